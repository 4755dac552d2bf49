"""`bench --plot`: the utilisation curve (busy fraction per time bin) and the PNG from a real run."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from minisgl_backend.errors import MissingExtraError
from minisgl_backend.tools.plot import busy_fraction, lanes_by_config, require_matplotlib
from tests.helpers import run_minisgl, run_module


def test_busy_fraction_is_the_covered_share_of_each_bin() -> None:
    edges = np.array([0.0, 1.0, 2.0, 3.0, 4.0])
    spans = [(0.5, 1.5), (1.25, 1.75), (3.0, 4.0)]  # the second lies inside the first: counted once
    np.testing.assert_allclose(busy_fraction(spans, edges), [0.5, 0.75, 0.0, 1.0])
    np.testing.assert_allclose(busy_fraction([], edges), [0, 0, 0, 0])


def test_lanes_by_config_reads_bench_trace_events() -> None:
    from minisgl_backend.metrics import Tracer

    tracer = Tracer(True)
    tracer.span("compute", "forward 1", 10.0, 10.5)
    tracer.span("scheduler", "plan 1", 10.0, 10.1)
    tracer.span("copy", "sample 1", 10.5, 10.6)
    lanes = lanes_by_config(tracer.chrome_events(pid=3, process_name="cfg"))
    assert list(lanes) == ["cfg"]
    assert lanes["cfg"]["compute"] == [pytest.approx((0.0, 0.5))]
    assert lanes["cfg"]["scheduler"] == [pytest.approx((0.0, 0.1))]


def test_missing_matplotlib_names_the_extra(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` raise ImportError
    with pytest.raises(MissingExtraError, match=r"pip install 'minisgl\[plot\]'"):
        require_matplotlib()


@pytest.mark.slow
def test_bench_plot_writes_a_png_of_every_config(tiny_model_dir, tmp_path) -> None:
    pytest.importorskip("matplotlib")  # in the test extra: CI has it
    png, trace = tmp_path / "ecg.png", tmp_path / "trace.json"
    load = ["--num-requests", "6", "--output-len", "4", "--concurrency", "3"]
    out = ["--plot", str(png), "--trace", str(trace)]
    r = run_minisgl("bench", "--sweep", "max_inflight=1,4", "--model", str(tiny_model_dir), *load, *out)
    assert r.returncode == 0, r.stderr
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000  # two drawn rows, not an empty canvas
    # The same PNG can be drawn later from the saved trace.
    again = tmp_path / "again.png"
    r = run_module("minisgl_backend.tools.plot", str(trace), str(again), timeout=120)
    assert r.returncode == 0, r.stderr
    assert again.stat().st_size > 20_000
    assert len(lanes_by_config(json.loads(trace.read_text())["traceEvents"])) == 2


def test_plot_without_a_scenario_is_a_clear_error(tiny_model_dir, tmp_path) -> None:
    r = run_minisgl("bench", "--model", str(tiny_model_dir), "--plot", str(tmp_path / "x.png"), timeout=120)
    assert r.returncode == 2 and "--scenario or --sweep" in r.stderr
