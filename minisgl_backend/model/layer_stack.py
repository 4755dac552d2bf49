"""Every layer of a batch in one native call (csrc/cpu/layer_stack.cpp, LayerStack): decode rows,
prompt chunks, or both.

A decode step runs about a dozen kernels per layer, and at small batches on a few cores the Python
around them (wrappers, views, module calls, small torch ops) is a large share of a small model's
step; in a prefill forward the kernels run long, but the other threads wait while the caller runs
that Python between them. The stack runs the same kernels on the same operands in the same order
from one call, the attention over the row tables the layer loop's plan builds and the last layer
past its K/V for the logit rows alone, so its bits are the layer-by-layer forward's
(tests/kernels/test_layer_stack.py).

It serves a model whose every layer the kernels cover: bf16 or float32 on a CPU with the native
kernels (any family but torch: the stack runs the family's kernels, AVX-512 or AVX2), a Llama-style
block (Qwen3's q/k norm included; not Gemma's), SiLU, and in bf16 every linear packed for the packed
kernel (AMX or AVX512-BF16: any row count), or the few-row kernel of the family's ISA: at any row
count where it has no row limit (cpu_kernels.kernel_row_limit(): avx2, and avx512 on a CPU without
AVX512-BF16), else in batches of up to cpu_kernels.MAX_KERNEL_ROWS rows (int8 weights on the int8
kernel at up to 4 rows under AVX-512, read dequantized otherwise, as Linear.forward); in float32
the float32 kernel, for batches of up to cpu_kernels.F32_KERNEL_ROWS rows (any row count where the
batch-invariant forward set the linears' any_rows).
It runs under the default and the batch-invariant forward alike (LayerStackForward wraps either),
with that forward's RoPE tables.
"""

from __future__ import annotations

import torch

from minisgl_backend.kvcache.storage import KVCache
from minisgl_backend.model import cpu_kernels
from minisgl_backend.model.batch import ForwardBatch, row_tables
from minisgl_backend.model.layers import AttentionBackend, Linear, PagedAttention, mlp_piece_rows
from minisgl_backend.model.llama import CausalLM, Forward, Ropes


class LayerStack:
    """The native stack of one model over one KV pool. It holds the model's weight tensors and the
    pool's (the native object keeps them alive and reads them in place): build it again after
    replacing either (LayerStackForward.stack does)."""

    def __init__(self, model: CausalLM, kv: KVCache) -> None:
        s = model.spec
        attn = model.model.layers[0].self_attn
        linears = _linears(model)
        f32 = model.lm_head.weight.dtype == torch.float32
        self.packed = all(lin.packed is not None for lin in linears)
        # every linear's kernel takes any row count: packed, or the few-row one without a row limit,
        # or in float32 where the batch-invariant forward asked for it; else the few-row kernel's rows
        if f32:
            self.any_rows = all(lin.any_rows for lin in linears)
            self.row_limit = cpu_kernels.F32_KERNEL_ROWS
        else:
            self.any_rows = self.packed or cpu_kernels.kernel_row_limit() is None
            self.row_limit = cpu_kernels.MAX_KERNEL_ROWS
        self._native = cpu_kernels._native.LayerStack(
            s.num_heads,
            s.num_kv_heads,
            s.head_dim,
            s.hidden_size,
            s.intermediate_size,
            s.rms_norm_eps,
            attn.scale,
            attn.softcap or 0.0,
            kv.block_size,
            kv.num_blocks,
            cpu_kernels.SCORERS[cpu_kernels.default_scorer()],
            0 if f32 else cpu_kernels.pack_kind(),  # a float32 model packs nothing
            cpu_kernels.isa(),
            mlp_piece_rows(
                s.intermediate_size,
                model.lm_head.weight.element_size(),
                all(layer.mlp.fused() for layer in model.model.layers),
            ),
            f32,
        )
        for layer in model.model.layers:
            a, mlp = layer.self_attn, layer.mlp
            self._native.add_layer(
                self._linear(a.qkv_proj),
                self._linear(a.o_proj),
                self._linear(mlp.gate_up_proj),
                self._linear(mlp.down_proj),
                layer.input_layernorm.weight,
                layer.post_attention_layernorm.weight,
                a.q_norm.weight if a.qk_norm else None,
                a.k_norm.weight if a.qk_norm else None,
                kv.k[a.layer_id],
                kv.v[a.layer_id],
                a.window or 0,
                a.rope_index,
                mlp.gate_up_proj.gated,
            )

    @staticmethod
    def supports(model: CausalLM, kv: KVCache, attention: AttentionBackend) -> bool:
        """Whether every layer of `model` is one the stack runs, over this pool, for a model whose
        attention back-end is `attention` (decided by the model, its back-end and the machine alone:
        the same for every batch). The stack runs the native paged attention, so only under that
        back-end. Its linears must be Linear itself, whose forward the stack reproduces (a subclass,
        such as the batch-invariant TiledLinear, runs other kernels)."""
        s = model.spec
        dtype = model.lm_head.weight.dtype
        return (
            isinstance(attention, PagedAttention)
            and cpu_kernels.available()
            and dtype in (torch.bfloat16, torch.float32)
            and not s.gemma
            and s.hidden_act == "silu"
            and s.head_dim % cpu_kernels.lanes() == 0
            and s.head_dim <= 256
            and kv.k[0].dtype == dtype
            and all(kv.k[i].is_contiguous() and kv.v[i].is_contiguous() for i in range(s.num_layers))
            and all(type(lin) is Linear and _native_ready(lin, dtype) for lin in _linears(model))
        )

    def runs(self, batch: ForwardBatch) -> bool:
        """Whether this batch takes the stack: any rows, decode and prefill, at a row count every
        linear's kernel takes."""
        n = batch.input_ids.shape[0]
        return n > 0 and (self.any_rows or n <= self.row_limit)

    def __call__(self, x: torch.Tensor, ropes: Ropes, batch: ForwardBatch) -> torch.Tensor:
        """The residual stream after the last layer at the rows batch.logits_index, for x = the
        embeddings of batch's rows (a fresh tensor: the layers overwrite it) and ropes = (cos, sin)
        [n, 1, rot] per RoPE of the model, in the model dtype."""
        n = x.shape[0]
        x = x.contiguous()
        mlp_out = torch.empty_like(x)
        cos = [c.reshape(n, -1).contiguous() for c, _ in ropes]
        sin = [s.reshape(n, -1).contiguous() for _, s in ropes]
        tables, row_table, positions = row_tables(batch)  # the attention plan the layer loop builds
        keep = batch.logits_index.to(torch.int64).contiguous()
        m = keep.shape[0]
        every_row = m == n and bool(torch.equal(keep, torch.arange(n)))
        self._native.run(
            x,
            mlp_out,
            positions.to(torch.int64).contiguous(),
            batch.slot_mapping.to(torch.int64).contiguous(),
            tables,
            row_table,
            None if every_row else keep,
            cos,
            sin,
            cpu_kernels.threads(),
        )
        return x[:m] + mlp_out[:m]

    @staticmethod
    def _linear(lin: Linear):
        n, k = lin.weight.shape
        return cpu_kernels._native.StackLinear(
            lin.weight if lin.packed is None else None,  # a packed layer's weight is the pack
            lin.packed,
            lin.bias,
            lin.qweight,
            lin.qscale,
            n,
            k,
        )


class LayerStackForward:
    """A forward strategy: the batches the stack runs go through it, with `inner`'s RoPE tables;
    every other batch (over the few-row kernel's rows), and every batch of a model or pool it does
    not run, goes through `inner` (the default or the batch-invariant forward), whose bits the
    stack's are."""

    def __init__(self, inner: Forward, attention: AttentionBackend) -> None:
        self.inner = inner
        self.attention = attention  # the model's attention back-end, which `inner` runs too
        self._built: tuple[KVCache, int, LayerStack | None] | None = None  # (pool, weights_version, stack)

    def stack(self, model: CausalLM, kv: KVCache) -> LayerStack | None:
        """The stack of `model` over `kv`, built on first use and again after the pool or the
        weights change (it points into both); None where it does not run them."""
        if self._built is None or self._built[0] is not kv or self._built[1] != model.weights_version:
            stack = LayerStack(model, kv) if LayerStack.supports(model, kv, self.attention) else None
            self._built = (kv, model.weights_version, stack)
        return self._built[2]

    def ropes(self, model: CausalLM, positions: torch.Tensor, dtype: torch.dtype) -> Ropes:
        return self.inner.ropes(model, positions, dtype)

    def layers(
        self, model: CausalLM, x: torch.Tensor, ropes: Ropes, batch: ForwardBatch, kv: KVCache
    ) -> torch.Tensor:
        stack = self.stack(model, kv)
        if stack is not None and stack.runs(batch):
            return stack(x, ropes, batch)
        return self.inner.layers(model, x, ropes, batch, kv)


def _linears(model: CausalLM) -> list[Linear]:
    out = []
    for layer in model.model.layers:
        out += [layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj]
    return out


def _native_ready(lin: Linear, dtype: torch.dtype) -> bool:
    """What the native linears read: contiguous weight and bias in the model's dtype (bf16: int8
    weights and float32 scales where quantized; float32: the weight itself, never packed)."""
    if dtype == torch.float32 and (lin.packed is not None or lin.qweight is not None):
        return False
    return (
        lin.weight.dtype == dtype
        and lin.weight.is_contiguous()
        and (lin.bias is None or (lin.bias.dtype == dtype and lin.bias.is_contiguous()))
        and (
            lin.qweight is None
            or (lin.qweight.is_contiguous() and lin.qscale is not None and lin.qscale.dtype == torch.float32)
        )
    )
