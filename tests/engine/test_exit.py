"""A program that never closes its engine still exits cleanly, even with iterations in flight.

Requests that stop early (stop token) leave planned-ahead iterations running on the compute thread;
before the atexit hook, interpreter shutdown unwound that thread through C++ code -> SIGABRT
("terminate called without an active exception"), as seen at the end of an lm-eval run."""

import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # slow tier: a child interpreter loads the embedded model

SCRIPT = """
from minisgl_backend import Engine, EngineConfig, SamplingParams
eng = Engine(EngineConfig(dtype="bfloat16", stats_interval_s=0))
greedy_one = SamplingParams(temperature=0, max_tokens=1)
first = eng.generate(["Hello there"] * 16, greedy_one, use_tqdm=False)[0].token_ids[0]
stop_at_first = SamplingParams(temperature=0, max_tokens=200, stop_token_ids=[first])
outs = eng.generate(["Hello there"] * 16, stop_at_first,
                    use_tqdm=False)
print("done", len(outs[0].token_ids))
"""


def test_exit_without_close_is_clean(smollm_dir):
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "done 1" in proc.stdout and "terminate called" not in proc.stderr
