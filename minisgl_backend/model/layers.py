"""The layers of the Llama-family decoder (`model/llama.py`): the linear layer over the native CPU
kernels, RMSNorm (and Gemma's), attention over the paged KV cache, the MLP and the decoder block
that chains them."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from typing import Any, ClassVar, cast, overload

import torch
import torch.nn.functional as F
from torch import nn

from minisgl_backend.kvcache.storage import KVCache
from minisgl_backend.model import cpu_kernels
from minisgl_backend.model.batch import ForwardBatch, chunk_mask, decode_window, row_tables
from minisgl_backend.model.rope import apply_rotary
from minisgl_backend.model.spec import ACTIVATIONS, ModelSpec


class Linear(nn.Linear):
    """nn.Linear over the native CPU kernels (`model/cpu_kernels.py`). After pack() (the engine calls
    it on a bf16 CPU model), every bf16 call runs the packed kernel (AMX tiles, or AVX512-BF16 panels
    where there is no AMX) at any row count, and the packed tensor is the layer's only copy of its
    weight: `weight` keeps the shape and dtype on the meta device, and dense() reads the values back
    from the pack. Where neither packed family runs, few-row bf16 calls (decode steps) run the
    AVX-512 kernel and the rest F.linear, or every bf16 call runs the family's kernel where it has no
    row limit (cpu_kernels.kernel_row_limit: avx2, and avx512 on a CPU without AVX512-BF16). After
    quantize_int8() the few-row calls (one row where packed) read int8 weights instead (half the
    bytes; AVX-512 only), and the rest runs on their dequantized bf16 copy, so prefill and decode
    use the same quantized weights."""

    qweight: torch.Tensor | None = None  # int8 [out, in], set by quantize_int8
    qscale: torch.Tensor | None = None  # float32 [out]: weight ~ qweight * qscale[:, None]
    packed: torch.Tensor | None = None  # the weight in the packed kernel's layout, set by pack
    gated: bool = False  # packed for linear_packed_silu (MLP.forward), which only MLP reads
    # Float32 rows on the kernel at every row count (set by the batch-invariant forward): by default
    # only up to cpu_kernels.F32_KERNEL_ROWS, beyond which the BLAS's blocking is faster.
    any_rows: bool = False

    def forward(self, x: torch.Tensor, float32: bool = False) -> torch.Tensor:
        """F.linear(x, weight, bias); `float32`: that output's values as float32, which the AMX
        kernel writes itself (no pass over the output afterwards)."""
        # Where packed, the int8 kernel wins only at one row: from two rows on, the packed kernel
        # reuses each (dequantized bf16) weight across the rows faster than the int8 FMA kernel.
        out = None
        if self.qweight is not None and self.qscale is not None and (self.packed is None or x.shape[0] == 1):
            out = cpu_kernels.linear_int8(x, self.qweight, self.qscale, self.bias)
        if out is None and self.packed is not None and not self.gated:
            out = cpu_kernels.linear_packed(x, self.packed, self.weight.shape, self.bias, widen=float32)
        if out is None:
            # Inputs the packed kernels do not take (another dtype) read the weight back from the pack:
            # correct, and never on an engine's path (its activations are the packed model's dtype).
            out = cpu_kernels.linear(x, self.dense(), self.bias, self.any_rows)
        return out.float() if float32 else out

    def dense(self) -> torch.Tensor:
        """The weight [out, in] in its own layout: `weight` itself, or read back from the pack (a new
        tensor, the same bits) once pack() has released it."""
        if self.packed is None:
            return self.weight
        rows = torch.arange(self.weight.shape[0])
        return cpu_kernels.packed_rows(self.packed, self.weight.shape, rows, self.gated)

    @torch.no_grad()
    def pack(self, gated: bool = False, values: torch.Tensor | None = None) -> bool:
        """Move the weight into the packed kernel's layout: the pack replaces it (`weight` becomes a
        meta tensor of its shape), so the model holds its weights once. False, and nothing changes,
        where the packed kernels cannot run (neither AMX nor AVX512-BF16, not bf16 on the CPU).
        Packing again (another `gated`) reads the values back from the current pack; to change the
        weight, unpack() first. gated: a SiLU MLP's [gate | up] weight, packed for the fused
        linear_packed_silu where that runs (no bias, not int8). `values`: the weight's values, where
        they lie elsewhere than in `weight` (the loader's reusable buffer: the weight's own memory
        is then never written, and released by the pack)."""
        weight = self.dense() if values is None else values
        if tuple(weight.shape) != tuple(self.weight.shape) or weight.dtype != self.weight.dtype:
            raise ValueError(
                f"values {list(weight.shape)} {weight.dtype} for a {list(self.weight.shape)} weight"
            )
        packed = None
        if gated and self.bias is None and self.qweight is None:
            packed = cpu_kernels.pack(weight, gated=True)
        is_gated = packed is not None
        if not is_gated:
            packed = cpu_kernels.pack(weight)
        if packed is None:
            return False
        self.packed, self.gated = packed, is_gated
        self.weight = nn.Parameter(torch.empty_like(weight, device="meta"), requires_grad=False)
        return True

    @torch.no_grad()
    def unpack(self) -> None:
        """Give the layer its weight back in its own layout and drop the pack (no-op if unpacked)."""
        if self.packed is not None:
            self.weight = nn.Parameter(self.dense(), requires_grad=False)
            self.packed, self.gated = None, False

    @torch.no_grad()
    def quantize_int8(self) -> None:
        """Symmetric per-output-channel int8 (absmax / 127), the weight-only scheme of gpt-fast; the
        bf16 weight is replaced by its dequantized value (a new tensor: a tied embedding keeps its
        own), packed again if it was packed."""
        was_packed, gated = self.packed is not None, self.gated
        self.unpack()
        w = self.weight.float()
        scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
        q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
        self.qweight, self.qscale = q.contiguous(), scale.contiguous()
        self.weight = nn.Parameter((q.float() * scale[:, None]).to(self.weight.dtype), requires_grad=False)
        if was_packed:
            self.pack(gated)


class Embedding(nn.Embedding):
    """nn.Embedding that draws no random values on the meta device: a model built there (the
    loader's) takes its values from the checkpoint, and drawing them under torch's device context
    would run torch's reference ops, whose first use imports its compiler stack: a slow import at
    every start-up, for nothing."""

    def reset_parameters(self) -> None:
        if not self.weight.is_meta:
            super().reset_parameters()


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


def norm_layer(spec: ModelSpec, dim: int) -> RMSNorm:
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


def take_rows(x: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    """The rows `keep` of x (all of x for None)."""
    return x if keep is None else x[keep]


class AttentionBackend(ABC):
    """How every layer of a model attends: one object, chosen once at load (model/loader.py,
    attention_backend) and held by the forward strategy the model runs, which asks it once per
    forward for the plan every layer shares (plan) and hands it each layer's q/k/v (attend). The
    implementations: PagedAttention (the native CPU kernels), TorchAttention (SDPA and batched
    matmuls) and TritonAttention (model/triton_attention.py, the GPU kernels)."""

    name: ClassVar[str] = ""
    # A row's output bits depend only on its own query and keys, at any batch: the batch-invariant
    # forward then attends through the back-end as it is instead of its own tiled attention.
    row_invariant: ClassVar[bool] = False

    def plan(self, batch: ForwardBatch, kv: KVCache, windows: Iterable[int | None]) -> Any:
        """What every layer of one forward over `batch` shares (windows: the layers' sliding
        windows, None for full attention); None where nothing is."""
        return None

    @abstractmethod
    def attend(
        self,
        attn: Attention,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        batch: ForwardBatch,
        kv: KVCache,
        plan: Any,
        keep: torch.Tensor | None,
    ) -> torch.Tensor:
        """Layer `attn`'s attention output [rows, h, d] at the rows `keep` (None: every row), for q
        [N, h, d] and the batch's own k/v [N, kvh, d], already written into `kv`."""


class ServesEveryRow(AttentionBackend):
    """A back-end that computes every row of a batch in one call from the pools alone (the Triton
    kernels); the rows `keep` are taken from its output."""

    @abstractmethod
    def __call__(
        self,
        q: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        batch: ForwardBatch,
        scale: float,
        window: int | None,
        softcap: float | None,
    ) -> torch.Tensor:
        """Attention output [N, h, d] of every row of `batch` (its K/V already in the pools)."""

    def attend(self, attn, q, k, v, batch, kv, plan, keep):
        kpool, vpool = kv.k[attn.layer_id], kv.v[attn.layer_id]
        return take_rows(self(q, kpool, vpool, batch, attn.scale, attn.window, attn.softcap), keep)


class PagedAttention(AttentionBackend):
    """The native CPU paged attention (cpu_kernels.paged_attention) for every row, prefill chunks
    included: each row's keys are read in place through its block table, never gathered into a
    fresh tensor per layer. A row's bits depend on its own query and keys alone."""

    name = "paged"
    row_invariant = True

    def plan(self, batch: ForwardBatch, kv: KVCache, windows: Iterable[int | None]) -> Any:
        return row_tables(batch)

    def attend(self, attn, q, k, v, batch, kv, plan, keep):
        kpool, vpool = kv.k[attn.layer_id], kv.v[attn.layer_id]
        tables, row_table, positions = row_tables(batch) if plan is None else plan
        if keep is not None:  # a row's output depends only on its own query and keys
            q, row_table, positions = q[keep], row_table[keep], positions[keep]
        o = cpu_kernels.paged_attention(
            q, kpool, vpool, tables, row_table, positions, attn.scale, attn.window, attn.softcap
        )
        if o is None:
            raise ValueError(
                f"the native paged attention does not run here ({q.dtype} queries on {q.device}, "
                f"{kpool.dtype} pools, kernel family {cpu_kernels.family()}): choose the torch back-end"
            )
        return o


class TorchAttention(AttentionBackend):
    """torch's own ops: the decode rows' contexts gathered and attended in batched matmuls, each
    prefill chunk through SDPA (or the eager form, with soft-capped scores)."""

    name = "torch"

    def plan(self, batch: ForwardBatch, kv: KVCache, windows: Iterable[int | None]) -> Any:
        """Per window size: the prefill chunks' masks and the decode rows' (tables, mask), built
        once and shared by every layer with that window."""
        return {
            w: (
                [chunk_mask(chunk, w) for chunk in batch.prefill_chunks],
                decode_window(batch, w, kv.block_size),
            )
            for w in set(windows)
        }

    def attend(self, attn, q, k, v, batch, kv, plan, keep):
        masks, decode = (
            self.plan(batch, kv, [attn.window])[attn.window] if plan is None else plan[attn.window]
        )
        n = q.shape[0]
        b = batch.num_decode
        out = None if b == n else torch.empty_like(q)
        if b:
            tables, mask = (batch.decode_block_tables, batch.decode_mask) if decode is None else decode
            assert tables is not None and mask is not None, "decode rows have tables"
            o = attn._decode_attention(q[:b], tables, mask, kv)
            if out is None:  # a decode-only batch: the attention output is the whole output
                return take_rows(o, keep)
            out[:b] = o
        assert out is not None  # b < n: the batch has prefill rows
        for chunk, mask in zip(batch.prefill_chunks, masks):
            s, e = chunk.start, chunk.start + chunk.length
            qr = q[s:e].transpose(0, 1)[None]  # [1, h, len, d]
            if chunk.ctx_len == chunk.length:  # first chunk: its own K/V are the whole context
                kr, vr = k[s:e], v[s:e]
            else:
                kr, vr = kv.gather(attn.layer_id, chunk.block_table)
                kr, vr = kr[: chunk.ctx_len], vr[: chunk.ctx_len]
            kr, vr = kr.transpose(0, 1)[None], vr.transpose(0, 1)[None]
            if attn.softcap is None:
                o = F.scaled_dot_product_attention(
                    qr, kr, vr, attn_mask=mask, is_causal=mask is None, scale=attn.sdpa_scale, enable_gqa=True
                )
            else:
                o = eager_attention(qr, kr, vr, mask, attn.scale, attn.softcap)
            out[s:e] = o[0].transpose(0, 1)
        return take_rows(out, keep)


def default_attention(device: torch.device, dtype: torch.dtype) -> AttentionBackend:
    """The CPU back-end for a model on `device` in `dtype`: the native paged kernels where the
    process's kernel family runs them (any family but torch, bfloat16 or float32), else torch's."""
    if device.type == "cpu" and cpu_kernels.available() and dtype in (torch.float32, torch.bfloat16):
        return PagedAttention()
    return TorchAttention()


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
            self.q_norm = norm_layer(spec, self.d)
            self.k_norm = norm_layer(spec, self.d)
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

    def write_kv(self, kv: KVCache, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """This layer's new K/V rows into their slots of the pool: the native row copy where it runs
        (torch's index_copy_ walks the strided rows element by element on one thread), else torch's."""
        if not cpu_kernels.kv_write(kv.k[self.layer_id], kv.v[self.layer_id], slots, k, v):
            kv.write(self.layer_id, slots, k, v)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        batch: ForwardBatch,
        kv: KVCache,
        masks: list[torch.Tensor | None] | None = None,
        decode: tuple[torch.Tensor | None, torch.Tensor | None] | None = None,
        rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
        keep: torch.Tensor | None = None,
        backend: AttentionBackend | None = None,
        plan: Any = None,
    ) -> torch.Tensor:
        """backend: the attention back-end the model runs (the forward strategy's), with its `plan`
        for this forward (AttentionBackend.plan; None: built for this layer alone); keep: the rows
        whose output is returned (None: all), see DecoderLayer.forward. A layer called on its own
        (tests) may give the plan's parts instead: rows = row_tables(batch) for the native paged
        attention, or masks (chunk_mask(chunk, self.window) per prefill chunk) and decode
        (decode_window(batch, self.window, block_size); None: the batch's decode block tables and
        mask) for torch's. K/V are written for every row."""
        n = x.shape[0]
        q, k, v = self.qkv(x, rope, n)
        self.write_kv(kv, batch.slot_mapping, k, v)
        if backend is None:
            if rows is not None:
                backend, plan = PagedAttention(), rows
            else:
                backend, plan = TorchAttention(), {self.window: (masks or [], decode)}
        o = backend.attend(self, q, k, v, batch, kv, plan, keep)
        return self.o_proj(o.reshape(o.shape[0], self.h * self.d))

    def _decode_attention(
        self, q: torch.Tensor, tables: torch.Tensor, mask: torch.Tensor, kv: KVCache
    ) -> torch.Tensor:
        """All decode rows at once on torch's ops: each row's context gathered through `tables`,
        padded and masked by `mask` (decode_window): plain batched matmuls grouped by KV head,
        which for one query token per row are several times faster on CPU than SDPA's flash kernel
        and never materialise repeated K/V heads."""
        bsz, group = q.shape[0], self.h // self.kvh
        kc, vc = kv.gather(self.layer_id, tables)  # [B, L, kvh, d]
        qg = q.view(bsz, self.kvh, group, self.d)
        scores = softcap(
            torch.matmul(qg, kc.permute(0, 2, 3, 1)) * self.scale, self.softcap
        )  # [B, kvh, group, L]
        scores = scores.float().masked_fill_(~mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(q.dtype)
        return torch.matmul(probs, vc.transpose(1, 2)).view(bsz, self.h, self.d)


# The most bytes of intermediate one MLP call materialises: more rows than that go through in
# pieces. A larger buffer is past what the C allocator keeps for reuse (glibc serves it from a fresh
# mapping and unmaps it when freed), so every layer of every chunk would fault in and zero its pages
# again; a piece's buffers come back from the allocator's heap already mapped. Each row's MLP
# depends on that row alone, so the pieces change no bits where the linears are row-invariant. A
# piece of few rows costs too: every piece streams the MLP's weights again.
MLP_PIECE_BYTES = 16 << 20


def mlp_piece_rows(intermediate_size: int, element_size: int, fused: bool = False) -> int:
    """The most rows one MLP call takes at once: MLP_PIECE_BYTES of its widest intermediate, [rows,
    2 x intermediate] (gate | up), or [rows, intermediate] where the gate/up GEMM applies SiLU x up
    on the way out (`fused`: a gated pack). The layer loop's MLP.forward and the native layer stack
    cut a batch's MLP the same way."""
    return max(1, MLP_PIECE_BYTES // ((1 if fused else 2) * intermediate_size * element_size))


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.gate_up_proj = Linear(spec.hidden_size, 2 * spec.intermediate_size, bias=spec.mlp_bias)
        self.down_proj = Linear(spec.intermediate_size, spec.hidden_size, bias=spec.mlp_bias)
        self.hidden_act = spec.hidden_act
        self.act = ACTIVATIONS[spec.hidden_act]
        self.intermediate_size = spec.intermediate_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0] if x.dim() == 2 else 0
        piece = mlp_piece_rows(self.intermediate_size, x.element_size(), self.fused())
        if rows <= piece:
            return self._rows(x)
        out = x.new_empty(rows, self.down_proj.weight.shape[0])
        for r in range(0, rows, piece):
            out[r : r + piece] = self._rows(x[r : r + piece])
        return out

    def fused(self) -> bool:
        """Whether the gate/up GEMM applies SiLU x up on the way out (its gated pack): the MLP then
        never holds the [rows, 2 x intermediate] gate | up."""
        return self.gate_up_proj.gated and self.gate_up_proj.packed is not None

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        lin, down = self.gate_up_proj, self.down_proj
        if lin.gated and lin.packed is not None and down.packed is not None and not down.gated:
            out = cpu_kernels.mlp_packed(x, lin.packed, down.packed, down.weight.shape, down.bias)
            if out is not None:  # the whole MLP in one call (the same bits as the steps below)
                return out
        if lin.gated and lin.packed is not None:  # the GEMM and silu_and_mul in one pass (the same bits)
            h = cpu_kernels.linear_packed_silu(x, lin.packed, lin.weight.shape)
            if h is not None:
                return self.down_proj(h)
        gate_up = lin(x)
        h = cpu_kernels.silu_and_mul(gate_up) if self.hidden_act == "silu" else None
        if h is None:
            gate, up = gate_up.chunk(2, dim=-1)
            h = self.act(gate) * up
        return self.down_proj(h)


# attend(attention module, normed hidden states, keep) -> attention output at the rows `keep` (None:
# all): the forward pass's attention (default or batch-invariant), with that layer's RoPE and masks
# already bound.
Attend = Callable[[Attention, torch.Tensor, torch.Tensor | None], torch.Tensor]


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, layer_id: int) -> None:
        super().__init__()
        self.self_attn = Attention(spec, layer_id)
        self.mlp = MLP(spec)
        self.input_layernorm = norm_layer(spec, spec.hidden_size)
        self.post_attention_layernorm = norm_layer(spec, spec.hidden_size)
        self.gemma = spec.gemma
        if spec.gemma:
            self.pre_feedforward_layernorm = norm_layer(spec, spec.hidden_size)
            self.post_feedforward_layernorm = norm_layer(spec, spec.hidden_size)

    def forward(self, x: torch.Tensor, attend: Attend, keep: torch.Tensor | None = None) -> torch.Tensor:
        """The residual stream after this layer at the rows `keep` (None: all). The last layer of a
        forward keeps only the rows that need logits: every row's K/V still goes into the cache, but
        the other rows skip attention, o_proj and the MLP (in a 512-token prefill chunk that is all
        of the layer but its qkv_proj, about 1/num_layers of the chunk's work)."""
        x, mlp_out = self.forward_deferred(x, None, attend, keep)
        return x + mlp_out

    def forward_deferred(
        self, x: torch.Tensor, pending: torch.Tensor | None, attend: Attend, keep: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """forward() with the residual adds deferred: the residual stream is x + pending (pending:
        the previous layer's MLP output, None: nothing), and the result is (the stream before this
        layer's last add, what that add adds). The input norm adds pending as it reads the rows
        (add_and_norm): one pass over the stream instead of an add and then a norm, with the same
        rounding, so the same bits."""
        if pending is None:
            h = self.input_layernorm(x)
        else:
            h, x = self.input_layernorm.add_and_norm(x, pending)
        a = attend(self.self_attn, h, keep)
        x = take_rows(x, keep)
        if not self.gemma:  # post_attention_layernorm is the MLP's input norm
            h, x = self.post_attention_layernorm.add_and_norm(x, a)
            return x, self.mlp(h)
        # Gemma: post_attention_layernorm normalises the attention output; the MLP has its own pair.
        h, x = self.pre_feedforward_layernorm.add_and_norm(x, self.post_attention_layernorm(a))
        return x, self.post_feedforward_layernorm(self.mlp(h))


class DecoderLayers(nn.ModuleList):
    """The decoder's layers: an nn.ModuleList whose items are typed as DecoderLayer, so the code that
    walks the layers (the layer loop, the layer stack, packing) is type-checked against them."""

    def __init__(self, layers: Iterable[DecoderLayer]) -> None:
        super().__init__(layers)

    def run(self, x: torch.Tensor, attend: Attend, keep: torch.Tensor | None) -> torch.Tensor:
        """The residual stream after every layer in turn at the rows `keep` (the last layer's, see
        DecoderLayer.forward), each layer's MLP output added by the next one's input norm."""
        pending = None
        for layer in self[:-1]:
            x, pending = layer.forward_deferred(x, pending, attend)
        x, mlp_out = self[-1].forward_deferred(x, pending, attend, keep)
        return x + mlp_out

    def __iter__(self) -> Iterator[DecoderLayer]:
        return cast(Iterator[DecoderLayer], super().__iter__())

    @overload
    def __getitem__(self, idx: slice) -> DecoderLayers: ...

    @overload
    def __getitem__(self, idx: int) -> DecoderLayer: ...

    def __getitem__(self, idx: int | slice) -> DecoderLayer | DecoderLayers:
        return cast("DecoderLayer | DecoderLayers", super().__getitem__(idx))
