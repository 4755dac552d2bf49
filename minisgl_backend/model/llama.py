"""A Llama-family decoder (Llama, SmolLM2, Mistral, Qwen2, Qwen3) over a paged KV cache.

Parameter names mirror Hugging Face's so a safetensors state dict loads as is. The only
difference from the reference implementation is attention: K/V of new tokens are written into
the block pool, and every query reads its whole context back through its block table.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from minisgl_backend.errors import ConfigError
from minisgl_backend.kvcache.storage import KVCache

if TYPE_CHECKING:
    from minisgl_backend.model.batch_invariant import BatchInvariantForward


class PrefillRow(NamedTuple):
    """One prompt chunk: tokens [start, start+length) of the batch, ending at context length ctx_len
    (a later chunk, ctx_len > length, also attends to the cached prefix)."""

    start: int
    length: int
    ctx_len: int
    block_table: torch.Tensor  # [ceil(ctx_len / block_size)] block ids


def chunk_mask(row: PrefillRow) -> torch.Tensor | None:
    """[length, ctx_len] causal mask of a later chunk; None for a first chunk (plain causal)."""
    if row.ctx_len == row.length:
        return None
    prefix = row.ctx_len - row.length
    dev = row.block_table.device  # built where attention runs: the block table is already there
    return torch.arange(row.ctx_len, device=dev)[None, :] <= torch.arange(prefix, row.ctx_len, device=dev)[:, None]


class ForwardBatch(NamedTuple):
    """A flattened mixed batch: decode rows first (one token each), then prefill chunks."""

    input_ids: torch.Tensor  # [N]
    positions: torch.Tensor  # [N]
    slot_mapping: torch.Tensor  # [N] flat KV slot each new token writes
    num_decode: int
    decode_block_tables: torch.Tensor | None  # [B, nb] (padded with block 0)
    decode_mask: torch.Tensor | None  # [B, 1, 1, nb * block_size] bool: key j < context length
    prefill_rows: tuple[PrefillRow, ...]
    logits_index: torch.Tensor  # [M] token rows whose next-token logits are wanted


class ModelSpec(NamedTuple):
    """What the engine reads from a Hugging Face config."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    mlp_bias: bool
    qk_norm: bool

    @classmethod
    def from_hf_config(cls, cfg) -> "ModelSpec":
        model_type = getattr(cfg, "model_type", "llama")
        if model_type not in ("llama", "mistral", "qwen2", "qwen3"):
            raise ConfigError(f"unsupported model_type {model_type!r} in config.json "
                              "(supported: llama, mistral, qwen2, qwen3)")
        rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ConfigError(f"unsupported rope_type {rope_type!r} in config.json: only plain RoPE is implemented")
        theta = rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        max_pos = cfg.max_position_embeddings
        window = getattr(cfg, "sliding_window", None)
        if window and getattr(cfg, "use_sliding_window", True):
            max_pos = min(max_pos, window)  # full attention is exact only inside the window
        return cls(
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_layers=cfg.num_hidden_layers,
            num_heads=cfg.num_attention_heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.rms_norm_eps,
            rope_theta=float(theta),
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or bool(getattr(cfg, "attention_bias", False)),
            mlp_bias=bool(getattr(cfg, "mlp_bias", False)),
            qk_norm=model_type == "qwen3",
        )


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Rotary(nn.Module):
    """RoPE (non-interleaved halves, as in HF Llama); cos/sin computed per batch from positions."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.h, self.kvh, self.d = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.q_proj = nn.Linear(spec.hidden_size, self.h * self.d, bias=spec.qkv_bias)
        self.k_proj = nn.Linear(spec.hidden_size, self.kvh * self.d, bias=spec.qkv_bias)
        self.v_proj = nn.Linear(spec.hidden_size, self.kvh * self.d, bias=spec.qkv_bias)
        self.o_proj = nn.Linear(self.h * self.d, spec.hidden_size, bias=False)
        if spec.qk_norm:
            self.q_norm = RMSNorm(self.d, spec.rms_norm_eps)
            self.k_norm = RMSNorm(self.d, spec.rms_norm_eps)
        self.qk_norm = spec.qk_norm

    def qkv(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], n: int
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Projections of the first n rows of x (the rest is row padding), normed and rotated."""
        q = self.q_proj(x)[:n].view(n, self.h, self.d)
        k = self.k_proj(x)[:n].view(n, self.kvh, self.d)
        v = self.v_proj(x)[:n].view(n, self.kvh, self.d)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = rope
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin, v

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], batch: ForwardBatch, kv: KVCache,
                masks: list[torch.Tensor | None]) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x, rope, n)
        kv.write(self.layer_id, batch.slot_mapping, k, v)

        out = torch.empty_like(q)
        b = batch.num_decode
        if b:
            out[:b] = self._decode_attention(q[:b], batch, kv)
        for row, mask in zip(batch.prefill_rows, masks):
            s, e = row.start, row.start + row.length
            qr = q[s:e].transpose(0, 1)[None]  # [1, h, len, d]
            if mask is None:  # first chunk: its own K/V are the whole context
                kr, vr = k[s:e], v[s:e]
            else:
                kr, vr = kv.gather(self.layer_id, row.block_table)
                kr, vr = kr[: row.ctx_len], vr[: row.ctx_len]
            o = F.scaled_dot_product_attention(
                qr, kr.transpose(0, 1)[None], vr.transpose(0, 1)[None],
                attn_mask=mask, is_causal=mask is None, enable_gqa=True,
            )
            out[s:e] = o[0].transpose(0, 1)
        return self.o_proj(out.reshape(n, self.h * self.d))

    def _decode_attention(self, q: torch.Tensor, batch: ForwardBatch, kv: KVCache) -> torch.Tensor:
        """All decode rows at once: each row's context gathered through its block table, padded, masked.

        Plain batched matmuls grouped by KV head: for one query token per row this is several times
        faster on CPU than SDPA's flash kernel, and it never materialises repeated K/V heads.
        """
        bsz, group = q.shape[0], self.h // self.kvh
        kc, vc = kv.gather(self.layer_id, batch.decode_block_tables)  # [B, L, kvh, d]
        qg = q.view(bsz, self.kvh, group, self.d)
        scores = torch.matmul(qg, kc.permute(0, 2, 3, 1)) * self.d**-0.5  # [B, kvh, group, L]
        scores = scores.float().masked_fill_(~batch.decode_mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(q.dtype)
        return torch.matmul(probs, vc.transpose(1, 2)).view(bsz, self.h, self.d)


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=spec.mlp_bias)
        self.up_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=spec.mlp_bias)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=spec.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, layer_id: int) -> None:
        super().__init__()
        self.self_attn = Attention(spec, layer_id)
        self.mlp = MLP(spec)
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)

    def forward(self, x, rope, batch, kv, masks):
        x = x + self.self_attn(self.input_layernorm(x), rope, batch, kv, masks)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(spec, i) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.rotary = Rotary(spec.head_dim, spec.rope_theta)


class CausalLM(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        self.model = Decoder(spec)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        # Set by model.batch_invariant.enable(): the deterministic forward pass (None = default path).
        self.batch_invariant: "BatchInvariantForward | None" = None
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.spec.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv: KVCache) -> torch.Tensor:
        """Run one mixed batch; returns logits [len(batch.logits_index), vocab] in the model dtype."""
        if self.batch_invariant is not None:  # EngineConfig.deterministic
            return self.batch_invariant.forward(self, batch, kv)
        m = self.model
        x = m.embed_tokens(batch.input_ids)
        rope = m.rotary(batch.positions, x.dtype)
        masks = [chunk_mask(row) for row in batch.prefill_rows]  # built once, shared by every layer
        for layer in m.layers:
            x = layer(x, rope, batch, kv, masks)
        # Only rows that sample or score need the LM head (the largest matmul at this model size).
        return self.lm_head(m.norm(x[batch.logits_index]))

    def load_hf_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        state = {k: v for k, v in state.items() if "rotary_emb" not in k}
        self.tie_weights()  # moving off the meta device unties shared parameters
        if self.spec.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        missing, unexpected = self.load_state_dict(state, strict=False)
        missing = [k for k in missing if not (self.spec.tie_word_embeddings and k == "lm_head.weight")]
        if missing or unexpected:
            raise ValueError(f"checkpoint does not match the model: missing={missing[:5]} unexpected={unexpected[:5]}")
