"""Micro-benchmark of one bf16 linear: the packed kernel and the few-row kernel against oneDNN.

    python -m minisgl_backend.bench.linear [--n 3072] [--k 576] [--rows 1 4 8 32 512] [--threads 1]
    python -m minisgl_backend.bench.linear --stream [--threads 2]
    python -m minisgl_backend.bench.linear --tile-roof [--threads 2]

Prints one JSON line per row count with GFLOP/s (2 * rows * n * k per call; at one row that is
also GB/s of weights), best of 5 by the calling thread's CPU time at one thread (robust on a shared
machine) and by wall time otherwise. The packed kernel is the process's kernel family's (`amx` or
`avx512bf16`; MINISGL_KERNELS picks a lower one); its column is named after the family. The few-row
kernel (up to 4 rows; any number under avx2) is the family's width: `avx512_few_rows`, or
`avx2_few_rows` under avx2.
--stream instead times one decode step's worth of SmolLM2's linears (121 distinct weights, ~270 MB,
so they come from L3/memory as in the model) at each row count, on the packed kernel, or where the
family packs nothing on Linear.forward's choice (the few-row kernel up to 4 rows, oneDNN beyond;
the avx2 kernel at every row count; oneDNN alone under the torch family): the figure behind
docs/performance.md's weight-stream numbers.
--tile-roof (amx family) instead prints the tile unit's sustained TFLOP/s (cpu_kernels.tile_tflops)
on zeros and on random bf16 values, its tiles kept loaded and loaded every round from L1 and from L2:
the ceilings the packed linear's GFLOP/s is read against. Loaded tiles of nonzero values cost the
unit more than zeros, so the nominal figure (zeros, kept) overstates what a GEMM can reach.
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from minisgl_backend.model import cpu_kernels

SMOLLM2_LAYER = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate_up, down
SMOLLM2_LAYERS, SMOLLM2_VOCAB = 30, 49152


def stream_step(xs: dict, shapes: list, weights: list, packed: bool) -> None:
    for (n, k), w in zip(shapes, weights):
        if packed:
            cpu_kernels.linear_packed(xs[k], w, (n, k))
        else:
            cpu_kernels.linear(xs[k], w)


def _pack(w: torch.Tensor) -> torch.Tensor:
    packed = cpu_kernels.pack(w)
    assert packed is not None, "packs is set only where the packed kernels run"
    return packed


def best_of(fn, clock) -> float:
    fn()
    best = float("inf")
    for _ in range(5):
        t, reps = clock(), 0
        while True:
            fn()
            reps += 1
            if clock() - t > 0.1:
                break
        best = min(best, (clock() - t) / reps)
    return best


Clock = Callable[[], float]


def kernel_bench_args(ap: argparse.ArgumentParser) -> tuple[argparse.Namespace, Clock, torch.dtype]:
    """The shared start of the attention and row-wise kernel benchmarks: adds --threads (1) and
    --dtype (bfloat16) to `ap`, parses, stops unless the native kernels run, sets torch's threads.
    Returns (args, clock, dtype); the clock is the calling thread's CPU time at one thread (robust on
    a shared machine), wall time otherwise."""
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    a = ap.parse_args()
    if not cpu_kernels.available():
        raise SystemExit("the native kernels do not run here (not built, MINISGL_CPU_KERNELS=0 or no AVX2)")
    torch.set_num_threads(a.threads)
    return a, time.thread_time if a.threads == 1 else time.perf_counter, getattr(torch, a.dtype)


def tile_roof(threads: int) -> None:
    """The tile unit's TFLOP/s, best of 3, on zeros and on random bf16 values: its tiles kept loaded,
    and loaded every round from 32 KB (L1) and from 512 KB (L2), as a GEMM loads them."""
    if not cpu_kernels.amx_available():
        raise SystemExit(f"kernel family {cpu_kernels.family()} has no tile unit (the amx family's)")
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    rates: dict[str, dict[str, float]] = {}
    for values in ("zeros", "random"):
        for where, kb in (("kept", 4), ("from_l1", 32), ("from_l2", 512)):
            n = kb * 512  # bf16 values in kb KB
            x = torch.randn(n, generator=g).bfloat16() if values == "random" else torch.zeros(n).bfloat16()
            best = max(cpu_kernels.tile_tflops(x, load=where != "kept") or 0.0 for _ in range(3))
            rates.setdefault(values, {})[where] = round(best, 3)
    print(json.dumps({"tile_unit_tflop_per_s": rates, "threads": threads}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=3072)
    ap.add_argument("--k", type=int, default=576)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 32, 512])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--stream", action="store_true")
    ap.add_argument("--tile-roof", action="store_true")
    a = ap.parse_args()
    if a.tile_roof:
        return tile_roof(a.threads)
    if not (cpu_kernels.available() or a.stream):
        raise SystemExit(
            f"kernel family {cpu_kernels.family()} runs no native linear (not built, no AVX2, or "
            "MINISGL_KERNELS=torch / MINISGL_CPU_KERNELS=0): nothing to compare"
        )
    torch.set_num_threads(a.threads)
    packs = cpu_kernels.packs()
    clock = time.thread_time if a.threads == 1 else time.perf_counter
    g = torch.Generator().manual_seed(0)
    if a.stream:
        shapes = SMOLLM2_LAYER * SMOLLM2_LAYERS + [(SMOLLM2_VOCAB, 576)]
        weights = [(torch.randn(n, k, generator=g) * 0.05).bfloat16() for n, k in shapes]
        if packs:
            weights = [_pack(w) for w in weights]
        for m in a.rows:
            xs = {k: torch.randn(m, k, generator=g).bfloat16() for k in {k for _, k in shapes}}
            ms = best_of(functools.partial(stream_step, xs, shapes, weights, packs), clock) * 1e3
            out = {"family": cpu_kernels.family(), "rows": m, "threads": a.threads, "linears": len(shapes)}
            print(json.dumps(out | {"step_ms": round(ms, 2)}))
        return
    w = (torch.randn(a.n, a.k, generator=g) * 0.05).bfloat16()
    packed = cpu_kernels.pack(w)
    few_rows = ("avx2" if cpu_kernels.isa() == cpu_kernels.ISA_AVX2 else "avx512") + "_few_rows"
    for m in a.rows:
        x = torch.randn(m, a.k, generator=g).bfloat16()
        fns: dict[str, Callable[[], object]] = {"onednn": functools.partial(F.linear, x, w)}
        if packs and packed is not None:
            fns[cpu_kernels.family()] = functools.partial(cpu_kernels.linear_packed, x, packed, (a.n, a.k))
        if cpu_kernels.kernel_row_limit() is None or m <= cpu_kernels.MAX_KERNEL_ROWS:
            fns[few_rows] = functools.partial(cpu_kernels.linear, x, w)
        flops = 2 * m * a.n * a.k
        row = {name: round(flops / best_of(fn, clock) / 1e9, 1) for name, fn in fns.items()}
        print(json.dumps({"n": a.n, "k": a.k, "rows": m, "threads": a.threads, "gflop_per_s": row}))


if __name__ == "__main__":
    main()
