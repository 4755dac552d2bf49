"""Shared fixtures: the embedded SmolLM2 model directory and a tiny random-weight Llama.

Load engines once per module (module-scoped fixtures in each test file): start-up is seconds.
"""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session")
def smollm_dir():
    """HF-format directory of the embedded default model (converted from its GGUF on first use)."""
    from minisgl_backend.model.loader import resolve_model_dir

    return resolve_model_dir("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A 2-layer random-weight Llama with SmolLM2's tokenizer: fast, exercises every engine path.
    MINISGL_TOKENIZER=DIR takes the tokenizer files from DIR instead of the embedded model (the GPU
    machine cannot carry the model: scripts/gpu_check.sh)."""
    from minisgl_backend.tools.tiny import make_tiny_llama

    return make_tiny_llama(
        tmp_path_factory.mktemp("tiny-llama"), tokenizer=os.environ.get("MINISGL_TOKENIZER")
    )
