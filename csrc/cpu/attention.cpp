// paged_attention: every query row over its paged K/V, read in place through its block table (no
// gather of every row's context into a fresh tensor per layer), OpenMP over (block of rows, KV head).
// Decode rows take one query vector at a time (attend_vectors), prefill blocks 16 query vectors per
// register (attend_lanes). bf16 scores come from one of three scorers, the machine's kernel family's:
// float32 FMAs (here), the AMX tile unit or vdpbf16ps (attention_bf16.cpp, with the V sum on the same
// unit); float32 rows always take the FMA scorer. The avx2 family's blocks run attention_avx2.cpp's
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
#include "attention_simd.h"
#include "common.h"
#include "kernels.h"

namespace minisgl::cpu {
namespace {

using namespace attn;  // attention_simd.h

// One (sequence, KV head): the group's query heads against keys [first, pos], softmax in float32.
// Plain C++ that the compiler vectorises for the ISA of the function it is inlined into: attend_group
// (the AVX-512 families', compiled for x86-64-v4) or attend_group_avx2.
template <typename T>
__attribute__((always_inline)) inline void attend_group_body(const T* q, const T* kpool, const T* vpool,
                                                             const int64_t* table, int64_t pos, int64_t kvh, T* out,
                                                             const AttnShape& s, LineVector<float>& scores,
                                                             LineVector<float>& acc) {
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
                                                            const AttnShape& s, LineVector<float>& scores,
                                                            LineVector<float>& acc) {
    attend_group_body(q, kpool, vpool, table, pos, kvh, out, s, scores, acc);
}

template <typename T>
AVX2 void attend_group_avx2(const T* q, const T* kpool, const T* vpool, const int64_t* table, int64_t pos, int64_t kvh,
                            T* out, const AttnShape& s, LineVector<float>& scores, LineVector<float>& acc) {
    attend_group_body(q, kpool, vpool, table, pos, kvh, out, s, scores, acc);
}

// The same attention on AVX-512 (head_dim a multiple of 16, up to 256) for a block of up to
// ATTN_BLOCK query rows (attention.h: the blocks, and the contract that makes a row's bits its own).

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
        for (int k = 0; k < KEYS; ++k)
            p[k][j] = _mm512_add_ps(lane_dot(qt, kf[k], chunks, j), lane_dot(qt, kf[k], chunks, j + 8));
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
    // float32 copies of K (for lane_scores) and V, shared by every lane, with the FMA scorer; with the
    // dp scorer V as bf16 key pairs (stage_value_pairs), with the tile unit as its V tiles
    // (stage_value_tiles) instead
    const bool dp = scorer == SCORE_DP, amx = scorer == SCORE_AMX;
    if (fma) {
        w.kf.resize(static_cast<size_t>(keys * d));
        w.vf.resize(static_cast<size_t>(keys * d));
        for (int64_t j = 0; j < keys; ++j)
            for (int64_t c = 0; c < chunks; ++c) {
                _mm512_storeu_ps(w.kf.data() + j * d + c * 16, load16(kpool + w.offsets[j] + kvh * d + c * 16));
                _mm512_storeu_ps(w.vf.data() + j * d + c * 16, load16(vpool + w.offsets[j] + kvh * d + c * 16));
            }
    }
    if constexpr (std::is_same_v<T, uint16_t>) {
        if (dp) {
            stage_value_pairs(vpool, b, kvh, s, w);
            stage_keys(kpool, b, kvh, d, w);
        }
        if (amx) stage_value_tiles(vpool, b, kvh, s, w);
    }
    w.q.resize(static_cast<size_t>(d * 16));
    w.scores.resize(static_cast<size_t>(span * 16));
    if (amx) w.stage.resize(static_cast<size_t>(16 * d));
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
        // The group's keys end at its last row's position: keys only the block's later rows see are
        // neither scored nor summed here (no lane of the group would weigh them).
        int64_t hi = lo;
        for (int64_t l = 0; l < n; ++l) hi = std::max<int64_t>(hi, lasts[l]);
        const int64_t gkeys = hi - lo + 1;
        T* lane_out[16];  // lane l's output vector: row (v0 + l) / g, head kvh * g + (v0 + l) % g
        for (int64_t l = 0; l < n; ++l) lane_out[l] = out + (v0 + l) / g * s.heads * d + (kvh * g + (v0 + l) % g) * d;
        float* sc = w.scores.data() - base * 16;  // sc[key * 16 + lane]
        const __m512 scale = _mm512_set1_ps(s.scale);
        // The tile unit's scores without a softcap stay unscaled in sc: the max below is taken over
        // them and then scaled, and each is scaled as its exponential is taken, which gives the bits
        // of scaling them first (x -> x * scale, rounded, is monotonic, so it commutes with the max),
        // without a pass that only scales.
        const bool unscaled = amx && s.softcap <= 0.0f;
        if constexpr (std::is_same_v<T, uint16_t>) {
            if (!fma) {
                auto* qb = reinterpret_cast<uint32_t*>(w.q.data());
                pack_query_pairs(q, q_stride, v0, n, kvh, s, qb);
                if (amx) {
                    amx_scores(kpool, table, s, kvh, lo, hi, qb, w.scores.data(), w.stage.data());
                    if (!unscaled)
                        for (int64_t key = lo; key <= hi; ++key)
                            _mm512_storeu_ps(sc + key * 16, _mm512_mul_ps(_mm512_loadu_ps(sc + key * 16), scale));
                } else {
                    dp_scores(w.keys.data(), s, lo, hi, qb, w.scores.data());  // scaled as it stores them
                }
            }
        }
        if (fma) {
            for (int64_t l = 0; l < 16; ++l) {  // qt: the lanes' query vectors transposed, [d][16]
                const T* qv = l < n ? q + (v0 + l) / g * q_stride + (kvh * g + (v0 + l) % g) * d : nullptr;
                for (int64_t i = 0; i < d; ++i) w.q[i * 16 + l] = qv ? load(qv, i) : 0.0f;
            }
            int64_t j = 0;
            for (; j + 2 <= gkeys; j += 2) {
                const float* kk[2] = {w.kf.data() + j * d, w.kf.data() + (j + 1) * d};
                __m512 two[2];
                lane_scores<2>(w.q.data(), kk, chunks, two);
                _mm512_storeu_ps(sc + (lo + j) * 16, _mm512_mul_ps(two[0], scale));
                _mm512_storeu_ps(sc + (lo + j + 1) * 16, _mm512_mul_ps(two[1], scale));
            }
            for (; j < gkeys; ++j) {
                const float* kk[1] = {w.kf.data() + j * d};
                __m512 one_key[1];
                lane_scores<1>(w.q.data(), kk, chunks, one_key);
                _mm512_storeu_ps(sc + (lo + j) * 16, _mm512_mul_ps(one_key[0], scale));
            }
        }
        if (s.softcap > 0.0f)
            for (int64_t i = lo * 16; i < (hi + 1) * 16; ++i) sc[i] = s.softcap * std::tanh(sc[i] / s.softcap);
        // Keys in [seen_lo, seen_hi] are seen by every used lane: there the softmax needs no mask. A
        // lane past n computes there on its zero query and stays finite; its sum's inverse is zero and
        // its output is never stored. Only the keys before a window's start or past the first rows'
        // positions (the causal diagonal) take the masked steps.
        int64_t seen_lo = lo, seen_hi = hi;
        for (int64_t l = 0; l < n; ++l) {
            seen_lo = std::max<int64_t>(seen_lo, firsts[l]);
            seen_hi = std::min<int64_t>(seen_hi, lasts[l]);
        }
        if (seen_hi < seen_lo) seen_lo = seen_hi = hi + 1;        // none: every key takes the masked steps
        const auto in_key_order = [&](const auto& step) AVX512 {  // step(key, the lanes that see it)
            for (int64_t key = lo; key < std::min(seen_lo, hi + 1); ++key) step(key, sees(first_v, last_v, key));
            for (int64_t key = seen_lo; key <= std::min(seen_hi, hi); ++key) step(key, __mmask16(0xffff));
            for (int64_t key = std::max(seen_hi + 1, seen_lo); key <= hi; ++key) step(key, sees(first_v, last_v, key));
        };
        // The max is exact in any order: the keys every lane sees take four chains (one chain would
        // wait on each vmaxps's latency), the others the masked steps.
        __m512 mx = _mm512_set1_ps(-INFINITY);
        for (int64_t key = lo; key < std::min(seen_lo, hi + 1); ++key)
            mx = _mm512_mask_max_ps(mx, sees(first_v, last_v, key), mx, _mm512_loadu_ps(sc + key * 16));
        for (int64_t key = std::max(seen_hi + 1, seen_lo); key <= hi; ++key)
            mx = _mm512_mask_max_ps(mx, sees(first_v, last_v, key), mx, _mm512_loadu_ps(sc + key * 16));
        {
            __m512 m4[4] = {mx, mx, mx, mx};
            const int64_t end = std::min(seen_hi, hi) + 1;
            int64_t key = seen_lo;
            for (; key + 4 <= end; key += 4)
                for (int u = 0; u < 4; ++u) m4[u] = _mm512_max_ps(m4[u], _mm512_loadu_ps(sc + (key + u) * 16));
            for (; key < end; ++key) m4[0] = _mm512_max_ps(m4[0], _mm512_loadu_ps(sc + key * 16));
            mx = _mm512_max_ps(_mm512_max_ps(m4[0], m4[1]), _mm512_max_ps(m4[2], m4[3]));
        }
        if (unscaled) mx = _mm512_mul_ps(mx, scale);
        __m512 part[16];
        for (auto& p : part) p = _mm512_setzero_ps();
        in_key_order([&](int64_t key, __mmask16 m) AVX512 {
            __m512 x = _mm512_loadu_ps(sc + key * 16);
            if (unscaled) x = _mm512_mul_ps(x, scale);
            const __m512 e = _mm512_maskz_mov_ps(m, exp16(_mm512_sub_ps(x, mx)));
            _mm512_storeu_ps(sc + key * 16, e);
            part[key & 15] = _mm512_add_ps(part[key & 15], e);  // by absolute key mod 16, as the tiles
        });
        const __m512 inv = _mm512_maskz_div_ps(used, one, vsum16(part));
        if constexpr (std::is_same_v<T, uint16_t>) {
            if (dp) {
                dp_lanes_value_sum(sc, inv, b, hi, s, w, lane_out, n);
                continue;
            }
            if (amx) {
                amx_lanes_value_sum(sc, inv, b, hi, s, w, lane_out, n);
                continue;
            }
        }
        for (int64_t key = lo; key <= hi; ++key)
            _mm512_storeu_ps(sc + key * 16, _mm512_mul_ps(_mm512_loadu_ps(sc + key * 16), inv));
        for (int64_t c = 0; c < chunks; ++c) {
            __m512 acc[16];
            for (auto& a : acc) a = _mm512_setzero_ps();
            for (int64_t j = 0; j < gkeys; ++j) {
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
                         const int64_t* table, const int64_t* pos, int64_t kvh, T* out, const AttnShape& s, int scorer,
                         AttnScratch& w) {
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
                       const int64_t* row_table, const int64_t* positions, uintptr_t out, int64_t n, const AttnShape& s,
                       int scorer, int threads, int isa) {
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
    // Blocks: runs of up to `block` consecutive rows on one table (one row each on the scalar path).
    // A block stages its keys' K and V once per KV head, so the longer the blocks of a prefill chunk,
    // the fewer times each key is staged; the shorter, the more items the threads share. The AVX-512
    // blocks take the longest of ATTN_BLOCK, halved down to ATTN_MIN_BLOCK, that leaves 4 items per
    // thread; the avx2 family's keep ATTN_MIN_BLOCK (they hold every vector's scores at once). Which
    // block a row lands in never changes its bits (attention.h).
    std::vector<int64_t> starts;
    const auto split = [&](int64_t block) {
        starts.clear();
        for (int64_t r = 0; r < n; ++r)
            if (!vector || r == 0 || row_table[r] != row_table[r - 1] || r - starts.back() == block)
                starts.push_back(r);
    };
    int64_t block = vector && !avx2 ? ATTN_BLOCK : ATTN_MIN_BLOCK;
    split(block);
    while (block > ATTN_MIN_BLOCK && static_cast<int64_t>(starts.size()) * s.kv_heads < 4 * int64_t{threads})
        split(block /= 2);
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

// The layer stack's (bf16 and float32).
template void paged_attention_t<uint16_t>(uintptr_t, int64_t, uintptr_t, uintptr_t, uintptr_t, const int64_t*,
                                          const int64_t*, uintptr_t, int64_t, const AttnShape&, int, int, int);
template void paged_attention_t<float>(uintptr_t, int64_t, uintptr_t, uintptr_t, uintptr_t, const int64_t*,
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
        throw std::out_of_range(
            "paged_attention: a row's table, position or block id lies outside the tables or the pool");
    const AttnShape s{
        heads, kv_heads, head_dim, block_size, table_stride, static_cast<float>(scale), static_cast<float>(softcap),
        window};
    if (bf16)
        paged_attention_t<uint16_t>(q, q_stride, k, v, tables, rt, pp, out, n, s, scorer, threads, isa);
    else
        paged_attention_t<float>(q, q_stride, k, v, tables, rt, pp, out, n, s, SCORE_FMA, threads, isa);
}

}  // namespace minisgl::cpu
