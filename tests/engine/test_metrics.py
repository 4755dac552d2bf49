"""Bookkeeping off the hot path: per-thread metric buffers folded ~1/s (exact mode on a switch), the
periodic stats line, and the drop-oldest log ring buffer."""

import logging
import time

import pytest

from minisgl_backend import Engine, EngineConfig, SamplingParams
from minisgl_backend.metrics import RingBufferHandler

PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.mark.parametrize("exact", [True, False])
def test_counters_match_the_work_done(tiny_model_dir, exact):
    cfg = EngineConfig(model=str(tiny_model_dir), num_blocks=128, block_size=4, metrics_exact=exact)
    with Engine(cfg) as eng:
        eng.generate([[100 + i] * (5 + i) for i in range(8)], PARAMS, use_tqdm=False)
        eng.drain()
        deadline = time.monotonic() + (0 if exact else 30.0)  # relaxed totals catch up within ~1 s
        while True:
            m = eng.metrics()
            if m.get("generated_tokens") == 48 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
    assert m["generated_tokens"] == 48 and m["requests_finished"] == 8
    assert m["prefill_tokens"] == sum(5 + i for i in range(8))
    assert m["iterations"] >= 6 and m["forward_s"] > 0
    # After drain the only KV in use is what the prefix cache keeps: every full block whose K/V was
    # computed (prompt + 6 tokens, the last of which never had its K/V written).
    assert m["kv_used_blocks"] == m["prefix_cache_blocks"] == sum((5 + i + 6 - 1) // 4 for i in range(8))


def test_periodic_stats_line(tiny_model_dir):
    seen: list[str] = []

    class Capture(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    handler = Capture()
    logger = logging.getLogger("minisgl")
    logger.addHandler(handler)
    try:
        cfg = EngineConfig(model=str(tiny_model_dir), num_blocks=64, block_size=4, stats_interval_s=1.0)
        with Engine(cfg) as eng:
            eng.generate(["hello"] * 4, PARAMS, use_tqdm=False)
            deadline = time.monotonic() + 30  # a line about every second; a loaded machine may lag
            while not any(s.startswith("running=") for s in seen) and time.monotonic() < deadline:
                time.sleep(0.1)
    finally:
        logger.removeHandler(handler)
    lines = [s for s in seen if s.startswith("running=")]
    assert lines and "kv=" in lines[-1] and "tok/s" in lines[-1]


def test_ring_buffer_drops_oldest_and_flushes():
    got: list[str] = []

    class Target(logging.Handler):
        def emit(self, record):
            got.append(record.getMessage())

    ring = RingBufferHandler(Target(), capacity=3, flush_interval_s=3600)
    for i in range(5):
        ring.emit(logging.LogRecord("t", logging.INFO, __file__, 0, f"m{i}", None, None))
    assert [r.getMessage() for r in ring.records] == ["m2", "m3", "m4"]
    ring.flush()
    assert got == ["m2", "m3", "m4"] and not ring.records


def test_stats_line_is_quiet_while_idle_and_counts_kv_as_the_server_does():
    from minisgl_backend.scheduler.loop import StatsLine

    stats = StatsLine(prefix_cache=True)
    stats.num_blocks = 100
    # idle: nothing runs, waits or ran since the last line; 30 blocks kept by the prefix cache alone
    idle = {
        "running": 0,
        "waiting": 0,
        "iterations": 50,
        "kv_used_blocks": 30,
        "prefix_cache_idle_blocks": 30,
    }
    assert stats(idle, dict(idle), 10.0) is None
    # busy: 10 of the 40 blocks in use belong to the prefix cache alone, so requests hold 30%
    busy = {**idle, "running": 2, "iterations": 60, "kv_used_blocks": 40, "prefix_cache_idle_blocks": 10}
    line = stats(busy, idle, 10.0)
    assert line is not None and "running=2" in line and "kv=30%" in line and "cached=10%" in line, line
    # the line that covers the end of a burst is still logged (iterations ran since the last one)
    done = {**busy, "running": 0, "iterations": 70}
    assert stats(done, busy, 10.0) is not None
