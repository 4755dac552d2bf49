"""scripts/gpu_check.sh: stages that never stop each other, one stage run alone, and the small mode
(every stage on the CPU) that proves the script before a GPU is lent."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from minisgl_backend import EngineConfig
from minisgl_backend.bench import gpu_check
from minisgl_backend.bench.configs import bench_configs
from minisgl_backend.bench.gpu_check import overlap_variants
from minisgl_backend.errors import ConfigError
from minisgl_backend.model.llama import LayerLoop

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def _run(
    tmp_path: Path, *stages: str, **env: str
) -> tuple[subprocess.CompletedProcess, list[tuple[str, str]]]:
    full = os.environ | {
        "OUT": str(tmp_path / "out"),
        "SCRATCH": str(tmp_path / "scratch"),
        "PYTHON": sys.executable,
        "GPU_CHECK_SMALL": "1",
    }
    proc = subprocess.run(
        ["bash", str(SCRIPT), *stages], env=full | env, capture_output=True, text=True, timeout=600
    )
    summary = tmp_path / "out" / "summary.txt"
    outcome = []  # (stage, outcome without its seconds), in the order they ran
    if summary.is_file():
        for line in summary.read_text().splitlines():
            name, rest = line.split(None, 1)
            outcome.append((name, rest.rsplit(None, 1)[0]))
    return proc, outcome


def test_a_failed_or_timed_out_stage_does_not_stop_the_next(tmp_path):
    """A stage past its time limit is stopped and recorded; a failing one is recorded; the stages
    after both still run, and the script itself exits 0 (its summary says what failed)."""
    sleeper = tmp_path / "slow_python"
    sleeper.write_text("#!/usr/bin/env bash\nsleep 30\n")
    sleeper.chmod(0o755)
    proc, outcome = _run(
        tmp_path, "env", "model", "env", PYTHON=str(sleeper), T_ENV="1", MINISGL_TOKENIZER=str(tmp_path)
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # no tokenizer files in tmp_path: the model stage fails before it runs Python
    assert outcome == [("env", "TIMED OUT"), ("model", "FAILED (rc 1)"), ("env", "TIMED OUT")]
    assert "no tokenizer files" in (tmp_path / "out" / "check.log").read_text()


def test_an_unknown_stage_is_refused_before_anything_runs(tmp_path):
    proc, outcome = _run(tmp_path, "env", "nope")
    assert proc.returncode == 2 and "unknown stage 'nope'" in proc.stderr
    assert outcome == []


def test_the_overlap_rows_are_the_designs():
    rows = overlap_variants([128, 768])
    assert list(rows) == [
        "serial, no chunking",
        "overlap, chunk 128",
        "overlap, chunk 768",
        "overlap, chunk 768, max_inflight 1",
        "overlap, chunk 768, python callbacks",
    ]
    assert rows["serial, no chunking"]["overlap"] is False
    assert rows["overlap, chunk 768, max_inflight 1"] | {"max_inflight": 4} == rows["overlap, chunk 768"]
    assert rows["overlap, chunk 768, python callbacks"]["callback_impl"] == "python"
    assert all(row["cuda_graphs"] is False for row in rows.values())  # eager, also on a GPU


def test_a_gpu_adds_the_cuda_graph_rows():
    """Serial and overlap both replay graphs, so the overlap gain is read between graph rows."""
    rows = overlap_variants([128, 768], graphs=True)
    assert list(rows)[5:7] == ["serial, cuda graphs", "overlap, chunk 768, cuda graphs"]
    assert rows["overlap, chunk 768, cuda graphs, switch 0.5 ms"]["switch_interval_ms"] == 0.5
    assert rows["serial, cuda graphs"] == rows["serial, no chunking"] | {"cuda_graphs": True}
    assert rows["overlap, chunk 768, cuda graphs"] == rows["overlap, chunk 768"] | {"cuda_graphs": True}


class _Broken:
    """An attention back-end that fails the way a kernel that does not compile on a device would."""

    def plan(self, *args, **kwargs):
        raise RuntimeError("kernel failed to compile")


def test_a_failing_forward_case_is_a_row_with_its_error(monkeypatch):
    """One back-end that raises costs the forward stage none of the other back-end's rows: its
    cases become rows holding the error, and every case still runs on the working back-end."""
    monkeypatch.setattr(
        gpu_check, "backends", lambda device: {"torch": LayerLoop(), "broken": LayerLoop(_Broken())}
    )
    rows = gpu_check.forward_rows(["tiny"], [1], ctx=8, chunk=8, device="cpu", dtype="float32", steps=1)
    cases = [(r["backend"], r["case"], "error" in r) for r in rows]
    assert cases == [
        ("torch", "decode B=1 ctx=8", False),
        ("torch", "decode B=1 ctx=8 graph", False),
        ("broken", "decode B=1 ctx=8", True),
        ("torch", "chunk 8 after 8", False),
        ("broken", "chunk 8 after 8", True),
    ]
    assert all("kernel failed to compile" in r["error"] for r in rows if "error" in r)
    assert all(r["ms"] > 0 for r in rows if "error" not in r)


def test_a_failing_overlap_variant_is_a_row_with_its_error(tiny_model_dir):
    """keep_going (the device check's overlap stage): a variant that fails is a row with its error
    and the next one runs; without it the error reaches the caller, as `minisgl bench` wants."""
    base = EngineConfig(model=str(tiny_model_dir), num_blocks=64, stats_interval_s=0)
    variants = {"graphs on a CPU": {"cuda_graphs": True}, "serial": {"overlap": False}}
    rows = bench_configs(base, variants, 4, 2, 2, keep_going=True)
    assert list(rows) == ["graphs on a CPU", "serial"]
    assert "cuda_graphs" in rows["graphs on a CPU"]["error"]
    assert rows["serial"]["requests"] == 4 and rows["serial"]["req_per_s"] > 0
    with pytest.raises(ConfigError, match="cuda_graphs"):
        bench_configs(base, variants, 4, 2, 2)


@pytest.mark.slow
def test_the_small_mode_runs_every_stage_on_the_cpu(tmp_path, tiny_model_dir):
    """GPU_CHECK_SMALL=1: every stage passes on the CPU, at most 8 small files come back in OUT (big
    ones stay in the scratch dir), and the Triton kernels' logits agree with the torch path's."""
    tokenizer = tiny_model_dir  # holds SmolLM2's tokenizer files, as .gpu_carry/tokenizer would
    proc, outcome = _run(tmp_path, MINISGL_TOKENIZER=str(tokenizer))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    stages = ["env", "tracker", "tests", "forward", "model", "overlap", "stress"]
    assert outcome == [(s, "ok") for s in stages], proc.stdout[-3000:]
    files = [p for p in (tmp_path / "out").iterdir() if p.is_file()]
    assert len(files) <= 8 and all(p.stat().st_size < 16 * 2**20 for p in files), files
    assert (tmp_path / "out" / "trace.json").is_file()
    forward = json.loads((tmp_path / "out" / "forward.json").read_text())
    kernels = [r for r in forward if r["backend"] == "triton" and not r["case"].endswith(" graph")]
    assert kernels and all(r["argmax_agree_vs_torch"] == 1.0 for r in kernels)
    graphs = [r for r in forward if r["case"].endswith(" graph")]  # decode B=1 and 4, per back-end
    assert len(graphs) == 4 and all(not r["captured"] and r["max_logit_diff_vs_eager"] < 1e-4 for r in graphs)
    overlap = json.loads((tmp_path / "out" / "overlap_table.json").read_text())
    assert len(overlap["rows"]) == 6 and any("sampled" in name for name in overlap["rows"])
    assert all("error" not in row for row in overlap["rows"].values())
    stress = json.loads((tmp_path / "out" / "stress.json").read_text())
    assert stress["ok"] and stress["fenced"]["mismatches"] == 0 and stress["unsafe"]["mismatches"] > 0
    assert stress["serial_vs_overlap"]["same_tokens"]
