"""The `minisgl` command line on the tiny model: generate, the seed-table scenario, bad config."""

import json
import subprocess
import sys


def _minisgl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "minisgl_backend.cli", *args], capture_output=True, text=True, timeout=300
    )


def test_generate_json(tiny_model_dir):
    r = _minisgl("generate", "--model", str(tiny_model_dir), "--max-tokens", "5", "--json", "hello", "world")
    assert r.returncode == 0, r.stderr
    lines = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert [x["prompt"] for x in lines] == ["hello", "world"]
    assert all(x["num_tokens"] == 5 and x["finish_reason"] == "length" for x in lines)


def test_seed_table_scenario_writes_all_four_rows(tiny_model_dir, tmp_path):
    out, trace = tmp_path / "table.json", tmp_path / "trace.json"
    r = _minisgl(
        "bench",
        "--scenario",
        "seed-table",
        "--model",
        str(tiny_model_dir),
        "--num-requests",
        "8",
        "--output-len",
        "4",
        "--concurrency",
        "4",
        "--json",
        str(out),
        "--trace",
        str(trace),
    )
    assert r.returncode == 0, r.stderr
    rows = json.loads(out.read_text())["results"]
    assert list(rows) == [
        "serial, no chunking",
        "overlap, chunk too small",
        "overlap, moderate chunk",
        "overlap, over-synchronised",
    ]
    assert all(row["requests"] == 8 and row["req_per_s"] > 0 for row in rows.values())
    # The timeline has the three lanes for all four configs, one complete span per forward pass.
    events = json.loads(trace.read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == {0, 1, 2, 3} and {e["tid"] for e in spans} == {0, 1, 2}
    assert all(e["dur"] >= 0 for e in spans) and any(e["name"].startswith("forward") for e in spans)
    # A serial engine never plans while a forward pass runs.
    assert rows["serial, no chunking"]["sched_overlap"] < 0.05


def test_bad_config_key_is_a_clear_error(tiny_model_dir):
    r = _minisgl("generate", "--model", str(tiny_model_dir), "--set", "chunksize=8", "hi")
    assert r.returncode == 2 and "unknown engine config key" in r.stderr and "chunk_size" in r.stderr
