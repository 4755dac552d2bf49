"""What the CPU draw can pick, reduced on the device before the copy: a few candidates per row
instead of the whole vocabulary.

The keyed draw (sampler.py) is an argmax: of the logits for a greedy row, of logits / T + Gumbel
noise G(seed, position, token) for a random one. The noise is a pure function of its key, so the
device can compute the same scores (the same 64-bit hash, bit for bit, in int64 arithmetic that wraps
as uint64 does) and keep each row's best `k` by score, and the (k+1)-th score as a bound on every token
it left out. The CPU then recomputes the candidates' scores exactly as the full draw does (numpy,
float64) and takes their argmax. That is the full draw's token whenever the winner's exact score
clears the bound by more than the device's float64 rounding could move any score (`margin`): no token
left out can then reach it. A row that does not clear it, and a row whose draw depends on more than
its scores (top-k / top-p / min-p filters, logit_bias and penalties, logits processors, logprobs),
takes the full row instead (`draw_reduced` answers None for it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from minisgl_backend.arith import int_bits
from minisgl_backend.sampling.sampler import SampleRow, hash_uniform, margin


def _shr(h: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's >> on int64 is arithmetic)."""
    return (h >> s) & ((1 << (64 - s)) - 1)


def _mix64(h: torch.Tensor) -> torch.Tensor:
    h = (h ^ _shr(h, 30)) * int_bits(0xBF58476D1CE4E5B9)
    h = (h ^ _shr(h, 27)) * int_bits(0x94D049BB133111EB)
    return h ^ _shr(h, 31)


def hash_uniform_torch(seeds: torch.Tensor, positions: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """sampler.hash_uniform in torch on any device, the same bits: seeds [R] (int64 holding the
    bits of each uint64 sampling key), positions [R], token_ids [R, C] -> float64 [R, C]."""
    row = _mix64(_mix64(seeds ^ int_bits(0x9E3779B97F4A7C15)) + positions * int_bits(0xD1B54A32D192ED03))
    h = _mix64(row[:, None] ^ (token_ids * int_bits(0xA24BAED4963EE407)))
    return (_shr(h, 11).double() + 0.5) / float(1 << 53)


class Candidates(NamedTuple):
    """Per row: the `k` best tokens by draw score, their logits, and the (k+1)-th best score."""

    # Tensors on the device, numpy arrays once copied (numpy()).
    ids: Any  # [R, k] int64
    logits: Any  # [R, k] float32
    bound: Any  # [R] float64: no token outside `ids` scores above it

    def numpy(self) -> Candidates:
        return Candidates(*(t.cpu().numpy() for t in self))


def reduce_for_draw(
    logits: torch.Tensor,
    seeds: torch.Tensor | Sequence[int],
    positions: torch.Tensor | Sequence[int],
    temperatures: torch.Tensor | Sequence[float],
    k: int,
) -> Candidates:
    """On the logits' device: each row's `k` best tokens by the score its draw maximises (logits
    for temperature 0, logits / T + G(seed, position, token) otherwise). logits [R, V] float; the
    keys as tensors on that device (seeds holding the uint64 bits as int64), or as host values.
    Nothing here waits for the device: greedy and random rows are scored alike, and the greedy
    ones then keep their logits."""
    dev = logits.device
    x = logits.double()
    if not isinstance(seeds, torch.Tensor):
        seeds = torch.tensor([int_bits(s) for s in seeds], dtype=torch.int64)
    seeds = seeds.to(dev)
    positions = torch.as_tensor(positions, dtype=torch.int64).to(dev)
    temps = torch.as_tensor(temperatures, dtype=torch.float64).to(dev)
    noisy = temps > 0
    vocab = torch.arange(x.shape[1], device=dev).expand(x.shape[0], -1)
    u = hash_uniform_torch(seeds, positions, vocab)
    scored = x / torch.where(noisy, temps, 1.0)[:, None] - torch.log(-torch.log(u))
    x = torch.where(noisy[:, None], scored, x)
    top = x.topk(min(k + 1, x.shape[1]), dim=1)
    ids = top.indices[:, :k]
    # With the whole vocabulary kept there is nothing left out to bound.
    bound = top.values[:, k] if top.values.shape[1] > k else torch.full_like(top.values[:, 0], -torch.inf)
    return Candidates(ids, logits.gather(1, ids).float(), bound)


def reducible(row: SampleRow) -> bool:
    """Whether a row's draw depends on its scores alone (else it needs its full logits row)."""
    p = row.params
    return not (
        p.top_k
        or p.top_p < 1.0
        or p.min_p > 0.0
        or p.penalised
        or p.logits_processors
        or p.logprobs is not None
    )


def draw_reduced(cand: Candidates, rows: Sequence[SampleRow]) -> list[int | None]:
    """Each row's token from its candidates (numpy, as Candidates.numpy() gives them), the same as
    sampler.sample over the full row; None where the candidates cannot prove it (the caller draws
    that row from its full logits)."""
    out: list[int | None] = []
    for i, row in enumerate(rows):
        if not reducible(row):
            out.append(None)
            continue
        order = np.argsort(cand.ids[i], kind="stable")  # the full draw scans token ids in order
        ids = cand.ids[i][order].astype(np.int64)
        x = cand.logits[i][order].astype(np.float64)
        bound = float(cand.bound[i])
        if row.params.greedy:
            scores, slack = x, 0.0  # logits reach the host exactly: only a tie left out is unproven
        else:
            u = hash_uniform(np.array([row.seed]), np.array([row.position]), ids[None, :])[0]
            scores = x / row.params.temperature - np.log(-np.log(u))  # as sampler._draw computes them
            slack = margin(bound) if np.isfinite(bound) else 0.0
        best = int(np.argmax(scores))
        out.append(int(ids[best]) if scores[best] > bound + slack else None)
    return out


def reduce_rows(logits: torch.Tensor, rows: Sequence[SampleRow], k: int = 8) -> Candidates:
    """reduce_for_draw keyed by each row's seed and position (temperature 0 for a greedy row)."""
    temps = [0.0 if r.params.greedy else float(r.params.temperature) for r in rows]
    return reduce_for_draw(logits, [r.seed for r in rows], [r.position for r in rows], temps, k)
