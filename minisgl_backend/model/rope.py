"""Rotary position embeddings: plain RoPE and the scaled variants transformers defines
(`modeling_rope_utils.py`): linear, dynamic (NTK), yarn, longrope and llama3, with partial rotary.

A variant changes only the inverse frequencies (and, for yarn and longrope, a constant factor on
cos/sin). Two of them depend on the sequence length in transformers: `dynamic` recomputes its base
from the current length once it passes max_position_embeddings, and `longrope` switches from its
short to its long factors once the length passes original_max_position_embeddings. A paged KV cache
keeps keys already rotated, so here **the length is the token's own position + 1**: position p is
rotated exactly as transformers rotates it when it runs the sequence token by token with a cache.
Every sequence within the original length therefore matches transformers exactly, and a position's
cos/sin never depend on the rest of the batch, the chunking or the prefix cache. Beyond the original
length, transformers' whole-sequence forward rotates every position with the frequencies of the
total length (and Phi-3's generate() drops its cache once to do that); this engine does not.
"""

from __future__ import annotations

import math
from typing import NamedTuple, TypeVar

import torch
from torch import nn

from minisgl_backend.model import cpu_kernels

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")
_REQUIRED = {
    "default": (),
    "linear": ("factor",),
    "dynamic": ("factor",),
    "yarn": (),
    "longrope": ("short_factor", "long_factor"),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
}


class RopeSpec(NamedTuple):
    """One rotary embedding, read from a transformers `rope_parameters` dict."""

    head_dim: int
    theta: float = 10000.0
    rope_type: str = "default"
    rotary_dim: int | None = None  # None: the whole head (partial_rotary_factor = 1)
    factor: float | None = None
    max_position_embeddings: int | None = None  # dynamic and yarn/longrope's default factor
    original_max_position_embeddings: int | None = None  # yarn, longrope, llama3
    low_freq_factor: float | None = None  # llama3
    high_freq_factor: float | None = None  # llama3
    attention_factor: float | None = None  # yarn, longrope: None = derived from factor
    beta_fast: float | None = None  # yarn
    beta_slow: float | None = None  # yarn
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn
    truncate: bool = True  # yarn
    short_factor: tuple[float, ...] | None = None  # longrope
    long_factor: tuple[float, ...] | None = None  # longrope

    @classmethod
    def from_hf(
        cls,
        params: dict,
        head_dim: int,
        max_position_embeddings: int,
        original_max_position_embeddings: int | None = None,
        partial_rotary_factor: float = 1.0,
    ) -> RopeSpec:
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"unsupported rope_type {rope_type!r} (supported: {', '.join(ROPE_TYPES)})")
        partial = params.get("partial_rotary_factor", partial_rotary_factor) or 1.0
        dim = int(head_dim * partial)
        get = params.get
        orig = get("original_max_position_embeddings") or original_max_position_embeddings
        if rope_type in ("yarn", "longrope", "llama3") and not orig:
            orig = max_position_embeddings
        missing = [k for k in _REQUIRED[rope_type] if get(k) is None]
        if missing:
            raise ValueError(f"rope_type {rope_type!r} needs {', '.join(missing)} in rope_parameters")
        for k in ("short_factor", "long_factor") if rope_type == "longrope" else ():
            if len(params[k]) != dim // 2:
                raise ValueError(
                    f"longrope {k} has {len(params[k])} entries, expected rotary dim / 2 = {dim // 2}"
                )
        return cls(
            head_dim=head_dim,
            theta=float(get("rope_theta", 10000.0)),
            rope_type=rope_type,
            rotary_dim=None if dim == head_dim else dim,
            factor=get("factor"),
            max_position_embeddings=max_position_embeddings,
            original_max_position_embeddings=orig,
            low_freq_factor=get("low_freq_factor"),
            high_freq_factor=get("high_freq_factor"),
            attention_factor=get("attention_factor"),
            beta_fast=get("beta_fast"),
            beta_slow=get("beta_slow"),
            mscale=get("mscale"),
            mscale_all_dim=get("mscale_all_dim"),
            truncate=get("truncate", True),
            short_factor=tuple(params["short_factor"]) if get("short_factor") else None,
            long_factor=tuple(params["long_factor"]) if get("long_factor") else None,
        )

    @property
    def dim(self) -> int:
        return self.rotary_dim or self.head_dim

    def context_limit(self) -> int:
        """The longest sequence the scaled RoPE is meant for (the engine's default max_model_len).
        `dynamic` stretches max_position_embeddings by its factor and `yarn` its original length (as
        vLLM derives them); the other types state their limit in max_position_embeddings."""
        mpe = _given(self.max_position_embeddings, "max_position_embeddings")
        if self.rope_type == "dynamic":
            return int(mpe * _given(self.factor, "factor"))
        if self.rope_type == "yarn" and self.factor:
            return max(
                mpe, int(_given(self.original_max_position_embeddings, "original length") * self.factor)
            )
        return mpe


T = TypeVar("T")


def _given(value: T | None, name: str) -> T:
    """A field the rope_type needs: from_hf checks them, so None here means a hand-built spec lacks it."""
    if value is None:
        raise ValueError(f"this rope_type needs {name} in its RopeSpec")
    return value


def _exponents(dim: int) -> torch.Tensor:
    return torch.arange(0, dim, 2, dtype=torch.int64).float() / dim


def base_inv_freq(spec: RopeSpec) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [dim/2], cos/sin factor) for positions inside the original length,
    computed as transformers' ROPE_INIT_FUNCTIONS[rope_type] computes them (seq_len=None)."""
    dim, base, t = spec.dim, spec.theta, spec.rope_type
    inv_freq = 1.0 / (base ** _exponents(dim))
    if t in ("default", "dynamic"):  # dynamic equals plain RoPE up to max_position_embeddings
        return inv_freq, 1.0
    if t == "linear":
        return inv_freq / _given(spec.factor, "factor"), 1.0
    if t == "llama3":
        return _llama3(spec, inv_freq), 1.0
    if t == "yarn":
        return _yarn(spec)
    if t == "longrope":
        return _longrope(spec, _given(spec.short_factor, "short_factor")), _longrope_scale(spec)
    raise ValueError(f"unsupported rope_type {t!r} (supported: {', '.join(ROPE_TYPES)})")


def _llama3(spec: RopeSpec, inv_freq: torch.Tensor) -> torch.Tensor:
    factor = _given(spec.factor, "factor")
    low = _given(spec.low_freq_factor, "low_freq_factor")
    high = _given(spec.high_freq_factor, "high_freq_factor")
    old_len = _given(spec.original_max_position_embeddings, "original_max_position_embeddings")
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)  # long wavelengths: / factor
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(spec: RopeSpec) -> tuple[torch.Tensor, float]:
    dim, base = spec.dim, spec.theta
    orig = _given(spec.original_max_position_embeddings, "original_max_position_embeddings")
    factor = spec.factor if spec.factor is not None else _default_factor(spec, orig)

    def mscale_of(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = spec.attention_factor
    if attention is None:
        if spec.mscale and spec.mscale_all_dim:
            attention = float(mscale_of(factor, spec.mscale) / mscale_of(factor, spec.mscale_all_dim))
        else:
            attention = mscale_of(factor)
    beta_fast, beta_slow = spec.beta_fast or 32, spec.beta_slow or 1

    def correction_dim(rotations: float) -> float:  # the dimension that turns `rotations` times in orig
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if spec.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp  # 1: keep the original frequency (fast dims), 0: interpolate (slow dims)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, attention


def _default_factor(spec: RopeSpec, orig: int) -> float:
    """yarn and longrope without a factor: how far max_position_embeddings stretches the original."""
    return _given(spec.max_position_embeddings, "max_position_embeddings") / orig


def _longrope(spec: RopeSpec, factors: tuple[float, ...]) -> torch.Tensor:
    """longrope's frequencies: plain RoPE's divided by one rescale factor per frequency."""
    return 1.0 / (torch.tensor(factors, dtype=torch.float32) * spec.theta ** _exponents(spec.dim))


def _longrope_scale(spec: RopeSpec) -> float:
    orig = _given(spec.original_max_position_embeddings, "original_max_position_embeddings")
    factor = spec.factor if spec.factor is not None else _default_factor(spec, orig)
    if spec.attention_factor is not None:
        return spec.attention_factor
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))


class Rotary(nn.Module):
    """cos/sin per position (non-interleaved halves, as in HF), [N, 1, dim] each, in `dtype`.

    `inv_freq` holds the frequencies of a position inside the original length (the deterministic
    forward reads it only through `forward`, which also covers the position-dependent variants)."""

    inv_freq: torch.Tensor  # buffers (register_buffer), declared for the type checker
    long_inv_freq: torch.Tensor

    def __init__(self, spec: RopeSpec) -> None:
        super().__init__()
        self.spec = spec
        # Computed on the CPU, then moved to the default device: on the meta device, where the
        # loader builds a model before its memory exists, these few ops would run torch's reference
        # implementations, whose first use imports its compiler stack: a slow import at every start-up.
        device = torch.get_default_device()
        with torch.device("cpu"):
            inv_freq, self.scale = base_inv_freq(spec)
            long_inv_freq = (
                _longrope(spec, _given(spec.long_factor, "long_factor"))
                if spec.rope_type == "longrope"
                else None
            )
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)
        if long_inv_freq is not None:
            self.register_buffer("long_inv_freq", long_inv_freq.to(device), persistent=False)

    def inv_freq_at(self, positions: torch.Tensor) -> torch.Tensor:
        """[N, dim/2] frequencies of each position (the sequence length it sees is position + 1)."""
        spec, n = self.spec, positions.shape[0]
        if spec.rope_type == "longrope":
            long = (positions >= _given(spec.original_max_position_embeddings, "original length"))[:, None]
            return torch.where(long, self.long_inv_freq[None, :], self.inv_freq[None, :])
        if spec.rope_type == "dynamic":
            mpe = _given(spec.max_position_embeddings, "max_position_embeddings")
            factor = _given(spec.factor, "factor")
            seq_len = torch.clamp(positions + 1, min=mpe).float()
            base = spec.theta * ((factor * seq_len / mpe) - (factor - 1)) ** (spec.dim / (spec.dim - 2))
            exps = _exponents(spec.dim).to(positions.device)
            return 1.0 / (base[:, None] ** exps[None, :])
        return self.inv_freq[None, :].expand(n, -1)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if self.spec.rope_type in ("longrope", "dynamic"):
            freqs = positions.float()[:, None] * self.inv_freq_at(positions)
        else:
            freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.scale != 1.0:
            cos, sin = cos * self.scale, sin * self.scale
        return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first cos.shape[-1] features of every head of x [N, heads, head_dim]; the rest
    (partial rotary) pass through."""
    if cpu_kernels.rope_(x, cos, sin):  # in place: x is the fresh output of a projection
        return x
    dim = cos.shape[-1]
    if dim == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    rot, rest = x[..., :dim], x[..., dim:]
    return torch.cat((rot * cos + rotate_half(rot) * sin, rest), dim=-1)
