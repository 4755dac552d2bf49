"""Batch-independent sampling on the CPU (S8, S16).

A random draw is Gumbel-max: argmax over allowed tokens t of logits[t]/T + G(seed, pos, t), where
G is Gumbel noise made from a stateless 32-bit hash of (request seed, absolute position, token id).
Nothing depends on the batch slot, the step count or chunk boundaries, so a request replays exactly
under any scheduling, and requests never share RNG state.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

from minisgl_backend.types import SamplingParams, TokenLogprob

_MASK32 = 0xFFFFFFFF


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's finaliser on int64 tensors holding 32-bit values (products wrap, then are masked)."""
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _MASK32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _MASK32
    return h ^ (h >> 16)


def hash_uniform(seeds: torch.Tensor, positions: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Uniform (0, 1) float64 noise per (seed[r], position[r], token_ids[r, c]); pure function."""
    s = seeds.to(torch.int64)
    row = _fmix32((_fmix32(s & _MASK32) ^ _fmix32((s >> 32) & _MASK32) ^ 0x2545F491) & _MASK32)
    row = _fmix32((row + positions.to(torch.int64) * 0x9E3779B1) & _MASK32)
    h = _fmix32((row[:, None] ^ ((token_ids.to(torch.int64) * 0x27D4EB2F) & _MASK32)) & _MASK32)
    h = _fmix32((h + 0x165667B1) & _MASK32)
    return (h.double() + 0.5) / 4294967296.0


class SampleRow(NamedTuple):
    params: SamplingParams
    seed: int
    position: int  # absolute position of the token being drawn
    output_ids: Sequence[int]  # what logits processors see


def apply_processors(logits: torch.Tensor, rows: Sequence[SampleRow]) -> tuple[torch.Tensor, dict[int, Exception]]:
    """Run each row's logits processors; a failing row is reported by index, not raised."""
    errors: dict[int, Exception] = {}
    todo = [i for i, r in enumerate(rows) if r.params.logits_processors]
    if todo:
        logits = logits.clone()
        for i in todo:
            try:
                for fn in rows[i].params.logits_processors:
                    logits[i] = fn(rows[i].output_ids, logits[i])
            except Exception as e:  # noqa: BLE001 - user code; its request fails, the batch goes on
                errors[i] = e
    return logits, errors


def sample(logits: torch.Tensor, rows: Sequence[SampleRow]) -> list[int]:
    """Draw one token per row from float32 CPU logits [R, V] (already processed)."""
    out = logits.argmax(dim=-1).tolist()  # greedy rows keep this
    rnd = [i for i, r in enumerate(rows) if not r.params.greedy]
    if rnd:
        picked = _sample_random(logits[rnd], [rows[i] for i in rnd])
        for i, t in zip(rnd, picked):
            out[i] = t
    return out


def _sample_random(logits: torch.Tensor, rows: list[SampleRow]) -> list[int]:
    r, vocab = logits.shape
    ps = [row.params for row in rows]
    x = logits / torch.tensor([p.temperature for p in ps], dtype=torch.float32)[:, None]
    if any(p.top_k or p.top_p < 1.0 or p.min_p > 0.0 for p in ps):
        # Filters need tokens in descending order; a top-k prefilter keeps that sort small.
        width = min(vocab, max(p.top_k for p in ps)) if all(p.top_k for p in ps) else vocab
        vals, ids = x.topk(width, dim=-1, sorted=True)
        ks = torch.tensor([p.top_k or width for p in ps])[:, None]
        cut = torch.arange(width)[None, :] >= ks
        probs = torch.softmax(vals.masked_fill(cut, float("-inf")), dim=-1)
        cut |= (probs.cumsum(-1) - probs) >= torch.tensor([p.top_p for p in ps])[:, None]
        cut |= probs < torch.tensor([p.min_p for p in ps])[:, None] * probs[:, :1]
        vals = vals.masked_fill(cut, float("-inf"))
    else:
        vals, ids = x, torch.arange(vocab).expand(r, vocab)
    u = hash_uniform(
        torch.tensor([row.seed for row in rows]), torch.tensor([row.position for row in rows]), ids
    )
    gumbel = -torch.log(-torch.log(u))
    choice = (vals.double() + gumbel).argmax(dim=-1, keepdim=True)
    return ids.gather(1, choice).squeeze(1).tolist()


def token_logprobs(logits: torch.Tensor, token_ids: Sequence[int], num_top: int) -> list[TokenLogprob]:
    """Logprob, rank and top alternatives of given tokens under raw float32 logits [R, V]."""
    lp = torch.log_softmax(logits, dim=-1)
    tok = torch.tensor(token_ids, dtype=torch.int64)[:, None]
    chosen = lp.gather(1, tok)
    ranks = ((lp > chosen).sum(dim=-1) + 1).tolist()
    chosen = chosen.squeeze(1).tolist()
    if num_top:
        top_v, top_i = lp.topk(num_top, dim=-1)
        tops = [tuple(zip(i, v)) for i, v in zip(top_i.tolist(), top_v.tolist())]
    else:
        tops = [()] * len(token_ids)
    return [TokenLogprob(t, c, k, top) for t, c, k, top in zip(token_ids, chosen, ranks, tops)]
