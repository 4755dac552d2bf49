"""The schema fuzzing benchmark (`python -m minisgl_backend.bench.schema`), reduced, on the tiny random
model: every operation of /openapi.json gets generated requests, and the server answers each without a
server error and as its schema documents. Needs schemathesis (not a dependency: the `fuzz` extra)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("schemathesis")

from tests.serve.servers import TINY_ENGINE  # noqa: E402

OPERATIONS = {
    "GET /ping",
    "POST /ping",
    "GET /health",
    "GET /version",
    "GET /v1/models",
    "GET /v1/models/{model_id}",
    "POST /tokenize",
    "POST /detokenize",
    "GET /tokenizer_info",
    "POST /v1/completions",
    "POST /v1/chat/completions",
    "GET /metrics",
}


def test_generated_requests_get_no_server_error_and_answers_the_schema_documents(
    tiny_model_dir, tmp_path, capsys
):
    from minisgl_backend.bench.schema import main

    out = tmp_path / "schema.json"
    engine = [f"--set={k}={v}" for k, v in {**TINY_ENGINE, "max_model_len": 64}.items()]
    rc = main(
        ["--model", str(tiny_model_dir), "--cases", "60", "--budget-s", "300", "--json", str(out), *engine]
    )
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    rows = {r["operation"]: r for r in result["rows"]}
    assert set(rows) == OPERATIONS, printed
    assert result["cases"] >= 60, printed
    for name, row in rows.items():
        assert row["cases"] >= 1 and f"| {name} | {row['cases']} |" in printed, printed
    bodies = ("POST /tokenize", "POST /detokenize", "POST /v1/completions", "POST /v1/chat/completions")
    for name in bodies:  # the bodies the schema forbids are refused as the client's error
        assert any(400 <= int(s) < 500 for s in rows[name]["statuses"]), rows[name]
    assert result["server_errors"] == 0 and result["violations"] == 0, printed
    assert rc == 0


def test_without_schemathesis_the_bench_says_how_to_install_it(monkeypatch, capsys):
    import sys

    from minisgl_backend.bench import schema

    monkeypatch.setitem(sys.modules, "schemathesis", None)  # import fails as if not installed
    with pytest.raises(schema.SchemathesisMissing, match="pip install schemathesis"):
        schema.bench_schema(object())  # said before an engine is built (this config would fail)
