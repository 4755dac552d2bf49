"""The in-flight tracker (backpressure, native completion callbacks), both implementations."""

from __future__ import annotations

import os
import shutil
import sysconfig
import threading
import time
import warnings

import pytest
import torch

from minisgl_backend.executor import tracker as tracker_mod
from minisgl_backend.executor.tracker import PyInflightTracker, make_tracker, native_available

NEEDS_NATIVE = "minisgl_backend.native._native is not built (pip install -e . with a C++ compiler)"


@pytest.fixture(params=["native", "python"])
def make(request: pytest.FixtureRequest):
    if request.param == "native" and not native_available():
        pytest.skip(NEEDS_NATIVE)
    return lambda max_inflight=4: make_tracker(request.param, max_inflight)


def _compiler_present() -> bool:
    cxx = os.environ.get("CXX") or sysconfig.get_config_var("CXX") or "c++"
    return shutil.which(cxx.split()[0]) is not None


def test_native_built_when_compiler_present() -> None:
    # A broken build must not hide behind the Python fallback: fail loudly where a compiler exists.
    if os.environ.get("MINISGL_SKIP_NATIVE", "") not in ("", "0"):
        pytest.skip("MINISGL_SKIP_NATIVE is set")
    if not _compiler_present():
        pytest.skip("no C++ compiler; the Python callback path is the expected fallback")
    assert native_available(), "a C++ compiler is present but " + NEEDS_NATIVE


def test_counts_and_bulk_drain_order(make) -> None:
    t = make(4)
    assert (t.inflight, t.max_inflight) == (0, 4)
    for _ in range(3):
        t.begin()
    assert t.inflight == 3
    for i in (12, 5, 9):
        t.complete(i)
    assert t.inflight == 0
    assert t.drain() == [12, 5, 9]  # completion order, all at once
    assert t.drain() == []
    t.begin()
    t.complete(1)
    assert t.wait(1.0) == [1]


def test_begin_beyond_max_raises(make) -> None:
    t = make(2)
    t.begin()
    t.begin()
    with pytest.raises(RuntimeError, match="max_inflight=2"):
        t.begin()
    assert t.inflight == 2
    t.complete(0)
    t.begin()  # room again after a completion
    assert t.inflight == 2


def test_wait_times_out_empty(make) -> None:
    t = make()
    start = time.monotonic()
    assert t.wait(0.05) == []
    assert 0.04 <= time.monotonic() - start < 10.0  # returns after its timeout, not never
    assert t.wait(0) == []  # zero: non-blocking


def test_wake_interrupts_blocked_wait(make) -> None:
    t = make()
    threading.Timer(0.05, t.wake).start()
    start = time.monotonic()
    assert t.wait(10.0) == []
    assert time.monotonic() - start < 5.0
    t.wake()  # a wake before the wait makes the next wait return at once
    start = time.monotonic()
    assert t.wait(10.0) == []
    assert time.monotonic() - start < 1.0


def test_wait_returns_on_completion_from_another_thread(make) -> None:
    t = make()
    t.begin()
    threading.Timer(0.05, t.complete, args=(42,)).start()
    assert t.wait(10.0) == [42]
    assert t.inflight == 0


def test_wait_releases_the_gil(make) -> None:
    # A pure-Python thread (needs the GIL) must make progress *during* the wait, not just after it.
    t = make()
    stop = threading.Event()
    stamps: list[float] = []

    def spin() -> None:
        n = 0
        while not stop.is_set():
            n += 1
            if n % 1_000 == 0:
                stamps.append(time.monotonic())

    worker = threading.Thread(target=spin)
    worker.start()
    time.sleep(0.02)
    start = time.monotonic()
    t.wait(0.3)
    end = time.monotonic()
    stop.set()
    worker.join()
    during = [s for s in stamps if start + 0.05 < s < end - 0.05]
    assert len(during) > 10


def test_concurrent_completions_each_id_once(make) -> None:
    threads_n, per_thread = 8, 2_000
    total = threads_n * per_thread
    t = make(total)
    for _ in range(total):
        t.begin()
    seen: list[int] = []

    def produce(k: int) -> None:
        for i in range(k * per_thread, (k + 1) * per_thread):
            t.complete(i)

    workers = [threading.Thread(target=produce, args=(k,)) for k in range(threads_n)]
    for w in workers:
        w.start()
    deadline = time.monotonic() + 15
    while len(seen) < total and time.monotonic() < deadline:
        seen += t.wait(0.1)
    for w in workers:
        w.join()
    seen += t.drain()
    assert sorted(seen) == list(range(total))
    assert t.inflight == 0
    # Each producer's ids arrive in its own order.
    for k in range(threads_n):
        mine = [i for i in seen if i // per_thread == k]
        assert mine == sorted(mine)


def test_make_tracker_rejects_unknown_impl() -> None:
    with pytest.raises(ValueError, match="'native', 'python'"):
        make_tracker("cuda", 4)
    with pytest.raises(ValueError):
        make_tracker("python", 0)


def test_native_falls_back_with_one_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tracker_mod, "_native_module", None)
    monkeypatch.setattr(tracker_mod, "_native_checked", True)
    monkeypatch.setattr(tracker_mod, "_warned_fallback", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = make_tracker("native", 4)
        second = make_tracker("native", 4)
    assert isinstance(first, PyInflightTracker) and isinstance(second, PyInflightTracker)
    assert len([w for w in caught if "Python callback path" in str(w.message)]) == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error path")
def test_cuda_host_complete_without_gpu_raises(make) -> None:
    t = make(4)
    t.begin()
    with pytest.raises(RuntimeError):  # no runtime, no driver or no device: a clear error, no crash
        t.cuda_host_complete(0, 1)
    assert t.inflight == 1 and t.drain() == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_host_complete(make) -> None:
    t = make(4)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        x = torch.randn(2048, 2048, device="cuda")
        for _ in range(4):
            x = x @ x
            x = x / x.norm()
    for i in range(3):
        t.begin()
        t.cuda_host_complete(stream.cuda_stream, i)
    got: list[int] = []
    deadline = time.monotonic() + 10
    while len(got) < 3 and time.monotonic() < deadline:
        got += t.wait(1.0)
    assert got == [0, 1, 2]
    assert t.inflight == 0
    stream.synchronize()
