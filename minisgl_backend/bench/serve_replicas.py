"""Serving throughput of `minisgl serve` at 1 vs N replicas, measured with `minisgl bench-serve`.

    python -m minisgl_backend.bench.serve_replicas                    # SmolLM2 bf16, the four servers below
    python -m minisgl_backend.bench.serve_replicas --tiny --num-requests 400 --concurrency 32

Each server is a fresh `minisgl serve` process on a free port (stopped with SIGTERM after its run):
  single, all cores      the in-process server (torch threads = cores)
  single, 1 thread       the in-process server with num_threads=1 (what one replica of two gets)
  ray, 1 replica         `--replicas 1 --ray-address local`: the Ray Serve path with one replica
                         (all cores), so the Ray overhead shows apart from the replica count
  ray, 1 replica, 1/N    the same with num_threads=cores // N (compare with "single, 1/N")
  ray, N replicas        `--replicas N`: cores // N threads each
The client is `minisgl bench-serve --url` (same prompts, same seed for every server). Prints a
markdown table and writes the rows as JSON (`--json`).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]  # the checkout: adapters/ for the servers


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(name: str, serve_args: list[str], bench_args: list[str], env: dict[str, str]) -> dict:
    port = _free_port()
    cmd = [sys.executable, "-m", "minisgl_backend.cli", "serve", "--port", str(port), *serve_args]
    print(f"== {name}: {' '.join(cmd[2:])}", flush=True)
    t0 = time.perf_counter()
    log = tempfile.TemporaryFile("w+")  # a file, not a pipe: a full pipe would stall the server
    server = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, text=True)
    try:
        while True:
            if server.poll() is not None:
                log.seek(0)
                raise RuntimeError(f"{name}: the server exited: {log.read()[-3000:]}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        started = time.perf_counter() - t0
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            bench = [
                sys.executable,
                "-m",
                "minisgl_backend.cli",
                "bench-serve",
                "--url",
                f"http://127.0.0.1:{port}",
            ]
            subprocess.run([*bench, *bench_args, "--json", out.name], env=env, cwd=ROOT, check=True)
            row = json.loads(Path(out.name).read_text())
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=120)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()
    row.update(server=name, start_s=started)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="the tiny random model instead of SmolLM2 bf16")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--cores", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--input-len", type=int, default=100)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--only", help="comma-separated subset: single,single1,ray1,ray1t,rayN")
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args()

    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "adapters"), env.get("PYTHONPATH", "")])
    if args.tiny:
        from minisgl_backend.tools.tiny import make_tiny_llama

        model = ["--model", str(make_tiny_llama())]
    else:
        model = ["--dtype", "bfloat16"]
    common = [*model, "--set", "stats_interval_s=0", "--log-level", "warning"]
    bench = [
        *("--num-requests", str(args.num_requests), "--num-prompts", str(args.num_requests)),
        *("--concurrency", str(args.concurrency), "--input-len", str(args.input_len)),
        *("--output-len", str(args.output_len)),
    ]
    n, per = args.replicas, max(1, args.cores // args.replicas)
    servers = {
        "single": (f"single, {args.cores} threads", [*common, "--set", f"num_threads={args.cores}"]),
        "single1": (f"single, {per} thread(s)", [*common, "--set", f"num_threads={per}"]),
        "ray1": (
            f"ray, 1 replica x {args.cores} threads",
            [*common, "--replicas", "1", "--ray-address", "local"],
        ),
        "ray1t": (
            f"ray, 1 replica x {per} thread(s)",
            [*common, "--replicas", "1", "--ray-address", "local", "--set", f"num_threads={per}"],
        ),
        "rayN": (f"ray, {n} replicas x {per} thread(s)", [*common, "--replicas", str(n)]),
    }
    chosen = args.only.split(",") if args.only else list(servers)
    rows = [_run(*servers[key], bench, env) for key in chosen]
    print("\n| server | start s | completed | req/s | output tok/s | TTFT mean / p99 ms | TPOT mean ms |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['server']} | {r['start_s']:.0f} | {r['completed']} | {r['req_per_s']:.2f} | "
            f"{r['output_tok_per_s']:.1f} | {r['ttft_mean_ms']:.0f} / {r['ttft_p99_ms']:.0f} | "
            f"{r['tpot_mean_ms']:.1f} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
