// The avx2 family's paged attention: attend_block_avx2 runs one block of query rows (attention.h) for
// paged_attention_t (attention.cpp), which splits the rows, checks the tables and runs the threads for
// every family. AVX2 + FMA, 8 float32 lanes, the FMA scorer only (no AMX, no vdpbf16ps), for bf16 and
// float32 rows and head dims that are multiples of 8 up to 256 (others take attention.cpp's scalar
// attend_group, compiled for AVX2).
//
// The structure is attention.cpp's FMA path at half the width: decode blocks take one query vector at
// a time (attend_vectors: lanes = 8 dims, a dot product per key then hsum8's tree), prefill blocks 8
// query vectors per register (attend_lanes: lanes = 8 vectors, the same products and the same tree
// across vectors, vsum8). It is its own file rather than a template of attention.cpp because that
// one's loops are written around AVX-512 mask registers and share them with the AMX and vdpbf16ps
// scorers; the ordering contract is the same (attention.h, above ATTN_BLOCK), with 8-key tiles.
//
// Bit-exactness: a row's bits depend only on its query, its position and the cached keys and values:
// its scores are one dot product per key (8-wide FMAs over head_dim in order, then hsum8's tree), its
// softmax sums by absolute key position mod 8, and its output sums the keys in key order, whichever
// of attend_vectors / attend_lanes ran and whatever rows share its block. They differ from the
// AVX-512 families' (16 lanes).

#include <algorithm>
#include <cmath>
#include <vector>

#include "attention.h"
#include "common.h"
#include "kernels.h"

namespace minisgl::cpu {
namespace avx2 {
namespace {

// Blocks of at least this many query vectors (rows x heads of the group) take attend_lanes.
constexpr int64_t LANES_FROM = 8;

template <typename T>
AVX2 inline __m256 load8(const T* p) {
    return load8n(p, 8);
}

// The keys of the 8-key tile from key t that lie in [first, last], as an all-ones / zero lane mask.
AVX2 inline __m256 tile_lanes8(int64_t first, int64_t last, int64_t t) {
    const __m256i key = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(t)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    const __m256i out = _mm256_or_si256(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(first)), key),
                                        _mm256_cmpgt_epi32(key, _mm256_set1_epi32(static_cast<int>(last))));
    return _mm256_castsi256_ps(_mm256_xor_si256(out, _mm256_set1_epi32(-1)));
}

// The lanes (query vectors) whose key range [first, last] holds `key`, as a lane mask.
AVX2 inline __m256 sees(__m256i first, __m256i last, int64_t key) {
    const __m256i k = _mm256_set1_epi32(static_cast<int>(key));
    const __m256i out = _mm256_or_si256(_mm256_cmpgt_epi32(first, k), _mm256_cmpgt_epi32(k, last));
    return _mm256_castsi256_ps(_mm256_xor_si256(out, _mm256_set1_epi32(-1)));
}

AVX2 inline float hmax8(__m256 v) {  // the largest lane (max is exact: any order gives its bits)
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

// hsum8's tree across 8 vectors, lane by lane: lane l of vsum8(p) has the bits of hsum8 of the
// vector whose lanes are p[0..7][l] (j with j+4, then j+2, then j+1).
AVX2 inline __m256 vsum8(__m256* p) {
    for (int w = 4; w >= 1; w /= 2)
        for (int j = 0; j < w; ++j) p[j] = _mm256_add_ps(p[j], p[j + w]);
    return p[0];
}

// The softmax and the sum over V of rows x g query vectors whose scores lie in w.scores, [vector][span]
// from key `base` (8-key tiles aligned to absolute positions): the softmax one vector at a time, lane j
// summing the keys = j mod 8 in key order, then hsum8; the V sum one output element per chain over the
// row's keys in order, VG vectors x CG 8-dim chunks per pass (9 accumulators, the chunks' V rows and a
// broadcast probability: 13 of AVX2's 16 registers).
template <typename T>
AVX2 void softmax_and_sum(const T* vpool, int64_t rows, const int64_t* pos, int64_t kvh, T* out, const AttnShape& s,
                          const BlockKeys& b, AttnScratch& w) {
    constexpr int64_t VG = 3, CG = 3;
    const int64_t d = s.head_dim, g = s.heads / s.kv_heads, chunks = d / 8;
    const int64_t lo = b.lo, base = lo / 8 * 8, span = (b.hi / 8 + 1) * 8 - base;
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t t0 = b.first[r] / 8 * 8, t1 = pos[r] / 8 * 8;
        for (int64_t h = 0; h < g; ++h) {
            float* sh = w.scores.data() + (r * g + h) * span - base;
            __m256 mx = _mm256_set1_ps(-INFINITY);
            for (int64_t t = t0; t <= t1; t += 8)
                mx = _mm256_blendv_ps(mx, _mm256_max_ps(mx, _mm256_loadu_ps(sh + t)), tile_lanes8(b.first[r], pos[r], t));
            const __m256 top = _mm256_set1_ps(hmax8(mx));
            __m256 sum = _mm256_setzero_ps();
            for (int64_t t = t0; t <= t1; t += 8) {
                const __m256 e =
                    _mm256_and_ps(tile_lanes8(b.first[r], pos[r], t), exp8(_mm256_sub_ps(_mm256_loadu_ps(sh + t), top)));
                _mm256_storeu_ps(sh + t, e);
                sum = _mm256_add_ps(sum, e);  // lane j: keys j mod 8, in key order
            }
            const __m256 inv = _mm256_set1_ps(1.0f / hsum8(sum));
            for (int64_t t = t0; t <= t1; t += 8) _mm256_storeu_ps(sh + t, _mm256_mul_ps(_mm256_loadu_ps(sh + t), inv));
        }
    }
    const T* vh = vpool + kvh * d;
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t h0 = 0; h0 < g; h0 += VG) {
            const int64_t nv = std::min<int64_t>(VG, g - h0);
            const float* p = w.scores.data() + (r * g + h0) * span - base;  // p[v * span + key]
            T* o = out + r * s.heads * d + (kvh * g + h0) * d;
            for (int64_t c0 = 0; c0 < chunks; c0 += CG) {
                const int64_t nc = std::min<int64_t>(CG, chunks - c0);
                __m256 acc[VG][CG];
                for (auto& a : acc)
                    for (auto& x : a) x = _mm256_setzero_ps();
                for (int64_t key = b.first[r]; key <= pos[r]; ++key) {
                    const T* vr = vh + w.offsets[key - lo] + c0 * 8;
                    __m256 vv[CG];
                    for (int c = 0; c < CG; ++c)
                        if (c < nc) vv[c] = load8(vr + c * 8);
                    for (int v = 0; v < VG; ++v) {
                        if (v >= nv) break;
                        const __m256 pv = _mm256_set1_ps(p[v * span + key]);
                        for (int c = 0; c < CG; ++c)
                            if (c < nc) acc[v][c] = _mm256_fmadd_ps(pv, vv[c], acc[v][c]);
                    }
                }
                for (int64_t v = 0; v < nv; ++v)
                    for (int64_t c = 0; c < nc; ++c) store8n(o + v * d + (c0 + c) * 8, acc[v][c], 8);
            }
        }
}

// One query vector at a time (lanes = 8 dims of head_dim): blocks of few query vectors (decode).
template <typename T>
AVX2 void attend_vectors(const T* q, int64_t q_stride, int64_t rows, const T* kpool, const T* vpool,
                         const int64_t* pos, int64_t kvh, T* out, const AttnShape& s, const BlockKeys& b,
                         AttnScratch& w) {
    const int64_t d = s.head_dim, g = s.heads / s.kv_heads, chunks = d / 8;
    const int64_t lo = b.lo, hi = b.hi, base = lo / 8 * 8, span = (hi / 8 + 1) * 8 - base;
    w.q.resize(static_cast<size_t>(rows * g * d));
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t h = 0; h < g; ++h)
            for (int64_t i = 0; i < d; ++i) w.q[(r * g + h) * d + i] = load(q + r * q_stride, (kvh * g + h) * d + i);
    w.scores.assign(static_cast<size_t>(rows * g * span), 0.0f);
    w.kf.resize(static_cast<size_t>(d));
    for (int64_t key = lo; key <= hi; ++key) {
        const T* kp = kpool + w.offsets[key - lo] + kvh * d;
        for (int64_t c = 0; c < chunks; ++c) _mm256_storeu_ps(w.kf.data() + c * 8, load8(kp + c * 8));
        for (int64_t r = 0; r < rows; ++r) {
            if (key < b.first[r] || key > pos[r]) continue;
            for (int64_t h = 0; h < g; ++h) {
                const float* qh = w.q.data() + (r * g + h) * d;
                __m256 dot = _mm256_mul_ps(_mm256_loadu_ps(qh), _mm256_loadu_ps(w.kf.data()));
                for (int64_t c = 1; c < chunks; ++c)
                    dot = _mm256_fmadd_ps(_mm256_loadu_ps(qh + c * 8), _mm256_loadu_ps(w.kf.data() + c * 8), dot);
                float sc = hsum8(dot) * s.scale;
                if (s.softcap > 0.0f) sc = s.softcap * std::tanh(sc / s.softcap);
                w.scores[(r * g + h) * span + key - base] = sc;
            }
        }
    }
    softmax_and_sum<T>(vpool, rows, pos, kvh, out, s, b, w);
}

// Lane l of the result: attend_vectors' lane j partial of query l against key kf (its products over
// the chunks in order, the first a product, the rest FMAs); qt holds the 8 queries transposed, [d][8].
AVX2 inline __m256 lane_dot(const float* qt, const float* kf, int64_t chunks, int j) {
    __m256 a = _mm256_mul_ps(_mm256_loadu_ps(qt + j * 8), _mm256_broadcast_ss(kf + j));
    for (int64_t c = 1; c < chunks; ++c)
        a = _mm256_fmadd_ps(_mm256_loadu_ps(qt + (c * 8 + j) * 8), _mm256_broadcast_ss(kf + c * 8 + j), a);
    return a;
}

// The scores of the 8 lanes' queries against KEYS keys: vsum8's tree over the lane_dot partials, the
// first level as they come (4 live vectors per key).
template <int KEYS>
AVX2 inline void lane_scores(const float* qt, const float* const* kf, int64_t chunks, __m256* out) {
    __m256 p[KEYS][4];
    for (int j = 0; j < 4; ++j)
        for (int k = 0; k < KEYS; ++k) p[k][j] = _mm256_add_ps(lane_dot(qt, kf[k], chunks, j), lane_dot(qt, kf[k], chunks, j + 4));
    for (int k = 0; k < KEYS; ++k) {
        for (int w = 2; w >= 1; w /= 2)
            for (int j = 0; j < w; ++j) p[k][j] = _mm256_add_ps(p[k][j], p[k][j + w]);
        out[k] = p[k][0];
    }
}

// Many query vectors (a prefill block): lanes = 8 query vectors (row, head of the group), keys one at
// a time, every score, softmax sum and output element by attend_vectors' operations in its order
// (keys outside a lane's range add exact zeros, which leave every sum's bits as they are but for the
// sign of an exact-zero output); K and V converted to float32 once per block and shared by the lanes.
template <typename T>
AVX2 void attend_lanes(const T* q, int64_t q_stride, int64_t rows, const T* kpool, const T* vpool, const int64_t* pos,
                       int64_t kvh, T* out, const AttnShape& s, const BlockKeys& b, AttnScratch& w) {
    const int64_t d = s.head_dim, g = s.heads / s.kv_heads, chunks = d / 8, vectors = rows * g;
    const int64_t lo = b.lo, keys = b.hi - lo + 1, base = lo / 8 * 8, span = (b.hi / 8 + 1) * 8 - base;
    w.kf.resize(static_cast<size_t>(keys * d));
    w.vf.resize(static_cast<size_t>(keys * d));
    for (int64_t j = 0; j < keys; ++j)
        for (int64_t c = 0; c < chunks; ++c) {
            _mm256_storeu_ps(w.kf.data() + j * d + c * 8, load8(kpool + w.offsets[j] + kvh * d + c * 8));
            _mm256_storeu_ps(w.vf.data() + j * d + c * 8, load8(vpool + w.offsets[j] + kvh * d + c * 8));
        }
    w.q.resize(static_cast<size_t>(d * 8));
    w.scores.resize(static_cast<size_t>(span * 8));
    const __m256 one = _mm256_set1_ps(1.0f), scale = _mm256_set1_ps(s.scale);
    for (int64_t v0 = 0; v0 < vectors; v0 += 8) {
        const int64_t n = std::min<int64_t>(8, vectors - v0);
        alignas(32) int32_t firsts[8], lasts[8];
        for (int64_t l = 0; l < 8; ++l) {
            const int64_t r = (v0 + l) / g;
            firsts[l] = l < n ? static_cast<int32_t>(b.first[r]) : INT32_MAX;  // unused lanes see no key
            lasts[l] = l < n ? static_cast<int32_t>(pos[r]) : -1;
        }
        const __m256i first_v = _mm256_load_si256(reinterpret_cast<const __m256i*>(firsts));
        const __m256i last_v = _mm256_load_si256(reinterpret_cast<const __m256i*>(lasts));
        const __m256 used = _mm256_castsi256_ps(first_lanes8(n));
        float* sc = w.scores.data() - base * 8;  // sc[key * 8 + lane]
        for (int64_t l = 0; l < 8; ++l) {  // qt: the lanes' query vectors transposed, [d][8]
            const T* qv = l < n ? q + (v0 + l) / g * q_stride + (kvh * g + (v0 + l) % g) * d : nullptr;
            for (int64_t i = 0; i < d; ++i) w.q[i * 8 + l] = qv ? load(qv, i) : 0.0f;
        }
        int64_t j = 0;
        for (; j + 2 <= keys; j += 2) {
            const float* kk[2] = {w.kf.data() + j * d, w.kf.data() + (j + 1) * d};
            __m256 two[2];
            lane_scores<2>(w.q.data(), kk, chunks, two);
            _mm256_storeu_ps(sc + (lo + j) * 8, _mm256_mul_ps(two[0], scale));
            _mm256_storeu_ps(sc + (lo + j + 1) * 8, _mm256_mul_ps(two[1], scale));
        }
        for (; j < keys; ++j) {
            const float* kk[1] = {w.kf.data() + j * d};
            __m256 one_key[1];
            lane_scores<1>(w.q.data(), kk, chunks, one_key);
            _mm256_storeu_ps(sc + (lo + j) * 8, _mm256_mul_ps(one_key[0], scale));
        }
        if (s.softcap > 0.0f)
            for (int64_t i = lo * 8; i < (b.hi + 1) * 8; ++i) sc[i] = s.softcap * std::tanh(sc[i] / s.softcap);
        __m256 mx = _mm256_set1_ps(-INFINITY);
        for (int64_t key = lo; key <= b.hi; ++key)
            mx = _mm256_blendv_ps(mx, _mm256_max_ps(mx, _mm256_loadu_ps(sc + key * 8)), sees(first_v, last_v, key));
        __m256 part[8];
        for (auto& p : part) p = _mm256_setzero_ps();
        for (int64_t key = lo; key <= b.hi; ++key) {
            const __m256 e = _mm256_and_ps(sees(first_v, last_v, key), exp8(_mm256_sub_ps(_mm256_loadu_ps(sc + key * 8), mx)));
            _mm256_storeu_ps(sc + key * 8, e);
            part[key & 7] = _mm256_add_ps(part[key & 7], e);  // by absolute key mod 8, as the tiles
        }
        const __m256 inv = _mm256_and_ps(used, _mm256_div_ps(one, vsum8(part)));
        for (int64_t key = lo; key <= b.hi; ++key)
            _mm256_storeu_ps(sc + key * 8, _mm256_mul_ps(_mm256_loadu_ps(sc + key * 8), inv));
        alignas(32) float tile[8][8];
        for (int64_t c = 0; c < chunks; ++c) {
            __m256 acc[8];
            for (auto& a : acc) a = _mm256_setzero_ps();
            for (int64_t k = 0; k < keys; ++k) {
                const __m256 p = _mm256_loadu_ps(sc + (lo + k) * 8);
                const float* vr = w.vf.data() + k * d + c * 8;
                for (int i = 0; i < 8; ++i) acc[i] = _mm256_fmadd_ps(p, _mm256_broadcast_ss(vr + i), acc[i]);
            }
            for (int i = 0; i < 8; ++i) _mm256_store_ps(tile[i], acc[i]);
            for (int64_t l = 0; l < n; ++l) {
                const int64_t r = (v0 + l) / g, h = (v0 + l) % g;
                for (int i = 0; i < 8; ++i) store(out + r * s.heads * d, (kvh * g + h) * d + c * 8 + i, tile[i][l]);
            }
        }
    }
}

}  // namespace
}  // namespace avx2

template <typename T>
void attend_block_avx2(const T* q, int64_t q_stride, int64_t rows, const T* kpool, const T* vpool,
                       const int64_t* table, const int64_t* pos, int64_t kvh, T* out, const AttnShape& s,
                       AttnScratch& w) {
    const BlockKeys b = block_keys(table, pos, rows, s, w);
    if (rows * (s.heads / s.kv_heads) >= avx2::LANES_FROM)
        return avx2::attend_lanes<T>(q, q_stride, rows, kpool, vpool, pos, kvh, out, s, b, w);
    prefetch_values(vpool, b, kvh, s, w);
    avx2::attend_vectors<T>(q, q_stride, rows, kpool, vpool, pos, kvh, out, s, b, w);
}

template void attend_block_avx2<float>(const float*, int64_t, int64_t, const float*, const float*, const int64_t*,
                                       const int64_t*, int64_t, float*, const AttnShape&, AttnScratch&);
template void attend_block_avx2<uint16_t>(const uint16_t*, int64_t, int64_t, const uint16_t*, const uint16_t*,
                                          const int64_t*, const int64_t*, int64_t, uint16_t*, const AttnShape&,
                                          AttnScratch&);

}  // namespace minisgl::cpu
