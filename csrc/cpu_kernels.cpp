// minisgl_backend._kernels: CPU kernels for the model's forward (docs/architecture.md §11d).
//
// - linear_amx: y = x @ w^T (+ bias) at any row count on the AMX tile unit, over weights packed once
//   at load (pack_amx). A row's bits depend only on that row and the weights (see its section), so
//   the default and the batch-invariant forward share it.
// - linear_bf16: the same for 1-4 rows on AVX-512 where the CPU has no AMX. At 1-8 rows a decode
//   step is a weight stream: every weight byte is read once per step and used by M rows. oneDNN's
//   bf16 path reaches ~6 GB/s there on this CPU (measured, README "Speed"); this kernel reads each
//   weight row once for up to four input rows (float32 FMAs on AVX-512F, see split_bf16). Each
//   output is one dot product over K in a fixed order.
// - linear_int8: linear_bf16's tiles over int8 weights with per-channel scales (weight_dtype: int8).
// - paged_attention: every query row over its paged K/V in place (no gather of every row's context
//   into a fresh tensor per layer), OpenMP over (block of rows, KV head); a row's bits do not depend
//   on the other rows, so it serves decode rows, and in the batch-invariant forward every row.
//   Prefill blocks take 16 query vectors per register (attend_lanes); bf16 scores come from the AMX
//   tile unit where the CPU has it (amx_scores).
// - rms_norm (with the residual add fused), rope, silu_and_mul: one pass per row instead of 2-8
//   torch ops, each of which costs more in dispatch than in arithmetic at decode sizes; 16
//   elements at a time on AVX-512.
// - DecodeStack: every layer of a decode-only batch from one call, over the kernels above.
//
// Built without torch headers: tensors arrive as data pointers plus shapes checked on the Python side
// (minisgl_backend/model/cpu_kernels.py). OpenMP is the same libgomp torch loads (one soname, one
// runtime, one thread team), and the caller passes torch's thread count. The GIL is released.

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <type_traits>
#include <vector>

#include <immintrin.h>
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>

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

// The few-row kernels read 4 weight rows at a time, 4 interleaved streams per thread, which the
// hardware prefetcher alone kept at ~4-5 GB/s per core: each 64 bytes of a row request the same line
// of the next block's 4 rows (the rows the thread reads next; past the matrix a prefetch never
// faults). Measured on one decode step's SmolLM2 weights at one row, 2 threads: int8 (135 MB)
// 16 -> 10 ms, bf16 without AMX (270 MB) 25 -> 16 ms.
template <typename W>
AVX512 inline void prefetch_next_tile(const W* w, int64_t K, int64_t k) {
    for (int j = 4; j < 8; ++j) _mm_prefetch(reinterpret_cast<const char*>(w + j * K + k), _MM_HINT_T0);
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

// ---- AMX bf16 linear over pre-packed weights: any row count ---------------------------------------
//
// The tile unit (AMX-BF16, Sapphire Rapids and later) multiplies a 16-row x 32-element bf16 tile of
// x by a 32 x 16 tile of weights into 16 x 16 float32 sums in one instruction. The weights are
// packed once at load (pack_amx) into the unit's pair-interleaved layout, in the order the kernel
// streams them: [N/32][K/32][2 tiles][16 k-pairs][16 outputs x 2], zero-padded to whole tiles, so
// one 32-output block is one contiguous run of memory.
//
// Each output element is the unit's dot product over K in 32-element steps in a fixed order, summed
// into float32 in the unit; nothing else touches it but the bias add and one rounding to bf16. Its
// bits therefore depend only on its own input row and weight row: never on the row count, on which
// tile the row lands in, or on the thread count (measured, tests/test_cpu_kernels.py), which is what
// the batch-invariant forward needs, at prefill speed.

#define AMX __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512dq,avx512vl")))

constexpr int64_t AMX_ROW_CHUNK = 256;  // rows per pass over a weight block: x's chunk stays in L2
// The weight tiles of the k-step this many steps ahead are prefetched: the hardware prefetcher
// alone left a 270 MB stream of steps 15-25% slower at 1, 8 and 32 rows (measured, README "Speed").
constexpr int64_t AMX_PREFETCH_STEPS = 2;

// The 2 KB (32 lines) of weight tiles of one k-step into L1; past the block's end it is the next
// block's start, which the thread reads next (a prefetch never faults).
AMX inline void prefetch_kstep(const uint16_t* wb) {
    for (int line = 0; line < 32; ++line) _mm_prefetch(reinterpret_cast<const char*>(wb + line * 32), _MM_HINT_T0);
}

// Linux hands the tile registers to a process only after it asks (ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA); without it the first tile instruction is SIGILL. Asked once at import.
bool cpu_has_amx() {
    __builtin_cpu_init();
    if (!cpu_has_avx512() || !__builtin_cpu_supports("amx-tile") || !__builtin_cpu_supports("amx-bf16"))
        return false;
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

struct alignas(64) TileConfig {
    uint8_t palette = 1, start_row = 0;
    uint8_t reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
};

// tmm0, tmm1: sums for the block's first ra rows (outputs 0-15, 16-31); tmm2, tmm3: the next rb rows;
// tmm4, tmm5: those rows of x; tmm6, tmm7: the two weight tiles of one k-step.
AMX void configure_tiles(int ra, int rb) {
    TileConfig c;
    for (int t = 0; t < 8; ++t) c.colsb[t] = 64;
    c.rows[0] = c.rows[1] = c.rows[4] = static_cast<uint8_t>(ra);
    c.rows[2] = c.rows[3] = c.rows[5] = static_cast<uint8_t>(rb ? rb : 1);
    c.rows[6] = c.rows[7] = 16;
    // GCC 12 treats the field stores as dead before ldtilecfg (it drops them) unless c escapes.
    asm volatile("" : : "r"(&c) : "memory");
    _tile_loadconfig(&c);
}

// The first min(n, 16) lanes (n >= 1).
inline __mmask16 first_lanes(int64_t n) { return n >= 16 ? __mmask16(0xffff) : static_cast<__mmask16>((1u << n) - 1); }

// 16 float32 to bf16 with round-to-nearest-even (f32_to_bf16, sixteen at a time).
AVX512 inline __m256i round_to_bf16(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), odd), 16);
    const __mmask16 nan =
        _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
    r = _mm512_mask_blend_epi32(nan, r, _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40)));
    return _mm512_cvtepi32_epi16(r);
}

AVX512 inline __m512 load_bf16x16(const uint16_t* p, __mmask16 mask) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, p)), 16));
}

// rows x 32 float32 sums (row stride 32) + bias, rounded, into y's columns n0.. (the valid ones).
AMX void store_sums(const float* sums, int rows, int64_t n0, int64_t N, const uint16_t* bias, uint16_t* y) {
    const int64_t left = N - n0;
    const auto lanes = [](int64_t n) { return n >= 16 ? __mmask16(0xffff) : static_cast<__mmask16>((1u << n) - 1); };
    const __mmask16 lo = lanes(left), hi = left > 16 ? lanes(left - 16) : 0;
    const __m512 b0 = bias ? load_bf16x16(bias + n0, lo) : _mm512_setzero_ps();
    const __m512 b1 = bias ? load_bf16x16(bias + n0 + 16, hi) : _mm512_setzero_ps();
    for (int r = 0; r < rows; ++r) {
        __m512 v0 = _mm512_load_ps(sums + r * 32), v1 = _mm512_load_ps(sums + r * 32 + 16);
        if (bias) {
            v0 = _mm512_add_ps(v0, b0);
            v1 = _mm512_add_ps(v1, b1);
        }
        uint16_t* yr = y + r * N + n0;
        _mm256_mask_storeu_epi16(yr, lo, round_to_bf16(v0));
        _mm256_mask_storeu_epi16(yr + 16, hi, round_to_bf16(v1));
    }
}

int64_t packed_amx_elems(int64_t N, int64_t K) { return (N + 31) / 32 * ((K + 31) / 32) * 1024; }

void pack_amx(uintptr_t w, uintptr_t out, int64_t N, int64_t K, int threads) {
    const auto* wp = reinterpret_cast<const uint16_t*>(w);
    auto* op = reinterpret_cast<uint16_t*>(out);
    const int64_t NB = (N + 31) / 32, KB = (K + 31) / 32;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t nb = 0; nb < NB; ++nb)
        for (int64_t kb = 0; kb < KB; ++kb)
            for (int64_t j = 0; j < 2; ++j)
                for (int64_t pair = 0; pair < 16; ++pair)
                    for (int64_t n = 0; n < 16; ++n)
                        for (int64_t e = 0; e < 2; ++e) {
                            const int64_t row = nb * 32 + j * 16 + n, col = kb * 32 + 2 * pair + e;
                            op[((((nb * KB + kb) * 2 + j) * 16 + pair) * 16 + n) * 2 + e] =
                                row < N && col < K ? wp[row * K + col] : 0;
                        }
}

// One block of up to 32 rows (x rows xs elements apart) x 32 outputs over the block's packed weights.
AMX void amx_block(const uint16_t* x, int64_t xs, const uint16_t* wb, int64_t KB, int ra, int rb, float* sums) {
    _tile_zero(0);
    _tile_zero(1);
    if (rb) {
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t kb = 0; kb < KB; ++kb) {
            prefetch_kstep(wb + (kb + AMX_PREFETCH_STEPS) * 1024);
            _tile_loadd(4, x + kb * 32, xs * 2);
            _tile_loadd(5, x + 16 * xs + kb * 32, xs * 2);
            _tile_loadd(6, wb + kb * 1024, 64);
            _tile_loadd(7, wb + kb * 1024 + 512, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
        _tile_stored(2, sums + 16 * 32, 128);
        _tile_stored(3, sums + 16 * 32 + 16, 128);
    } else {
        for (int64_t kb = 0; kb < KB; ++kb) {
            prefetch_kstep(wb + (kb + AMX_PREFETCH_STEPS) * 1024);
            _tile_loadd(4, x + kb * 32, xs * 2);
            _tile_loadd(6, wb + kb * 1024, 64);
            _tile_loadd(7, wb + kb * 1024 + 512, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
        }
    }
    _tile_stored(0, sums, 128);
    _tile_stored(1, sums + 16, 128);
}

AMX void linear_amx(uintptr_t x, uintptr_t packed, uintptr_t bias, uintptr_t y, int64_t M, int64_t N, int64_t K,
                    int threads) {
    const auto* xp = reinterpret_cast<const uint16_t*>(x);
    const auto* wp = reinterpret_cast<const uint16_t*>(packed);
    const auto* bp = reinterpret_cast<const uint16_t*>(bias);
    auto* yp = reinterpret_cast<uint16_t*>(y);
    const int64_t NB = (N + 31) / 32, KB = (K + 31) / 32, xs = KB * 32;
    std::vector<uint16_t> padded;  // x with K zero-padded to whole k-steps, when it is not already
    if (xs != K) {
        padded.assign(static_cast<size_t>(M * xs), 0);
        for (int64_t m = 0; m < M; ++m) std::memcpy(padded.data() + m * xs, xp + m * K, K * 2);
        xp = padded.data();
    }
#pragma omp parallel num_threads(threads)
    {
        alignas(64) float sums[32 * 32];
        int ra_now = -1, rb_now = -1;  // the thread's tile shape (ldtilecfg only when it changes)
        for (int64_t c0 = 0; c0 < M; c0 += AMX_ROW_CHUNK) {
            const int64_t c1 = std::min(M, c0 + AMX_ROW_CHUNK);
            // Static over weight blocks: each thread streams one contiguous slice of the weights,
            // and a block's weights stay in L1/L2 while every row of the chunk uses them.
#pragma omp for schedule(static)
            for (int64_t nb = 0; nb < NB; ++nb)
                for (int64_t m0 = c0; m0 < c1; m0 += 32) {
                    const int rows = static_cast<int>(std::min<int64_t>(32, c1 - m0));
                    const int ra = std::min(16, rows), rb = rows - ra;
                    if (ra != ra_now || rb != rb_now) {
                        configure_tiles(ra, rb);
                        ra_now = ra;
                        rb_now = rb;
                    }
                    amx_block(xp + m0 * xs, xs, wp + nb * KB * 1024, KB, ra, rb, sums);
                    store_sums(sums, rows, nb * 32, N, bp, yp + m0 * N);
                }
        }
        if (ra_now >= 0) _tile_release();
    }
}

// ---- AVX512-BF16 linear over pre-packed weights: any row count ------------------------------------
//
// Where the CPU has AVX512-BF16 but no AMX (AMD Zen 4/5, Intel Cooper Lake), vdpbf16ps multiplies 16
// (even, odd) bf16 pairs of one register by 16 pairs of another and adds both products into 16
// float32 lanes: 32 multiply-adds per instruction. Zen 5 issues two per cycle (measured: 7.0 G/s per
// core, 450 GFLOPS, against 7.7 G/s of float32 FMAs at half the width), so the float32 split of
// linear_bf16 would cost half the rate here. pack_dpbf16 lays the weights out once at load in the
// order the kernel reads them: panels of 64 outputs (the last one 16, 32 or 48), each [K/2 pairs]
// [outputs][2], so one k-pair of a panel is four 64-byte vectors and a panel is one contiguous run.
// A k-pair of an input row is one 32-bit broadcast; a 6-row x 64-output tile keeps 24 accumulators
// in registers.
//
// Each output element is one vdpbf16ps chain over K in pair order, started at zero (K blocks spill
// the chain to float32 memory and reload it unchanged), then the bias add and one rounding to bf16.
// Its bits therefore depend only on its own input row and weight row: never on the row count, on
// which tile or chunk the row lands in, or on the thread count (tests/test_cpu_kernels.py), so the
// default and the batch-invariant forward share it, as they share linear_amx.
#define DPBF16 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16")))

bool cpu_has_avx512_bf16() {
    __builtin_cpu_init();
    return cpu_has_avx512() && __builtin_cpu_supports("avx512bf16");
}

constexpr int DP_ROWS = 6;            // rows per register tile: 6 x 4 accumulators + 4 weights + 1 input
constexpr int64_t DP_ROW_CHUNK = 96;  // rows per pass over a panel: their K block of x stays in L2
constexpr int64_t DP_KC = 256;        // k-pairs per block at many rows: a panel's block (64 KB) stays in L2
// Lines of the panel this many bytes ahead are requested into L1: at one to a few rows a step is a
// weight stream, and the hardware prefetcher alone leaves it short of the memory's rate.
constexpr int64_t DP_PREFETCH_BYTES = 1024;

// K is padded to whole pairs (a zero weight; linear_dpbf16 pads x the same way).
int64_t packed_dpbf16_elems(int64_t N, int64_t K) { return (N + 15) / 16 * 16 * (K + K % 2); }

// `gated` (a fused gate/up weight [gate | up], N = 2I with I a multiple of 32): panel p holds gate rows
// 32p..32p+31 then up rows I+32p..I+32p+31, so linear_dpbf16_silu finds both halves of its 32
// outputs in one panel.
void pack_dpbf16(uintptr_t w, uintptr_t out, int64_t N, int64_t K, bool gated, int threads) {
    const auto* wp = reinterpret_cast<const uint16_t*>(w);
    auto* op = reinterpret_cast<uint16_t*>(out);
    const int64_t np = (N + 15) / 16 * 16, panels = (np + 63) / 64, kp = K + K % 2;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t p = 0; p < panels; ++p) {
        const int64_t n0 = p * 64, width = std::min<int64_t>(64, np - n0);
        uint16_t* panel = op + n0 * kp;
        for (int64_t pair = 0; pair < kp / 2; ++pair)
            for (int64_t j = 0; j < width; ++j)
                for (int64_t e = 0; e < 2; ++e) {
                    const int64_t n = gated ? (j < 32 ? n0 / 2 + j : N / 2 + n0 / 2 + j - 32) : n0 + j;
                    const int64_t k = 2 * pair + e;
                    panel[(pair * width + j) * 2 + e] = n < N && k < K ? wp[n * K + k] : 0;
                }
    }
}

// R rows (x rows xs apart) x V vectors of 16 outputs, k-pairs p0..p1 of the panel, sums in c (row
// stride 64), started at zero when `first`. `stream`: the first tile over this block of the panel,
// which reads it from memory (the later tiles find it in cache).
template <int R, int V>
DPBF16 void dp_tile(const uint16_t* x, int64_t xs, const uint16_t* panel, int64_t p0, int64_t p1, float* c,
                    bool first, bool stream) {
    __m512 acc[R][V];
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
        for (int v = 0; v < V; ++v) acc[r][v] = first ? _mm512_setzero_ps() : _mm512_load_ps(c + r * 64 + v * 16);
    for (int64_t p = p0; p < p1; ++p) {
        const uint16_t* wk = panel + p * V * 32;
        if (stream) {
#pragma GCC unroll 4
            for (int v = 0; v < V; ++v)
                _mm_prefetch(reinterpret_cast<const char*>(wk) + DP_PREFETCH_BYTES + v * 64, _MM_HINT_T0);
        }
        __m512bh w[V];
#pragma GCC unroll 4
        for (int v = 0; v < V; ++v) w[v] = (__m512bh)_mm512_loadu_si512(wk + v * 32);
#pragma GCC unroll 6
        for (int r = 0; r < R; ++r) {
            int32_t pair;
            std::memcpy(&pair, x + r * xs + 2 * p, 4);
            const __m512bh b = (__m512bh)_mm512_set1_epi32(pair);
#pragma GCC unroll 4
            for (int v = 0; v < V; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], b, w[v]);
        }
    }
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
        for (int v = 0; v < V; ++v) _mm512_store_ps(c + r * 64 + v * 16, acc[r][v]);
}

using DpTile = void (*)(const uint16_t*, int64_t, const uint16_t*, int64_t, int64_t, float*, bool, bool);

template <int V>
constexpr DpTile dp_tile_of(int rows) {
    switch (rows) {
        case 1: return dp_tile<1, V>;
        case 2: return dp_tile<2, V>;
        case 3: return dp_tile<3, V>;
        case 4: return dp_tile<4, V>;
        case 5: return dp_tile<5, V>;
        default: return dp_tile<6, V>;
    }
}

DpTile dp_tile_for(int rows, int vectors) {
    switch (vectors) {
        case 1: return dp_tile_of<1>(rows);
        case 2: return dp_tile_of<2>(rows);
        case 3: return dp_tile_of<3>(rows);
        default: return dp_tile_of<4>(rows);
    }
}

// The packed GEMM over rows x panels; `finish(sums, c0, c1, n0, vectors)` takes each (row chunk,
// panel)'s float32 sums (row stride 64) and writes the output.
template <typename Finish>
DPBF16 void dp_linear(const uint16_t* xp, const uint16_t* wp, int64_t M, int64_t N, int64_t K, int threads,
                      const Finish& finish) {
    const int64_t np = (N + 15) / 16 * 16, panels = (np + 63) / 64, kp = K + K % 2, pairs = kp / 2;
    std::vector<uint16_t> padded;  // x with an odd K padded to whole pairs (zeros, as the weights)
    if (kp != K) {
        padded.assign(static_cast<size_t>(M * kp), 0);
        for (int64_t m = 0; m < M; ++m) std::memcpy(padded.data() + m * kp, xp + m * K, K * 2);
        xp = padded.data();
    }
    const int64_t chunks = (M + DP_ROW_CHUNK - 1) / DP_ROW_CHUNK;
    // One spill of a chain per K block costs nothing at many rows; at a tile or less there is no reuse
    // of the panel to keep in cache, so the chain runs over the whole of K.
    const int64_t kc = M <= DP_ROWS ? pairs : DP_KC;
    // Static over (panel, chunk), panel-major: each thread streams one contiguous slice of the
    // weights once, a panel's K block staying in L2 while every chunk of rows passes over it.
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t item = 0; item < chunks * panels; ++item) {
        alignas(64) float sums[DP_ROW_CHUNK * 64];
        const int64_t c0 = item % chunks * DP_ROW_CHUNK, c1 = std::min(M, c0 + DP_ROW_CHUNK);
        const int64_t n0 = item / chunks * 64, width = std::min<int64_t>(64, np - n0);
        const int vectors = static_cast<int>(width / 16);
        const uint16_t* panel = wp + n0 * kp;
        for (int64_t k0 = 0; k0 < pairs; k0 += kc)
            for (int64_t r0 = c0; r0 < c1; r0 += DP_ROWS) {
                const int rows = static_cast<int>(std::min<int64_t>(DP_ROWS, c1 - r0));
                dp_tile_for(rows, vectors)(xp + r0 * kp, kp, panel, k0, std::min(pairs, k0 + kc),
                                           sums + (r0 - c0) * 64, k0 == 0, r0 == c0);
            }
        finish(sums, c0, c1, n0, vectors);
    }
}

DPBF16 void linear_dpbf16(uintptr_t x, uintptr_t packed, uintptr_t bias, uintptr_t y, int64_t M, int64_t N, int64_t K,
                          int threads) {
    const auto* bp = reinterpret_cast<const uint16_t*>(bias);
    auto* yp = reinterpret_cast<uint16_t*>(y);
    dp_linear(reinterpret_cast<const uint16_t*>(x), reinterpret_cast<const uint16_t*>(packed), M, N, K, threads,
              [&](const float* sums, int64_t c0, int64_t c1, int64_t n0, int vectors) DPBF16 {
                  for (int v = 0; v < vectors; ++v) {
                      const int64_t n = n0 + v * 16;
                      const __mmask16 lanes = first_lanes(N - n);
                      const __m512 b = bp ? load_bf16x16(bp + n, lanes) : _mm512_setzero_ps();
                      for (int64_t r = c0; r < c1; ++r) {
                          __m512 s = _mm512_load_ps(sums + (r - c0) * 64 + v * 16);
                          if (bp) s = _mm512_add_ps(s, b);
                          _mm256_mask_storeu_epi16(yp + r * N + n, lanes, round_to_bf16(s));
                      }
                  }
              });
}

// ---- the machine's streaming read rate ----------------------------------------------------------
//
// What a weight stream can reach here: `bytes` of a buffer read once, split in contiguous slices
// over the threads, each summed 64 bytes at a time (the sum is returned so the loads cannot be
// dropped). minisgl bench divides a decode step's weight bytes by its time against this figure.
AVX512 double stream_read(uintptr_t buf, int64_t bytes, int threads) {
    const auto* p = reinterpret_cast<const float*>(buf);
    const int64_t n = bytes / 64;
    double total = 0.0;
#pragma omp parallel for num_threads(threads) schedule(static) reduction(+ : total)
    for (int64_t i = 0; i < n; i += 4) {
        __m512 a = _mm512_loadu_ps(p + i * 16);
        for (int64_t j = 1; j < 4 && i + j < n; ++j) a = _mm512_add_ps(a, _mm512_loadu_ps(p + (i + j) * 16));
        total += _mm512_reduce_add_ps(a);
    }
    return total;
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
        if ((k & 63) == 0) prefetch_next_tile(w, K, k);
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

// The same attention on AVX-512 (head_dim a multiple of 16, up to 256) for a block of up to
// ATTN_BLOCK query rows that share one block table (rows of one prefill chunk; a decode row is a
// block of one): each key's K and V rows are loaded and converted once per block and KV head and
// used by every query row and head of the group.
//
// Every query's arithmetic is the same whatever block it is in: its scores are one dot product per
// key (16-wide FMAs over head_dim, then a fixed reduction; or the tile unit's, on every block of the
// machine), its softmax sums by absolute key position mod 16 (so which lane a key falls in depends on
// the key alone), and its output sums the keys in key order. A row's bits thus depend only on its
// query, its position and the cached keys: not on the other rows of the call, the block sizes, the
// chunking, whether it is a decode or a prefill row or which of attend_vectors / attend_lanes ran.
// That is what lets the batch-invariant forward use it for every row.
constexpr int64_t ATTN_BLOCK = 16;

template <typename T>
AVX512 inline __m512 load16(const T* p);
template <>
AVX512 inline __m512 load16<float>(const float* p) {
    return _mm512_loadu_ps(p);
}
template <>
AVX512 inline __m512 load16<uint16_t>(const uint16_t* p) {
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

template <typename T>
AVX512 inline __m512 load16m(const T* p, __mmask16 m);
template <>
AVX512 inline __m512 load16m<float>(const float* p, __mmask16 m) {
    return _mm512_maskz_loadu_ps(m, p);
}
template <>
AVX512 inline __m512 load16m<uint16_t>(const uint16_t* p, __mmask16 m) {
    return load_bf16x16(p, m);
}

template <typename T>
AVX512 inline void store16m(T* p, __m512 v, __mmask16 m);
template <>
AVX512 inline void store16m<float>(float* p, __m512 v, __mmask16 m) {
    _mm512_mask_storeu_ps(p, m, v);
}
template <>
AVX512 inline void store16m<uint16_t>(uint16_t* p, __m512 v, __mmask16 m) {
    _mm256_mask_storeu_epi16(p, m, round_to_bf16(v));
}

template <typename T>
AVX512 inline __m512 round16(__m512 v) {  // to the dtype and back, as storing and loading it
    if constexpr (std::is_same_v<T, float>) return v;
    else return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(round_to_bf16(v)), 16));
}


// exp(x): 2^(x log2 e) split into 2^n (scalef) times 2^f, |f| <= 1/2, from its degree-7 Taylor
// polynomial (relative error below 1e-8 before rounding). Softmax calls it on scores minus their
// maximum (x <= 0), SiLU on any x: past 89 it is inf, below -87 it stays at exp(-87).
AVX512 inline __m512 exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(89.0f));
    const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.693147180559945309f));
    static constexpr float c[8] = {1.0f,         1.0f,          0.5f,          1.0f / 6.0f,
                                   1.0f / 24.0f, 1.0f / 120.0f, 1.0f / 720.0f, 1.0f / 5040.0f};
    __m512 p = _mm512_set1_ps(c[7]);
    for (int i = 6; i >= 0; --i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c[i]));
    return _mm512_scalef_ps(p, n);
}

// The fixed reduction order of a score's and a softmax sum's 16 lanes: lane j with lane j+8, then
// j with j+4, j with j+2, j with j+1. hsum16 applies it across one vector's lanes; vsum16 applies the
// same tree across 16 vectors, lane by lane, so lane l of vsum16(p) has the bits of hsum16 of the
// vector whose lanes are p[0..15][l].
AVX512 inline float hsum16(__m512 v) {
    const __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
    const __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    const __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));
    return _mm_cvtss_f32(_mm_add_ss(c, _mm_movehdup_ps(c)));
}

AVX512 inline __m512 vsum16(__m512* p) {
    for (int w = 8; w >= 1; w /= 2)
        for (int j = 0; j < w; ++j) p[j] = _mm512_add_ps(p[j], p[j + w]);
    return p[0];
}

struct AttnScratch {  // per thread, reused across its work items
    std::vector<float> q, scores, acc, kf, vf;
    std::vector<uint16_t> stage, pb;
    std::vector<uint32_t> vpair, ppair;
    std::vector<int64_t> offsets;
};

// Which keys a block reads, and where they lie: first[r] the first key row r sees (its window),
// keys lo..hi the union of the rows' ranges, w.offsets[key - lo] each key's slot in the pool.
struct BlockKeys {
    int64_t first[ATTN_BLOCK], lo, hi;
};

inline BlockKeys block_keys(const int64_t* table, const int64_t* pos, int64_t rows, const AttnShape& s,
                            AttnScratch& w) {
    BlockKeys b{{}, INT64_MAX, 0};
    for (int64_t r = 0; r < rows; ++r) {
        b.first[r] = s.window > 0 ? std::max<int64_t>(0, pos[r] - s.window + 1) : 0;
        b.lo = std::min(b.lo, b.first[r]);
        b.hi = std::max(b.hi, pos[r]);
    }
    const int64_t row = s.kv_heads * s.head_dim;
    w.offsets.resize(static_cast<size_t>(b.hi - b.lo + 1));
    for (int64_t key = b.lo; key <= b.hi;) {  // pool offsets block by block: no division per key
        const int64_t at = table[key / s.block_size] * s.block_size * row;
        for (int64_t t = key % s.block_size; t < s.block_size && key <= b.hi; ++t, ++key)
            w.offsets[key - b.lo] = at + t * row;
    }
    return b;
}

// ---- the V sum on vdpbf16ps (the avx512bf16 family's attention) ----
//
// With the dp scorer the probabilities are rounded to bf16 and each output element is one vdpbf16ps
// chain over key pairs (2t, 2t + 1), pairs aligned to absolute key positions and taken in order:
// acc += p(2t) v(2t) + p(2t+1) v(2t+1), a key outside the row's range with p = 0. Half the
// instructions of the float32 FMA sum, and the same bits whether the lanes are a decode row's
// dims (dp_value_sum) or 16 query vectors of a prefill block (attend_lanes).

// V rows of the block's keys as (key 2t, key 2t+1) pairs per dim, [pair - lo / 2][dim]; keys outside
// [lo, hi] zero (so the pair partner of an end key reads no unwritten slot).
DPBF16 void stage_value_pairs(const uint16_t* vpool, const BlockKeys& b, int64_t kvh, const AttnShape& s,
                              AttnScratch& w) {
    const int64_t d = s.head_dim, p0 = b.lo / 2, pairs = b.hi / 2 - p0 + 1;
    w.vpair.resize(static_cast<size_t>(pairs * d));
    for (int64_t t = 0; t < pairs; ++t) {
        const int64_t ke = 2 * (p0 + t), ko = ke + 1;
        const bool e_in = ke >= b.lo, o_in = ko <= b.hi;
        const uint16_t* ve = e_in ? vpool + w.offsets[ke - b.lo] + kvh * d : nullptr;
        const uint16_t* vo = o_in ? vpool + w.offsets[ko - b.lo] + kvh * d : nullptr;
        for (int64_t c = 0; c < d; c += 16) {
            const __m512i e = e_in ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(ve + c)))
                                   : _mm512_setzero_si512();
            const __m512i o = o_in ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(vo + c)))
                                   : _mm512_setzero_si512();
            _mm512_storeu_si512(w.vpair.data() + t * d + c, _mm512_or_si512(e, _mm512_slli_epi32(o, 16)));
        }
    }
}

// 16 float32 as bf16 in the low halves of 16 uint32 (vcvtneps2bf16: both V sums round the same way).
DPBF16 inline __m512i bf16_lanes(__m512 x) { return _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(x)); }

// The decode blocks' V sum (softmax_and_sum's, with the dp scorer): lanes = 16 dims; each vector's
// probabilities rounded to bf16 over the span (zero outside its keys), each pair broadcast.
DPBF16 void dp_value_sum(const uint16_t* vpool, int64_t rows, const int64_t* pos, int64_t kvh, uint16_t* out,
                         const AttnShape& s, const BlockKeys& b, AttnScratch& w) {
    const int64_t d = s.head_dim, g = s.heads / s.kv_heads, chunks = d / 16;
    const int64_t base = b.lo / 16 * 16, span = (b.hi / 16 + 1) * 16 - base, p0 = b.lo / 2;
    stage_value_pairs(vpool, b, kvh, s, w);
    w.pb.assign(static_cast<size_t>(rows * g * span), 0);
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t h = 0; h < g; ++h) {
            const float* sh = w.scores.data() + (r * g + h) * span;
            uint16_t* ph = w.pb.data() + (r * g + h) * span;
            for (int64_t t = b.first[r] / 16 * 16; t <= pos[r]; t += 16) {
                const int64_t a = std::max<int64_t>(b.first[r] - t, 0), e = std::min<int64_t>(pos[r] - t, 15);
                const auto lanes = static_cast<__mmask16>(((1u << (e + 1)) - 1) & ~((1u << a) - 1));
                const __m512 x = _mm512_maskz_loadu_ps(lanes, sh + t - base);
                _mm256_storeu_si256(reinterpret_cast<__m256i*>(ph + t - base), (__m256i)_mm512_cvtneps_pbh(x));
            }
        }
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t h0 = 0; h0 < g; h0 += 6) {
            const int64_t nv = std::min<int64_t>(6, g - h0);
            const uint16_t* p = w.pb.data() + (r * g + h0) * span - base;  // p[v * span + key]
            uint16_t* o = out + r * s.heads * d + (kvh * g + h0) * d;
            for (int64_t c0 = 0; c0 < chunks; c0 += 4) {
                const int64_t nc = std::min<int64_t>(4, chunks - c0);
                __m512 acc[6][4];
                for (auto& a : acc)
                    for (auto& x : a) x = _mm512_setzero_ps();
                for (int64_t t = b.first[r] / 2; t <= pos[r] / 2; ++t) {
                    const uint32_t* vr = w.vpair.data() + (t - p0) * d + c0 * 16;
                    __m512bh vv[4];
                    for (int c = 0; c < 4; ++c)
                        if (c < nc) vv[c] = (__m512bh)_mm512_loadu_si512(vr + c * 16);
                    for (int v = 0; v < 6; ++v) {
                        if (v >= nv) break;
                        int32_t pair;
                        std::memcpy(&pair, p + v * span + 2 * t, 4);
                        const __m512bh pv = (__m512bh)_mm512_set1_epi32(pair);
                        for (int c = 0; c < 4; ++c)
                            if (c < nc) acc[v][c] = _mm512_dpbf16_ps(acc[v][c], vv[c], pv);
                    }
                }
                for (int64_t v = 0; v < nv; ++v)
                    for (int64_t c = 0; c < nc; ++c) store16m(o + v * d + (c0 + c) * 16, acc[v][c], 0xffff);
            }
        }
}

// A prefill block's V sum for one lane group (attend_lanes', with the dp scorer): sc[key * 16 + lane]
// the normalized probabilities of keys lo..hi, out_tile [chunk][dim][lane] the sums.
DPBF16 void dp_lanes_value_sum(const float* sc, const BlockKeys& b, const AttnShape& s, AttnScratch& w,
                               float* out_tile) {
    const int64_t d = s.head_dim, p0 = b.lo / 2, pairs = b.hi / 2 - p0 + 1;
    w.ppair.resize(static_cast<size_t>(pairs * 16));
    for (int64_t t = 0; t < pairs; ++t) {
        const int64_t ke = 2 * (p0 + t), ko = ke + 1;
        const __m512 e = ke >= b.lo ? _mm512_loadu_ps(sc + ke * 16) : _mm512_setzero_ps();
        const __m512 o = ko <= b.hi ? _mm512_loadu_ps(sc + ko * 16) : _mm512_setzero_ps();
        _mm512_storeu_si512(w.ppair.data() + t * 16, _mm512_or_si512(bf16_lanes(e), _mm512_slli_epi32(bf16_lanes(o), 16)));
    }
    for (int64_t c = 0; c < d / 16; ++c) {
        __m512 acc[16];
        for (auto& a : acc) a = _mm512_setzero_ps();
        for (int64_t t = 0; t < pairs; ++t) {
            const __m512bh pp = (__m512bh)_mm512_loadu_si512(w.ppair.data() + t * 16);
            const uint32_t* vr = w.vpair.data() + t * d + c * 16;
#pragma GCC unroll 16
            for (int i = 0; i < 16; ++i) {
                const __m512bh vb = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(vr[i]));
                acc[i] = _mm512_dpbf16_ps(acc[i], vb, pp);
            }
        }
        for (int i = 0; i < 16; ++i) _mm512_storeu_ps(out_tile + (c * 16 + i) * 16, acc[i]);
    }
}

// The softmax and the sum over V of rows x g query vectors whose scores lie in w.scores, [vector][span]
// from key `base` (attend_vectors', or the tile unit's for few vectors): the softmax one vector at a
// time, 16 keys per lane tile; the V sum in registers, up to 6 vectors of a row at a time.
template <typename T>
AVX512 void softmax_and_sum(const T* vpool, int64_t rows, const int64_t* pos, int64_t kvh, T* out, const AttnShape& s,
                            const BlockKeys& b, AttnScratch& w, bool dp = false) {
    const int64_t d = s.head_dim, g = s.heads / s.kv_heads, chunks = d / 16;
    const int64_t lo = b.lo, hi = b.hi, base = lo / 16 * 16, span = (hi / 16 + 1) * 16 - base;
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t t0 = b.first[r] / 16 * 16, t1 = pos[r] / 16 * 16;
        const auto lanes = [&](int64_t t) {  // the tile's keys in [first, pos]
            const int64_t a = std::max<int64_t>(b.first[r] - t, 0), e = std::min<int64_t>(pos[r] - t, 15);
            return static_cast<__mmask16>(((1u << (e + 1)) - 1) & ~((1u << a) - 1));
        };
        for (int64_t h = 0; h < g; ++h) {
            float* sh = w.scores.data() + (r * g + h) * span - base;
            __m512 mx = _mm512_set1_ps(-INFINITY);
            for (int64_t t = t0; t <= t1; t += 16) mx = _mm512_mask_max_ps(mx, lanes(t), mx, _mm512_loadu_ps(sh + t));
            const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
            __m512 sum = _mm512_setzero_ps();
            for (int64_t t = t0; t <= t1; t += 16) {
                const __m512 e = _mm512_maskz_mov_ps(lanes(t), exp16(_mm512_sub_ps(_mm512_loadu_ps(sh + t), top)));
                _mm512_storeu_ps(sh + t, e);
                sum = _mm512_add_ps(sum, e);  // lane j: keys j mod 16, in key order
            }
            const __m512 inv = _mm512_set1_ps(1.0f / hsum16(sum));
            for (int64_t t = t0; t <= t1; t += 16) _mm512_storeu_ps(sh + t, _mm512_mul_ps(_mm512_loadu_ps(sh + t), inv));
        }
    }
    if constexpr (std::is_same_v<T, uint16_t>)
        if (dp) return dp_value_sum(vpool, rows, pos, kvh, out, s, b, w);
    // Up to 64 dims of up to 6 vectors at a time in 24 accumulators, keys in order (each output
    // element one FMA per key, as attend_lanes'), each V chunk converted once for the group: the
    // accumulators in memory had made this loop half of decode attention's time (measured).
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t h0 = 0; h0 < g; h0 += 6) {
            const int64_t nv = std::min<int64_t>(6, g - h0);
            const float* p = w.scores.data() + (r * g + h0) * span - base;  // p[v * span + key]
            T* o = out + r * s.heads * d + (kvh * g + h0) * d;
            for (int64_t c0 = 0; c0 < chunks; c0 += 4) {
                const int64_t nc = std::min<int64_t>(4, chunks - c0);
                __m512 acc[6][4];
                for (auto& a : acc)
                    for (auto& x : a) x = _mm512_setzero_ps();
                for (int64_t key = b.first[r]; key <= pos[r]; ++key) {
                    const T* vp = vpool + w.offsets[key - lo] + kvh * d + c0 * 16;
                    __m512 vv[4];
                    for (int c = 0; c < 4; ++c)
                        if (c < nc) vv[c] = load16(vp + c * 16);
                    for (int v = 0; v < 6; ++v) {
                        if (v >= nv) break;
                        const __m512 pv = _mm512_set1_ps(p[v * span + key]);
                        for (int c = 0; c < 4; ++c)
                            if (c < nc) acc[v][c] = _mm512_fmadd_ps(pv, vv[c], acc[v][c]);
                    }
                }
                for (int64_t v = 0; v < nv; ++v)
                    for (int64_t c = 0; c < nc; ++c) store16m(o + v * d + (c0 + c) * 16, acc[v][c], 0xffff);
            }
        }
}

// One query vector at a time (lanes = 16 dims of head_dim): for blocks of few query vectors (decode).
template <typename T>
AVX512 void attend_vectors(const T* q, int64_t q_stride, int64_t rows, const T* kpool, const T* vpool,
                           const int64_t* pos, int64_t kvh, T* out, const AttnShape& s, const BlockKeys& b,
                           AttnScratch& w) {
    const int64_t d = s.head_dim, g = s.heads / s.kv_heads, chunks = d / 16;
    const int64_t lo = b.lo, hi = b.hi, base = lo / 16 * 16, span = (hi / 16 + 1) * 16 - base;  // 16-key tiles
    w.q.resize(static_cast<size_t>(rows * g * d));
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t h = 0; h < g; ++h)
            for (int64_t i = 0; i < d; ++i) w.q[(r * g + h) * d + i] = load(q + r * q_stride, (kvh * g + h) * d + i);
    w.scores.assign(static_cast<size_t>(rows * g * span), 0.0f);
    __m512 c16[16];
    for (int64_t key = lo; key <= hi; ++key) {
        const T* kp = kpool + w.offsets[key - lo] + kvh * d;
        for (int64_t c = 0; c < chunks; ++c) c16[c] = load16(kp + c * 16);
        for (int64_t r = 0; r < rows; ++r) {
            if (key < b.first[r] || key > pos[r]) continue;
            for (int64_t h = 0; h < g; ++h) {
                const float* qh = w.q.data() + (r * g + h) * d;
                __m512 dot = _mm512_mul_ps(_mm512_loadu_ps(qh), c16[0]);
                for (int64_t c = 1; c < chunks; ++c) dot = _mm512_fmadd_ps(_mm512_loadu_ps(qh + c * 16), c16[c], dot);
                float sc = hsum16(dot) * s.scale;
                if (s.softcap > 0.0f) sc = s.softcap * std::tanh(sc / s.softcap);
                w.scores[(r * g + h) * span + key - base] = sc;
            }
        }
    }
    softmax_and_sum<T>(vpool, rows, pos, kvh, out, s, b, w);
}

// Scores of 16 query vectors (lanes; qt holds them transposed, [head_dim][16]) against KEYS keys
// (float32 rows kf[k]): lane l of score k is attend_vectors' dot product of query l and key k, the
// same multiplies and adds in the same order (lane j of each 16-dim chunk accumulated over chunks,
// then the hsum16 tree, here vsum16).
AVX512 inline __m512 lane_dot(const float* qt, const float* kf, int64_t chunks, int j) {
    __m512 a = _mm512_mul_ps(_mm512_loadu_ps(qt + j * 16), _mm512_set1_ps(kf[j]));  // lane j of each chunk
    for (int64_t c = 1; c < chunks; ++c)
        a = _mm512_fmadd_ps(_mm512_loadu_ps(qt + (c * 16 + j) * 16), _mm512_set1_ps(kf[c * 16 + j]), a);
    return a;
}

template <int KEYS>
AVX512 inline void lane_scores(const float* qt, const float* const* kf, int64_t chunks, __m512* out) {
    __m512 p[KEYS][16];
    for (int j = 0; j < 8; ++j)  // vsum16's first level as the partials come: 8 live vectors per key
        for (int k = 0; k < KEYS; ++k) p[k][j] = _mm512_add_ps(lane_dot(qt, kf[k], chunks, j), lane_dot(qt, kf[k], chunks, j + 8));
    for (int k = 0; k < KEYS; ++k) {
        for (int w = 4; w >= 1; w /= 2)
            for (int j = 0; j < w; ++j) p[k][j] = _mm512_add_ps(p[k][j], p[k][j + w]);
        out[k] = p[k][0];
    }
}

AVX512 inline __mmask16 sees(__m512i first, __m512i last, int64_t key) {  // the lanes whose range holds key
    const __m512i k = _mm512_set1_epi32(static_cast<int32_t>(key));
    return static_cast<__mmask16>(_mm512_cmple_epi32_mask(first, k) & _mm512_cmple_epi32_mask(k, last));
}

// Blocks of at least this many query vectors (rows x heads of the group) take attend_lanes.
constexpr int64_t LANES_FROM = 8;

// Scores on the tile unit (bf16, head_dim a multiple of 32, AMX): tmm0 the scores of 16 keys (rows)
// x 16 query vectors, tmm1 the 16 keys' 32 dims of one k-step, tmm2 that k-step's query pairs.
AMX void configure_score_tiles() {
    TileConfig c;
    for (int t = 0; t < 3; ++t) {
        c.colsb[t] = 64;
        c.rows[t] = 16;
    }
    asm volatile("" : : "r"(&c) : "memory");  // the field stores must reach memory (configure_tiles)
    _tile_loadconfig(&c);
}

AMX void release_tiles() { _tile_release(); }

// The scores of 16 query vectors against keys base..hi, 16-key tiles aligned to absolute positions:
// sc[key - base][lane]. qb holds the query vectors as the tile unit's B operand: k-step by k-step,
// 16 pairs x 16 lanes of (dim 2i, dim 2i+1). Each score is the unit's fixed-order dot product of one
// key row and one query column, whatever the other rows and columns hold (as the packed linear's).
// A tile whose keys lie in one cache block (block_size a multiple of 16) is read from the pool in
// place; otherwise its keys in [lo, hi] are staged, the rest zero.
AMX void amx_scores(const uint16_t* kpool, const int64_t* table, const AttnShape& s, int64_t kvh, int64_t lo,
                    int64_t hi, const uint32_t* qb, float* sc, uint16_t* stage) {
    const int64_t d = s.head_dim, row = s.kv_heads * d, bs = s.block_size, base = lo / 16 * 16;
    for (int64_t t = base; t <= hi; t += 16) {
        const uint16_t* a = stage;
        int64_t stride = d * 2;
        if (bs % 16 == 0) {
            a = kpool + (table[t / bs] * bs + t % bs) * row + kvh * d;
            stride = row * 2;
        } else {
            for (int64_t j = 0; j < 16; ++j) {
                const int64_t key = t + j;
                if (key < lo || key > hi)
                    std::memset(stage + j * d, 0, d * 2);
                else
                    std::memcpy(stage + j * d, kpool + (table[key / bs] * bs + key % bs) * row + kvh * d, d * 2);
            }
        }
        _tile_zero(0);
        for (int64_t ks = 0; ks < d / 32; ++ks) {
            _tile_loadd(1, a + ks * 32, stride);
            _tile_loadd(2, qb + ks * 256, 64);
            _tile_dpbf16ps(0, 1, 2);
        }
        _tile_stored(0, sc + (t - base) * 16, 64);
    }
}

// Which unit scores bf16 query vectors against keys (paged_attention's `scorer`): float32 FMAs over
// 16-dim chunks and a fixed reduction (attend_vectors, lane_scores), the tile unit (amx_scores), or
// vdpbf16ps (dp_scores). A row's bits depend on which one ran, so the choice is the machine's kernel
// family and never the rows'.
enum Scorer : int { SCORE_FMA = 0, SCORE_AMX = 1, SCORE_DP = 2 };

// amx_scores' result from vdpbf16ps (AVX512-BF16, no tile unit): lanes = the 16 query vectors of qb,
// each key's (dim 2i, dim 2i+1) pair broadcast against the lanes' pairs, one chain over the pairs
// in order per score (so a score's bits depend on its query and key alone, as the tile unit's).
// Sixteen keys at a time keep sixteen chains in flight (eight left the unit idle: 1.34 -> 1.17 ms per
// layer for a 256-row chunk at 256 cached, README "Speed"); keys of the 16-key tiles outside [lo, hi] score
// zero, as amx_scores' staged zeros. Read in place, whatever the block size.
DPBF16 void dp_scores(const uint16_t* kpool, const int64_t* table, const AttnShape& s, int64_t kvh, int64_t lo,
                      int64_t hi, const uint32_t* qb, float* sc) {
    const int64_t d = s.head_dim, row = s.kv_heads * d, bs = s.block_size, base = lo / 16 * 16;
    const int64_t end = (hi / 16 + 1) * 16;
    for (int64_t key = base; key < lo; ++key) _mm512_storeu_ps(sc + (key - base) * 16, _mm512_setzero_ps());
    for (int64_t key = hi + 1; key < end; ++key) _mm512_storeu_ps(sc + (key - base) * 16, _mm512_setzero_ps());
    constexpr int KEYS = 16;
    for (int64_t k0 = lo; k0 <= hi; k0 += KEYS) {
        const int nk = static_cast<int>(std::min<int64_t>(KEYS, hi - k0 + 1));
        const uint16_t* kr[KEYS];
        for (int j = 0; j < KEYS; ++j) {
            const int64_t key = k0 + std::min(j, nk - 1);  // past hi: a repeat of the last key, not stored
            kr[j] = kpool + (table[key / bs] * bs + key % bs) * row + kvh * d;
        }
        __m512 acc[KEYS];
        for (auto& a : acc) a = _mm512_setzero_ps();
        for (int64_t i = 0; i < d / 2; ++i) {
            const __m512bh qv = (__m512bh)_mm512_loadu_si512(qb + i * 16);
#pragma GCC unroll 16
            for (int j = 0; j < KEYS; ++j) {
                int32_t pair;
                std::memcpy(&pair, kr[j] + 2 * i, 4);
                acc[j] = _mm512_dpbf16_ps(acc[j], (__m512bh)_mm512_set1_epi32(pair), qv);
            }
        }
        for (int j = 0; j < nk; ++j) _mm512_storeu_ps(sc + (k0 + j - base) * 16, acc[j]);
    }
}

// The query vectors v0..v0+n-1 of a block (lane l: row (v0 + l) / g, head (v0 + l) % g of the
// group) as the tile unit's B operand: k-step by k-step, 16 pairs x 16 lanes of (dim 2i, dim 2i+1),
// the raw bf16 bits; lanes past n are zero.
AVX512 inline void pack_query_pairs(const uint16_t* q, int64_t q_stride, int64_t v0, int64_t n, int64_t kvh,
                                    const AttnShape& s, uint32_t* qb) {
    const int64_t d = s.head_dim, g = s.heads / s.kv_heads;
    for (int64_t l = 0; l < 16; ++l) {
        if (l >= n) {
            for (int64_t i = 0; i < d / 2; ++i) qb[i * 16 + l] = 0u;
            continue;
        }
        const uint16_t* qv = q + (v0 + l) / g * q_stride + (kvh * g + (v0 + l) % g) * d;
        for (int64_t i = 0; i < d / 2; ++i)
            qb[i * 16 + l] = static_cast<uint32_t>(qv[2 * i]) | static_cast<uint32_t>(qv[2 * i + 1]) << 16;
    }
}

// Few query vectors (decode rows) on the tile unit or vdpbf16ps: their scores from amx_scores or
// dp_scores, then attend_vectors' softmax and V sum on them, one vector at a time ([vector][span]).
AVX512 void attend_vectors_bf16(const uint16_t* q, int64_t q_stride, int64_t rows, const uint16_t* kpool,
                                const uint16_t* vpool, const int64_t* table, const int64_t* pos, int64_t kvh,
                                uint16_t* out, const AttnShape& s, const BlockKeys& b, int scorer, AttnScratch& w) {
    const int64_t g = s.heads / s.kv_heads, n = rows * g;
    const int64_t base = b.lo / 16 * 16, span = (b.hi / 16 + 1) * 16 - base;
    w.q.resize(static_cast<size_t>(s.head_dim * 16));
    w.kf.resize(static_cast<size_t>(span * 16));
    w.stage.resize(static_cast<size_t>(16 * s.head_dim));
    auto* qb = reinterpret_cast<uint32_t*>(w.q.data());
    pack_query_pairs(q, q_stride, 0, n, kvh, s, qb);
    if (scorer == SCORE_AMX)
        amx_scores(kpool, table, s, kvh, b.lo, b.hi, qb, w.kf.data(), w.stage.data());  // kf[key - base][lane]
    else
        dp_scores(kpool, table, s, kvh, b.lo, b.hi, qb, w.kf.data());
    w.scores.assign(static_cast<size_t>(n * span), 0.0f);
    for (int64_t l = 0; l < n; ++l)
        for (int64_t key = b.first[l / g]; key <= pos[l / g]; ++key) {
            float v = w.kf[(key - base) * 16 + l] * s.scale;
            if (s.softcap > 0.0f) v = s.softcap * std::tanh(v / s.softcap);
            w.scores[l * span + key - base] = v;
        }
    softmax_and_sum<uint16_t>(vpool, rows, pos, kvh, out, s, b, w, scorer == SCORE_DP);
}

// Many query vectors (a prefill block): lanes = 16 query vectors (row, head of the group), keys one
// at a time. Each score, softmax sum and output element is computed by the same operations in the
// same order as attend_vectors (keys outside a lane's range add exact zeros, which leaves every sum's
// bits as they are, but for the sign of an exact-zero output), so a row's bits do not depend on which
// of the two its block took; this one shares every K/V load and conversion among 16 query vectors
// and needs no horizontal reduction. With the tile unit or vdpbf16ps (`scorer`) the scores come from
// amx_scores or dp_scores, as attend_vectors_bf16's do.
template <typename T>
AVX512 void attend_lanes(const T* q, int64_t q_stride, int64_t rows, const T* kpool, const T* vpool,
                         const int64_t* table, const int64_t* pos, int64_t kvh, T* out, const AttnShape& s,
                         const BlockKeys& b, int scorer, AttnScratch& w) {
    const bool fma = scorer == SCORE_FMA;
    const int64_t d = s.head_dim, g = s.heads / s.kv_heads, chunks = d / 16, vectors = rows * g;
    const int64_t lo = b.lo, keys = b.hi - lo + 1, base = lo / 16 * 16, span = (b.hi / 16 + 1) * 16 - base;
    // float32 copies of K (for lane_scores, with the FMA scorer) and V, shared by every lane; with the
    // dp scorer V as bf16 key pairs instead (stage_value_pairs)
    const bool dp = scorer == SCORE_DP;
    if (fma) w.kf.resize(static_cast<size_t>(keys * d));
    if (!dp) w.vf.resize(static_cast<size_t>(keys * d));
    for (int64_t j = 0; j < keys; ++j)
        for (int64_t c = 0; c < chunks; ++c) {
            if (fma) _mm512_storeu_ps(w.kf.data() + j * d + c * 16, load16(kpool + w.offsets[j] + kvh * d + c * 16));
            if (!dp) _mm512_storeu_ps(w.vf.data() + j * d + c * 16, load16(vpool + w.offsets[j] + kvh * d + c * 16));
        }
    if constexpr (std::is_same_v<T, uint16_t>)
        if (dp) stage_value_pairs(vpool, b, kvh, s, w);
    w.q.resize(static_cast<size_t>(d * 16));
    w.scores.resize(static_cast<size_t>(span * 16));
    if (scorer == SCORE_AMX) w.stage.resize(static_cast<size_t>(16 * d));
    const __m512 one = _mm512_set1_ps(1.0f);
    for (int64_t v0 = 0; v0 < vectors; v0 += 16) {
        const int64_t n = std::min<int64_t>(16, vectors - v0);
        const __mmask16 used = static_cast<__mmask16>((1u << n) - 1);
        alignas(64) int32_t firsts[16], lasts[16];
        for (int64_t l = 0; l < 16; ++l) {
            const int64_t r = (v0 + l) / g;
            firsts[l] = l < n ? static_cast<int32_t>(b.first[r]) : INT32_MAX;  // unused lanes see no key
            lasts[l] = l < n ? static_cast<int32_t>(pos[r]) : -1;
        }
        const __m512i first_v = _mm512_load_si512(firsts), last_v = _mm512_load_si512(lasts);
        float* sc = w.scores.data() - base * 16;  // sc[key * 16 + lane]
        const __m512 scale = _mm512_set1_ps(s.scale);
        if constexpr (std::is_same_v<T, uint16_t>) {
            if (!fma) {
                auto* qb = reinterpret_cast<uint32_t*>(w.q.data());
                pack_query_pairs(q, q_stride, v0, n, kvh, s, qb);
                if (scorer == SCORE_AMX)
                    amx_scores(kpool, table, s, kvh, lo, b.hi, qb, w.scores.data(), w.stage.data());
                else
                    dp_scores(kpool, table, s, kvh, lo, b.hi, qb, w.scores.data());
                for (int64_t key = lo; key <= b.hi; ++key)
                    _mm512_storeu_ps(sc + key * 16, _mm512_mul_ps(_mm512_loadu_ps(sc + key * 16), scale));
            }
        }
        if (fma) {
            for (int64_t l = 0; l < 16; ++l) {  // qt: the lanes' query vectors transposed, [d][16]
                const T* qv = l < n ? q + (v0 + l) / g * q_stride + (kvh * g + (v0 + l) % g) * d : nullptr;
                for (int64_t i = 0; i < d; ++i) w.q[i * 16 + l] = qv ? load(qv, i) : 0.0f;
            }
            int64_t j = 0;
            for (; j + 2 <= keys; j += 2) {
                const float* kk[2] = {w.kf.data() + j * d, w.kf.data() + (j + 1) * d};
                __m512 two[2];
                lane_scores<2>(w.q.data(), kk, chunks, two);
                _mm512_storeu_ps(sc + (lo + j) * 16, _mm512_mul_ps(two[0], scale));
                _mm512_storeu_ps(sc + (lo + j + 1) * 16, _mm512_mul_ps(two[1], scale));
            }
            for (; j < keys; ++j) {
                const float* kk[1] = {w.kf.data() + j * d};
                __m512 one_key[1];
                lane_scores<1>(w.q.data(), kk, chunks, one_key);
                _mm512_storeu_ps(sc + (lo + j) * 16, _mm512_mul_ps(one_key[0], scale));
            }
        }
        if (s.softcap > 0.0f)
            for (int64_t i = lo * 16; i < (b.hi + 1) * 16; ++i) sc[i] = s.softcap * std::tanh(sc[i] / s.softcap);
        __m512 mx = _mm512_set1_ps(-INFINITY);
        for (int64_t key = lo; key <= b.hi; ++key)
            mx = _mm512_mask_max_ps(mx, sees(first_v, last_v, key), mx, _mm512_loadu_ps(sc + key * 16));
        __m512 part[16];
        for (auto& p : part) p = _mm512_setzero_ps();
        for (int64_t key = lo; key <= b.hi; ++key) {
            const __m512 e = _mm512_maskz_mov_ps(sees(first_v, last_v, key), exp16(_mm512_sub_ps(_mm512_loadu_ps(sc + key * 16), mx)));
            _mm512_storeu_ps(sc + key * 16, e);
            part[key & 15] = _mm512_add_ps(part[key & 15], e);  // by absolute key mod 16, as the tiles
        }
        const __m512 inv = _mm512_maskz_div_ps(used, one, vsum16(part));
        for (int64_t key = lo; key <= b.hi; ++key)
            _mm512_storeu_ps(sc + key * 16, _mm512_mul_ps(_mm512_loadu_ps(sc + key * 16), inv));
        if constexpr (std::is_same_v<T, uint16_t>)
            if (dp) {
                w.acc.resize(static_cast<size_t>(d * 16));
                dp_lanes_value_sum(sc, b, s, w, w.acc.data());  // [dim][lane]
                for (int64_t l = 0; l < n; ++l) {
                    const int64_t r = (v0 + l) / g, h = (v0 + l) % g;
                    for (int64_t i = 0; i < d; ++i) store(out + r * s.heads * d, (kvh * g + h) * d + i, w.acc[i * 16 + l]);
                }
                continue;
            }
        alignas(64) float tile[16][16];
        for (int64_t c = 0; c < chunks; ++c) {
            __m512 acc[16];
            for (auto& a : acc) a = _mm512_setzero_ps();
            for (int64_t j = 0; j < keys; ++j) {
                const __m512 p = _mm512_loadu_ps(sc + (lo + j) * 16);
                const float* vr = w.vf.data() + j * d + c * 16;
                for (int i = 0; i < 16; ++i) acc[i] = _mm512_fmadd_ps(p, _mm512_set1_ps(vr[i]), acc[i]);
            }
            for (int i = 0; i < 16; ++i) _mm512_store_ps(tile[i], acc[i]);
            for (int64_t l = 0; l < n; ++l) {
                const int64_t r = (v0 + l) / g, h = (v0 + l) % g;
                for (int i = 0; i < 16; ++i) store(out + r * s.heads * d, (kvh * g + h) * d + c * 16 + i, tile[i][l]);
            }
        }
    }
}

// A decode block's V rows are requested into L2 before its scores are computed, so that their
// memory latencies overlap the scoring instead of stalling the V sum key by key (the rows of one KV
// head are 2-4 lines every kv_heads * head_dim elements, a stride the hardware prefetcher does not
// follow across shuffled blocks): decode attention at batch 8-32 ~20% faster (README "Speed").
template <typename T>
AVX512 inline void prefetch_values(const T* vpool, const BlockKeys& b, int64_t kvh, const AttnShape& s,
                                   const AttnScratch& w) {
    const int64_t bytes = s.head_dim * static_cast<int64_t>(sizeof(T));
    for (int64_t j = 0; j <= b.hi - b.lo; ++j) {
        const char* row = reinterpret_cast<const char*>(vpool + w.offsets[j] + kvh * s.head_dim);
        for (int64_t line = 0; line < bytes; line += 64) _mm_prefetch(row + line, _MM_HINT_T1);
    }
}

template <typename T>
AVX512 void attend_block(const T* q, int64_t q_stride, int64_t rows, const T* kpool, const T* vpool,
                         const int64_t* table, const int64_t* pos, int64_t kvh, T* out, const AttnShape& s,
                         int scorer, AttnScratch& w) {
    const BlockKeys b = block_keys(table, pos, rows, s, w);
    if (rows * (s.heads / s.kv_heads) >= LANES_FROM)
        return attend_lanes<T>(q, q_stride, rows, kpool, vpool, table, pos, kvh, out, s, b, scorer, w);
    prefetch_values(vpool, b, kvh, s, w);
    if constexpr (std::is_same_v<T, uint16_t>)
        if (scorer != SCORE_FMA)
            return attend_vectors_bf16(q, q_stride, rows, kpool, vpool, table, pos, kvh, out, s, b, scorer, w);
    attend_vectors<T>(q, q_stride, rows, kpool, vpool, pos, kvh, out, s, b, w);
}

template <typename T>
void paged_attention_t(uintptr_t q, int64_t q_stride, uintptr_t k, uintptr_t v, uintptr_t tables,
                       const int64_t* row_table, const int64_t* positions, uintptr_t out, int64_t n,
                       const AttnShape& s, int scorer, int threads) {
    const auto* qp = reinterpret_cast<const T*>(q);
    const auto* kp = reinterpret_cast<const T*>(k);
    const auto* vp = reinterpret_cast<const T*>(v);
    const auto* tp = reinterpret_cast<const int64_t*>(tables);
    auto* op = reinterpret_cast<T*>(out);
    const int64_t per_row = s.heads * s.head_dim;
    static const bool avx512 = cpu_has_avx512();
    const bool vector = avx512 && s.head_dim % 16 == 0 && s.head_dim <= 256;
    // The tile unit or vdpbf16ps scores bf16 rows: on a machine that has it, every block of every
    // call (the bits of a row depend on which scorer ran, so the choice depends on the machine's
    // kernel family and the shape only). Otherwise, and for float32, the FMA scorer.
    const bool bf16_scorer = vector && std::is_same_v<T, uint16_t> &&
                             ((scorer == SCORE_AMX && s.head_dim % 32 == 0) || scorer == SCORE_DP);
    const int used = bf16_scorer ? scorer : SCORE_FMA;
    const bool tiles = used == SCORE_AMX;
    // Blocks: runs of up to ATTN_BLOCK consecutive rows on one table (one row each on the scalar path).
    std::vector<int64_t> starts;
    for (int64_t r = 0; r < n; ++r)
        if (!vector || r == 0 || row_table[r] != row_table[r - 1] || r - starts.back() == ATTN_BLOCK) starts.push_back(r);
    const int64_t blocks = static_cast<int64_t>(starts.size());
    starts.push_back(n);
#pragma omp parallel num_threads(threads)
    {
        AttnScratch w;
        if (tiles) configure_score_tiles();
        // Dynamic: a long prefill block costs many decode rows.
#pragma omp for schedule(dynamic)
        for (int64_t item = 0; item < blocks * s.kv_heads; ++item) {
            const int64_t b = item / s.kv_heads, kvh = item % s.kv_heads, r0 = starts[b];
            const int64_t* table = tp + row_table[r0] * s.table_stride;
            if (vector)
                attend_block<T>(qp + r0 * q_stride, q_stride, starts[b + 1] - r0, kp, vp, table, positions + r0, kvh,
                                op + r0 * per_row, s, used, w);
            else
                attend_group<T>(qp + r0 * q_stride, kp, vp, table, positions[r0], kvh, op + r0 * per_row, s, w.scores,
                                w.acc);
        }
        if (tiles) release_tiles();
    }
}

// Every block a query will read lies inside its table row and the pool: a bad table is an error,
// never a read out of bounds.
bool tables_in_bounds(const int64_t* tables, const int64_t* row_table, const int64_t* positions, int64_t n,
                      int64_t num_tables, int64_t stride, int64_t block_size, int64_t num_blocks) {
    for (int64_t r = 0; r < n; ++r) {
        const int64_t pos = positions[r], t = row_table[r];
        if (t < 0 || t >= num_tables || pos < 0 || pos / block_size >= stride) return false;
        for (int64_t i = 0; i <= pos / block_size; ++i) {
            const int64_t blk = tables[t * stride + i];
            if (blk < 0 || blk >= num_blocks) return false;
        }
    }
    return true;
}

void paged_attention(uintptr_t q, int64_t q_stride, uintptr_t k, uintptr_t v, uintptr_t tables, uintptr_t row_table,
                     uintptr_t positions, uintptr_t out, int64_t n, int64_t heads, int64_t kv_heads, int64_t head_dim,
                     int64_t block_size, int64_t num_blocks, int64_t num_tables, int64_t table_stride, double scale,
                     double softcap, int64_t window, bool bf16, int scorer, int threads) {
    if (heads % kv_heads != 0) throw std::invalid_argument("heads must be a multiple of kv_heads");
    const auto* rt = reinterpret_cast<const int64_t*>(row_table);
    const auto* pp = reinterpret_cast<const int64_t*>(positions);
    if (!tables_in_bounds(reinterpret_cast<const int64_t*>(tables), rt, pp, n, num_tables, table_stride, block_size,
                          num_blocks))
        throw std::out_of_range("paged_attention: a row's table, position or block id lies outside the tables or the pool");
    const AttnShape s{heads,
                      kv_heads,
                      head_dim,
                      block_size,
                      table_stride,
                      static_cast<float>(scale),
                      static_cast<float>(softcap),
                      window};
    if (bf16)
        paged_attention_t<uint16_t>(q, q_stride, k, v, tables, rt, pp, out, n, s, scorer, threads);
    else
        paged_attention_t<float>(q, q_stride, k, v, tables, rt, pp, out, n, s, SCORE_FMA, threads);
}

// ---- row-wise ops: RMSNorm (with the residual add fused) and RoPE -------------------------------
//
// Each row is computed alone in a fixed order, so its bits never depend on the other rows: these are
// shared by the default and the batch-invariant forward. Roundings follow the torch expressions they
// replace (model/llama.py RMSNorm / GemmaRMSNorm, model/rope.py apply_rotary) step by step.

// On AVX-512 the three run 16 elements at a time with the same roundings (RoPE and SiLU keep each
// element's operations; RMSNorm's sum of squares is summed by lanes, then by hsum16's tree: a fixed
// order, not the scalar one). The scalar loops stay for CPUs without it.

template <typename T>
void rms_norm_row(T* xr, const T* residual, T* sr, const T* weight, T* out, int64_t dim, float eps, bool gemma) {
    // x + residual, rounded to the model dtype as torch's add does, is the row normalised and
    // (sum_out) the new residual stream.
    float ss = 0.0f;
    for (int64_t i = 0; i < dim; ++i) {
        float v = load(xr, i);
        if (residual) {
            v += load(residual, i);
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
            store(out, i, n * (1.0f + load(weight, i)));
        } else {  // rounded to the dtype, then weight * it in the dtype
            T nd;
            store(&nd, 0, n);
            store(out, i, load(weight, i) * load(&nd, 0));
        }
    }
}

template <typename T>
AVX512 void rms_norm_row16(T* xr, const T* residual, T* sr, const T* weight, T* out, int64_t dim, float eps,
                           bool gemma) {
    __m512 ss = _mm512_setzero_ps();
    for (int64_t i = 0; i < dim; i += 16) {
        const __mmask16 m = first_lanes(dim - i);
        __m512 v = load16m(xr + i, m);
        if (residual) {
            v = round16<T>(_mm512_add_ps(v, load16m(residual + i, m)));
            store16m(sr + i, v, m);
        }
        ss = _mm512_fmadd_ps(v, v, ss);
    }
    const __m512 inv = _mm512_set1_ps(1.0f / std::sqrt(hsum16(ss) / static_cast<float>(dim) + eps));
    const T* src = residual ? sr : xr;
    for (int64_t i = 0; i < dim; i += 16) {
        const __mmask16 m = first_lanes(dim - i);
        const __m512 n = _mm512_mul_ps(load16m(src + i, m), inv), w = load16m(weight + i, m);
        store16m(out + i, gemma ? _mm512_mul_ps(n, _mm512_add_ps(_mm512_set1_ps(1.0f), w)) : _mm512_mul_ps(w, round16<T>(n)), m);
    }
}

template <typename T>
void rms_norm_t(T* x, const T* residual, T* sum_out, const T* weight, T* out, int64_t rows, int64_t dim,
                float eps, bool gemma, int threads) {
    static const bool avx512 = cpu_has_avx512();
#pragma omp parallel for num_threads(threads) schedule(static) if (rows >= 32)
    for (int64_t r = 0; r < rows; ++r) {
        T* sr = sum_out ? sum_out + r * dim : nullptr;
        const T* res = residual ? residual + r * dim : nullptr;
        if (avx512)
            rms_norm_row16(x + r * dim, res, sr, weight, out + r * dim, dim, eps, gemma);
        else
            rms_norm_row(x + r * dim, res, sr, weight, out + r * dim, dim, eps, gemma);
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
void rope_head(T* xh, const T* c, const T* s, int64_t half) {
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

template <typename T>
AVX512 void rope_head16(T* xh, const T* c, const T* s, int64_t half) {
    for (int64_t i = 0; i < half; i += 16) {
        const __mmask16 m = first_lanes(half - i);
        const __m512 x1 = load16m(xh + i, m), x2 = load16m(xh + i + half, m);
        const __m512 a = round16<T>(_mm512_mul_ps(x1, load16m(c + i, m)));
        const __m512 b = round16<T>(_mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), x2), load16m(s + i, m)));
        const __m512 c2 = round16<T>(_mm512_mul_ps(x2, load16m(c + i + half, m)));
        const __m512 d = round16<T>(_mm512_mul_ps(x1, load16m(s + i + half, m)));
        store16m(xh + i, _mm512_add_ps(a, b), m);
        store16m(xh + i + half, _mm512_add_ps(c2, d), m);
    }
}

template <typename T>
void rope_t(T* x, const T* cos, const T* sin, int64_t rows, int64_t heads, int64_t rot, int64_t sr, int64_t sh,
            int threads) {
    static const bool avx512 = cpu_has_avx512();
#pragma omp parallel for num_threads(threads) schedule(static) if (rows >= 32)
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t h = 0; h < heads; ++h) {
            if (avx512)
                rope_head16(x + r * sr + h * sh, cos + r * rot, sin + r * rot, rot / 2);
            else
                rope_head(x + r * sr + h * sh, cos + r * rot, sin + r * rot, rot / 2);
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
void silu_and_mul_row(const T* g, const T* u, T* out, int64_t dim) {
    for (int64_t i = 0; i < dim; ++i) {
        const float x = load(g, i);
        T act;
        store(&act, 0, x / (1.0f + std::exp(-x)));
        store(out, i, load(&act, 0) * load(u, i));
    }
}

template <typename T>
AVX512 void silu_and_mul_row16(const T* g, const T* u, T* out, int64_t dim) {
    const __m512 one = _mm512_set1_ps(1.0f);
    for (int64_t i = 0; i < dim; i += 16) {
        const __mmask16 m = first_lanes(dim - i);
        const __m512 x = load16m(g + i, m);
        const __m512 act = round16<T>(_mm512_div_ps(x, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), x)))));
        store16m(out + i, _mm512_mul_ps(act, load16m(u + i, m)), m);
    }
}

template <typename T>
void silu_and_mul_t(const T* gate_up, T* out, int64_t rows, int64_t dim, int threads) {
    static const bool avx512 = cpu_has_avx512();
#pragma omp parallel for num_threads(threads) schedule(static) if (rows >= 32)
    for (int64_t r = 0; r < rows; ++r) {
        const T* g = gate_up + r * 2 * dim;
        if (avx512)
            silu_and_mul_row16(g, g + dim, out + r * dim, dim);
        else
            silu_and_mul_row(g, g + dim, out + r * dim, dim);
    }
}

void silu_and_mul(uintptr_t gate_up, uintptr_t out, int64_t rows, int64_t dim, bool bf16, int threads) {
    if (bf16)
        silu_and_mul_t(reinterpret_cast<const uint16_t*>(gate_up), reinterpret_cast<uint16_t*>(out), rows, dim,
                       threads);
    else
        silu_and_mul_t(reinterpret_cast<const float*>(gate_up), reinterpret_cast<float*>(out), rows, dim, threads);
}

// y [M, I] = silu(gate) * up over a fused gate/up weight packed `gated` (N = 2I, pack_dpbf16): the
// GEMM and silu_and_mul in one pass, rounding as the two do in turn (the gate and up sums to bf16,
// SiLU to bf16, then the product), so the same bits without writing [M, 2I] out and reading it
// back (silu_and_mul was ~6% of a SmolLM2 prefill forward, README "Speed").
DPBF16 void linear_dpbf16_silu(uintptr_t x, uintptr_t packed, uintptr_t y, int64_t M, int64_t I, int64_t K,
                               int threads) {
    auto* yp = reinterpret_cast<uint16_t*>(y);
    const __m512 one = _mm512_set1_ps(1.0f), zero = _mm512_setzero_ps();
    dp_linear(reinterpret_cast<const uint16_t*>(x), reinterpret_cast<const uint16_t*>(packed), M, 2 * I, K, threads,
              [&](const float* sums, int64_t c0, int64_t c1, int64_t n0, int) DPBF16 {
                  for (int64_t r = c0; r < c1; ++r)
                      for (int h = 0; h < 2; ++h) {
                          const float* sr = sums + (r - c0) * 64 + h * 16;
                          const __m512 g = round16<uint16_t>(_mm512_load_ps(sr));
                          const __m512 u = round16<uint16_t>(_mm512_load_ps(sr + 32));
                          const __m512 e = exp16(_mm512_sub_ps(zero, g));
                          const __m512 act = round16<uint16_t>(_mm512_div_ps(g, _mm512_add_ps(one, e)));
                          _mm256_storeu_si256(reinterpret_cast<__m256i*>(yp + r * I + n0 / 2 + h * 16),
                                              round_to_bf16(_mm512_mul_ps(act, u)));
                      }
              });
}


// ---- the decode stack: every layer of a decode-only batch in one call ---------------------------
//
// A decode step calls ~11 of these kernels per layer, each through its Python wrapper and torch's
// tensor glue: on this 2-core machine that glue was 10-14 ms of a 20-55 ms SmolLM2 step at batch
// 1-32 (measured, README "Speed"). For a decode-only bf16 batch of a Llama-style layer (pre-norm,
// fused qkv and gate/up, SiLU, Qwen3's q/k norm; not Gemma's block) DecodeStack::run calls the same
// kernels on the same operands, in the same order, with each linear taking the kernel Linear.forward
// would take at that row count (model/llama.py): its bits are those of the layer-by-layer forward
// (tests/test_decode_stack.py). Python builds it once per model and KV pool (model/decode_stack.py)
// and keeps every tensor it points into alive.
struct StackLinear {
    uintptr_t weight, packed, bias, qweight, qscale;  // 0: absent
    int64_t n, k;
};

struct StackLayer {
    StackLinear qkv, o, gate_up, down;
    uintptr_t input_norm, post_norm, q_norm, k_norm, kpool, vpool;  // q/k norm 0: none
    int64_t window, rope;  // window 0: full attention; rope: which of run()'s cos/sin pairs
    bool gated;            // gate_up packed for linear_dpbf16_silu (Linear.gated)
};

// What StackLinear::packed holds (cpu_kernels.pack_kind()).
enum PackKind : int { PACK_NONE = 0, PACK_AMX = 1, PACK_DPBF16 = 2 };

// Linear.forward's choice at m rows: int8 at one row where packed (at up to 4 where not), the packed
// kernel (AMX tiles or AVX512-BF16 panels) where packed, else the few-row AVX-512 kernel (the builder
// never lets m exceed 4 there).
void stack_linear(const StackLinear& l, int pack_kind, const uint16_t* x, uint16_t* y, int64_t m, int threads) {
    const auto xp = reinterpret_cast<uintptr_t>(x), yp = reinterpret_cast<uintptr_t>(y);
    if (l.qweight && (!l.packed || m == 1) && m <= 4)
        linear_int8(xp, l.qweight, l.qscale, l.bias, yp, m, l.n, l.k, threads);
    else if (l.packed && pack_kind == PACK_AMX)
        linear_amx(xp, l.packed, l.bias, yp, m, l.n, l.k, threads);
    else if (l.packed && pack_kind == PACK_DPBF16)
        linear_dpbf16(xp, l.packed, l.bias, yp, m, l.n, l.k, threads);
    else
        linear_bf16(xp, l.weight, l.bias, yp, m, l.n, l.k, threads);
}

class DecodeStack {
  public:
    DecodeStack(int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t hidden, int64_t intermediate, double eps,
                double scale, double softcap, int64_t block_size, int64_t num_blocks, int scorer, int pack_kind)
        : h_(heads), kvh_(kv_heads), d_(head_dim), hidden_(hidden), inter_(intermediate), eps_(static_cast<float>(eps)),
          scale_(static_cast<float>(scale)), softcap_(static_cast<float>(softcap)), bs_(block_size),
          blocks_(num_blocks), scorer_(scorer), pack_kind_(pack_kind) {
        if (heads % kv_heads != 0 || head_dim % 16 != 0 || head_dim > 256)
            throw std::invalid_argument("DecodeStack: heads must be a multiple of kv_heads, head_dim of 16 (<= 256)");
    }

    void add_layer(StackLinear qkv, StackLinear o, StackLinear gate_up, StackLinear down, uintptr_t input_norm,
                   uintptr_t post_norm, uintptr_t q_norm, uintptr_t k_norm, uintptr_t kpool, uintptr_t vpool,
                   int64_t window, int64_t rope, bool gated) {
        layers_.push_back(
            {qkv, o, gate_up, down, input_norm, post_norm, q_norm, k_norm, kpool, vpool, window, rope, gated});
    }

    // x [n, hidden] (the embeddings; overwritten with the residual stream) and mlp_out [n, hidden]:
    // on return the last layer's input to its final add, as DecoderLayer.forward's `x` and `mlp(h)`.
    // Row i is a decode row at positions[i], writing its K/V at slots[i], reading table i.
    void run(uintptr_t x, uintptr_t mlp_out, int64_t n, uintptr_t positions, uintptr_t slots, uintptr_t tables,
             int64_t table_stride, std::vector<uintptr_t> cos, std::vector<uintptr_t> sin, std::vector<int64_t> rot,
             int threads) const {
        const auto* pos = reinterpret_cast<const int64_t*>(positions);
        const auto* slot = reinterpret_cast<const int64_t*>(slots);
        const auto* tab = reinterpret_cast<const int64_t*>(tables);
        std::vector<int64_t> row_table(static_cast<size_t>(n));
        for (int64_t r = 0; r < n; ++r) {
            row_table[r] = r;
            if (slot[r] < 0 || slot[r] >= blocks_ * bs_) throw std::out_of_range("DecodeStack: a KV slot lies outside the pool");
        }
        if (!tables_in_bounds(tab, row_table.data(), pos, n, n, table_stride, bs_, blocks_))
            throw std::out_of_range("DecodeStack: a row's position or block id lies outside its table or the pool");
        for (const auto& l : layers_)
            if (l.rope < 0 || l.rope >= static_cast<int64_t>(cos.size()) || cos.size() != sin.size() || sin.size() != rot.size())
                throw std::invalid_argument("DecodeStack: a layer's RoPE index has no cos/sin pair");
        const int64_t width = (h_ + 2 * kvh_) * d_, kv_row = kvh_ * d_;
        std::vector<uint16_t> normed(n * hidden_), qkv(n * width), attn(n * h_ * d_), attn_out(n * hidden_),
            gate_up(n * 2 * inter_), act(n * inter_);
        auto* xs = reinterpret_cast<uint16_t*>(x);
        auto* mlp = reinterpret_cast<uint16_t*>(mlp_out);
        const AttnShape shape{h_, kvh_, d_, bs_, table_stride, scale_, softcap_, 0};
        for (size_t i = 0; i < layers_.size(); ++i) {
            const StackLayer& l = layers_[i];
            // The previous layer's `x + mlp(h)` fused into this layer's input norm (as add_and_norm).
            rms_norm_t(xs, i ? mlp : nullptr, i ? xs : nullptr, reinterpret_cast<const uint16_t*>(l.input_norm),
                       normed.data(), n, hidden_, eps_, false, threads);
            stack_linear(l.qkv, pack_kind_, normed.data(), qkv.data(), n, threads);
            for (int64_t r = 0; l.q_norm && r < n; ++r) {  // Qwen3: each head's q and k normed, in place
                uint16_t *qr = qkv.data() + r * width, *kr = qr + h_ * d_;
                const auto* qw = reinterpret_cast<const uint16_t*>(l.q_norm);
                const auto* kw = reinterpret_cast<const uint16_t*>(l.k_norm);
                rms_norm_t<uint16_t>(qr, nullptr, nullptr, qw, qr, h_, d_, eps_, false, threads);
                rms_norm_t<uint16_t>(kr, nullptr, nullptr, kw, kr, kvh_, d_, eps_, false, threads);
            }
            rope_t(qkv.data(), reinterpret_cast<const uint16_t*>(cos[l.rope]), reinterpret_cast<const uint16_t*>(sin[l.rope]),
                   n, h_ + kvh_, rot[l.rope], width, d_, threads);
            auto* kp = reinterpret_cast<uint16_t*>(l.kpool);
            auto* vp = reinterpret_cast<uint16_t*>(l.vpool);
            for (int64_t r = 0; r < n; ++r) {  // KVCache.write
                std::memcpy(kp + slot[r] * kv_row, qkv.data() + r * width + h_ * d_, kv_row * 2);
                std::memcpy(vp + slot[r] * kv_row, qkv.data() + r * width + (h_ + kvh_) * d_, kv_row * 2);
            }
            AttnShape ls = shape;
            ls.window = l.window;
            paged_attention_t<uint16_t>(reinterpret_cast<uintptr_t>(qkv.data()), width, l.kpool, l.vpool, tables,
                                        row_table.data(), pos, reinterpret_cast<uintptr_t>(attn.data()), n, ls, scorer_,
                                        threads);
            stack_linear(l.o, pack_kind_, attn.data(), attn_out.data(), n, threads);
            rms_norm_t(xs, attn_out.data(), xs, reinterpret_cast<const uint16_t*>(l.post_norm), normed.data(), n, hidden_,
                       eps_, false, threads);
            if (l.gated) {  // MLP.forward's fused path
                linear_dpbf16_silu(reinterpret_cast<uintptr_t>(normed.data()), l.gate_up.packed,
                                   reinterpret_cast<uintptr_t>(act.data()), n, inter_, hidden_, threads);
            } else {
                stack_linear(l.gate_up, pack_kind_, normed.data(), gate_up.data(), n, threads);
                silu_and_mul_t(gate_up.data(), act.data(), n, inter_, threads);
            }
            stack_linear(l.down, pack_kind_, act.data(), mlp, n, threads);
        }
    }

  private:
    int64_t h_, kvh_, d_, hidden_, inter_;
    float eps_, scale_, softcap_;
    int64_t bs_, blocks_;
    int scorer_;
    int pack_kind_;
    std::vector<StackLayer> layers_;
};

}  // namespace

PYBIND11_MODULE(_kernels, m) {
    m.doc() = "CPU decode kernels for minisgl (pointer-level; use minisgl_backend.model.cpu_kernels).";
    m.def("has_avx512", &cpu_has_avx512, "True if this CPU runs linear_bf16.");
    m.def("linear_bf16", &linear_bf16, py::call_guard<py::gil_scoped_release>(), py::arg("x"), py::arg("w"),
          py::arg("bias"), py::arg("y"), py::arg("m"), py::arg("n"), py::arg("k"), py::arg("threads"),
          "y[m,n] = x[m,k] @ w[n,k]^T (+ bias[n]); contiguous bfloat16; bias 0 = none.");
    m.def("has_amx", &cpu_has_amx, "True if this CPU runs linear_amx (and the process may use its tiles).");
    m.def("packed_amx_elems", &packed_amx_elems, py::arg("n"), py::arg("k"), "bf16 elements of pack_amx's output.");
    m.def("pack_amx", &pack_amx, py::call_guard<py::gil_scoped_release>(), py::arg("w"), py::arg("out"), py::arg("n"),
          py::arg("k"), py::arg("threads"), "w [n,k] bf16 into linear_amx's tile layout (packed_amx_elems long).");
    m.def("linear_amx", &linear_amx, py::call_guard<py::gil_scoped_release>(), py::arg("x"), py::arg("packed"),
          py::arg("bias"), py::arg("y"), py::arg("m"), py::arg("n"), py::arg("k"), py::arg("threads"),
          "y[m,n] = x[m,k] @ w[n,k]^T (+ bias[n]) for any m over pack_amx(w); contiguous bfloat16; bias 0 = none.");
    m.def("has_avx512_bf16", &cpu_has_avx512_bf16, "True if this CPU runs linear_dpbf16 (AVX512-BF16).");
    m.def("packed_dpbf16_elems", &packed_dpbf16_elems, py::arg("n"), py::arg("k"),
          "bf16 elements of pack_dpbf16's output (0: K odd, not packable).");
    m.def("pack_dpbf16", &pack_dpbf16, py::call_guard<py::gil_scoped_release>(), py::arg("w"), py::arg("out"),
          py::arg("n"), py::arg("k"), py::arg("gated"), py::arg("threads"),
          "w [n,k] bf16 into linear_dpbf16's panel layout (gated: a [gate | up] weight for linear_dpbf16_silu).");
    m.def("linear_dpbf16_silu", &linear_dpbf16_silu, py::call_guard<py::gil_scoped_release>(), py::arg("x"),
          py::arg("packed"), py::arg("y"), py::arg("m"), py::arg("i"), py::arg("k"), py::arg("threads"),
          "y[m,i] = silu(x @ gate^T) * (x @ up^T) over pack_dpbf16([gate | up], gated=True); bfloat16.");
    m.def("linear_dpbf16", &linear_dpbf16, py::call_guard<py::gil_scoped_release>(), py::arg("x"),
          py::arg("packed"), py::arg("bias"), py::arg("y"), py::arg("m"), py::arg("n"), py::arg("k"),
          py::arg("threads"),
          "y[m,n] = x[m,k] @ w[n,k]^T (+ bias[n]) for any m over pack_dpbf16(w); contiguous bfloat16.");
    m.def("stream_read", &stream_read, py::call_guard<py::gil_scoped_release>(), py::arg("buf"), py::arg("bytes"),
          py::arg("threads"), "Read `bytes` of buf once over `threads` (a memory bandwidth probe); returns their sum.");
    m.def("linear_int8", &linear_int8, py::call_guard<py::gil_scoped_release>(), py::arg("x"), py::arg("w"),
          py::arg("scale"), py::arg("bias"), py::arg("y"), py::arg("m"), py::arg("n"), py::arg("k"),
          py::arg("threads"),
          "y[m,n] = (x[m,k] @ w[n,k]^T) * scale[n] (+ bias[n]); x, bias, y bfloat16, w int8, scale float32.");
    m.def("paged_attention", &paged_attention, py::call_guard<py::gil_scoped_release>(), py::arg("q"),
          py::arg("q_row_stride"), py::arg("k"), py::arg("v"), py::arg("tables"), py::arg("row_table"),
          py::arg("positions"), py::arg("out"), py::arg("rows"), py::arg("heads"), py::arg("kv_heads"),
          py::arg("head_dim"), py::arg("block_size"), py::arg("num_blocks"), py::arg("num_tables"),
          py::arg("table_stride"), py::arg("scale"), py::arg("softcap"), py::arg("window"), py::arg("bf16"),
          py::arg("scorer"), py::arg("threads"),
          "Each query row over its paged K/V: q [rows,h,d] (rows q_row_stride apart), out [rows,h,d], pools "
          "[slots,kvh,d], tables int64 [num_tables,stride], row_table int64 [rows] (the row's table), positions "
          "int64 [rows] (the query's position; keys 0..pos, or the last `window`).");
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
    py::class_<StackLinear>(m, "StackLinear")
        .def(py::init<uintptr_t, uintptr_t, uintptr_t, uintptr_t, uintptr_t, int64_t, int64_t>(), py::arg("weight"),
             py::arg("packed"), py::arg("bias"), py::arg("qweight"), py::arg("qscale"), py::arg("n"), py::arg("k"));
    py::class_<DecodeStack>(m, "DecodeStack")
        .def(py::init<int64_t, int64_t, int64_t, int64_t, int64_t, double, double, double, int64_t, int64_t, int,
                      int>(),
             py::arg("heads"), py::arg("kv_heads"), py::arg("head_dim"), py::arg("hidden"), py::arg("intermediate"),
             py::arg("eps"), py::arg("scale"), py::arg("softcap"), py::arg("block_size"), py::arg("num_blocks"),
             py::arg("scorer"), py::arg("pack_kind"))
        .def("add_layer", &DecodeStack::add_layer, py::arg("qkv"), py::arg("o"), py::arg("gate_up"), py::arg("down"),
             py::arg("input_norm"), py::arg("post_norm"), py::arg("q_norm"), py::arg("k_norm"), py::arg("kpool"),
             py::arg("vpool"), py::arg("window"), py::arg("rope"), py::arg("gated"))
        .def("run", &DecodeStack::run, py::call_guard<py::gil_scoped_release>(), py::arg("x"), py::arg("mlp_out"),
             py::arg("rows"), py::arg("positions"), py::arg("slots"), py::arg("tables"), py::arg("table_stride"),
             py::arg("cos"), py::arg("sin"), py::arg("rot"), py::arg("threads"),
             "Every layer over decode rows: x [rows, hidden] in (embeddings) and out (residual stream), "
             "mlp_out [rows, hidden] the last layer's MLP output; positions, slots int64 [rows], tables int64 "
             "[rows, table_stride]; cos/sin [rows, rot] bf16 per RoPE.");
}
