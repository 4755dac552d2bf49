"""`minisgl bench --scenario peers`: output tok/s of the default and deterministic configs on the
peer harness's workloads, and the batch-1 decode step against the machine's weight-read rate."""

from __future__ import annotations

import time
from typing import Any

from minisgl_backend.bench.measure import random_prompts, summarize
from minisgl_backend.config import EngineConfig
from minisgl_backend.engine import Engine
from minisgl_backend.model import cpu_kernels
from minisgl_backend.types import SamplingParams

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
