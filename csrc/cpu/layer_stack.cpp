// LayerStack: every layer of a batch (decode rows, prompt chunks or both) in one call. A decode step
// calls ~11 kernels per layer, each through its Python wrapper and torch's tensor glue, and for a small
// model on a few cores that glue is a large share of the step; in a prefill forward the pool's threads
// wait through it between every two kernels (docs/performance.md). For a bf16 batch of a Llama-style
// layer (pre-norm, fused qkv and gate/up, SiLU, Qwen3's q/k norm; not Gemma's block) LayerStack::run
// calls the same kernels (the other files' entry points) on the same operands, in the same order, with
// each linear taking the kernel Linear.forward would take at that row count (model/layers.py). Python
// builds it per model and KV pool, again when the weights change (LayerStackForward,
// model/layer_stack.py), and keeps every tensor it points into alive.
//
// Bit-exactness: its bits are those of the layer-by-layer forward (tests/kernels/test_layer_stack.py): it
// adds no arithmetic of its own, only the calls and the K/V copies.

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <type_traits>
#include <vector>

#include "common.h"
#include "kernels.h"

namespace minisgl::cpu {
namespace {

// What StackLinear::packed holds (cpu_kernels.pack_kind()).
enum PackKind : int { PACK_NONE = 0, PACK_AMX = 1, PACK_DPBF16 = 2 };

// Linear.forward's choice at m rows: int8 at one row where packed (at up to 4 where not; AVX-512
// only: the avx2 family reads the dequantized bf16 weight, as cpu_kernels.linear_int8 declines there),
// the packed kernel (AMX tiles or AVX512-BF16 panels) where packed, else the few-row kernel of the
// family's ISA (the builder lets m exceed 4 there only where cpu_kernels.kernel_row_limit() has no
// limit, as cpu_kernels.linear does).
void stack_linear(const StackLinear& l, int pack_kind, const uint16_t* x, uint16_t* y, int64_t m, int threads,
                  int isa) {
    const auto xp = reinterpret_cast<uintptr_t>(x), yp = reinterpret_cast<uintptr_t>(y);
    if (l.qweight && isa != ISA_AVX2 && (!l.packed || m == 1) && m <= 4)
        linear_int8(xp, l.qweight, l.qscale, l.bias, yp, m, l.n, l.k, threads);
    else if (l.packed && pack_kind == PACK_AMX)
        linear_amx(xp, l.packed, l.bias, yp, m, l.n, l.k, threads);
    else if (l.packed && pack_kind == PACK_DPBF16)
        linear_dpbf16(xp, l.packed, l.bias, yp, m, l.n, l.k, threads);
    else
        linear_bf16(xp, l.weight, l.bias, yp, m, l.n, l.k, threads, isa);
}

// A float32 model's linears: the float32 kernel (the builder keeps m within the rows Linear.forward
// gives it, or any m where the batch-invariant forward set any_rows).
void stack_linear(const StackLinear& l, int, const float* x, float* y, int64_t m, int threads, int isa) {
    linear_f32(reinterpret_cast<uintptr_t>(x), l.weight, l.bias, reinterpret_cast<uintptr_t>(y), m, l.n, l.k, threads,
               isa);
}

}  // namespace

LayerStack::LayerStack(int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t hidden, int64_t intermediate,
                       double eps, double scale, double softcap, int64_t block_size, int64_t num_blocks, int scorer,
                       int pack_kind, int isa, int64_t mlp_rows, bool f32)
    : h_(heads),
      kvh_(kv_heads),
      d_(head_dim),
      hidden_(hidden),
      inter_(intermediate),
      eps_(static_cast<float>(eps)),
      scale_(static_cast<float>(scale)),
      softcap_(static_cast<float>(softcap)),
      bs_(block_size),
      blocks_(num_blocks),
      scorer_(scorer),
      pack_kind_(pack_kind),
      isa_(require_isa(isa)),
      mlp_rows_(std::max<int64_t>(1, mlp_rows)),
      f32_(f32) {
    if (heads % kv_heads != 0 || head_dim % (isa_ == ISA_AVX2 ? 8 : 16) != 0 || head_dim > 256)
        throw std::invalid_argument(
            "LayerStack: heads must be a multiple of kv_heads, head_dim of the lane width (16, avx2 8; <= 256)");
    if ((isa_ == ISA_AVX2 || f32) && pack_kind != PACK_NONE)
        throw std::invalid_argument("LayerStack: the avx2 family and float32 models pack nothing");
}

void LayerStack::add_layer(StackLinear qkv, StackLinear o, StackLinear gate_up, StackLinear down, uintptr_t input_norm,
                           uintptr_t post_norm, uintptr_t q_norm, uintptr_t k_norm, uintptr_t kpool, uintptr_t vpool,
                           int64_t window, int64_t rope, bool gated) {
    layers_.push_back(
        {qkv, o, gate_up, down, input_norm, post_norm, q_norm, k_norm, kpool, vpool, window, rope, gated});
}

namespace {

// Rows `ids` of src (row stride `stride` elements, `width` of them copied) into dst, packed.
template <typename T>
void take_rows(const T* src, int64_t stride, const int64_t* ids, int64_t count, int64_t width, T* dst) {
    for (int64_t i = 0; i < count; ++i) std::memcpy(dst + i * width, src + ids[i] * stride, width * sizeof(T));
}

template <typename T>
T* grown(LineVector<T>& buf, int64_t elems) {
    if (static_cast<int64_t>(buf.size()) < elems) buf.resize(static_cast<size_t>(elems));
    return buf.data();
}

}  // namespace

// x [n, hidden] (the embeddings; overwritten with the residual stream) and mlp_out [n, hidden]: on
// return the last layer's input to its final add, as DecoderLayer.forward's `x` and `mlp(h)`, at the
// rows `keep` (kept of them, in rows 0..kept - 1 of both; kept < 0: every row, in place). Row i sits
// at positions[i], writes its K/V at slots[i] and reads table row_table[i] of the num_tables tables:
// a decode row a table of its own, a prefill chunk's rows one between them (row_tables in
// model/batch.py). The last layer runs past its K/V only for the rows `keep` (DecoderLayer.forward).
// In the model's dtype: bf16 (uint16_t) or float32, as the constructor was told.
void LayerStack::run(uintptr_t x, uintptr_t mlp_out, int64_t n, uintptr_t positions, uintptr_t slots, uintptr_t tables,
                     int64_t num_tables, int64_t table_stride, uintptr_t row_table, uintptr_t keep, int64_t kept,
                     std::vector<uintptr_t> cos, std::vector<uintptr_t> sin, std::vector<int64_t> rot,
                     int threads) const {
    if (f32_)
        run_t<float>(x, mlp_out, n, positions, slots, tables, num_tables, table_stride, row_table, keep, kept, cos, sin,
                     rot, threads);
    else
        run_t<uint16_t>(x, mlp_out, n, positions, slots, tables, num_tables, table_stride, row_table, keep, kept, cos,
                        sin, rot, threads);
}

template <typename T>
void LayerStack::run_t(uintptr_t x, uintptr_t mlp_out, int64_t n, uintptr_t positions, uintptr_t slots,
                       uintptr_t tables, int64_t num_tables, int64_t table_stride, uintptr_t row_table, uintptr_t keep,
                       int64_t kept, const std::vector<uintptr_t>& cos, const std::vector<uintptr_t>& sin,
                       const std::vector<int64_t>& rot, int threads) const {
    const auto* pos = reinterpret_cast<const int64_t*>(positions);
    const auto* slot = reinterpret_cast<const int64_t*>(slots);
    const auto* tab = reinterpret_cast<const int64_t*>(tables);
    const auto* rows_table = reinterpret_cast<const int64_t*>(row_table);
    const auto* keep_ids = reinterpret_cast<const int64_t*>(keep);
    for (int64_t r = 0; r < n; ++r)
        if (slot[r] < 0 || slot[r] >= blocks_ * bs_)
            throw std::out_of_range("LayerStack: a KV slot lies outside the pool");
    if (!tables_in_bounds(tab, rows_table, pos, n, num_tables, table_stride, bs_, blocks_))
        throw std::out_of_range("LayerStack: a row's table, position or block id lies outside the tables or the pool");
    for (int64_t i = 0; i < kept; ++i)
        if (keep_ids[i] < 0 || keep_ids[i] >= n)
            throw std::out_of_range("LayerStack: a kept row lies outside the batch");
    for (const auto& l : layers_)
        if (l.rope < 0 || l.rope >= static_cast<int64_t>(cos.size()) || cos.size() != sin.size() ||
            sin.size() != rot.size())
            throw std::invalid_argument("LayerStack: a layer's RoPE index has no cos/sin pair");
    const std::lock_guard<std::mutex> hold(mu_);
    Scratch<T>& w = scratch<T>();
    const int64_t width = (h_ + 2 * kvh_) * d_, kv_row = kvh_ * d_;
    // (whole 16-row tiles: the RMSNorm may write its rows in the packed layout, below)
    T* normed = grown(w.normed, (n + 15) / 16 * 16 * hidden_);
    T* qkv = grown(w.qkv, n * width);
    T* attn = grown(w.attn, n * h_ * d_);
    T* attn_out = grown(w.attn_out, n * hidden_);
    auto* xs = reinterpret_cast<T*>(x);
    auto* mlp = reinterpret_cast<T*>(mlp_out);
    const AttnShape shape{h_, kvh_, d_, bs_, table_stride, scale_, softcap_, 0};
    // Where the AMX panels run a norm's consumer (past 32 rows), the norm writes its rows straight into
    // the packed tile layout the panels read (linear_amx_packed, mlp_amx_packed), which saves packing
    // them again: the same values, so the same bits.
    const bool amx_rows = std::is_same_v<T, uint16_t> && pack_kind_ == PACK_AMX && hidden_ % 32 == 0;
    const auto* packed_normed = reinterpret_cast<const uint16_t*>(normed);
    for (size_t i = 0; i < layers_.size(); ++i) {
        const StackLayer& l = layers_[i];
        // The previous layer's `x + mlp(h)` fused into this layer's input norm (as add_and_norm).
        const bool qkv_packed_in = amx_rows && l.qkv.packed && n > 32;
        rms_norm_t(xs, i ? mlp : nullptr, i ? xs : nullptr, reinterpret_cast<const T*>(l.input_norm), normed, n,
                   hidden_, eps_, false, threads, isa_, qkv_packed_in);
        if (qkv_packed_in)
            linear_amx_packed(packed_normed, l.qkv.packed, l.qkv.bias, reinterpret_cast<uintptr_t>(qkv), n, l.qkv.n,
                              l.qkv.k, threads);
        else
            stack_linear(l.qkv, pack_kind_, normed, qkv, n, threads, isa_);
        for (int64_t r = 0; l.q_norm && r < n; ++r) {  // Qwen3: each head's q and k normed, in place
            T *qr = qkv + r * width, *kr = qr + h_ * d_;
            const auto* qw = reinterpret_cast<const T*>(l.q_norm);
            const auto* kw = reinterpret_cast<const T*>(l.k_norm);
            rms_norm_t<T>(qr, nullptr, nullptr, qw, qr, h_, d_, eps_, false, threads, isa_);
            rms_norm_t<T>(kr, nullptr, nullptr, kw, kr, kvh_, d_, eps_, false, threads, isa_);
        }
        rope_t(qkv, reinterpret_cast<const T*>(cos[l.rope]), reinterpret_cast<const T*>(sin[l.rope]), n, h_ + kvh_,
               rot[l.rope], width, d_, threads, isa_);
        kv_write(reinterpret_cast<uintptr_t>(qkv + h_ * d_), reinterpret_cast<uintptr_t>(qkv + (h_ + kvh_) * d_),
                 width * sizeof(T), l.kpool, l.vpool, reinterpret_cast<uintptr_t>(slot), n, kv_row * sizeof(T),
                 threads);
        // The rest of the layer for the rows it serves: all of them, or in the last layer the kept
        // ones, gathered (their queries, tables, positions and residual rows) into rows 0..m - 1.
        const bool gather = kept >= 0 && i + 1 == layers_.size();
        const int64_t m = gather ? kept : n;
        if (m == 0) break;  // no row wants logits: the K/V were all this forward had to leave
        const T* q = qkv;
        int64_t q_stride = width;
        const int64_t *m_table = rows_table, *m_pos = pos;
        T* res = xs;
        if (gather) {
            T* kq = grown(w.kept_q, m * h_ * d_);
            take_rows(qkv, width, keep_ids, m, h_ * d_, kq);
            q = kq, q_stride = h_ * d_;
            int64_t* kt = grown(w.kept_table, m);
            int64_t* kp = grown(w.kept_pos, m);
            for (int64_t j = 0; j < m; ++j) kt[j] = rows_table[keep_ids[j]], kp[j] = pos[keep_ids[j]];
            m_table = kt, m_pos = kp;
            res = grown(w.kept_x, m * hidden_);
            take_rows(xs, hidden_, keep_ids, m, hidden_, res);
        }
        AttnShape ls = shape;
        ls.window = l.window;
        paged_attention_t<T>(reinterpret_cast<uintptr_t>(q), q_stride, l.kpool, l.vpool, tables, m_table, m_pos,
                             reinterpret_cast<uintptr_t>(attn), m, ls, scorer_, threads, isa_);
        stack_linear(l.o, pack_kind_, attn, attn_out, m, threads, isa_);
        const bool whole_mlp =
            std::is_same_v<T, uint16_t> && l.gated && pack_kind_ == PACK_AMX && l.down.packed && inter_ % 32 == 0;
        // packed rows for every piece: each piece must start on a 16-row tile
        const bool mlp_packed_in = amx_rows && whole_mlp && m > 32 && (mlp_rows_ >= m || mlp_rows_ % 16 == 0);
        rms_norm_t(res, attn_out, res, reinterpret_cast<const T*>(l.post_norm), normed, m, hidden_, eps_, false,
                   threads, isa_, mlp_packed_in);
        for (int64_t r0 = 0; r0 < m; r0 += mlp_rows_) {  // MLP.forward's pieces of rows
            const int64_t rows = std::min(mlp_rows_, m - r0);
            if (mlp_packed_in) {  // any piece, the last one's few rows too: the same bits as mlp_amx's
                mlp_amx_packed(packed_normed + r0 / 16 * (hidden_ / 32) * 512, l.gate_up.packed, l.down.packed,
                               l.down.bias, reinterpret_cast<uintptr_t>(mlp + r0 * hidden_), rows, inter_, hidden_,
                               threads);
                continue;
            }
            const T* in = normed + r0 * hidden_;
            if (whole_mlp && rows > 32) {  // MLP.forward's whole-MLP call (cpu_kernels.mlp_packed)
                mlp_amx(reinterpret_cast<uintptr_t>(in), l.gate_up.packed, l.down.packed, l.down.bias,
                        reinterpret_cast<uintptr_t>(mlp + r0 * hidden_), rows, inter_, hidden_, threads);
                continue;
            }
            T* act = grown(w.act, rows * inter_);          // (the whole-MLP call above keeps its own)
            if (std::is_same_v<T, uint16_t> && l.gated) {  // MLP.forward's fused path (bf16 packs only)
                (pack_kind_ == PACK_AMX ? linear_amx_silu : linear_dpbf16_silu)(
                    reinterpret_cast<uintptr_t>(in), l.gate_up.packed, reinterpret_cast<uintptr_t>(act), rows, inter_,
                    hidden_, threads);
            } else {
                T* gate_up = grown(w.gate_up, rows * 2 * inter_);
                stack_linear(l.gate_up, pack_kind_, in, gate_up, rows, threads, isa_);
                silu_and_mul_t(gate_up, act, rows, inter_, threads, isa_);
            }
            stack_linear(l.down, pack_kind_, act, mlp + r0 * hidden_, rows, threads, isa_);
        }
        if (gather) std::memcpy(xs, res, static_cast<size_t>(m * hidden_) * sizeof(T));
    }
}

}  // namespace minisgl::cpu
