"""Shared fixtures: the embedded SmolLM2 model directory and a tiny random-weight Llama.

Load engines once per module (module-scoped fixtures in each test file): start-up is seconds.
"""

from __future__ import annotations

import os

import pytest
import torch

# Triton reads TRITON_INTERPRET when triton.language is first imported, and torch imports it on its
# own in some tests (whichever runs first): without a GPU, the Triton kernels' tests run under the
# interpreter only if it is set before any of that, so here, at the start of the session.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


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
