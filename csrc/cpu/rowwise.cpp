// Row-wise ops: RMSNorm (with the residual add fused), RoPE in place, SiLU x up. One pass per row
// instead of 2-8 torch ops, each of which costs more in dispatch than in arithmetic at decode sizes;
// 16 elements at a time on AVX-512, 8 on AVX2 (the avx2 family), from one source (rowwise_lanes.h),
// compiled three times: AVX-512, AVX-512 with AVX512-BF16's conversions (the same bits, fewer
// instructions per rounding) and AVX2.
//
// Bit-exactness: each row is computed alone in a fixed order, so its bits never depend on the other
// rows or the thread count: these are shared by the default and the batch-invariant forward.
// Roundings follow the torch expressions they replace (model/layers.py RMSNorm / GemmaRMSNorm,
// model/rope.py apply_rotary, F.silu(gate) * up) step by step: RoPE keeps each element's operations;
// SiLU takes each width's exp (exp16, exp8) and RMSNorm's sum of squares is summed by lanes, then by a
// fixed tree (hsum16 or hsum8), so their bits differ between the AVX-512 and the avx2 family.

#include <cmath>
#include <cstring>
#include <stdexcept>

#include "common.h"
#include "kernels.h"

namespace minisgl::cpu {

namespace avx512 {
namespace {
using V = Lanes16;
#define LANES_TARGET AVX512
#include "rowwise_lanes.h"
#undef LANES_TARGET
}  // namespace
}  // namespace avx512

namespace avx512bf16 {
namespace {
using V = Lanes16Bf16;
#define LANES_TARGET DPBF16
#include "rowwise_lanes.h"
#undef LANES_TARGET
}  // namespace
}  // namespace avx512bf16

namespace avx2 {
namespace {
using V = Lanes8;
#define LANES_TARGET AVX2
#include "rowwise_lanes.h"
#undef LANES_TARGET
}  // namespace
}  // namespace avx2

// Row-wise work is a few microseconds a row: under 32 rows, waking other threads costs more than
// it saves.
inline int row_threads(int64_t rows, int threads) { return rows >= 32 ? threads : 1; }

template <typename T>
void rms_norm_t(T* x, const T* residual, T* sum_out, const T* weight, T* out, int64_t rows, int64_t dim, float eps,
                bool gemma, int threads, int isa, bool packed_out) {
    const Isa code = require_isa(isa);
    if (packed_out && (!std::is_same_v<T, uint16_t> || gemma || dim % 32))
        throw std::invalid_argument("rms_norm_t: a packed output takes bf16 rows of whole k-steps, not gemma's");
    parallel_for(row_threads(rows, threads), rows, 0, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) {
            T* sr = sum_out ? sum_out + r * dim : nullptr;
            const T* res = residual ? residual + r * dim : nullptr;
            // packed_out: row r in pack_rows' layout ([rows / 16][dim / 32][16 rows][32]), each of its
            // 32-element groups 512 elements after the last
            T* o = packed_out ? out + (r / 16 * (dim / 32) * 16 + r % 16) * 32 : out + r * dim;
            const int64_t step = packed_out ? 512 : 32;
            if (code == ISA_AVX512_BF16)
                avx512bf16::rms_norm_row(x + r * dim, res, sr, weight, o, dim, eps, gemma, step);
            else if (code == ISA_AVX512)
                avx512::rms_norm_row(x + r * dim, res, sr, weight, o, dim, eps, gemma, step);
            else
                avx2::rms_norm_row(x + r * dim, res, sr, weight, o, dim, eps, gemma, step);
        }
    });
}
// The layer stack's (bf16 and float32).
template void rms_norm_t(uint16_t*, const uint16_t*, uint16_t*, const uint16_t*, uint16_t*, int64_t, int64_t, float,
                         bool, int, int, bool);
template void rms_norm_t(float*, const float*, float*, const float*, float*, int64_t, int64_t, float, bool, int, int,
                         bool);

void rms_norm(uintptr_t x, uintptr_t residual, uintptr_t sum_out, uintptr_t weight, uintptr_t out, int64_t rows,
              int64_t dim, double eps, bool gemma, bool bf16, int threads, int isa) {
    if (bf16)
        rms_norm_t(reinterpret_cast<uint16_t*>(x), reinterpret_cast<const uint16_t*>(residual),
                   reinterpret_cast<uint16_t*>(sum_out), reinterpret_cast<const uint16_t*>(weight),
                   reinterpret_cast<uint16_t*>(out), rows, dim, static_cast<float>(eps), gemma, threads, isa);
    else
        rms_norm_t(reinterpret_cast<float*>(x), reinterpret_cast<const float*>(residual),
                   reinterpret_cast<float*>(sum_out), reinterpret_cast<const float*>(weight),
                   reinterpret_cast<float*>(out), rows, dim, static_cast<float>(eps), gemma, threads, isa);
}

// In place on x [rows, heads, head_dim] (row stride sr, head stride sh, unit feature stride): the
// first `rot` features of every head rotated by cos/sin [rows, rot] (contiguous), the rest unchanged.
template <typename T>
void rope_t(T* x, const T* cos, const T* sin, int64_t rows, int64_t heads, int64_t rot, int64_t sr, int64_t sh,
            int threads, int isa) {
    const Isa code = require_isa(isa);
    parallel_for(row_threads(rows, threads), rows, 0, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r)
            for (int64_t h = 0; h < heads; ++h) {
                if (code == ISA_AVX512_BF16)
                    avx512bf16::rope_head(x + r * sr + h * sh, cos + r * rot, sin + r * rot, rot / 2);
                else if (code == ISA_AVX512)
                    avx512::rope_head(x + r * sr + h * sh, cos + r * rot, sin + r * rot, rot / 2);
                else
                    avx2::rope_head(x + r * sr + h * sh, cos + r * rot, sin + r * rot, rot / 2);
            }
    });
}
template void rope_t(uint16_t*, const uint16_t*, const uint16_t*, int64_t, int64_t, int64_t, int64_t, int64_t, int,
                     int);
template void rope_t(float*, const float*, const float*, int64_t, int64_t, int64_t, int64_t, int64_t, int, int);

void rope(uintptr_t x, uintptr_t cos, uintptr_t sin, int64_t rows, int64_t heads, int64_t rot, int64_t sr, int64_t sh,
          bool bf16, int threads, int isa) {
    if (bf16)
        rope_t(reinterpret_cast<uint16_t*>(x), reinterpret_cast<const uint16_t*>(cos),
               reinterpret_cast<const uint16_t*>(sin), rows, heads, rot, sr, sh, threads, isa);
    else
        rope_t(reinterpret_cast<float*>(x), reinterpret_cast<const float*>(cos), reinterpret_cast<const float*>(sin),
               rows, heads, rot, sr, sh, threads, isa);
}

// out[r, i] = silu(gate[r, i]) * up[r, i] with gate_up = [gate | up] per row.
template <typename T>
void silu_and_mul_t(const T* gate_up, T* out, int64_t rows, int64_t dim, int threads, int isa) {
    const Isa code = require_isa(isa);
    parallel_for(row_threads(rows, threads), rows, 0, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) {
            const T* g = gate_up + r * 2 * dim;
            if (code == ISA_AVX512_BF16)
                avx512bf16::silu_and_mul_row(g, g + dim, out + r * dim, dim);
            else if (code == ISA_AVX512)
                avx512::silu_and_mul_row(g, g + dim, out + r * dim, dim);
            else
                avx2::silu_and_mul_row(g, g + dim, out + r * dim, dim);
        }
    });
}
template void silu_and_mul_t(const uint16_t*, uint16_t*, int64_t, int64_t, int, int);
template void silu_and_mul_t(const float*, float*, int64_t, int64_t, int, int);

void silu_and_mul(uintptr_t gate_up, uintptr_t out, int64_t rows, int64_t dim, bool bf16, int threads, int isa) {
    if (bf16)
        silu_and_mul_t(reinterpret_cast<const uint16_t*>(gate_up), reinterpret_cast<uint16_t*>(out), rows, dim, threads,
                       isa);
    else
        silu_and_mul_t(reinterpret_cast<const float*>(gate_up), reinterpret_cast<float*>(out), rows, dim, threads, isa);
}

// The K/V write: kpool row slots[i] = k row i and vpool's = v's, row_bytes each, source rows
// src_stride bytes apart (k and v are views into the qkv projection's output). Plain row copies over
// the threads, where torch's index_copy_ walked the strided source element by element on one.
void kv_write(uintptr_t k, uintptr_t v, int64_t src_stride, uintptr_t kpool, uintptr_t vpool, uintptr_t slots,
              int64_t rows, int64_t row_bytes, int threads) {
    const auto* ks = reinterpret_cast<const char*>(k);
    const auto* vs = reinterpret_cast<const char*>(v);
    auto* kp = reinterpret_cast<char*>(kpool);
    auto* vp = reinterpret_cast<char*>(vpool);
    const auto* slot = reinterpret_cast<const int64_t*>(slots);
    parallel_for(row_threads(rows, threads), rows, 0, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) {
            std::memcpy(kp + slot[r] * row_bytes, ks + r * src_stride, static_cast<size_t>(row_bytes));
            std::memcpy(vp + slot[r] * row_bytes, vs + r * src_stride, static_cast<size_t>(row_bytes));
        }
    });
}

}  // namespace minisgl::cpu
