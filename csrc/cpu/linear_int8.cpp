// linear_int8: y = (x @ q^T) * scale[n] (+ bias) for 1-4 bf16 rows over weight-only int8 weights with
// per-output-channel float32 scales (weight_dtype: int8): linear_fma.cpp's 4-weight-row tiles at half
// the bytes of bf16 per decode step. Each 128-bit load holds 16 weights, widened to float32
// (vpmovsxbd + vcvtdq2ps) once and used by every input row; the input rows are float32 (converted
// once per call).
//
// Bit-exactness: each output is one float32 dot product over K in a fixed order (16-lane FMAs in k
// order, then reduce4's tree), times its scale, plus the bias, rounded once to bf16; its bits depend
// only on its input row and weight row, not on M, the tile the row lands in or the thread count.

#include <vector>

#include "common.h"
#include "kernels.h"

namespace minisgl::cpu {
namespace {

template <int MM>
AVX512 inline void tile_int8(const float* x, int64_t xs, const int8_t* w, const float* scale, const uint16_t* bias,
                             uint16_t* y, int64_t K, int64_t N) {
    __m512 acc[MM][4];
    zero_tile(acc);
    for (int64_t k = 0; k < K; k += 16) {
        const __mmask16 mask = K - k >= 16 ? __mmask16(0xffff) : static_cast<__mmask16>((1u << (K - k)) - 1);
        __m512 wf[4];
        if ((k & 63) == 0) prefetch_rows_ahead(w, K, k, 4);
#pragma GCC unroll 4
        for (int j = 0; j < 4; ++j)
            wf[j] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(mask, w + j * K + k)));
#pragma GCC unroll 4
        for (int i = 0; i < MM; ++i) {
            const __m512 xv = _mm512_loadu_ps(x + i * xs + k);
#pragma GCC unroll 4
            for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_fmadd_ps(xv, wf[j], acc[i][j]);
        }
    }
#pragma GCC unroll 4
    for (int i = 0; i < MM; ++i) {
        alignas(16) float s[4];
        _mm_store_ps(s, _mm_mul_ps(reduce4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]), _mm_loadu_ps(scale)));
        for (int j = 0; j < 4; ++j) y[i * N + j] = f32_to_bf16(bias ? s[j] + bf16_to_f32(bias[j]) : s[j]);
    }
}

AVX512 void tail_int8(const float* x, const int8_t* w, float scale, const uint16_t* bias, uint16_t* y, int64_t K) {
    __m512 acc = _mm512_setzero_ps();
    const __m512 z = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
        const __mmask16 mask = K - k >= 16 ? __mmask16(0xffff) : static_cast<__mmask16>((1u << (K - k)) - 1);
        const __m512 wf = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(mask, w + k)));
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(x + k), wf, acc);
    }
    alignas(16) float s[4];
    _mm_store_ps(s, reduce4(acc, z, z, z));
    const float v = s[0] * scale;
    *y = f32_to_bf16(bias ? v + bf16_to_f32(*bias) : v);
}

AVX512 void tiles_int8(const float* x, int64_t xs, const int8_t* w, const float* scale, const uint16_t* bias,
                       uint16_t* y, int64_t M, int64_t N, int64_t K, int64_t b) {
    const int64_t n0 = b * 4;
    const int8_t* wb = w + n0 * K;
    const uint16_t* bb = bias ? bias + n0 : nullptr;
    int64_t m0 = 0;
    for (; m0 + 4 <= M; m0 += 4) tile_int8<4>(x + m0 * xs, xs, wb, scale + n0, bb, y + m0 * N + n0, K, N);
    switch (M - m0) {
        case 3:
            tile_int8<3>(x + m0 * xs, xs, wb, scale + n0, bb, y + m0 * N + n0, K, N);
            break;
        case 2:
            tile_int8<2>(x + m0 * xs, xs, wb, scale + n0, bb, y + m0 * N + n0, K, N);
            break;
        case 1:
            tile_int8<1>(x + m0 * xs, xs, wb, scale + n0, bb, y + m0 * N + n0, K, N);
            break;
        default:
            break;
    }
}

}  // namespace

void linear_int8(uintptr_t x, uintptr_t w, uintptr_t scale, uintptr_t bias, uintptr_t y, int64_t M, int64_t N,
                 int64_t K, int threads) {
    const auto* xp = reinterpret_cast<const uint16_t*>(x);
    const auto* wp = reinterpret_cast<const int8_t*>(w);
    const auto* sp = reinterpret_cast<const float*>(scale);
    const auto* bp = reinterpret_cast<const uint16_t*>(bias);
    auto* yp = reinterpret_cast<uint16_t*>(y);
    const int64_t xs = (K + 15) / 16 * 16;  // float32 per row, zero-padded to whole k-steps
    std::vector<float> xf(static_cast<size_t>(M * xs), 0.0f);
    for (int64_t m = 0; m < M; ++m)
        for (int64_t k = 0; k < K; ++k) xf[m * xs + k] = bf16_to_f32(xp[m * K + k]);
    const int64_t blocks = N / 4, tail = N % 4;
    parallel_for(threads, blocks + M * tail, 0, [&](int64_t i0, int64_t i1) {
        for (int64_t i = i0; i < i1; ++i) {
            if (i < blocks) {
                tiles_int8(xf.data(), xs, wp, sp, bp, yp, M, N, K, i);
                continue;
            }
            const int64_t t = i - blocks, m = t / tail, n = blocks * 4 + t % tail;
            tail_int8(xf.data() + m * xs, wp + n * K, sp[n], bp ? bp + n : nullptr, yp + m * N + n, K);
        }
    });
}

}  // namespace minisgl::cpu
