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
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from minisgl_backend.errors import ConfigError
from minisgl_backend.iteration import PrefillChunk
from minisgl_backend.kvcache.storage import KVCache
from minisgl_backend.model import cpu_kernels
from minisgl_backend.model.decode_stack import DecodeStack
from minisgl_backend.model.rope import RopeSpec, Rotary, apply_rotary

if TYPE_CHECKING:
    from minisgl_backend.model.batch_invariant import BatchInvariantForward

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text")
ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


def chunk_mask(chunk: PrefillChunk, window: int | None = None) -> torch.Tensor | None:
    """[length, ctx_len] mask of one prompt chunk: query at position q sees key j iff j <= q (and,
    in a sliding-window layer, j > q - window). None when plain causal attention over the chunk's
    own keys is exact (a first chunk no longer than the window)."""
    prefix = chunk.ctx_len - chunk.length
    if prefix == 0 and (window is None or chunk.length <= window):
        return None
    dev = chunk.block_table.device  # built where attention runs: the block table is already there
    q = torch.arange(prefix, chunk.ctx_len, device=dev)[:, None]
    k = torch.arange(chunk.ctx_len, device=dev)[None, :]
    mask = k <= q
    if window is not None:
        mask &= k > q - window
    return mask


class ForwardBatch(NamedTuple):
    """A flattened mixed batch: decode rows first (one token each), then prefill chunks."""

    input_ids: torch.Tensor  # [N]
    positions: torch.Tensor  # [N]
    slot_mapping: torch.Tensor  # [N] flat KV slot each new token writes
    num_decode: int
    decode_block_tables: torch.Tensor | None  # [B, nb] (padded with block 0)
    decode_mask: torch.Tensor | None  # [B, 1, 1, nb * block_size] bool: key j < context length
    prefill_chunks: tuple[PrefillChunk, ...]
    logits_index: torch.Tensor  # [M] token rows whose next-token logits are wanted


def row_tables(batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tables, row_table, positions) for cpu_kernels.paged_attention over every row of the batch:
    the decode rows' block tables, then one per prefill chunk, zero-padded to one width."""
    n = batch.input_ids.shape[0]
    parts = [] if batch.decode_block_tables is None else list(batch.decode_block_tables[: batch.num_decode])
    row_table = torch.empty(n, dtype=torch.int64)
    row_table[: batch.num_decode] = torch.arange(batch.num_decode)
    for chunk in batch.prefill_chunks:
        row_table[chunk.start : chunk.start + chunk.length] = len(parts)
        parts.append(chunk.block_table)
    width = max((t.shape[0] for t in parts), default=1)
    tables = torch.zeros(max(len(parts), 1), width, dtype=torch.int64)
    for i, t in enumerate(parts):
        tables[i, : t.shape[0]] = t
    return tables, row_table, batch.positions[:n]


def decode_window(
    batch: ForwardBatch, window: int | None, block_size: int
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(block tables, mask) the decode rows attend through. In a sliding-window layer only the
    blocks that hold a row's last `window` keys are gathered, and the mask keeps keys at positions
    p - window < j <= p (p: the row's position); otherwise batch.decode_block_tables / decode_mask."""
    tables = batch.decode_block_tables
    if window is None or tables is None:
        return tables, batch.decode_mask
    dev = tables.device
    span = -(-(window - 1) // block_size) + 1  # most blocks that `window` consecutive keys touch
    pos = batch.positions[: batch.num_decode].to(dev)[:, None]  # [B, 1]
    first = torch.clamp(pos - window + 1, min=0) // block_size
    if span >= tables.shape[1]:  # the whole context is no longer than the window's blocks
        first = torch.zeros_like(first)
        span = tables.shape[1]
    idx = first + torch.arange(span, device=dev)[None, :]  # [B, span] block index within each row
    # Indices past a row's table read some valid block; their keys lie after p, so they are masked.
    narrow = tables.gather(1, idx.clamp(max=tables.shape[1] - 1))
    keys = (idx[:, :, None] * block_size + torch.arange(block_size, device=dev)).view(len(pos), -1)
    mask = (keys <= pos) & (keys > pos - window)
    return narrow, mask[:, None, None, :]


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


class Linear(nn.Linear):
    """nn.Linear over the native CPU kernels (`model/cpu_kernels.py`). After pack() (the engine calls
    it on a bf16 CPU model), every bf16 call runs the packed kernel (AMX tiles, or AVX512-BF16 panels
    where there is no AMX) on a packed copy of the weight, at any row count; where neither runs,
    few-row bf16 calls (decode steps) run the AVX-512 kernel and the rest F.linear. After
    quantize_int8() the few-row calls (one row where packed) read int8 weights instead (half the
    bytes), and the rest runs on their dequantized bf16 copy, so prefill and decode use the same
    quantized weights."""

    qweight: torch.Tensor | None = None  # int8 [out, in], set by quantize_int8
    qscale: torch.Tensor | None = None  # float32 [out]: weight ~ qweight * qscale[:, None]
    packed: torch.Tensor | None = None  # the weight in the packed kernel's layout, set by pack
    gated: bool = False  # packed for linear_packed_silu (MLP.forward), which only MLP reads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Where packed, the int8 kernel wins only at one row (measured with AMX: 2-4 rows run ~1.7x
        # faster on the tile unit over the dequantized bf16 weight than on the int8 FMA kernel).
        if self.qweight is not None and (self.packed is None or x.shape[0] == 1):
            out = cpu_kernels.linear_int8(x, self.qweight, self.qscale, self.bias)
            if out is not None:
                return out
        if self.packed is not None and not self.gated:
            out = cpu_kernels.linear_packed(x, self.packed, self.weight.shape, self.bias)
            if out is not None:
                return out
        return cpu_kernels.linear(x, self.weight, self.bias)

    @torch.no_grad()
    def pack(self, gated: bool = False) -> bool:
        """Pack the current weight for the packed kernel (a copy: call again after changing the
        weight). False where it cannot run (neither AMX nor AVX512-BF16, not bf16 on the CPU).
        gated: a SiLU MLP's [gate | up] weight, packed for the fused linear_packed_silu where that
        runs (AVX512-BF16, no bias, not int8); Linear.forward then reads the weight itself."""
        self.packed = None
        if gated and self.bias is None and self.qweight is None:
            self.packed = cpu_kernels.pack(self.weight, gated=True)
        self.gated = self.packed is not None
        if not self.gated:
            self.packed = cpu_kernels.pack(self.weight)
        return self.packed is not None

    @torch.no_grad()
    def quantize_int8(self) -> None:
        """Symmetric per-output-channel int8 (absmax / 127), the weight-only scheme of gpt-fast; the
        bf16 weight is replaced by its dequantized value (a new tensor: a tied embedding keeps its own)."""
        w = self.weight.float()
        scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
        q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
        self.qweight, self.qscale = q.contiguous(), scale.contiguous()
        self.weight = nn.Parameter((q.float() * scale[:, None]).to(self.weight.dtype), requires_grad=False)
        if self.packed is not None:  # the pack holds the old weight
            self.pack()


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    gemma = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        native = cpu_kernels.rms_norm(x, self.weight, self.eps, self.gemma)
        return self.norm(x) if native is None else native[0]

    def add_and_norm(self, x: torch.Tensor, add: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + add), x + add): the residual add fused with the norm that reads it."""
        native = cpu_kernels.rms_norm(x, self.weight, self.eps, self.gemma, add)
        if native is not None:
            return native
        x = x + add
        return self.norm(x), x

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        """The torch expression (the native kernel rounds the same steps)."""
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: the stored weight is an offset from 1, and the scale is applied in float32."""

    gemma = True

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).to(x.dtype)


def _norm(spec: ModelSpec, dim: int) -> RMSNorm:
    return (GemmaRMSNorm if spec.gemma else RMSNorm)(dim, spec.rms_norm_eps)


def softcap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    return x if cap is None else torch.tanh(x / cap) * cap


def eager_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    cap: float | None,
) -> torch.Tensor:
    """SDPA with soft-capped scores (which SDPA cannot do), as transformers' eager attention:
    q [1, h, L, d], k/v [1, kvh, S, d], mask [L, S] bool or None (causal)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = softcap(torch.matmul(q, k.transpose(-1, -2)) * scale, cap)
    if mask is None:
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
    probs = torch.softmax(scores.float().masked_fill(~mask, float("-inf")), dim=-1).to(q.dtype)
    return torch.matmul(probs, v)


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.h, self.kvh, self.d = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.window = spec.window(layer_id)  # None: full attention
        self.rope_index = spec.rope_index(layer_id)
        self.sdpa_scale = spec.attn_scale  # None: SDPA's default 1/sqrt(d)
        self.scale = spec.attn_scale or self.d**-0.5
        self.softcap = spec.attn_softcap
        self.qkv_proj = Linear(spec.hidden_size, (self.h + 2 * self.kvh) * self.d, bias=spec.qkv_bias)
        self.o_proj = Linear(self.h * self.d, spec.hidden_size, bias=False)
        if spec.qk_norm:
            self.q_norm = _norm(spec, self.d)
            self.k_norm = _norm(spec, self.d)
        self.qk_norm = spec.qk_norm

    def qkv(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], n: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Projections of the first n rows of x (the rest is row padding), normed and rotated: views
        into one qkv_proj output (rows of stride (h + 2 kvh) d)."""
        qkv = self.qkv_proj(x)[:n].view(n, self.h + 2 * self.kvh, self.d)
        v = qkv[:, self.h + self.kvh :]
        cos, sin = rope
        if self.qk_norm:
            q, k = self.q_norm(qkv[:, : self.h]), self.k_norm(qkv[:, self.h : self.h + self.kvh])
            return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v
        qk = apply_rotary(qkv[:, : self.h + self.kvh], cos, sin)  # q and k heads in one pass
        return qk[:, : self.h], qk[:, self.h :], v

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        batch: ForwardBatch,
        kv: KVCache,
        masks: list[torch.Tensor | None],
        decode: tuple[torch.Tensor | None, torch.Tensor | None] | None = None,
        rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """masks: chunk_mask(chunk, self.window) per prefill chunk; decode: decode_window(batch,
        self.window, block_size) (None: the batch's decode block tables and mask); rows:
        row_tables(batch), where the native paged attention runs for this model and pool (it then
        serves every row: no prefill chunk's context is gathered)."""
        n = x.shape[0]
        q, k, v = self.qkv(x, rope, n)
        kv.write(self.layer_id, batch.slot_mapping, k, v)
        if rows is not None:
            kpool, vpool = kv.k[self.layer_id], kv.v[self.layer_id]
            o = cpu_kernels.paged_attention(q, kpool, vpool, *rows, self.scale, self.window, self.softcap)
            return self.o_proj(o.view(n, self.h * self.d))

        b = batch.num_decode
        out = None if b == n else torch.empty_like(q)
        if b:
            tables, mask = (batch.decode_block_tables, batch.decode_mask) if decode is None else decode
            full, pos = batch.decode_block_tables, batch.positions[:b]
            o = self._decode_attention(q[:b], tables, mask, kv, full, pos)
            if out is None:  # a decode-only batch: the attention output is the whole output
                return self.o_proj(o.reshape(n, self.h * self.d))
            out[:b] = o
        for chunk, mask in zip(batch.prefill_chunks, masks):
            s, e = chunk.start, chunk.start + chunk.length
            qr = q[s:e].transpose(0, 1)[None]  # [1, h, len, d]
            if chunk.ctx_len == chunk.length:  # first chunk: its own K/V are the whole context
                kr, vr = k[s:e], v[s:e]
            else:
                kr, vr = kv.gather(self.layer_id, chunk.block_table)
                kr, vr = kr[: chunk.ctx_len], vr[: chunk.ctx_len]
            kr, vr = kr.transpose(0, 1)[None], vr.transpose(0, 1)[None]
            if self.softcap is None:
                o = F.scaled_dot_product_attention(
                    qr, kr, vr, attn_mask=mask, is_causal=mask is None, scale=self.sdpa_scale, enable_gqa=True
                )
            else:
                o = eager_attention(qr, kr, vr, mask, self.scale, self.softcap)
            out[s:e] = o[0].transpose(0, 1)
        return self.o_proj(out.reshape(n, self.h * self.d))

    def _decode_attention(
        self,
        q: torch.Tensor,
        tables: torch.Tensor,
        mask: torch.Tensor,
        kv: KVCache,
        full_tables: torch.Tensor,
        positions: torch.Tensor,
    ) -> torch.Tensor:
        """All decode rows at once. On CPU the native kernel reads each row's keys in place through
        `full_tables` (the batch's block tables; the window is applied by position). Otherwise each
        row's context is gathered through `tables`, padded and masked by `mask` (decode_window):
        plain batched matmuls grouped by KV head, which for one query token per row are several times
        faster on CPU than SDPA's flash kernel and never materialise repeated K/V heads.
        """
        native = cpu_kernels.decode_attention(
            q,
            kv.k[self.layer_id],
            kv.v[self.layer_id],
            full_tables,
            positions,
            self.scale,
            self.window,
            self.softcap,
        )
        if native is not None:
            return native
        bsz, group = q.shape[0], self.h // self.kvh
        kc, vc = kv.gather(self.layer_id, tables)  # [B, L, kvh, d]
        qg = q.view(bsz, self.kvh, group, self.d)
        scores = softcap(
            torch.matmul(qg, kc.permute(0, 2, 3, 1)) * self.scale, self.softcap
        )  # [B, kvh, group, L]
        scores = scores.float().masked_fill_(~mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(q.dtype)
        return torch.matmul(probs, vc.transpose(1, 2)).view(bsz, self.h, self.d)


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.gate_up_proj = Linear(spec.hidden_size, 2 * spec.intermediate_size, bias=spec.mlp_bias)
        self.down_proj = Linear(spec.intermediate_size, spec.hidden_size, bias=spec.mlp_bias)
        self.hidden_act = spec.hidden_act
        self.act = ACTIVATIONS[spec.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lin = self.gate_up_proj
        if lin.gated:  # the GEMM and silu_and_mul in one pass (the same bits as the two in turn)
            h = cpu_kernels.linear_packed_silu(x, lin.packed, lin.weight.shape)
            if h is not None:
                return self.down_proj(h)
        gate_up = lin(x)
        h = cpu_kernels.silu_and_mul(gate_up) if self.hidden_act == "silu" else None
        if h is None:
            gate, up = gate_up.chunk(2, dim=-1)
            h = self.act(gate) * up
        return self.down_proj(h)


# attend(attention module, normed hidden states) -> attention output: the forward pass's attention
# (default or batch-invariant), with that layer's RoPE and masks already bound.
Attend = Callable[[Attention, torch.Tensor], torch.Tensor]


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, layer_id: int) -> None:
        super().__init__()
        self.self_attn = Attention(spec, layer_id)
        self.mlp = MLP(spec)
        self.input_layernorm = _norm(spec, spec.hidden_size)
        self.post_attention_layernorm = _norm(spec, spec.hidden_size)
        self.gemma = spec.gemma
        if spec.gemma:
            self.pre_feedforward_layernorm = _norm(spec, spec.hidden_size)
            self.post_feedforward_layernorm = _norm(spec, spec.hidden_size)

    def forward(self, x: torch.Tensor, attend: Attend) -> torch.Tensor:
        a = attend(self.self_attn, self.input_layernorm(x))
        if not self.gemma:  # post_attention_layernorm is the MLP's input norm
            h, x = self.post_attention_layernorm.add_and_norm(x, a)
            return x + self.mlp(h)
        # Gemma: post_attention_layernorm normalises the attention output; the MLP has its own pair.
        h, x = self.pre_feedforward_layernorm.add_and_norm(x, self.post_attention_layernorm(a))
        return x + self.post_feedforward_layernorm(self.mlp(h))


def build_rotary(spec: ModelSpec) -> nn.ModuleList:
    """One Rotary per distinct RoPE of the model (Attention.rope_index picks a layer's)."""
    return nn.ModuleList(Rotary(r) for r in spec.ropes())


class Decoder(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(spec, i) for i in range(spec.num_layers))
        self.norm = _norm(spec, spec.hidden_size)
        self.rotary = build_rotary(spec)


class CausalLM(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        self.model = Decoder(spec)
        self.lm_head = Linear(spec.hidden_size, spec.vocab_size, bias=False)
        # Set by model.batch_invariant.enable(): the deterministic forward pass (None = default path).
        self.batch_invariant: BatchInvariantForward | None = None
        self._stack: tuple[KVCache, DecodeStack | None] | None = None  # decode_stack()'s, for one pool
        self.tie_weights()

    def decode_stack(self, kv: KVCache) -> DecodeStack | None:
        """The native stack of every layer over `kv` for decode-only batches (model/decode_stack.py),
        built on first use; None where this model is not one it runs."""
        if self._stack is None or self._stack[0] is not kv:
            self._stack = (kv, DecodeStack(self, kv) if DecodeStack.supports(self, kv, Linear) else None)
        return self._stack[1]

    def quantize_int8(self) -> None:
        """`weight_dtype: int8`: every linear layer, the LM head included (untied from the embedding,
        which stays exact), holds int8 weights for decode (see Linear.quantize_int8)."""
        self._stack = None  # it points into the weights being replaced
        for module in self.modules():
            if isinstance(module, Linear):
                module.quantize_int8()

    def pack_weights(self) -> int:
        """Pack every linear layer's weight for the packed kernel (Linear.pack); returns how many took
        it (0 without AMX or AVX512-BF16, or for a model that is not bf16 on the CPU). Costs one
        more copy of those weights in memory: F.linear paths and the tied embedding keep reading
        the original."""
        self._stack = None  # it points into the packs being replaced
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
        if self.batch_invariant is not None:  # EngineConfig.deterministic
            return self.batch_invariant.forward(self, batch, kv)
        m = self.model
        x = self.embed(batch.input_ids)
        ropes = [rotary(batch.positions, x.dtype) for rotary in m.rotary]
        stack = self.decode_stack(kv)
        if stack is not None and stack.runs(batch):
            return self.logits(stack(x, ropes, batch)[batch.logits_index])
        # The native paged attention reads every row's keys in place (prefill chunks included: on
        # this CPU it beats SDPA over a gathered context, measured in README "Speed"); otherwise
        # masks are built once per window size and shared by every layer with that window.
        masks: dict[int | None, tuple] = {}
        rows = None
        if cpu_kernels.attention_runs(x, kv.k[0], kv.v[0]):
            rows = row_tables(batch)
            masks = dict.fromkeys({layer.self_attn.window for layer in m.layers}, ([], None))
        else:
            for w in {layer.self_attn.window for layer in m.layers}:
                masks[w] = (
                    [chunk_mask(chunk, w) for chunk in batch.prefill_chunks],
                    decode_window(batch, w, kv.block_size),
                )

        def attend(attn: Attention, h: torch.Tensor) -> torch.Tensor:
            return attn(h, ropes[attn.rope_index], batch, kv, *masks[attn.window], rows=rows)

        for layer in m.layers:
            x = layer(x, attend)
        # Only rows that sample or score need the LM head (the largest matmul at this model size).
        return self.logits(x[batch.logits_index])

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
