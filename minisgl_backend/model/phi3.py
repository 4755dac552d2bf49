"""Phi-3 checkpoints store the attention's q/k/v and the MLP's gate/up projections fused
(`qkv_proj`, `gate_up_proj`); otherwise the model is the Llama-family decoder (with longrope and
partial rotary from its config). The fused weights are split once at load into the Llama names,
rows in transformers' order: q, k, v and gate, up."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # llama.py imports this module when it loads a Phi-3 checkpoint
    from minisgl_backend.model.llama import ModelSpec


def split_fused_projections(state: dict[str, torch.Tensor], spec: ModelSpec) -> dict[str, torch.Tensor]:
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    out: dict[str, torch.Tensor] = {}
    for name, w in state.items():
        prefix, _, leaf = name.rpartition(".")  # leaf: weight or bias
        if prefix.endswith("self_attn.qkv_proj"):
            base = prefix[: -len("qkv_proj")]
            for part, t in zip(("q_proj", "k_proj", "v_proj"), w.split([q, kv, kv])):
                out[f"{base}{part}.{leaf}"] = t
        elif prefix.endswith("mlp.gate_up_proj"):
            base = prefix[: -len("gate_up_proj")]
            gate, up = w.chunk(2)
            out[f"{base}gate_proj.{leaf}"], out[f"{base}up_proj.{leaf}"] = gate, up
        else:
            out[name] = w
    return out
