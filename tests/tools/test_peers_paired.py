"""scripts/peers_paired.py: engines taking turns on the same workloads, the ratio taken within each
round (so a slow minute slows both runs of a pair), the order flipped from round to round."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "peers_paired.py"


def _script():
    spec = importlib.util.spec_from_file_location("peers_paired", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["peers_paired"] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


def test_ratio_is_paired_within_rounds_not_best_over_best():
    pp = _script()
    # The machine slows down threefold in round 1 and "b" is half as fast as "a" in every round: the
    # paired ratio is 0.5 in both rounds. Best over best (a's fast round against b's) would say 0.5
    # too, so b's round-0 run is made slower still: paired 0.5 and 0.25, best over best 1/6.
    records = [
        pp.Record("w", 0, ["a", "b"], {"a": 1.0, "b": 4.0}, {"a": 10, "b": 10}),
        pp.Record("w", 1, ["b", "a"], {"a": 3.0, "b": 6.0}, {"a": 10, "b": 10}),
        pp.Record("w", 2, ["a", "b"], {"a": 3.3, "b": 6.6}, {"a": 10, "b": 10}),
    ]
    (row,) = pp.summarize(records, ["a", "b"])
    assert row["rounds"] == 3
    assert row["sides"]["a"] == {"best_s": 1.0, "median_s": 3.0, "tok_per_s": 10.0}
    b = row["sides"]["b"]
    assert (b["best_s"], b["median_s"], b["tok_per_s"]) == (4.0, 6.0, 2.5)
    assert b["ratio_median"] == 0.5 and b["ratio_range"] == [0.25, 0.5]
    assert "a / a" not in pp.table([row], ["a", "b"]) and "0.50x (0.25-0.50)" in pp.table([row], ["a", "b"])


def test_order_flips_every_round():
    pp = _script()
    assert [pp.round_order(["a", "b", "c"], r) for r in range(3)] == [
        ["a", "b", "c"],
        ["c", "b", "a"],
        ["a", "b", "c"],
    ]


def test_bad_side_is_a_clear_error():
    pp = _script()
    for text in ("no-equals", "x=python", "x=python tgi model"):
        with pytest.raises(SystemExit, match="NAME=PYTHON KIND"):
            pp.Side.parse(text)


def test_two_engines_take_turns_on_the_embedded_model(tmp_path):
    wl = tmp_path / "wl.json"
    wl.write_text(json.dumps({"prompts": [[100 + i, 200 + i, 300 + i] for i in range(3)], "max_tokens": 3}))
    py = sys.executable
    proc = subprocess.run(
        [py, str(SCRIPT), "--rounds", "2", "--settle", "0", "--json",
         "--side", f"one={py} minisgl num_threads=1",
         "--side", f"det={py} minisgl num_threads=1,deterministic=true", str(wl)],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = json.loads(proc.stdout)
    assert row["workload"] == "wl.json" and row["rounds"] == 2
    assert set(row["sides"]) == {"one", "det"}
    assert row["sides"]["det"]["ratio_median"] > 0
    rounds = [json.loads(line) for line in proc.stderr.splitlines() if line.startswith('{"workload"')]
    assert [r["order"] for r in rounds] == [["one", "det"], ["det", "one"]]
    assert all(r["tokens"] == {"one": 9, "det": 9} for r in rounds)


def test_a_side_that_fails_to_load_names_itself(tmp_path):
    wl = tmp_path / "wl.json"
    wl.write_text(json.dumps({"prompts": [[1, 2]], "max_tokens": 1}))
    py = sys.executable
    proc = subprocess.run(
        [py, str(SCRIPT), "--rounds", "1", "--settle", "0",
         "--side", f"ok={py} minisgl num_threads=1", "--side", f"bad={py} minisgl no_such_key=1", str(wl)],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode != 0
    assert "side 'bad' exited" in proc.stderr and "no_such_key" in proc.stderr
