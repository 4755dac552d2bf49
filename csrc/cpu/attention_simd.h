// The AVX-512 pieces both halves of the AVX-512 paged attention use (attention.cpp: the blocks of
// rows, the FMA scorer and the attention loops; attention_bf16.cpp: the bf16 scorers on the tile unit
// and vdpbf16ps, and the V sum on vdpbf16ps): register helpers, the V-sum loop, the softmax, and the
// bf16 scorers' entry points. Internal to csrc/cpu/.
#pragma once

#include <cmath>
#include <cstdint>

#include "attention.h"
#include "common.h"

namespace minisgl::cpu::attn {

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

// Blocks of at least this many query vectors (rows x heads of the group) take attend_lanes.
constexpr int64_t LANES_FROM = 8;

// Which unit scores bf16 query vectors against keys (paged_attention's `scorer`): float32 FMAs over
// 16-dim chunks and a fixed reduction (attend_vectors, lane_scores), the tile unit (amx_scores), or
// vdpbf16ps (dp_scores). A row's bits depend on which one ran, so the choice is the machine's kernel
// family and never the rows'.
enum Scorer : int { SCORE_FMA = 0, SCORE_AMX = 1, SCORE_DP = 2 };

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
            r[l] = l < n ? _mm512_maskz_loadu_epi32(in_row,
                                                    q + (v0 + l) / g * q_stride + (kvh * g + (v0 + l) % g) * d + 2 * c)
                         : _mm512_setzero_si512();
        transpose16(r);
        for (int i = 0; i < take; ++i) _mm512_storeu_si512(qb + (c + i) * 16, r[i]);
    }
}

// ---- the bf16 scorers and the V sum on vdpbf16ps (attention_bf16.cpp) ----

DPBF16 void stage_value_pairs(const uint16_t* vpool, const BlockKeys& b, int64_t kvh, const AttnShape& s,
                              AttnScratch& w);
DPBF16 __attribute__((flatten)) void dp_value_sum(const uint16_t* vpool, int64_t rows, const int64_t* pos, int64_t kvh,
                                                  uint16_t* out, const AttnShape& s, const BlockKeys& b,
                                                  AttnScratch& w);
DPBF16 void dp_lanes_value_sum(const float* sc, __m512 inv, const BlockKeys& b, int64_t hi, const AttnShape& s,
                               AttnScratch& w, uint16_t* const* lane_out, int64_t n);
AVX512 void stage_value_tiles(const uint16_t* vpool, const BlockKeys& b, int64_t kvh, const AttnShape& s,
                              AttnScratch& w);
AMX void amx_vectors_value_sum(const uint16_t* vpool, int64_t rows, int64_t kvh, uint16_t* out, const AttnShape& s,
                               const BlockKeys& b, AttnScratch& w);
AMX void amx_lanes_value_sum(const float* sc, __m512 inv, const BlockKeys& b, int64_t hi, const AttnShape& s,
                             AttnScratch& w, uint16_t* const* lane_out, int64_t n);
AMX void configure_score_tiles();
AMX void release_tiles();
AMX void amx_scores(const uint16_t* kpool, const int64_t* table, const AttnShape& s, int64_t kvh, int64_t lo,
                    int64_t hi, const uint32_t* qb, float* sc, uint16_t* stage);
DPBF16 void stage_keys(const uint16_t* kpool, const BlockKeys& b, int64_t kvh, int64_t d, AttnScratch& w);
DPBF16 void dp_scores(const uint16_t* keys, const AttnShape& s, int64_t lo, int64_t hi, const uint32_t* qb, float* sc);
AVX512 void attend_vectors_bf16(const uint16_t* q, int64_t q_stride, int64_t rows, const uint16_t* kpool,
                                const uint16_t* vpool, const int64_t* table, const int64_t* pos, int64_t kvh,
                                uint16_t* out, const AttnShape& s, const BlockKeys& b, int scorer, AttnScratch& w);

// Which V sum follows a bf16 scorer: float32 FMAs (the FMA scorer's), vdpbf16ps (the dp scorer's) or
// the tile unit (the AMX scorer's). Like the scorer, it is the machine's kernel family's.
enum ValueSum : int { SUM_FMA = 0, SUM_DP = 1, SUM_AMX = 2 };

// The softmax and the sum over V of rows x g query vectors whose scores lie in w.scores, [vector][span]
// from key `base` (attend_vectors', or the tile unit's for few vectors): the softmax one vector at a
// time, 16 keys per lane tile; the V sum in registers, up to 6 vectors of a row at a time, or on
// the tile unit.
template <typename T>
AVX512 void softmax_and_sum(const T* vpool, int64_t rows, const int64_t* pos, int64_t kvh, T* out, const AttnShape& s,
                            const BlockKeys& b, AttnScratch& w, ValueSum sum = SUM_FMA) {
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
            for (int64_t t = t0; t <= t1; t += 16)
                _mm512_storeu_ps(sh + t, _mm512_mul_ps(_mm512_loadu_ps(sh + t), inv));
        }
    }
    if constexpr (std::is_same_v<T, uint16_t>) {
        if (sum == SUM_DP) return dp_value_sum(vpool, rows, pos, kvh, out, s, b, w);
        if (sum == SUM_AMX) return amx_vectors_value_sum(vpool, rows, kvh, out, s, b, w);
    }
    value_sum(FmaSteps<T>{vpool + kvh * d, w.offsets.data(), lo, w.scores.data() - base, span}, rows, b, pos, kvh, out,
              s);
}

}  // namespace minisgl::cpu::attn
