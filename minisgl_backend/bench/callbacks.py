"""Microbenchmark of the completion path: the Python tracker vs the native extension (what Python
completion callbacks cost a pipeline whose other threads need the GIL).

  python -m minisgl_backend.bench.callbacks [--completions 100000] [--work-items 3000] [--matrix 96]

Rows, per implementation:
- complete() only: the raw call from one thread, nobody waiting.
- cross-thread: a worker thread calls begin()+complete(i) N times while the main thread sits in wait() and
  drains in bulk -- the shape of a completion callback feeding the scheduler loop.
- producer it/s: a worker doing GIL-releasing numpy matmuls (a stand-in for kernel launches / copies) and
  completing one id per item, while the main thread waits; compared with the same producer alone.
"""

from __future__ import annotations

import argparse
import threading
import time
from collections.abc import Callable

import numpy as np

from minisgl_backend.executor.tracker import InflightTracker, make_tracker, native_available


def complete_only(make: Callable[[int], InflightTracker], n: int) -> float:
    t = make(n)
    for _ in range(n):
        t.begin()
    start = time.perf_counter()
    for i in range(n):
        t.complete(i)
    elapsed = time.perf_counter() - start
    assert len(t.drain()) == n
    return elapsed / n * 1e9


def consume(t: InflightTracker, n: int) -> int:
    """Main-thread side: wait + bulk drain until n ids arrived; returns the number of non-empty batches."""
    got = batches = 0
    while got < n:
        ids = t.wait(1.0)
        if ids:
            got += len(ids)
            batches += 1
    return batches


def cross_thread(make: Callable[[int], InflightTracker], n: int) -> tuple[float, int]:
    t = make(n)

    def worker() -> None:
        for i in range(n):
            t.begin()
            t.complete(i)

    th = threading.Thread(target=worker)
    start = time.perf_counter()
    th.start()
    batches = consume(t, n)
    elapsed = time.perf_counter() - start
    th.join()
    assert t.inflight == 0
    return elapsed / n * 1e9, batches


def producer(t: InflightTracker | None, items: int, a: np.ndarray) -> None:
    for i in range(items):
        np.dot(a, a)  # releases the GIL inside BLAS
        if t is not None:
            t.begin()
            t.complete(i)


def producer_rate(make: Callable[[int], InflightTracker] | None, items: int, a: np.ndarray) -> float:
    t = make(items) if make is not None else None
    th = threading.Thread(target=producer, args=(t, items, a))
    start = time.perf_counter()
    th.start()
    if t is not None:
        consume(t, items)
    th.join()
    return items / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--completions", type=int, default=100_000)
    ap.add_argument("--work-items", type=int, default=3_000)
    ap.add_argument("--matrix", type=int, default=96, help="side of the square matmul per producer item")
    args = ap.parse_args()

    impls = ["python"] + (["native"] if native_available() else [])
    if not native_available():
        print("NOTE: minisgl_backend.native._native is not built; only the Python tracker is measured.")
    a = np.random.default_rng(0).standard_normal((args.matrix, args.matrix)).astype(np.float32)
    producer_rate(None, min(200, args.work_items), a)  # warm BLAS
    alone = producer_rate(None, args.work_items, a)

    rows = []
    for impl in impls:
        make = lambda m, impl=impl: make_tracker(impl, m)  # noqa: E731
        only = complete_only(make, args.completions)
        xt, batches = cross_thread(make, args.completions)
        rate = producer_rate(make, args.work_items, a)
        rows.append((impl, only, xt, args.completions / batches, rate))

    print(
        f"completions={args.completions:,}  producer items={args.work_items:,} "
        f"({args.matrix}x{args.matrix} matmul)"
    )
    print(f"producer alone (no tracker): {alone:,.0f} it/s")
    head = ("impl", "complete() ns", "cross-thread ns/id", "ids per wake", "producer it/s", "vs alone")
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join("---" for _ in head) + "|")
    for impl, only, xt, per_batch, rate in rows:
        print(f"| {impl} | {only:,.0f} | {xt:,.0f} | {per_batch:,.1f} | {rate:,.0f} | {rate / alone:.2f}x |")


if __name__ == "__main__":
    main()
