"""lm-eval on the local tasks at data_parallel_size=1 vs N (Ray replicas): wall time, scores, prefix hits.

    python -m minisgl_backend.bench.lm_eval_dp                         # minisgl_mc, 5-shot, dp 1 vs 2
    python -m minisgl_backend.bench.lm_eval_dp --num-fewshot 0 --dp 1,2,4 --tasks minisgl_mc,minisgl_gen

Each run is a fresh interpreter (start-up, Ray start and model load included in `wall s`; `eval s` is
lm_eval.simple_evaluate alone, `engine s` the time inside the adapter's engine calls), offline, fp32,
with `metrics_exact` so the prefix-cache counters are exact. The hit rate is prefix_hit_tokens /
prefix_query_tokens summed over the replicas. Prints a table and a JSON summary; `scores equal`
compares every task metric with the dp=1 run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from minisgl_backend.bench.lm_eval import OFFLINE, task_metrics

ROOT = Path(__file__).resolve().parents[2]  # the checkout: configs/tasks, adapters/


def worker(args: argparse.Namespace) -> None:
    t0 = time.perf_counter()
    import lm_eval
    import lm_eval.models  # noqa: F401 - its import registers `minisgl` (the adapter's .pth hook)
    from lm_eval.api.registry import get_model
    from lm_eval.tasks import TaskManager

    model_args = {"pretrained": args.model, "dtype": "float32", "metrics_exact": True, "stats_interval_s": 0}
    model_args.update(json.loads(args.model_args))
    lm = get_model("minisgl")(data_parallel_size=args.worker, **model_args)
    t_load = time.perf_counter()
    engine_s = [0.0]  # time inside the adapter's engine calls (lm-eval's own task set-up excluded)
    run = lm._run

    def timed_run(*a, **kw):
        t = time.perf_counter()
        try:
            return run(*a, **kw)
        finally:
            engine_s[0] += time.perf_counter() - t

    lm._run = timed_run
    results = lm_eval.simple_evaluate(
        model=lm,
        tasks=args.tasks.split(","),
        num_fewshot=args.num_fewshot,
        limit=args.limit,
        task_manager=TaskManager(include_path=str(ROOT / "configs" / "tasks")),
    )
    t_eval = time.perf_counter()
    m = lm.engine.metrics()
    lm.close()
    scores = task_metrics(results["results"])
    query, hit = m.get("prefix_query_tokens", 0), m.get("prefix_hit_tokens", 0)
    print(
        "RESULT "
        + json.dumps(
            {
                "load_s": round(t_load - t0, 2),
                "eval_s": round(t_eval - t_load, 2),
                "engine_s": round(engine_s[0], 2),
                "prefix_query_tokens": query,
                "prefix_hit_tokens": hit,
                "prefix_hit_rate": round(hit / query, 4) if query else None,
                "prefill_tokens": m.get("prefill_tokens"),
                "scores": scores,
            }
        )
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", default="minisgl_mc")
    ap.add_argument("--model", default="smollm2-135m-instruct", help="engine model reference")
    ap.add_argument("--dp", default="1,2", help="data_parallel_size values to run")
    ap.add_argument("--num-fewshot", type=int, default=5)
    ap.add_argument("--limit", type=float, default=None)
    ap.add_argument(
        "--model-args", default="{}", help="extra model_args as JSON, e.g. '{\"chunk_size\": 512}'"
    )
    ap.add_argument("--json", type=Path, default=None, help="also write the summary here")
    ap.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker is not None:
        return worker(args)
    env = {**os.environ, **OFFLINE}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "adapters"), env.get("PYTHONPATH", "")])
    runs: dict[int, dict] = {}
    for dp in (int(x) for x in args.dp.split(",")):
        cmd = [
            sys.executable,
            "-m",
            __spec__.name,
            "--worker",
            str(dp),
            "--tasks",
            args.tasks,
            "--model",
            args.model,
        ]
        cmd += ["--num-fewshot", str(args.num_fewshot), "--model-args", args.model_args]
        if args.limit:
            cmd += ["--limit", str(args.limit)]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
        if proc.returncode != 0 or line is None:
            raise SystemExit(f"dp={dp} failed:\n{proc.stderr[-4000:]}")
        runs[dp] = {"wall_s": round(wall, 2), **json.loads(line.removeprefix("RESULT "))}
    base = runs[min(runs)]
    print(
        f"{'dp':>3} {'wall s':>8} {'eval s':>8} {'engine s':>9} {'load s':>7} {'prefix hit rate':>16} "
        f"{'scores equal':>13}"
    )
    for dp, r in runs.items():
        r["scores_equal_to_dp1"] = r["scores"] == base["scores"]
        rate = "-" if r["prefix_hit_rate"] is None else f"{100 * r['prefix_hit_rate']:.1f}%"
        print(
            f"{dp:>3} {r['wall_s']:>8.1f} {r['eval_s']:>8.1f} {r['engine_s']:>9.1f} {r['load_s']:>7.1f} "
            f"{rate:>16} "
            f"{str(r['scores_equal_to_dp1']):>13}"
        )
    summary = {
        "model": args.model,
        "tasks": args.tasks,
        "num_fewshot": args.num_fewshot,
        "limit": args.limit,
        "cpus": os.cpu_count(),
        "runs": runs,
    }
    print(json.dumps(summary, indent=1))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
