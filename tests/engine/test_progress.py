"""Scheduling progress under KV pressure: preemption must never livelock, and a planner that spins
without progress must be caught (a long stress run with mixed batches off is where it shows).

The reproducer: a 10-block pool that cannot hold all three requests at once. With prefill-first
planning, a request preempted by a decode would be re-admitted with the very blocks that decode
needed, and preempted again before its sampled token was processed — forever.
"""

from __future__ import annotations

import time

import pytest

from minisgl_backend import Engine, EngineConfig, SamplingParams
from minisgl_backend.errors import EngineDeadError, EngineStalledError

POLICIES = [
    {"mixed_batches": False, "overlap": True},
    {"mixed_batches": False, "overlap": False},
    {"mixed_batches": True, "overlap": True},
    {"mixed_batches": False, "chunk_size": None, "overlap": True},
]


def _cfg(tiny_model_dir, **kw) -> EngineConfig:
    pool = dict(num_blocks=10, block_size=4, chunk_size=4, max_num_seqs=4, max_num_batched_tokens=64)
    base = dict(model=str(tiny_model_dir), **pool, prefix_cache="off", max_model_len=40, num_threads=1)
    return EngineConfig(**{**base, **kw})


def _run_reproducer(eng: Engine) -> list:
    long_a = SamplingParams(temperature=0, max_tokens=28, ignore_eos=True)
    long_b = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    handles = [eng.submit([11, 12, 13, 14, 15], long_a), eng.submit([21, 22], long_a)]
    time.sleep(0.05)
    handles.append(eng.submit([31], long_b))
    return [h.result(timeout=20) for h in handles]


@pytest.mark.parametrize("policy", POLICIES, ids=["unmixed", "unmixed-serial", "mixed", "whole-prompt"])
def test_preemption_under_a_tight_pool_always_finishes(tiny_model_dir, policy):
    solo_cfg = _cfg(tiny_model_dir, overlap=False, num_blocks=64)
    with Engine(solo_cfg) as ref:
        expected = [
            ref.generate([p], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)[
                0
            ].token_ids
            for p, n in (([11, 12, 13, 14, 15], 28), ([21, 22], 28), ([31], 32))
        ]
    with Engine(_cfg(tiny_model_dir, **policy)) as eng:
        t0 = time.perf_counter()
        outs = _run_reproducer(eng)
        wall = time.perf_counter() - t0
        assert [o.token_ids for o in outs] == expected
        # Progress, not thrash: each preemption costs at most a recompute of one request.
        assert sum(o.num_preemptions for o in outs) <= 20, [o.num_preemptions for o in outs]
        assert wall < 60, f"{wall:.1f}s"  # a livelock runs into the result timeouts; this bounds a crawl
        counts = eng.drain(timeout=30, flush_cache=True)
        assert counts["FREE"] == eng.num_blocks, counts
        assert eng.metrics().get("stalls", 0) == 0


def test_watchdog_fails_a_spinning_planner(tiny_model_dir, monkeypatch):
    """A planner that keeps launching iterations but never commits a token is a livelock: the
    watchdog logs it, counts it and fails the engine with EngineStalledError instead of spinning."""
    from minisgl_backend.scheduler.scheduler import Scheduler

    def complete_dropping_everything(self, batch, out):
        # Sampled tokens are lost and every request starts over: the shape of the old livelock.
        self.last_completed = batch.iteration
        for req in list(self.running):
            self._preempt(req)
        self.retire()
        return []

    monkeypatch.setattr(Scheduler, "complete", complete_dropping_everything)
    eng = Engine(_cfg(tiny_model_dir, num_blocks=64, stall_timeout_s=1.0, metrics_exact=True))
    try:
        handle = eng.submit([5, 6, 7], SamplingParams(temperature=0, max_tokens=4))
        t0 = time.perf_counter()
        with pytest.raises(EngineDeadError) as info:
            handle.result(timeout=20)
        assert time.perf_counter() - t0 < 10
        assert isinstance(info.value.__cause__, EngineStalledError), repr(info.value.__cause__)
        assert "no progress" in str(info.value)
        assert eng.metrics().get("stalls", 0) >= 1
    finally:
        eng.close()
