// What the two paged attentions share (attention.cpp, the AVX-512 families'; attention_avx2.cpp, the
// avx2 family's): the blocks of query rows they take, each thread's scratch, and where a block's keys
// lie in the pool. paged_attention_t (attention.cpp) splits the rows into blocks and runs one
// family's attend_block on each (block, KV head) over the threads.
#pragma once

#include <algorithm>
#include <climits>
#include <cstdint>
#include <vector>

#include <xmmintrin.h>

#include "kernels.h"

namespace minisgl::cpu {

// The attention of a block of up to ATTN_BLOCK query rows that share one block table (rows of one
// prefill chunk; a decode row is a block of one): each key's K and V rows are loaded and converted
// once per block and KV head and used by every query row and head of the group.
//
// Every query's arithmetic is the same whatever block it is in: its scores are one dot product per
// key (FMAs over head_dim in the family's lane width, 16 or 8, then a fixed reduction; or the tile
// unit's, on every block of the machine), its softmax sums by absolute key position mod the lane
// width (so which lane a key falls in depends on the key alone), and its output sums the keys in
// key order (on the tile unit, in 32-key steps aligned to absolute positions, in order). A row's
// bits thus depend only on its query, its position and the cached keys: not on the other rows of
// the call, the block sizes, the chunking, whether it is a decode or a prefill row or which of
// attend_vectors / attend_lanes ran. That is what lets the batch-invariant forward use it for every
// row.
//
// Blocks hold ATTN_MIN_BLOCK to ATTN_BLOCK rows (paged_attention_t picks the length per call).
constexpr int64_t ATTN_BLOCK = 64;
constexpr int64_t ATTN_MIN_BLOCK = 16;

struct AttnScratch {  // per thread, reused across its work items
    LineVector<float> q, scores, acc, kf, vf;
    LineVector<uint16_t> stage, pb, keys;
    LineVector<uint32_t> vpair, ppair;
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

// A decode block's K and then V rows are requested into L2 before its scores are computed, so that
// their memory latencies overlap one another and the scoring instead of stalling the scores and the V
// sum key by key (the rows of one KV head are 2-4 lines every kv_heads * head_dim elements, a stride
// the hardware prefetcher does not follow across shuffled blocks). Both prefetches pay off once the
// cache outgrows the last-level cache (python -m minisgl_backend.bench.attention, case decode_step).
template <typename T>
inline void prefetch_rows(const T* pool, const BlockKeys& b, int64_t kvh, const AttnShape& s, const AttnScratch& w) {
    const int64_t bytes = s.head_dim * static_cast<int64_t>(sizeof(T));
    for (int64_t j = 0; j <= b.hi - b.lo; ++j) {
        const char* row = reinterpret_cast<const char*>(pool + w.offsets[j] + kvh * s.head_dim);
        for (int64_t line = 0; line < bytes; line += 64) _mm_prefetch(row + line, _MM_HINT_T1);
    }
}

// The avx2 family's attention of one block (attention_avx2.cpp; head_dim a multiple of 8, up to 256):
// float32 FMAs, 8 lanes. Instantiated for float and bf16 (uint16_t).
template <typename T>
void attend_block_avx2(const T* q, int64_t q_stride, int64_t rows, const T* kpool, const T* vpool, const int64_t* table,
                       const int64_t* pos, int64_t kvh, T* out, const AttnShape& s, AttnScratch& w);

}  // namespace minisgl::cpu
