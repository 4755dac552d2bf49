"""A tiny random-weight Llama with the embedded model's tokenizer: fast tests and stress runs.

Outputs are meaningless text, but every engine path (chunking, preemption, reclaim) runs exactly as
on a real model, in milliseconds per iteration.
"""

from __future__ import annotations

from pathlib import Path

import torch

from minisgl_backend.model.loader import cache_root, resolve_model_dir


def make_tiny_llama(out: Path | None = None, seed: int = 0) -> Path:
    """Write (once) and return a 2-layer, hidden-64 Llama directory."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    out = Path(out) if out is not None else cache_root() / f"tiny-llama-{seed}"
    if (out / "config.json").is_file():
        return out
    cfg = LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-5,
        initializer_range=0.25,  # large weights: outputs depend on context, greedy choices well separated
    )
    torch.manual_seed(seed)
    LlamaForCausalLM(cfg).save_pretrained(out)
    AutoTokenizer.from_pretrained(resolve_model_dir("smollm2-135m-instruct")).save_pretrained(out)
    return out
