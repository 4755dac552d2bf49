"""The CPU thread plan (minisgl_backend/model/cpu_threads.py): the count follows the CPUs the process
may use (affinity mask, cgroup quota), the kernels take their own pool where they run the heavy work
and torch's OpenMP team where torch does, and a forward on OpenMP's team drops to one thread while
the machine is busy and comes back once it is not."""

from __future__ import annotations

import pytest
import torch

from minisgl_backend.bench.load import CompetingLoad
from minisgl_backend.model import cpu_kernels, cpu_threads


def _v2(tmp_path, limits: dict[str, str]):
    """A cgroup v2 tree: {relative dir: cpu.max text}; the process lives in the deepest one."""
    root = tmp_path / "cg"
    for rel, text in limits.items():
        (root / rel).mkdir(parents=True, exist_ok=True)
        (root / rel / "cpu.max").write_text(text)
    deepest = max(limits, key=len)
    proc = tmp_path / "cgroup"
    proc.write_text(f"0::/{deepest}\n")
    return root, proc


def test_cgroup_v2_quota_is_the_tightest_on_the_path(tmp_path):
    root, proc = _v2(
        tmp_path, {"user": "300000 100000", "user/job": "150000 100000", "user/job/run": "max 100000"}
    )
    assert cpu_threads.cgroup_cpu_quota(root, proc) == 1.5
    root, proc = _v2(tmp_path / "b", {"a": "max 100000"})
    assert cpu_threads.cgroup_cpu_quota(root, proc) is None


def test_cgroup_v1_quota(tmp_path):
    base = tmp_path / "cg" / "cpu,cpuacct" / "docker" / "x"
    base.mkdir(parents=True)
    (base / "cpu.cfs_quota_us").write_text("50000\n")
    (base / "cpu.cfs_period_us").write_text("100000\n")
    proc = tmp_path / "cgroup"
    proc.write_text("5:memory:/docker/x\n4:cpu,cpuacct:/docker/x\n")
    assert cpu_threads.cgroup_cpu_quota(tmp_path / "cg", proc) == 0.5
    (base / "cpu.cfs_quota_us").write_text("-1\n")
    assert cpu_threads.cgroup_cpu_quota(tmp_path / "cg", proc) is None
    assert cpu_threads.cgroup_cpu_quota(tmp_path / "cg", tmp_path / "missing") is None


def test_thread_count_follows_affinity_and_quota(monkeypatch):
    monkeypatch.setattr(cpu_threads, "_TORCH_DEFAULT", 8)
    monkeypatch.setattr(cpu_threads.cpu_kernels, "affinity", lambda: {0, 1, 2, 3})
    monkeypatch.setattr(cpu_threads, "cgroup_cpu_quota", lambda: None)
    assert cpu_threads.usable_cpus()[0] == 4
    monkeypatch.setattr(cpu_threads, "cgroup_cpu_quota", lambda: 2.5)
    count, why = cpu_threads.usable_cpus()
    assert count == 2 and "quota of 2.5" in why
    monkeypatch.setattr(cpu_threads, "cgroup_cpu_quota", lambda: 0.5)
    assert cpu_threads.usable_cpus()[0] == 1, "a quota under one CPU still computes on one thread"
    monkeypatch.setattr(cpu_threads.cpu_kernels, "affinity", lambda: {0})
    monkeypatch.setattr(cpu_threads, "cgroup_cpu_quota", lambda: None)
    assert cpu_threads.usable_cpus() == (1, "1 CPU in the affinity mask")
    assert cpu_threads.plan(3, "bfloat16").threads == 3, "num_threads wins"


def test_plan_gives_the_kernels_their_pool_where_they_run_the_heavy_work(monkeypatch):
    monkeypatch.setattr(cpu_threads, "usable_cpus", lambda: (2, "test"))
    for family, library_bf16 in (("amx", None), ("avx512bf16", None), ("avx2", None), ("avx512", False)):
        if cpu_kernels.runs_family(family):
            with cpu_kernels.family_override(family, library_bf16):
                p = cpu_threads.plan(None, "bfloat16")
                assert (p.threads, p.torch_threads, p.openmp) == (2, 1, False), family
                p = cpu_threads.plan(None, "float32")
                assert (p.threads, p.torch_threads, p.openmp) == (2, 2, True), family
    if cpu_kernels.runs_family("avx512"):  # oneDNN's bf16 matmul runs its many-row linears
        with cpu_kernels.family_override("avx512", library_bf16=True):
            p = cpu_threads.plan(None, "bfloat16")
            assert (p.torch_threads, p.openmp) == (2, True)
    with cpu_kernels.family_override("torch"):
        p = cpu_threads.plan(None, "bfloat16")
        assert (p.torch_threads, p.openmp) == (2, True)


@pytest.fixture
def thread_state():
    """Restores torch's thread count, the kernels' count and pool, and the plan after the test."""
    saved = torch.get_num_threads(), cpu_kernels._THREADS, cpu_threads._ACTIVE
    yield
    torch.set_num_threads(saved[0])
    cpu_kernels.set_threads(saved[1])
    cpu_kernels.use_openmp(False)
    cpu_threads._ACTIVE = saved[2]


class _Others:
    """OtherLoad's answer, set by the test."""

    def __init__(self, busy: bool) -> None:
        self.busy = busy

    def update(self, now: float) -> bool:
        return self.busy


def test_a_forward_on_openmp_drops_to_one_thread_while_busy(monkeypatch, thread_state):
    busy = [True]
    clock = [100.0]
    monkeypatch.setattr(cpu_kernels, "contended", lambda: busy[0])
    monkeypatch.setattr(cpu_threads, "_OTHERS", _Others(True))
    monkeypatch.setattr(cpu_threads.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(cpu_threads, "_held_until", 0.0)
    cpu_threads.apply(cpu_threads.ThreadPlan(2, 2, openmp=True, why="test"))
    cpu_threads.adapt()
    assert (cpu_kernels.threads(), torch.get_num_threads()) == (1, 1)
    busy[0] = False
    clock[0] += cpu_threads.HOLD_S / 2
    cpu_threads.adapt()
    assert cpu_kernels.threads() == 1, "it holds one thread for a while before it tries again"
    clock[0] += cpu_threads.HOLD_S
    cpu_threads.adapt()
    assert (cpu_kernels.threads(), torch.get_num_threads()) == (2, 2)
    # the own pool keeps its threads for a step with prompt tokens: it stops spinning instead
    cpu_threads.apply(cpu_threads.ThreadPlan(2, 1, openmp=False, why="test"))
    busy[0] = True
    cpu_threads.adapt()
    assert cpu_kernels.threads() == 2
    # the deterministic mode's plan keeps its count: its probed row tiles hold at that count only
    deterministic = cpu_threads.plan(2, "float32", deterministic=True)
    assert deterministic.openmp and not deterministic.adaptive
    cpu_threads.apply(deterministic)
    clock[0] += 10 * cpu_threads.HOLD_S
    cpu_threads.adapt()
    assert (cpu_kernels.threads(), torch.get_num_threads()) == (2, 2)


def test_a_forward_on_openmp_keeps_its_threads_when_only_its_own_threads_wait(monkeypatch, thread_state):
    """The team kept waiting for a core while no other process uses the CPUs: the engine's own
    scheduler and sampling threads did it (they do on a 2-core machine), and a forward dropped to one
    thread for that would run an idle machine at half speed."""
    monkeypatch.setattr(cpu_kernels, "contended", lambda: True)
    monkeypatch.setattr(cpu_threads, "_OTHERS", _Others(False))
    monkeypatch.setattr(cpu_threads, "_held_until", 0.0)
    cpu_threads.apply(cpu_threads.ThreadPlan(2, 2, openmp=True, why="test"))
    for _ in range(3):
        cpu_threads.adapt()
        assert (cpu_kernels.threads(), torch.get_num_threads()) == (2, 2)


def test_a_few_row_decode_step_on_the_own_pool_runs_on_one_thread_while_busy(monkeypatch, thread_state):
    """A step of a few decode rows reads every weight for little arithmetic: beside a busy process
    one thread does it as fast as two that keep waking each other. Wider steps keep their threads,
    and so does every step while no other process uses the CPUs, whatever the pool's own signal says
    (the engine's own threads trip that one)."""
    others = _Others(True)
    monkeypatch.setattr(cpu_threads, "_OTHERS", others)
    monkeypatch.setattr(cpu_kernels, "contended", lambda: True)
    cpu_threads.apply(cpu_threads.ThreadPlan(2, 1, openmp=False, why="test"))
    cpu_threads.adapt(1)
    assert cpu_kernels.threads() == 1
    assert torch.get_num_threads() == 1, "torch keeps its own count on this plan"
    cpu_threads.adapt(cpu_threads.FEW_DECODE_ROWS)
    assert cpu_kernels.threads() == 1
    cpu_threads.adapt(cpu_threads.FEW_DECODE_ROWS + 1)
    assert cpu_kernels.threads() == 2, "a wide decode step pays for its second thread"
    cpu_threads.adapt(None)
    assert cpu_kernels.threads() == 2, "so does a step with prompt tokens"
    others.busy = False
    cpu_threads.adapt(1)
    assert cpu_kernels.threads() == 2, "no other process: the pool's own signal is not enough"


def _fake_proc(tmp_path, machine_busy: int, own: int) -> None:
    idle = 1000
    (tmp_path / "stat").write_text(f"cpu  {machine_busy} 0 0 {idle} 0 0 0 0 0 0\ncpu0 0 0 0 0\n")
    fields = ["1", "(python (x))", "S"] + ["0"] * 10 + [str(own), "0"] + ["0"] * 30
    (tmp_path / "self_stat").write_text(" ".join(fields))


def test_other_load_counts_the_machines_cpu_time_less_this_process(tmp_path):
    """Over 1 s, the machine busy for 150 ticks of which this process took 40 is 110 ticks' worth of
    other work (1.1 CPUs at 100 ticks a second); busy 80 of which 60 were ours, 20 ticks' worth."""
    load = cpu_threads.OtherLoad(tmp_path / "stat", tmp_path / "self_stat")
    per_s = cpu_threads._TICKS
    _fake_proc(tmp_path, 1000, 500)
    assert load.update(10.0) is False  # the first reading only starts a window
    _fake_proc(tmp_path, 1150, 540)
    assert load.update(10.05) is False, "within a window the last answer holds"
    assert load.update(11.0) is (110 / per_s >= cpu_threads.OtherLoad.BUSY_CPUS)
    assert load.others_cpus == pytest.approx(110 / per_s)
    _fake_proc(tmp_path, 1230, 600)
    assert load.update(12.0) is False and load.others_cpus == pytest.approx(20 / per_s)


def test_other_load_is_never_busy_without_proc(tmp_path):
    load = cpu_threads.OtherLoad(tmp_path / "missing", tmp_path / "missing")
    assert load.update(1.0) is False and load.update(5.0) is False


def _schedstat() -> bool:
    try:
        with open("/proc/thread-self/schedstat") as f:
            return len(f.read().split()) >= 2
    except OSError:
        return False


@pytest.mark.skipif(not cpu_kernels.available(), reason="the native kernels are not built here")
@pytest.mark.skipif(not _schedstat(), reason="this kernel keeps no run-queue statistics (schedstat)")
def test_the_pool_sees_a_busy_machine():
    """With more busy processes than CPUs beside a kernel loop, the run-queue signal turns on (the
    loop runs until it does, bounded); this is what the engine's adapt() and the pool's waits read."""
    import time

    w = torch.randn(512, 512).bfloat16()
    x = torch.randn(4, 512).bfloat16()
    seen = False
    with CompetingLoad(len(cpu_kernels.affinity()) + 1, limit_s=120), cpu_kernels.threads_override(2):
        end = time.monotonic() + 60
        while time.monotonic() < end and not seen:
            cpu_kernels.linear(x, w)
            seen = cpu_kernels.contended()
    assert seen, "60 s of kernel calls beside a saturating load never read as busy"


def test_competing_load_runs_and_ends(tmp_path):
    with CompetingLoad(2, limit_s=60) as load:
        assert load.running == 2
    assert load.running == 0
    with CompetingLoad(1, limit_s=0.2) as load:
        load._procs[0].wait(timeout=60)  # it stops by itself at its limit
        assert load.running == 0
    with pytest.raises(ValueError, match="0 or more"):
        CompetingLoad(-1)
