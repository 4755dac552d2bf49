"""Attention over the paged KV cache in Triton: the CUDA back-end's kernels, read in place.

Both kernels read K/V straight from the pool ([num_blocks, block_size, kv_heads, head_dim] per layer)
through block tables, so no context is gathered into a fresh tensor, and both run an online softmax
in float32 (the flash-attention recurrence), so no score matrix is materialised:

- `paged_decode_attention`: one query row per sequence (a decode step, or any row set: each row names
  its table and position). One program per (row, KV head) scores all the query heads of that KV
  head at once, so a GQA model reads each key once per row, not once per query head.
- `paged_prefill_attention`: the rows of one prompt chunk, a tile of queries per program, over the
  prefix already in the cache plus the causal part of the chunk itself (its K/V are written before
  attention runs). A tile stops at its last query's position, so key tiles wholly above the
  diagonal are never read, and in a sliding-window layer it starts at the first key its first
  query can see.

Softcapped scores (Gemma 2) and sliding windows (Mistral, Gemma) are switches of both kernels.

On a machine without a GPU the same kernels run under Triton's interpreter (TRITON_INTERPRET=1 set
before this module is imported) on CPU tensors; that is how the tests prove them. The interpreter
computes `tl.dot` of bfloat16 operands wrongly, so there both operands are widened to float32 first
(exact); on a GPU bfloat16 operands go to the tensor cores as they are. This module imports triton:
import it only where triton is installed (`available()` says so without importing it).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import threading
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

from minisgl_backend.model.layers import ServesEveryRow


def available() -> bool:
    """Whether triton is installed (this module can be imported)."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@triton.jit
def _softcap(s, cap):
    # tanh(x) = 1 - 2 / (exp(2x) + 1): saturates to +-1 without overflow trouble (exp -> inf gives 1)
    # and needs no libdevice call, which the interpreter does not have.
    return cap * (1.0 - 2.0 / (tl.exp(2.0 * s / cap) + 1.0))


@triton.jit
def _kv_tile(K, V, Table, n, nmask, dmask, dd, kvh, BS, stride_b, stride_s, stride_h, F32_DOT: tl.constexpr):
    """The K and V rows of keys `n` (masked by nmask, dims by dmask) of KV head kvh, read in place
    through one sequence's block table: the block that holds key n, then its slot (the keys of one
    tile may span several blocks); widened to float32 where the dot runs in it."""
    blk = tl.load(Table + n // BS, mask=nmask, other=0).to(tl.int64)
    kmask = nmask[:, None] & dmask[None, :]
    kv_off = blk[:, None] * stride_b + (n % BS)[:, None] * stride_s + kvh * stride_h + dd[None, :]
    k = tl.load(K + kv_off, mask=kmask, other=0.0)
    v = tl.load(V + kv_off, mask=kmask, other=0.0)
    if F32_DOT:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return k, v


@triton.jit
def _decode_kernel(
    Q,
    K,
    V,
    Out,
    Tables,
    RowTable,
    Pos,
    stride_qn,
    stride_qh,
    stride_b,
    stride_s,
    stride_h,
    stride_on,
    stride_oh,
    stride_t,
    scale,
    cap,
    window,
    BS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_ROW_TABLE: tl.constexpr,
    USE_CAP: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    F32_DOT: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    row = tl.program_id(0)
    kvh = tl.program_id(1)
    if HAS_ROW_TABLE:
        table = tl.load(RowTable + row).to(tl.int64)
    else:
        table = row.to(tl.int64)
    pos = tl.load(Pos + row).to(tl.int32)

    g = tl.arange(0, BLOCK_G)
    dd = tl.arange(0, BLOCK_D)
    gmask = g < GROUP
    dmask = dd < D
    heads = kvh * GROUP + g
    q = tl.load(
        Q + row.to(tl.int64) * stride_qn + heads[:, None] * stride_qh + dd[None, :],
        mask=gmask[:, None] & dmask[None, :],
        other=0.0,
    )
    if F32_DOT:
        q = q.to(tl.float32)

    hi = pos + 1  # keys 0..pos of this row's table
    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(pos - window + 1, 0)
    # Masked scores are -inf but the running max starts finite, so a tile with no visible key leaves
    # the state as it was (exp(-inf) = 0) instead of producing inf - inf.
    m_i = tl.full([BLOCK_G], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for start in range((lo // BLOCK_N) * BLOCK_N, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        nmask = (n < hi) & (n >= lo)
        k, v = _kv_tile(
            K,
            V,
            Tables + table * stride_t,
            n,
            nmask,
            dmask,
            dd,
            kvh,
            BS,
            stride_b,
            stride_s,
            stride_h,
            F32_DOT,
        )
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * scale
        if USE_CAP:
            s = _softcap(s, cap)
        s = tl.where(nmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(
        Out + row.to(tl.int64) * stride_on + heads[:, None] * stride_oh + dd[None, :],
        out.to(Out.dtype.element_ty),
        mask=gmask[:, None] & dmask[None, :],
    )


@triton.jit
def _prefill_kernel(
    Q,
    K,
    V,
    Out,
    Table,
    start_row,
    length,
    prefix,
    stride_qn,
    stride_qh,
    stride_b,
    stride_s,
    stride_h,
    stride_on,
    stride_oh,
    scale,
    cap,
    window,
    BS: tl.constexpr,
    GROUP: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_CAP: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    F32_DOT: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    tile = tl.program_id(0)
    head = tl.program_id(1)
    kvh = head // GROUP
    qi = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # query rows within the chunk
    qmask = qi < length
    qpos = prefix + qi  # their absolute positions
    dd = tl.arange(0, BLOCK_D)
    dmask = dd < D
    rows = (start_row + qi).to(tl.int64)
    q = tl.load(
        Q + rows[:, None] * stride_qn + head * stride_qh + dd[None, :],
        mask=qmask[:, None] & dmask[None, :],
        other=0.0,
    )
    if F32_DOT:
        q = q.to(tl.float32)

    # Causal: no query of this tile sees a key past its last query's position.
    hi = tl.minimum(prefix + (tile + 1) * BLOCK_M, prefix + length)
    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(prefix + tile * BLOCK_M - window + 1, 0)
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range((lo // BLOCK_N) * BLOCK_N, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        nmask = n < hi
        k, v = _kv_tile(K, V, Table, n, nmask, dmask, dd, kvh, BS, stride_b, stride_s, stride_h, F32_DOT)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * scale
        if USE_CAP:
            s = _softcap(s, cap)
        visible = nmask[None, :] & (n[None, :] <= qpos[:, None])
        if USE_WINDOW:
            visible = visible & (n[None, :] > qpos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
        m_i = m_new
    # Rows past the chunk's end saw no key (l = 0); they are not stored.
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        Out + rows[:, None] * stride_on + head * stride_oh + dd[None, :],
        out.to(Out.dtype.element_ty),
        mask=qmask[:, None] & dmask[None, :],
    )


def _pow2(x: int, least: int = 16) -> int:
    # tl.dot takes tiles of at least 16 along every dimension, and aranges are powers of two.
    return max(least, triton.next_power_of_2(x))


def _f32_dot(q: torch.Tensor) -> bool:
    return q.dtype == torch.float32 or interpreting()


def _dot_precision(q: torch.Tensor) -> str | None:
    # float32 operands in full precision (a GPU would round them to tf32 by default, far from the
    # CPU's float32 results); other operands at the tensor cores' own precision.
    return "ieee" if _f32_dot(q) else None


# Tiles and warps per program. Each program keeps a query tile, a K and a V tile, the scores and a
# float32 accumulator in registers; a variant whose tiles do not fit the registers of its warps
# spills to local memory, which on a GPU costs more than smaller tiles' extra loop trips. A 64-wide
# head in 16 bits keeps 4 warps and 64-key tiles (what has run on a GPU); wider heads and float32
# take 8 warps and the largest tiles at which no variant spills on the GPUs the back-end targets.
# `python -m minisgl_backend.tools.triton_check` compiles every launched variant for those GPUs
# and says where one would spill (no GPU needed).


class Tiles(NamedTuple):
    block_m: int  # query rows per program (prefill; decode scores one row's query heads)
    block_n: int  # keys per loop trip
    num_warps: int


def decode_tiles(head_dim: int, dtype: torch.dtype) -> Tiles:
    d = _pow2(head_dim)
    if dtype == torch.float32:
        return Tiles(0, 16 if d > 128 else 32, 8)
    return Tiles(0, 64, 4) if d <= 64 else Tiles(0, 64 if d <= 128 else 32, 8)


def prefill_tiles(head_dim: int, dtype: torch.dtype) -> Tiles:
    d = _pow2(head_dim)
    if dtype == torch.float32:
        return Tiles(32, 32, 8) if d <= 64 else Tiles(16, 32 if d <= 128 else 16, 8)
    return Tiles(64, 64, 4) if d <= 64 else Tiles(64, 32, 8) if d <= 128 else Tiles(16, 32, 8)


def _check_strides(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, out: torch.Tensor) -> None:
    # Both kernels take one set of strides for K and V (the pool's two tensors of one shape) and
    # index the head dim with unit stride.
    assert (
        q.stride(2) == 1
        and k_pool.stride(3) == 1
        and v_pool.stride() == k_pool.stride()
        and out.stride(2) == 1
    )


class Launch(NamedTuple):
    """One kernel launch: its grid, its runtime arguments in the kernel's order, its compile-time
    ones and its warps."""

    kernel: Any
    grid: tuple[int, ...]
    args: tuple[Any, ...]
    constexprs: dict[str, Any]
    num_warps: int


_captured = threading.local()


@contextlib.contextmanager
def captured_launches() -> Iterator[list[Launch]]:
    """Within it, this thread's kernel launches are recorded into the list it yields instead of
    run: the compile check (tools/triton_check.py) calls the launchers over meta tensors this way
    and compiles exactly the launches they would make, for a GPU it does not have."""
    before = getattr(_captured, "launches", None)
    launches: list[Launch] = []
    _captured.launches = launches
    try:
        yield launches
    finally:
        _captured.launches = before


def _launch(launch: Launch) -> None:
    record = getattr(_captured, "launches", None)
    if record is not None:
        record.append(launch)
    else:
        launch.kernel[launch.grid](*launch.args, **launch.constexprs, num_warps=launch.num_warps)


def paged_decode_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    tables: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    window: int | None,
    softcap: float | None,
    row_table: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """Each query row over its paged K/V: q [N, h, d] (rows may be strided views); k_pool/v_pool
    [num_blocks, block_size, kvh, d]; tables [T, nb] block ids; row i reads table row_table[i] (i when
    row_table is None) at keys 0..positions[i], or the last `window` of them. Returns out [N, h, d]
    in q's dtype. The same contract as cpu_kernels.paged_attention, without its bounds check: a
    table entry past a row's position is never read, but one at or before it must be a valid block.
    `block_n`: keys per tile (default: `decode_tiles`)."""
    n, h, d = q.shape
    kvh = k_pool.shape[2]
    group = h // kvh
    if out is None:
        out = torch.empty(n, h, d, dtype=q.dtype, device=q.device)
    if n == 0:
        return out
    _check_strides(q, k_pool, v_pool, out)
    assert tables.stride(1) == 1
    tiles = decode_tiles(d, q.dtype)
    args = (
        q,
        k_pool,
        v_pool,
        out,
        tables,
        tables if row_table is None else row_table,
        positions,
        q.stride(0),
        q.stride(1),
        *k_pool.stride()[:3],
        out.stride(0),
        out.stride(1),
        tables.stride(0),
        scale,
        softcap or 0.0,
        window or 0,
    )
    constexprs = dict(
        BS=k_pool.shape[1],
        GROUP=group,
        BLOCK_G=_pow2(group),
        D=d,
        BLOCK_D=_pow2(d),
        BLOCK_N=block_n or tiles.block_n,
        HAS_ROW_TABLE=row_table is not None,
        USE_CAP=softcap is not None,
        USE_WINDOW=window is not None,
        F32_DOT=_f32_dot(q),
        DOT_PREC=_dot_precision(q),
    )
    _launch(Launch(_decode_kernel, (n, kvh), args, constexprs, tiles.num_warps))
    return out


def paged_prefill_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_table: torch.Tensor,
    start: int,
    length: int,
    ctx_len: int,
    scale: float,
    window: int | None,
    softcap: float | None,
    out: torch.Tensor,
    block_m: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """The rows [start, start + length) of q [N, h, d], one prompt chunk ending at context length
    ctx_len, over its paged K/V (block_table [ceil(ctx_len / block_size)] block ids; the chunk's own
    K/V already written): row start + i is at position ctx_len - length + i and sees keys 0..that
    position (or the last `window` of them). Writes those rows of out [N, h, d] and returns out.
    `block_m`, `block_n`: query rows and keys per tile (default: `prefill_tiles`)."""
    h, d = q.shape[1], q.shape[2]
    kvh = k_pool.shape[2]
    if length == 0:
        return out
    _check_strides(q, k_pool, v_pool, out)
    assert block_table.dim() == 1 and block_table.stride(0) == 1
    tiles = prefill_tiles(d, q.dtype)
    block_m, block_n = block_m or tiles.block_m, block_n or tiles.block_n
    args = (
        q,
        k_pool,
        v_pool,
        out,
        block_table,
        start,
        length,
        ctx_len - length,
        q.stride(0),
        q.stride(1),
        *k_pool.stride()[:3],
        out.stride(0),
        out.stride(1),
        scale,
        softcap or 0.0,
        window or 0,
    )
    constexprs = dict(
        BS=k_pool.shape[1],
        GROUP=h // kvh,
        D=d,
        BLOCK_D=_pow2(d),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        USE_CAP=softcap is not None,
        USE_WINDOW=window is not None,
        F32_DOT=_f32_dot(q),
        DOT_PREC=_dot_precision(q),
    )
    _launch(Launch(_prefill_kernel, (triton.cdiv(length, block_m), h), args, constexprs, tiles.num_warps))
    return out


class TritonAttention(ServesEveryRow):
    """The attention back-end of a model on a GPU (model/loader.py picks it once, at load): every
    row of a batch through the kernels above, the decode rows in one launch and each prompt chunk
    in one. Reads only what the scheduler already put on the device (block tables, positions)
    and the chunks' lengths, which are host integers: nothing here waits for the device."""

    name = "triton"

    def __call__(
        self,
        q: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        batch,
        scale: float,
        window: int | None,
        softcap: float | None,
    ) -> torch.Tensor:
        """Attention output [N, h, d] of every row of `batch` (q [N, h, d]; the batch's K/V already
        written into the pool)."""
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        b = batch.num_decode
        if b:
            tables = batch.decode_block_tables
            paged_decode_attention(
                q[:b], k_pool, v_pool, tables, batch.positions[:b], scale, window, softcap, out=out[:b]
            )
        for chunk in batch.prefill_chunks:
            paged_prefill_attention(
                q,
                k_pool,
                v_pool,
                chunk.block_table,
                chunk.start,
                chunk.length,
                chunk.ctx_len,
                scale,
                window,
                softcap,
                out,
            )
        return out
