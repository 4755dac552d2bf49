"""The attention back-end chosen at load where triton is missing (model/loader.py,
attention_backend): a GPU model falls back to the torch path with a warning, and asking for the
kernels is refused. Runs without triton (it is made to look absent)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from minisgl_backend.errors import ConfigError
from minisgl_backend.model import loader


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
        assert loader.attention_backend(gpu_model) is None
    assert "triton is not installed" in caplog.text
    cpu_model = SimpleNamespace(device=torch.device("cpu"))
    assert loader.attention_backend(cpu_model) is None


def test_asking_for_the_kernels_without_triton_is_refused(no_triton, monkeypatch):
    monkeypatch.setenv("MINISGL_ATTENTION", "triton")
    with pytest.raises(ConfigError, match="needs the triton package"):
        loader.attention_backend(SimpleNamespace(device=torch.device("cpu")))
