"""The avx2 kernel family on an emulated AVX2-only CPU: run every avx2 entry point of the built
extension on fixed inputs (no torch: ctypes buffers, so it also runs under user-mode emulation) and
print a digest of each output.

    .venv/bin/python scripts/avx2_check.py > native.txt
    qemu-x86_64 -cpu Haswell "$(readlink -f .venv/bin/python)" scripts/avx2_check.py > emulated.txt
    diff <(grep -v -e has_avx -e isa= native.txt) <(grep -v -e has_avx -e isa= emulated.txt)

Under `-cpu Haswell` (AVX2 + FMA, no AVX-512; QEMU's TCG faults on any AVX-512 instruction) the
first line reads `has_avx512 False has_avx2 True`, every kernel runs, and the digests match the
native run's bit for bit (a family's bits depend on the family, not the CPU); an AVX-512 request
(isa=2) is refused with ValueError, not SIGILL. Covers the few-row linear (1, 4, 9 rows; K and N
tails), RMSNorm + add, SiLU x up, partial RoPE (bf16 and float32), the paged attention's vector
(d=64) and scalar (d=12) paths over two tables with prefill and decode rows, and stream_read.
Argument: the extension's path (default: the one built in minisgl_backend/native/).
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import random
import struct
import sys
from pathlib import Path

ISA_AVX2, ISA_AVX512 = 1, 2  # csrc/cpu/common.h Isa


def load(path: str | None):
    so = (
        Path(path)
        if path
        else next((Path(__file__).parents[1] / "minisgl_backend/native").glob("_kernels*.so"))
    )
    spec = importlib.util.spec_from_file_location("_kernels", so)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main() -> None:
    k = load(sys.argv[1] if len(sys.argv) > 1 else None)
    print("has_avx512", k.has_avx512(), "has_avx2", k.has_avx2())
    rng = random.Random(0)
    total = hashlib.sha256()

    def bf16(n: int, scale: float = 1.0):
        buf = (ctypes.c_uint16 * n)()
        for i in range(n):
            buf[i] = struct.unpack("<I", struct.pack("<f", rng.gauss(0, scale)))[0] >> 16
        return buf

    def f32(n: int, scale: float = 1.0):
        buf = (ctypes.c_float * n)()
        for i in range(n):
            buf[i] = rng.gauss(0, scale)
        return buf

    def i64(values: list[int]):
        return (ctypes.c_int64 * len(values))(*values)

    def record(name: str, buf) -> None:
        total.update(bytes(buf))
        print(name, hashlib.sha256(bytes(buf)).hexdigest()[:16])

    ptr = ctypes.addressof
    for n, kk in ((37, 50), (64, 96), (8, 33)):
        w, b = bf16(n * kk, 0.05), bf16(n)
        for m in (1, 4, 9):
            x, y = bf16(m * kk), (ctypes.c_uint16 * (m * n))()
            k.linear_bf16(ptr(x), ptr(w), ptr(b), ptr(y), m, n, kk, 2, ISA_AVX2)
            record(f"linear {n}x{kk} m={m}", y)
    for bf in (True, False):
        make, size = (bf16, 2) if bf else (f32, 4)
        rows, dim = 5, 100
        x, add, w = make(rows * dim), make(rows * dim), make(dim)
        out, tot = (ctypes.c_uint8 * (rows * dim * size))(), (ctypes.c_uint8 * (rows * dim * size))()
        k.rms_norm(ptr(x), ptr(add), ptr(tot), ptr(w), ptr(out), rows, dim, 1e-6, False, bf, 2, ISA_AVX2)
        record(f"rms_norm bf16={bf}", out)
        record(f"rms_norm sum bf16={bf}", tot)
        gate_up, act = make(rows * 2 * 70, 4.0), (ctypes.c_uint8 * (rows * 70 * size))()
        k.silu_and_mul(ptr(gate_up), ptr(act), rows, 70, bf, 2, ISA_AVX2)
        record(f"silu_and_mul bf16={bf}", act)
        q, cos, sin = make(rows * 5 * 24), make(rows * 20), make(rows * 20)
        k.rope(ptr(q), ptr(cos), ptr(sin), rows, 5, 20, 5 * 24, 24, bf, 2, ISA_AVX2)
        record(f"rope bf16={bf}", q)
        for d in (64, 12):  # the vector path, the scalar one
            h, kvh, bs, pool = 9, 3, 16, 12
            kp, vp = make(pool * bs * kvh * d), make(pool * bs * kvh * d)
            tables = i64([3, 7, 1, 0, 2, 5, 9, 11, 4, 6, 8, 10])  # two tables of 6 blocks
            row_table, pos = i64([0] * 20 + [1, 1]), i64([*range(20, 40), 50, 91])  # a chunk, 2 decode rows
            qq, o = make(22 * h * d), (ctypes.c_uint8 * (22 * h * d * size))()
            k.paged_attention(
                ptr(qq),
                h * d,
                ptr(kp),
                ptr(vp),
                ptr(tables),
                ptr(row_table),
                ptr(pos),
                ptr(o),
                22,
                h,
                kvh,
                d,
                bs,
                pool,
                2,
                6,
                d**-0.5,
                0.0,
                0,
                bf,
                0,
                2,
                ISA_AVX2,
            )
            record(f"paged_attention d={d} bf16={bf}", o)
    buf = (ctypes.c_float * (1 << 20))()
    print("stream_read", k.stream_read(ptr(buf), 4 << 20, 2, ISA_AVX2))
    one, y1 = bf16(1), (ctypes.c_uint16 * 1)()
    try:
        k.linear_bf16(ptr(one), ptr(one), 0, ptr(y1), 1, 1, 1, 1, ISA_AVX512)
        print("isa=2 ran")
    except ValueError as exc:
        print("isa=2 refused:", exc)
    print("all", total.hexdigest())


if __name__ == "__main__":
    main()
