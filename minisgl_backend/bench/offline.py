"""The default `minisgl bench`: the engine vs Hugging Face `generate` on one workload, in one run."""

from __future__ import annotations

import time
from typing import Any

import torch

from minisgl_backend.bench.load import CompetingLoad
from minisgl_backend.bench.measure import random_prompts, summarize
from minisgl_backend.config import EngineConfig
from minisgl_backend.engine import Engine
from minisgl_backend.model import cpu_kernels
from minisgl_backend.types import SamplingParams


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


def bench(
    config: EngineConfig,
    num_requests: int,
    input_len: int,
    output_len: int,
    hf: bool = True,
    hf_batch_size: int | None = None,
    busy: int = 0,
) -> dict[str, Any]:
    """The engine (and HF generate) on one workload; with `busy` > 0 the engine again beside that
    many busy processes (CompetingLoad), and a one-thread engine beside them, the floor it must beat."""
    with Engine(config) as engine:
        prompts = random_prompts(num_requests, input_len, engine.vocab_size)
        run_engine(engine, prompts[:2], output_len)  # warm-up
        rows: dict[str, dict[str, Any]] = {"minisgl": run_engine(engine, prompts, output_len)}
        if busy:
            with CompetingLoad(busy):
                rows["minisgl, busy"] = run_engine(engine, prompts, output_len)
        leaked = engine.check_invariants()
        model_dir = str(engine.model_dir)
    if busy:
        with CompetingLoad(busy), Engine(config.replace(num_threads=1)) as engine:
            run_engine(engine, prompts[:2], output_len)
            rows["minisgl 1 thread, busy"] = run_engine(engine, prompts, output_len)
        rows["ratio_busy_over_idle"] = {
            k: rows["minisgl, busy"][k] / rows["minisgl"][k] for k in ("req_per_s", "output_tok_per_s")
        }
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
            "kernels": cpu_kernels.family(),  # the CPU kernel family of this process
            "busy_processes": busy,
        },
        "results": rows,
        "kv_blocks_after_drain": leaked,
    }
