"""logit_bias and the repetition / frequency / presence penalties, with vLLM's semantics.

vLLM (v1 `Sampler.apply_logits_processors`, `apply_penalties` in model_executor/layers/utils.py and
`apply_repetition_penalties_torch` in _custom_ops.py) changes the float32 logits in this order,
before temperature, top-k / top-p / min-p and before the greedy argmax:

1. logit_bias: logits[t] += bias[t];
2. repetition penalty r over every token in the prompt or the output so far: a logit > 0 is divided
   by r, any other multiplied by r;
3. frequency penalty f: logits[t] -= f * (count of t in the output);
4. presence penalty p: logits[t] -= p for every t in the output.

Each row is processed on its own (a request's logits never depend on its batch neighbours), and
only the tokens a row names are touched, so the cost follows the history's length, not the vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from minisgl_backend.errors import InvalidSamplingParamsError
from minisgl_backend.sampling.sampler import SampleRow, _failure

_F32_TINY = np.float32(np.finfo(np.float32).smallest_subnormal)
_F32_MAX = np.float32(np.finfo(np.float32).max)


def penalise_row(
    logits: np.ndarray,
    prompt_ids: Sequence[int] | np.ndarray,
    output_ids: Sequence[int] | np.ndarray,
    *,
    repetition_penalty: float = 1.0,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    logit_bias: Sequence[tuple[int, float]] = (),
) -> np.ndarray:
    """One row [V] of float32 logits after logit_bias and the penalties (a new array). Token ids of
    the history and of logit_bias must be in [0, V)."""
    x = np.array(logits, dtype=np.float32)
    vocab = x.shape[-1]
    if logit_bias:
        ids = np.fromiter((t for t, _ in logit_bias), dtype=np.int64, count=len(logit_bias))
        x[ids] += np.fromiter((b for _, b in logit_bias), dtype=np.float32, count=len(logit_bias))
    out = np.asarray(output_ids, dtype=np.int64)
    if repetition_penalty != 1.0:
        seen = np.zeros(vocab, dtype=bool)
        seen[np.asarray(prompt_ids, dtype=np.int64)] = True
        seen[out] = True
        ids = np.flatnonzero(seen)
        # A valid penalty below float32's smallest value rounds to 0 there: the smallest float32
        # instead keeps a masked -inf logit -inf (0 times -inf is NaN), and a quotient past float32's
        # range is capped at its largest value rather than +inf (which would make top-p NaN).
        r = max(np.float32(repetition_penalty), _F32_TINY)
        v = x[ids]
        with np.errstate(over="ignore"):
            x[ids] = np.where(v > 0, np.minimum(v / r, _F32_MAX), v * r)
    if (frequency_penalty != 0.0 or presence_penalty != 0.0) and out.size:
        ids, counts = np.unique(out, return_counts=True)
        if frequency_penalty != 0.0:
            x[ids] -= np.float32(frequency_penalty) * counts.astype(np.float32)
        if presence_penalty != 0.0:
            x[ids] -= np.float32(presence_penalty)
    return x


def apply_penalties(
    logits: np.ndarray, rows: Sequence[SampleRow], errors: dict[int, Exception]
) -> np.ndarray:
    """Apply each penalised row's logit_bias and penalties to float32 logits [R, V] (a copy when any
    row changes). A row whose logit_bias names a token outside the vocabulary gets an
    InvalidSamplingParamsError in `errors` (that request alone fails); rows already in `errors` are
    skipped."""
    todo = [i for i, r in enumerate(rows) if r.params.penalised and i not in errors]
    if not todo:
        return logits
    logits = logits.copy()
    vocab = logits.shape[-1]
    for i in todo:
        row = rows[i]
        p = row.params
        try:
            p.check_vocab(vocab)
            logits[i] = penalise_row(
                logits[i],
                row.prompt_ids,
                row.output_ids,
                repetition_penalty=p.repetition_penalty,
                presence_penalty=p.presence_penalty,
                frequency_penalty=p.frequency_penalty,
                logit_bias=p.logit_bias,
            )
        except InvalidSamplingParamsError as e:
            errors[i] = e
        except Exception as e:  # noqa: BLE001 - one row's failure must not end the iteration
            errors[i] = _failure("penalties", e)
    return logits
