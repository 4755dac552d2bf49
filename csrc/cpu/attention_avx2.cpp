// The avx2 family's paged attention: attend_block_avx2 runs one block of query rows (attention.h) for
// paged_attention_t (attention.cpp), which splits the rows, checks the tables and runs the threads for
// every family. AVX2 + FMA, 8 float32 lanes, the FMA scorer only (no AMX, no vdpbf16ps), for bf16 and
// float32 rows and head dims that are multiples of 8 up to 256 (others take attention.cpp's scalar
// attend_group, compiled for AVX2).
//
// One path for decode and prefill blocks, keys in the lanes: the block's K is staged once, as float32
// transposed in 8-key tiles aligned to absolute key positions ([tile][dim][key]); each score is then
// one FMA chain over head_dim in order (query dim broadcast, 8 keys' dims in the lanes), 4 query
// vectors x 2 key tiles at a time (8 chains in flight, 6 loads per 8 FMAs); the softmax runs over
// those tiles per query vector; the V sum over V staged as float32 once, 3 query vectors x 3 8-dim
// chunks per pass. It is not a template of attention.cpp: that one's loops are written around
// AVX-512 mask registers and share them with the AMX and vdpbf16ps scorers, and its prefill layout
// (query vectors in the lanes) needs two loads per FMA at 8 lanes, which left it behind SDPA here.
//
// Bit-exactness: a row's bits depend only on its query, its position and the cached keys and values:
// each score is its own chain over the dims, the softmax sums the keys of a row's tiles by absolute
// position mod 8 (then hsum8's tree), and each output element is one chain over the row's keys in
// order; the same code runs whatever rows share the block, so the contract of attention.h holds
// whatever the block. They differ from the AVX-512 families' (16 lanes, another score order).

#include <algorithm>
#include <cmath>
#include <vector>

#include "attention.h"
#include "common.h"
#include "kernels.h"

namespace minisgl::cpu {
namespace avx2 {
namespace {

constexpr int64_t QV = 4;          // query vectors per score pass
constexpr int64_t VG = 3, CG = 3;  // query vectors x 8-dim chunks per V-sum pass

template <typename T>
AVX2 inline __m256 load8(const T* p) {
    return load8n(p, 8);
}

// The keys of the 8-key tile from key t that lie in [first, last], as an all-ones / zero lane mask.
AVX2 inline __m256 tile_lanes8(int64_t first, int64_t last, int64_t t) {
    const __m256i key =
        _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(t)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    const __m256i out = _mm256_or_si256(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(first)), key),
                                        _mm256_cmpgt_epi32(key, _mm256_set1_epi32(static_cast<int>(last))));
    return _mm256_castsi256_ps(_mm256_xor_si256(out, _mm256_set1_epi32(-1)));
}

AVX2 inline float hmax8(__m256 v) {  // the largest lane (max is exact: any order gives its bits)
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

// r[i] = lane i of the 8 vectors: r[i][l] = x[l][i] (an 8 x 8 float32 transpose in registers).
AVX2 inline void transpose8(__m256 (&x)[8]) {
    __m256 t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(x[i], x[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(x[i], x[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xee);
        u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xee);
    }
    for (int i = 0; i < 4; ++i) {
        x[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
        x[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
    }
}

// The block's operands as float32: w.q [vector][d] (vectors padded to a multiple of QV with zeros),
// w.kf the keys' tiles transposed [tile][d][8] (keys outside [lo, hi] zero), w.vf [key - lo][d].
template <typename T>
AVX2 void stage(const T* q, int64_t q_stride, int64_t rows, const T* kpool, const T* vpool, int64_t kvh,
                const AttnShape& s, const BlockKeys& b, AttnScratch& w) {
    const int64_t d = s.head_dim, g = s.heads / s.kv_heads, chunks = d / 8, n = rows * g;
    const int64_t base = b.lo / 8 * 8, tiles = b.hi / 8 + 1 - b.lo / 8, keys = b.hi - b.lo + 1;
    w.q.assign(static_cast<size_t>((n + QV - 1) / QV * QV * d), 0.0f);
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t h = 0; h < g; ++h)
            for (int64_t c = 0; c < chunks; ++c)
                _mm256_storeu_ps(w.q.data() + (r * g + h) * d + c * 8,
                                 load8(q + r * q_stride + (kvh * g + h) * d + c * 8));
    w.kf.resize(static_cast<size_t>(tiles * d * 8));
    for (int64_t t = 0; t < tiles; ++t) {
        const T* kr[8];
        for (int l = 0; l < 8; ++l) {
            const int64_t key = base + t * 8 + l;
            kr[l] = key < b.lo || key > b.hi ? nullptr : kpool + w.offsets[key - b.lo] + kvh * d;
        }
        for (int64_t c = 0; c < chunks; ++c) {
            __m256 x[8];
            for (int l = 0; l < 8; ++l) x[l] = kr[l] ? load8(kr[l] + c * 8) : _mm256_setzero_ps();
            transpose8(x);
            for (int i = 0; i < 8; ++i) _mm256_storeu_ps(w.kf.data() + (t * d + c * 8 + i) * 8, x[i]);
        }
    }
    w.vf.resize(static_cast<size_t>(keys * d));
    for (int64_t j = 0; j < keys; ++j)
        for (int64_t c = 0; c < chunks; ++c)
            _mm256_storeu_ps(w.vf.data() + j * d + c * 8, load8(vpool + w.offsets[j] + kvh * d + c * 8));
}

// Scores of QV query vectors (from v0) against the key tiles [t0, t1) (tile index from the block's
// first tile): w.scores[v * span + 8 * tile + lane] = scale * (one FMA chain over the dims).
AVX2 void score_vectors(int64_t v0, int64_t t0, int64_t t1, int64_t span, const AttnShape& s, AttnScratch& w) {
    const int64_t d = s.head_dim;
    const float* q = w.q.data() + v0 * d;
    const __m256 scale = _mm256_set1_ps(s.scale);
    for (int64_t t = t0; t < t1; t += 2) {
        const bool two = t + 1 < t1;
        const float* k0 = w.kf.data() + t * d * 8;
        const float* k1 = two ? k0 + d * 8 : k0;  // a lone last tile scores twice, stored once
        __m256 a[QV][2];
#pragma GCC unroll 4
        for (int v = 0; v < QV; ++v) a[v][0] = a[v][1] = _mm256_setzero_ps();
        for (int64_t i = 0; i < d; ++i) {
            const __m256 ka = _mm256_loadu_ps(k0 + i * 8), kb = _mm256_loadu_ps(k1 + i * 8);
#pragma GCC unroll 4
            for (int v = 0; v < QV; ++v) {
                const __m256 qb = _mm256_broadcast_ss(q + v * d + i);
                a[v][0] = _mm256_fmadd_ps(qb, ka, a[v][0]);
                a[v][1] = _mm256_fmadd_ps(qb, kb, a[v][1]);
            }
        }
#pragma GCC unroll 4
        for (int v = 0; v < QV; ++v) {
            float* sv = w.scores.data() + (v0 + v) * span + t * 8;
            _mm256_storeu_ps(sv, _mm256_mul_ps(a[v][0], scale));
            if (two) _mm256_storeu_ps(sv + 8, _mm256_mul_ps(a[v][1], scale));
        }
    }
}

// NV query vectors x NC 8-dim chunks of the V sum over keys [first, last]: NV x NC accumulators in
// registers (constant counts, so the loops unroll and nothing spills), stored to out[v * d + c * 8].
template <typename T, int NV, int NC>
AVX2 void value_pass(const float* p, int64_t span, const float* vf, int64_t d, int64_t first, int64_t last, T* out) {
    // Every loop over NV and NC unrolled by pragma: GCC 12 otherwise unrolled them too late to keep the
    // accumulators out of memory (a store per FMA, the V sum at half the scores' rate).
    __m256 a[NV][NC];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v)
#pragma GCC unroll 4
        for (int c = 0; c < NC; ++c) a[v][c] = _mm256_setzero_ps();
    for (int64_t key = first; key <= last; ++key) {
        __m256 vv[NC];
#pragma GCC unroll 4
        for (int c = 0; c < NC; ++c) vv[c] = _mm256_loadu_ps(vf + key * d + c * 8);
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v) {
            const __m256 pv = _mm256_broadcast_ss(p + v * span + key);
#pragma GCC unroll 4
            for (int c = 0; c < NC; ++c) a[v][c] = _mm256_fmadd_ps(pv, vv[c], a[v][c]);
        }
    }
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v)
#pragma GCC unroll 4
        for (int c = 0; c < NC; ++c) store8n(out + v * d + c * 8, a[v][c], 8);
}

template <typename T>
using ValuePass = void (*)(const float*, int64_t, const float*, int64_t, int64_t, int64_t, T*);

template <typename T>
constexpr ValuePass<T> VALUE_PASSES[VG][CG] = {
    {value_pass<T, 1, 1>, value_pass<T, 1, 2>, value_pass<T, 1, 3>},
    {value_pass<T, 2, 1>, value_pass<T, 2, 2>, value_pass<T, 2, 3>},
    {value_pass<T, 3, 1>, value_pass<T, 3, 2>, value_pass<T, 3, 3>},
};

template <typename T>
AVX2 void attend_block(const T* q, int64_t q_stride, int64_t rows, const T* kpool, const T* vpool, const int64_t* table,
                       const int64_t* pos, int64_t kvh, T* out, const AttnShape& s, AttnScratch& w) {
    const BlockKeys b = block_keys(table, pos, rows, s, w);
    const int64_t d = s.head_dim, g = s.heads / s.kv_heads, chunks = d / 8, n = rows * g;
    const int64_t lo = b.lo, base = lo / 8 * 8, span = (b.hi / 8 + 1) * 8 - base;
    stage(q, q_stride, rows, kpool, vpool, kvh, s, b, w);
    w.scores.resize(static_cast<size_t>((n + QV - 1) / QV * QV * span));
    // scores: each group of QV vectors over the tiles its rows see (any of its rows: the others' are
    // computed and never read)
    for (int64_t v0 = 0; v0 < n; v0 += QV) {
        int64_t first = INT64_MAX, last = 0;
        for (int64_t v = v0; v < std::min(v0 + QV, n); ++v) {
            first = std::min(first, b.first[v / g]);
            last = std::max(last, pos[v / g]);
        }
        score_vectors(v0, (first - base) / 8, (last - base) / 8 + 1, span, s, w);
    }
    // softcap and softmax, one vector at a time over its row's tiles: lane j sums the keys = j mod 8 in
    // key order (keys outside the row's range exact zeros), then hsum8's tree
    for (int64_t v = 0; v < n; ++v) {
        const int64_t r = v / g, t0 = b.first[r] / 8 * 8, t1 = pos[r] / 8 * 8;
        float* sv = w.scores.data() + v * span - base;
        if (s.softcap > 0.0f)
            for (int64_t key = t0; key < t1 + 8; ++key) sv[key] = s.softcap * std::tanh(sv[key] / s.softcap);
        __m256 mx = _mm256_set1_ps(-INFINITY);
        for (int64_t t = t0; t <= t1; t += 8)
            mx = _mm256_blendv_ps(mx, _mm256_max_ps(mx, _mm256_loadu_ps(sv + t)), tile_lanes8(b.first[r], pos[r], t));
        const __m256 top = _mm256_set1_ps(hmax8(mx));
        __m256 sum = _mm256_setzero_ps();
        for (int64_t t = t0; t <= t1; t += 8) {
            const __m256 e =
                _mm256_and_ps(tile_lanes8(b.first[r], pos[r], t), exp8(_mm256_sub_ps(_mm256_loadu_ps(sv + t), top)));
            _mm256_storeu_ps(sv + t, e);
            sum = _mm256_add_ps(sum, e);
        }
        const __m256 inv = _mm256_set1_ps(1.0f / hsum8(sum));
        for (int64_t t = t0; t <= t1; t += 8) _mm256_storeu_ps(sv + t, _mm256_mul_ps(_mm256_loadu_ps(sv + t), inv));
    }
    // the V sum: up to VG vectors of a row x CG chunks per pass (value_pass), each output element one
    // chain over the row's keys in order
    const float* vf = w.vf.data() - lo * d;  // vf[key * d]
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t h0 = 0; h0 < g; h0 += VG) {
            const int64_t nv = std::min<int64_t>(VG, g - h0);
            const float* p = w.scores.data() + (r * g + h0) * span - base;  // p[v * span + key]
            T* o = out + r * s.heads * d + (kvh * g + h0) * d;
            for (int64_t c0 = 0; c0 < chunks; c0 += CG) {
                const ValuePass<T> run = VALUE_PASSES<T>[nv - 1][std::min<int64_t>(CG, chunks - c0) - 1];
                run(p, span, vf + c0 * 8, d, b.first[r], pos[r], o + c0 * 8);
            }
        }
}

}  // namespace
}  // namespace avx2

template <typename T>
void attend_block_avx2(const T* q, int64_t q_stride, int64_t rows, const T* kpool, const T* vpool, const int64_t* table,
                       const int64_t* pos, int64_t kvh, T* out, const AttnShape& s, AttnScratch& w) {
    avx2::attend_block(q, q_stride, rows, kpool, vpool, table, pos, kvh, out, s, w);
}

template void attend_block_avx2<float>(const float*, int64_t, int64_t, const float*, const float*, const int64_t*,
                                       const int64_t*, int64_t, float*, const AttnShape&, AttnScratch&);
template void attend_block_avx2<uint16_t>(const uint16_t*, int64_t, int64_t, const uint16_t*, const uint16_t*,
                                          const int64_t*, const int64_t*, int64_t, uint16_t*, const AttnShape&,
                                          AttnScratch&);

}  // namespace minisgl::cpu
