"""Utilisation over time from a bench timeline: whether compute really overlaps planning is read off
the picture, not assumed (a serial loop shows the device idle while the scheduler plans). For each
config of a `bench --scenario/--sweep --trace` run, the share of each small time bin during which
the compute lane was busy, with the scheduler lane drawn over it; configs stacked.

Reads the Chrome-trace events the bench writes (Tracer.chrome_events), so a saved trace can also be
drawn later, on another machine: `python -m minisgl_backend.tools.plot trace.json out.png`. matplotlib is
an optional extra (`pip install 'minisgl[plot]'`), imported only when a plot is drawn.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Sequence

import numpy as np

from minisgl_backend.errors import MissingExtraError

LANES = ("compute", "scheduler")  # drawn lanes; Tracer.LANES gives their trace thread ids


def require_matplotlib() -> None:
    """Fail before any work is done when --plot cannot be drawn."""
    try:
        importlib.import_module("matplotlib")
    except ImportError as e:
        raise MissingExtraError("--plot needs matplotlib: pip install 'minisgl[plot]'") from e


def busy_fraction(spans: Sequence[tuple[float, float]], edges: np.ndarray) -> np.ndarray:
    """Fraction of each bin [edges[i], edges[i+1]) covered by the union of `spans` (start, end)."""
    merged: list[list[float]] = []
    for a, b in sorted(spans):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    if not merged:
        return np.zeros(len(edges) - 1)
    iv = np.asarray(merged)
    # covered(t) = busy time in [-inf, t]; a bin's busy time is the difference at its two edges.
    covered = np.clip(edges[:, None] - iv[None, :, 0], 0.0, (iv[:, 1] - iv[:, 0])[None, :]).sum(axis=1)
    return np.diff(covered) / np.diff(edges)


def lanes_by_config(events: list[dict]) -> dict[str, dict[str, list[tuple[float, float]]]]:
    """{config name: {lane: [(start_s, end_s)]}} from Chrome-trace events, times from each run's start."""
    from minisgl_backend.metrics import Tracer

    names = {
        e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "process_name"
    }
    out: dict[str, dict[str, list[tuple[float, float]]]] = {
        n: {lane: [] for lane in LANES} for n in names.values()
    }
    for e in events:
        if e.get("ph") != "X":
            continue
        lane = Tracer.LANES[e["tid"]]
        if lane in LANES:
            start = e["ts"] / 1e6
            out[names[e["pid"]]][lane].append((start, start + e["dur"] / 1e6))
    return out


def plot_utilisation(events: list[dict], out: str, bins: int = 300) -> None:
    """Write a PNG: one row per config, compute busy fraction per bin (filled) and scheduler (line)."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    configs = lanes_by_config(events)
    if not configs:
        raise ValueError("the trace holds no configs to plot")
    end = max((b for lanes in configs.values() for spans in lanes.values() for _, b in spans), default=1.0)
    edges = np.linspace(0.0, end, bins + 1)
    mids = (edges[:-1] + edges[1:]) / 2
    fig, axes = plt.subplots(
        len(configs), 1, figsize=(11, 1.7 * len(configs) + 0.8), sharex=True, squeeze=False
    )
    for ax, (name, lanes) in zip(axes[:, 0], configs.items()):
        compute = busy_fraction(lanes["compute"], edges)
        ax.fill_between(mids, compute, step="mid", alpha=0.6, color="tab:blue", label="compute busy")
        ax.plot(
            mids,
            busy_fraction(lanes["scheduler"], edges),
            drawstyle="steps-mid",
            lw=0.8,
            color="tab:orange",
            label="scheduler busy",
        )
        run_end = max((b for spans in lanes.values() for _, b in spans), default=0.0)
        busy = busy_fraction(lanes["compute"], np.array([0.0, run_end]))[0] if run_end else 0.0
        ax.set_title(f"{name}: compute busy {busy:.0%} of {run_end:.2f} s", fontsize=9, loc="left")
        ax.set_ylim(0, 1.05)
        ax.set_ylabel("busy")
    axes[0, 0].legend(loc="upper right", fontsize=8)
    axes[-1, 0].set_xlabel(f"seconds since the run started (bins of {1000 * end / bins:.1f} ms)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m minisgl_backend.tools.plot", description=__doc__.split("\n")[0]
    )
    p.add_argument("trace", help="trace JSON written by `minisgl bench ... --trace`")
    p.add_argument("out", help="PNG to write")
    p.add_argument("--bins", type=int, default=300)
    args = p.parse_args(argv)
    with open(args.trace) as f:
        plot_utilisation(json.load(f)["traceEvents"], args.out, args.bins)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
