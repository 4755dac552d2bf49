"""What the engine reads from a Hugging Face config: `ModelSpec`, the switches the Llama-family
decoder (`model/llama.py`) is built from, and the architectures and activations it supports."""

from __future__ import annotations

from typing import NamedTuple

import torch.nn.functional as F

from minisgl_backend.errors import ConfigError
from minisgl_backend.model.rope import RopeSpec

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text")
ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


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
    model_type: str = "llama"
    rope: RopeSpec | None = None  # None: plain RoPE with rope_theta over the whole head
    local_rope: RopeSpec | None = None  # Gemma 3: the RoPE of sliding-window layers (None: `rope`)
    sliding_window: int | None = None  # keys a query sees in a sliding layer, itself included
    sliding_layers: tuple[bool, ...] = ()  # per layer; () = every layer, when sliding_window is set
    attn_scale: float | None = None  # None: head_dim ** -0.5 (Gemma: query_pre_attn_scalar ** -0.5)
    attn_softcap: float | None = None  # Gemma 2: attention scores -> cap * tanh(scores / cap)
    final_softcap: float | None = None  # Gemma 2: the same on the logits
    hidden_act: str = "silu"  # the MLP gate's activation (Gemma: gelu_pytorch_tanh)
    # Gemma 2/3 block: (1 + weight) RMSNorm, embeddings scaled by sqrt(hidden_size), a norm after
    # attention and one before and after the MLP.
    gemma: bool = False

    def window(self, layer: int) -> int | None:
        if self.sliding_window is None or (self.sliding_layers and not self.sliding_layers[layer]):
            return None
        return self.sliding_window

    def ropes(self) -> tuple[RopeSpec, ...]:
        """The distinct RoPEs: [0] global, [1] (Gemma 3) the sliding layers' one."""
        main = self.rope or RopeSpec(self.head_dim, self.rope_theta)
        return (main,) if self.local_rope is None else (main, self.local_rope)

    def rope_index(self, layer: int) -> int:
        """Which of ropes() the layer uses: the local one for a layer typed sliding_attention."""
        return 1 if self.local_rope is not None and self.sliding_layers and self.sliding_layers[layer] else 0

    @classmethod
    def from_hf_config(cls, cfg) -> ModelSpec:
        model_type = getattr(cfg, "model_type", "llama")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"unsupported model_type {model_type!r} in config.json "
                f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        gemma = model_type in ("gemma2", "gemma3_text")
        if getattr(cfg, "use_bidirectional_attention", False):
            raise ValueError(f"{model_type} with use_bidirectional_attention is not a causal LM")
        window = getattr(cfg, "sliding_window", None) if getattr(cfg, "use_sliding_window", True) else None
        layer_types = tuple(getattr(cfg, "layer_types", None) or ())
        unknown = set(layer_types) - {"full_attention", "sliding_attention"}
        if unknown:
            raise ValueError(
                f"unsupported layer_types {sorted(unknown)} (supported: full_attention, sliding_attention)"
            )
        sliding = tuple(t == "sliding_attention" for t in layer_types)
        if sliding and not any(sliding):
            window = None
        rope, local_rope = _rope_specs(cfg, head_dim)
        act = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", "silu")
        if act not in ACTIVATIONS:
            raise ValueError(f"unsupported activation {act!r} (supported: {', '.join(ACTIVATIONS)})")
        scalar = getattr(cfg, "query_pre_attn_scalar", None) if gemma else None
        return cls(
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_layers=cfg.num_hidden_layers,
            num_heads=cfg.num_attention_heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.rms_norm_eps,
            rope_theta=rope.theta,
            max_position_embeddings=rope.context_limit(),  # not capped by a sliding window: it is real
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or bool(getattr(cfg, "attention_bias", False)),
            mlp_bias=bool(getattr(cfg, "mlp_bias", False)),
            qk_norm=model_type in ("qwen3", "gemma3_text"),
            model_type=model_type,
            rope=rope,
            local_rope=local_rope,
            sliding_window=window,
            sliding_layers=sliding,
            attn_scale=float(scalar) ** -0.5 if scalar else None,
            # transformers' Gemma 3 attention ignores attn_logit_softcapping; Gemma 2 applies it.
            attn_softcap=getattr(cfg, "attn_logit_softcapping", None) if model_type == "gemma2" else None,
            final_softcap=getattr(cfg, "final_logit_softcapping", None) if gemma else None,
            hidden_act=act,
            gemma=gemma,
        )


def _rope_specs(cfg, head_dim: int) -> tuple[RopeSpec, RopeSpec | None]:
    """(global RoPE, sliding layers' RoPE or None) from `rope_parameters` (transformers 5) or the
    older `rope_scaling` + `rope_theta`; Gemma 3 nests one dict per layer type."""
    params = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}

    def spec(p: dict) -> RopeSpec:
        p = {"rope_theta": getattr(cfg, "rope_theta", None) or 10000.0, **p}
        return RopeSpec.from_hf(
            p,
            head_dim,
            cfg.max_position_embeddings,
            getattr(cfg, "original_max_position_embeddings", None),
            getattr(cfg, "partial_rotary_factor", None) or 1.0,
        )

    if isinstance(params.get("full_attention"), dict):
        local = params.get("sliding_attention")
        return spec(params["full_attention"]), spec(local) if isinstance(local, dict) else None
    return spec(params), None
