"""`minisgl bench --scenario sampling`: what sampling costs. The engine's output tok/s under each
sampling mode on one workload, against greedy; then one draw's time per mode on a row of the model's
vocabulary, with the native screen of the keyed draw (cpu_kernels.keyed_draw_screen, the AVX-512
kernel families) and with numpy alone (the torch family's path), which give the same tokens."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from minisgl_backend.bench.measure import random_prompts
from minisgl_backend.config import EngineConfig
from minisgl_backend.engine import Engine
from minisgl_backend.model import cpu_kernels
from minisgl_backend.sampling.sampler import SampleRow, sample
from minisgl_backend.types import SamplingParams

SAMPLING_MODES: dict[str, dict[str, Any]] = {
    "greedy": {"temperature": 0.0},
    "temperature 0.8": {"temperature": 0.8},
    "temperature 0.8, top_k 50": {"temperature": 0.8, "top_k": 50},
    "temperature 0.8, top_p 0.95": {"temperature": 0.8, "top_p": 0.95},
}
WORKLOAD = (32, 100, 64)  # requests, prompt tokens, new tokens (the peers' 32-request row)


def _draw_us(vocab: int, params: SamplingParams, rows: int = 64) -> float:
    """Microseconds per row of sampler.sample over `rows` rows of a model-like vocabulary row (a
    standard normal scaled by 3: a spread of ~40 logits, as a small model's)."""
    logits = (np.random.default_rng(0).standard_normal((rows, vocab)) * 3).astype(np.float32)
    keys = [SampleRow(params, 1000 + i, 50 + i, ()) for i in range(rows)]
    sample(logits[:2], keys[:2])
    start = time.perf_counter()
    sample(logits, keys)
    return 1e6 * (time.perf_counter() - start) / rows


def bench_sampling(base: EngineConfig, repeat: int = 2) -> dict[str, Any]:
    """Each SAMPLING_MODES mode on WORKLOAD (prefix cache off, ignore_eos, seeded, best of `repeat`
    runs): {"rows": mode -> {"tok/s", "vs greedy", "draw us", "draw us, numpy"}, "kernels": the
    family}. "draw us" is one row's draw with this process's kernels, "draw us, numpy" the same
    with the torch family's (numpy only)."""
    n, input_len, output_len = WORKLOAD
    rows: dict[str, dict[str, float]] = {}
    with Engine(base.replace(prefix_cache="off")) as engine:
        prompts = random_prompts(n, input_len, engine.vocab_size)
        for name, mode in SAMPLING_MODES.items():
            params = SamplingParams(max_tokens=output_len, ignore_eos=True, seed=0, **mode)
            engine.generate(prompts[:2], params, use_tqdm=False)
            best = float("inf")
            for _ in range(repeat):
                start = time.perf_counter()
                outs = engine.generate(prompts, params, use_tqdm=False)
                best = min(best, time.perf_counter() - start)
            rows[name] = {"tok/s": sum(len(o.token_ids) for o in outs) / best}
            print(f"  {name}: {rows[name]['tok/s']:.1f} tok/s", flush=True)
        vocab = engine.vocab_size
    for name, mode in SAMPLING_MODES.items():
        row = rows[name]
        row["vs greedy"] = row["tok/s"] / rows["greedy"]["tok/s"]
        params = SamplingParams(**mode)
        row["draw us"] = _draw_us(vocab, params)
        with cpu_kernels.family_override("torch"):
            row["draw us, numpy"] = _draw_us(vocab, params)
    return {"rows": rows, "kernels": cpu_kernels.family(), "workload": list(WORKLOAD), "vocab": vocab}
