"""Block lifetimes (a "ghost reply": a block reused too early leaks one request's text into another):
thousands of requests with random arrival and aborts through a pool that is reused constantly,
overlap on. Fenced reclaim gives 0 mismatches against solo runs; the unsafe
debug switch must produce mismatches, proving the harness can see the bug."""

import pytest

from minisgl_backend import EngineConfig
from minisgl_backend.tools.stress import STRESS_POOL, run_stress

pytestmark = pytest.mark.slow  # slow tier: thousands of requests per test


def _config(tiny_model_dir, **kw) -> EngineConfig:
    return EngineConfig(model=str(tiny_model_dir), **(STRESS_POOL | {"overlap": True} | kw))


@pytest.mark.parametrize("mixed", [True, False], ids=["mixed", "prefill-first"])
def test_fenced_reclaim_never_mixes_up_requests(tiny_model_dir, mixed):
    # prefill-first (mixed_batches off) is `minisgl stress`'s default, and the policy that livelocked.
    report = run_stress(_config(tiny_model_dir, mixed_batches=mixed), 2000, seed=1)
    assert report.completed > 1500 and report.aborted > 100
    assert report.mismatches == 0, report.examples
    assert not report.leaked, report.kv_after_drain


def test_unsafe_reclaim_is_caught(tiny_model_dir):
    cfg = _config(tiny_model_dir, mixed_batches=False, debug_unsafe_reclaim=True, debug_delay_ms=2.0)
    report = run_stress(cfg, 1000, seed=2)
    assert report.mismatches > 0, "the harness failed to detect reclaim across a sync boundary"
