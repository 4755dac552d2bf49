"""Fair admission: one submission's many prompts or samples cannot hold every free slot against a
request that arrives after it (`scheduling_policy: fair`, the default); `fcfs` keeps arrival order.
Driven on the scheduler itself, one planning step at a time, so the order is exact."""

from __future__ import annotations

import pytest

from minisgl_backend.config import EngineConfig
from minisgl_backend.errors import ConfigError
from minisgl_backend.executor.token_table import RowPool
from minisgl_backend.handle import RequestHandle
from minisgl_backend.kvcache.block_pool import BlockPool
from minisgl_backend.scheduler.request import Request
from minisgl_backend.scheduler.scheduler import Scheduler
from minisgl_backend.types import SamplingParams


class _Counters:
    def add(self, name: str, value: float = 1.0) -> None:
        pass


def _scheduler(policy: str, max_num_seqs: int = 2) -> Scheduler:
    cfg = EngineConfig(
        max_num_seqs=max_num_seqs, block_size=4, num_blocks=64, prefix_cache="off", scheduling_policy=policy
    )
    return Scheduler(cfg, BlockPool(64), RowPool(8), 256, metrics=_Counters())


def _request(rid: str, owner: str | None = None) -> Request:
    params = SamplingParams(max_tokens=4)
    return Request(rid, [1, 2, 3, 4, 5], params, 0, frozenset(), None, RequestHandle(rid, 1), owner=owner)


def _admitted(s: Scheduler) -> list[str]:
    batch = s.schedule()
    return [e.req.request_id for e in batch.prefill] if batch else []


@pytest.mark.parametrize("policy, expected", [("fair", "late"), ("fcfs", "big-2")])
def test_a_late_request_takes_the_next_free_slot_under_fair_admission(policy, expected):
    s = _scheduler(policy)
    big = [_request(f"big-{i}", owner="big") for i in range(6)]  # one submission's six prompts
    for r in big:
        s.add(r)
    assert _admitted(s) == ["big-0", "big-1"]  # both slots taken
    s.add(_request("late"))
    assert _admitted(s) == []  # no free slot: nobody is admitted, whatever the order
    s.finish(big[0], "stop")
    s.retire()
    assert _admitted(s) == [expected]


def test_owners_take_turns_and_the_one_admitted_least_recently_goes_first():
    s = _scheduler("fair", max_num_seqs=5)
    for i in range(3):
        s.add(_request(f"a-{i}", owner="a"))
    for i in range(3):
        s.add(_request(f"b-{i}", owner="b"))
    s.add(_request("c-0", owner="c"))
    assert _admitted(s) == ["a-0", "b-0", "c-0", "a-1", "b-1"]
    s.finish(s.running[0], "stop")  # a-0: a slot frees while a, b and c were admitted in that order
    s.add(_request("d-0", owner="d"))
    s.retire()
    assert _admitted(s) == ["d-0"], "never admitted goes first"
    s.finish(s.running[0], "stop")
    s.retire()
    assert _admitted(s) == ["a-2"], "then the owner admitted longest ago: a (b went after it)"


def test_samples_of_one_prompt_are_one_owner():
    """Without an owner a request is its own: its n samples (one request id) share one turn."""
    s = _scheduler("fair", max_num_seqs=3)
    for _ in range(3):
        s.add(_request("n-samples"))
    s.add(_request("other"))
    assert _admitted(s) == ["n-samples", "other", "n-samples"]


def test_scheduling_policy_is_checked():
    with pytest.raises(ConfigError, match="scheduling_policy"):
        EngineConfig(scheduling_policy="priority")
