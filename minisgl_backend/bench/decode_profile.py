"""Time and profile decode steps of the model alone (no scheduler): the per-op split in docs/performance.md.

    python -m minisgl_backend.bench.decode_profile [--dtype bfloat16] [--batch 1] [--context 100] [--steps 40]
                                     [--deterministic] [--int8] [--threads N] [--cpu-time] [--profile]
                                     [--layer-loop]

Builds a KV cache, prefills `batch` random prompts of `context` tokens, then times `steps` decode
steps and prints one JSON line (min and median step time, tokens/s). --cpu-time times each step by
the calling thread's CPU time instead of wall time (with --threads 1 it is robust to other processes
on a shared machine). --profile adds torch.profiler's table of the ops of 10 steps. Run it with
MINISGL_CPU_KERNELS=0 for the torch-only path, MINISGL_AMX=0 for the AVX-512 kernels without AMX,
MINISGL_KERNELS=<family> for any other family (the JSON names it).
--layer-loop runs the Python layer loop where the native layer stack would run (model/layer_stack.py).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from minisgl_backend.arith import cdiv
from minisgl_backend.iteration import PrefillChunk
from minisgl_backend.kvcache.storage import KVCache
from minisgl_backend.model import cpu_kernels
from minisgl_backend.model.batch import ForwardBatch
from minisgl_backend.model.layer_stack import LayerStackForward
from minisgl_backend.model.loader import load_model, prepare

BLOCK = 16


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=100)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--deterministic", action="store_true")
    ap.add_argument("--int8", action="store_true", help="weight_dtype: int8 (bf16 only)")
    ap.add_argument("--cpu-time", action="store_true")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--layer-loop", action="store_true", help="no native layer stack")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    model = load_model(a.model, a.dtype, "cpu").model
    prepare(model, "int8" if a.int8 else None, a.deterministic)
    stacked = model.forward_strategy
    assert isinstance(stacked, LayerStackForward)  # what prepare picks
    if a.layer_loop:
        model.forward_strategy = stacked.inner
    s = model.spec
    per_seq = cdiv(a.context + a.steps + 20, BLOCK)
    kv = KVCache(
        s.num_layers, per_seq * a.batch, BLOCK, s.num_kv_heads, s.head_dim, model.lm_head.weight.dtype, "cpu"
    )
    tables = torch.arange(per_seq * a.batch).view(a.batch, per_seq)
    gen = torch.Generator().manual_seed(0)

    def tokens(n: int) -> torch.Tensor:
        return torch.randint(100, s.vocab_size - 100, (n,), generator=gen)

    for b in range(a.batch):
        pos = torch.arange(a.context)
        slots = tables[b][pos // BLOCK] * BLOCK + pos % BLOCK
        chunk = PrefillChunk(0, a.context, a.context, tables[b][: cdiv(a.context, BLOCK)])
        model(ForwardBatch(tokens(a.context), pos, slots, 0, None, None, (chunk,), pos[-1:]), kv)

    def step(p: int) -> None:
        pos = torch.full((a.batch,), p)
        nb = p // BLOCK + 1
        mask = (torch.arange(nb * BLOCK) <= p)[None, None, None, :].expand(a.batch, 1, 1, -1)
        slots = tables[:, p // BLOCK] * BLOCK + p % BLOCK
        fb = ForwardBatch(
            tokens(a.batch), pos, slots, a.batch, tables[:, :nb].contiguous(), mask, (), torch.arange(a.batch)
        )
        model(fb, kv)

    clock = time.thread_time if a.cpu_time else time.perf_counter
    p = a.context
    for _ in range(3):
        step(p)
        p += 1
    times = []
    for _ in range(a.steps):
        t = clock()
        step(p)
        times.append(clock() - t)
        p += 1
    times.sort()
    best, median = times[0], times[len(times) // 2]
    print(
        json.dumps(
            {
                "dtype": a.dtype,
                "batch": a.batch,
                "context": a.context,
                "deterministic": a.deterministic,
                "int8": a.int8,
                "threads": torch.get_num_threads(),
                "kernels": cpu_kernels.family(),
                "cpu_kernels": cpu_kernels.available(),
                "amx": cpu_kernels.amx_available(),
                "layer_stack": not a.layer_loop and stacked.stack(model, kv) is not None,
                "clock": "thread_cpu" if a.cpu_time else "wall",
                "step_ms_min": round(best * 1e3, 2),
                "step_ms_median": round(median * 1e3, 2),
                "tok_per_s_best": round(a.batch / best, 1),
            }
        )
    )
    if a.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(10):
                step(p)
                p += 1
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))


if __name__ == "__main__":
    main()
