"""The CUDA back-end (executor/cuda.py) against the CPU one. Skipped without a GPU; run by
scripts/gpu_check.sh on a machine that has one."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from minisgl_backend import Engine, EngineConfig, SamplingParams
from minisgl_backend.executor.cuda import CUDAExecutor
from minisgl_backend.executor.tracker import native_available
from tests.helpers import SMALL_POOL, assert_drained, token_prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
SCORED = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=3, logprobs=3)


def _config(tiny_model_dir, **overrides) -> EngineConfig:
    return EngineConfig(model=str(tiny_model_dir), **SMALL_POOL, **overrides)


def _run(cfg: EngineConfig, prompts, params):
    with Engine(cfg) as eng:
        outs = eng.generate(prompts, params, use_tqdm=False)
        assert_drained(eng)  # every block, row and slot fence retired (the prefix cache flushed)
        return outs, eng


@pytest.fixture(scope="module")
def cpu_reference(tiny_model_dir):
    prompts = token_prompts(12)
    greedy, _ = _run(_config(tiny_model_dir), prompts, GREEDY)
    scored, _ = _run(_config(tiny_model_dir), prompts[:4], SCORED)
    return prompts, greedy, scored


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "serial"])
def test_cuda_greedy_equals_cpu(tiny_model_dir, cpu_reference, overlap):
    prompts, greedy, _ = cpu_reference
    outs, eng = _run(_config(tiny_model_dir, device="cuda", overlap=overlap), prompts, GREEDY)
    assert isinstance(eng._executor, CUDAExecutor)
    assert [o.token_ids for o in outs] == [o.token_ids for o in greedy]


def test_cuda_graph_decode_equals_cpu(tiny_model_dir, cpu_reference):
    """Decode batches replay captured CUDA graphs at their bucket (cuda_graphs: true)."""
    prompts, greedy, _ = cpu_reference
    outs, eng = _run(_config(tiny_model_dir, device="cuda", cuda_graphs=True), prompts, GREEDY)
    graphs = eng._executor._graphs
    assert graphs is not None and graphs.captured
    assert [o.token_ids for o in outs] == [o.token_ids for o in greedy]


def test_cuda_prompt_logprobs_close_to_cpu(tiny_model_dir, cpu_reference):
    prompts, _, scored = cpu_reference
    outs, _ = _run(_config(tiny_model_dir, device="cuda"), prompts[:4], SCORED)
    for got, want in zip(outs, scored):
        assert got.token_ids == want.token_ids
        a = np.array([lp.logprob for lp in got.prompt_logprobs if lp is not None])
        b = np.array([lp.logprob for lp in want.prompt_logprobs if lp is not None])
        assert len(a) == len(b) > 0
        np.testing.assert_allclose(a, b, atol=2e-3, rtol=0)


def test_model_and_kv_live_on_the_device(tiny_model_dir):
    with Engine(_config(tiny_model_dir, device="cuda")) as eng:
        ex = eng._executor
        assert next(ex.model.parameters()).device.type == "cuda"
        assert ex.kv.k[0].device.type == "cuda"
        eng.generate(token_prompts(1), GREEDY, use_tqdm=False)
        slots = ex._ring._free + ex._ring._reclaim.pending()
        bufs = [buf for slot in slots for buf in slot._bufs.values()]
        assert len(slots) == ex.tracker.max_inflight and bufs and all(b.is_pinned() for b in bufs)


@pytest.mark.skipif(not native_available(), reason="native extension not built")
def test_native_host_callback_drives_the_copy_worker(tiny_model_dir, cpu_reference):
    """The copy worker gets its work only from cudaLaunchHostFunc callbacks into the native tracker:
    if they did not fire, nothing would complete."""
    from minisgl_backend.native import _native

    assert _native.cuda_runtime_available()
    prompts, greedy, _ = cpu_reference
    with Engine(_config(tiny_model_dir, device="cuda", callback_impl="native")) as eng:
        assert type(eng._executor._copied) is _native.InflightTracker
        outs = eng.generate(prompts, GREEDY, use_tqdm=False)
        assert [o.token_ids for o in outs] == [o.token_ids for o in greedy]
        assert eng._executor._copied.inflight == 0


def test_python_callback_path_on_cuda(tiny_model_dir, cpu_reference):
    prompts, greedy, _ = cpu_reference
    outs, _ = _run(_config(tiny_model_dir, device="cuda", callback_impl="python"), prompts, GREEDY)
    assert [o.token_ids for o in outs] == [o.token_ids for o in greedy]


def test_cuda_trace_has_gpu_forward_spans(tiny_model_dir):
    with Engine(_config(tiny_model_dir, device="cuda", trace=True)) as eng:
        eng.generate(token_prompts(4), GREEDY, use_tqdm=False)
        spans = eng.tracer.spans
    forwards = [s for s in spans if s[0] == "compute"]
    samples = {s[1].split()[1]: s for s in spans if s[0] == "copy"}
    assert forwards and all(b >= a for _, _, a, b in forwards)
    for _, name, _, end in forwards:  # a forward's logits are sampled after the forward ended
        assert samples[name.split()[1]][2] >= end - 1e-3


def test_reduced_logits_give_the_full_copys_tokens(tiny_model_dir, monkeypatch):
    """MINISGL_REDUCE_LOGITS=1: the host gets each sampled row's draw candidates instead of the full
    logits; greedy, seeded and logprob-scored requests give the same tokens and logprobs as with
    the full copy, and every block is free afterwards."""
    prompts = token_prompts(8)
    params = [
        GREEDY,
        SamplingParams(temperature=0.8, seed=7, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=1.2, seed=2**63 + 1, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.7, top_p=0.9, seed=3, max_tokens=12, ignore_eos=True, logprobs=2),
    ] * 2
    monkeypatch.setenv("MINISGL_REDUCE_LOGITS", "0")
    full, _ = _run(_config(tiny_model_dir, device="cuda"), prompts, params)
    monkeypatch.setenv("MINISGL_REDUCE_LOGITS", "1")
    reduced, eng = _run(_config(tiny_model_dir, device="cuda"), prompts, params)
    assert eng._executor._reduce
    assert [o.token_ids for o in reduced] == [o.token_ids for o in full]
    assert [o.logprobs for o in reduced] == [o.logprobs for o in full]
