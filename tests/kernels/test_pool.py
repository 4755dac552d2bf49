"""The kernels' thread pool (csrc/cpu/pool.h): every kernel gives the same bits at any thread count,
on its own pool and on OpenMP's team, and with one thread taken off its core in the middle of its
work (the test hook sleeps it right after it claims items, as the OS does on a busy machine); the
share of a late thread is done by the others. Run for every kernel family this machine runs."""

from __future__ import annotations

import contextlib
import os
import time

import pytest
import torch

from minisgl_backend.model import cpu_kernels
from minisgl_backend.native import _kernels as _native_mod  # noqa: F401  (skip below when missing)

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="the native kernels are not built here")

FAMILIES = [f for f in ("amx", "avx512bf16", "avx512", "avx2") if cpu_kernels.runs_family(f)]
THREADS = (2, 3, 4)
DELAY_US = 3000


@contextlib.contextmanager
def _delayed(slot: int, micros: int):
    cpu_kernels.pool_test_delay(slot, micros)
    try:
        yield
    finally:
        cpu_kernels.pool_test_delay(0, 0)


@contextlib.contextmanager
def _openmp(on: bool):
    cpu_kernels.use_openmp(on)
    try:
        yield
    finally:
        cpu_kernels.use_openmp(False)


def _g(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _cases(family: str) -> dict[str, object]:
    """name -> a function running one kernel call under the current family (inputs fixed)."""
    g = _g(3)
    cases: dict[str, object] = {}
    w = (torch.randn(200, 96, generator=g) * 0.05).bfloat16()
    x4 = torch.randn(4, 96, generator=g).bfloat16()
    cases["few-row linear"] = lambda: cpu_kernels.linear(x4, w)
    packed = cpu_kernels.pack(w)
    if packed is not None:
        for m in (3, 37, 300):
            xm = torch.randn(m, 96, generator=g).bfloat16()
            cases[f"packed linear, {m} rows"] = lambda xm=xm: cpu_kernels.linear_packed(xm, packed, (200, 96))
    gate_up = (torch.randn(128, 96, generator=g) * 0.05).bfloat16()
    gated = cpu_kernels.pack(gate_up, gated=True)
    if gated is not None:
        x40 = torch.randn(40, 96, generator=g).bfloat16()
        cases["packed gate/up silu"] = lambda: cpu_kernels.linear_packed_silu(x40, gated, (128, 96))
    if family != "avx2":
        qw, qs = (
            torch.randint(-127, 128, (200, 96), generator=g).to(torch.int8),
            torch.rand(200, generator=g) / 50,
        )
        cases["int8 linear"] = lambda: cpu_kernels.linear_int8(x4, qw, qs, None)
    kvh, d, bs, pool = 2, 64, 16, 32
    k = torch.randn(pool, bs, kvh, d, generator=g).bfloat16()
    v = torch.randn(pool, bs, kvh, d, generator=g).bfloat16()
    tables = torch.stack([torch.randperm(pool, generator=g)[:5] for _ in range(3)])
    row_table = torch.tensor([0] * 45 + [1, 2])
    pos = torch.cat([torch.arange(20, 65), torch.tensor([33, 70])])
    q = torch.randn(47, 2 * kvh, d, generator=g).bfloat16()
    cases["paged attention, prefill and decode rows"] = lambda: cpu_kernels.paged_attention(
        q, k, v, tables, row_table, pos, d**-0.5, None, None
    )
    x = torch.randn(64, 96, generator=g).bfloat16()
    res = torch.randn(64, 96, generator=g).bfloat16()
    nw = torch.randn(96, generator=g).bfloat16()
    cases["rms norm + residual, 64 rows"] = lambda: cpu_kernels.rms_norm(x, nw, 1e-5, False, add=res)
    cases["silu and mul, 64 rows"] = lambda: cpu_kernels.silu_and_mul(torch.cat([x, res], dim=1))
    cos, sin = torch.randn(64, 1, 16, generator=g).bfloat16(), torch.randn(64, 1, 16, generator=g).bfloat16()

    def rope():
        heads = x.view(64, 6, 16).clone()
        assert cpu_kernels.rope_(heads, cos, sin)
        return heads

    cases["rope, 64 rows"] = rope
    return cases


def _flat(out) -> list[torch.Tensor]:
    if isinstance(out, tuple):
        return [t for t in out if t is not None]
    assert out is not None, "the kernel did not run"
    return [out]


@pytest.mark.parametrize("family", FAMILIES)
def test_every_kernel_has_the_same_bits_at_any_thread_count_and_with_a_late_thread(family):
    with cpu_kernels.family_override(family):
        for name, run in _cases(family).items():
            with cpu_kernels.threads_override(1):
                ref = _flat(run())
            for openmp in (False, True):
                with _openmp(openmp):
                    for n in THREADS:
                        with cpu_kernels.threads_override(n):
                            got = _flat(run())
                            with _delayed(1, DELAY_US):
                                late = _flat(run())
                        where = f"{name}, {n} threads, {'OpenMP' if openmp else 'own pool'}"
                        assert all(torch.equal(a, b) for a, b in zip(got, ref)), f"{where}: bits differ"
                        assert all(torch.equal(a, b) for a, b in zip(late, ref)), (
                            f"{where}, one late: bits differ"
                        )


def test_a_late_threads_share_is_done_by_the_others():
    """Thread 1 sleeps after its first claim: it computes no more than that claim (its grain), the
    caller does the rest, and every item is computed once."""
    n, grain = 4096, 8
    with _delayed(1, 300_000):
        by = _native_mod.pool_claims(2, n, grain)
    assert -1 not in by, "an item was never computed"
    assert by.count(1) <= grain
    assert by.count(0) >= n - grain


def test_a_running_pool_shares_out_every_item_once():
    for threads in (1, 2, 3, 8):
        for n in (1, 7, 1000):
            by = _native_mod.pool_claims(threads, n, 0)
            assert len(by) == n and -1 not in by
            assert set(by) <= set(range(min(threads, n)))
    assert set(_native_mod.pool_claims(1, 100, 0)) == {0}, "one thread is the caller alone"


def test_kernel_errors_still_raise_under_the_pool():
    """A bad block table is refused (an IndexError naming it) on more than one thread too."""
    g = _g(0)
    k = torch.randn(4, 4, 1, 16, generator=g)
    q = torch.randn(2, 1, 16, generator=g)
    with cpu_kernels.threads_override(2), pytest.raises(IndexError, match="outside the tables"):
        cpu_kernels.decode_attention(
            q, k, k, torch.tensor([[0], [9]]), torch.tensor([0, 0]), 0.25, None, None
        )


def _allowed(tid: int | str) -> set[int]:
    """The CPUs a thread of this process may run on (its Cpus_allowed_list)."""
    with open(f"/proc/self/task/{tid}/status") as f:
        line = next(x for x in f if x.startswith("Cpus_allowed_list:"))
    cpus: set[int] = set()
    for part in line.split(":", 1)[1].strip().split(","):
        a, _, b = part.partition("-")
        cpus.update(range(int(a), int(b or a) + 1))
    return cpus


def _pool_thread(slot: int) -> str | None:
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError), open(f"/proc/self/task/{tid}/comm") as f:
            if f.read().strip() == f"minisgl-pool-{slot}":
                return tid
    return None


def _pool_thread_allowed() -> set[int] | None:
    """The CPUs the pool's first thread may run on; None before it has started."""
    tid = _pool_thread(1)
    return None if tid is None else _allowed(tid)


def _settles(check, seconds: float = 20.0) -> bool:
    """check() after parallel calls, until it holds: a pool thread places itself when it wakes for a
    call, which may be after the caller has done every item and returned."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        _native_mod.pool_claims(2, 4096, 1)
        if check():
            return True
        time.sleep(0.01)
    return False


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="pinning needs two CPUs in the affinity mask")
def test_pinned_threads_take_a_cpu_each_and_return_to_the_process_mask():
    """Pinning on: a call's caller takes the first CPU of the process's mask and the pool's first
    thread the second (so the OS cannot stack them on one core beside another process); a call on
    one thread, or pinning off, returns a thread to the whole mask. The bits never move."""
    cpus = sorted(os.sched_getaffinity(0))
    g = _g(5)
    w, x = (torch.randn(200, 96, generator=g) * 0.05).bfloat16(), torch.randn(37, 96, generator=g).bfloat16()
    with cpu_kernels.threads_override(2):
        free = cpu_kernels.linear(x, w)
    try:
        cpu_kernels.set_pinning("on")
        assert _settles(lambda: _pool_thread_allowed() == {cpus[1]}), (
            "the pool's first thread did not pin itself to the second CPU"
        )
        assert os.sched_getaffinity(0) == {cpus[0]}, "the caller did not pin itself to the first CPU"
        # what the engine's thread plan reads: the process's CPUs, not the pinned thread's one
        assert cpu_kernels.affinity() == set(cpus)
        from minisgl_backend.model import cpu_threads

        assert f"{len(cpus)} CPUs in the affinity mask" in cpu_threads.usable_cpus()[1]
        with cpu_kernels.threads_override(2):
            assert torch.equal(cpu_kernels.linear(x, w), free), "pinning changed the bits"
        _native_mod.pool_claims(1, 100, 0)
        assert os.sched_getaffinity(0) == set(cpus), "a call on one thread left the caller pinned"
        cpu_kernels.set_pinning("off")
        mask = set(cpus)
        assert _settles(lambda: _pool_thread_allowed() == mask and os.sched_getaffinity(0) == mask)
    finally:
        cpu_kernels.set_pinning("off")
        _settles(lambda: os.sched_getaffinity(0) == set(cpus))
        cpu_kernels.set_pinning("auto")
    with pytest.raises(ValueError, match="auto, on, off"):
        cpu_kernels.set_pinning("always")
