"""The batch-invariant forward pass (`EngineConfig.deterministic`).

A request's logits must not depend on how many rows share its batch, where its chunk boundaries
fall, which requests run beside it, or whether a token is computed by a prefill chunk or a decode
row. The default forward breaks all four (docs/determinism.md; `tests/model/test_batch_invariant.py`
checks this forward against them):

- `F.linear` (MKL sgemm, oneDNN for bf16): a row's bits depend on the row count M of the call,
  because the library picks a different blocking (and so a different summation order) per M, and
  which row counts agree differs by CPU, weight shape and dtype. What holds everywhere: inside ONE
  call of a fixed shape, a row's bits do not depend on its position or on the other rows. So **every linear
  runs on fixed row tiles** (`TiledLinear`): `ROW_TILE` rows (the last tile zero-padded), plus
  larger tiles only where a probe at `enable()` found that they give the same bits as `ROW_TILE`
  for that weight's shape on this machine (`tiles_for`), which keeps long prefills fast.
- SDPA's reduction over keys depends on the number of queries and keys in the call (chunked prefill
  differs from whole-prompt prefill, decode from prefill). So attention is computed here the same
  way for every query token: scores against keys padded to whole splits of `KV_SPLIT` keys (a score
  is one length-d dot product, invariant to the number of rows, keys and batched sequences, in
  fp32 and bf16), an exact max, then per split a fixed-shape
  `[rows, KV_SPLIT] @ [KV_SPLIT, d]` product and a fixed-length sum, and the splits combined by
  sequential float32 additions in key order. A query sees the same splits with the same contents
  whether it is one decode row or one of 256 prefill rows; padding splits add exact zeros.
- RoPE comes from a per-position table computed once (by the model's own Rotary, so every RoPE
  variant of `model/rope.py`), so a position's cos/sin never depend on the other positions in the batch.

Row-wise ops built from torch reductions (RMSNorm, residual adds, SiLU) reduce within one row only,
so they are invariant already and shared with the default path. The default path itself is left untouched.

On a CPU with the native kernels (docs/architecture.md, "CPU kernels") two of these give way to kernels whose
bits are row-invariant by construction: a packed linear (AMX or AVX512-BF16, `Linear.pack`), or a
bf16 linear under the avx2 family (its kernel at every row count), stays as it is instead of
becoming a TiledLinear (the default forward runs the same kernels), a float32 linear runs the
float32 kernel at every row count (`Linear.any_rows`; the default forward stops at
cpu_kernels.F32_KERNEL_ROWS), and attention for every row runs
through the model's attention back-end where that is row-invariant (`PagedAttention`, the native
paged kernels) instead of `attend`. Which path a model takes depends on its device, dtype, shapes,
the kernel family and the back-end chosen at load only, so every row of every batch takes the same one.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from minisgl_backend.arith import cdiv
from minisgl_backend.kvcache.storage import KVCache
from minisgl_backend.model import cpu_kernels
from minisgl_backend.model.batch import ForwardBatch
from minisgl_backend.model.layers import Attention, AttentionBackend, Linear, default_attention, take_rows
from minisgl_backend.model.llama import CausalLM, Ropes

ROW_MULTIPLE = 4  # attention's matmul row counts are padded to this (see attend)
ROW_TILE = 16  # every linear call has this many rows, or one of LARGER_TILES that the probe accepted
LARGER_TILES = (256, 64)
KV_SPLIT = 64  # keys per attention split: the fixed reduction length over keys (see attend)
LOG2E = 1.4426950408889634
QUERY_TILE = 256  # prefill queries per attention call: bounds the score matrix, not the result


Scratch = dict  # buffers by (name, shape, dtype), and "rows": row_tables(batch) of this forward


def _buffer(scratch: Scratch, key: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """A buffer (dtype and device of `like`) reused by every layer of one forward: fresh multi-MB
    tensors per layer pay page faults on every touch, which can cost more than the arithmetic done in
    them."""
    full = (key, shape, like.dtype)
    if full not in scratch:
        scratch[full] = torch.empty(shape, dtype=like.dtype, device=like.device)
    return scratch[full]


class TiledLinear(nn.Linear):
    """nn.Linear whose every call has a fixed row count: rows go in tiles of the sizes in `tiles`
    (largest first, each verified by `tiles_for` to agree with ROW_TILE), the rest in ROW_TILE tiles
    with the last zero-padded. A row's bits then depend only on the row itself."""

    tiles: tuple[int, ...] = (ROW_TILE,)
    packed = None  # never packed: the model's callers read Linear's attributes of it too
    gated = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = x.shape[0]
        if m == 0 or m in self.tiles:
            return F.linear(x, self.weight, self.bias)
        out, i = [], 0
        for t in self.tiles:
            while m - i >= t and t != ROW_TILE:
                out.append(F.linear(x[i : i + t], self.weight, self.bias))
                i += t
        while i < m:
            part = x[i : i + ROW_TILE]
            n = part.shape[0]
            if n < ROW_TILE:
                part = torch.cat([part, part.new_zeros(ROW_TILE - n, *part.shape[1:])])
            out.append(F.linear(part, self.weight, self.bias)[:n])
            i += n
        return out[0] if len(out) == 1 else torch.cat(out)


def tiles_for(weight: torch.Tensor, bias: torch.Tensor | None) -> tuple[int, ...]:
    """The tile sizes whose calls give a row the same bits as a ROW_TILE call, for this weight's
    shape, dtype and device on this machine and the current thread count (kernels are chosen by
    all of them), probed with random rows at three offsets inside the tile."""
    g = torch.Generator(device=weight.device).manual_seed(0)
    k = weight.shape[1]

    def rand(m: int) -> torch.Tensor:
        return torch.randn(m, k, generator=g, device=weight.device).to(weight.dtype)

    probe = rand(ROW_TILE)
    ref = F.linear(probe, weight, bias)
    ok = [ROW_TILE]
    for t in LARGER_TILES:
        agree = True
        for at in (0, t // 3, t - ROW_TILE):  # aligned, misaligned and last: kernel tails differ
            x = rand(t)
            x[at : at + ROW_TILE] = probe
            agree = agree and torch.equal(F.linear(x, weight, bias)[at : at + ROW_TILE], ref)
        if agree:
            ok.append(t)
    return tuple(sorted(ok, reverse=True))


def context(
    kv: KVCache, layer: int, block_tables: torch.Tensor, length: int, scratch: Scratch
) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V of `length` keys per sequence through block_tables [B, nb], as [B, kvh, W, d] with
    W = `length` rounded up to whole splits. Keys past a sequence's own length are masked by
    position in `attend`; they hold whatever finite values their block (or block 0, which pads
    the tables) holds."""
    width = cdiv(length, KV_SPLIT) * KV_SPLIT
    bs = kv.block_size
    nbk = cdiv(width, bs)
    tables = block_tables[:, :nbk]
    if tables.shape[1] < nbk:
        tables = torch.cat([tables, tables.new_zeros(tables.shape[0], nbk - tables.shape[1])], dim=1)
    bsz = tables.shape[0]
    out = []
    for name, pool in (("k", kv.k[layer]), ("v", kv.v[layer])):
        kvh, d = pool.shape[-2:]
        raw = _buffer(scratch, name + "-raw", (bsz * nbk, bs, kvh, d), pool)
        torch.index_select(pool, 0, tables.reshape(-1), out=raw)
        f = _buffer(scratch, name, (bsz, kvh, width, d), pool)
        f.copy_(raw.view(bsz, nbk * bs, kvh, d)[:, :width].transpose(1, 2))  # head-major
        out.append(f)
    return out[0], out[1]


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    scale: float,
    window: int | None = None,
    cap: float | None = None,
) -> torch.Tensor:
    """Causal attention with bits that depend only on each query's own context.

    q [B, M, h, d]; k, v [B, kvh, W, d] from `context` (key j is absolute position j; keys past a
    query's position are masked, and in a sliding-window layer keys at or before position - window);
    q_pos [B, M]; cap: Gemma 2's score soft-capping. The two products run in the K/V dtype (bf16 products
    are row-invariant for these shapes too, and skip a float32 copy of every key); softmax
    and the combine run in float32. Returns float32 [B, M, h, d]. Window and soft-capping are
    elementwise on the scores, and a wholly masked split adds exact zeros, so neither changes the
    invariance argument.
    """
    bsz, m, h, d = q.shape
    kvh, width = k.shape[1], k.shape[2]
    g, splits = h // kvh, width // KV_SPLIT
    # One matmul row per (query, head of the group), padded to a multiple of ROW_MULTIPLE rows.
    rows = m * g
    # Scores in log2 units: torch's CPU exp2 is much cheaper than its exp.
    # (With soft-capping the scale cannot be folded: cap * tanh(s / cap) needs the plain score s.)
    qscale = scale * LOG2E if cap is None else scale
    qg = (q.float() * qscale).to(k.dtype).view(bsz, m, kvh, g, d).transpose(1, 2).reshape(bsz, kvh, rows, d)
    row_pos = q_pos[:, :, None].expand(bsz, m, g).reshape(bsz, rows)
    pad = -rows % ROW_MULTIPLE
    if pad:
        qg = torch.cat([qg, qg.new_zeros(bsz, kvh, pad, d)], dim=2)
        row_pos = torch.cat([row_pos, row_pos.new_zeros(bsz, pad)], dim=1)  # pad rows see key 0 only
    r = rows + pad
    # A score is one length-d dot product: its bits do not depend on how many keys share the call
    # (see the module docstring), so all keys go in one product per (sequence, kv head).
    scores = torch.matmul(qg, k.transpose(-1, -2)).float()  # [B, kvh, R, W]
    if cap is not None:
        scores = torch.tanh(scores / cap) * (cap * LOG2E)
    keys = torch.arange(width, device=row_pos.device)[None, None, :]
    hidden = keys > row_pos[:, :, None]  # [B, R, W]
    if window is not None:
        hidden |= keys <= row_pos[:, :, None] - window
    scores.masked_fill_(hidden[:, None], float("-inf"))
    probs = torch.exp2(scores - scores.amax(-1, keepdim=True))  # the max is exact in any order
    # The sums over keys are where order matters: split-major [B, kvh, splits, R, KV_SPLIT], so each
    # split is one fixed-shape product and one fixed-length sum.
    probs = probs.view(bsz, kvh, r, splits, KV_SPLIT).transpose(2, 3).contiguous()
    den_parts = probs.sum(-1)  # [B, kvh, splits, R]
    num_parts = torch.matmul(
        probs.to(v.dtype), v.view(bsz, kvh, splits, KV_SPLIT, d)
    ).float()  # [B,kvh,splits,R,d]
    num, den = num_parts[:, :, 0], den_parts[:, :, 0]
    for s in range(1, splits):  # sequential combine in key order: padding splits add exact zeros
        num = num + num_parts[:, :, s]
        den = den + den_parts[:, :, s]
    out = (num / den[..., None])[:, :, :rows]  # [B, kvh, rows, d]
    return out.view(bsz, kvh, m, g, d).transpose(1, 2).reshape(bsz, m, h, d)


class BatchInvariantForward:
    """The deterministic forward of one CausalLM (a model/llama.py Forward; holds its RoPE tables)."""

    def __init__(self, model: CausalLM, attention: AttentionBackend) -> None:
        # The model's attention back-end: attended through as it is where it is row-invariant (the
        # native paged kernels), else replaced by this forward's own tiled attention.
        self.attention = attention
        positions = torch.arange(model.spec.max_position_embeddings, device=model.device)
        # [max_pos, 1, rotary dim] float32 cos/sin per RoPE of the model, computed once by the same
        # Rotary (so the same variant) as the default path.
        self.tables = [rotary(positions, torch.float32) for rotary in model.model.rotary]

    def _attention(
        self,
        attn: Attention,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        batch: ForwardBatch,
        kv: KVCache,
        scratch: Scratch,
        keep: torch.Tensor | None,
    ) -> torch.Tensor:
        n = batch.input_ids.shape[0]
        q, k, v = attn.qkv(x, rope, n)
        attn.write_kv(kv, batch.slot_mapping, k, v)
        scale, window, cap = attn.scale, attn.window, attn.softcap
        if self.attention.row_invariant:  # every row of every call, or none
            if "plan" not in scratch:  # the same for every layer of the forward
                scratch["plan"] = self.attention.plan(batch, kv, [window])
            o = self.attention.attend(attn, q, k, v, batch, kv, scratch["plan"], keep)
            return attn.o_proj(o.view(o.shape[0], attn.h * attn.d))
        out = x.new_zeros(x.shape[0], attn.h, attn.d)  # row padding stays zero
        b = batch.num_decode
        if b:
            pos = batch.positions[:b]
            assert batch.decode_block_tables is not None  # decode rows have tables
            kc, vc = context(kv, attn.layer_id, batch.decode_block_tables, int(pos.max()) + 1, scratch)
            out[:b] = attend(q[:b, None], kc, vc, pos[:, None], scale, window, cap)[:, 0]
        for chunk in batch.prefill_chunks:  # every chunk reads its whole context back from the cache
            kr, vr = context(kv, attn.layer_id, chunk.block_table[None], chunk.ctx_len, scratch)
            for s in range(chunk.start, chunk.start + chunk.length, QUERY_TILE):
                e = min(s + QUERY_TILE, chunk.start + chunk.length)
                out[s:e] = attend(q[None, s:e], kr, vr, batch.positions[None, s:e], scale, window, cap)[0]
        return attn.o_proj(take_rows(out.view(x.shape[0], attn.h * attn.d), keep))

    def ropes(self, model: CausalLM, positions: torch.Tensor, dtype: torch.dtype) -> Ropes:
        return [(cos[positions].to(dtype), sin[positions].to(dtype)) for cos, sin in self.tables]

    def layers(
        self, model: CausalLM, x: torch.Tensor, ropes: Ropes, batch: ForwardBatch, kv: KVCache
    ) -> torch.Tensor:
        scratch: Scratch = {}

        def attend_layer(attn: Attention, h: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
            return self._attention(attn, h, ropes[attn.rope_index], batch, kv, scratch, keep)

        return model.model.layers.run(x, attend_layer, batch.logits_index)


def _row_invariant(lin: nn.Linear) -> bool:
    if not isinstance(lin, Linear) or lin.qweight is not None:
        return False
    return lin.packed is not None or lin.any_rows or cpu_kernels.linear_row_invariant(lin.weight, lin.bias)


def enable(model: CausalLM, attention: AttentionBackend | None = None) -> BatchInvariantForward:
    """Make `model`'s linears row-invariant and return the batch-invariant forward that runs it, over
    the model's attention back-end (None: default_attention for its device and dtype; call on the
    compute thread: builds a table and probes the tile sizes of each distinct linear shape)."""
    probed: dict[tuple, tuple[int, ...]] = {}
    # A packed Linear (AMX or AVX512-BF16 kernel at every row count, no int8 path) is row-invariant
    # as it is, and so is a bf16 Linear under the avx2 family (its kernel at every row count). A
    # float32 Linear the kernels take runs its kernel at every row count from here on (any_rows).
    # Any other linear would send few-row calls to a kernel whose bits differ from the library's:
    # it becomes a TiledLinear, whose calls are all library calls of probed shapes.
    for mod in model.modules():
        if (
            type(mod) is Linear
            and mod.qweight is None
            and cpu_kernels.f32_kernel_weight(mod.weight, mod.bias)
        ):
            mod.any_rows = True
    linears = [mod for mod in model.modules() if isinstance(mod, nn.Linear) and not _row_invariant(mod)]
    for lin in [mod for mod in linears if not isinstance(mod, TiledLinear)]:
        if isinstance(lin, Linear):
            model.unpack_layer(lin)  # F.linear reads the weight in its own layout
        key = (tuple(lin.weight.shape), lin.weight.dtype, lin.bias is not None)
        if key not in probed:
            with torch.no_grad():
                probed[key] = tiles_for(lin.weight, lin.bias)
        lin.__class__ = TiledLinear
        cast(TiledLinear, lin).tiles = probed[key]
    if attention is None:
        attention = default_attention(model.device, model.lm_head.weight.dtype)
    return BatchInvariantForward(model, attention)
