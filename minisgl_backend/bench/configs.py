"""`minisgl bench --scenario overlap-table|prefix` and `--sweep`: one closed-loop workload under each of
several engine configs, one engine at a time (optionally with each run's timeline for --trace/--plot)."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from typing import Any

from minisgl_backend.bench.measure import summarize
from minisgl_backend.config import EngineConfig
from minisgl_backend.engine import Engine
from minisgl_backend.types import RequestOutput, SamplingParams

# `--scenario overlap-table`: what overlap scheduling and chunked prefill buy over the serial loop, as
# plain config overrides. A chunk too small pays a planning round and a forward pass per few tokens; a
# moderate one lets long prefills interleave with decode; one iteration in flight (max_inflight 1)
# keeps chunking but makes the scheduler wait for every forward pass, so nothing overlaps.
OVERLAP_TABLE: dict[str, dict[str, Any]] = {
    "serial, no chunking": {"overlap": False, "chunk_size": None, "mixed_batches": False, "max_inflight": 1},
    "overlap, chunk too small": {"overlap": True, "chunk_size": 32, "mixed_batches": True, "max_inflight": 4},
    "overlap, moderate chunk": {"overlap": True, "chunk_size": 256, "mixed_batches": True, "max_inflight": 4},
    "overlap, over-synchronised": {
        "overlap": True,
        "chunk_size": 256,
        "mixed_batches": True,
        "max_inflight": 1,
    },
}


def mixed_prompts(
    n: int, vocab: int, short: int = 64, long: int = 768, long_every: int = 4, seed: int = 0
) -> list[list[int]]:
    """Mostly short prompts with a long one every `long_every`: long prefills arrive while others decode."""
    rng = random.Random(seed)
    return [
        [rng.randrange(100, vocab - 1) for _ in range(long if i % long_every == long_every - 1 else short)]
        for i in range(n)
    ]


# The prefix-cache scenario: every mode on one shared-prefix workload, in one run.
PREFIX_TABLE: dict[str, dict[str, Any]] = {
    f"prefix_cache={m}": {"prefix_cache": m} for m in ("off", "sync", "async")
}


def shared_prefix_prompts(
    n: int, vocab: int, num_stems: int = 4, stem_len: int = 512, tail_len: int = 32, seed: int = 0
) -> list[list[int]]:
    """Few-shot shape: each prompt is one of a few long shared stems plus its own short question."""
    rng = random.Random(seed)
    stems = [[rng.randrange(100, vocab - 1) for _ in range(stem_len)] for _ in range(num_stems)]
    return [stems[i % num_stems] + [rng.randrange(100, vocab - 1) for _ in range(tail_len)] for i in range(n)]


def run_closed_loop(
    engine: Engine,
    prompts: list[list[int]],
    output_len: int,
    concurrency: int,
    sampling: dict[str, Any] | None = None,
) -> dict[str, float]:
    """`concurrency` clients, each sending its next request when the previous one finished; greedy,
    or with the SamplingParams fields `sampling` (e.g. a temperature and a seed)."""
    params = SamplingParams(**{"temperature": 0, **(sampling or {})}, max_tokens=output_len, ignore_eos=True)
    queue_ = list(reversed(prompts))
    lock = threading.Lock()
    outs: list[RequestOutput] = []

    def client() -> None:
        while True:
            with lock:
                if not queue_:
                    return
                prompt = queue_.pop()
            out = engine.submit(prompt, params).result()
            with lock:
                outs.append(out)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return summarize(outs, time.perf_counter() - t0)


def bench_configs(
    base: EngineConfig,
    variants: dict[str, dict[str, Any]],
    num_requests: int,
    output_len: int,
    concurrency: int,
    trace_events: list[dict] | None = None,
    workload: Callable[[int, int], list[list[int]]] = mixed_prompts,
    sampling: dict[str, Any] | None = None,
    first_pid: int = 0,
    keep_going: bool = False,
) -> dict[str, dict[str, Any]]:
    """The same workload (`workload(num_requests, vocab)`) under each config variant, one engine at
    a time, drawn as run_closed_loop's `sampling` says. With `trace_events`, every run's timeline is
    appended (one trace process per variant, numbered from `first_pid`) and each row reports how
    much of the scheduler thread's busy time overlapped a running forward pass. With `keep_going`,
    a variant that raises becomes a row holding only its `error` and the next variant still runs
    (a device check that must bring back every row it can); otherwise the error propagates."""
    rows: dict[str, dict[str, Any]] = {}
    for i, (name, overrides) in enumerate(variants.items(), start=first_pid):
        try:
            rows[name] = _bench_one(
                base.replace(**overrides),
                num_requests,
                output_len,
                concurrency,
                trace_events,
                workload,
                sampling,
                i,
                name,
            )
        except Exception as e:  # noqa: BLE001 - re-raised unless the caller keeps going
            if not keep_going:
                raise
            rows[name] = {"error": f"{type(e).__name__}: {e}"[:500]}
            print(f"  {name}: FAILED: {rows[name]['error']}", flush=True)
            continue
        print(f"  {name}: {rows[name]['req_per_s']:.2f} req/s", flush=True)
    return rows


def _bench_one(  # one variant of bench_configs
    cfg: EngineConfig,
    num_requests: int,
    output_len: int,
    concurrency: int,
    trace_events: list[dict] | None,
    workload: Callable[[int, int], list[list[int]]],
    sampling: dict[str, Any] | None,
    pid: int,
    name: str,
) -> dict[str, Any]:
    cfg = cfg.replace(metrics_exact=True, **({"trace": True} if trace_events is not None else {}))
    with Engine(cfg) as engine:
        prompts = workload(num_requests, engine.vocab_size)
        warm = [[101, 102, 103]]  # shares no prefix with the workload: the cache starts cold
        engine.generate(warm, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
        engine.tracer.spans.clear()
        before = engine.metrics()
        row = run_closed_loop(engine, prompts, output_len, concurrency, sampling)
        engine.drain()
        row.update(_prefill_stats(before, engine.metrics()))
        if trace_events is not None:
            trace_events.extend(engine.tracer.chrome_events(pid=pid, process_name=name))
            row["sched_overlap"] = engine.tracer.busy_overlap()
    return row


def _prefill_stats(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Prefill work and prefix-cache effect of one run: tokens computed, tokens and requests served
    from the cache, evictions, and the scheduler time spent inserting into the tree."""
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    return {
        "prefill_tokens": d.get("prefill_tokens", 0.0),
        "prefix_hit_tokens": d.get("prefix_hit_tokens", 0.0),
        "prefix_token_hit_rate": d.get("prefix_hit_tokens", 0.0)
        / max(d.get("prefix_query_tokens", 0.0), 1.0),
        "prefix_request_hit_rate": d.get("prefix_hits", 0.0) / max(d.get("prefix_queries", 0.0), 1.0),
        "prefix_evicted_blocks": d.get("prefix_evicted_blocks", 0.0),
        "prefix_insert_ms": 1000 * d.get("prefix_insert_s", 0.0),
    }
