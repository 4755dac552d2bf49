"""Micro-benchmark of the row-wise kernels against the torch expressions they replace.

    python -m minisgl_backend.bench.rowwise [--rows 1 8 32 256] [--threads 1] [--dtype bfloat16]

SmolLM2's shapes: RMSNorm with the residual add fused over hidden 576 (`RMSNorm.add_and_norm`),
RoPE in place over the 9 query and 3 key heads of head_dim 64 (`apply_rotary`), SiLU x up over the
fused gate/up output of 2 x 1536. Prints one JSON line per op and row count, microseconds per call,
best of 5 (the calling thread's CPU time at one thread, wall time otherwise): `native` (the process's
kernel family; MINISGL_KERNELS picks a lower one) and `torch` (the same module's torch path, as the
`torch` family runs it).
"""

from __future__ import annotations

import argparse
import functools
import json

import torch
import torch.nn.functional as F

from minisgl_backend.bench.linear import best_of, kernel_bench_args
from minisgl_backend.model import cpu_kernels
from minisgl_backend.model.layers import RMSNorm
from minisgl_backend.model.rope import rotate_half

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER = 576, 9, 3, 64, 1536


def torch_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + rotate_half(x) * sin  # apply_rotary's torch path, full rotary


def torch_add_and_norm(
    norm: RMSNorm, x: torch.Tensor, add: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    s = x + add
    return norm.norm(s), s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 256])
    a, clock, dtype = kernel_bench_args(ap)
    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(HIDDEN, 1e-5).to(dtype)
    for m in a.rows:
        x, add = (torch.randn(m, HIDDEN, generator=g).to(dtype) for _ in range(2))
        qk = torch.randn(m, HEADS + KV_HEADS, HEAD_DIM, generator=g).to(dtype)
        angles = torch.randn(m, 1, HEAD_DIM, generator=g)
        cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
        gate_up = torch.randn(m, 2 * INTER, generator=g).to(dtype)
        gate, up = gate_up.chunk(2, dim=-1)
        cases = {
            "rms_norm_add": (
                functools.partial(cpu_kernels.rms_norm, x, norm.weight, norm.eps, False, add),
                functools.partial(torch_add_and_norm, norm, x, add),
            ),
            "rope": (
                functools.partial(cpu_kernels.rope_, qk, cos, sin),  # in place: the same input each call
                functools.partial(torch_rope, qk, cos, sin),
            ),
            "silu_and_mul": (
                functools.partial(cpu_kernels.silu_and_mul, gate_up),
                lambda gate=gate, up=up: F.silu(gate) * up,
            ),
        }
        with torch.inference_mode():
            for op, (native, plain) in cases.items():
                us = {
                    name: round(best_of(fn, clock) * 1e6, 2)
                    for name, fn in (("native", native), ("torch", plain))
                }
                out = {"op": op, "rows": m, "family": cpu_kernels.family(), "threads": a.threads, "us": us}
                print(json.dumps(out))


if __name__ == "__main__":
    main()
