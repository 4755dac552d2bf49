// linear_bf16: y = x @ w^T (+ bias) for 1-4 rows of bf16 on AVX-512 (float32 FMAs), the `avx512`
// family's linear (the CPU has neither AMX nor AVX512-BF16). At 1-8 rows a decode step is a weight
// stream: every weight byte is read once per step and used by M rows. oneDNN's bf16 path reaches
// ~6 GB/s there (measured, docs/performance.md "Speed"); this kernel reads each weight row once
// for up to four input rows, over the bf16 weights as stored (no packing).
//
// Bit-exactness: each output is one dot product over K in a fixed order (16-lane FMAs in k order,
// then reduce4's tree), plus the bias, rounded once to bf16; its bits depend only on its input row
// and weight row, not on M, the tile the row lands in or the thread count.

#include <vector>

#include "common.h"
#include "kernels.h"

namespace minisgl::cpu {
namespace {

// One k-step of 32 weights: a 512-bit load holds 16 (even, odd) bf16 pairs. `w << 16` is the even
// elements as float32 and `w & 0xffff0000` the odd ones (bf16 is the top half of a float32), so the
// pair becomes two FMAs against the input row split the same way. Two float32 FMAs run ~2x faster
// than one vdpbf16ps on this CPU (measured: 1.1 G vdpbf16ps/s vs 4.8 G FMA/s per core).
AVX512 inline void split_bf16(__m512i w, __m512& even, __m512& odd) {
    even = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
    odd = _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
}

// MM input rows x 4 weight rows: 4*MM float32 accumulators; each weight vector is loaded and split
// once per k-step and used by every input row. xe/xo: the input rows' even/odd elements as float32,
// zero-padded to a whole k-step (row stride xs), so a masked weight tail meets zeros.
template <int MM>
AVX512 inline void tile_bf16(const float* xe, const float* xo, int64_t xs, const uint16_t* w,
                             const uint16_t* bias, uint16_t* y, int64_t K, int64_t N) {
    __m512 acc[MM][4];
    zero_tile(acc);
    for (int64_t k = 0; k < K; k += 32) {
        const __mmask32 mask = K - k >= 32 ? ~__mmask32(0) : (__mmask32(1) << (K - k)) - 1;
        __m512 we[4], wo[4];
        prefetch_next_tile(w, K, k);
#pragma GCC unroll 4
        for (int j = 0; j < 4; ++j) split_bf16(_mm512_maskz_loadu_epi16(mask, w + j * K + k), we[j], wo[j]);
#pragma GCC unroll 4
        for (int i = 0; i < MM; ++i) {
            const __m512 e = _mm512_loadu_ps(xe + i * xs + k / 2), o = _mm512_loadu_ps(xo + i * xs + k / 2);
#pragma GCC unroll 4
            for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_fmadd_ps(o, wo[j], _mm512_fmadd_ps(e, we[j], acc[i][j]));
        }
    }
#pragma GCC unroll 4
    for (int i = 0; i < MM; ++i) {
        alignas(16) float s[4];
        _mm_store_ps(s, reduce4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]));
        for (int j = 0; j < 4; ++j) y[i * N + j] = f32_to_bf16(bias ? s[j] + bf16_to_f32(bias[j]) : s[j]);
    }
}

// The last N % 4 outputs of one input row: the tile's arithmetic with the missing weight rows zero
// (it reads row `w` four times and keeps the first result), so the bits match a full tile's.
AVX512 void tail_bf16(const float* xe, const float* xo, const uint16_t* w, const uint16_t* bias, uint16_t* y,
                      int64_t K) {
    __m512 acc = _mm512_setzero_ps();
    const __m512 z = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {
        const __mmask32 mask = K - k >= 32 ? ~__mmask32(0) : (__mmask32(1) << (K - k)) - 1;
        __m512 we, wo;
        split_bf16(_mm512_maskz_loadu_epi16(mask, w + k), we, wo);
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(xo + k / 2), wo, _mm512_fmadd_ps(_mm512_loadu_ps(xe + k / 2), we, acc));
    }
    alignas(16) float s[4];
    _mm_store_ps(s, reduce4(acc, z, z, z));
    *y = f32_to_bf16(bias ? s[0] + bf16_to_f32(*bias) : s[0]);
}

AVX512 void split_rows(const uint16_t* x, int64_t M, int64_t K, int64_t xs, float* xe, float* xo) {
    for (int64_t m = 0; m < M; ++m)
        for (int64_t k = 0; k < 2 * xs; ++k) {
            const float v = k < K ? bf16_to_f32(x[m * K + k]) : 0.0f;
            (k % 2 ? xo : xe)[m * xs + k / 2] = v;
        }
}

AVX512 void tiles_bf16(const float* xe, const float* xo, int64_t xs, const uint16_t* w, const uint16_t* bias,
                       uint16_t* y, int64_t M, int64_t N, int64_t K, int64_t b) {
    const int64_t n0 = b * 4;
    const uint16_t* wb = w + n0 * K;
    const uint16_t* bb = bias ? bias + n0 : nullptr;
    int64_t m0 = 0;
    for (; m0 + 4 <= M; m0 += 4) tile_bf16<4>(xe + m0 * xs, xo + m0 * xs, xs, wb, bb, y + m0 * N + n0, K, N);
    switch (M - m0) {
        case 3: tile_bf16<3>(xe + m0 * xs, xo + m0 * xs, xs, wb, bb, y + m0 * N + n0, K, N); break;
        case 2: tile_bf16<2>(xe + m0 * xs, xo + m0 * xs, xs, wb, bb, y + m0 * N + n0, K, N); break;
        case 1: tile_bf16<1>(xe + m0 * xs, xo + m0 * xs, xs, wb, bb, y + m0 * N + n0, K, N); break;
        default: break;
    }
}

}  // namespace

void linear_bf16(uintptr_t x, uintptr_t w, uintptr_t bias, uintptr_t y, int64_t M, int64_t N, int64_t K,
                 int threads) {
    const auto* xp = reinterpret_cast<const uint16_t*>(x);
    const auto* wp = reinterpret_cast<const uint16_t*>(w);
    const auto* bp = reinterpret_cast<const uint16_t*>(bias);
    auto* yp = reinterpret_cast<uint16_t*>(y);
    const int64_t xs = (K + 31) / 32 * 16;  // float32 per half row, padded to whole k-steps
    std::vector<float> split(static_cast<size_t>(2 * M * xs));
    float* xe = split.data();
    float* xo = xe + M * xs;
    split_rows(xp, M, K, xs, xe, xo);
    const int64_t blocks = N / 4, tail = N % 4;
    // Static schedule: each thread streams one contiguous slice of the weight matrix; the split input
    // rows stay in L1, and a 4-row weight block stays there while every input row uses it.
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static) nowait
        for (int64_t b = 0; b < blocks; ++b) tiles_bf16(xe, xo, xs, wp, bp, yp, M, N, K, b);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < M * tail; ++t) {
            const int64_t m = t / tail, n = blocks * 4 + t % tail;
            tail_bf16(xe + m * xs, xo + m * xs, wp + n * K, bp ? bp + n : nullptr, yp + m * N + n, K);
        }
    }
}

}  // namespace minisgl::cpu
