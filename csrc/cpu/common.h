// The helpers every CPU kernel family shares (csrc/cpu/*.cpp, built into minisgl_backend.native._kernels):
// bf16 <-> float32 conversion, the CPU feature checks, the target attributes each family compiles
// under, the 16-lane (AVX-512) and 8-lane (AVX2 + FMA) loads, stores, exp and sums they are written
// with, and Lanes16 / Lanes8, the same operations under one name per width for the kernels written
// once for both (rowwise_lanes.h, linear_lanes.h).
//
// Bit-exactness: every helper here is a fixed sequence of operations (fixed reduction trees, one
// rounding rule), inlined into each kernel, so a kernel's bits do not depend on which file it is in.
// Every file is compiled with the same flags (setup.py); the ISA comes from these attributes only,
// so one .so runs on any x86-64 CPU and each family checks its CPU at run time.
#pragma once

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <type_traits>

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#define AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl")))
#define AMX __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512dq,avx512vl,avx512bf16")))
#define DPBF16 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16")))
#define AVX2 __attribute__((target("avx2,fma")))

namespace minisgl::cpu {

// ---- bf16 <-> float32, one element --------------------------------------------------------------

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

// Element i of a float32 or bf16 array as float32, and back (rounded to the array's dtype).
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

// ---- CPU features: each family's kernels run only where its check passes -------------------------

inline bool cpu_has_avx512() {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
}

// Linux hands the tile registers to a process only after it asks (ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA); without it the first tile instruction is SIGILL. Asked once at import. The
// family also rounds with AVX512-BF16's conversions (every CPU with AMX-BF16 has them).
inline bool cpu_has_amx() {
    __builtin_cpu_init();
    if (!cpu_has_avx512() || !__builtin_cpu_supports("amx-tile") || !__builtin_cpu_supports("amx-bf16") ||
        !__builtin_cpu_supports("avx512bf16"))
        return false;
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

// The avx2 family: AVX2 and FMA (Haswell / Zen 1 and later), 8 float32 lanes.
inline bool cpu_has_avx2() {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

inline bool cpu_has_avx512_bf16() {
    __builtin_cpu_init();
    return cpu_has_avx512() && __builtin_cpu_supports("avx512bf16");
}

// Which vector code a kernel entry point runs: the process's kernel family's, passed from Python
// (cpu_kernels.py), so that MINISGL_KERNELS=avx2 runs the 8-lane code on a CPU that has AVX-512 too.
// ISA_AVX512_BF16 is the AVX-512 code with the bf16 conversions of AVX512-BF16 (the amx and
// avx512bf16 families), which round as the plain AVX-512 code does (common.h round_to_bf16_dp): the
// same bits, so MINISGL_KERNELS=avx512 on such a CPU still runs, and tests, the plain code.
// Never more than the CPU has: require_isa throws before any such instruction runs.
enum Isa : int { ISA_AVX2 = 1, ISA_AVX512 = 2, ISA_AVX512_BF16 = 3 };

inline Isa require_isa(int isa) {
    static const bool avx2 = cpu_has_avx2(), avx512 = cpu_has_avx512(), bf16 = cpu_has_avx512_bf16();
    if ((isa == ISA_AVX512_BF16 && bf16) || (isa == ISA_AVX512 && avx512) || (isa == ISA_AVX2 && avx2))
        return static_cast<Isa>(isa);
    throw std::invalid_argument("this CPU does not run the requested kernel ISA (cpu_kernels.family())");
}

// The tile unit's configuration (ldtilecfg's 64-byte operand): linear_amx and the AMX scorer.
struct alignas(64) TileConfig {
    uint8_t palette = 1, start_row = 0;
    uint8_t reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
};

// Every tile register configured as a full tile, 16 rows of 64 bytes: the AMX scorer's (attention) and
// the tile-rate probe's shape.
AMX inline void configure_full_tiles() {
    TileConfig c;
    for (int t = 0; t < 8; ++t) {
        c.colsb[t] = 64;
        c.rows[t] = 16;
    }
    asm volatile("" : : "r"(&c) : "memory");  // the field stores must reach memory (linear_amx.cpp)
    _tile_loadconfig(&c);
}

// ---- the few-row linears' tiles (linear_fma.cpp, linear_int8.cpp) -----------------------------

// A tile's MM input rows x 4 weight rows of float32 accumulators, zeroed.
template <int MM>
AVX512 inline void zero_tile(__m512 (&acc)[MM][4]) {
#pragma GCC unroll 4
    for (int i = 0; i < MM; ++i)
#pragma GCC unroll 4
        for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_setzero_ps();
}

// [sum(a), sum(b), sum(c), sum(d)]: a transpose-and-add tree (fixed order, so fixed bits).
AVX512 inline __m128 reduce4(__m512 a, __m512 b, __m512 c, __m512 d) {
    // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] and the same for c, d
    const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
    const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
    // per lane: [a, b, c, d] partial sums
    const __m512 abcd = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd))),
                                      _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd))));
    const __m256 half = _mm256_add_ps(_mm512_castps512_ps256(abcd), _mm512_extractf32x8_ps(abcd, 1));
    return _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1));
}

// The few-row kernels read a tile of weight rows at a time, interleaved streams per thread, which the
// hardware prefetcher alone keeps well below the memory's read rate. So each line of a tile's rows
// requests the same line of the `rows` rows PREFETCH_ROWS further on into L2 (past the matrix a
// prefetch never faults). Far ahead into L2 rather than the next tile into L1: a request into L1
// one 4-row tile ahead arrives too late to hide a row's read from memory, and a decode step at one row
// is a weight stream, so its time follows this read rate (docs/performance.md).
constexpr int PREFETCH_ROWS = 8;
template <typename W>
inline void prefetch_rows_ahead(const W* w, int64_t K, int64_t k, int rows) {
    for (int j = PREFETCH_ROWS; j < PREFETCH_ROWS + rows; ++j)
        _mm_prefetch(reinterpret_cast<const char*>(w + j * K + k), _MM_HINT_T1);
}

// ---- 16 lanes at a time ------------------------------------------------------------------------

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
    const __m256i h =
        mask == 0xffff ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)) : _mm256_maskz_loadu_epi16(mask, p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// The same for 16 elements: load16/load16m (masked) widen, store16m rounds (round_to_bf16). A whole
// vector (mask all ones) takes the plain load or store: on some CPUs the masked forms made the
// row-wise ops of a prefill forward several times slower, where the next op reads what they stored.
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
    return m == 0xffff ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps(m, p);
}
template <>
AVX512 inline __m512 load16m<uint16_t>(const uint16_t* p, __mmask16 m) {
    return load_bf16x16(p, m);
}

template <typename T>
AVX512 inline void store16m(T* p, __m512 v, __mmask16 m);
template <>
AVX512 inline void store16m<float>(float* p, __m512 v, __mmask16 m) {
    if (m == 0xffff)
        _mm512_storeu_ps(p, v);
    else
        _mm512_mask_storeu_ps(p, m, v);
}
template <>
AVX512 inline void store16m<uint16_t>(uint16_t* p, __m512 v, __mmask16 m) {
    if (m == 0xffff)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), round_to_bf16(v));
    else
        _mm256_mask_storeu_epi16(p, m, round_to_bf16(v));
}

template <typename T>
AVX512 inline __m512 round16(__m512 v) {  // to the dtype and back, as storing and loading it
    if constexpr (std::is_same_v<T, float>)
        return v;
    else {  // round_to_bf16's bits, kept in the high half of each lane (no narrowing and widening)
        const __m512i u = _mm512_castps_si512(v), high = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
        const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
        const __m512i r = _mm512_and_si512(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), odd), high);
        const __mmask16 nan =
            _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
        const __m512i quiet = _mm512_or_si512(_mm512_and_si512(u, high), _mm512_set1_epi32(0x00400000));
        return _mm512_castsi512_ps(_mm512_mask_blend_epi32(nan, r, quiet));
    }
}

// round_to_bf16 and round16<uint16_t> in one instruction on AVX512-BF16 (the epilogues of the
// avx512bf16 family's GEMMs). vcvtneps2bf16 rounds to nearest even and quiets a NaN exactly as
// round_to_bf16 does, but it flushes a float32 denormal to zero, where round_to_bf16 keeps it: a
// vector with one (a nonzero element whose exponent field is zero, below 1.2e-38) takes the integer
// rounding instead, so the bits are round_to_bf16's on every input and the family's bits do not
// depend on which of the two ran.
DPBF16 inline bool has_denormal(__m512 v) { return _mm512_fpclass_ps_mask(v, 0x20) != 0; }  // 0x20: denormal
DPBF16 inline __m256i round_to_bf16_dp(__m512 v) {
    if (__builtin_expect(has_denormal(v), 0)) return round_to_bf16(v);
    return (__m256i)_mm512_cvtneps_pbh(v);
}
DPBF16 inline __m512 round16_dp(__m512 v) {  // round16<uint16_t>'s bits (the bf16 in each lane's high half)
    if (__builtin_expect(has_denormal(v), 0)) return round16<uint16_t>(v);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}
// 2^t = 2^n (scalef) times 2^f, n = t rounded to nearest, f = t - n in [-1/2, 1/2] (exact), 2^f from
// a degree-5 polynomial with p(0) = 1, fitted for relative error (1.7e-7 in float32 over f's range).
AVX512 inline __m512 exp2_split(__m512 t) {
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n);
    static constexpr float c[6] = {1.0f,
                                   0.6931470036506653f,
                                   0.24022242426872253f,
                                   0.05550733581185341f,
                                   0.009671512991189957f,
                                   0.001326472731307149f};
    __m512 p = _mm512_set1_ps(c[5]);
    for (int i = 4; i >= 0; --i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c[i]));
    return _mm512_scalef_ps(p, n);
}
// exp(x) as 2^(x log2 e): relative error below 4e-6 over [-87, 88.3] (measured in steps of 1e-3;
// most of it the rounding of x log2 e at large |x|, below 1.2e-6 on [-20, 0]). Softmax calls it on
// scores minus their maximum (x <= 0), SiLU on any x: below -87 (and for NaN) it stays at exp(-87),
// past 88.7 it is inf (scalef overflows).
AVX512 inline __m512 exp16(__m512 x) {
    return exp2_split(_mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(1.44269504088896341f)));
}
// exp16(-x)'s bits without the negation: min(x, 87) * -log2 e is max(-x, -87) * log2 e exactly (a
// NaN x takes the 87 as -x takes the -87).
AVX512 inline __m512 exp16_neg(__m512 x) {
    return exp2_split(_mm512_mul_ps(_mm512_min_ps(x, _mm512_set1_ps(87.0f)), _mm512_set1_ps(-1.44269504088896341f)));
}

// 16 outputs of silu(gate) * up from the float32 sums of a fused gate/up GEMM, rounded as the
// GEMM's bf16 store and silu_and_mul round them in turn (the sums to bf16, SiLU to bf16, then the
// product): the epilogue that lets both packed families skip the [rows, 2I] intermediate with the
// same bits. The tile unit's GEMM runs it between its tile products on the same core, so each
// instruction it saves is time saved: the two sums are rounded in one vcvtne2ps2bf16 and put back
// into float32 lanes by two word permutes, and one test at the end stands for the four roundings'
// denormal tests (a vector with a denormal among its sums or the two values it rounds later takes
// round16_dp's and round_to_bf16_dp's own paths instead, with the same bits).
DPBF16 inline __m256i silu_mul_bf16(__m512 gate_sum, __m512 up_sum) {
    // [up | gate] as 32 bf16: word i of gate is word 16 + i; lane i's high word takes it, the low is zero
    const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(gate_sum, up_sum);
    alignas(64) static constexpr int16_t gate_words[32] = {0, 16, 0, 17, 0, 18, 0, 19, 0, 20, 0, 21, 0, 22, 0, 23,
                                                           0, 24, 0, 25, 0, 26, 0, 27, 0, 28, 0, 29, 0, 30, 0, 31};
    alignas(64) static constexpr int16_t up_words[32] = {0, 0, 0, 1, 0, 2,  0, 3,  0, 4,  0, 5,  0, 6,  0, 7,
                                                         0, 8, 0, 9, 0, 10, 0, 11, 0, 12, 0, 13, 0, 14, 0, 15};
    constexpr __mmask32 high_words = 0xaaaaaaaa;
    const __m512 g =
        _mm512_castsi512_ps(_mm512_maskz_permutexvar_epi16(high_words, _mm512_load_si512(gate_words), both));
    const __m512 u = _mm512_castsi512_ps(_mm512_maskz_permutexvar_epi16(high_words, _mm512_load_si512(up_words), both));
    const __m512 q = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), exp16_neg(g)));
    const __m512 act =
        _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(q)), 16));
    const __m512 out = _mm512_mul_ps(act, u);
    constexpr int denormal = 0x20;
    if (__builtin_expect((_mm512_fpclass_ps_mask(gate_sum, denormal) | _mm512_fpclass_ps_mask(up_sum, denormal) |
                          _mm512_fpclass_ps_mask(q, denormal) | _mm512_fpclass_ps_mask(out, denormal)) != 0,
                         0)) {
        const __m512 gd = round16_dp(gate_sum), ud = round16_dp(up_sum);
        const __m512 ad = round16_dp(_mm512_div_ps(gd, _mm512_add_ps(_mm512_set1_ps(1.0f), exp16_neg(gd))));
        return round_to_bf16_dp(_mm512_mul_ps(ad, ud));
    }
    return (__m256i)_mm512_cvtneps_pbh(out);
}

// The fixed reduction order of a score's and a softmax sum's 16 lanes: lane j with lane j+8, then
// j with j+4, j with j+2, j with j+1. hsum16 applies it across one vector's lanes (attention.cpp's
// vsum16 applies the same tree across 16 vectors, lane by lane).
AVX512 inline float hsum16(__m512 v) {
    const __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
    const __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    const __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));
    return _mm_cvtss_f32(_mm_add_ss(c, _mm_movehdup_ps(c)));
}

// ---- 8 lanes at a time (AVX2 + FMA: no mask registers, no scalef) --------------------------------

// The first min(n, 8) lanes as an all-ones / zero mask (maskload / maskstore's operand), n >= 1.
AVX2 inline __m256i first_lanes8(int64_t n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n < 8 ? n : 8)),
                              _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// 8 float32 rounded to bf16 (round-to-nearest-even, NaN kept a quiet NaN: f32_to_bf16, eight at a
// time), left in float32: the bf16 bits in the high halves, zeros below. In the float domain, with no
// packing, since AVX2 has no 32 -> 16-bit narrowing within a register (round16's vpmovdw).
AVX2 inline __m256 round8_f32(__m256 v) {
    const __m256i u = _mm256_castps_si256(v), hi = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_and_si256(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), odd), hi);
    const __m256i nan = _mm256_and_si256(_mm256_or_si256(u, _mm256_set1_epi32(0x00400000)), hi);
    return _mm256_blendv_ps(_mm256_castsi256_ps(r), _mm256_castsi256_ps(nan), _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
}

// 8 float32 to bf16 as 8 uint16 (round8_f32's high halves, packed; no value exceeds 0xffff, so packus
// does not saturate, and the 64-bit permute puts the two 128-bit halves' lanes back in order).
AVX2 inline __m128i round_to_bf16x8(__m256 v) {
    const __m256i h = _mm256_srli_epi32(_mm256_castps_si256(round8_f32(v)), 16);
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(h, h), 0x08));
}

AVX2 inline __m256 widen_bf16x8(__m128i h) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// load8n / store8n: the first min(n, 8) elements (n >= 1), widened to float32 / rounded to the
// array's dtype; lanes past n load as zero and are not stored. Short bf16 runs go through a zeroed
// 8-element copy (AVX2 has no 16-bit masked load).
template <typename T>
AVX2 inline __m256 load8n(const T* p, int64_t n);
template <>
AVX2 inline __m256 load8n<float>(const float* p, int64_t n) {
    return n >= 8 ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, first_lanes8(n));
}
template <>
AVX2 inline __m256 load8n<uint16_t>(const uint16_t* p, int64_t n) {
    if (n >= 8) return widen_bf16x8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    alignas(16) uint16_t b[8] = {};
    std::memcpy(b, p, static_cast<size_t>(n) * 2);
    return widen_bf16x8(_mm_load_si128(reinterpret_cast<const __m128i*>(b)));
}

template <typename T>
AVX2 inline void store8n(T* p, __m256 v, int64_t n);
template <>
AVX2 inline void store8n<float>(float* p, __m256 v, int64_t n) {
    if (n >= 8)
        _mm256_storeu_ps(p, v);
    else
        _mm256_maskstore_ps(p, first_lanes8(n), v);
}
template <>
AVX2 inline void store8n<uint16_t>(uint16_t* p, __m256 v, int64_t n) {
    const __m128i h = round_to_bf16x8(v);
    if (n >= 8) {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(p), h);
        return;
    }
    alignas(16) uint16_t b[8];
    _mm_store_si128(reinterpret_cast<__m128i*>(b), h);
    std::memcpy(p, b, static_cast<size_t>(n) * 2);
}

template <typename T>
AVX2 inline __m256 round8(__m256 v) {  // to the dtype and back, as storing and loading it
    if constexpr (std::is_same_v<T, float>)
        return v;
    else
        return round8_f32(v);
}

// exp(x) on 8 lanes, Cephes' expf: n = round(x log2 e), f = x - n ln 2 (in two FMAs, ln 2 split so
// the first product is exact), exp(f) = 1 + f + f^2 P(f) (degree-5 minimax, |f| <= ln 2 / 2), times
// 2^n built in the exponent field. Relative error below 1.2e-7 (measured over [-87, 88.3] in steps
// of 1e-3; exp16's is 4e-6 there) in ~17 instructions (exp16 takes 10, at twice the width).
// Clamped as exp16 is below (exp(-87)), and above at 88.3 (n <= 127, so 2^n is a normal float): SiLU
// of a gate below -88.3 is then ~-4e-37 (through exp16, -0 below -88.7), nothing a sum or bf16 keeps.
AVX2 inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.3f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 f = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    f = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), f);
    static constexpr float c[6] = {5.0000001201e-1f, 1.6666665459e-1f, 4.1665795894e-2f,
                                   8.3334519073e-3f, 1.3981999507e-3f, 1.9875691500e-4f};
    __m256 p = _mm256_set1_ps(c[5]);
    for (int i = 4; i >= 0; --i) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(c[i]));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(f, f), _mm256_add_ps(f, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
    return _mm256_mul_ps(p, _mm256_castsi256_ps(_mm256_slli_epi32(e, 23)));
}

// The fixed reduction order of 8 lanes: lane j with lane j+4, then j with j+2, j with j+1.
AVX2 inline float hsum8(__m256 v) {
    const __m128 b = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));
    return _mm_cvtss_f32(_mm_add_ss(c, _mm_movehdup_ps(c)));
}

// reduce4 on 8 lanes: [sum(a), sum(b), sum(c), sum(d)], each from its own vector's lanes by a fixed tree.
AVX2 inline __m128 reduce4x8(__m256 a, __m256 b, __m256 c, __m256 d) {
    const __m256 ab = _mm256_add_ps(_mm256_unpacklo_ps(a, b), _mm256_unpackhi_ps(a, b));
    const __m256 cd = _mm256_add_ps(_mm256_unpacklo_ps(c, d), _mm256_unpackhi_ps(c, d));
    const __m256 abcd = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(_mm256_castps_pd(ab), _mm256_castps_pd(cd))),
                                      _mm256_castpd_ps(_mm256_unpackhi_pd(_mm256_castps_pd(ab), _mm256_castps_pd(cd))));
    return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

// ---- one name per operation for both widths -------------------------------------------------------
//
// The kernels written once for both families (rowwise_lanes.h, linear_lanes.h) call these. A function
// compiles for one ISA only (its target attribute cannot depend on a template argument), so each such
// file is included twice, in namespace avx512 with V = Lanes16 under LANES_TARGET = AVX512 and in
// namespace avx2 with V = Lanes8 under AVX2; the 16-lane members are the helpers above, unchanged, so
// the AVX-512 kernels keep their bits.
struct Lanes16 {
    using F = __m512;
    using W = __m512i;  // one k-step of bf16 weights: 16 (even, odd) pairs
    static constexpr int N = 16;
    AVX512 static F zero() { return _mm512_setzero_ps(); }
    AVX512 static F set1(float x) { return _mm512_set1_ps(x); }
    AVX512 static F add(F a, F b) { return _mm512_add_ps(a, b); }
    AVX512 static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
    AVX512 static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
    AVX512 static F div(F a, F b) { return _mm512_div_ps(a, b); }
    AVX512 static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
    AVX512 static F loadu(const float* p) { return _mm512_loadu_ps(p); }
    template <typename T>
    AVX512 static F loadn(const T* p, int64_t n) {
        return load16m(p, first_lanes(n));
    }
    template <typename T>
    AVX512 static void storen(T* p, F v, int64_t n) {
        store16m(p, v, first_lanes(n));
    }
    template <typename T>
    AVX512 static F round(F v) {
        return round16<T>(v);
    }
    AVX512 static F exp(F x) { return exp16(x); }
    AVX512 static float hsum(F v) { return hsum16(v); }
    AVX512 static __m128 reduce4(F a, F b, F c, F d) { return minisgl::cpu::reduce4(a, b, c, d); }
    // The first min(n, 32) bf16 of a row (zeros past n), and their even / odd elements as float32;
    // whole vectors plain, as load16m.
    AVX512 static W load_pairs(const uint16_t* p, int64_t n) {
        if (n >= 32) return _mm512_loadu_si512(p);
        return _mm512_maskz_loadu_epi16((__mmask32(1) << n) - 1, p);
    }
    AVX512 static void split(W w, F& even, F& odd) {
        even = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
        odd = _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
    }
    // split's inverse, rounding each float32 to bf16 (round_to_bf16's bits), and its masked store.
    AVX512 static W join(F even, F odd) {
        return _mm512_or_si512(_mm512_slli_epi32(_mm512_cvtepu16_epi32(round_to_bf16(odd)), 16),
                               _mm512_cvtepu16_epi32(round_to_bf16(even)));
    }
    AVX512 static void store_pairs(uint16_t* p, W w, int64_t n) {
        if (n >= 32)
            _mm512_storeu_si512(p, w);
        else
            _mm512_mask_storeu_epi16(p, (__mmask32(1) << n) - 1, w);
    }
};

// 16 (even[i], odd[i]) pairs of bf16, word 2i from even and 2i + 1 from odd, in one 512-bit vector:
// vcvtne2ps2bf16 rounds both at once (even into the low 16 words, odd into the high; vcvtneps2bf16's
// bits, subnormals flushed), and one word permute interleaves them.
DPBF16 inline __m512i bf16_pairs(__m512 even, __m512 odd) {
    alignas(64) static constexpr int16_t pair_up[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
                                                        8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    return _mm512_permutexvar_epi16(_mm512_load_si512(pair_up), (__m512i)_mm512_cvtne2ps_pbh(odd, even));
}

// Lanes16 whose bf16 roundings take vcvtneps2bf16 (round_to_bf16_dp, round16_dp): the row-wise
// kernels of the AVX-512 families that have AVX512-BF16 (ISA_AVX512_BF16), with Lanes16's bits.
struct Lanes16Bf16 : Lanes16 {
    template <typename T>
    DPBF16 static void storen(T* p, F v, int64_t n) {
        if constexpr (std::is_same_v<T, float>)
            Lanes16::storen(p, v, n);
        else if (n >= 16)
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), round_to_bf16_dp(v));
        else
            _mm256_mask_storeu_epi16(p, first_lanes(n), round_to_bf16_dp(v));
    }
    template <typename T>
    DPBF16 static F round(F v) {
        if constexpr (std::is_same_v<T, float>)
            return v;
        else
            return round16_dp(v);
    }
    // Lanes16::join's bits, from bf16_pairs where no element is subnormal.
    DPBF16 static W join(F even, F odd) {
        if (__builtin_expect(has_denormal(even) || has_denormal(odd), 0)) return Lanes16::join(even, odd);
        return bf16_pairs(even, odd);
    }
};

struct Lanes8 {
    using F = __m256;
    using W = __m256i;  // 8 (even, odd) pairs
    static constexpr int N = 8;
    AVX2 static F zero() { return _mm256_setzero_ps(); }
    AVX2 static F set1(float x) { return _mm256_set1_ps(x); }
    AVX2 static F add(F a, F b) { return _mm256_add_ps(a, b); }
    AVX2 static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
    AVX2 static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
    AVX2 static F div(F a, F b) { return _mm256_div_ps(a, b); }
    AVX2 static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
    AVX2 static F loadu(const float* p) { return _mm256_loadu_ps(p); }
    template <typename T>
    AVX2 static F loadn(const T* p, int64_t n) {
        return load8n(p, n);
    }
    template <typename T>
    AVX2 static void storen(T* p, F v, int64_t n) {
        store8n(p, v, n);
    }
    template <typename T>
    AVX2 static F round(F v) {
        return round8<T>(v);
    }
    AVX2 static F exp(F x) { return exp8(x); }
    AVX2 static float hsum(F v) { return hsum8(v); }
    AVX2 static __m128 reduce4(F a, F b, F c, F d) { return reduce4x8(a, b, c, d); }
    AVX2 static W load_pairs(const uint16_t* p, int64_t n) {
        if (n >= 16) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
        alignas(32) uint16_t b[16] = {};
        std::memcpy(b, p, static_cast<size_t>(n) * 2);
        return _mm256_load_si256(reinterpret_cast<const __m256i*>(b));
    }
    AVX2 static void split(W w, F& even, F& odd) {
        even = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
        odd = _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
    }
    AVX2 static W join(F even, F odd) {  // round8_f32 leaves the bf16 bits high, zeros below
        return _mm256_or_si256(_mm256_castps_si256(round8_f32(odd)),
                               _mm256_srli_epi32(_mm256_castps_si256(round8_f32(even)), 16));
    }
    AVX2 static void store_pairs(uint16_t* p, W w, int64_t n) {
        if (n >= 16) {
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), w);
            return;
        }
        alignas(32) uint16_t b[16];
        _mm256_store_si256(reinterpret_cast<__m256i*>(b), w);
        std::memcpy(p, b, static_cast<size_t>(n) * 2);
    }
};

}  // namespace minisgl::cpu
