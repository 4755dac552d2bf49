"""Compile the GPU attention kernels for NVIDIA GPUs on a machine that has none:
`python -m minisgl_backend.tools.triton_check [--arch 90 80 89] [--json out.json]`.

Triton's interpreter proves what the kernels compute, on the CPU; it does not compile them, so a
kernel that the GPU compiler rejects, that spills registers to local memory or that asks for more
shared memory than a GPU has would pass every interpreted test and fail (or crawl) on the first GPU.
This check compiles each variant the back-end launches (model/triton_attention.py: decode and
prefill, every dtype, the usual head sizes, with and without the softcap, window and row-table
switches) to a cubin for each architecture. The launchers themselves are called, over meta tensors
with their launches captured, so what is compiled is what they would launch. Each cubin's registers,
stack (spilled registers) and shared memory are read back. It needs Triton's NVIDIA back-end, which
its wheel ships (the GPU compiler included), and no GPU or driver. Exit status 1 if a variant fails
to compile, spills, or needs more shared memory than the architecture gives one block.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from typing import Any

import torch

# Shared memory one block may use (the opt-in maximum), by compute capability.
SHARED_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}
HEAD_DIMS = (64, 128, 256)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_TYPES = {
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float32: "fp32",
    torch.int32: "i32",
    torch.int64: "i64",
}


@dataclass
class Row:
    kernel: str
    arch: int
    dtype: str
    head_dim: int
    switches: str
    tiles: str
    registers: int | None = None
    spill_bytes: int | None = None
    shared_bytes: int | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return (
            self.error is None
            and self.spill_bytes == 0
            and self.shared_bytes is not None
            and self.shared_bytes <= SHARED_LIMIT.get(self.arch, 99 * 1024)
        )


def _signature(launch: Any) -> tuple[dict[str, str], dict[str, Any]]:
    """Triton's signature of a launch: a type per runtime argument, then the compile-time ones."""
    names = launch.kernel.arg_names
    sig: dict[str, str] = {}
    for name, value in zip(names, launch.args):
        if isinstance(value, torch.Tensor):
            sig[name] = "*" + _TYPES[value.dtype]
        elif isinstance(value, bool):
            sig[name] = "i1"
        elif isinstance(value, int):
            sig[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
        else:
            sig[name] = "fp32"
    for name in launch.constexprs:
        sig[name] = "constexpr"
    return sig, dict(launch.constexprs)


def cuobjdump() -> str | None:
    """The CUDA toolkit's cubin reader that Triton's NVIDIA back-end ships, or None where triton or
    that back-end is not installed (then nothing can be compiled for a GPU here)."""
    try:
        import triton
    except ImportError:
        return None
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    return tool if os.path.exists(tool) else None


def _usage(cubin: bytes) -> tuple[int, int]:
    """(registers, stack bytes) of the one kernel in a cubin, as the CUDA toolkit's dump reads them."""
    tool = cuobjdump()
    if tool is None:
        raise RuntimeError("triton's NVIDIA back-end (its cuobjdump) is not installed")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run(
            [tool, "--dump-resource-usage", f.name], capture_output=True, text=True, check=True
        )
    m = re.search(r"REG:(\d+)\s+STACK:(\d+)", out.stdout)
    if m is None:
        raise RuntimeError(f"no resource usage in cuobjdump's output: {out.stdout[-400:]}")
    return int(m.group(1)), int(m.group(2))


def compile_launch(launch: Any, arch: int, num_warps: int) -> tuple[int, int, int]:
    """(registers, spilled bytes, shared bytes) of one launch compiled for compute capability `arch`."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig, constexprs = _signature(launch)
    src = ASTSource(launch.kernel, sig, constexprs=constexprs)
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps})
    regs, stack = _usage(compiled.asm["cubin"])
    return regs, stack, int(compiled.metadata.shared)


def launches(dtype: torch.dtype, head_dim: int) -> list[tuple[str, str, Any]]:
    """(kernel, switches, launch) for each variant of one dtype and head size, over meta tensors
    shaped as a GQA model's pool (4 query heads per KV head, blocks of 16)."""
    from minisgl_backend.model import triton_attention as ta

    def t(*shape: int, dt: torch.dtype = dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dt, device="meta")

    kvh, h, bs = 2, 8, 16
    pool = t(64, bs, kvh, head_dim)
    q, out = t(32, h, head_dim), t(32, h, head_dim)
    tables, pos = t(32, 8, dt=torch.int64), t(32, dt=torch.int64)
    rows, table = t(32, dt=torch.int64), t(8, dt=torch.int64)
    found: list[tuple[str, str, Any]] = []
    for name, window, cap, row_table in (("plain", None, None, None), ("window+softcap", 8, 30.0, rows)):
        with ta.captured_launches() as launched:
            ta.paged_decode_attention(q, pool, pool, tables, pos, 0.1, window, cap, row_table, out)
            ta.paged_prefill_attention(q, pool, pool, table, 0, 32, 100, 0.1, window, cap, out)
        decode, prefill = launched
        found.append(("decode", name + ("+row table" if row_table is not None else ""), decode))
        found.append(("prefill", name, prefill))
    return found


def run(archs: list[int], dtypes: list[str], head_dims: list[int], num_warps: int | None = None) -> list[Row]:
    rows: list[Row] = []
    for arch in archs:
        for dt in dtypes:
            for d in head_dims:
                for kernel, switches, launch in launches(DTYPES[dt], d):
                    c, warps = launch.constexprs, num_warps or launch.num_warps
                    tiles = f"{c.get('BLOCK_M', c.get('BLOCK_G'))}x{c['BLOCK_N']}, {warps} warps"
                    row = Row(kernel, arch, dt, d, switches, tiles)
                    try:
                        row.registers, row.spill_bytes, row.shared_bytes = compile_launch(launch, arch, warps)
                    except Exception as e:  # noqa: BLE001 - reported in the table and the exit status
                        row.error = f"{type(e).__name__}: {e}"[:500]
                    rows.append(row)
    return rows


def table(rows: list[Row]) -> str:
    head = "| kernel | sm | dtype | head | switches | tiles | registers | spilled B | shared B | ok |"
    lines = [head, "|" + "---|" * 10]
    for r in rows:
        lines.append(
            f"| {r.kernel} | {r.arch} | {r.dtype} | {r.head_dim} | {r.switches} | {r.tiles} | "
            f"{r.registers} | {r.spill_bytes} | {r.shared_bytes} | {'yes' if r.ok else 'NO'} |"
        )
        if r.error:
            lines.append(f"  error: {r.error}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m minisgl_backend.tools.triton_check", description=__doc__)
    p.add_argument(
        "--arch", type=int, nargs="+", default=[90, 80], help="compute capabilities, e.g. 90 80 89"
    )
    p.add_argument("--dtype", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    p.add_argument("--head-dim", type=int, nargs="+", default=list(HEAD_DIMS))
    p.add_argument(
        "--num-warps", type=int, help="compile at this many warps instead of the launchers' (to compare)"
    )
    p.add_argument("--json", help="write the rows here")
    a = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        p.error("TRITON_INTERPRET is set: the interpreter compiles nothing; run without it")
    rows = run(a.arch, a.dtype, a.head_dim, a.num_warps)
    print(table(rows))
    bad = [r for r in rows if not r.ok]
    print(f"{len(rows) - len(bad)} of {len(rows)} variants compile without spilling and fit shared memory")
    if a.json:
        with open(a.json, "w") as f:
            json.dump([asdict(r) | {"ok": r.ok} for r in rows], f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
