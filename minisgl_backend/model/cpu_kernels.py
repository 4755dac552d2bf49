"""The CPU kernels of csrc/cpu/ (one file per family), behind torch-shaped functions with a torch fallback.

Each wrapper takes and returns torch tensors and checks what the native code assumes (device,
dtype, contiguity, shapes). Where a check fails, or the extension was not built, or the process's
kernel family (FAMILIES below: amx, avx512bf16, avx512, avx2, torch) lacks the kernel, `linear` runs
F.linear itself and the others return None (False for `rope_`), so the caller keeps its torch
expression. The process runs one KernelFamily, chosen at import from `MINISGL_KERNELS=<family>`
(a cap: never above what the CPU runs), with `MINISGL_AMX=0` (no AMX) and `MINISGL_CPU_KERNELS=0`
(torch everywhere, how the two are compared) its aliases.

The native functions take torch tensors and check them in C++ (csrc/cpu/tensor_arg.h): the
wrappers decide where a kernel runs, the native side refuses a tensor it cannot read (ValueError).

Why the kernels exist: a decode step of a few rows reads every weight once, and oneDNN's bf16 matmul
reads weights at a fraction of the memory's rate at those row counts (docs/performance.md has the
figures); the attention of one query per sequence otherwise gathers every sequence's whole context
into a fresh tensor in every layer. The packed linears and the paged attention also give each row
bits that depend on that row alone, which is what the batch-invariant forward needs
(docs/architecture.md, "CPU kernels").
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from minisgl_backend.arith import int_bits
from minisgl_backend.pages import huge_page_empty

try:  # built by setup.py when a C++ compiler is present (optional, like the in-flight tracker)
    from minisgl_backend.native import _kernels as _native  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - depends on the build
    _native = None

# Rows up to which linear() uses the kernel where torch's bf16 matmul (oneDNN) runs on the CPU's bf16
# dot products (AVX512-BF16 or AMX): beyond, it reuses each weight across more rows than the kernel's
# 4-row tiles and wins. Where it does not (the avx2 family, and the avx512 family on a CPU without
# them), the kernel runs at every row count (kernel_row_limit()): oneDNN's bf16 matmul then converts
# its operands on every call and runs well below the kernel at any row count.
MAX_KERNEL_ROWS = 4
# Rows up to which linear() runs float32 rows on the same kernel over float32 weights, on every
# family: a decode batch streams each weight once, which the BLAS's float32 matrix-vector and
# small-matrix paths do well below the memory's rate on some CPUs; at prompt-chunk sizes the BLAS's
# own blocking catches up with the kernel's 4-row tiles.
F32_KERNEL_ROWS = 32


# The kernel families, fastest first. A CPU runs every family from the best it supports down:
#   amx         bf16 linears and attention scores on the AMX tile unit (Sapphire Rapids and later)
#   avx512bf16  bf16 linears on vdpbf16ps (AMD Zen 4/5, Cooper Lake); the rest as avx512
#   avx512      AVX-512 F/BW/DQ/VL: few-row linears (bf16 and int8), paged attention, row-wise ops;
#               F.linear beyond, or on a CPU without AVX512-BF16 (Skylake to Ice Lake) the bf16
#               linear at every row count
#   avx2        AVX2 + FMA (Haswell, Zen 1-3): the bf16 linear at every row count, paged attention,
#               row-wise ops and the layer stack, at 8 lanes; no packing; int8 linears read their
#               dequantized bf16 weight
#   torch       torch's own ops everywhere
# MINISGL_KERNELS=<family> caps the family at a lower one (how each is measured and tested on a
# machine that runs a higher one); MINISGL_AMX=0 caps it at avx512bf16 and MINISGL_CPU_KERNELS=0
# at torch (KERNEL_ALIASES).
FAMILIES = ("amx", "avx512bf16", "avx512", "avx2", "torch")

# The vector code each native family's entry points run (csrc/cpu/common.h Isa): AVX2, AVX-512, and
# AVX-512 with AVX512-BF16's conversions (amx, avx512bf16: the same bits as plain AVX-512's).
ISA_AVX2, ISA_AVX512, ISA_AVX512_BF16 = 1, 2, 3


def machine_family() -> str:
    """The best kernel family this CPU and build run, whatever the environment asks."""
    if _native is None:
        return "torch"
    if not _native.has_avx512():
        return "avx2" if _native.has_avx2() else "torch"
    if _native.has_amx():
        return "amx"
    return "avx512bf16" if _native.has_avx512_bf16() else "avx512"


# The environment variable that chooses the family, and the older switches kept as aliases of it:
# MINISGL_AMX=0 caps the family at avx512bf16, MINISGL_CPU_KERNELS=0 at torch (0 or 1 each).
KERNELS_ENV = "MINISGL_KERNELS"
KERNEL_ALIASES = {"MINISGL_AMX": "avx512bf16", "MINISGL_CPU_KERNELS": "torch"}


@dataclass(frozen=True)
class KernelFamily:
    """What every wrapper below runs under one kernel family, decided once from its name (one of
    FAMILIES) and never changed: whether any native kernel runs, the AMX tile kernels, which packed
    linear pack()/linear_packed() run ("amx", "dpbf16" or None), the vector code (ISA_AVX2,
    ISA_AVX512 or ISA_AVX512_BF16) of the native entry points and the bf16 few-row kernel's row
    limit (which also depends on the CPU: library_bf16). Build one with KernelFamily.named."""

    name: str
    native: bool
    amx: bool
    packs: str | None
    isa: int
    row_limit: int | None  # kernel_row_limit()

    @classmethod
    def named(cls, name: str, library_bf16: bool | None = None) -> KernelFamily:
        """The family `name` where torch's bf16 matmul does (library_bf16) or does not run on bf16
        dot products, which decides the few-row kernel's row limit (None: as on this machine)."""
        if library_bf16 is None:
            library_bf16 = _LIBRARY_BF16
        if name not in FAMILIES:
            raise ValueError(f"{name!r} is not a kernel family; valid: {', '.join(FAMILIES)}")
        packs = {"amx": "amx", "avx512bf16": "dpbf16"}.get(name)
        isa = {"avx2": ISA_AVX2, "amx": ISA_AVX512_BF16, "avx512bf16": ISA_AVX512_BF16}.get(name, ISA_AVX512)
        row_limit = MAX_KERNEL_ROWS if library_bf16 and isa != ISA_AVX2 else None
        return cls(name, name != "torch", name == "amx", packs, isa, row_limit)

    @property
    def lanes(self) -> int:
        """float32 lanes of the family's vector code (16 or 8)."""
        return 8 if self.isa == ISA_AVX2 else 16


def family_from_env(env: Mapping[str, str] = os.environ) -> str:
    """The family a process with environment `env` runs: MINISGL_KERNELS (default: the best) capped by
    its aliases and by what this machine runs. ValueError for a value that is none of the choices."""
    cap = env.get(KERNELS_ENV, "").strip().lower() or FAMILIES[0]
    if cap not in FAMILIES:
        raise ValueError(f"{KERNELS_ENV}={cap!r} is not a kernel family; valid: {', '.join(FAMILIES)}")
    for alias, family in KERNEL_ALIASES.items():
        value = env.get(alias, "").strip()
        if value not in ("", "0", "1"):
            raise ValueError(f"{alias}={value!r}: valid values are 0 ({KERNELS_ENV}={family}) and 1 (no cap)")
        if value == "0":
            cap = max(cap, family, key=FAMILIES.index)
    return max(cap, machine_family(), key=FAMILIES.index)


# oneDNN's ISA names (ONEDNN_MAX_CPU_ISA) below its first with bf16 dot products (AVX512_CORE_BF16).
ONEDNN_BELOW_BF16 = frozenset(
    {"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI"}
)


def library_bf16(env: Mapping[str, str] = os.environ) -> bool:
    """Whether torch's bf16 matmul (oneDNN) runs on this CPU's bf16 dot products: the CPU has
    AVX512-BF16 (every CPU with AMX has it too) and ONEDNN_MAX_CPU_ISA (or its older name
    DNNL_MAX_CPU_ISA), which torch's oneDNN reads, does not cap oneDNN below them. Without them
    oneDNN converts a bf16 matmul's operands to float32 on every call."""
    if _native is None or not _native.has_avx512_bf16():
        return False
    cap = (env.get("ONEDNN_MAX_CPU_ISA") or env.get("DNNL_MAX_CPU_ISA") or "").strip().upper()
    return cap not in ONEDNN_BELOW_BF16


# The family this process runs, chosen once at import; family_override swaps in another for a block.
_LIBRARY_BF16 = library_bf16()
_ACTIVE = KernelFamily.named(family_from_env(), _LIBRARY_BF16)


def active() -> KernelFamily:
    """The kernel family this process runs (family_override's inside its block)."""
    return _ACTIVE


def runs_family(name: str) -> bool:
    """Whether this machine and build run kernel family `name` (it or a higher one is supported)."""
    return FAMILIES.index(name) >= FAMILIES.index(machine_family())


@contextlib.contextmanager
def family_override(name: str, library_bf16: bool | None = None) -> Iterator[None]:
    """Run the block as if the process had started with MINISGL_KERNELS=`name` (tests and benchmarks
    compare families in one process), and, where `library_bf16` is given, as if torch's bf16 matmul
    did or did not run on bf16 dot products (the few-row kernel's row limit; default: this
    machine's). Weights packed before or inside the block keep their layout: pack them inside it,
    and build a LayerStack there too."""
    global _ACTIVE
    if name not in FAMILIES or not runs_family(name):
        raise ValueError(f"kernel family {name!r} does not run here; these do: {', '.join(_runnable())}")
    saved, _ACTIVE = _ACTIVE, KernelFamily.named(name, library_bf16)
    try:
        yield
    finally:
        _ACTIVE = saved


def _runnable() -> list[str]:
    return [f for f in FAMILIES if runs_family(f)]


_THREADS: int | None = None


def threads() -> int:
    """How many threads the native kernels split their work over: set_threads()'s count, else torch's."""
    return _THREADS or torch.get_num_threads()


def set_threads(n: int | None) -> None:
    """The kernels' thread count (None: follow torch.get_num_threads()); minisgl_backend.model.cpu_threads
    sets it for an engine."""
    global _THREADS
    if n is not None and n < 1:
        raise ValueError(f"a thread count is at least 1, got {n}")
    _THREADS = n


@contextlib.contextmanager
def threads_override(n: int) -> Iterator[None]:
    """Run the block's kernels (and torch's ops) on n threads (tests compare thread counts)."""
    saved, saved_torch = _THREADS, torch.get_num_threads()
    set_threads(n)
    torch.set_num_threads(n)
    try:
        yield
    finally:
        set_threads(saved)
        torch.set_num_threads(saved_torch)


def pool_test_delay(slot: int, micros: int) -> None:
    """Test hook: the kernels' pool thread `slot` (1 = the first beside the caller) sleeps `micros`
    after it claims its first items in every parallel call (0: off), as if the OS had taken its core."""
    if _native is not None:
        _native.pool_set_test_delay(slot, micros)


def use_openmp(on: bool) -> None:
    """Run the kernels on torch's OpenMP team (True) or on their own pool (False, the default)."""
    if _native is not None:
        _native.pool_use_openmp(on)


PIN_MODES = ("auto", "on", "off")


def set_pinning(mode: str) -> None:
    """Whether the threads of a parallel kernel call pin themselves, one CPU of the process's affinity
    mask each: "auto" (the default, MINISGL_PIN_THREADS) while other processes keep them waiting for
    cores, "on" always, "off" never. Pinning changes where a thread runs, never a bit of a result."""
    if mode not in PIN_MODES:
        raise ValueError(f"pinning must be one of {', '.join(PIN_MODES)}, not {mode!r}")
    if _native is not None:
        _native.pool_set_pinning(PIN_MODES.index(mode))


def affinity() -> set[int]:
    """The CPUs this process may use: the calling thread's affinity mask, or the process's where the
    kernels' pool pinned this thread to one CPU (set_pinning)."""
    if _native is not None:
        return set(_native.pool_affinity())
    return set(os.sched_getaffinity(0))


def contended() -> bool:
    """Whether the kernels' threads have been kept waiting for a core lately (another busy process)."""
    return _native is not None and _native.pool_contended()


def family() -> str:
    """The kernel family this process runs (one of FAMILIES)."""
    return _ACTIVE.name


def available() -> bool:
    """True if the native kernels are built, enabled and this CPU runs them (a family other than
    torch: AVX-512 F/BW/DQ/VL, or AVX2 + FMA)."""
    return _ACTIVE.native


def isa() -> int:
    """The vector code this process's native entry points run (ISA_AVX512_BF16, ISA_AVX512 or
    ISA_AVX2; the LayerStack's too)."""
    return _ACTIVE.isa


def lanes() -> int:
    """float32 lanes of that code (16 or 8): the paged attention's vector paths and the layer stack
    take head dims that are a multiple of it (up to 256)."""
    return _ACTIVE.lanes


def avx512_available() -> bool:
    """True if this process runs the AVX-512 kernels (amx, avx512bf16 or avx512: the int8 linear,
    the packed linears' families), not the avx2 family's."""
    return _ACTIVE.native and _ACTIVE.isa != ISA_AVX2


def amx_available() -> bool:
    """True if this process runs the AMX tile kernels (linear and attention scores)."""
    return _ACTIVE.amx


def packs() -> bool:
    """True if pack() packs: a packed linear (AMX, or AVX512-BF16 without it) runs at any row count."""
    return _ACTIVE.packs is not None


def _bf16_cpu_input(x: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """bf16 CPU rows (any layout: the kernels copy them contiguous) and a contiguous bf16 bias or
    none: what every native linear takes."""
    return (
        x.dtype == torch.bfloat16
        and x.is_cpu
        and (bias is None or (bias.dtype == torch.bfloat16 and bias.is_contiguous()))
    )


def kernel_row_limit() -> int | None:
    """The most rows `linear` runs its bf16 kernel for: MAX_KERNEL_ROWS under the AVX-512 families
    where torch's bf16 matmul runs on bf16 dot products (library_bf16), no limit (None) under avx2
    and under avx512 on a CPU without them, where the kernel beats oneDNN at every row count.
    Decided by the family and the CPU once, never by a batch."""
    return _ACTIVE.row_limit


def _few_bf16_rows(x: torch.Tensor, bias: torch.Tensor | None, limit: int | None = MAX_KERNEL_ROWS) -> bool:
    """Whether a linear call is one the few-row kernels take: 1..limit (None: any number of) 2-D rows."""
    m = x.shape[0]
    return (
        _ACTIVE.native
        and 0 < m
        and (limit is None or m <= limit)
        and x.dim() == 2
        and _bf16_cpu_input(x, bias)
    )


def linear_row_invariant(weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether `linear` over this weight runs the kernel at every row count (kernel_row_limit() is
    None, a contiguous bf16 CPU weight and bias), so a row's bits never depend on the rows beside it or
    their number: the batch-invariant forward keeps such a linear as it is."""
    return (
        kernel_row_limit() is None
        and _ACTIVE.native
        and weight.dtype == torch.bfloat16
        and weight.is_cpu
        and weight.is_contiguous()
        and (bias is None or (bias.dtype == torch.bfloat16 and bias.is_contiguous()))
    )


def f32_kernel_weight(weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether the float32 kernel takes this weight: a contiguous float32 CPU weight, a contiguous
    float32 bias or none, under a vector family."""
    return (
        _ACTIVE.native
        and weight.dtype == torch.float32
        and weight.is_cpu
        and weight.is_contiguous()
        and (bias is None or (bias.dtype == torch.float32 and bias.is_contiguous()))
    )


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, any_rows: bool = False
) -> torch.Tensor:
    """F.linear(x, weight, bias) for 2-D x; the kernel for contiguous bf16 CPU rows, up to
    kernel_row_limit() of them (any number where it has none), and for float32 rows up to F32_KERNEL_ROWS
    of them, or any number with `any_rows` (the batch-invariant forward's linears: one kernel for
    every call, so a row's bits never depend on the call).

    The kernel's output for a row depends only on that row and the weights (one dot product per
    output, in a fixed order), never on how many rows share the call."""
    m = x.shape[0]
    if (
        0 < m
        and (any_rows or m <= F32_KERNEL_ROWS)
        and x.dim() == 2
        and x.dtype == torch.float32
        and x.is_cpu
        and f32_kernel_weight(weight, bias)
    ):
        out = torch.empty(m, weight.shape[0], dtype=torch.float32)
        _native.linear_f32(x.contiguous(), weight, bias, out, threads(), _ACTIVE.isa)
        return out
    fits = _few_bf16_rows(x, bias, kernel_row_limit())
    if not (fits and weight.dtype == torch.bfloat16 and weight.is_contiguous()):
        return F.linear(x, weight, bias)
    x = x.contiguous()
    n, k = weight.shape
    out = torch.empty(m, n, dtype=x.dtype)
    _native.linear_bf16(x, weight, bias, out, threads(), _ACTIVE.isa)
    return out


def packs_weight(weight: torch.Tensor, device: torch.device | None = None) -> bool:
    """True if pack(weight) packs it (ungated at least): a 2-D bf16 CPU weight under a packing
    family. `device`: where the weight will be, for one still on the meta device."""
    where = (device or weight.device).type
    return bool(_ACTIVE.packs) and weight.dim() == 2 and weight.dtype == torch.bfloat16 and where == "cpu"


def pack(weight: torch.Tensor, gated: bool = False) -> torch.Tensor | None:
    """weight [N, K] (bf16, CPU) in the packed linear's layout (AMX tiles, or AVX512-BF16 panels),
    a new tensor of about the same size (zero-padded to whole tiles); None where linear_packed
    cannot run on it (neither family, other dtype or device). The pack is a copy: a later change
    to `weight` does not reach it (packed_rows reads the weight back). gated: a fused [gate | up]
    weight packed for linear_packed_silu (gate rows a multiple of 32; None elsewhere): linear_packed
    cannot read it."""
    if gated and not (weight.dim() == 2 and weight.shape[0] % 64 == 0):
        return None
    if not packs_weight(weight):
        return None
    weight = weight.contiguous()
    n, k = weight.shape
    elems = _native.packed_amx_elems(n, k) if _ACTIVE.packs == "amx" else _native.packed_dpbf16_elems(n, k)
    out = huge_page_empty(elems, torch.bfloat16)
    if _ACTIVE.packs == "amx":
        _native.pack_amx(weight, out, gated, threads())
    else:
        _native.pack_dpbf16(weight, out, gated, threads())
    return out


def packed_rows(
    packed: torch.Tensor, shape: tuple[int, ...], ids: torch.Tensor, gated: bool = False
) -> torch.Tensor:
    """Rows `ids` (any shape of int ids, each in [0, N)) of the weight [N, K] = `shape` that
    pack(weight, gated) packed: [*ids.shape, K] bf16, the original values bit for bit. The pack is
    then the only copy a layer needs: its embedding rows and any caller of the plain weight read it
    back from there."""
    n, k = shape
    flat = ids.reshape(-1).to(torch.int64).contiguous()
    out = torch.empty(flat.numel(), k, dtype=torch.bfloat16)
    if flat.numel():  # IndexError from the native bounds check for an id outside [0, n)
        if _ACTIVE.packs == "amx":
            _native.packed_rows_amx(packed, n, k, gated, flat, out, threads())
        else:
            _native.packed_rows_dpbf16(packed, n, k, gated, flat, out, threads())
    return out.reshape(*ids.shape, k)


def linear_packed_silu(x: torch.Tensor, packed: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor | None:
    """silu(gate) * up of F.linear(x, [gate | up]) (weight.shape = `shape`, no bias) over pack(weight,
    gated=True), as silu_and_mul of linear_packed rounds it (the same bits) without the [.., 2I]
    intermediate. None where it cannot run."""
    n, k = shape
    if not (_ACTIVE.packs and x.dim() >= 1 and x.shape[-1] == k and _bf16_cpu_input(x, None)):
        return None
    m = x.numel() // k if k else 0
    out = torch.empty(*x.shape[:-1], n // 2, dtype=x.dtype)
    if m:
        fused = _native.linear_amx_silu if _ACTIVE.packs == "amx" else _native.linear_dpbf16_silu
        fused(x.reshape(m, k).contiguous(), packed, n, out.view(m, n // 2), threads())
    return out


def mlp_packed(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    down_shape: tuple[int, ...],
    bias: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """down_proj(silu(gate) * up) for x [rows, H] over pack(gate_up weight, gated=True) and
    pack(down weight [H, I] = `down_shape`): the bits of linear_packed_silu then linear_packed, with
    the [rows, I] intermediate written once, in the layout the down projection reads. None where it
    does not run (the caller takes the two steps): other families than AMX's, 32 rows or fewer (the
    few-row kernel reads its rows as they lie, so there is no packing to save)."""
    h, inter = down_shape
    if not (
        _ACTIVE.packs == "amx" and x.dim() == 2 and x.shape[0] > 32 and x.shape[1] == h and inter % 32 == 0
    ):
        return None
    if not _bf16_cpu_input(x, bias):
        return None
    out = torch.empty(x.shape[0], h, dtype=x.dtype)
    _native.mlp_amx(x.contiguous(), gate_up, down, bias, out, inter, threads())
    return out


def linear_packed(
    x: torch.Tensor,
    packed: torch.Tensor,
    shape: tuple[int, ...],
    bias: torch.Tensor | None = None,
    widen: bool = False,
) -> torch.Tensor | None:
    """F.linear(x, weight, bias) for bf16 CPU x [..., K] over pack(weight) (weight.shape = `shape`),
    at any row count. A row's output bits depend only on that row and the weight: never on the row
    count, the other rows or the thread count (each output is one chain of the unit's dot products
    over K in a fixed order), so the default and the batch-invariant forward share it. `widen`: the
    output as float32, the bf16 output's .float(). None where it cannot run (the caller keeps
    F.linear)."""
    n, k = shape
    if not (x.dim() >= 1 and x.shape[-1] == k and _bf16_cpu_input(x, bias)):
        return None
    m = x.numel() // k if k else 0
    # The AMX kernel stores the widened outputs itself, saving a pass over them. The AVX512-BF16
    # kernel converts afterwards: its float32 stores, made between the products of a loop bound by
    # its arithmetic, cost more than the pass they would save.
    amx = _ACTIVE.packs == "amx"
    out = torch.empty(*x.shape[:-1], n, dtype=torch.float32 if widen and amx else x.dtype)
    if m:
        run = _native.linear_amx if amx else _native.linear_dpbf16
        run(x.reshape(m, k).contiguous(), packed, n, bias, out.view(m, n), threads())
    return out.float() if widen else out


def pack_kind() -> int:
    """What LayerStack's packed linears are: 0 none, 1 AMX tiles, 2 AVX512-BF16 panels."""
    return {None: 0, "amx": 1, "dpbf16": 2}[_ACTIVE.packs]


def paged_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    tables: torch.Tensor,
    row_table: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    window: int | None,
    softcap: float | None,
    scorer: str | None = None,
) -> torch.Tensor | None:
    """Each query row over its paged K/V, read in place: q [N, h, d]; k_pool/v_pool [num_blocks,
    block_size, kvh, d]; tables [T, nb] block ids; row_table [N] which table a row reads; positions
    [N] (a row sees keys 0..position of its table, or the last `window` of them; its own K/V must
    already be in the cache). Returns [N, h, d], or None where the kernel cannot run (the caller
    keeps its torch path). A row's bits depend only on its query, position and keys, never on the
    other rows (csrc/cpu/attention.cpp, attend_block). IndexError (from the native bounds check) if a
    row's table, position or block id lies outside the tables or the pool. scorer: which unit scores
    bf16 rows, "fma" (float32 FMAs: AVX-512, or AVX2 under the avx2 family), "amx" (the tile unit) or
    "dp" (vdpbf16ps); None: the process's kernel family's (default_scorer()). Their bits differ;
    float32 rows always take "fma", and so does every row under the avx2 family (ValueError for
    another scorer there)."""
    if not attention_runs(q, k_pool, v_pool):
        return None
    scorer = scorer or default_scorer()
    if not scorer_runs(scorer):
        raise ValueError(f"attention scorer {scorer!r} does not run under kernel family {_ACTIVE.name}")
    n, h, d = q.shape
    if q.stride(2) != 1 or q.stride(1) != d:  # rows may be strided (views into the qkv output)
        q = q.contiguous()
    tables = tables.to(torch.int64).contiguous()
    row_table = row_table.to(torch.int64).contiguous()
    positions = positions.to(torch.int64).contiguous()
    out = torch.empty(n, h, d, dtype=q.dtype)
    if n == 0:
        return out
    _native.paged_attention(
        q,
        k_pool,
        v_pool,
        tables,
        row_table,
        positions,
        out,
        scale,
        softcap or 0.0,
        window or 0,
        SCORERS[scorer],
        threads(),
        _ACTIVE.isa,
    )
    return out


# csrc/cpu/attention.cpp's Scorer values.
SCORERS = {"fma": 0, "amx": 1, "dp": 2}
_SCORER_FAMILY = {"fma": "avx512", "amx": "amx", "dp": "avx512bf16"}


def default_scorer() -> str:
    """The attention scorer of this process's kernel family (the LayerStack's too)."""
    return {"amx": "amx", "avx512bf16": "dp"}.get(_ACTIVE.name, "fma")


def scorer_runs(name: str) -> bool:
    """Whether this process runs attention scorer `name`: under an AVX-512 family, any scorer whose
    family this machine runs (tests and benchmarks compare them); under avx2, "fma" alone."""
    if _ACTIVE.isa == ISA_AVX2:
        return name == "fma"
    return runs_family(_SCORER_FAMILY[name])


def attention_runs(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor) -> bool:
    """Whether paged_attention runs for these operands: decided by device, dtype and pool layout
    alone (the same for every row of a model), never by the rows themselves."""
    return (
        _ACTIVE.native
        and q.is_cpu
        and q.dtype in (torch.float32, torch.bfloat16)
        and k_pool.dtype == q.dtype
        and v_pool.dtype == q.dtype
        and k_pool.is_contiguous()
        and v_pool.is_contiguous()
    )


def decode_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    tables: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    window: int | None,
    softcap: float | None,
) -> torch.Tensor | None:
    """paged_attention for one query per sequence: row i reads tables[i] (q [B, h, d], tables
    [B, nb], positions [B])."""
    rows = torch.arange(q.shape[0])
    return paged_attention(q, k_pool, v_pool, tables, rows, positions, scale, window, softcap)


def _rowwise_ok(*tensors: torch.Tensor) -> bool:
    """Whether the row-wise kernels run: decided by device and dtype alone, never by layout (a
    [1, h, d] view is contiguous where a [n, h, d] one is not, and the batch-invariant forward
    needs every row to take the same path whatever the batch); other layouts are copied first."""
    first = tensors[0]
    return (
        _ACTIVE.native
        and first.is_cpu
        and first.dtype in (torch.float32, torch.bfloat16)
        and all(t.dtype == first.dtype for t in tensors[1:])
    )


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool, add: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(RMSNorm of s, s) with s = x + add (or x): over the last dim, row by row, rounded as the
    torch expressions of model/layers.py RMSNorm / GemmaRMSNorm (gemma: the (1 + weight) form).
    None where the kernel cannot run."""
    operands = (x, weight) if add is None else (x, weight, add)
    if not _rowwise_ok(*operands) or (add is not None and add.shape != x.shape):
        return None
    x, weight = x.contiguous(), weight.contiguous()
    add = None if add is None else add.contiguous()
    out = torch.empty_like(x)
    total = x if add is None else torch.empty_like(x)
    _native.rms_norm(x, add, None if add is None else total, weight, out, eps, gemma, threads(), _ACTIVE.isa)
    return out, total


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Rotate x [N, heads, head_dim] in place by cos/sin [N, 1, rot] (rot <= head_dim: partial
    rotary), rounded as model/rope.py apply_rotary. False (x untouched) where the kernel cannot run."""
    rot = cos.shape[-1]
    if not (
        _rowwise_ok(x, cos, sin)
        and x.dim() == 3
        and x.stride(-1) == 1
        and rot % 2 == 0
        and cos.shape == (x.shape[0], 1, rot)
        and sin.shape == cos.shape
    ):
        return False
    cos, sin = cos.contiguous(), sin.contiguous()
    _native.rope(x, cos, sin, threads(), _ACTIVE.isa)
    return True


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """silu(gate) * up for gate_up [..., 2 * I] = [gate | up] (the fused MLP input), rounded as
    F.silu(gate) * up. None where the kernel cannot run."""
    if not _rowwise_ok(gate_up) or gate_up.shape[-1] % 2:
        return None
    gate_up = gate_up.contiguous()
    out = gate_up.new_empty(*gate_up.shape[:-1], gate_up.shape[-1] // 2)
    _native.silu_and_mul(gate_up, out, threads(), _ACTIVE.isa)
    return out


def kv_write(
    k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> bool:
    """Slot slots[i] of the pools ([..., kv_heads, head_dim], kv_heads x head_dim elements a slot)
    = k[i] / v[i] ([N, kv_heads, head_dim]: views into the qkv projection's output), copied row by
    row over the kernels' threads. False (nothing written) where the kernel cannot run; a slot
    outside the pool is an IndexError."""
    if not (
        _rowwise_ok(k, v, k_pool, v_pool)
        and k.dim() == 3
        and v.shape == k.shape
        and v.stride() == k.stride()
        and k.stride(-1) == 1
        and k.stride(1) == k.shape[2]
        and k_pool.is_contiguous()
        and v_pool.is_contiguous()
        and slots.is_cpu
        and slots.dtype == torch.int64
    ):
        return False
    _native.kv_write(k, v, k_pool, v_pool, slots.contiguous(), threads())
    return True


def linear_int8(
    x: torch.Tensor, qweight: torch.Tensor, qscale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor | None:
    """(x @ qweight^T) * qscale (+ bias) for a few bf16 CPU rows over int8 weights [N, K] with
    float32 per-output-channel scales [N] (`weight_dtype: int8`). None where the kernel cannot run,
    the avx2 family included (the caller runs `linear` on its dequantized bf16 weight)."""
    m = x.shape[0]
    if not (avx512_available() and _few_bf16_rows(x, bias)):
        return None
    x = x.contiguous()
    n, k = qweight.shape
    out = torch.empty(m, n, dtype=x.dtype)
    _native.linear_int8(x, qweight, qscale, bias, out, threads())
    return out


def _vocab_row(x: np.ndarray) -> bool:
    """Whether the sampler's native passes take x: a contiguous float32 logits row, under the AVX-512
    kernels (without 64-bit vector multiplies the passes are slower than numpy's)."""
    return avx512_available() and x.dtype == np.float32 and x.ndim == 1 and x.flags.c_contiguous


def keyed_draw_screen(
    x: np.ndarray, temperature: float, seed: int, position: int
) -> tuple[int, float, float, float, bool] | None:
    """The keyed Gumbel-max draw's scores over one float32 logits row x [vocab] (sampling/sampler.py's
    draw without filters), screened in one native pass on the calling thread: (best token, its
    score, a bound on every other token's score, the token's uniform noise bit for bit as
    sampler.hash_uniform gives it, whether a logit was NaN), every score and bound within ~1e-14 of
    numpy's. Token -1: no finite largest logit (a NaN, +inf, or nothing but -inf). None where the
    AVX-512 kernels do not run (without 64-bit vector multiplies the pass is slower than numpy's), x
    is not a contiguous float32 row, or the sampling key does not fit 64 bits."""
    if not _vocab_row(x) or not -(1 << 63) <= seed < 1 << 64:  # the full draw reports a bad key
        return None
    return _native.keyed_draw_screen(
        torch.from_numpy(x), float(temperature), int_bits(seed), position, ISA_AVX512
    )


def keyed_best_ids(x: np.ndarray, temperature: float, width: int) -> np.ndarray | None:
    """The ids of the `width` largest x / T of one float32 logits row x [vocab] (float64, divided as
    numpy divides), by x / T descending then id ascending: sampling/sampler.py's _best_ids, selected
    natively. None where the AVX-512 kernels do not run, x is not a contiguous float32 row, or the
    native selection hands the row back (a NaN, a width of a quarter of the row or more, a tie at its
    cut): the caller then selects in numpy."""
    if not _vocab_row(x) or width < 1:
        return None
    out = np.empty(width, dtype=np.int64)
    got = _native.keyed_best_ids(
        torch.from_numpy(x), float(temperature), width, torch.from_numpy(out), ISA_AVX512
    )
    return out if got == width else None


def log_sum_exp(x: np.ndarray, temperature: float) -> tuple[float, float] | None:
    """The softmax normaliser of one float32 logits row x [vocab] over x / T in float64: (max, log of
    the sum of exp(x / T - max)), the max exact and the log-sum within ~1e-15 of numpy's. None where
    the AVX-512 kernels do not run, x is not a contiguous float32 row, or the row has a NaN or no
    finite maximum: the caller then takes numpy's log-softmax."""
    if not _vocab_row(x):
        return None
    return _native.log_sum_exp(torch.from_numpy(x), float(temperature), ISA_AVX512)


def stream_read_gbps(megabytes: int = 512, repeat: int = 5) -> float | None:
    """The machine's streaming read rate in GB/s at torch's thread count: the best of `repeat`
    single reads of a fresh `megabytes` buffer (larger than any cache), as a weight stream reads:
    on huge pages, as the packed weights lie (on 4 KB pages the probe reads slower than a weight
    stream does). None where the native kernels do not run."""
    if not _ACTIVE.native:
        return None
    buf = huge_page_empty(megabytes << 18, torch.float32).fill_(1.0)  # MB * 2**20 bytes / 4
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        _native.stream_read(buf, threads(), _ACTIVE.isa)
        best = min(best, time.perf_counter() - start)
    return buf.numel() * 4 / best / 1e9


def tile_tflops(operands: torch.Tensor, load: bool = False, rounds: int = 200_000) -> float | None:
    """The AMX tile unit's sustained rate in TFLOP/s at torch's thread count: rounds of four
    16 x 32 bf16 tile products, on the first four tiles of `operands` kept loaded (the unit's own
    rate), or with `load` each round's four loaded from the next 4 KB of `operands` in turn (a GEMM's
    inner loop, its operands in whichever cache their size fits). The rate depends on the values:
    zeros give the nominal rate, random ones what a GEMM can reach. None unless the amx family runs."""
    if not _ACTIVE.amx:
        return None
    return _native.tile_rate(operands.contiguous(), load, rounds, threads()) / 1e12


# The native entry points as torch ops, torch.ops.minisgl.<name>: each schema names its arguments
# and types and marks the tensors it writes, and the CPU implementation is the checked native
# function itself (a ValueError from C++ for a wrong device, dtype, shape or layout), so the
# profiler, torch.compile and the dispatcher see them. The wrappers above call the same native
# functions directly rather than through torch.ops: the dispatcher's round trip back into Python
# costs more per call than the checks themselves, and a decode step calls these a dozen times per
# layer (docs/architecture.md, "CPU kernels").
OP_SCHEMAS = {
    "linear_bf16": "(Tensor x, Tensor weight, Tensor? bias, Tensor(a!) out, int threads, int isa) -> ()",
    "pack_amx": "(Tensor weight, Tensor(a!) out, bool gated, int threads) -> ()",
    "packed_rows_amx": (
        "(Tensor packed, int n, int k, bool gated, Tensor ids, Tensor(a!) out, int threads) -> ()"
    ),
    "linear_amx": "(Tensor x, Tensor packed, int n, Tensor? bias, Tensor(a!) out, int threads) -> ()",
    "linear_amx_silu": "(Tensor x, Tensor packed, int n, Tensor(a!) out, int threads) -> ()",
    "mlp_amx": (
        "(Tensor x, Tensor gate_up, Tensor down, Tensor? bias, Tensor(a!) out, int inter, int threads) -> ()"
    ),
    "pack_dpbf16": "(Tensor weight, Tensor(a!) out, bool gated, int threads) -> ()",
    "packed_rows_dpbf16": (
        "(Tensor packed, int n, int k, bool gated, Tensor ids, Tensor(a!) out, int threads) -> ()"
    ),
    "linear_dpbf16": "(Tensor x, Tensor packed, int n, Tensor? bias, Tensor(a!) out, int threads) -> ()",
    "linear_dpbf16_silu": "(Tensor x, Tensor packed, int n, Tensor(a!) out, int threads) -> ()",
    "linear_int8": "(Tensor x, Tensor weight, Tensor scale, Tensor? bias, Tensor(a!) out, int threads) -> ()",
    "paged_attention": (
        "(Tensor q, Tensor k_pool, Tensor v_pool, Tensor tables, Tensor row_table, Tensor positions, "
        "Tensor(a!) out, float scale, float softcap, int window, int scorer, int threads, int isa) -> ()"
    ),
    "rms_norm": (
        "(Tensor x, Tensor? residual, Tensor(a!)? sum_out, Tensor weight, Tensor(b!) out, float eps, "
        "bool gemma, int threads, int isa) -> ()"
    ),
    "rope": "(Tensor(a!) x, Tensor cos, Tensor sin, int threads, int isa) -> ()",
    "silu_and_mul": "(Tensor gate_up, Tensor(a!) out, int threads, int isa) -> ()",
    "kv_write": "(Tensor k, Tensor v, Tensor(a!) k_pool, Tensor(b!) v_pool, Tensor slots, int threads) -> ()",
}
OP_NAMESPACE = "minisgl"


def _register_ops() -> torch.library.Library | None:
    """Define torch.ops.minisgl.* over the native functions (None where the extension is not built,
    or another copy of this module registered them first: a namespace is defined once a process)."""
    if (
        _native is None
        or hasattr(torch.ops, OP_NAMESPACE)
        and hasattr(getattr(torch.ops, OP_NAMESPACE), "rope")
    ):
        return None
    lib = torch.library.Library(OP_NAMESPACE, "DEF")
    for name, schema in OP_SCHEMAS.items():
        lib.define(name + schema)
        lib.impl(name, getattr(_native, name), "CPU")
    return lib


_OPS_LIBRARY = _register_ops()  # held: the registrations last as long as the Library object
