"""The eval benchmark (`python -m minisgl_backend.bench.lm_eval`) runs a peer engine's lm_eval from the
peer's own venv: `--vllm-python` names that venv's interpreter, and its run gets vLLM's CPU settings."""

import stat
import sys

import pytest

from minisgl_backend.bench import lm_eval as bench

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="a shell script stands in for lm_eval")

# Stands in for a venv's lm_eval: records its arguments and environment, writes a result and a sample.
FAKE_LM_EVAL = """#!/bin/sh
out=""
while [ $# -gt 0 ]; do
  if [ "$1" = "--output_path" ]; then out="$2"; fi
  shift
done
mkdir -p "$out/m"
env > "$out/env.txt"
echo "$0" > "$out/argv0.txt"
echo '{"results": {"t": {"acc,none": 0.5, "acc_stderr,none": 0.1, "alias": "t"}}}' > "$out/m/results_1.json"
echo '{"doc_id": 0, "resps": [[["-1.5", "True"]]], "metrics": ["acc"]}' > "$out/m/samples_t_1.jsonl"
"""


def test_a_peer_runs_the_lm_eval_of_its_own_venv_with_the_settings_given(tmp_path):
    venv_bin = tmp_path / "peer" / "bin"
    venv_bin.mkdir(parents=True)
    fake = venv_bin / "lm_eval"
    fake.write_text(FAKE_LM_EVAL)
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    out = tmp_path / "out"
    wall, cpu, metrics, responses = bench.run_lm_eval(
        "vllm", "pretrained=x", "t", out, [], str(venv_bin / "python"), bench.VLLM_CPU_ENV
    )
    assert (out / "argv0.txt").read_text().strip() == str(fake)
    env = dict(line.split("=", 1) for line in (out / "env.txt").read_text().splitlines() if "=" in line)
    assert env["VLLM_TARGET_DEVICE"] == "cpu" and env["HF_HUB_OFFLINE"] == "1"
    assert metrics == {"t": {"acc,none": 0.5}}
    assert responses == {("t", 0, 0): ["-1.5", "True"]}
    assert wall >= 0 and cpu >= 0


def test_repetitions_alternate_the_order_and_ratios_are_paired_within_each():
    """Every other repetition runs the configurations in reverse, and a peer's speed is read within
    each repetition: a peer whose best run fell in a quiet spell does not look faster for it."""
    names = ["minisgl", "hf bs=16", "vllm"]
    assert bench.round_order(names, 0) == names and bench.round_order(names, 1) == names[::-1]
    assert bench.round_order(names, 2) == names
    # minisgl's best (10) and the peer's best (18) came in different repetitions: best over best
    # reads 1.8x, the repetitions themselves 2.0x, 2.0x and 1.5x.
    paired = bench.paired_ratios([10.0, 20.0, 12.0], [20.0, 40.0, 18.0])
    assert paired == {"median": 2.0, "range": [1.5, 2.0]}
