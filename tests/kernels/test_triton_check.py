"""The GPU attention kernels compile for a GPU this machine does not have (tools/triton_check.py):
what Triton's interpreter cannot show. Every launched variant compiles, keeps its registers (no
spill to local memory) and fits a block's shared memory on an H100/H200 (compute capability 9.0);
the check itself sees a spill where one happens."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from minisgl_backend.tools import triton_check

pytestmark = pytest.mark.gpu_sim

ROOT = Path(__file__).resolve().parents[2]


needs_backend = pytest.mark.skipif(
    triton_check.cuobjdump() is None, reason="triton without its NVIDIA back-end"
)


def _check(tmp_path: Path, *args: str) -> tuple[int, list[dict], str]:
    out = tmp_path / "rows.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the interpreter compiles nothing
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "minisgl_backend.tools.triton_check",
            "--arch",
            "90",
            *args,
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    rows = json.loads(out.read_text()) if out.exists() else []
    return r.returncode, rows, r.stdout + r.stderr


@needs_backend
def test_every_launched_attention_kernel_compiles_for_a_hopper_gpu_without_spilling(tmp_path):
    rc, rows, printed = _check(tmp_path, "--dtype", "bf16", "fp32")
    # decode and prefill, each plain and with every switch, at three head sizes and two dtypes
    assert len(rows) == 2 * 2 * 3 * 2, printed
    bad = [r for r in rows if not r["ok"]]
    assert not bad, printed
    assert all(r["error"] is None and r["spill_bytes"] == 0 and 0 < r["registers"] <= 255 for r in rows)
    assert rc == 0, printed
    assert "24 of 24 variants" in printed


@needs_backend
def test_the_check_sees_the_spill_of_four_warps_at_a_128_wide_head(tmp_path):
    """Four warps holding the default tiles of a 128-wide head spill: the check says so."""
    rc, rows, printed = _check(tmp_path, "--dtype", "bf16", "--head-dim", "128", "--num-warps", "4")
    prefill = [r for r in rows if r["kernel"] == "prefill"]
    assert prefill and all(r["spill_bytes"] > 0 and not r["ok"] for r in prefill), printed
    assert rc == 1, printed
