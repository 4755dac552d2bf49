"""Micro-benchmark of paged attention: the native kernel on each of its scorers, and SDPA beside it.

    python -m minisgl_backend.bench.attention [--threads 1] [--dtype bfloat16]

SmolLM2's attention shape (9 heads, 3 KV heads, head_dim 64, block size 16) over a paged pool with
shuffled blocks. Prints one JSON line per case, milliseconds per layer, best of 5 (the calling
thread's CPU time at one thread, wall time otherwise):

- prefill chunks (`start` cached tokens, then `rows` new ones): `paged_attention` with each scorer
  this process runs (`fma`: float32 FMAs, AVX-512 or, under the avx2 family, AVX2; `dp`:
  AVX512-BF16; `amx`: the tile unit), against SDPA on the context gathered from the pool, as the
  forward runs it where the kernel does not serve prefill rows;
- decode rows (`batch` rows at `context` keys each): the same scorers, against the torch path of
  `Attention._decode_attention` (each row's blocks gathered, batched matmuls, masked softmax);
- decode steps: the same rows over 30 layers' pools (ms per step), whose K/V come from memory as
  in the model, where the pools of one layer above stay in cache.

The figures behind docs/performance.md's attention numbers.
"""

from __future__ import annotations

import argparse
import functools
import json
from collections.abc import Callable

import torch
import torch.nn.functional as F

from minisgl_backend.arith import cdiv
from minisgl_backend.bench.linear import best_of, kernel_bench_args
from minisgl_backend.model import cpu_kernels

HEADS, KV_HEADS, HEAD_DIM, BLOCK, LAYERS = 9, 3, 64, 16, 30


def pool(blocks: int, dtype: torch.dtype, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (blocks, BLOCK, KV_HEADS, HEAD_DIM)
    return torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype)


def sdpa_chunk(q, k, v, table, start, ctx) -> torch.Tensor:
    kr = k[table].reshape(-1, KV_HEADS, HEAD_DIM)[:ctx].transpose(0, 1)[None]
    vr = v[table].reshape(-1, KV_HEADS, HEAD_DIM)[:ctx].transpose(0, 1)[None]
    mask = torch.ones(q.shape[0], ctx, dtype=torch.bool).tril(start) if start else None
    qr = q.transpose(0, 1)[None]
    return F.scaled_dot_product_attention(qr, kr, vr, attn_mask=mask, is_causal=mask is None, enable_gqa=True)


def torch_decode(q, k, v, tables, pos, scale) -> torch.Tensor:
    """model/layers.py Attention._decode_attention's torch path (the gather through the tables
    included, the mask built outside as the forward builds it once per step)."""
    bsz, group = q.shape[0], HEADS // KV_HEADS
    flat = tables.reshape(-1)
    kc = k.index_select(0, flat).view(bsz, -1, KV_HEADS, HEAD_DIM)
    vc = v.index_select(0, flat).view(bsz, -1, KV_HEADS, HEAD_DIM)
    mask = (torch.arange(kc.shape[1])[None, :] <= pos[:, None])[:, None, None, :]
    scores = torch.matmul(q.view(bsz, KV_HEADS, group, HEAD_DIM), kc.permute(0, 2, 3, 1)) * scale
    probs = torch.softmax(scores.float().masked_fill_(~mask, float("-inf")), dim=-1).to(q.dtype)
    return torch.matmul(probs, vc.transpose(1, 2)).view(bsz, HEADS, HEAD_DIM)


def kernel_calls(
    scorers: list[str],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    tables: torch.Tensor,
    row_table: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
) -> dict[str, Callable[[], object]]:
    """paged_attention on each scorer, as calls without arguments (no window, no softcap)."""
    args = (q, k, v, tables, row_table, positions, scale, None, None)
    return {name: functools.partial(cpu_kernels.paged_attention, *args, scorer=name) for name in scorers}


def main() -> None:
    a, clock, dtype = kernel_bench_args(argparse.ArgumentParser(description=__doc__.split("\n")[0]))
    g = torch.Generator().manual_seed(0)
    scale = HEAD_DIM**-0.5
    bf16 = a.dtype == "bfloat16"
    scorers = [
        name for name in cpu_kernels.SCORERS if cpu_kernels.scorer_runs(name) and (bf16 or name == "fma")
    ]
    for start, rows in [(0, 256), (256, 256), (0, 512)]:
        ctx = start + rows
        nb = cdiv(ctx, BLOCK)
        k, v = pool(nb + 4, dtype, g)
        table = torch.randperm(nb + 4, generator=g)[:nb]
        q = torch.randn(rows, HEADS, HEAD_DIM, generator=g).to(dtype)
        row_table, pos = torch.zeros(rows, dtype=torch.int64), torch.arange(start, ctx)
        fns = kernel_calls(scorers, q, k, v, table[None], row_table, pos, scale)
        fns["sdpa_gathered"] = functools.partial(sdpa_chunk, q, k, v, table, start, ctx)
        ms = {name: round(best_of(fn, clock) * 1e3, 3) for name, fn in fns.items()}
        print(json.dumps({"case": "prefill", "start": start, "rows": rows, "threads": a.threads, "ms": ms}))
    for batch, context in [(1, 160), (8, 160), (32, 160), (32, 512)]:
        nb = cdiv(context, BLOCK)
        k, v = pool(batch * nb + 4, dtype, g)
        tables = torch.randperm(batch * nb + 4, generator=g)[: batch * nb].view(batch, nb)
        q = torch.randn(batch, HEADS, HEAD_DIM, generator=g).to(dtype)
        pos = torch.full((batch,), context - 1)
        fns = kernel_calls(scorers, q, k, v, tables, torch.arange(batch), pos, scale)
        fns["torch_gathered"] = functools.partial(torch_decode, q, k, v, tables, pos, scale)
        ms = {name: round(best_of(fn, clock) * 1e3, 3) for name, fn in fns.items()}
        print(
            json.dumps({"case": "decode", "batch": batch, "context": context, "threads": a.threads, "ms": ms})
        )
    for batch, context in [(8, 160), (32, 160)]:  # a whole step's K/V, which comes from memory
        nb = cdiv(context, BLOCK)
        k, v = pool(LAYERS * batch * nb, dtype, g)
        perm = torch.randperm(LAYERS * batch * nb, generator=g).view(LAYERS, batch, nb)
        q = torch.randn(batch, HEADS, HEAD_DIM, generator=g).to(dtype)
        pos = torch.full((batch,), context - 1)
        layers = [
            kernel_calls(scorers, q, k, v, perm[i], torch.arange(batch), pos, scale) for i in range(LAYERS)
        ]

        def step(name: str, layers: list = layers) -> None:
            for calls in layers:
                calls[name]()

        ms = {name: round(best_of(functools.partial(step, name), clock) * 1e3, 3) for name in scorers}
        print(
            json.dumps(
                {
                    "case": "decode_step",
                    "layers": LAYERS,
                    "batch": batch,
                    "context": context,
                    "threads": a.threads,
                    "ms": ms,
                }
            )
        )


if __name__ == "__main__":
    main()
