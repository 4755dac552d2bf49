"""Shared fixtures: the embedded SmolLM2 model directory and a tiny random-weight Llama.

Load engines once per module (module-scoped fixtures in each test file): start-up is seconds.
"""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def smollm_dir():
    """HF-format directory of the embedded default model (converted from its GGUF on first use)."""
    from minisgl_backend.model.loader import resolve_model_dir

    return resolve_model_dir("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, smollm_dir):
    """A 2-layer random-weight Llama with SmolLM2's tokenizer: fast, exercises every engine path."""
    from minisgl_backend.tiny import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
