"""Shared fixtures: the embedded SmolLM2 model directory and a tiny random-weight Llama.

Load engines once per module (module-scoped fixtures in each test file): start-up is seconds.
"""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session")
def smollm_dir():
    """HF-format directory of the embedded default model (converted from its GGUF on first use)."""
    from minisgl_backend.model.loader import resolve_model_dir

    return resolve_model_dir("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, smollm_dir):
    """A 2-layer random-weight Llama with SmolLM2's tokenizer: fast, exercises every engine path."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("tiny-llama")
    cfg = LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-5,
        initializer_range=0.25,  # large weights: outputs depend on context, greedy choices well separated
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(smollm_dir).save_pretrained(out)
    return out
