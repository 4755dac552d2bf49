// minisgl_backend._kernels: CPU kernels for the decode step (docs/architecture.md §11d).
//
// - linear_bf16: y = x @ w^T (+ bias) for a few bf16 rows. At 1-8 rows a decode step is a weight
//   stream: every weight byte is read once per step and used by M rows. oneDNN's bf16 path reaches
//   ~6 GB/s there on this CPU (measured, README "Speed"); this kernel reads each weight row once for
//   up to four input rows (float32 FMAs on AVX-512F, see split_bf16) and gets near the memory
//   bandwidth. Each output is one dot product over K in a fixed order, so its bits depend only on its
//   input row and weight row: never on M, on the other rows, or on the thread count.
// - decode_attention: one query token per sequence attending over its paged K/V in place (no gather
//   of every row's context into a fresh tensor per layer), OpenMP over (sequence, KV head).
// - rms_norm (with the residual add fused), rope, silu_and_mul: one pass per row instead of 2-8
//   torch ops, each of which costs more in dispatch than in arithmetic at decode sizes.
//
// Built without torch headers: tensors arrive as data pointers plus shapes checked on the Python side
// (minisgl_backend/model/cpu_kernels.py). OpenMP is the same libgomp torch loads (one soname, one
// runtime, one thread team), and the caller passes torch's thread count. The GIL is released.

#include <pybind11/pybind11.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <vector>

#include <immintrin.h>
#include <omp.h>

namespace py = pybind11;

namespace {

inline float bf16_to_f32(uint16_t h) {
    uint32_t u = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

// Round to nearest even, as torch's float -> bfloat16 conversion (NaN stays a quiet NaN).
inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return static_cast<uint16_t>(u >> 16);
}

bool cpu_has_avx512() {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
}

#define AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl")))

// [sum(a), sum(b), sum(c), sum(d)]: a transpose-and-add tree (fixed order, so fixed bits).
AVX512 inline __m128 reduce4(__m512 a, __m512 b, __m512 c, __m512 d) {
    // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] and the same for c, d
    const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
    const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
    // per lane: [a, b, c, d] partial sums
    const __m512 abcd = _mm512_add_ps(
        _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd))),
        _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd))));
    const __m256 half = _mm256_add_ps(_mm512_castps512_ps256(abcd), _mm512_extractf32x8_ps(abcd, 1));
    return _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1));
}

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
#pragma GCC unroll 4
    for (int i = 0; i < MM; ++i)
#pragma GCC unroll 4
        for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {
        const __mmask32 mask = K - k >= 32 ? ~__mmask32(0) : (__mmask32(1) << (K - k)) - 1;
        __m512 we[4], wo[4];
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

// ---- weight-only int8: y = (x @ q^T) * scale[n] (+ bias) -------------------------------------------
//
// The same 4-weight-row tiles over per-output-channel int8 weights: half the bytes of bf16 per decode
// step. Each 128-bit load holds 16 weights, widened to float32 (vpmovsxbd + vcvtdq2ps) once and used
// by every input row; the input rows are float32 (converted once per call).

template <int MM>
AVX512 inline void tile_int8(const float* x, int64_t xs, const int8_t* w, const float* scale, const uint16_t* bias,
                             uint16_t* y, int64_t K, int64_t N) {
    __m512 acc[MM][4];
#pragma GCC unroll 4
    for (int i = 0; i < MM; ++i)
#pragma GCC unroll 4
        for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
        const __mmask16 mask = K - k >= 16 ? __mmask16(0xffff) : static_cast<__mmask16>((1u << (K - k)) - 1);
        __m512 wf[4];
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
        case 3: tile_int8<3>(x + m0 * xs, xs, wb, scale + n0, bb, y + m0 * N + n0, K, N); break;
        case 2: tile_int8<2>(x + m0 * xs, xs, wb, scale + n0, bb, y + m0 * N + n0, K, N); break;
        case 1: tile_int8<1>(x + m0 * xs, xs, wb, scale + n0, bb, y + m0 * N + n0, K, N); break;
        default: break;
    }
}

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
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static) nowait
        for (int64_t b = 0; b < blocks; ++b) tiles_int8(xf.data(), xs, wp, sp, bp, yp, M, N, K, b);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < M * tail; ++t) {
            const int64_t m = t / tail, n = blocks * 4 + t % tail;
            tail_int8(xf.data() + m * xs, wp + n * K, sp[n], bp ? bp + n : nullptr, yp + m * N + n, K);
        }
    }
}

// ---- decode attention over the paged cache ------------------------------------------------------

template <typename T>
inline float load(const T* p, int64_t i);
template <>
inline float load<float>(const float* p, int64_t i) {
    return p[i];
}
template <>
inline float load<uint16_t>(const uint16_t* p, int64_t i) {
    return bf16_to_f32(p[i]);
}

template <typename T>
inline void store(T* p, int64_t i, float v);
template <>
inline void store<float>(float* p, int64_t i, float v) {
    p[i] = v;
}
template <>
inline void store<uint16_t>(uint16_t* p, int64_t i, float v) {
    p[i] = f32_to_bf16(v);
}

struct AttnShape {
    int64_t heads, kv_heads, head_dim, block_size, table_stride;
    float scale, softcap;  // softcap 0: none
    int64_t window;        // 0: full attention
};

// One (sequence, KV head): the group's query heads against keys [first, pos], softmax in float32.
template <typename T>
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default"))) void attend_group(
    const T* q, const T* kpool, const T* vpool, const int64_t* table, int64_t pos, int64_t kvh, T* out,
    const AttnShape& s, std::vector<float>& scores, std::vector<float>& acc) {
    const int64_t d = s.head_dim, g = s.heads / s.kv_heads;
    const int64_t first = s.window > 0 ? std::max<int64_t>(0, pos - s.window + 1) : 0;
    const int64_t len = pos - first + 1;
    scores.resize(static_cast<size_t>(g * len));
    acc.assign(static_cast<size_t>(g * d), 0.0f);
    std::vector<float> qf(static_cast<size_t>(g * d));
    for (int64_t h = 0; h < g; ++h)
        for (int64_t i = 0; i < d; ++i) qf[h * d + i] = load(q, (kvh * g + h) * d + i);
    const int64_t row = s.kv_heads * d;  // elements per slot in the pool
    for (int64_t j = 0; j < len; ++j) {
        const int64_t key = first + j;
        const T* kp = kpool + (table[key / s.block_size] * s.block_size + key % s.block_size) * row + kvh * d;
        for (int64_t h = 0; h < g; ++h) {
            float dot = 0.0f;
            const float* qh = qf.data() + h * d;
#pragma omp simd reduction(+ : dot)
            for (int64_t i = 0; i < d; ++i) dot += qh[i] * load(kp, i);
            float sc = dot * s.scale;
            if (s.softcap > 0.0f) sc = s.softcap * std::tanh(sc / s.softcap);
            scores[h * len + j] = sc;
        }
    }
    for (int64_t h = 0; h < g; ++h) {
        float* sh = scores.data() + h * len;
        float mx = -INFINITY;
        for (int64_t j = 0; j < len; ++j) mx = std::max(mx, sh[j]);
        float sum = 0.0f;
        for (int64_t j = 0; j < len; ++j) {
            sh[j] = std::exp(sh[j] - mx);
            sum += sh[j];
        }
        const float inv = 1.0f / sum;
        for (int64_t j = 0; j < len; ++j) sh[j] *= inv;
    }
    for (int64_t j = 0; j < len; ++j) {
        const int64_t key = first + j;
        const T* vp = vpool + (table[key / s.block_size] * s.block_size + key % s.block_size) * row + kvh * d;
        for (int64_t h = 0; h < g; ++h) {
            const float p = scores[h * len + j];
            float* ah = acc.data() + h * d;
#pragma omp simd
            for (int64_t i = 0; i < d; ++i) ah[i] += p * load(vp, i);
        }
    }
    for (int64_t h = 0; h < g; ++h)
        for (int64_t i = 0; i < d; ++i) store(out, (kvh * g + h) * d + i, acc[h * d + i]);
}

template <typename T>
void decode_attention_t(uintptr_t q, int64_t q_stride, uintptr_t k, uintptr_t v, uintptr_t tables,
                        uintptr_t positions, uintptr_t out, int64_t batch, const AttnShape& s, int threads) {
    const auto* qp = reinterpret_cast<const T*>(q);
    const auto* kp = reinterpret_cast<const T*>(k);
    const auto* vp = reinterpret_cast<const T*>(v);
    const auto* tp = reinterpret_cast<const int64_t*>(tables);
    const auto* pp = reinterpret_cast<const int64_t*>(positions);
    auto* op = reinterpret_cast<T*>(out);
    const int64_t per_row = s.heads * s.head_dim;
#pragma omp parallel num_threads(threads)
    {
        std::vector<float> scores, acc;  // per thread, reused across its (row, head) items
#pragma omp for schedule(static)
        for (int64_t item = 0; item < batch * s.kv_heads; ++item) {
            const int64_t b = item / s.kv_heads, kvh = item % s.kv_heads;
            attend_group<T>(qp + b * q_stride, kp, vp, tp + b * s.table_stride, pp[b], kvh, op + b * per_row, s,
                            scores, acc);
        }
    }
}

// Every block a query will read lies inside its table row and the pool: a bad table is an error,
// never a read out of bounds.
bool tables_in_bounds(const int64_t* tables, const int64_t* positions, int64_t batch, int64_t stride,
                      int64_t block_size, int64_t num_blocks) {
    for (int64_t b = 0; b < batch; ++b) {
        const int64_t pos = positions[b];
        if (pos < 0 || pos / block_size >= stride) return false;
        for (int64_t i = 0; i <= pos / block_size; ++i) {
            const int64_t blk = tables[b * stride + i];
            if (blk < 0 || blk >= num_blocks) return false;
        }
    }
    return true;
}

void decode_attention(uintptr_t q, int64_t q_stride, uintptr_t k, uintptr_t v, uintptr_t tables, uintptr_t positions,
                      uintptr_t out, int64_t batch, int64_t heads, int64_t kv_heads, int64_t head_dim,
                      int64_t block_size, int64_t num_blocks, int64_t table_stride, double scale, double softcap,
                      int64_t window, bool bf16, int threads) {
    if (heads % kv_heads != 0) throw std::invalid_argument("heads must be a multiple of kv_heads");
    if (!tables_in_bounds(reinterpret_cast<const int64_t*>(tables), reinterpret_cast<const int64_t*>(positions),
                          batch, table_stride, block_size, num_blocks))
        throw std::out_of_range("decode_attention: a position or block id lies outside its block table or the pool");
    const AttnShape s{heads,
                      kv_heads,
                      head_dim,
                      block_size,
                      table_stride,
                      static_cast<float>(scale),
                      static_cast<float>(softcap),
                      window};
    if (bf16)
        decode_attention_t<uint16_t>(q, q_stride, k, v, tables, positions, out, batch, s, threads);
    else
        decode_attention_t<float>(q, q_stride, k, v, tables, positions, out, batch, s, threads);
}

// ---- row-wise ops: RMSNorm (with the residual add fused) and RoPE -------------------------------
//
// Each row is computed alone in a fixed order, so its bits never depend on the other rows: these are
// shared by the default and the batch-invariant forward. Roundings follow the torch expressions they
// replace (model/llama.py RMSNorm / GemmaRMSNorm, model/rope.py apply_rotary) step by step.

template <typename T>
void rms_norm_t(T* x, const T* residual, T* sum_out, const T* weight, T* out, int64_t rows, int64_t dim,
                float eps, bool gemma, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows >= 32)
    for (int64_t r = 0; r < rows; ++r) {
        T* xr = x + r * dim;
        T* sr = sum_out ? sum_out + r * dim : nullptr;
        // x + residual, rounded to the model dtype as torch's add does, is the row normalised and
        // (sum_out) the new residual stream.
        float ss = 0.0f;
        for (int64_t i = 0; i < dim; ++i) {
            float v = load(xr, i);
            if (residual) {
                v += load(residual + r * dim, i);
                store(sr, i, v);
                v = load(sr, i);
            }
            ss += v * v;
        }
        const float inv = 1.0f / std::sqrt(ss / static_cast<float>(dim) + eps);
        const T* src = residual ? sr : xr;
        for (int64_t i = 0; i < dim; ++i) {
            const float n = load(src, i) * inv;
            if (gemma) {  // (x * rsqrt) * (1 + w) in float32, rounded once
                store(out + r * dim, i, n * (1.0f + load(weight, i)));
            } else {  // rounded to the dtype, then weight * it in the dtype
                T nd;
                store(&nd, 0, n);
                store(out + r * dim, i, load(weight, i) * load(&nd, 0));
            }
        }
    }
}

void rms_norm(uintptr_t x, uintptr_t residual, uintptr_t sum_out, uintptr_t weight, uintptr_t out, int64_t rows,
              int64_t dim, double eps, bool gemma, bool bf16, int threads) {
    if (bf16)
        rms_norm_t(reinterpret_cast<uint16_t*>(x), reinterpret_cast<const uint16_t*>(residual),
                   reinterpret_cast<uint16_t*>(sum_out), reinterpret_cast<const uint16_t*>(weight),
                   reinterpret_cast<uint16_t*>(out), rows, dim, static_cast<float>(eps), gemma, threads);
    else
        rms_norm_t(reinterpret_cast<float*>(x), reinterpret_cast<const float*>(residual),
                   reinterpret_cast<float*>(sum_out), reinterpret_cast<const float*>(weight),
                   reinterpret_cast<float*>(out), rows, dim, static_cast<float>(eps), gemma, threads);
}

// In place on x [rows, heads, head_dim] (row stride sr, head stride sh, unit feature stride): the
// first `rot` features of every head rotated by cos/sin [rows, rot] (contiguous), the rest unchanged.
// x1*cos - x2*sin and x2*cos + x1*sin, each product and the sum rounded to the dtype as torch's
// x * cos + rotate_half(x) * sin rounds them.
template <typename T>
void rope_t(T* x, const T* cos, const T* sin, int64_t rows, int64_t heads, int64_t rot, int64_t sr, int64_t sh,
            int threads) {
    const int64_t half = rot / 2;
#pragma omp parallel for num_threads(threads) schedule(static) if (rows >= 32)
    for (int64_t r = 0; r < rows; ++r) {
        const T* c = cos + r * rot;
        const T* s = sin + r * rot;
        for (int64_t h = 0; h < heads; ++h) {
            T* xh = x + r * sr + h * sh;
            for (int64_t i = 0; i < half; ++i) {
                const float x1 = load(xh, i), x2 = load(xh, i + half);
                T a, b, c2, d;
                store(&a, 0, x1 * load(c, i));
                store(&b, 0, -x2 * load(s, i));
                store(&c2, 0, x2 * load(c, i + half));
                store(&d, 0, x1 * load(s, i + half));
                store(xh, i, load(&a, 0) + load(&b, 0));
                store(xh, i + half, load(&c2, 0) + load(&d, 0));
            }
        }
    }
}

void rope(uintptr_t x, uintptr_t cos, uintptr_t sin, int64_t rows, int64_t heads, int64_t rot, int64_t sr,
          int64_t sh, bool bf16, int threads) {
    if (bf16)
        rope_t(reinterpret_cast<uint16_t*>(x), reinterpret_cast<const uint16_t*>(cos),
               reinterpret_cast<const uint16_t*>(sin), rows, heads, rot, sr, sh, threads);
    else
        rope_t(reinterpret_cast<float*>(x), reinterpret_cast<const float*>(cos), reinterpret_cast<const float*>(sin),
               rows, heads, rot, sr, sh, threads);
}

// out[r, i] = silu(gate[r, i]) * up[r, i] with gate_up = [gate | up] per row: torch's
// F.silu(gate) * up, its silu rounded to the dtype before the product.
template <typename T>
void silu_and_mul_t(const T* gate_up, T* out, int64_t rows, int64_t dim, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows >= 32)
    for (int64_t r = 0; r < rows; ++r) {
        const T* g = gate_up + r * 2 * dim;
        const T* u = g + dim;
        for (int64_t i = 0; i < dim; ++i) {
            const float x = load(g, i);
            T act;
            store(&act, 0, x / (1.0f + std::exp(-x)));
            store(out + r * dim, i, load(&act, 0) * load(u, i));
        }
    }
}

void silu_and_mul(uintptr_t gate_up, uintptr_t out, int64_t rows, int64_t dim, bool bf16, int threads) {
    if (bf16)
        silu_and_mul_t(reinterpret_cast<const uint16_t*>(gate_up), reinterpret_cast<uint16_t*>(out), rows, dim,
                       threads);
    else
        silu_and_mul_t(reinterpret_cast<const float*>(gate_up), reinterpret_cast<float*>(out), rows, dim, threads);
}

}  // namespace

PYBIND11_MODULE(_kernels, m) {
    m.doc() = "CPU decode kernels for minisgl (pointer-level; use minisgl_backend.model.cpu_kernels).";
    m.def("has_avx512", &cpu_has_avx512, "True if this CPU runs linear_bf16.");
    m.def("linear_bf16", &linear_bf16, py::call_guard<py::gil_scoped_release>(), py::arg("x"), py::arg("w"),
          py::arg("bias"), py::arg("y"), py::arg("m"), py::arg("n"), py::arg("k"), py::arg("threads"),
          "y[m,n] = x[m,k] @ w[n,k]^T (+ bias[n]); contiguous bfloat16; bias 0 = none.");
    m.def("linear_int8", &linear_int8, py::call_guard<py::gil_scoped_release>(), py::arg("x"), py::arg("w"),
          py::arg("scale"), py::arg("bias"), py::arg("y"), py::arg("m"), py::arg("n"), py::arg("k"),
          py::arg("threads"),
          "y[m,n] = (x[m,k] @ w[n,k]^T) * scale[n] (+ bias[n]); x, bias, y bfloat16, w int8, scale float32.");
    m.def("decode_attention", &decode_attention, py::call_guard<py::gil_scoped_release>(), py::arg("q"),
          py::arg("q_row_stride"), py::arg("k"), py::arg("v"), py::arg("tables"), py::arg("positions"), py::arg("out"), py::arg("batch"),
          py::arg("heads"), py::arg("kv_heads"), py::arg("head_dim"), py::arg("block_size"),
          py::arg("num_blocks"), py::arg("table_stride"), py::arg("scale"), py::arg("softcap"), py::arg("window"), py::arg("bf16"),
          py::arg("threads"),
          "One query per sequence over its paged K/V: q [b,h,d] (rows q_row_stride apart), out [b,h,d], pools [slots,kvh,d], tables int64 [b,stride], "
          "positions int64 [b] (the query's position; keys 0..pos, or the last `window`).");
    m.def("rms_norm", &rms_norm, py::call_guard<py::gil_scoped_release>(), py::arg("x"), py::arg("residual"),
          py::arg("sum_out"), py::arg("weight"), py::arg("out"), py::arg("rows"), py::arg("dim"), py::arg("eps"),
          py::arg("gemma"), py::arg("bf16"), py::arg("threads"),
          "out = RMSNorm(x [+ residual]) row by row; with residual, sum_out receives x + residual.");
    m.def("rope", &rope, py::call_guard<py::gil_scoped_release>(), py::arg("x"), py::arg("cos"), py::arg("sin"),
          py::arg("rows"), py::arg("heads"), py::arg("rot"), py::arg("row_stride"), py::arg("head_stride"),
          py::arg("bf16"), py::arg("threads"), "Rotate the first `rot` features of every head of x in place.");
    m.def("silu_and_mul", &silu_and_mul, py::call_guard<py::gil_scoped_release>(), py::arg("gate_up"),
          py::arg("out"), py::arg("rows"), py::arg("dim"), py::arg("bf16"), py::arg("threads"),
          "out [rows, dim] = silu(gate) * up for gate_up [rows, 2 * dim] = [gate | up].");
}
