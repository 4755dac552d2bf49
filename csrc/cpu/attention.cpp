// paged_attention: every query row over its paged K/V, read in place through its block table (no
// gather of every row's context into a fresh tensor per layer), OpenMP over (block of rows, KV head).
// Decode rows take one query vector at a time (attend_vectors), prefill blocks 16 query vectors per
// register (attend_lanes). bf16 scores come from one of three scorers, the machine's kernel family's:
// float32 FMAs, the AMX tile unit (amx_scores) or vdpbf16ps (dp_scores, with its V sum on vdpbf16ps
// too); float32 rows always take the FMA scorer. The avx2 family's blocks run attention_avx2.cpp's
// 8-lane FMA attention instead (isa). Head dims the vector paths do not take (not a multiple of the
// lane width, or over 256) take the scalar attend_group, compiled for the family's ISA.
//
// Bit-exactness: a row's bits depend only on its query, its position, the cached keys and values,
// the ISA and the scorer, never on the other rows of the call, the block they share or the thread
// count (the contract is spelled out above ATTN_BLOCK, attention.h), so it serves decode rows and,
// in the batch-invariant forward, every row.

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <vector>

#include "attention.h"
#include "common.h"
#include "kernels.h"

namespace minisgl::cpu {
namespace {

// One (sequence, KV head): the group's query heads against keys [first, pos], softmax in float32.
// Plain C++ that the compiler vectorises for the ISA of the function it is inlined into: attend_group
// (the AVX-512 families', compiled for x86-64-v4) or attend_group_avx2.
template <typename T>
__attribute__((always_inline)) inline void attend_group_body(const T* q, const T* kpool, const T* vpool,
                                                             const int64_t* table, int64_t pos, int64_t kvh, T* out,
                                                             const AttnShape& s, std::vector<float>& scores,
                                                             std::vector<float>& acc) {
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
__attribute__((target("arch=x86-64-v4"))) void attend_group(const T* q, const T* kpool, const T* vpool,
                                                           const int64_t* table, int64_t pos, int64_t kvh, T* out,
                                                           const AttnShape& s, std::vector<float>& scores,
                                                           std::vector<float>& acc) {
    attend_group_body(q, kpool, vpool, table, pos, kvh, out, s, scores, acc);
}

template <typename T>
AVX2 void attend_group_avx2(const T* q, const T* kpool, const T* vpool, const int64_t* table, int64_t pos,
                            int64_t kvh, T* out, const AttnShape& s, std::vector<float>& scores,
                            std::vector<float>& acc) {
    attend_group_body(q, kpool, vpool, table, pos, kvh, out, s, scores, acc);
}

// The same attention on AVX-512 (head_dim a multiple of 16, up to 256) for a block of up to
// ATTN_BLOCK query rows (attention.h: the blocks, and the contract that makes a row's bits its own).

// hsum16's tree (common.h) across 16 vectors, lane by lane: lane l of vsum16(p) has the bits of
// hsum16 of the vector whose lanes are p[0..15][l].
AVX512 inline __m512 vsum16(__m512* p) {
    for (int w = 8; w >= 1; w /= 2)
        for (int j = 0; j < w; ++j) p[j] = _mm512_add_ps(p[j], p[j + w]);
    return p[0];
}

// r[j] lane i -> r[i] lane j: a 16 x 16 matrix of 32-bit elements transposed in registers.
AVX512 inline void transpose16(__m512i* r) {
    __m512i t[16];
    for (int j = 0; j < 16; j += 2) {
        t[j] = _mm512_unpacklo_epi32(r[j], r[j + 1]);
        t[j + 1] = _mm512_unpackhi_epi32(r[j], r[j + 1]);
    }
    for (int a = 0; a < 16; a += 4) {  // u[a + c]'s 128-bit lane L: rows a..a+3 of column 4L + c
        r[a] = _mm512_unpacklo_epi64(t[a], t[a + 2]);
        r[a + 1] = _mm512_unpackhi_epi64(t[a], t[a + 2]);
        r[a + 2] = _mm512_unpacklo_epi64(t[a + 1], t[a + 3]);
        r[a + 3] = _mm512_unpackhi_epi64(t[a + 1], t[a + 3]);
    }
    for (int c = 0; c < 4; ++c) {  // a 4 x 4 transpose of 128-bit lanes across r[c], r[4 + c], r[8 + c], r[12 + c]
        const __m512i v0 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x44), v1 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xEE);
        const __m512i v2 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x44);
        const __m512i v3 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xEE);
        t[c] = _mm512_shuffle_i32x4(v0, v2, 0x88);
        t[4 + c] = _mm512_shuffle_i32x4(v0, v2, 0xDD);
        t[8 + c] = _mm512_shuffle_i32x4(v1, v3, 0x88);
        t[12 + c] = _mm512_shuffle_i32x4(v1, v3, 0xDD);
    }
    for (int i = 0; i < 16; ++i) r[i] = t[i];
}

// acc[i] lane l = dim c0 + i of lane l's output vector (a lane group's V sum, dims in registers):
// transposed, each of the first n lanes' 16 dims stored at lane_out[l] + c0, rounded as store16m
// (store's bits, sixteen at a time), instead of 16 x n scalar stores.
template <typename T>
AVX512 inline void store_lanes(const __m512* acc, T* const* lane_out, int64_t n, int64_t c0) {
    __m512i r[16];
    for (int i = 0; i < 16; ++i) r[i] = _mm512_castps_si512(acc[i]);
    transpose16(r);
    for (int64_t l = 0; l < n; ++l) store16m(lane_out[l] + c0, _mm512_castsi512_ps(r[l]), 0xffff);
}

// The keys of the 16-key tile from key t that lie in [first, last], as lanes.
inline __mmask16 tile_lanes(int64_t first, int64_t last, int64_t t) {
    const int64_t a = std::max<int64_t>(first - t, 0), e = std::min<int64_t>(last - t, 15);
    return static_cast<__mmask16>(((1u << (e + 1)) - 1) & ~((1u << a) - 1));
}

// The V sum of a block's rows x g query vectors whose probabilities are ready ([vector][span] from
// key `base`), for the FMA and the dp sum alike: up to 64 dims of up to 6 vectors of a row at a time
// in 24 accumulators, each output element one chain over the row's steps in order, each V chunk
// loaded once for the group (accumulators kept in memory instead would make this loop dominate
// decode attention). `Steps` says what one step is (FmaSteps: a key; DpSteps: a key pair).
template <typename Steps, typename T>
AVX512 inline void value_sum(const Steps& steps, int64_t rows, const BlockKeys& b, const int64_t* pos, int64_t kvh,
                             T* out, const AttnShape& s) {
    const int64_t d = s.head_dim, g = s.heads / s.kv_heads, chunks = d / 16;
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t h0 = 0; h0 < g; h0 += 6) {
            const int64_t nv = std::min<int64_t>(6, g - h0);
            const auto* p = steps.p + (r * g + h0) * steps.span;  // p[v * span + key]
            T* o = out + r * s.heads * d + (kvh * g + h0) * d;
            for (int64_t c0 = 0; c0 < chunks; c0 += 4) {
                const int64_t nc = std::min<int64_t>(4, chunks - c0);
                __m512 acc[6][4];
                for (auto& a : acc)
                    for (auto& x : a) x = _mm512_setzero_ps();
                for (int64_t t = Steps::step(b.first[r]); t <= Steps::step(pos[r]); ++t) {
                    const auto* vr = steps.values(t) + c0 * 16;
                    typename Steps::Vec vv[4];
                    for (int c = 0; c < 4; ++c)
                        if (c < nc) vv[c] = Steps::load(vr + c * 16);
                    for (int v = 0; v < 6; ++v) {
                        if (v >= nv) break;
                        const typename Steps::Vec pv = Steps::prob(p + v * steps.span, t);
                        for (int c = 0; c < 4; ++c)
                            if (c < nc) acc[v][c] = Steps::add(acc[v][c], vv[c], pv);
                    }
                }
                for (int64_t v = 0; v < nv; ++v)
                    for (int64_t c = 0; c < nc; ++c) store16m(o + v * d + (c0 + c) * 16, acc[v][c], 0xffff);
            }
        }
}

// value_sum's step with the FMA scorer: one key, its V row converted to float32, the vector's
// probability broadcast, one FMA per key (as attend_lanes').
template <typename T>
struct FmaSteps {
    using Vec = __m512;
    const T* v;  // the KV head's V rows: key `key`'s at v + offsets[key - lo]
    const int64_t* offsets;
    int64_t lo;
    const float* p;  // the probabilities, p[vector * span + key]
    int64_t span;

    static int64_t step(int64_t key) { return key; }
    const T* values(int64_t key) const { return v + offsets[key - lo]; }
    AVX512 static __m512 load(const T* vr) { return load16(vr); }
    AVX512 static __m512 prob(const float* pv, int64_t key) { return _mm512_set1_ps(pv[key]); }
    AVX512 static __m512 add(__m512 acc, __m512 vv, __m512 pv) { return _mm512_fmadd_ps(pv, vv, acc); }
};

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

// value_sum's step with the dp scorer: the key pair t = (2t, 2t + 1), the pair's V rows interleaved
// by stage_value_pairs, the vector's two bf16 probabilities broadcast as one 32-bit pair.
struct DpSteps {
    using Vec = __m512bh;
    const uint32_t* vpair;  // [t - p0][dim]
    int64_t p0, d;
    const uint16_t* p;  // the probabilities, p[vector * span + key]
    int64_t span;

    static int64_t step(int64_t key) { return key / 2; }
    const uint32_t* values(int64_t t) const { return vpair + (t - p0) * d; }
    AVX512 static __m512bh load(const uint32_t* vr) { return (__m512bh)_mm512_loadu_si512(vr); }
    AVX512 static __m512bh prob(const uint16_t* pv, int64_t t) {
        int32_t pair;
        std::memcpy(&pair, pv + 2 * t, 4);
        return (__m512bh)_mm512_set1_epi32(pair);
    }
    DPBF16 static __m512 add(__m512 acc, __m512bh vv, __m512bh pv) { return _mm512_dpbf16_ps(acc, vv, pv); }
};

// DpSteps' V sum for head_dim a multiple of 64, reading the pairs' V rows in place: each 32-dim half of
// a 64-dim chunk of keys 2t and 2t + 1 is interleaved into (2t, 2t + 1) pairs in registers
// (vpunpck{l,h}wd: dims 8L..8L+3 and 8L+4..8L+7 of each 128-bit lane L), so the accumulators hold
// the dims in that order until a permute at the end puts them back. Each output element is the same
// chain over the same pairs as value_sum's over stage_value_pairs' layout, so the same bits, without
// writing every V row of the block out and reading it back (a staging pass that costs a large share of
// the decode V sum).
DPBF16 void dp_value_sum_in_place(const uint16_t* vpool, int64_t rows, const int64_t* pos, int64_t kvh, uint16_t* out,
                                  const AttnShape& s, const BlockKeys& b, const AttnScratch& w, int64_t span,
                                  int64_t base) {
    const int64_t d = s.head_dim, g = s.heads / s.kv_heads;
    alignas(64) static constexpr int32_t low_dims[16] = {0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23};
    alignas(64) static constexpr int32_t high_dims[16] = {8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31};
    const __m512i lo_idx = _mm512_load_si512(low_dims), hi_idx = _mm512_load_si512(high_dims);
    const auto row_at = [&](int64_t key, int64_t c0) -> const uint16_t* {  // outside [lo, hi]: none (zeros)
        return key < b.lo || key > b.hi ? nullptr : vpool + w.offsets[key - b.lo] + kvh * d + c0;
    };
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t h0 = 0; h0 < g; h0 += 6) {
            const int64_t nv = std::min<int64_t>(6, g - h0);
            const uint16_t* p = w.pb.data() + (r * g + h0) * span - base;  // p[v * span + key]
            for (int64_t c0 = 0; c0 < d; c0 += 64) {
                __m512 acc[6][4];
                for (auto& a : acc)
                    for (auto& x : a) x = _mm512_setzero_ps();
                for (int64_t t = b.first[r] / 2; t <= pos[r] / 2; ++t) {
                    const uint16_t* ve = row_at(2 * t, c0);
                    const uint16_t* vo = row_at(2 * t + 1, c0);
                    const __m512i e0 = ve ? _mm512_loadu_si512(ve) : _mm512_setzero_si512();
                    const __m512i e1 = ve ? _mm512_loadu_si512(ve + 32) : _mm512_setzero_si512();
                    const __m512i o0 = vo ? _mm512_loadu_si512(vo) : _mm512_setzero_si512();
                    const __m512i o1 = vo ? _mm512_loadu_si512(vo + 32) : _mm512_setzero_si512();
                    const __m512bh vv[4] = {(__m512bh)_mm512_unpacklo_epi16(e0, o0), (__m512bh)_mm512_unpackhi_epi16(e0, o0),
                                            (__m512bh)_mm512_unpacklo_epi16(e1, o1), (__m512bh)_mm512_unpackhi_epi16(e1, o1)};
                    for (int v = 0; v < 6; ++v) {
                        if (v >= nv) break;
                        int32_t pair;
                        std::memcpy(&pair, p + v * span + 2 * t, 4);
                        const __m512bh pv = (__m512bh)_mm512_set1_epi32(pair);
                        for (int c = 0; c < 4; ++c) acc[v][c] = _mm512_dpbf16_ps(acc[v][c], vv[c], pv);
                    }
                }
                for (int64_t v = 0; v < nv; ++v) {
                    uint16_t* o = out + r * s.heads * d + (kvh * g + h0 + v) * d + c0;
                    for (int half = 0; half < 2; ++half) {
                        const __m512 lo = acc[v][2 * half], hi = acc[v][2 * half + 1];
                        store16m(o + half * 32, _mm512_permutex2var_ps(lo, lo_idx, hi), 0xffff);
                        store16m(o + half * 32 + 16, _mm512_permutex2var_ps(lo, hi_idx, hi), 0xffff);
                    }
                }
            }
        }
}

// The decode blocks' V sum (softmax_and_sum's, with the dp scorer): lanes = 16 dims; each vector's
// probabilities rounded to bf16 over the span (zero outside its keys), each pair broadcast.
// flatten: value_sum is AVX512 (it is the FMA sum's too), and DpSteps::add's vdpbf16ps can be inlined
// only into a function compiled for AVX512-BF16; flattened into this one, the loop keeps it inline.
DPBF16 __attribute__((flatten)) void dp_value_sum(const uint16_t* vpool, int64_t rows, const int64_t* pos,
                                                  int64_t kvh, uint16_t* out, const AttnShape& s, const BlockKeys& b,
                                                  AttnScratch& w) {
    const int64_t d = s.head_dim, g = s.heads / s.kv_heads;
    const int64_t base = b.lo / 16 * 16, span = (b.hi / 16 + 1) * 16 - base, p0 = b.lo / 2;
    w.pb.assign(static_cast<size_t>(rows * g * span), 0);
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t h = 0; h < g; ++h) {
            const float* sh = w.scores.data() + (r * g + h) * span;
            uint16_t* ph = w.pb.data() + (r * g + h) * span;
            for (int64_t t = b.first[r] / 16 * 16; t <= pos[r]; t += 16) {
                const __m512 x = _mm512_maskz_loadu_ps(tile_lanes(b.first[r], pos[r], t), sh + t - base);
                _mm256_storeu_si256(reinterpret_cast<__m256i*>(ph + t - base), (__m256i)_mm512_cvtneps_pbh(x));
            }
        }
    if (d % 64 == 0) return dp_value_sum_in_place(vpool, rows, pos, kvh, out, s, b, w, span, base);
    stage_value_pairs(vpool, b, kvh, s, w);
    value_sum(DpSteps{w.vpair.data(), p0, d, w.pb.data() - base, span}, rows, b, pos, kvh, out, s);
}

// A prefill block's V sum for one lane group (attend_lanes', with the dp scorer): sc[key * 16 + lane]
// the exponentials of keys lo..hi, normalized (x inv, each lane's 1 / sum) as they are rounded to
// bf16 pairs; the first n lanes' sums stored at lane_out[lane] (store_lanes).
DPBF16 void dp_lanes_value_sum(const float* sc, __m512 inv, const BlockKeys& b, const AttnShape& s, AttnScratch& w,
                               uint16_t* const* lane_out, int64_t n) {
    const int64_t d = s.head_dim, p0 = b.lo / 2, pairs = b.hi / 2 - p0 + 1;
    w.ppair.resize(static_cast<size_t>(pairs * 16));
    for (int64_t t = 0; t < pairs; ++t) {
        const int64_t ke = 2 * (p0 + t), ko = ke + 1;
        const __m512 e = ke >= b.lo ? _mm512_mul_ps(_mm512_loadu_ps(sc + ke * 16), inv) : _mm512_setzero_ps();
        const __m512 o = ko <= b.hi ? _mm512_mul_ps(_mm512_loadu_ps(sc + ko * 16), inv) : _mm512_setzero_ps();
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
        store_lanes(acc, lane_out, n, c * 16);
    }
}

// The softmax and the sum over V of rows x g query vectors whose scores lie in w.scores, [vector][span]
// from key `base` (attend_vectors', or the tile unit's for few vectors): the softmax one vector at a
// time, 16 keys per lane tile; the V sum in registers, up to 6 vectors of a row at a time.
template <typename T>
AVX512 void softmax_and_sum(const T* vpool, int64_t rows, const int64_t* pos, int64_t kvh, T* out, const AttnShape& s,
                            const BlockKeys& b, AttnScratch& w, bool dp = false) {
    const int64_t d = s.head_dim, g = s.heads / s.kv_heads;
    const int64_t lo = b.lo, hi = b.hi, base = lo / 16 * 16, span = (hi / 16 + 1) * 16 - base;
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t t0 = b.first[r] / 16 * 16, t1 = pos[r] / 16 * 16;
        const auto lanes = [&](int64_t t) { return tile_lanes(b.first[r], pos[r], t); };
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
    value_sum(FmaSteps<T>{vpool + kvh * d, w.offsets.data(), lo, w.scores.data() - base, span}, rows, b, pos, kvh,
              out, s);
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
// Sixteen keys at a time keep sixteen chains in flight (eight leave the dot-product unit idle between
// dependent steps); keys of the 16-key tiles
// outside [lo, hi] score zero, as amx_scores' staged zeros. Read in place, whatever the block size.
DPBF16 void dp_scores(const uint16_t* kpool, const int64_t* table, const AttnShape& s, int64_t kvh, int64_t lo,
                      int64_t hi, const uint32_t* qb, float* sc) {
    const __m512 scale = _mm512_set1_ps(s.scale);
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
        for (int j = 0; j < nk; ++j) _mm512_storeu_ps(sc + (k0 + j - base) * 16, _mm512_mul_ps(acc[j], scale));
    }
}

// The query vectors v0..v0+n-1 of a block (lane l: row (v0 + l) / g, head (v0 + l) % g of the
// group) as the tile unit's B operand: k-step by k-step, 16 pairs x 16 lanes of (dim 2i, dim 2i+1),
// the raw bf16 bits; lanes past n are zero.
AVX512 inline void pack_query_pairs(const uint16_t* q, int64_t q_stride, int64_t v0, int64_t n, int64_t kvh,
                                    const AttnShape& s, uint32_t* qb) {
    const int64_t d = s.head_dim, g = s.heads / s.kv_heads, pairs = d / 2;
    for (int64_t c = 0; c < pairs; c += 16) {  // head_dim a multiple of 16: 8 or 16 pairs at a time
        const int take = static_cast<int>(std::min<int64_t>(16, pairs - c));
        const __mmask16 in_row = static_cast<__mmask16>((1u << take) - 1);
        __m512i r[16];
        for (int64_t l = 0; l < 16; ++l)
            r[l] = l < n ? _mm512_maskz_loadu_epi32(in_row, q + (v0 + l) / g * q_stride + (kvh * g + (v0 + l) % g) * d + 2 * c)
                         : _mm512_setzero_si512();
        transpose16(r);
        for (int i = 0; i < take; ++i) _mm512_storeu_si512(qb + (c + i) * 16, r[i]);
    }
}

// dp_scores for the few query vectors of a decode block, with the keys in the lanes instead: a
// 16-key tile's K rows are transposed to (dim 2i, dim 2i+1) pairs x 16 keys (`stage`), and each
// vector's pair i is broadcast against them. Every lane runs the chain dp_scores runs for that
// (query, key), acc += q(2i) k(2i) + q(2i+1) k(2i+1) over the pairs in order from zero (the two
// products are exact in float32, so which operand holds the query does not change a bit), without
// dp_scores' 16 - N idle lanes (a decode row of SmolLM2 has 3 query vectors per KV head, and scoring
// is most of decode attention). T tiles at a time keep T x N chains in flight.
// sc[v * span + key - base] = score x scale for every key of the tiles; keys outside [lo, hi] hold a
// repeated key's score, which the softmax masks out as it does every key outside a row's range.
template <int N>
DPBF16 void dp_key_scores(const uint16_t* kpool, const int64_t* offsets, int64_t lo, int64_t hi, int64_t kvh,
                          int64_t d, const uint16_t* const* qp, float scale, float* sc, int64_t span,
                          uint32_t* stage) {
    constexpr int T = N == 1 ? 8 : N == 2 ? 6 : N == 3 ? 4 : N <= 5 ? 3 : 2;
    const int64_t base = lo / 16 * 16, pairs = d / 2;
    for (int64_t t0 = base; t0 <= hi; t0 += 16 * T) {
        const int nt = static_cast<int>(std::min<int64_t>(T, (hi - t0) / 16 + 1));
        for (int u = 0; u < nt; ++u) {
            const uint16_t* kr[16];
            for (int j = 0; j < 16; ++j) {
                const int64_t key = std::clamp<int64_t>(t0 + 16 * u + j, lo, hi);
                kr[j] = kpool + offsets[key - lo] + kvh * d;
            }
            for (int64_t c = 0; c < pairs; c += 16) {  // head_dim a multiple of 16: 8 or 16 pairs at a time
                const int take = static_cast<int>(std::min<int64_t>(16, pairs - c));
                const __mmask16 in_row = static_cast<__mmask16>((1u << take) - 1);
                __m512i r[16];
                for (int j = 0; j < 16; ++j) r[j] = _mm512_maskz_loadu_epi32(in_row, kr[j] + 2 * c);
                transpose16(r);
                for (int i = 0; i < take; ++i) _mm512_storeu_si512(stage + (u * pairs + c + i) * 16, r[i]);
            }
        }
        __m512 acc[T][N];
        for (auto& a : acc)
            for (auto& x : a) x = _mm512_setzero_ps();
        for (int64_t i = 0; i < pairs; ++i) {
            __m512bh qb[N];
            for (int v = 0; v < N; ++v) {
                int32_t pair;
                std::memcpy(&pair, qp[v] + 2 * i, 4);
                qb[v] = (__m512bh)_mm512_set1_epi32(pair);
            }
            for (int u = 0; u < T; ++u) {
                if (u >= nt) break;
                const __m512bh kt = (__m512bh)_mm512_loadu_si512(stage + (u * pairs + i) * 16);
                for (int v = 0; v < N; ++v) acc[u][v] = _mm512_dpbf16_ps(acc[u][v], kt, qb[v]);
            }
        }
        const __m512 sv = _mm512_set1_ps(scale);
        for (int u = 0; u < nt; ++u)
            for (int v = 0; v < N; ++v)
                _mm512_storeu_ps(sc + v * span + t0 + 16 * u - base, _mm512_mul_ps(acc[u][v], sv));
    }
}

using KeyScores = void (*)(const uint16_t*, const int64_t*, int64_t, int64_t, int64_t, int64_t, const uint16_t* const*,
                           float, float*, int64_t, uint32_t*);

// The decode blocks' vector counts (rows x heads of the group below LANES_FROM).
KeyScores key_scores_for(int64_t vectors) {
    switch (vectors) {
        case 1: return dp_key_scores<1>;
        case 2: return dp_key_scores<2>;
        case 3: return dp_key_scores<3>;
        case 4: return dp_key_scores<4>;
        case 5: return dp_key_scores<5>;
        case 6: return dp_key_scores<6>;
        default: return dp_key_scores<7>;
    }
}

// Few query vectors (decode rows) on the tile unit or vdpbf16ps: their scores from amx_scores or
// dp_key_scores, then attend_vectors' softmax and V sum on them, one vector at a time ([vector][span]).
AVX512 void attend_vectors_bf16(const uint16_t* q, int64_t q_stride, int64_t rows, const uint16_t* kpool,
                                const uint16_t* vpool, const int64_t* table, const int64_t* pos, int64_t kvh,
                                uint16_t* out, const AttnShape& s, const BlockKeys& b, int scorer, AttnScratch& w) {
    const int64_t g = s.heads / s.kv_heads, n = rows * g;
    const int64_t base = b.lo / 16 * 16, span = (b.hi / 16 + 1) * 16 - base;
    if (scorer == SCORE_DP) {
        const uint16_t* qp[LANES_FROM];
        for (int64_t l = 0; l < n; ++l) qp[l] = q + l / g * q_stride + (kvh * g + l % g) * s.head_dim;
        w.scores.resize(static_cast<size_t>(n * span));
        w.vpair.resize(static_cast<size_t>(16 * 8 * s.head_dim));  // up to 8 tiles of pairs x 16 keys
        key_scores_for(n)(kpool, w.offsets.data(), b.lo, b.hi, kvh, s.head_dim, qp, s.scale, w.scores.data(), span,
                          w.vpair.data());
        if (s.softcap > 0.0f)
            for (int64_t l = 0; l < n; ++l)
                for (int64_t key = b.first[l / g]; key <= pos[l / g]; ++key) {
                    float& v = w.scores[l * span + key - base];
                    v = s.softcap * std::tanh(v / s.softcap);
                }
        return softmax_and_sum<uint16_t>(vpool, rows, pos, kvh, out, s, b, w, true);
    }
    w.q.resize(static_cast<size_t>(s.head_dim * 16));
    w.kf.resize(static_cast<size_t>(span * 16));
    w.stage.resize(static_cast<size_t>(16 * s.head_dim));
    auto* qb = reinterpret_cast<uint32_t*>(w.q.data());
    pack_query_pairs(q, q_stride, 0, n, kvh, s, qb);
    amx_scores(kpool, table, s, kvh, b.lo, b.hi, qb, w.kf.data(), w.stage.data());  // kf[key - base][lane]
    w.scores.assign(static_cast<size_t>(n * span), 0.0f);
    for (int64_t l = 0; l < n; ++l)
        for (int64_t key = b.first[l / g]; key <= pos[l / g]; ++key) {
            float v = w.kf[(key - base) * 16 + l] * s.scale;
            if (s.softcap > 0.0f) v = s.softcap * std::tanh(v / s.softcap);
            w.scores[l * span + key - base] = v;
        }
    softmax_and_sum<uint16_t>(vpool, rows, pos, kvh, out, s, b, w);
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
        T* lane_out[16];  // lane l's output vector: row (v0 + l) / g, head kvh * g + (v0 + l) % g
        for (int64_t l = 0; l < n; ++l) lane_out[l] = out + (v0 + l) / g * s.heads * d + (kvh * g + (v0 + l) % g) * d;
        float* sc = w.scores.data() - base * 16;  // sc[key * 16 + lane]
        const __m512 scale = _mm512_set1_ps(s.scale);
        if constexpr (std::is_same_v<T, uint16_t>) {
            if (!fma) {
                auto* qb = reinterpret_cast<uint32_t*>(w.q.data());
                pack_query_pairs(q, q_stride, v0, n, kvh, s, qb);
                if (scorer == SCORE_AMX) {
                    amx_scores(kpool, table, s, kvh, lo, b.hi, qb, w.scores.data(), w.stage.data());
                    for (int64_t key = lo; key <= b.hi; ++key)
                        _mm512_storeu_ps(sc + key * 16, _mm512_mul_ps(_mm512_loadu_ps(sc + key * 16), scale));
                } else {
                    dp_scores(kpool, table, s, kvh, lo, b.hi, qb, w.scores.data());  // scaled as it stores them
                }
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
        if constexpr (std::is_same_v<T, uint16_t>)
            if (dp) {
                dp_lanes_value_sum(sc, inv, b, s, w, lane_out, n);
                continue;
            }
        for (int64_t key = lo; key <= b.hi; ++key)
            _mm512_storeu_ps(sc + key * 16, _mm512_mul_ps(_mm512_loadu_ps(sc + key * 16), inv));
        for (int64_t c = 0; c < chunks; ++c) {
            __m512 acc[16];
            for (auto& a : acc) a = _mm512_setzero_ps();
            for (int64_t j = 0; j < keys; ++j) {
                const __m512 p = _mm512_loadu_ps(sc + (lo + j) * 16);
                const float* vr = w.vf.data() + j * d + c * 16;
                for (int i = 0; i < 16; ++i) acc[i] = _mm512_fmadd_ps(p, _mm512_set1_ps(vr[i]), acc[i]);
            }
            store_lanes(acc, lane_out, n, c * 16);
        }
    }
}

template <typename T>
AVX512 void attend_block(const T* q, int64_t q_stride, int64_t rows, const T* kpool, const T* vpool,
                         const int64_t* table, const int64_t* pos, int64_t kvh, T* out, const AttnShape& s,
                         int scorer, AttnScratch& w) {
    const BlockKeys b = block_keys(table, pos, rows, s, w);
    if (rows * (s.heads / s.kv_heads) >= LANES_FROM)
        return attend_lanes<T>(q, q_stride, rows, kpool, vpool, table, pos, kvh, out, s, b, scorer, w);
    prefetch_rows(kpool, b, kvh, s, w);
    prefetch_rows(vpool, b, kvh, s, w);
    if constexpr (std::is_same_v<T, uint16_t>)
        if (scorer != SCORE_FMA)
            return attend_vectors_bf16(q, q_stride, rows, kpool, vpool, table, pos, kvh, out, s, b, scorer, w);
    attend_vectors<T>(q, q_stride, rows, kpool, vpool, pos, kvh, out, s, b, w);
}

}  // namespace

template <typename T>
void paged_attention_t(uintptr_t q, int64_t q_stride, uintptr_t k, uintptr_t v, uintptr_t tables,
                       const int64_t* row_table, const int64_t* positions, uintptr_t out, int64_t n,
                       const AttnShape& s, int scorer, int threads, int isa) {
    const auto* qp = reinterpret_cast<const T*>(q);
    const auto* kp = reinterpret_cast<const T*>(k);
    const auto* vp = reinterpret_cast<const T*>(v);
    const auto* tp = reinterpret_cast<const int64_t*>(tables);
    auto* op = reinterpret_cast<T*>(out);
    const int64_t per_row = s.heads * s.head_dim;
    const bool avx2 = require_isa(isa) == ISA_AVX2;
    const bool vector = s.head_dim % (avx2 ? 8 : 16) == 0 && s.head_dim <= 256;
    // The tile unit or vdpbf16ps scores bf16 rows: on a machine that has it, every block of every
    // call (the bits of a row depend on which scorer ran, so the choice depends on the machine's
    // kernel family and the shape only). Otherwise, and for float32 and the avx2 family, the FMA scorer.
    const bool bf16_scorer = vector && !avx2 && std::is_same_v<T, uint16_t> &&
                             ((scorer == SCORE_AMX && s.head_dim % 32 == 0) || scorer == SCORE_DP);
    const int used = bf16_scorer ? scorer : SCORE_FMA;
    const bool tiles = used == SCORE_AMX;
    // Blocks: runs of up to ATTN_BLOCK consecutive rows on one table (one row each on the scalar path).
    std::vector<int64_t> starts;
    for (int64_t r = 0; r < n; ++r)
        if (!vector || r == 0 || row_table[r] != row_table[r - 1] || r - starts.back() == ATTN_BLOCK) starts.push_back(r);
    const int64_t blocks = static_cast<int64_t>(starts.size());
    starts.push_back(n);
    // One item at a time: a long prefill block costs many decode rows.
    run_parallel(threads, blocks * s.kv_heads, 1, [&](WorkShare& share, int slot) {
        AttnScratch w;
        bool configured = false;
        for (int64_t item, item_end; share.claim(slot, item, item_end);) {
            if (tiles && !configured) {
                configure_score_tiles();
                configured = true;
            }
            const int64_t b = item / s.kv_heads, kvh = item % s.kv_heads, r0 = starts[b];
            const int64_t* table = tp + row_table[r0] * s.table_stride;
            const T* qr = qp + r0 * q_stride;
            T* o = op + r0 * per_row;
            if (vector && avx2)
                attend_block_avx2<T>(qr, q_stride, starts[b + 1] - r0, kp, vp, table, positions + r0, kvh, o, s, w);
            else if (vector)
                attend_block<T>(qr, q_stride, starts[b + 1] - r0, kp, vp, table, positions + r0, kvh, o, s, used, w);
            else if (avx2)
                attend_group_avx2<T>(qr, kp, vp, table, positions[r0], kvh, o, s, w.scores, w.acc);
            else
                attend_group<T>(qr, kp, vp, table, positions[r0], kvh, o, s, w.scores, w.acc);
        }
        if (configured) release_tiles();
    });
}

// The decode stack's (bf16; paged_attention instantiates the float32 one).
template void paged_attention_t<uint16_t>(uintptr_t, int64_t, uintptr_t, uintptr_t, uintptr_t, const int64_t*,
                                          const int64_t*, uintptr_t, int64_t, const AttnShape&, int, int, int);

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
                     double softcap, int64_t window, bool bf16, int scorer, int threads, int isa) {
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
        paged_attention_t<uint16_t>(q, q_stride, k, v, tables, rt, pp, out, n, s, scorer, threads, isa);
    else
        paged_attention_t<float>(q, q_stride, k, v, tables, rt, pp, out, n, s, SCORE_FMA, threads, isa);
}

}  // namespace minisgl::cpu
