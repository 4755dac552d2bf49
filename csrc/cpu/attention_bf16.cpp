// The bf16 scorers of the AVX-512 paged attention (attention.cpp runs the blocks): the scores of
// query vectors against keys on the AMX tile unit (amx_scores) or on vdpbf16ps (dp_scores, and
// dp_key_scores for the few vectors of a decode block), and the V sum on the tile unit
// (amx_vectors_value_sum, amx_lanes_value_sum) or on vdpbf16ps (dp_value_sum, dp_lanes_value_sum).
// Each score and each output element is one chain in a fixed order, so a row's bits depend on its
// query, its keys and the scorer alone (attention.h states the contract).

#include <algorithm>
#include <cmath>
#include <vector>

#include "attention.h"
#include "attention_simd.h"
#include "common.h"
#include "kernels.h"

namespace minisgl::cpu::attn {

// 16 output elements rounded to bf16 (round_to_bf16_dp: round_to_bf16's bits in one instruction).
DPBF16 inline void store_bf16(uint16_t* p, __m512 v) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), round_to_bf16_dp(v));
}

// ---- the V sum on vdpbf16ps (the avx512bf16 family's attention) ----
//
// With the dp scorer the probabilities are rounded to bf16 and each output element is one vdpbf16ps
// chain over key pairs (2t, 2t + 1), pairs aligned to absolute key positions and taken in order:
// acc += p(2t) v(2t) + p(2t+1) v(2t+1), a key outside the row's range with p = 0. Half the
// instructions of the float32 FMA sum, and the same bits whether the lanes are a decode row's
// dims (dp_value_sum) or 16 query vectors of a prefill block (attend_lanes).

// The V row of key `key` of the block (KV head kvh), or nullptr outside [lo, hi].
inline const uint16_t* value_row(const uint16_t* vpool, const BlockKeys& b, int64_t key, int64_t kvh, int64_t d,
                                 const AttnScratch& w) {
    return key < b.lo || key > b.hi ? nullptr : vpool + w.offsets[key - b.lo] + kvh * d;
}

// Dims c..c+15 of two keys' V rows as 16 (key 2t, key 2t+1) pairs; a missing row (nullptr) is zeros.
AVX512 inline __m512i value_pairs16(const uint16_t* ve, const uint16_t* vo, int64_t c) {
    const __m512i e = ve ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(ve + c)))
                         : _mm512_setzero_si512();
    const __m512i o = vo ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(vo + c)))
                         : _mm512_setzero_si512();
    return _mm512_or_si512(e, _mm512_slli_epi32(o, 16));
}

// V rows of the block's keys as (key 2t, key 2t+1) pairs per dim, [pair - lo / 2][dim]; keys outside
// [lo, hi] zero (so the pair partner of an end key reads no unwritten slot).
DPBF16 void stage_value_pairs(const uint16_t* vpool, const BlockKeys& b, int64_t kvh, const AttnShape& s,
                              AttnScratch& w) {
    const int64_t d = s.head_dim, p0 = b.lo / 2, pairs = b.hi / 2 - p0 + 1;
    w.vpair.resize(static_cast<size_t>(pairs * d));
    for (int64_t t = 0; t < pairs; ++t) {
        const uint16_t* ve = value_row(vpool, b, 2 * (p0 + t), kvh, d, w);
        const uint16_t* vo = value_row(vpool, b, 2 * (p0 + t) + 1, kvh, d, w);
        for (int64_t c = 0; c < d; c += 16) _mm512_storeu_si512(w.vpair.data() + t * d + c, value_pairs16(ve, vo, c));
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
                    const __m512bh vv[4] = {
                        (__m512bh)_mm512_unpacklo_epi16(e0, o0), (__m512bh)_mm512_unpackhi_epi16(e0, o0),
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
                        store_bf16(o + half * 32, _mm512_permutex2var_ps(lo, lo_idx, hi));
                        store_bf16(o + half * 32 + 16, _mm512_permutex2var_ps(lo, hi_idx, hi));
                    }
                }
            }
        }
}

// The decode blocks' V sum (softmax_and_sum's, with the dp scorer): lanes = 16 dims; each vector's
// probabilities rounded to bf16 over the span (zero outside its keys), each pair broadcast.
// flatten: value_sum is AVX512 (it is the FMA sum's too), and DpSteps::add's vdpbf16ps can be inlined
// only into a function compiled for AVX512-BF16; flattened into this one, the loop keeps it inline.
DPBF16 __attribute__((flatten)) void dp_value_sum(const uint16_t* vpool, int64_t rows, const int64_t* pos, int64_t kvh,
                                                  uint16_t* out, const AttnShape& s, const BlockKeys& b,
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

// NV query vectors x NC 16-dim chunks of dp_lanes_value_sum: lanes = dims, as dp_value_sum's, so each
// V pair vector is loaded once for the NV vectors and each vector's probability pair is one broadcast
// for NC products (with the query vectors in the lanes, every product took a broadcast of its own).
// Output element (vector, dim) is the same chain over the same pairs in order either way.
template <int NV, int NC>
DPBF16 void lanes_value_chunks(const uint32_t* vpair, const uint32_t* ppair, int64_t pairs, int64_t d, int64_t c0,
                               uint16_t* const* out) {
    __m512 acc[NV][NC];
    for (auto& a : acc)
        for (auto& x : a) x = _mm512_setzero_ps();
    for (int64_t t = 0; t < pairs; ++t) {
        __m512bh vv[NC];
        for (int c = 0; c < NC; ++c) vv[c] = (__m512bh)_mm512_loadu_si512(vpair + t * d + c0 + c * 16);
        for (int v = 0; v < NV; ++v) {
            const __m512bh pv = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(ppair[t * 16 + v]));
            for (int c = 0; c < NC; ++c) acc[v][c] = _mm512_dpbf16_ps(acc[v][c], vv[c], pv);
        }
    }
    for (int v = 0; v < NV; ++v)
        for (int c = 0; c < NC; ++c) store_bf16(out[v] + c0 + c * 16, acc[v][c]);
}

using LanesValueChunks = void (*)(const uint32_t*, const uint32_t*, int64_t, int64_t, int64_t, uint16_t* const*);

template <int NV>
constexpr LanesValueChunks lanes_value_chunks_of(int nc) {
    return nc == 4 ? lanes_value_chunks<NV, 4>
                   : (nc == 3 ? lanes_value_chunks<NV, 3>
                              : (nc == 2 ? lanes_value_chunks<NV, 2> : lanes_value_chunks<NV, 1>));
}

// Up to 6 vectors x 4 chunks: 24 accumulators, 4 V vectors and a broadcast in the 32 registers.
constexpr int LANES_SUM_VECTORS = 6;

// A prefill block's V sum for one lane group (attend_lanes', with the dp scorer): sc[key * 16 + lane]
// the exponentials of keys lo..hi, normalized (x inv, each lane's 1 / sum) as they are rounded to
// bf16 pairs; the first n lanes' sums stored at lane_out[lane].
DPBF16 void dp_lanes_value_sum(const float* sc, __m512 inv, const BlockKeys& b, int64_t hi, const AttnShape& s,
                               AttnScratch& w, uint16_t* const* lane_out, int64_t n) {
    const int64_t d = s.head_dim, p0 = b.lo / 2, pairs = hi / 2 - p0 + 1;
    w.ppair.resize(static_cast<size_t>(pairs * 16));
    // Key 2t's and 2t + 1's probabilities of each lane as one pair (bf16_pairs).
    for (int64_t t = 0; t < pairs; ++t) {
        const int64_t ke = 2 * (p0 + t), ko = ke + 1;
        const __m512 e = ke >= b.lo ? _mm512_mul_ps(_mm512_loadu_ps(sc + ke * 16), inv) : _mm512_setzero_ps();
        const __m512 o = ko <= hi ? _mm512_mul_ps(_mm512_loadu_ps(sc + ko * 16), inv) : _mm512_setzero_ps();
        _mm512_storeu_si512(w.ppair.data() + t * 16, bf16_pairs(e, o));
    }
    static constexpr LanesValueChunks by_vectors[LANES_SUM_VECTORS][4] = {
        {lanes_value_chunks_of<1>(1), lanes_value_chunks_of<1>(2), lanes_value_chunks_of<1>(3),
         lanes_value_chunks_of<1>(4)},
        {lanes_value_chunks_of<2>(1), lanes_value_chunks_of<2>(2), lanes_value_chunks_of<2>(3),
         lanes_value_chunks_of<2>(4)},
        {lanes_value_chunks_of<3>(1), lanes_value_chunks_of<3>(2), lanes_value_chunks_of<3>(3),
         lanes_value_chunks_of<3>(4)},
        {lanes_value_chunks_of<4>(1), lanes_value_chunks_of<4>(2), lanes_value_chunks_of<4>(3),
         lanes_value_chunks_of<4>(4)},
        {lanes_value_chunks_of<5>(1), lanes_value_chunks_of<5>(2), lanes_value_chunks_of<5>(3),
         lanes_value_chunks_of<5>(4)},
        {lanes_value_chunks_of<6>(1), lanes_value_chunks_of<6>(2), lanes_value_chunks_of<6>(3),
         lanes_value_chunks_of<6>(4)}};
    for (int64_t v0 = 0; v0 < n; v0 += LANES_SUM_VECTORS) {
        const int64_t nv = std::min<int64_t>(LANES_SUM_VECTORS, n - v0);
        for (int64_t c0 = 0; c0 < d; c0 += 64) {
            const int64_t nc = std::min<int64_t>(4, (d - c0) / 16);
            by_vectors[nv - 1][nc - 1](w.vpair.data(), w.ppair.data() + v0, pairs, d, c0, lane_out + v0);
        }
    }
}

// ---- the V sum on the tile unit (the amx family's attention) ----
//
// With the tile unit scoring, the probabilities are rounded to bf16 (as the dp sum's) and each output
// element is the unit's sum over 32-key k-steps aligned to absolute key positions, taken in order
// from the k-step of the block's first key: an A tile of 16 query vectors' probabilities (a key
// outside a vector's range has p = 0) times a B tile of the k-step's V rows as (key 2t, key 2t+1)
// pairs x 16 dims. The unit's sum for one element reads only that vector's probabilities and that
// dim's values, so its bits are the same whether the tile's rows are a decode row's few vectors or
// 16 of a prefill block; a k-step with no key of a vector adds exact zeros to a sum that is already
// exact (the unit never leaves a subnormal one), which leaves it as it is.

constexpr int64_t KSTEP_KEYS = 32;  // keys per k-step of the tile unit (16 bf16 pairs)

// V of keys lo..hi as the unit's B tiles, one contiguous 1 KB tile per (k-step j from lo / 32, 16-dim
// chunk c): w.vpair[((j - lo / 32) * chunks + c) * 256 + pair * 16 + column]; keys outside [lo, hi]
// zero. Each 32-dim half of a pair of V rows is interleaved in registers (vpunpck{l,h}wd), so chunk
// 2h holds dims 8L..8L+3 and chunk 2h + 1 dims 8L+4..8L+7 of each 128-bit lane L of half h, in
// the columns amx_value_sum puts back in order (as dp_value_sum_in_place's registers).
AVX512 void stage_value_tiles(const uint16_t* vpool, const BlockKeys& b, int64_t kvh, const AttnShape& s,
                              AttnScratch& w) {
    const int64_t d = s.head_dim, chunks = d / 16, j0 = b.lo / KSTEP_KEYS, steps = b.hi / KSTEP_KEYS - j0 + 1;
    w.vpair.resize(static_cast<size_t>(steps * chunks * 256));
    for (int64_t j = 0; j < steps; ++j)
        for (int64_t i = 0; i < 16; ++i) {
            const int64_t ke = (j0 + j) * KSTEP_KEYS + 2 * i;
            const uint16_t* ve = value_row(vpool, b, ke, kvh, d, w);
            const uint16_t* vo = value_row(vpool, b, ke + 1, kvh, d, w);
            for (int64_t c = 0; c < chunks; c += 2) {
                const __m512i e = ve ? _mm512_loadu_si512(ve + c * 16) : _mm512_setzero_si512();
                const __m512i o = vo ? _mm512_loadu_si512(vo + c * 16) : _mm512_setzero_si512();
                uint32_t* t = w.vpair.data() + ((j * chunks + c) * 16 + i) * 16;
                _mm512_storeu_si512(t, _mm512_unpacklo_epi16(e, o));
                _mm512_storeu_si512(t + 256, _mm512_unpackhi_epi16(e, o));
            }
        }
}

// NC (2 or 4) 16-dim chunks from c0 of the 16 vectors' V sums: tmm0..tmm3 the sums, tmm4 a k-step's
// probabilities (pt, [k-step][vector][16 pairs]), tmm5..tmm7 (tmm5 again for a fourth chunk) the
// k-step's V tiles; sums stored at cb[chunk][vector][16].
template <int NC>
AMX void amx_value_chunks(const uint32_t* pt, const uint32_t* vt, int64_t steps, int64_t chunks, int64_t c0,
                          float* cb) {
    _tile_zero(0);
    _tile_zero(1);
    if constexpr (NC > 2) {
        _tile_zero(2);
        _tile_zero(3);
    }
    for (int64_t j = 0; j < steps; ++j) {
        const uint32_t* v = vt + (j * chunks + c0) * 256;
        _tile_loadd(4, pt + j * 256, 64);
        _tile_loadd(5, v, 64);
        _tile_dpbf16ps(0, 4, 5);
        _tile_loadd(6, v + 256, 64);
        _tile_dpbf16ps(1, 4, 6);
        if constexpr (NC > 2) {
            _tile_loadd(7, v + 512, 64);
            _tile_dpbf16ps(2, 4, 7);
            _tile_loadd(5, v + 768, 64);
            _tile_dpbf16ps(3, 4, 5);
        }
    }
    _tile_stored(0, cb, 64);
    _tile_stored(1, cb + 256, 64);
    if constexpr (NC > 2) {
        _tile_stored(2, cb + 512, 64);
        _tile_stored(3, cb + 768, 64);
    }
}

// The V sums of up to 16 vectors from their probability tiles (pt) and stage_value_tiles' V tiles,
// over `steps` k-steps; vector l's d dims (head_dim a multiple of 32) stored at out[l] (the first n),
// each 32-dim half's two chunks permuted back into dim order.
AMX void amx_value_sum(const uint32_t* pt, const uint32_t* vt, int64_t steps, int64_t d, uint16_t* const* out,
                       int64_t n) {
    const int64_t chunks = d / 16;
    alignas(64) static constexpr int32_t low_dims[16] = {0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23};
    alignas(64) static constexpr int32_t high_dims[16] = {8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31};
    const __m512i lo_idx = _mm512_load_si512(low_dims), hi_idx = _mm512_load_si512(high_dims);
    alignas(64) float cb[4 * 256];
    for (int64_t c0 = 0; c0 < chunks; c0 += 4) {
        const int64_t nc = std::min<int64_t>(4, chunks - c0);
        if (nc == 4)
            amx_value_chunks<4>(pt, vt, steps, chunks, c0, cb);
        else
            amx_value_chunks<2>(pt, vt, steps, chunks, c0, cb);
        for (int64_t c = 0; c < nc; c += 2)
            for (int64_t l = 0; l < n; ++l) {
                const __m512 a = _mm512_load_ps(cb + c * 256 + l * 16), z = _mm512_load_ps(cb + (c + 1) * 256 + l * 16);
                store16m(out[l] + (c0 + c) * 16, _mm512_permutex2var_ps(a, lo_idx, z), 0xffff);
                store16m(out[l] + (c0 + c) * 16 + 16, _mm512_permutex2var_ps(a, hi_idx, z), 0xffff);
            }
    }
}

// The decode blocks' V sum with the tile unit (softmax_and_sum's): the rows x g vectors' normalized
// probabilities (w.scores, [vector][span] from key lo / 16 * 16, zero outside each vector's keys)
// rounded to bf16 into the A tiles, then amx_value_sum over the block's k-steps.
AMX void amx_vectors_value_sum(const uint16_t* vpool, int64_t rows, int64_t kvh, uint16_t* out, const AttnShape& s,
                               const BlockKeys& b, AttnScratch& w) {
    const int64_t d = s.head_dim, g = s.heads / s.kv_heads, n = rows * g;
    const int64_t base = b.lo / 16 * 16, span = (b.hi / 16 + 1) * 16 - base;
    const int64_t j0 = b.lo / KSTEP_KEYS, steps = b.hi / KSTEP_KEYS - j0 + 1;
    stage_value_tiles(vpool, b, kvh, s, w);
    // Rows past n are left as they are: a row of the sums reads only its own row of probabilities,
    // and those rows' sums are never stored.
    w.ppair.resize(static_cast<size_t>(steps * 256));
    auto* pt = reinterpret_cast<uint16_t*>(w.ppair.data());  // [k-step][vector][32 keys]
    uint16_t* lane_out[16];
    for (int64_t l = 0; l < n; ++l) {
        lane_out[l] = out + l / g * s.heads * d + (kvh * g + l % g) * d;
        for (int64_t j = 0; j < steps; ++j)
            for (int64_t half = 0; half < 2; ++half) {
                const int64_t k0 = (j0 + j) * KSTEP_KEYS + half * 16;
                const bool in = k0 >= base && k0 < base + span;
                const __m512 p = in ? _mm512_loadu_ps(w.scores.data() + l * span + k0 - base) : _mm512_setzero_ps();
                _mm256_storeu_si256(reinterpret_cast<__m256i*>(pt + (j * 16 + l) * 32 + half * 16),
                                    (__m256i)_mm512_cvtneps_pbh(p));
            }
    }
    amx_value_sum(w.ppair.data(), w.vpair.data(), steps, d, lane_out, n);
}

// A prefill block's V sum for one lane group with the tile unit (attend_lanes'): sc[key * 16 + lane]
// the exponentials of keys lo..hi, normalized (x inv) as they are rounded to bf16 pairs (as
// dp_lanes_value_sum's) and transposed into the A tiles; the V tiles are the block's, staged once
// (stage_value_tiles). The first n lanes' sums stored at lane_out[lane].
AMX void amx_lanes_value_sum(const float* sc, __m512 inv, const BlockKeys& b, int64_t hi, const AttnShape& s,
                             AttnScratch& w, uint16_t* const* lane_out, int64_t n) {
    const int64_t j0 = b.lo / KSTEP_KEYS, steps = hi / KSTEP_KEYS - j0 + 1;
    w.ppair.resize(static_cast<size_t>(steps * 256));
    for (int64_t j = 0; j < steps; ++j) {
        __m512i r[16];
        for (int64_t i = 0; i < 16; ++i) {
            const int64_t ke = (j0 + j) * KSTEP_KEYS + 2 * i, ko = ke + 1;
            const __m512 e =
                ke >= b.lo && ke <= hi ? _mm512_mul_ps(_mm512_loadu_ps(sc + ke * 16), inv) : _mm512_setzero_ps();
            const __m512 o =
                ko >= b.lo && ko <= hi ? _mm512_mul_ps(_mm512_loadu_ps(sc + ko * 16), inv) : _mm512_setzero_ps();
            r[i] = bf16_pairs(e, o);  // pair i of every lane
        }
        transpose16(r);  // every pair of lane l
        for (int64_t l = 0; l < 16; ++l) _mm512_storeu_si512(w.ppair.data() + (j * 16 + l) * 16, r[l]);
    }
    amx_value_sum(w.ppair.data(), w.vpair.data(), steps, s.head_dim, lane_out, n);
}

// Scores on the tile unit (bf16, head_dim a multiple of 32, AMX): tmm0 the scores of 16 keys (rows)
// x 16 query vectors, tmm1 the 16 keys' 32 dims of one k-step, tmm2 that k-step's query pairs; the V
// sum (amx_value_chunks) takes all eight tiles, every one 16 rows of 64 bytes.
AMX void configure_score_tiles() { configure_full_tiles(); }

AMX void release_tiles() { _tile_release(); }

// amx_scores for tiles read in place with up to four k-steps (head_dim up to 128): the query's
// k-steps stay in tmm2..tmm5 for every tile instead of being loaded again for each, and two key
// tiles are in flight (sums in tmm0 and tmm6, keys in tmm1 and tmm7), so one tile's products do not
// wait on the other's. Each score is the same chain of products in the same order. The tile
// intrinsics take register numbers as literals, so each k-step is spelled out.
AMX void amx_scores_in_place(const uint16_t* kpool, const int64_t* table, const AttnShape& s, int64_t kvh, int64_t base,
                             int64_t hi, const uint32_t* qb, float* sc) {
    const int64_t d = s.head_dim, ks = d / 32, row = s.kv_heads * d, bs = s.block_size, stride = row * 2;
    const auto keys = [&](int64_t t) { return kpool + (table[t / bs] * bs + t % bs) * row + kvh * d; };
    _tile_loadd(2, qb, 64);
    if (ks > 1) _tile_loadd(3, qb + 256, 64);
    if (ks > 2) _tile_loadd(4, qb + 512, 64);
    if (ks > 3) _tile_loadd(5, qb + 768, 64);
    int64_t t = base;
    for (; t + 16 <= hi; t += 32) {
        const uint16_t *a = keys(t), *b = keys(t + 16);
        _tile_zero(0);
        _tile_zero(6);
        _tile_loadd(1, a, stride);
        _tile_dpbf16ps(0, 1, 2);
        _tile_loadd(7, b, stride);
        _tile_dpbf16ps(6, 7, 2);
        if (ks > 1) {
            _tile_loadd(1, a + 32, stride);
            _tile_dpbf16ps(0, 1, 3);
            _tile_loadd(7, b + 32, stride);
            _tile_dpbf16ps(6, 7, 3);
        }
        if (ks > 2) {
            _tile_loadd(1, a + 64, stride);
            _tile_dpbf16ps(0, 1, 4);
            _tile_loadd(7, b + 64, stride);
            _tile_dpbf16ps(6, 7, 4);
        }
        if (ks > 3) {
            _tile_loadd(1, a + 96, stride);
            _tile_dpbf16ps(0, 1, 5);
            _tile_loadd(7, b + 96, stride);
            _tile_dpbf16ps(6, 7, 5);
        }
        _tile_stored(0, sc + (t - base) * 16, 64);
        _tile_stored(6, sc + (t + 16 - base) * 16, 64);
    }
    if (t <= hi) {
        const uint16_t* a = keys(t);
        _tile_zero(0);
        _tile_loadd(1, a, stride);
        _tile_dpbf16ps(0, 1, 2);
        if (ks > 1) {
            _tile_loadd(1, a + 32, stride);
            _tile_dpbf16ps(0, 1, 3);
        }
        if (ks > 2) {
            _tile_loadd(1, a + 64, stride);
            _tile_dpbf16ps(0, 1, 4);
        }
        if (ks > 3) {
            _tile_loadd(1, a + 96, stride);
            _tile_dpbf16ps(0, 1, 5);
        }
        _tile_stored(0, sc + (t - base) * 16, 64);
    }
}

// The scores of 16 query vectors against keys base..hi, 16-key tiles aligned to absolute positions:
// sc[key - base][lane]. qb holds the query vectors as the tile unit's B operand: k-step by k-step,
// 16 pairs x 16 lanes of (dim 2i, dim 2i+1). Each score is the unit's fixed-order dot product of one
// key row and one query column, whatever the other rows and columns hold (as the packed linear's).
// A tile whose keys lie in one cache block (block_size a multiple of 16) is read from the pool in
// place; otherwise its keys in [lo, hi] are staged, the rest zero.
AMX void amx_scores(const uint16_t* kpool, const int64_t* table, const AttnShape& s, int64_t kvh, int64_t lo,
                    int64_t hi, const uint32_t* qb, float* sc, uint16_t* stage) {
    const int64_t d = s.head_dim, row = s.kv_heads * d, bs = s.block_size, base = lo / 16 * 16;
    if (bs % 16 == 0 && d <= 128) return amx_scores_in_place(kpool, table, s, kvh, base, hi, qb, sc);
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

// The block's K rows for dp_scores, copied once per block and KV head into one contiguous run,
// [key - lo][d] for keys lo..hi, then the last key repeated up to the next 16 keys (a tile past hi
// reads those rows; their scores are not stored). One base pointer then serves a whole tile: the
// scorer's broadcasts read at fixed offsets from it, where sixteen row pointers of their own (the
// rows lie apart in the pool, a block table between them) would not all stay in registers.
DPBF16 void stage_keys(const uint16_t* kpool, const BlockKeys& b, int64_t kvh, int64_t d, AttnScratch& w) {
    const int64_t keys = b.hi - b.lo + 1, rows = (keys + 15) / 16 * 16;
    w.keys.resize(static_cast<size_t>(rows * d));
    for (int64_t j = 0; j < rows; ++j)
        std::memcpy(w.keys.data() + j * d, kpool + w.offsets[std::min(j, keys - 1)] + kvh * d,
                    static_cast<size_t>(d) * sizeof(uint16_t));
}

// One tile's chains: acc[j] += the query pairs (lanes) x key j's pair i, over the pairs in order. D
// known at compile time puts every broadcast at a constant offset from the tile's base (folded into
// vdpbf16ps as a memory operand); 0 takes d at run time, for other head sizes. The same operations
// in the same order either way, so the same bits.
template <int D>
DPBF16 inline void dp_tile(const uint16_t* kt, int64_t d, const uint32_t* qb, __m512* acc) {
    const int64_t dim = D > 0 ? D : d;
    for (int64_t i = 0; i < dim / 2; ++i) {
        const __m512bh qv = (__m512bh)_mm512_loadu_si512(qb + i * 16);
#pragma GCC unroll 16
        for (int j = 0; j < 16; ++j) {
            int32_t pair;
            std::memcpy(&pair, kt + j * dim + 2 * i, 4);
            acc[j] = _mm512_dpbf16_ps(acc[j], (__m512bh)_mm512_set1_epi32(pair), qv);
        }
    }
}

// amx_scores' result from vdpbf16ps (AVX512-BF16, no tile unit): lanes = the 16 query vectors of qb,
// each key's (dim 2i, dim 2i+1) pair broadcast against the lanes' pairs, one chain over the pairs
// in order per score (so a score's bits depend on its query and key alone, as the tile unit's).
// Sixteen keys at a time keep sixteen chains in flight (eight leave the dot-product unit idle between
// dependent steps); keys of the 16-key tiles outside [lo, hi] score zero, as amx_scores' staged
// zeros. K comes from stage_keys' copy of the block's rows (keys, [key - lo][d]).
DPBF16 void dp_scores(const uint16_t* keys, const AttnShape& s, int64_t lo, int64_t hi, const uint32_t* qb, float* sc) {
    const __m512 scale = _mm512_set1_ps(s.scale);
    const int64_t d = s.head_dim, base = lo / 16 * 16;
    const int64_t end = (hi / 16 + 1) * 16;
    for (int64_t key = base; key < lo; ++key) _mm512_storeu_ps(sc + (key - base) * 16, _mm512_setzero_ps());
    for (int64_t key = hi + 1; key < end; ++key) _mm512_storeu_ps(sc + (key - base) * 16, _mm512_setzero_ps());
    constexpr int KEYS = 16;
    for (int64_t k0 = lo; k0 <= hi; k0 += KEYS) {
        const int nk = static_cast<int>(std::min<int64_t>(KEYS, hi - k0 + 1));
        const uint16_t* kt = keys + (k0 - lo) * d;
        __m512 acc[KEYS];
        for (auto& a : acc) a = _mm512_setzero_ps();
        if (d == 64)
            dp_tile<64>(kt, d, qb, acc);
        else if (d == 128)
            dp_tile<128>(kt, d, qb, acc);
        else
            dp_tile<0>(kt, d, qb, acc);
        for (int j = 0; j < nk; ++j) _mm512_storeu_ps(sc + (k0 + j - base) * 16, _mm512_mul_ps(acc[j], scale));
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
DPBF16 void dp_key_scores(const uint16_t* kpool, const int64_t* offsets, int64_t lo, int64_t hi, int64_t kvh, int64_t d,
                          const uint16_t* const* qp, float scale, float* sc, int64_t span, uint32_t* stage) {
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
        case 1:
            return dp_key_scores<1>;
        case 2:
            return dp_key_scores<2>;
        case 3:
            return dp_key_scores<3>;
        case 4:
            return dp_key_scores<4>;
        case 5:
            return dp_key_scores<5>;
        case 6:
            return dp_key_scores<6>;
        default:
            return dp_key_scores<7>;
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
        return softmax_and_sum<uint16_t>(vpool, rows, pos, kvh, out, s, b, w, SUM_DP);
    }
    w.q.resize(static_cast<size_t>(s.head_dim * 16));
    w.kf.resize(static_cast<size_t>(span * 16));
    w.stage.resize(static_cast<size_t>(16 * s.head_dim));
    auto* qb = reinterpret_cast<uint32_t*>(w.q.data());
    pack_query_pairs(q, q_stride, 0, n, kvh, s, qb);
    amx_scores(kpool, table, s, kvh, b.lo, b.hi, qb, w.kf.data(), w.stage.data());  // kf[key - base][lane]
    // Each 16-key tile of kf ([key][lane]) transposed into the vectors' rows of scores ([vector][key]),
    // scaled, with the keys outside a vector's range zero: the same multiplies as key by key, without
    // a scalar load and store per score.
    w.scores.resize(static_cast<size_t>(n * span));
    const __m512 scale = _mm512_set1_ps(s.scale);
    for (int64_t t = base; t < base + span; t += 16) {
        __m512i r[16];
        for (int64_t j = 0; j < 16; ++j) r[j] = _mm512_castps_si512(_mm512_loadu_ps(w.kf.data() + (t - base + j) * 16));
        transpose16(r);  // r[l]: vector l's scores of keys t..t+15
        for (int64_t l = 0; l < n; ++l) {
            const int64_t first = b.first[l / g], last = pos[l / g];
            const __mmask16 in = t > last || t + 15 < first ? 0 : tile_lanes(first, last, t);
            _mm512_storeu_ps(w.scores.data() + l * span + t - base,
                             _mm512_maskz_mul_ps(in, _mm512_castsi512_ps(r[l]), scale));
        }
    }
    if (s.softcap > 0.0f)
        for (int64_t l = 0; l < n; ++l)
            for (int64_t key = b.first[l / g]; key <= pos[l / g]; ++key) {
                float& v = w.scores[l * span + key - base];
                v = s.softcap * std::tanh(v / s.softcap);
            }
    softmax_and_sum<uint16_t>(vpool, rows, pos, kvh, out, s, b, w, SUM_AMX);
}

}  // namespace minisgl::cpu::attn
