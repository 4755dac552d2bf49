"""What every engine benchmark measures: random token prompts, and a run's throughput and latency
(TTFT, TPOT, as SGLang/vLLM define them) in one row; `format_table` prints rows as `minisgl bench`
shows them.

Definitions: TTFT = first token time - arrival; TPOT per request = (latency - TTFT) /
(output_len - 1), averaged over requests; output tok/s = generated tokens / wall.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Sequence
from typing import Any

from minisgl_backend.types import RequestOutput


def random_prompts(n: int, input_len: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """Token-id prompts of a fixed length (ids from a safe range: no special tokens)."""
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 1) for _ in range(input_len)] for _ in range(n)]


def _pct(xs: Sequence[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))] if xs else float("nan")


def summarize(outputs: Sequence[RequestOutput], wall: float) -> dict[str, float]:
    ttft = [t for o in outputs if (t := o.timings.ttft) is not None]
    tpot = [
        (end - first) / (len(o.token_ids) - 1)
        for o in outputs
        if len(o.token_ids) > 1
        and (end := o.timings.finish) is not None
        and (first := o.timings.first_token) is not None
    ]
    gen = sum(len(o.token_ids) for o in outputs)
    row = {
        "requests": len(outputs),
        "wall_s": wall,
        "req_per_s": len(outputs) / wall,
        "output_tok_per_s": gen / wall,
    }
    for name, xs in (("ttft_ms", ttft), ("tpot_ms", tpot)):
        row[f"{name}_mean"] = 1000 * statistics.fmean(xs) if xs else float("nan")
        row[f"{name}_p50"] = 1000 * _pct(xs, 50)
        row[f"{name}_p99"] = 1000 * _pct(xs, 99)
    return row


SERVING_COLUMNS = (
    "requests",
    "wall_s",
    "req_per_s",
    "output_tok_per_s",
    "ttft_ms_mean",
    "ttft_ms_p50",
    "ttft_ms_p99",
    "tpot_ms_mean",
    "tpot_ms_p50",
    "tpot_ms_p99",
    "sched_overlap",
)


def format_table(
    rows: dict[str, dict[str, Any]], extra: Sequence[str] = (), columns: Sequence[str] = SERVING_COLUMNS
) -> str:
    """One line per row: `columns`, then `extra`."""
    cols = [*columns, *extra]
    width = max(map(len, rows)) + 2
    widths = [max(17, len(c) + 2) for c in cols]
    lines = ["".ljust(width) + "".join(c.rjust(w) for c, w in zip(cols, widths))]
    for name, row in rows.items():
        cells = []
        for c, w in zip(cols, widths):
            v = row.get(c)
            cells.append(("-" if v is None else f"{v:.2f}" if isinstance(v, float) else str(v)).rjust(w))
        lines.append(name.ljust(width) + "".join(cells))
    return "\n".join(lines)
