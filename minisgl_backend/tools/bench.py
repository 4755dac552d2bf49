"""Offline throughput benchmark: the engine vs Hugging Face `generate` on one workload, in one run.

Definitions (as SGLang/vLLM): TTFT = first token time - arrival; TPOT per request =
(latency - TTFT) / (output_len - 1), averaged over requests; output tok/s = generated tokens / wall.
"""

from __future__ import annotations

import random
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from minisgl_backend.config import EngineConfig
from minisgl_backend.engine import Engine
from minisgl_backend.model import cpu_kernels
from minisgl_backend.types import RequestOutput, SamplingParams


def random_prompts(n: int, input_len: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """Token-id prompts of a fixed length (ids from a safe range: no special tokens)."""
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 1) for _ in range(input_len)] for _ in range(n)]


def _pct(xs: Sequence[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))] if xs else float("nan")


def summarize(outputs: Sequence[RequestOutput], wall: float) -> dict[str, float]:
    ttft = [o.timings.ttft for o in outputs]
    tpot = [
        (o.timings.finish - o.timings.first_token) / (len(o.token_ids) - 1)
        for o in outputs
        if len(o.token_ids) > 1
    ]
    gen = sum(len(o.token_ids) for o in outputs)
    row = {
        "requests": len(outputs),
        "wall_s": wall,
        "req_per_s": len(outputs) / wall,
        "output_tok_per_s": gen / wall,
    }
    for name, xs in (("ttft_ms", ttft), ("tpot_ms", tpot)):
        row[f"{name}_mean"] = 1000 * statistics.fmean(xs) if xs else float("nan")
        row[f"{name}_p50"] = 1000 * _pct(xs, 50)
        row[f"{name}_p99"] = 1000 * _pct(xs, 99)
    return row


def run_engine(
    engine: Engine, prompts: list[list[int]], output_len: int, warmup: bool = True
) -> dict[str, float]:
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    if warmup:
        engine.generate(
            prompts[:2], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False
        )
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params, use_tqdm=False)
    return summarize(outs, time.perf_counter() - t0)


def run_hf(
    model_dir: str, dtype: str, prompts: list[list[int]], output_len: int, batch_size: int
) -> dict[str, float]:
    """HF transformers `generate`, static batches of `batch_size` (left padded), greedy."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0

    def run_batch(batch: list[list[int]], new: int) -> int:
        width = max(map(len, batch))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=pad,
            )
        return (out.shape[1] - width) * len(batch)

    run_batch(prompts[:2], 2)  # warm-up
    t0 = time.perf_counter()
    gen = sum(run_batch(prompts[i : i + batch_size], output_len) for i in range(0, len(prompts), batch_size))
    wall = time.perf_counter() - t0
    return {
        "requests": len(prompts),
        "wall_s": wall,
        "req_per_s": len(prompts) / wall,
        "output_tok_per_s": gen / wall,
    }


# The seed's four rows (section 5.3) as plain config overrides.
SEED_TABLE: dict[str, dict[str, Any]] = {
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
    engine: Engine, prompts: list[list[int]], output_len: int, concurrency: int
) -> dict[str, float]:
    """`concurrency` clients, each sending its next request when the previous one finished."""
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
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
) -> dict[str, dict[str, Any]]:
    """The same workload (`workload(num_requests, vocab)`) under each config variant, one engine at
    a time. With `trace_events`, every run's timeline is appended (one trace process per variant) and
    each row reports how much of the scheduler thread's busy time overlapped a running forward pass."""
    rows: dict[str, dict[str, Any]] = {}
    for i, (name, overrides) in enumerate(variants.items()):
        cfg = base.replace(
            **overrides, metrics_exact=True, **({"trace": True} if trace_events is not None else {})
        )
        with Engine(cfg) as engine:
            prompts = workload(num_requests, engine.vocab_size)
            warm = [[101, 102, 103]]  # shares no prefix with the workload: the cache starts cold
            engine.generate(warm, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
            engine.tracer.spans.clear()
            before = engine.metrics()
            rows[name] = run_closed_loop(engine, prompts, output_len, concurrency)
            engine.drain()
            rows[name].update(_prefill_stats(before, engine.metrics()))
            if trace_events is not None:
                trace_events.extend(engine.tracer.chrome_events(pid=i, process_name=name))
                rows[name]["sched_overlap"] = engine.tracer.busy_overlap()
        print(f"  {name}: {rows[name]['req_per_s']:.2f} req/s", flush=True)
    return rows


# The peers scenario: the workloads of ../shared/peers (and the speed issues): random-token prompts,
# greedy, ignore_eos; (requests, prompt tokens, new tokens). The last is prefill: one new token.
PEER_WORKLOADS = {
    "1 x 200 -> 96": (1, 200, 96),
    "8 x 200 -> 96": (8, 200, 96),
    "32 x 100 -> 64": (32, 100, 64),
    "32 x 512 -> 1 (prefill)": (32, 512, 1),
}
PEER_VARIANTS = {"default": {}, "deterministic": {"deterministic": True}}


def bench_peers(base: EngineConfig, repeat: int = 3) -> dict[str, Any]:
    """Each PEER_VARIANTS config on each PEER_WORKLOADS workload, measured as the peer harness
    measures vLLM and HF: a warm-up on 2 prompts, then the best of `repeat` full runs, with the
    prefix cache off (the runs repeat their prompts: with it on, prefill would be cache hits).
    Returns {"rows": workload -> {variant: output tok/s (prefill: seconds), "<variant> cost %"},
    "kernels": the kernel family, "decode": the batch-1 weight stream}: the default config's
    decode step at one request (its mean time per output token), the weight bytes a step reads,
    their ratio and the machine's streaming read rate measured beside it."""
    base = base.replace(prefix_cache="off")
    rows: dict[str, dict[str, float]] = {name: {} for name in PEER_WORKLOADS}
    stream: dict[str, float] = {}
    for variant, overrides in PEER_VARIANTS.items():
        with Engine(base.replace(**overrides)) as engine:
            for name, (n, input_len, output_len) in PEER_WORKLOADS.items():
                prompts = random_prompts(n, input_len, engine.vocab_size)
                params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
                engine.generate(prompts[:2], params, use_tqdm=False)
                best, tpot = float("inf"), float("inf")
                for _ in range(repeat):
                    t0 = time.perf_counter()
                    outs = engine.generate(prompts, params, use_tqdm=False)
                    best = min(best, time.perf_counter() - t0)
                    if n == 1:
                        tpot = min(tpot, summarize(outs, best)["tpot_ms_mean"] / 1000)
                prefill = output_len == 1
                rows[name][variant] = best if prefill else sum(len(o.token_ids) for o in outs) / best
                unit = "s" if prefill else "tok/s"
                print(f"  {variant} {name}: {rows[name][variant]:.2f} {unit}", flush=True)
                if n == 1 and variant == "default":
                    stream = {"step_ms": 1000 * tpot, "weight_bytes": engine.decode_weight_bytes}
    if stream:
        stream["weights_gb_per_s"] = stream["weight_bytes"] / (stream["step_ms"] / 1000) / 1e9
        read = cpu_kernels.stream_read_gbps()
        if read:
            stream["stream_read_gb_per_s"] = read
            stream["fraction_of_read"] = stream["weights_gb_per_s"] / read
    for name, row in rows.items():
        for variant in PEER_VARIANTS:
            if variant != "default":  # a cost: the time it adds (prefill rows are seconds)
                ratio = row["default"] / row[variant] if "prefill" in name else row[variant] / row["default"]
                row[f"{variant} cost %"] = 100 * (1 - ratio)
    return {
        "rows": rows,
        "kernels": cpu_kernels.family(),
        "machine_kernels": cpu_kernels.machine_family(),
        "decode": stream,
    }


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


SERVING_COLUMNS = (
    "requests",
    "wall_s",
    "req_per_s",
    "output_tok_per_s",
    "ttft_ms_mean",
    "ttft_ms_p50",
    "ttft_ms_p99",
    "tpot_ms_mean",
    "tpot_ms_p50",
    "tpot_ms_p99",
    "sched_overlap",
)


def format_table(
    rows: dict[str, dict[str, Any]], extra: Sequence[str] = (), columns: Sequence[str] = SERVING_COLUMNS
) -> str:
    """One line per row: `columns`, then `extra`."""
    cols = [*columns, *extra]
    width = max(map(len, rows)) + 2
    widths = [max(17, len(c) + 2) for c in cols]
    lines = ["".ljust(width) + "".join(c.rjust(w) for c, w in zip(cols, widths))]
    for name, row in rows.items():
        cells = []
        for c, w in zip(cols, widths):
            v = row.get(c)
            cells.append(("-" if v is None else f"{v:.2f}" if isinstance(v, float) else str(v)).rjust(w))
        lines.append(name.ljust(width) + "".join(cells))
    return "\n".join(lines)


def bench(
    config: EngineConfig,
    num_requests: int,
    input_len: int,
    output_len: int,
    hf: bool = True,
    hf_batch_size: int | None = None,
) -> dict[str, Any]:
    with Engine(config) as engine:
        prompts = random_prompts(num_requests, input_len, engine.vocab_size)
        rows: dict[str, dict[str, Any]] = {"minisgl": run_engine(engine, prompts, output_len)}
        leaked = engine.check_invariants()
        model_dir = str(engine.model_dir)
    if hf:
        rows["hf_generate"] = run_hf(
            model_dir, config.dtype, prompts, output_len, hf_batch_size or num_requests
        )
        rows["ratio_minisgl_over_hf"] = {
            k: rows["minisgl"][k] / rows["hf_generate"][k] for k in ("req_per_s", "output_tok_per_s")
        }
    return {
        "config": {
            "dtype": config.dtype,
            "num_requests": num_requests,
            "input_len": input_len,
            "output_len": output_len,
            "chunk_size": config.chunk_size,
        },
        "results": rows,
        "kv_blocks_after_drain": leaked,
    }
