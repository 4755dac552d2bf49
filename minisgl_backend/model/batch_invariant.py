"""The batch-invariant forward pass (`EngineConfig.deterministic`).

A request's logits must not depend on how many rows share its batch, where its chunk boundaries
fall, which requests run beside it, or whether a token is computed by a prefill chunk or a decode
row. The default forward breaks all four on this CPU (measured, `shared/notes/FIELD_NOTES.md` §5
and `tests/test_batch_invariant.py`):

- fp32 `F.linear` / `matmul` (MKL sgemm): a row's bits depend on the row count M when M < 12 and
  M is not a multiple of 4 (the last M % 4 rows take a different kernel tail). Every multiple of 4,
  up to 2048 rows and for every weight shape of the supported models, gives the same bits for a
  given row at any position, whatever the other rows hold; bf16 was invariant for every M.
  So: **every matmul runs on a row count padded to a multiple of 4** (`ROW_MULTIPLE`).
- SDPA's reduction over keys depends on the number of queries and keys in the call (chunked prefill
  differs from whole-prompt prefill, decode from prefill). So attention is computed here the same
  way for every query token: scores against keys padded to whole splits of `KV_SPLIT` keys (a score
  is one length-d dot product; measured invariant to the number of rows, keys and batched
  sequences, in fp32 and bf16), an exact max, then per split a fixed-shape
  `[rows, KV_SPLIT] @ [KV_SPLIT, d]` product and a fixed-length sum, and the splits combined by
  sequential float32 additions in key order. A query sees the same splits with the same contents
  whether it is one decode row or one of 256 prefill rows; padding splits add exact zeros.
- RoPE comes from a per-position table computed once, so a position's cos/sin never depend on the
  other positions in the batch.

Row-wise ops built from torch reductions (RMSNorm, residual adds, SiLU) were measured invariant and
are shared with the default path. The default path itself is left untouched.
"""

from __future__ import annotations

import torch

from minisgl_backend.kvcache.storage import KVCache
from minisgl_backend.model.llama import Attention, CausalLM, ForwardBatch

ROW_MULTIPLE = 4  # matmul row counts are padded to this (see the module docstring)
KV_SPLIT = 64  # keys per attention split: the fixed reduction length over keys (see attend)
LOG2E = 1.4426950408889634
QUERY_TILE = 256  # prefill queries per attention call: bounds the score matrix, not the result


def pad_rows(x: torch.Tensor, multiple: int = ROW_MULTIPLE) -> torch.Tensor:
    """x [M, ...] with zero rows appended up to a multiple of `multiple` (x itself when aligned)."""
    extra = -x.shape[0] % multiple
    return torch.cat([x, x.new_zeros(extra, *x.shape[1:])]) if extra else x


Scratch = dict[tuple, torch.Tensor]


def _buffer(scratch: Scratch, key: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """A buffer (dtype and device of `like`) reused by every layer of one forward: fresh multi-MB
    tensors per layer pay page faults on every touch (measured: a bf16 SmolLM2 decode step at batch 8,
    832 keys, took ~600 ms with them and ~240 ms with reuse)."""
    full = (key, shape, like.dtype)
    if full not in scratch:
        scratch[full] = torch.empty(shape, dtype=like.dtype, device=like.device)
    return scratch[full]


def context(kv: KVCache, layer: int, block_tables: torch.Tensor, length: int,
            scratch: Scratch) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V of `length` keys per sequence through block_tables [B, nb], as [B, kvh, W, d] with
    W = `length` rounded up to whole splits. Keys past a sequence's own length are masked by
    position in `attend`; they hold whatever finite values their block (or block 0, which pads
    the tables) holds."""
    width = -(-length // KV_SPLIT) * KV_SPLIT
    bs = kv.block_size
    nbk = -(-width // bs)
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


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention with bits that depend only on each query's own context.

    q [B, M, h, d]; k, v [B, kvh, W, d] from `context` (key j is absolute position j; keys past a
    query's position are masked); q_pos [B, M]. The two products run in the K/V dtype (bf16 ones
    were measured invariant for these shapes too, and skip a float32 copy of every key); softmax
    and the combine run in float32. Returns float32 [B, M, h, d].
    """
    bsz, m, h, d = q.shape
    kvh, width = k.shape[1], k.shape[2]
    g, splits = h // kvh, width // KV_SPLIT
    # One matmul row per (query, head of the group), padded to a multiple of ROW_MULTIPLE rows.
    rows = m * g
    # Scores in log2 units: exp2 is ~7x faster than exp in this torch build on this CPU (measured).
    qg = (q.float() * (scale * LOG2E)).to(k.dtype).view(bsz, m, kvh, g, d).transpose(1, 2).reshape(bsz, kvh, rows, d)
    row_pos = q_pos[:, :, None].expand(bsz, m, g).reshape(bsz, rows)
    pad = -rows % ROW_MULTIPLE
    if pad:
        qg = torch.cat([qg, qg.new_zeros(bsz, kvh, pad, d)], dim=2)
        row_pos = torch.cat([row_pos, row_pos.new_zeros(bsz, pad)], dim=1)  # pad rows see key 0 only
    r = rows + pad
    # A score is one length-d dot product: its bits do not depend on how many keys share the call
    # (measured, see the module docstring), so all keys go in one product per (sequence, kv head).
    scores = torch.matmul(qg, k.transpose(-1, -2)).float()  # [B, kvh, R, W]
    hidden = torch.arange(width, device=row_pos.device)[None, None, :] > row_pos[:, :, None]  # [B, R, W]
    scores.masked_fill_(hidden[:, None], float("-inf"))
    probs = torch.exp2(scores - scores.amax(-1, keepdim=True))  # the max is exact in any order
    # The sums over keys are where order matters: split-major [B, kvh, splits, R, KV_SPLIT], so each
    # split is one fixed-shape product and one fixed-length sum.
    probs = probs.view(bsz, kvh, r, splits, KV_SPLIT).transpose(2, 3).contiguous()
    den_parts = probs.sum(-1)  # [B, kvh, splits, R]
    num_parts = torch.matmul(probs.to(v.dtype), v.view(bsz, kvh, splits, KV_SPLIT, d)).float()  # [B,kvh,splits,R,d]
    num, den = num_parts[:, :, 0], den_parts[:, :, 0]
    for s in range(1, splits):  # sequential combine in key order: padding splits add exact zeros
        num = num + num_parts[:, :, s]
        den = den + den_parts[:, :, s]
    out = (num / den[..., None])[:, :, :rows]  # [B, kvh, rows, d]
    return out.view(bsz, kvh, m, g, d).transpose(1, 2).reshape(bsz, m, h, d)


class BatchInvariantForward:
    """The deterministic forward of one CausalLM (holds its RoPE table)."""

    def __init__(self, model: CausalLM) -> None:
        spec = model.spec
        rotary = model.model.rotary
        positions = torch.arange(spec.max_position_embeddings)
        freqs = positions.float()[:, None] * rotary.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos, self.sin = emb.cos(), emb.sin()  # [max_pos, head_dim] float32, computed once

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[positions].to(dtype)[:, None, :], self.sin[positions].to(dtype)[:, None, :]

    def _attention(self, attn: Attention, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                   batch: ForwardBatch, kv: KVCache, scratch: Scratch) -> torch.Tensor:
        n = batch.input_ids.shape[0]
        q, k, v = attn.qkv(x, rope, n)
        kv.write(attn.layer_id, batch.slot_mapping, k, v)
        scale = attn.d**-0.5
        out = x.new_zeros(x.shape[0], attn.h, attn.d)  # row padding stays zero
        b = batch.num_decode
        if b:
            pos = batch.positions[:b]
            kc, vc = context(kv, attn.layer_id, batch.decode_block_tables, int(pos.max()) + 1, scratch)
            out[:b] = attend(q[:b, None], kc, vc, pos[:, None], scale)[:, 0]
        for row in batch.prefill_rows:  # every chunk reads its whole context back from the cache
            kr, vr = context(kv, attn.layer_id, row.block_table[None], row.ctx_len, scratch)
            for s in range(row.start, row.start + row.length, QUERY_TILE):
                e = min(s + QUERY_TILE, row.start + row.length)
                out[s:e] = attend(q[None, s:e], kr, vr, batch.positions[None, s:e], scale)[0]
        return attn.o_proj(out.view(x.shape[0], attn.h * attn.d))

    def forward(self, model: CausalLM, batch: ForwardBatch, kv: KVCache) -> torch.Tensor:
        """Same contract as CausalLM.forward: logits [len(batch.logits_index), vocab], model dtype."""
        m = model.model
        x = pad_rows(m.embed_tokens(batch.input_ids))  # padded once: every layer's matmuls see it
        rope = self._rope(batch.positions, x.dtype)
        scratch: Scratch = {}
        for layer in m.layers:
            x = x + self._attention(layer.self_attn, layer.input_layernorm(x), rope, batch, kv, scratch)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        wanted = batch.logits_index.shape[0]
        return model.lm_head(m.norm(pad_rows(x[batch.logits_index])))[:wanted]


def enable(model: CausalLM) -> None:
    """Switch `model` to the batch-invariant forward (call on the compute thread: builds a table)."""
    model.batch_invariant = BatchInvariantForward(model)
