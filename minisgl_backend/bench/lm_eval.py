"""Same lm_eval run, `--model hf` (and `--model vllm`) vs `--model minisgl`: wall time, metrics and
per-request parity.

    python -m minisgl_backend.bench.lm_eval                      # speed: minisgl_mc (600 requests), fp32
    python -m minisgl_backend.bench.lm_eval --tasks minisgl_mc,minisgl_gen,minisgl_ppl   # full parity
    python -m minisgl_backend.bench.lm_eval --hf-batch-sizes "" --variant prefix_cache=off  # cache gain
    python -m minisgl_backend.bench.lm_eval --shape llama-1b --dtype bfloat16 --num-fewshot 3 --limit 40 \
        --hf-batch-sizes 16     # the eval users run: a few-shot loglikelihood task on the 1B shape, bf16
    python -m minisgl_backend.bench.lm_eval --hf-batch-sizes "" --tasks minisgl_mc,minisgl_gen,minisgl_ppl \
        --variant deterministic=false --repeat 2        # the cost of the adapter's deterministic default
    python -m minisgl_backend.bench.lm_eval ... --vllm-python /path/to/venv/bin/python  # vLLM's CPU
        build beside them, from a venv of its own that has vLLM and lm-eval

Each run is the stock CLI in a fresh subprocess (start-up and model load included), offline, on the
same weights (the HF directory the engine resolves the model to). Prints a table and a JSON summary:
metrics per run, max |loglikelihood difference| per request, and whether greedy generations are identical.
Each run also reports its CPU time (user + system of the lm_eval process), steadier than the wall
time on a machine other jobs share. `--repeat N` runs every configuration N times, interleaved (the
order reversed every other time), and reports each peer's wall time over minisgl's within each
repetition as well: its median and range ("paired") are what to read on a machine shared with
other jobs, where the best runs of two engines can come from different spells of its load.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]  # the checkout: configs/tasks

# Every run reads the local caches only: timings without downloads, and no run on a changed dataset.
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
# vLLM's CPU build: its platform, a KV pool that fits beside the others, every CPU for its OpenMP team,
# no usage report (it is offline).
VLLM_CPU_ENV = {
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_CPU_KVCACHE_SPACE": "2",
    "VLLM_CPU_OMP_THREADS_BIND": f"0-{max(0, len(os.sched_getaffinity(0)) - 1)}"
    if hasattr(os, "sched_getaffinity")
    else "all",
    "VLLM_NO_USAGE_STATS": "1",
}


def task_metrics(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    """lm-eval's `results` section without its stderr entries and labels: task -> metric -> value."""
    return {
        task: {k: v for k, v in vals.items() if isinstance(v, (int, float)) and "stderr" not in k}
        for task, vals in results.items()
    }


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_lm_eval(
    model: str,
    model_args: str,
    tasks: str,
    out: Path,
    extra: list[str],
    python: str | None = None,
    env_extra: dict[str, str] | None = None,
) -> tuple[float, float, dict, dict]:
    """Returns (wall seconds, CPU seconds, metrics per task, {(task, doc_id, request index): response}).
    `python`: the interpreter of another venv whose lm_eval runs (a peer engine's)."""
    cmd = [
        str(Path(python or sys.executable).with_name("lm_eval")),
        "--model",
        model,
        "--model_args",
        model_args,
        "--include_path",
        "configs/tasks",
        "--tasks",
        tasks,
        "--device",
        "cpu",
        "--output_path",
        str(out),
        "--log_samples",
        *extra,
    ]
    env = {**os.environ, **OFFLINE, **(env_extra or {})}
    t0, cpu0 = time.perf_counter(), _children_cpu_s()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall, cpu = time.perf_counter() - t0, _children_cpu_s() - cpu0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-4000:]}")
    results = json.loads(next(out.rglob("results_*.json")).read_text())["results"]
    metrics = task_metrics(results)
    responses: dict = {}
    for f in out.rglob("samples_*.jsonl"):
        task = f.name.removeprefix("samples_").rsplit("_", 1)[0]
        for line in f.read_text().splitlines():
            s = json.loads(line)
            rolling = "bits_per_byte" in s.get("metrics", [])  # responses are strings: tell numbers from text
            for i, r in enumerate(s["resps"]):
                responses[(task, s["doc_id"], i)] = float(r[0]) if rolling else r[0]
    return wall, cpu, metrics, responses


def round_order(names: list[str], rep: int) -> list[str]:
    """The order the configurations run in repetition `rep`: reversed every other one, so that no
    configuration always runs first (on a cold machine) or right after the same one."""
    return names if rep % 2 == 0 else names[::-1]


def paired_ratios(base: list[float], other: list[float]) -> dict[str, Any]:
    """`other`'s wall time over minisgl's within each repetition (the two ran minutes apart at most,
    where the best of each may come from different spells of a shared machine): median and range."""
    ratios = [o / b for b, o in zip(base, other, strict=True)]
    return {
        "median": round(statistics.median(ratios), 2),
        "range": [round(min(ratios), 2), round(max(ratios), 2)],
    }


def compare(a: dict, b: dict) -> dict:
    max_ll, gen_total, gen_diff, greedy_diff = 0.0, 0, [], 0
    for key, ra in a.items():
        rb = b[key]
        if isinstance(ra, str):  # generate_until (loglikelihood_rolling arrives as a float)
            gen_total += 1
            if ra != rb:
                gen_diff.append({"request": list(key), "hf": ra, "minisgl": rb})
        elif isinstance(ra, list):  # loglikelihood: [logprob, is_greedy]
            max_ll = max(max_ll, abs(float(ra[0]) - float(rb[0])))
            greedy_diff += str(ra[1]) != str(rb[1])
        else:  # loglikelihood_rolling: a number
            max_ll = max(max_ll, abs(float(ra) - float(rb)))
    return {
        "requests": len(a),
        "max_abs_loglikelihood_diff": max_ll,
        "is_greedy_mismatches": greedy_diff,
        "generations": gen_total,
        "generation_mismatches": gen_diff,
    }


def metrics_match(a: dict, b: dict, rel: float = 1e-4) -> bool:
    """Equal metrics: the same keys, values equal up to float noise (perplexities sum ~1e2 logprobs)."""
    if a.keys() != b.keys() or any(a[t].keys() != b[t].keys() for t in a):
        return False
    return all(abs(a[t][k] - b[t][k]) <= rel * max(1.0, abs(b[t][k])) for t in a for k in a[t])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", default="minisgl_mc")
    ap.add_argument("--model", default="smollm2-135m-instruct", help="engine model reference")
    ap.add_argument(
        "--shape",
        choices=["llama-1b"],
        help="instead of --model: the random-weight Llama-3.2-1B shape (written once into the model cache)",
    )
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="both engines' dtype")
    ap.add_argument("--hf-batch-sizes", default="1,16", help="hf runs to time (lm-eval's default is 1)")
    ap.add_argument("--minisgl-args", default="", help="extra model_args for minisgl, e.g. chunk_size=512")
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="K=V[,K=V]",
        help="also run minisgl with these extra model_args (repeatable), e.g. prefix_cache=off",
    )
    ap.add_argument(
        "--vllm-python",
        default=None,
        help="also run `--model vllm` with this interpreter's venv (vLLM's CPU build and lm-eval in it)",
    )
    ap.add_argument(
        "--vllm-args",
        default="max_model_len=4096",
        help="extra model_args for vllm (its KV pool must hold max_model_len: the 1B shape's is 128k)",
    )
    ap.add_argument("--limit", type=float, default=None)
    ap.add_argument(
        "--num-fewshot", type=int, default=None, help="lm-eval --num_fewshot (longer shared contexts)"
    )
    ap.add_argument(
        "--repeat", type=int, default=1, help="run every configuration this many times, interleaved"
    )
    ap.add_argument("--json", type=Path, default=None, help="also write the summary here")
    args = ap.parse_args()

    from minisgl_backend.model.loader import resolve_model_dir

    if args.shape:
        from minisgl_backend.tools.tiny import cached_random_llama

        path = cached_random_llama(args.shape)
        args.model = str(path)
    hf_dir = resolve_model_dir(args.model)
    extra = ["--limit", str(args.limit)] if args.limit else []
    if args.num_fewshot is not None:
        extra += ["--num_fewshot", str(args.num_fewshot)]
    mini_args = f"pretrained={args.model},dtype={args.dtype}" + (
        f",{args.minisgl_args}" if args.minisgl_args else ""
    )
    # name -> (lm-eval model, model_args, more CLI arguments, interpreter, environment)
    Config = tuple[str, str, list[str], str | None, dict[str, str] | None]
    configs: dict[str, Config] = {"minisgl": ("minisgl", mini_args, [], None, None)}
    configs.update({f"minisgl {v}": ("minisgl", f"{mini_args},{v}", [], None, None) for v in args.variant})
    for bs in filter(None, args.hf_batch_sizes.split(",")):
        hf_args = f"pretrained={hf_dir},dtype={args.dtype}"
        configs[f"hf bs={bs}"] = ("hf", hf_args, ["--batch_size", bs], None, None)
    if args.vllm_python:
        vllm_args = f"pretrained={hf_dir},dtype={args.dtype}" + (
            f",{args.vllm_args}" if args.vllm_args else ""
        )
        configs["vllm"] = ("vllm", vllm_args, [], args.vllm_python, VLLM_CPU_ENV)
    runs: dict[str, list[tuple[float, float, dict, dict]]] = {name: [] for name in configs}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeat):  # interleaved, so a slow spell of the machine hits every config
            for i, name in enumerate(round_order(list(configs), rep)):
                model, model_args, more, python, env = configs[name]
                out = Path(tmp, f"run{rep}-{i}")
                runs[name].append(run_lm_eval(model, model_args, args.tasks, out, extra + more, python, env))
    base_wall = min(r[0] for r in runs["minisgl"])
    base_cpu = min(r[1] for r in runs["minisgl"])
    _, _, base_metrics, base_resp = runs["minisgl"][0]
    summary = {
        "model": args.model,
        "dtype": args.dtype,
        "tasks": args.tasks,
        "limit": args.limit,
        "num_fewshot": args.num_fewshot,
        "runs": {},
    }
    width = max(map(len, runs)) + 1
    print(
        f"{'run (best of repeats)':<{width}} {'wall s':>8} {'cpu s':>8} {'wall / minisgl':>15} "
        f"{'paired (range)':>20}  metrics"
    )
    for name, reps in runs.items():
        wall, cpu = min(r[0] for r in reps), min(r[1] for r in reps)
        metrics, resp = reps[0][2], reps[0][3]
        entry = {
            "wall_s": [round(r[0], 2) for r in reps],
            "cpu_s": [round(r[1], 2) for r in reps],
            "metrics": metrics,
            "repeats_identical": all(r[2] == metrics and r[3] == resp for r in reps),
        }
        if name != "minisgl":
            entry["speedup_of_minisgl"] = round(wall / base_wall, 2)
            pr = paired_ratios([r[0] for r in runs["minisgl"]], [r[0] for r in reps])
            entry["speedup_paired"] = pr
            entry["cpu_ratio_to_minisgl"] = round(cpu / base_cpu, 2)
            entry["metrics_equal"] = metrics_match(metrics, base_metrics)
            entry["parity"] = compare(resp, base_resp)
        summary["runs"][name] = entry
        flat = ", ".join(f"{t}.{k}={v:.4g}" for t, m in metrics.items() for k, v in m.items())
        speed, paired = "-", "-"
        if name != "minisgl":
            speed = f"{wall / base_wall:.2f}x"
            paired = f"{pr['median']:.2f}x ({pr['range'][0]:.2f}-{pr['range'][1]:.2f})"
        print(f"{name:<{width}} {wall:>8.1f} {cpu:>8.1f} {speed:>15} {paired:>20}  {flat}")
    print(json.dumps(summary, indent=1))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
