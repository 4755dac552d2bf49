"""`minisgl bench --scenario memory`: what the engine holds against what the model needs, and how
fast the biggest model this machine can hold decodes.

It starts an engine and reads the process's resident memory (RSS) and its peak (the high-water
mark, which covers loading), then sets them against the bound a user can plan with: the weights
once, plus the KV pool, plus a fixed allowance for the runtime (Python, torch, the tokenizer). Then
it runs the peer harness's batch-1 workload (one 200-token prompt, 96 greedy tokens, best of
`repeat`) and sets the decode step against the machine's streaming read rate: a batch-1 step reads
every weight once, so that rate is its floor.
"""

from __future__ import annotations

import time
from typing import Any

from minisgl_backend.bench.measure import random_prompts, summarize
from minisgl_backend.config import EngineConfig
from minisgl_backend.engine import Engine
from minisgl_backend.model import cpu_kernels
from minisgl_backend.types import SamplingParams

# The bound `minisgl bench --scenario memory` checks: RSS <= WEIGHT_SLACK x the weights' bytes + the
# KV pool + RUNTIME_BYTES. The slack covers the pack layouts' padding; the allowance, the interpreter,
# torch, the tokenizer and the engine's own buffers.
WEIGHT_SLACK = 1.15
RUNTIME_BYTES = 0.6e9
BATCH1 = (1, 200, 96)  # requests, prompt tokens, new tokens: the peers' batch-1 row


def process_memory() -> dict[str, int]:
    """This process's resident bytes now (rss) and at their peak so far (peak), from /proc (Linux);
    empty elsewhere."""
    out: dict[str, int] = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    out["rss" if key == "VmRSS" else "peak"] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return out


def bench_memory(config: EngineConfig, repeat: int = 3) -> dict[str, Any]:
    """Start an engine on `config` (prefix cache off, as the peers run), and return its memory
    against the bound and its batch-1 decode against the read rate (see the module docstring)."""
    config = config.replace(prefix_cache="off")
    start = time.perf_counter()
    with Engine(config) as engine:
        load_s = time.perf_counter() - start
        mem = process_memory()
        bound = WEIGHT_SLACK * engine.weight_bytes + engine.kv_cache_bytes + RUNTIME_BYTES
        result: dict[str, Any] = {
            "model": str(engine.model_dir),
            "kernels": cpu_kernels.family(),
            "load_s": load_s,
            "weight_bytes": engine.weight_bytes,
            "held_weight_bytes": engine.held_weight_bytes,
            "kv_cache_bytes": engine.kv_cache_bytes,
            "bound_bytes": bound,
            **{f"{k}_bytes": v for k, v in mem.items()},
        }
        if mem:
            result["rss_within_bound"] = mem["rss"] <= bound
            result["peak_within_bound"] = mem["peak"] <= bound
        n, input_len, output_len = BATCH1
        prompts = random_prompts(n, input_len, engine.vocab_size)
        params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
        engine.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        best_tpot = float("inf")
        for _ in range(repeat):
            t0 = time.perf_counter()
            outs = engine.generate(prompts, params, use_tqdm=False)
            best_tpot = min(best_tpot, summarize(outs, time.perf_counter() - t0)["tpot_ms_mean"] / 1000)
        step = {"step_ms": 1000 * best_tpot, "weight_bytes_per_step": engine.decode_weight_bytes}
        step["weights_gb_per_s"] = engine.decode_weight_bytes / best_tpot / 1e9
        read = cpu_kernels.stream_read_gbps()
        if read:
            step["stream_read_gb_per_s"] = read
            step["fraction_of_read"] = step["weights_gb_per_s"] / read
        result["batch1"] = step
        after = process_memory()
        if after:
            result["rss_after_run_bytes"] = after["rss"]
    return result


def format_memory(result: dict[str, Any]) -> str:
    """The scenario's result as the lines `minisgl bench` prints."""
    gb = 1e9
    lines = [
        f"model: {result['model']} (kernels: {result['kernels']}), loaded in {result['load_s']:.1f} s",
        f"weights {result['weight_bytes'] / gb:.2f} GB (held: {result['held_weight_bytes'] / gb:.2f} GB), "
        f"KV pool {result['kv_cache_bytes'] / gb:.2f} GB",
    ]
    if "rss_bytes" in result:
        lines.append(
            f"RSS {result['rss_bytes'] / gb:.2f} GB, peak {result['peak_bytes'] / gb:.2f} GB; bound "
            f"{WEIGHT_SLACK} x weights + KV pool + {RUNTIME_BYTES / gb:.1f} GB = "
            f"{result['bound_bytes'] / gb:.2f} GB: "
            f"RSS {'within' if result['rss_within_bound'] else 'OVER'}, "
            f"peak {'within' if result['peak_within_bound'] else 'OVER'}"
        )
    s = result["batch1"]
    line = f"batch-1 decode: {s['step_ms']:.1f} ms/token, {s['weights_gb_per_s']:.2f} GB/s of weights"
    if "stream_read_gb_per_s" in s:
        line += f" = {s['fraction_of_read']:.2f} of the {s['stream_read_gb_per_s']:.2f} GB/s read rate"
    return "\n".join([*lines, line])
