"""The CUDA executor's stream logic run on the CPU: the real `CUDAExecutor` code over SimulatedOps
(executor/device_ops.py), whose copy stream completes late and whose copy destinations hold poison
until the copy lands. Its tokens must equal the CPU executor's, in and out of overlap, with a slow
sampling stage: a missing wait on the uploads, a staging slot reused under a copy in flight, or
logits read before their copy landed would feed the model or the sampler poison (an index out of
range, NaN); a logits copy not ordered after the forward raises StreamHazardError."""

from __future__ import annotations

import threading

import pytest
import torch

from minisgl_backend import Engine, EngineConfig, SamplingParams
from minisgl_backend import engine as engine_mod
from minisgl_backend.executor.cuda import CUDAExecutor
from minisgl_backend.executor.device_ops import SimulatedOps, StreamHazardError, poison_
from minisgl_backend.executor.tracker import PyInflightTracker
from tests.helpers import QUIET, SMALL_POOL, token_prompts

pytestmark = pytest.mark.gpu_sim

# Batch-invariant forward: the reference tokens do not depend on how either engine batched the work,
# so any difference is the executor's.
EXACT = dict(**QUIET, **SMALL_POOL, deterministic=True, stall_timeout_s=30)
PARAMS = [
    SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
    SamplingParams(temperature=0.8, seed=7, max_tokens=10, ignore_eos=True),
]


def _run(model_dir, **config) -> list[list[int]]:
    prompts = token_prompts(6)
    params = [PARAMS[i % 2] for i in range(len(prompts))]
    with Engine(EngineConfig(model=str(model_dir), **EXACT, **config)) as eng:
        return [o.token_ids for o in eng.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def cpu_tokens(tiny_model_dir) -> list[list[int]]:
    return _run(tiny_model_dir)


@pytest.fixture
def simulated(monkeypatch, request) -> list[SimulatedOps]:
    """Engines built in the test run the CUDA executor over SimulatedOps; returns their ops. With
    the parameter True (indirect), its decode batches run at graph buckets (eagerly here)."""
    made: list[SimulatedOps] = []
    graphs = getattr(request, "param", False)

    def make_executor(config, tracker, metrics, tracer):
        ops = SimulatedOps(delay_s=0.002)
        made.append(ops)
        copied = PyInflightTracker(tracker.max_inflight)
        return CUDAExecutor(
            torch.device("cpu"),
            tracker,
            copied,
            metrics,
            tracer,
            debug_delay_ms=config.debug_delay_ms,
            ops=ops,
            decode_graphs=graphs,
        )

    monkeypatch.setattr(engine_mod, "make_executor", make_executor)
    yield made
    for ops in made:
        ops.close()


@pytest.mark.parametrize(
    "config",
    [dict(max_inflight=1), dict(max_inflight=4), dict(max_inflight=4, debug_delay_ms=3.0)],
    ids=["inflight1", "inflight4", "inflight4-slow-sampling"],
)
def test_cuda_executor_on_simulated_streams_matches_the_cpu_executor(
    tiny_model_dir, cpu_tokens, simulated, config
) -> None:
    got = _run(tiny_model_dir, **config)
    assert len(simulated) == 1 and not simulated[0].errors
    assert got == cpu_tokens


@pytest.mark.parametrize("simulated", [True], indirect=True, ids=["graphs"])
def test_decode_at_graph_buckets_on_simulated_streams_matches_the_cpu_executor(
    tiny_model_dir, cpu_tokens, simulated
) -> None:
    """Decode batches run at their bucket over static buffers, the padding rows writing a KV block
    that the engine keeps out of the block pool."""
    with Engine(EngineConfig(model=str(tiny_model_dir), **EXACT, max_inflight=4)) as eng:
        ex = eng._executor
        assert isinstance(ex, CUDAExecutor) and ex._graphs is not None
        assert eng.num_blocks == SMALL_POOL["num_blocks"] and ex.kv.num_blocks == eng.num_blocks + 1
        prompts = token_prompts(6)
        params = [PARAMS[i % 2] for i in range(len(prompts))]
        got = [o.token_ids for o in eng.generate(prompts, params, use_tqdm=False)]
    assert not simulated[0].errors
    assert got == cpu_tokens


def test_simulated_copies_are_poisoned_until_they_land_and_event_waits_wait() -> None:
    ops = SimulatedOps(delay_s=0.05)
    copy = ops.stream("copy")
    # Each copy below is held behind a gate until its destination was checked: a random delay alone
    # can be shorter than this thread's stall on a loaded machine.
    gate = threading.Event()
    copy.submit(lambda: gate.wait(60))
    try:
        host = torch.arange(6, dtype=torch.int64)
        with ops.use(copy):
            dev = ops.h2d(host)
            landed = ops.event()
            ops.record(landed, copy)
        host.fill_(-1)  # a copy reads its source when it runs: the staging buffer must outlive it
        assert (dev == torch.iinfo(torch.int64).max).all()  # issued, not landed
        gate.set()
        compute = ops.stream("compute")
        ops.wait(compute, landed)  # blocks this thread, as the compute worker, until the copy landed
        assert torch.equal(dev, torch.full((6,), -1))
        out = torch.zeros(3)
        gate = threading.Event()
        copy.submit(lambda: gate.wait(60))
        with ops.use(copy):
            ops.d2h(torch.ones(3), out)
        assert out.isnan().all()
        gate.set()
        ops.synchronize()
        assert torch.equal(out, torch.ones(3))
        assert poison_(torch.zeros(2, dtype=torch.bool)).all()
        # A copy of the forward's output must be ordered after it by an event wait.
        compute_end = ops.event()
        with ops.use(compute):
            ops.record(compute_end, compute)
        with ops.use(compute):  # later work on the compute stream, not covered by compute_end
            pass
        with ops.use(copy), pytest.raises(StreamHazardError, match="without waiting"):
            ops.d2h(torch.ones(3), out)
        with ops.use(compute):
            ops.record(compute_end, compute)
        with ops.use(copy):
            ops.wait(copy, compute_end)
            ops.d2h(torch.ones(3), out)
    finally:
        ops.close()


@pytest.mark.parametrize("simulated", [True], indirect=True, ids=["graphs"])
def test_a_closed_engine_drops_its_model_pool_and_graphs(tiny_model_dir, simulated) -> None:
    """close() lets go of the KV pool, the weights and the decode graphs (which hold both) while the
    caller still holds the Engine: on a GPU the next engine sizes its pool from the device's free
    memory, so what a closed engine kept would be taken from it."""
    import gc
    import weakref

    with Engine(EngineConfig(model=str(tiny_model_dir), **EXACT)) as eng:
        ex = eng._executor
        assert isinstance(ex, CUDAExecutor) and ex._graphs is not None
        eng.generate(token_prompts(2), PARAMS[0], use_tqdm=False)
        held = [weakref.ref(t) for t in (ex.kv.k[0], next(ex.model.parameters()), ex._graphs)]
    gc.collect()
    assert [r() is None for r in held] == [True, True, True]
