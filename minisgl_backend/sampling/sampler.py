"""Batch-independent sampling on the CPU, in numpy (it runs on the copy worker while the next forward
computes).

A random draw is Gumbel-max: argmax over allowed tokens t of logits[t]/T + G(seed, pos, t), where
G is Gumbel noise made from a stateless 64-bit hash of (request seed, absolute position, token id).
Nothing depends on the batch slot, the step count or chunk boundaries, so a request replays exactly
under any scheduling, and requests never share RNG state.

numpy, not torch: torch would start an OpenMP team on this (copy-stage) thread, and two teams contend
for the same cores, slowing the forward pass on the compute thread. numpy is single-threaded and
releases the GIL inside its loops. Where the AVX-512 kernels run, the passes over a whole vocabulary
row (the draw without filters, the top-k selection, top-p's normaliser) are native single-threaded
passes on this thread instead (model/cpu_kernels.py), each checked against or decided as numpy
would, so the tokens are the same with or without them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from minisgl_backend.errors import RequestFailedError
from minisgl_backend.model import cpu_kernels
from minisgl_backend.types import SamplingParams, TokenLogprob

# A score is x / T - log(-log(u)): the division rounds the same everywhere (IEEE), the logs may differ
# in their last bits between numpy, the native screen (cpu_kernels.keyed_draw_screen) and a device.
# The noise term is below 40, so the scores differ by far less than MARGIN plus a few units in the
# last place of the score itself.
MARGIN = 1e-9
_PREFILTER = 1024  # top-p / min-p look at the best 1024 tokens first, then wider until the cut falls inside
_CUT_STRIDE = 16  # _best_ids guesses its cut from every this-many-th token
_WIDEN = 4  # a prefilter too narrow for top-p / min-p grows by this factor
# A top-p / min-p decision this close to its cut under the native normaliser goes to numpy's: the two
# differ by ~1e-15 in a probability, so farther from the cut they decide alike.
_CUT_MARGIN = 1e-9


def margin(bound: float) -> float:
    """How far a candidate's exact score must clear a screened bound (the best score of every token
    left out, computed elsewhere) to beat every token left out."""
    return MARGIN + 4 * float(np.spacing(abs(bound)))


def _mix64(h: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser (uint64 arithmetic wraps modulo 2**64)."""
    h = (h ^ (h >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    h = (h ^ (h >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return h ^ (h >> np.uint64(31))


def hash_uniform(seeds: np.ndarray, positions: np.ndarray, token_ids: np.ndarray) -> np.ndarray:
    """Uniform (0, 1) float64 noise per (seeds[r], positions[r], token_ids[r, c]); a pure function."""
    with np.errstate(over="ignore"):
        row = _mix64(
            _mix64(seeds.astype(np.uint64) ^ np.uint64(0x9E3779B97F4A7C15))
            + positions.astype(np.uint64) * np.uint64(0xD1B54A32D192ED03)
        )
        h = _mix64(row[:, None] ^ (token_ids.astype(np.uint64) * np.uint64(0xA24BAED4963EE407)))
    return ((h >> np.uint64(11)).astype(np.float64) + 0.5) / float(1 << 53)


_GOLDEN = 0x9E3779B97F4A7C15  # SplitMix64's increment
_MASK64 = (1 << 64) - 1


def sample_key(seed: int, index: int) -> int:
    """The sampling key of sample `index` of a request seeded `seed` (SamplingParams.n): `seed`
    itself for sample 0, so sample 0 of any n is the n = 1 output; for i > 0 the i-th output of
    SplitMix64 seeded with `seed`, mix64((seed + i * 0x9E3779B97F4A7C15) mod 2**64), a function of
    (seed, i) only, so sample i does not depend on n, and distinct i give unrelated noise."""
    if index == 0:
        return seed
    z = (seed + index * _GOLDEN) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


class SampleRow(NamedTuple):
    params: SamplingParams
    seed: int
    position: int  # absolute position of the token being drawn
    output_ids: Sequence[int]  # what logits processors (and the penalties) see
    prompt_ids: Sequence[int] = ()  # the prompt, read only for a repetition penalty


def _name(fn: object) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__


def _processed_row(fn: object, row: object, vocab: int) -> np.ndarray:
    """A processor's returned row as float32 numpy, or RequestFailedError saying what is wrong."""
    if not isinstance(row, torch.Tensor):
        raise RequestFailedError(
            f"logits processor {_name(fn)} returned {type(row).__name__}, "
            f"expected a float torch.Tensor of shape [{vocab}]"
        )
    if tuple(row.shape) != (vocab,):
        raise RequestFailedError(
            f"logits processor {_name(fn)} returned a tensor of shape {list(row.shape)}, expected [{vocab}]"
        )
    if row.dtype not in (torch.float16, torch.float32, torch.float64):
        raise RequestFailedError(
            f"logits processor {_name(fn)} returned dtype {row.dtype}, expected float16, float32 or float64"
        )
    out = row.detach().cpu().numpy().astype(np.float32, copy=False)
    if np.isnan(out).any() or np.isposinf(out).any():
        raise RequestFailedError(
            f"logits processor {_name(fn)} returned NaN or +inf logits "
            "(mask tokens with -inf, keep the others finite)"
        )
    if np.isneginf(out).all():
        raise RequestFailedError(
            f"logits processor {_name(fn)} masked every token (all -inf): nothing left to draw"
        )
    return out


def _failure(what: str, e: BaseException) -> RequestFailedError:
    if isinstance(e, RequestFailedError):
        return e
    err = RequestFailedError(f"{what} raised {e!r}")
    err.__cause__ = e
    return err


def apply_processors(
    logits: np.ndarray, rows: Sequence[SampleRow]
) -> tuple[np.ndarray, dict[int, Exception]]:
    """Run each row's logits processors (on torch views of a copy of the rows, per the public
    contract: the rows given are left as they are, since the caller may pass a view of logits that
    other rows' logprobs are read from).
    A failing row — the processor raised anything (BaseException included: it is user code on an
    engine thread) or returned an unusable row — is reported by index as a RequestFailedError
    chaining the cause, never raised."""
    errors: dict[int, Exception] = {}
    todo = [i for i, r in enumerate(rows) if r.params.logits_processors]
    if todo:
        logits = logits.copy()
        vocab = logits.shape[-1]
        for i in todo:
            fn: object = None
            try:
                row = torch.from_numpy(logits[i])
                for fn in rows[i].params.logits_processors:
                    row = fn(rows[i].output_ids, row)
                    row = torch.from_numpy(_processed_row(fn, row, vocab))
                logits[i] = row.numpy()
            except BaseException as e:  # noqa: BLE001 - user code; its request fails, the batch goes on
                errors[i] = _failure(f"logits processor {_name(fn)}", e)
    return logits, errors


def sample(
    logits: np.ndarray, rows: Sequence[SampleRow], errors: dict[int, Exception] | None = None
) -> list[int]:
    """Draw one token per row from float32 logits [R, V] (already processed). A row whose draw
    fails (e.g. no candidate token) gets its argmax as a placeholder and an entry in `errors`
    (raised instead when `errors` is None)."""
    out = logits.argmax(axis=-1).tolist()  # greedy rows keep this
    for i, row in enumerate(rows):
        if row.params.greedy or (errors is not None and i in errors):
            continue
        try:
            out[i] = _draw(logits[i], row)
        except Exception as e:  # noqa: BLE001 - one row's failure must not end the iteration
            if errors is None:
                raise
            errors[i] = _failure("sampling", e)
    return out


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def _draw(logits: np.ndarray, row: SampleRow) -> int:
    p = row.params
    filtered = bool(p.top_k or p.top_p < 1.0 or p.min_p > 0.0)
    if not filtered and (token := _screened_draw(logits, row)) is not None:
        return token
    if filtered:
        ids, vals = _candidates(logits, p)
    else:
        vals = logits.astype(np.float64) / p.temperature
        ids = np.arange(vals.shape[0])
    if ids.size == 0 or not np.isfinite(vals).any():
        raise RequestFailedError(
            f"no token to draw at position {row.position}: the filters (temperature={p.temperature}, "
            f"top_k={p.top_k}, top_p={p.top_p}, min_p={p.min_p}) left no candidate with a finite logit"
        )
    u = hash_uniform(np.array([row.seed]), np.array([row.position]), ids[None, :])[0]
    return int(ids[np.argmax(vals - np.log(-np.log(u)))])


def _screened_draw(logits: np.ndarray, row: SampleRow) -> int | None:
    """The token _draw gives a row without filters, from the native screen of the whole row: its best
    token's score, recomputed here as _draw computes every score, when it clears the bound on every
    other token's score by the margin. None (draw in full) where the screen does not run, the row's
    largest logit is not finite, or two scores are too close to tell apart."""
    p = row.params
    got = cpu_kernels.keyed_draw_screen(logits, p.temperature, row.seed, row.position)
    if got is None:
        return None
    token, _, bound, u, _ = got
    if token < 0:
        return None
    exact = np.float64(logits[token]) / p.temperature - np.log(-np.log(np.float64(u)))
    slack = margin(bound) if np.isfinite(bound) else 0.0
    return int(token) if exact > bound + slack else None


def _best_ids(x: np.ndarray, width: int) -> np.ndarray:
    """The `width` token ids of largest x, in descending x and, among equal values, ascending id (of
    the ids tied at the cut, the lowest). A cut is guessed from every 16th token, and only the tokens
    at or above it are partitioned, if there are at least `width` of them (every token below is
    smaller than every token above, so the best `width` are among them); else a lower guess, then
    the whole row. The answer is the same whichever guess served."""
    vocab = x.shape[0]
    near = np.arange(vocab)
    sample = x[::_CUT_STRIDE]
    guess = width // _CUT_STRIDE + width // (2 * _CUT_STRIDE) + 2  # ~1.5x the share of the sample
    while width < vocab // 4 and guess < sample.size:
        cut = np.partition(sample, sample.size - guess)[sample.size - guess]
        found = np.flatnonzero(x >= cut)
        if found.size >= width:
            near = found
            break
        guess *= 4
    if near.size > width:
        xs = x[near]
        kth = np.partition(xs, near.size - width)[near.size - width]
        above = near[xs > kth]
        # Each part is in ascending id order, and their values differ: the stable sort below
        # keeps equal values in ascending id order.
        near = np.concatenate([above, near[xs == kth][: width - above.size]])
    return near[np.argsort(-x[near], kind="stable")]


def _candidates(logits: np.ndarray, p: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """Token ids allowed by top-k, then top-p, then min-p, in descending order of x = logits / T
    (float64), and their x."""
    vocab = logits.shape[0]
    row: list[np.ndarray] = []  # x of the whole row, made once where numpy needs it

    def whole() -> np.ndarray:
        if not row:
            row.append(logits.astype(np.float64) / p.temperature)
        return row[0]

    # top-p and min-p act on the top-k renormalised distribution, which needs no full softmax; without
    # top-k, on the whole row's: its normaliser from the native pass where it runs, else numpy's
    # log-softmax (also where a filter's cut lies within the native normaliser's rounding).
    norm = None if p.top_k else cpu_kernels.log_sum_exp(logits, p.temperature)
    logp = None if p.top_k or norm is not None else _log_softmax(whole()[None, :])[0]
    width = min(vocab, p.top_k) if p.top_k else min(vocab, _PREFILTER)
    while True:
        ids = cpu_kernels.keyed_best_ids(logits, p.temperature, width)
        if ids is None:
            ids = _best_ids(whole(), width)
        vals = whole()[ids] if row else logits[ids].astype(np.float64) / p.temperature
        keep, unsure = _filtered(p, vals, norm, None if logp is None else logp[ids])
        if unsure:
            norm, logp = None, _log_softmax(whole()[None, :])[0]
            keep, _ = _filtered(p, vals, None, logp[ids])
        # Exact once the cut falls inside the prefilter (or the prefilter is top-k / the whole vocab).
        # A flat distribution's nucleus can hold thousands of tokens: widen by steps, since selecting
        # the best 4x as many costs far less than sorting the whole vocabulary.
        if p.top_k or width == vocab or not keep[-1]:
            return ids[keep], vals[keep]
        width = min(vocab, width * _WIDEN)


def _filtered(
    p: SamplingParams, vals: np.ndarray, norm: tuple[float, float] | None, logp: np.ndarray | None
) -> tuple[np.ndarray, bool]:
    """Which of the candidates (x = vals, descending) top-p and min-p keep, and whether a decision
    lies within _CUT_MARGIN of its cut under the native normaliser `norm` (then only numpy's own
    log-softmax decides it). Probabilities: exp(logp) (the whole row's log-softmax), exp(x - max -
    log-sum) from `norm` (numpy's order of operations, its log-sum within ~1e-15), or, with top-k,
    the candidates' own renormalised distribution."""
    if norm is not None:
        probs = np.exp(vals - norm[0] - norm[1])
    elif logp is not None:
        probs = np.exp(logp)
    else:
        probs = np.exp(vals - vals[0])
        probs = probs / probs.sum()
    keep = np.ones(len(vals), dtype=bool)
    unsure = False
    if p.top_p < 1.0:
        before = np.cumsum(probs) - probs
        keep &= before < p.top_p
        unsure = norm is not None and bool((np.abs(before - p.top_p) < _CUT_MARGIN).any())
    if p.min_p > 0.0:
        floor = p.min_p * probs[0]
        keep &= probs >= floor
        unsure = unsure or (norm is not None and bool((np.abs(probs - floor) < _CUT_MARGIN * probs[0]).any()))
    return keep, unsure


def token_logprobs(logits: np.ndarray, token_ids: Sequence[int], num_top: int) -> list[TokenLogprob]:
    """Logprob, rank and top alternatives of given tokens under raw float32 logits [R, V]."""
    lp = _log_softmax(logits)
    tok = np.asarray(token_ids, dtype=np.int64)
    chosen = lp[np.arange(len(tok)), tok]
    ranks = ((lp > chosen[:, None]).sum(axis=-1) + 1).tolist()
    tops: list[tuple[tuple[int, float], ...]] = [()] * len(tok)
    if num_top:
        k = min(num_top, lp.shape[-1])
        part = np.argpartition(-lp, k - 1, axis=-1)[:, :k]
        for r in range(len(tok)):
            ids = part[r][np.argsort(-lp[r, part[r]], kind="stable")]
            tops[r] = tuple((int(i), float(lp[r, i])) for i in ids)
    return [TokenLogprob(int(t), float(c), k, top) for t, c, k, top in zip(tok, chosen, ranks, tops)]
