"""CPU seconds by thread role (bench/thread_cpu.py), what `bench-serve --offline-baseline` splits the
server's cost by. CPU time, not wall time: a loaded machine slows these tests, never fails them."""

import os
import sys
import threading
import time

import pytest

from minisgl_backend.bench import thread_cpu

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/task")


def _burn(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def _busy_threads(
    *specs: tuple[str, float],
) -> tuple[list[threading.Thread], threading.Event, list[threading.Event]]:
    """Threads named as given that each burn their CPU seconds, then stay alive until released (a
    thread that ended before a sample is not in it)."""
    release = threading.Event()
    burnt = [threading.Event() for _ in specs]

    def run(seconds: float, flag: threading.Event) -> None:
        _burn(seconds)
        flag.set()
        release.wait()

    threads = [threading.Thread(target=run, args=(s, f), name=name) for (name, s), f in zip(specs, burnt)]
    return threads, release, burnt


def test_each_thread_is_charged_the_cpu_it_spent_under_its_role():
    threads, release, burnt = _busy_threads(("minisgl-compute", 0.4), ("minisgl-serve", 0.2))
    before = thread_cpu.Sample()
    for t in threads:
        t.start()
    _burn(0.2)  # the test's own thread: a client of the engine, not the engine
    for f in burnt:
        assert f.wait(120)
    split = thread_cpu.Sample().since(before)
    release.set()
    for t in threads:
        t.join()
    assert 0.35 <= split["compute"] < 1.0
    assert 0.15 <= split["event loop"] < 0.6
    assert split[thread_cpu.CLIENT] >= 0.15
    assert thread_cpu.server_seconds(split) == pytest.approx(split["compute"] + split["event loop"], abs=0.05)


def test_a_thread_that_ran_a_few_ms_is_charged_them_not_zero():
    """A tiny served run's compute thread may spend only a few ms between the two samples: that is
    read to the microsecond, not in the clock ticks of /proc's stat (which would read 0 or 10 ms)."""
    if thread_cpu._schedstat(str(threading.get_native_id())) is None:
        pytest.skip("this kernel keeps no schedstats")
    threads, release, burnt = _busy_threads(("minisgl-compute", 0.003))
    before = thread_cpu.Sample()
    threads[0].start()
    assert burnt[0].wait(120)
    split = thread_cpu.Sample().since(before)
    release.set()
    threads[0].join()
    assert 0.002 <= split["compute"] < 0.009


def test_roles_follow_the_names_the_engine_and_the_server_give_their_threads():
    assert thread_cpu.role("minisgl-serve-cpu_0") == "server workers"
    assert thread_cpu.role("minisgl-serve") == "event loop"
    assert thread_cpu.role("minisgl-scheduler") == "scheduler"
    assert thread_cpu.role("minisgl-copy") == "copy (sampling)"
    assert thread_cpu.role("Thread-3 (client)") == thread_cpu.CLIENT
    assert thread_cpu.role(None) == thread_cpu.NATIVE  # a thread Python does not know: the kernel pool


def test_a_process_that_is_gone_reads_zero_and_this_one_reads_its_cpu():
    assert thread_cpu.process_seconds(2**22 + 12345) == 0.0
    assert thread_cpu.process_seconds(os.getpid()) > 0


def test_a_doorbell_wakes_every_waiter_with_one_cross_thread_call_per_burst():
    """The scheduler thread posts a token to every running request at once: each stream's event is
    set on the loop, with one call into the loop for the burst, not one per stream."""
    import asyncio

    from minisgl_backend.aio import Doorbell

    async def main() -> tuple[int, list[bool]]:
        loop = asyncio.get_running_loop()
        calls = 0
        original = loop.call_soon_threadsafe

        def counting(*a, **k):  # type: ignore[no-untyped-def]
            nonlocal calls
            calls += 1
            return original(*a, **k)

        loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
        bell = Doorbell(loop)
        events = [asyncio.Event() for _ in range(16)]
        poster = threading.Thread(target=lambda: [bell.ring(e) for e in events])
        poster.start()
        poster.join()  # the whole burst is posted before the loop runs again
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 30)
        bell.ring(events[0])  # rung again after a delivery: a new call
        events[0].clear()
        await asyncio.wait_for(events[0].wait(), 30)
        return calls, [e.is_set() for e in events]

    calls, set_ = asyncio.run(main())
    assert all(set_)
    assert calls == 2
