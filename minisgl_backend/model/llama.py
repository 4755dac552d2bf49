"""A Llama-family decoder over a paged KV cache: Llama, SmolLM2, Mistral, Qwen2, Qwen3, Phi-3,
Gemma 2 and Gemma 3 (text).

Parameter names mirror Hugging Face's, except that every layer holds its q/k/v projections as one
`qkv_proj` and its gate/up projections as one `gate_up_proj` (Phi-3's own layout; other checkpoints
are concatenated at load, `fuse_projections`): one matmul instead of three and two, which at decode
is one weight stream and one call. The only difference from the reference
implementation is attention: K/V of new tokens are written into the block pool, and every query
reads its whole context back through its block table. The architectures differ by switches read
from the config (`ModelSpec`): RoPE variant (`model/rope.py`), sliding-window layers, q/k norm,
qkv bias, attention scale and logit soft-capping, and the Gemma block (`ModelSpec.gemma`).

How the layers run over a batch is the model's forward strategy (`Forward`), which whoever builds
the model picks (`model/loader.py`, prepare): by default `LayerLoop`, each layer in turn from Python.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from minisgl_backend.kvcache.storage import KVCache
from minisgl_backend.model import cpu_kernels
from minisgl_backend.model.batch import ForwardBatch, chunk_mask, decode_window, row_tables
from minisgl_backend.model.layers import (
    Attention,
    DecoderLayer,
    GemmaRMSNorm,
    Linear,
    RMSNorm,
    norm_layer,
    softcap,
)
from minisgl_backend.model.rope import Rotary
from minisgl_backend.model.spec import SUPPORTED_MODEL_TYPES, ModelSpec

# This module's names, and those it held before the spec, the batch and the layers moved to their own
# modules (tests and scripts import them from here).
__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "Attention",
    "CausalLM",
    "Decoder",
    "Forward",
    "ForwardBatch",
    "GemmaRMSNorm",
    "LayerLoop",
    "Linear",
    "ModelSpec",
    "RMSNorm",
    "Ropes",
    "build_rotary",
    "chunk_mask",
    "fuse_projections",
]

# (cos, sin) [N, 1, rotary dim] per RoPE of the model (Decoder.rotary), for the N rows of a batch.
Ropes = list[tuple[torch.Tensor, torch.Tensor]]


class Forward(Protocol):
    """How CausalLM.forward runs the decoder over one batch, between the embeddings and the final
    norm and LM head: the RoPE tables its rows get and how the layers run."""

    def ropes(self, model: CausalLM, positions: torch.Tensor, dtype: torch.dtype) -> Ropes:
        """(cos, sin) per RoPE of `model` at `positions`, in `dtype`."""
        ...

    def layers(
        self, model: CausalLM, x: torch.Tensor, ropes: Ropes, batch: ForwardBatch, kv: KVCache
    ) -> torch.Tensor:
        """The residual stream after the last layer at the rows batch.logits_index, for x = the
        embeddings of the batch's rows (the K/V of all its new tokens are written into `kv` on the
        way; the last layer runs the rest only for those rows, DecoderLayer.forward)."""
        ...


class LayerLoop:
    """The default forward: every layer in turn from Python, RoPE from the model's Rotary modules."""

    def ropes(self, model: CausalLM, positions: torch.Tensor, dtype: torch.dtype) -> Ropes:
        return [rotary(positions, dtype) for rotary in model.model.rotary]

    def layers(
        self, model: CausalLM, x: torch.Tensor, ropes: Ropes, batch: ForwardBatch, kv: KVCache
    ) -> torch.Tensor:
        layers = model.model.layers
        # The native paged attention reads every row's keys in place (prefill chunks included: on
        # this CPU it beats SDPA over a gathered context, measured in docs/performance.md, "Speed
        # (CPU kernels)"); otherwise masks are built once per window size and shared by every layer
        # with that window.
        masks: dict[int | None, tuple] = {}
        rows = None
        if cpu_kernels.attention_runs(x, kv.k[0], kv.v[0]):
            rows = row_tables(batch)
            masks = dict.fromkeys({layer.self_attn.window for layer in layers}, ([], None))
        else:
            for w in {layer.self_attn.window for layer in layers}:
                masks[w] = (
                    [chunk_mask(chunk, w) for chunk in batch.prefill_chunks],
                    decode_window(batch, w, kv.block_size),
                )

        def attend(attn: Attention, h: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
            return attn(h, ropes[attn.rope_index], batch, kv, *masks[attn.window], rows=rows, keep=keep)

        for layer in layers[:-1]:
            x = layer(x, attend)
        return layers[-1](x, attend, batch.logits_index)


def build_rotary(spec: ModelSpec) -> nn.ModuleList:
    """One Rotary per distinct RoPE of the model (Attention.rope_index picks a layer's)."""
    return nn.ModuleList(Rotary(r) for r in spec.ropes())


class Decoder(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(spec, i) for i in range(spec.num_layers))
        self.norm = norm_layer(spec, spec.hidden_size)
        self.rotary = build_rotary(spec)


class CausalLM(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        self.model = Decoder(spec)
        self.lm_head = Linear(spec.hidden_size, spec.vocab_size, bias=False)
        # How forward() runs the layers; whoever builds the model sets it once the weights are final
        # (model/loader.py's prepare, from the engine config).
        self.forward_strategy: Forward = LayerLoop()
        # Bumped by each transform that replaces weight tensors (quantize_int8, pack_weights), so that
        # a strategy holding raw pointers into them (the decode stack) knows to rebuild.
        self.weights_version = 0
        self.tie_weights()

    def quantize_int8(self) -> None:
        """`weight_dtype: int8`: every linear layer, the LM head included (untied from the embedding,
        which stays exact), holds int8 weights for decode (see Linear.quantize_int8)."""
        self.weights_version += 1
        for module in self.modules():
            if isinstance(module, Linear):
                module.quantize_int8()

    def pack_weights(self) -> int:
        """Pack every linear layer's weight for the packed kernel (Linear.pack); returns how many took
        it (0 without AMX or AVX512-BF16, or for a model that is not bf16 on the CPU). Costs one
        more copy of those weights in memory: F.linear paths and the tied embedding keep reading
        the original."""
        self.weights_version += 1
        gated = {id(layer.mlp.gate_up_proj) for layer in self.model.layers if layer.mlp.hidden_act == "silu"}
        return sum(m.pack(gated=id(m) in gated) for m in self.modules() if isinstance(m, Linear))

    def decode_weight_bytes(self) -> int:
        """Bytes of linear weights one decode step of one row reads, as Linear.forward picks them
        (int8 at one row, else the packed copy, else the weight): what a batch-1 step streams."""
        total = 0
        for lin in (m for m in self.modules() if isinstance(m, Linear)):
            if lin.qweight is not None:
                total += lin.qweight.numel() + lin.qscale.numel() * 4
            elif lin.packed is not None:
                total += lin.packed.numel() * lin.packed.element_size()
            else:
                total += lin.weight.numel() * lin.weight.element_size()
        return total

    def tie_weights(self) -> None:
        if self.spec.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        if self.spec.gemma:  # the scale rounded to the model dtype first, as transformers does
            x = x * torch.tensor(self.spec.hidden_size**0.5, dtype=x.dtype, device=x.device)
        return x

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm, LM head and (Gemma 2) soft-capping of the rows that need logits."""
        return softcap(self.lm_head(self.model.norm(h)), self.spec.final_softcap)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv: KVCache) -> torch.Tensor:
        """Run one mixed batch; returns logits [len(batch.logits_index), vocab] in the model dtype."""
        x = self.embed(batch.input_ids)
        ropes = self.forward_strategy.ropes(self, batch.positions, x.dtype)
        # Only rows that sample or score need the LM head (the largest matmul at this model size),
        # and the last layer past their K/V: layers() returns those rows only.
        return self.logits(self.forward_strategy.layers(self, x, ropes, batch, kv))

    def load_hf_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        state = fuse_projections({k: v for k, v in state.items() if "rotary_emb" not in k})
        self.tie_weights()  # moving off the meta device unties shared parameters
        if self.spec.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        missing, unexpected = self.load_state_dict(state, strict=False)
        missing = [k for k in missing if not (self.spec.tie_word_embeddings and k == "lm_head.weight")]
        if missing or unexpected:
            raise ValueError(
                f"checkpoint does not match the model: missing={missing[:5]} unexpected={unexpected[:5]}"
            )


def fuse_projections(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Hugging Face's separate q/k/v and gate/up projections concatenated into the model's
    `qkv_proj` (rows q, k, v) and `gate_up_proj` (rows gate, up): the layout Phi-3 checkpoints
    already store, in transformers' row order. A layer missing a part is left as it is, so
    load_state_dict names what is missing."""
    out = dict(state)
    for fused, parts in (
        ("self_attn.qkv_proj", ("q_proj", "k_proj", "v_proj")),
        ("mlp.gate_up_proj", ("gate_proj", "up_proj")),
    ):
        owner = fused.rpartition(".")[0]
        for name in [k for k in state if k.endswith(f"{owner}.{parts[0]}.weight")]:
            base = name[: -len(f"{parts[0]}.weight")]
            for leaf in ("weight", "bias"):
                names = [f"{base}{p}.{leaf}" for p in parts]
                if all(n in out for n in names):
                    out[f"{base}{fused.rpartition('.')[2]}.{leaf}"] = torch.cat([out.pop(n) for n in names])
    return out
