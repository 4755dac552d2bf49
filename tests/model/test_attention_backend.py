"""The attention back-end chosen at load where triton is missing (model/loader.py,
attention_backend): a GPU model falls back to the torch back-end with a warning, and asking for the
kernels is refused. Runs without triton (it is made to look absent)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from minisgl_backend.errors import ConfigError
from minisgl_backend.model import cpu_kernels, loader
from minisgl_backend.model.layers import PagedAttention, TorchAttention


@pytest.fixture
def no_triton(monkeypatch):
    real = loader.importlib.util.find_spec
    monkeypatch.setattr(
        loader.importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real(name, *a)
    )


def test_a_gpu_model_without_triton_runs_the_torch_path(no_triton, monkeypatch, caplog):
    monkeypatch.delenv("MINISGL_ATTENTION", raising=False)
    gpu_model = SimpleNamespace(device=torch.device("cuda", 0))
    with caplog.at_level(logging.WARNING, logger="minisgl"):
        assert isinstance(loader.attention_backend(gpu_model), TorchAttention)
    assert "triton is not installed" in caplog.text
    cpu_model = SimpleNamespace(device=torch.device("cpu"))
    assert isinstance(
        loader.attention_backend(cpu_model), PagedAttention if cpu_kernels.available() else TorchAttention
    )


def test_asking_for_the_kernels_without_triton_is_refused(no_triton, monkeypatch):
    monkeypatch.setenv("MINISGL_ATTENTION", "triton")
    with pytest.raises(ConfigError, match="needs the triton package"):
        loader.attention_backend(SimpleNamespace(device=torch.device("cpu")))


def _spied(base: type) -> type:
    """`base` counting its plan and attend calls."""

    class Spy(base):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            self.plans = self.attends = 0

        def plan(self, batch, kv, windows):
            self.plans += 1
            return super().plan(batch, kv, windows)

        def attend(self, attn, q, k, v, batch, kv, plan, keep):
            self.attends += 1
            return super().attend(attn, q, k, v, batch, kv, plan, keep)

    return Spy


def _prefill_and_decode(model, attention_kind: type, deterministic: bool, stacked: bool = True):
    """A forward strategy over a spy of `attention_kind`, as the loader builds one (stacked: inside
    the native layer stack's strategy, which takes every batch it runs); the logits of a prefill and
    a decode step."""
    from minisgl_backend.model import batch_invariant
    from minisgl_backend.model.layer_stack import LayerStackForward
    from minisgl_backend.model.llama import LayerLoop
    from tests.kernels.test_layer_stack import _decode_batch, _prefilled

    spy = _spied(attention_kind)()
    inner = batch_invariant.enable(model, spy) if deterministic else LayerLoop(spy)
    model.forward_strategy = LayerStackForward(inner, spy) if stacked else inner
    kv, tables = _prefilled(model, 2)
    return spy, model(_decode_batch(tables, 0, seed=3), kv)


@pytest.mark.skipif(not cpu_kernels.available(), reason="the native kernels do not run here")
def test_every_layer_asks_the_one_back_end():
    """The layer loop builds the back-end's plan once per forward and attends every layer through
    it; a model given torch's back-end runs it even where the native kernels run (and then no
    layer stack, which runs the native attention itself), within rounding of the native one."""
    from tests.kernels.test_layer_stack import _model, _spec

    spec = _spec()
    torch_spy, torch_logits = _prefill_and_decode(_model(spec, "unpacked"), TorchAttention, False)
    # two prefills and one decode step, each a forward: one plan each, one attend per layer
    assert (torch_spy.plans, torch_spy.attends) == (3, 3 * spec.num_layers)
    paged_spy, paged_logits = _prefill_and_decode(_model(spec, "unpacked"), PagedAttention, False)
    assert paged_spy.plans == 2  # the decode step ran the native stack: no layer-loop forward
    assert (paged_logits - torch_logits).abs().max() < 0.1 * paged_logits.abs().max()


@pytest.mark.skipif(not cpu_kernels.available(), reason="the native kernels do not run here")
def test_the_layer_stack_and_the_batch_invariant_forward_ask_the_back_end():
    from minisgl_backend.kvcache.storage import KVCache
    from minisgl_backend.model.layer_stack import LayerStack
    from tests.kernels.test_layer_stack import _model, _spec

    model = _model(_spec(), "unpacked")
    s = model.spec
    kv = KVCache(s.num_layers, 8, 16, s.num_kv_heads, s.head_dim, torch.bfloat16, "cpu")
    assert LayerStack.supports(model, kv, PagedAttention())
    assert not LayerStack.supports(model, kv, TorchAttention())
    # the batch-invariant forward attends through a row-invariant back-end, else through its own
    # tiled attention (never torch's default paths, whose bits depend on the batch); the stack,
    # which would take these batches, is left out
    torch_spy, _ = _prefill_and_decode(_model(_spec(), "deterministic"), TorchAttention, True, stacked=False)
    assert torch_spy.attends == 0
    paged_spy, _ = _prefill_and_decode(_model(_spec(), "deterministic"), PagedAttention, True, stacked=False)
    assert paged_spy.attends > 0


def test_the_loader_chooses_the_back_end_once(monkeypatch):
    """attention_backend is the one choice: deterministic never takes Triton, and the strategy it
    builds holds the back-end it chose."""
    from minisgl_backend.model.layer_stack import LayerStackForward
    from minisgl_backend.model.llama import CausalLM
    from tests.helpers import model_spec

    monkeypatch.setenv("MINISGL_ATTENTION", "triton")
    model = CausalLM(model_spec())
    chosen = loader.attention_backend(model, deterministic=True)
    assert isinstance(chosen, PagedAttention if cpu_kernels.available() else TorchAttention)
    strategy = loader.forward_strategy(model, deterministic=True)
    assert isinstance(strategy, LayerStackForward) and strategy.attention is strategy.inner.attention
