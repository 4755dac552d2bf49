"""The hostile-load benchmark (`python -m minisgl_backend.bench.hostile`), reduced with `--quick`, on the
tiny random model: it runs every case and reports what a user of the server would notice beside each
(over-limit requests refused, the 1-token request beside a request of many sequences answered, the
drained server refusing new work while its request in flight finishes, RSS read around the burst).
No timing is asserted: the machine is shared."""

from __future__ import annotations

import json
import math

import pytest

pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from tests.serve.servers import TINY_ENGINE  # noqa: E402

CASES = [
    "3 many prompts",
    "3 /tokenize",
    "4 token ids",
    "4 chat n=8",
    "5 4 x n=16 (fair)",
    "8 drain",
    "9 burst of 40",
]


def test_the_quick_hostile_bench_prints_a_row_per_case_with_what_a_client_sees(
    tiny_model_dir, tmp_path, capsys
):
    from minisgl_backend.bench.hostile import main

    out = tmp_path / "hostile.json"
    engine = [f"--set={k}={v}" for k, v in TINY_ENGINE.items()]
    rc = main(["--model", str(tiny_model_dir), "--quick", "--json", str(out), *engine])
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    rows = {r["case"]: r for r in result["rows"]}
    assert list(rows) == CASES
    for name in CASES:
        assert f"| {name} |" in printed, printed  # one table row each, none flagged UNEXPECTED
        row = rows[name]
        assert row["health_samples"] >= 1 and row["one_token_samples"] >= 1, row
        assert row["rss_mb"] > 0, row
        if name != "8 drain":  # the probes of every other case go to the main server, which answers
            assert set(row["probe_codes"]) == {"200"}, row

    assert rows["3 many prompts"]["codes"].get("400 request_too_long") == 2, rows["3 many prompts"]
    assert rows["3 /tokenize"]["codes"] == {"200": 1, "400 request_too_long": 2}, rows["3 /tokenize"]
    assert all(code.startswith("400") for code in rows["4 token ids"]["codes"])
    assert rows["4 chat n=8"]["codes"] == {"200": 1}

    big = rows["5 4 x n=16 (fair)"]
    assert big["codes"]["beside 200"] == 1 and math.isfinite(big["beside_ms"])

    drain = rows["8 drain"]
    assert drain["codes"] == {"200": 1, "503 shutting_down": 1}  # in flight: whole; new: refused
    assert set(drain["probe_codes"]) == {"503 shutting_down"}  # /health too, while it drains
    assert drain["stopped_by_itself"]

    burst = rows["9 burst of 40"]
    assert burst["codes"] == {"200": 40}
    assert burst["rss_before_mb"] > 0 and burst["rss_ratio"] > 0
    assert result["rss_start_mb"] > 0 and result["rss_end_mb"] > 0
    assert "RSS:" in printed and "over the burst" in printed
    assert rc == 0  # every case saw what it expected
