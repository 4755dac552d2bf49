#!/usr/bin/env bash
# The GPU check: one call that measures the CUDA back-end, in stages that never stop each other.
#
#   scripts/gpu_check.sh              every stage in order (env tracker tests forward model overlap stress)
#   scripts/gpu_check.sh STAGE...     only those stages (e.g. `overlap` again after a fix)
#   scripts/gpu_check.sh carry        on the machine that sends the call: write the tokenizer files the
#                                     device needs into .gpu_carry/tokenizer (carry `.gpu_carry`)
#
# Stages (each under `timeout`; a failed or timed-out stage is recorded and the next one runs):
#   env      torch, CUDA, triton, the GPU
#   tracker  the native completion tracker for this Python (one compiler line; the CPU kernels are
#            not rebuilt: the GPU never runs them, and without them the CPU falls back to torch)
#   tests    the CUDA tests, the tracker's, the Triton attention kernels' and the logits reduction's
#            (on the GPU itself)
#   forward  decode-step and prefill-chunk micro-numbers on random 1B and 8B shapes, batch 1/16/64,
#            Triton kernels vs the torch path (time, host issue time, kernels per forward, logit diff),
#            and each decode case again as a CUDA-graph replay (cuda_graphs; eager buckets on the CPU)
#   model    a random-weight ~1.2B Llama directory in the scratch dir (the next stage's model)
#   overlap  the design's table on it: serial, overlap with chunks 128 and 768, one in flight, Python
#            callbacks, a sampled row and (on a GPU) a CUDA-graph row (req/s, TTFT/TPOT p50/p99), with
#            a timeline
#   stress   block lifetimes under overlap (fenced reclaim: 0 mismatches and every block FREE; the
#            unsafe debug switch: mismatches found) and serial vs overlap tokens and logprobs
#
# Outputs: at most 8 small files in $OUT (check.log, summary.txt, tests.log, forward.json,
# overlap_table.json, trace.json, utilisation.png, stress.json); big ones (the models) in $SCRATCH.
#
# Environment:
#   OUT=./gpu_out               small outputs          SCRATCH=/tmp/minisgl_gpu_check  big ones
#   PYTHON=python3              interpreter (torch with CUDA, transformers, pytest; triton for the kernels)
#   MINISGL_TOKENIZER=DIR       SmolLM2 tokenizer files (default: .gpu_carry/tokenizer, from `carry`)
#   GPU_CHECK_SMALL=1           every stage on the CPU with tiny shapes (kernels under Triton's
#                               interpreter): tests the script itself, in a few minutes
#   T_<STAGE>=SECONDS           a stage's time limit (defaults below)
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
OUT=${OUT:-./gpu_out}
SCRATCH=${SCRATCH:-/tmp/minisgl_gpu_check}
mkdir -p "$OUT" "$SCRATCH"
OUT=$(cd "$OUT" && pwd)
PY=${PYTHON:-python3}
export PYTHONPATH="$ROOT:$ROOT/adapters${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
TOKENIZER=${MINISGL_TOKENIZER:-$ROOT/.gpu_carry/tokenizer}
SMALL=${GPU_CHECK_SMALL:-0}
if [[ "$SMALL" == 1 ]]; then
  DEVICE=cpu; DTYPE=float32; SHAPE=tiny; FWD_SHAPES=tiny; BATCHES=1,4; CTX=40; CHUNK=24; STEPS=2
  NREQ=8; OUTLEN=4; CONC=4; KV_GB=${KV_GB:-0.25}; CHUNKS=16,64; STRESS_N=400
  # The kernels run under Triton's interpreter on the CPU; the engine's attention stays the CPU's.
  export TRITON_INTERPRET=1
  : "${T_ENV:=60}" "${T_TRACKER:=60}" "${T_TESTS:=150}" "${T_FORWARD:=90}" "${T_MODEL:=60}" "${T_OVERLAP:=150}"
  : "${T_STRESS:=150}"
else
  DEVICE=cuda; DTYPE=bfloat16; SHAPE=1b; FWD_SHAPES=1b,8b; BATCHES=1,16,64; CTX=512; CHUNK=768; STEPS=10
  NREQ=96; OUTLEN=64; CONC=16; KV_GB=${KV_GB:-8}; CHUNKS=128,768; STRESS_N=200
  # 595 s in all, inside one device call's limit; each about twice what an H200 took.
  : "${T_ENV:=20}" "${T_TRACKER:=40}" "${T_TESTS:=110}" "${T_FORWARD:=75}" "${T_MODEL:=60}" "${T_OVERLAP:=180}"
  : "${T_STRESS:=110}"
fi
MODEL_DIR="$SCRATCH/model-$SHAPE"
LOG="$OUT/check.log"
SUMMARY="$OUT/summary.txt"

stage_env() {
  "$PY" - <<'PY'
import importlib.util, platform, torch
print(f"python {platform.python_version()}, torch {torch.__version__}, CUDA {torch.version.cuda}")
print(f"CUDA available: {torch.cuda.is_available()}",
      f"({torch.cuda.get_device_name(0)}, {torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB)"
      if torch.cuda.is_available() else "")
if importlib.util.find_spec("triton"):
    import triton
    print(f"triton {triton.__version__}")
else:
    print("triton: not installed (the CUDA attention then runs the torch path)")
PY
}

stage_tracker() {
  local suffix inc dest=""
  if ! "$PY" -c "import minisgl_backend.native._native" 2>/dev/null; then
    dest=minisgl_backend/native
  else
    echo "native tracker: already importable"
    # The small run still compiles it (into the scratch dir), so that the compiler line is tested.
    if [[ "$SMALL" == 1 ]]; then dest=$SCRATCH; fi
  fi
  if [[ -n "$dest" ]]; then
    # Only the tracker: one file, one compiler line (the CPU kernels' 15 files are not needed here).
    suffix=$("$PY" -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")
    # pybind11's headers: from the interpreter's pybind11, else the copy the carry stage made (the
    # device machine reaches no package index; pybind11 is a build requirement, not a runtime one).
    if ! inc=$("$PY" -m pybind11 --includes 2>/dev/null); then
      [[ -d "$ROOT/.gpu_carry/pybind11" ]] || { echo "no pybind11: pip install pybind11, or run the carry stage"; return 1; }
      inc="-I$ROOT/.gpu_carry/pybind11 $("$PY" -c "import sysconfig; print('-I' + sysconfig.get_paths()['include'])")"
    fi
    # shellcheck disable=SC2086  # $inc is a list of -I flags
    c++ -O2 -std=c++17 -shared -fPIC -fvisibility=hidden $inc csrc/inflight_tracker.cpp \
      -o "$dest/_native$suffix" -ldl || return 1
    echo "built $dest/_native$suffix"
  fi
  "$PY" -c "from minisgl_backend.executor.tracker import native_available as n; print('native tracker:', n()); assert n()"
}

stage_tests() {
  # The tests' tiny model takes its tokenizer from there too (the embedded model cannot travel).
  if [[ -f "$TOKENIZER/tokenizer.json" ]]; then export MINISGL_TOKENIZER="$TOKENIZER"; fi
  "$PY" -m pytest -q -rs -p no:cacheprovider tests/kernels/test_cuda.py tests/engine/test_tracker.py \
    tests/kernels/test_triton_attention.py tests/engine/test_sampler_reduce.py 2>&1 | tee "$OUT/tests.log"
}

stage_forward() {
  "$PY" -m minisgl_backend.bench.gpu_check forward --shapes "$FWD_SHAPES" --batches "$BATCHES" \
    --ctx "$CTX" --chunk "$CHUNK" --steps "$STEPS" --device "$DEVICE" --dtype "$DTYPE" --json "$OUT/forward.json"
}

stage_model() {
  if [[ ! -f "$TOKENIZER/tokenizer.json" ]]; then
    echo "no tokenizer files in $TOKENIZER: run \`scripts/gpu_check.sh carry\` where the embedded model is" \
      "installed and carry .gpu_carry, or set MINISGL_TOKENIZER=DIR"
    return 1
  fi
  "$PY" -m minisgl_backend.tools.tiny "$MODEL_DIR" --shape "$SHAPE" --dtype "$DTYPE" --tokenizer "$TOKENIZER"
}

stage_overlap() {
  [[ -f "$MODEL_DIR/config.json" ]] || stage_model || return 1
  # The engine's own choice of attention: the Triton kernels on a GPU, the CPU kernels on the CPU.
  "$PY" -m minisgl_backend.bench.gpu_check overlap --model "$MODEL_DIR" \
    --device "$DEVICE" --dtype "$DTYPE" --kv-gb "$KV_GB" --chunks "$CHUNKS" --num-requests "$NREQ" \
    --output-len "$OUTLEN" --concurrency "$CONC" --json "$OUT/overlap_table.json" \
    --trace "$OUT/trace.json" --plot "$OUT/utilisation.png"
}

stage_stress() {
  local tok=()
  if [[ -f "$TOKENIZER/tokenizer.json" ]]; then tok=(--tokenizer "$TOKENIZER"); fi
  "$PY" -m minisgl_backend.bench.gpu_check stress --model "$SCRATCH/tiny-llama" "${tok[@]}" \
    --requests "$STRESS_N" --device "$DEVICE" --json "$OUT/stress.json"
}

stage_carry() {
  mkdir -p "$ROOT/.gpu_carry"
  "$PY" - "$ROOT/.gpu_carry/tokenizer" <<'PY'
import sys
from transformers import AutoTokenizer
from minisgl_backend.model.loader import resolve_model_dir
AutoTokenizer.from_pretrained(resolve_model_dir("smollm2-135m-instruct")).save_pretrained(sys.argv[1])
print("tokenizer files in", sys.argv[1])
PY
  # pybind11's headers, for the tracker stage where the device's Python has no pybind11
  if inc=$("$PY" -c "import pybind11; print(pybind11.get_include())" 2>/dev/null); then
    rm -rf "$ROOT/.gpu_carry/pybind11" && cp -r "$inc" "$ROOT/.gpu_carry/pybind11"
  fi
  du -sh "$ROOT/.gpu_carry"
}

run_stage() {  # run_stage NAME: under its time limit; the outcome goes to the summary, never stops us
  local name=$1 limit var t0 rc
  var="T_${name^^}"
  limit=${!var:-120}
  t0=$SECONDS
  echo; echo "=== $name (limit ${limit}s) ==="
  # A stage runs in a child shell of this script (functions exported), so `timeout` can stop it whole.
  timeout --kill-after=10 "$limit" bash -o pipefail -c "stage_$name" 2>&1
  rc=$?
  local what=ok
  if [[ $rc == 124 || $rc == 137 ]]; then what="TIMED OUT"; elif [[ $rc != 0 ]]; then what="FAILED (rc $rc)"; fi
  printf '%-8s %-16s %4ds\n' "$name" "$what" $((SECONDS - t0)) | tee -a "$SUMMARY"
  return 0
}

export -f stage_env stage_tracker stage_tests stage_forward stage_model stage_overlap stage_stress stage_carry
export T_ENV T_TRACKER T_TESTS T_FORWARD T_MODEL T_OVERLAP T_STRESS
export SMALL ROOT OUT SCRATCH PY TOKENIZER DEVICE DTYPE SHAPE FWD_SHAPES BATCHES CTX CHUNK STEPS NREQ OUTLEN CONC \
  KV_GB CHUNKS MODEL_DIR STRESS_N

STAGES=("$@")
if [[ ${#STAGES[@]} == 0 ]]; then
  STAGES=(env tracker tests forward model overlap stress)
  if [[ "$SMALL" == 1 && ! -f "$TOKENIZER/tokenizer.json" ]]; then STAGES=(carry "${STAGES[@]}"); fi
  : >"$SUMMARY"
fi
for s in "${STAGES[@]}"; do
  if ! declare -F "stage_$s" >/dev/null; then
    echo "unknown stage '$s' (env tracker tests forward model overlap stress carry)" >&2
    exit 2
  fi
done
START=$SECONDS
{
  echo "gpu_check: stages ${STAGES[*]}; small=$SMALL device=$DEVICE out=$OUT scratch=$SCRATCH"
  for s in "${STAGES[@]}"; do run_stage "$s"; done
  echo; echo "=== done in $((SECONDS - START))s ==="
  cat "$SUMMARY"
  ls -l "$OUT"
  n=$(find "$OUT" -maxdepth 1 -type f | wc -l)
  big=$(find "$OUT" -maxdepth 1 -type f -size +16M | wc -l)
  if ((n > 8 || big > 0)); then echo "WARNING: $n files in $OUT ($big over 16 MiB): more than comes back"; fi
} 2>&1 | tee -a "$LOG"
