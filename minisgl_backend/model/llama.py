"""A Llama-family decoder over a paged KV cache: Llama, SmolLM2, Mistral, Qwen2, Qwen3, Phi-3,
Gemma 2 and Gemma 3 (text).

Parameter names mirror Hugging Face's, except that every layer holds its q/k/v projections as one
`qkv_proj` and its gate/up projections as one `gate_up_proj` (Phi-3's own layout; other checkpoints
are read into their rows at load, `fused_layout`): one matmul instead of three and two, which at decode
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
from minisgl_backend.model.batch import ForwardBatch
from minisgl_backend.model.checkpoint import Checkpoint
from minisgl_backend.model.layers import (
    Attention,
    AttentionBackend,
    DecoderLayer,
    DecoderLayers,
    Embedding,
    Linear,
    default_attention,
    norm_layer,
    softcap,
)
from minisgl_backend.model.rope import Rotary
from minisgl_backend.model.spec import ModelSpec
from minisgl_backend.pages import huge_page_empty

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
    """The default forward: every layer in turn from Python, RoPE from the model's Rotary modules.
    attention: the attention back-end chosen at load (model/loader.py, attention_backend), which
    serves every row of every layer; None: default_attention for the model's device and dtype,
    chosen on first use and kept."""

    def __init__(self, attention: AttentionBackend | None = None) -> None:
        self.attention = attention

    def ropes(self, model: CausalLM, positions: torch.Tensor, dtype: torch.dtype) -> Ropes:
        return [rotary(positions, dtype) for rotary in model.model.rotary]

    def layers(
        self, model: CausalLM, x: torch.Tensor, ropes: Ropes, batch: ForwardBatch, kv: KVCache
    ) -> torch.Tensor:
        layers = model.model.layers
        if self.attention is None:
            self.attention = default_attention(model.device, x.dtype)
        backend = self.attention
        # Built once per forward and shared by every layer: the native kernels' row tables, or the
        # masks per window size.
        plan = backend.plan(batch, kv, [layer.self_attn.window for layer in layers])

        def attend(attn: Attention, h: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
            return attn(h, ropes[attn.rope_index], batch, kv, keep=keep, backend=backend, plan=plan)

        return layers.run(x, attend, batch.logits_index)


def build_rotary(spec: ModelSpec) -> nn.ModuleList:
    """One Rotary per distinct RoPE of the model (Attention.rope_index picks a layer's)."""
    return nn.ModuleList(Rotary(r) for r in spec.ropes())


class Decoder(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.embed_tokens = Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = DecoderLayers(DecoderLayer(spec, i) for i in range(spec.num_layers))
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
        # a strategy holding raw pointers into them (the layer stack) knows to rebuild.
        self.weights_version = 0
        self.tie_weights()

    def quantize_int8(self) -> None:
        """`weight_dtype: int8`: every linear layer, the LM head included (untied from the embedding,
        which stays exact), holds int8 weights for decode (see Linear.quantize_int8)."""
        self.weights_version += 1
        if self.embeds_from_head():  # the embedding keeps the exact weights in its own tensor
            self.model.embed_tokens.weight = nn.Parameter(self.lm_head.dense(), requires_grad=False)
        for module in self.modules():
            if isinstance(module, Linear):
                module.quantize_int8()

    def pack_weights(self) -> int:
        """Move every linear layer's weight into the packed kernel's layout (Linear.pack: the pack
        replaces the weight); returns how many took it (0 without AMX or AVX512-BF16, or for a model
        that is not bf16 on the CPU). A tied embedding is released with the LM head's weight and
        reads its rows from the head's pack (embed), so every weight is held once."""
        self.weights_version += 1
        tied = self.lm_head.weight is self.model.embed_tokens.weight
        gated = self._gated_linears()
        # Layers the loader already packed (load_checkpoint's `pack`) stay as they are.
        packed = sum(
            m.packed is not None or m.pack(gated=m in gated) for m in self.modules() if isinstance(m, Linear)
        )
        if tied and self.lm_head.packed is not None:
            self.model.embed_tokens.weight = self.lm_head.weight  # the meta stand-in: rows come from the pack
        return packed

    def _gated_linears(self) -> set[Linear]:
        """The [gate | up] weights packed for the fused SiLU MLP kernel."""
        return {layer.mlp.gate_up_proj for layer in self.model.layers if layer.mlp.hidden_act == "silu"}

    def unpack_weights(self) -> None:
        """Undo pack_weights: every linear layer (and a tied embedding) holds its weight in its own
        layout again, for a caller that changes weights in place."""
        for m in list(self.modules()):
            if isinstance(m, Linear):
                self.unpack_layer(m)

    def unpack_layer(self, lin: Linear) -> None:
        """Linear.unpack on one of this model's layers; a tied embedding reading its rows from the
        LM head's pack shares the unpacked weight again."""
        self.weights_version += 1
        shared = lin is self.lm_head and self.embeds_from_head()
        lin.unpack()
        if shared:
            self.model.embed_tokens.weight = lin.weight

    def embeds_from_head(self) -> bool:
        """Whether the embedding's rows are read from the packed LM head (a tied embedding after
        pack_weights) rather than from its own weight."""
        head = self.lm_head
        return getattr(head, "packed", None) is not None and self.model.embed_tokens.weight is head.weight

    @property
    def device(self) -> torch.device:
        """Where the model runs (its final norm's weight is never packed or released)."""
        return self.model.norm.weight.device

    def decode_weight_bytes(self) -> int:
        """Bytes of linear weights one decode step of one row reads, as Linear.forward picks them
        (int8 at one row, else the packed copy, else the weight): what a batch-1 step streams."""
        total = 0
        for lin in (m for m in self.modules() if isinstance(m, Linear)):
            if lin.qweight is not None and lin.qscale is not None:
                total += lin.qweight.numel() + lin.qscale.numel() * 4
            elif lin.packed is not None:
                total += lin.packed.numel() * lin.packed.element_size()
            else:
                total += lin.weight.numel() * lin.weight.element_size()
        return total

    def weight_bytes(self) -> int:
        """Bytes of the model's parameters in its dtype, a tied one once: what the model needs."""
        params = {id(p): p for p in self.parameters()}.values()
        return sum(p.numel() * p.element_size() for p in params)

    def held_bytes(self) -> int:
        """Bytes of memory the model's tensors hold: parameters and buffers not released (meta),
        packs, int8 weights and scales, each storage once. pack_weights keeps this within the pack
        layouts' padding of weight_bytes(); int8 adds its own weights beside the bf16 ones."""
        tensors = [*self.parameters(), *self.buffers()]
        for m in self.modules():
            extra = (getattr(m, name, None) for name in ("packed", "qweight", "qscale"))
            tensors += [t for t in extra if t is not None]
        storages = {}
        for t in tensors:
            if not t.is_meta:
                s = t.untyped_storage()
                storages[s.data_ptr()] = s.nbytes()
        return sum(storages.values())

    def tie_weights(self) -> None:
        if self.spec.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.embeds_from_head() and self.lm_head.packed is not None:
            x = cpu_kernels.packed_rows(self.lm_head.packed, self.lm_head.weight.shape, input_ids)
        else:
            x = self.model.embed_tokens(input_ids)
        if self.spec.gemma:  # the scale rounded to the model dtype first, as transformers does
            x = x * torch.tensor(self.spec.hidden_size**0.5, dtype=x.dtype, device=x.device)
        return x

    def logits(self, h: torch.Tensor, float32: bool = False) -> torch.Tensor:
        """Final norm, LM head and (Gemma 2) soft-capping of the rows that need logits; `float32`:
        their values as float32 (the LM head writes them so where it can)."""
        h = self.model.norm(h)
        # Soft-capped logits are capped in the model dtype (as transformers does), and the
        # batch-invariant forward's tiled head has no float32 store: both convert afterwards.
        if float32 and self.spec.final_softcap is None and isinstance(self.lm_head, Linear):
            return self.lm_head(h, float32=True)
        out = softcap(self.lm_head(h), self.spec.final_softcap)
        return out.float() if float32 else out

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv: KVCache, float32_logits: bool = False) -> torch.Tensor:
        """Run one mixed batch; returns logits [len(batch.logits_index), vocab] in the model dtype, or
        their values as float32 (`float32_logits`: what the host's sampling reads, without a pass
        that converts them)."""
        x = self.embed(batch.input_ids)
        ropes = self.forward_strategy.ropes(self, batch.positions, x.dtype)
        # Only rows that sample or score need the LM head (the largest matmul at this model size),
        # and the last layer past their K/V: layers() returns those rows only.
        return self.logits(self.forward_strategy.layers(self, x, ropes, batch, kv), float32_logits)

    @torch.no_grad()
    def load_checkpoint(self, checkpoint: Checkpoint, pack: bool = False) -> None:
        """Read every weight from `checkpoint` into this model's parameters in place (their dtype and
        device: converted on the way where the checkpoint's differ), one tensor at a time, so
        loading never holds a second copy of the model. Hugging Face's separate projections land
        in their rows of the fused ones (fused_layout). Raises ValueError naming what is missing,
        unexpected or mis-shaped.

        `pack`: each linear weight the packed kernels take is read into one reusable buffer and
        packed from there as pack_weights would pack it (the same bits), so its own memory is never
        written: that is most of a model, and writing it first would fault in every page of it
        only to copy it into the packs and release it."""
        self.tie_weights()  # moving off the meta device unties shared parameters
        params = self.state_dict(keep_vars=True)
        layout = fused_layout({k: v for k, v in checkpoint.shapes.items() if "rotary_emb" not in k})
        tied = self.spec.tie_word_embeddings
        if tied:
            layout.pop("lm_head.weight", None)
        missing = [k for k in params if k not in layout and not (tied and k == "lm_head.weight")]
        unexpected = [k for k in layout if k not in params]
        if missing or unexpected:
            raise ValueError(
                f"checkpoint does not match the model: missing={missing[:5]} unexpected={unexpected[:5]}"
            )
        packed_by = self._packed_at_load(self.device) if pack else {}
        largest = max((params[t].numel() for t in packed_by), default=0)
        buffer = huge_page_empty(largest, self.lm_head.weight.dtype)
        gated = self._gated_linears()
        for target, parts in layout.items():
            dest = params[target].data
            lin = packed_by.get(target)
            into = dest if lin is None else buffer[: dest.numel()].view(dest.shape)
            if len(parts) == 1:
                checkpoint.read_into(parts[0][0], into)
            else:
                shapes = [checkpoint.shapes[name] for name, _ in parts]
                if sum(s[0] for s in shapes) != into.shape[0] or any(s[1:] != into.shape[1:] for s in shapes):
                    want = list(into.shape)
                    raise ValueError(
                        f"{target}: the checkpoint's parts {shapes} do not make the model's {want}"
                    )
                for (name, row), shape in zip(parts, shapes, strict=True):
                    checkpoint.read_into(name, into[row : row + shape[0]])
            if lin is not None and not lin.pack(gated=lin in gated, values=into):
                raise RuntimeError(f"{target}: the packed kernels turned down a weight they take")
        if tied and self.lm_head.packed is not None:
            self.model.embed_tokens.weight = self.lm_head.weight  # as pack_weights leaves it

    def materialize(self, device: torch.device | str, pack: bool = False) -> None:
        """Give a model built on the meta device uninitialised memory on `device` (to_empty), except
        the linear weights load_checkpoint(pack=True) packs as it reads them (`pack`): those stay on
        the meta device, since their values go from the checkpoint into the packs and memory of
        their own would only be reserved, never written (most of the model, reserved twice at the
        peak of loading, more than a machine that does not overcommit memory lends)."""
        device = torch.device(device)
        kept = [(lin, lin.weight) for lin in self._packed_at_load(device).values()] if pack else []
        tied_kept = any(lin is self.lm_head for lin, _ in kept) and self.spec.tie_word_embeddings
        for lin, _ in kept:  # to_empty passes over an absent parameter
            lin.weight = None  # type: ignore[assignment]
        if tied_kept:
            self.model.embed_tokens.weight = None  # type: ignore[assignment]
        self.to_empty(device=device)
        for lin, weight in kept:
            lin.weight = weight
        if tied_kept:
            self.model.embed_tokens.weight = self.lm_head.weight

    def _packed_at_load(self, device: torch.device) -> dict[str, Linear]:
        """Parameter name -> the linear layer whose weight it is, for the weights the packed
        kernels take on `device` (a tied embedding's is the LM head's)."""
        out = {}
        for name, module in self.named_modules():
            if isinstance(module, Linear) and cpu_kernels.packs_weight(module.weight, device):
                key = f"{name}.weight"
                if module is self.lm_head and self.spec.tie_word_embeddings:
                    key = "model.embed_tokens.weight"
                out[key] = module
        return out


# The fused parameters and the Hugging Face projections they hold, in row order.
FUSED = (
    ("self_attn.qkv_proj", ("q_proj", "k_proj", "v_proj")),
    ("mlp.gate_up_proj", ("gate_proj", "up_proj")),
)


def fused_layout(shapes: dict[str, tuple[int, ...]]) -> dict[str, list[tuple[str, int]]]:
    """Where each checkpoint tensor goes: model parameter name -> [(checkpoint name, first row)].
    Hugging Face's separate q/k/v and gate/up projections are concatenated into the model's
    `qkv_proj` (rows q, k, v) and `gate_up_proj` (rows gate, up): the layout Phi-3 checkpoints
    already store, in transformers' row order. A layer missing a part keeps its parts under their
    own names, so the caller names what is missing."""
    out: dict[str, list[tuple[str, int]]] = {name: [(name, 0)] for name in shapes}
    for fused, parts in FUSED:
        owner, _, leaf_name = fused.rpartition(".")
        for name in [k for k in shapes if k.endswith(f"{owner}.{parts[0]}.weight")]:
            base = name[: -len(f"{parts[0]}.weight")]
            for leaf in ("weight", "bias"):
                names = [f"{base}{p}.{leaf}" for p in parts]
                if all(n in out and len(shapes[n]) >= 1 for n in names):
                    row, placed = 0, []
                    for n in names:
                        del out[n]
                        placed.append((n, row))
                        row += shapes[n][0]
                    out[f"{base}{leaf_name}.{leaf}"] = placed
    return out
