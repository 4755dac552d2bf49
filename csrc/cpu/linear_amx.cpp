// linear_amx: y = x @ w^T (+ bias) at any row count on the AMX tile unit (AMX-BF16, Sapphire Rapids
// and later), the `amx` family's linear. The unit multiplies a 16-row x 32-element bf16 tile of x by
// a 32 x 16 tile of weights into 16 x 16 float32 sums in one instruction. The weights are packed
// once at load (pack_amx) into the unit's pair-interleaved layout, in the order the kernel streams
// them: [N/32][K/32][2 tiles][16 k-pairs][16 outputs x 2], zero-padded to whole tiles, so one
// 32-output block is one contiguous run of memory. A fused [gate | up] weight may be packed `gated`:
// block b's two tiles are then gate rows 16b.. and up rows I + 16b.. (I = N / 2), so
// linear_amx_silu finds both halves of 16 outputs of silu(gate) * up in one block.
//
// Bit-exactness: each output element is the unit's dot product over K in 32-element steps in a
// fixed order, summed into float32 in the unit; nothing else touches it but the bias add and one
// rounding to bf16. Its bits therefore depend only on its own input row and weight row: never on the
// row count, on which tile the row lands in, or on the thread count (checked by
// tests/kernels/test_cpu_kernels.py), which is what the batch-invariant forward needs, at prefill speed.

#include <algorithm>
#include <vector>

#include "common.h"
#include "kernels.h"

namespace minisgl::cpu {
namespace {

constexpr int64_t AMX_ROW_CHUNK = 256;  // rows per pass over a weight block: x's chunk stays in L2
// Over weights streamed from memory (amx_rows: a decode step's few rows), each k-step's two weight
// tiles are copied into an L1 buffer with vector loads and the tile unit loads them from there: its
// own loads of lines from beyond L1 keep the stream well short of the memory's rate, which vector
// loads reach. The stream is requested into L2 this many bytes ahead of the line being copied: the
// hardware prefetcher alone does not run far enough ahead. The panel order reads its weights from L2
// for many rows each, where a copy per row block would cost more than the tile loads it speeds up.
constexpr int64_t STREAM_PREFETCH_BYTES = 8192;
// The panel order (amx_panels) keeps a 32-row block of x, packed, in L1 while the weight tiles
// stream past it (read with the streaming hint, so they do not push it out): up to this many
// k-steps of it at a time (32 KB: most of L1). Longer parts would leave too little room beside the
// kept sums and the outputs being written, and the block would be reloaded from L2 for every
// weight block; shorter ones store and reload the float32 sums more often than they save.
constexpr int64_t PANEL_MAX_KSTEPS = 16;
// Bytes of packed weights per panel: the panel stays in L2 while every row block of a row chunk
// passes over it.
constexpr int64_t PANEL_WEIGHT_BYTES = 896 * 1024;
// A panel spans at least this many weight blocks. Each part of a row block is read from beyond L2
// once per panel and used by every block of it, so a panel of a few blocks leaves the kernel waiting
// on x; where K is so long that this many blocks' whole K would not fit in the panel's bytes, the
// panel covers a range of K at a time, and every row block's float32 sums are kept between ranges.
// Those kept sums (4 KB a block for each row block of the chunk) share L2 with the panel's weights:
// at twice this many blocks they would outweigh the weights themselves, the two would no longer fit
// in L2 together, and every range would reload both from beyond it.
constexpr int64_t PANEL_MIN_BLOCKS = 8;
constexpr int64_t PANEL_ROW_CHUNK = 512;  // rows per work item of the panel order

struct alignas(64) Line {  // one cache line of scratch
    uint16_t e[32];
};

// The 2 KB (32 lines) of weight tiles of one k-step into an L1 buffer, requesting the line
// STREAM_PREFETCH_BYTES ahead of each; past the block's end that is the next block's start, which
// the thread reads next (a prefetch never faults).
AMX inline void stage_kstep(const uint16_t* w, uint16_t* stage) {
    for (int line = 0; line < 32; ++line) {
        _mm_prefetch(reinterpret_cast<const char*>(w + line * 32) + STREAM_PREFETCH_BYTES, _MM_HINT_T1);
        _mm512_store_si512(stage + line * 32, _mm512_load_si512(w + line * 32));
    }
}

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

// A thread's tile shape for blocks of `rows` rows: ra rows in the first tiles, rb in the second
// (ldtilecfg only when it changes); release() hands the tiles back once the thread is done.
struct TileShape {
    int ra = -1, rb = -1;
    AMX void fit(int rows) {
        const int a = std::min(16, rows), b = rows - a;
        if (a != ra || b != rb) {
            configure_tiles(a, b);
            ra = a;
            rb = b;
        }
    }
    AMX void release() const {
        if (ra >= 0) _tile_release();
    }
};

// rows x 32 float32 sums (row stride 32) + bias, rounded, into y's columns n0.. (the valid ones). Out
// float: each output rounded to bf16 and widened back (the bits of the bf16 output's .float(), with no
// pass over it afterwards).
template <typename Out>
AMX void store_sums(const float* sums, int rows, int64_t n0, int64_t N, const uint16_t* bias, Out* y) {
    const int64_t left = N - n0;
    const __mmask16 lo = first_lanes(left), hi = left > 16 ? first_lanes(left - 16) : 0;
    const __m512 b0 = bias ? load_bf16x16(bias + n0, lo) : _mm512_setzero_ps();
    const __m512 b1 = bias ? load_bf16x16(bias + n0 + 16, hi) : _mm512_setzero_ps();
    for (int r = 0; r < rows; ++r) {
        __m512 v0 = _mm512_load_ps(sums + r * 32), v1 = _mm512_load_ps(sums + r * 32 + 16);
        if (bias) {
            v0 = _mm512_add_ps(v0, b0);
            v1 = _mm512_add_ps(v1, b1);
        }
        Out* yr = y + r * N + n0;
        if constexpr (std::is_same_v<Out, float>) {
            _mm512_mask_storeu_ps(yr, lo, round16<uint16_t>(v0));
            _mm512_mask_storeu_ps(yr + 16, hi, round16<uint16_t>(v1));
        } else {
            _mm256_mask_storeu_epi16(yr, lo, round_to_bf16(v0));
            _mm256_mask_storeu_epi16(yr + 16, hi, round_to_bf16(v1));
        }
    }
}

// rows x 16 outputs of silu(gate) * up from a gated block's sums (gate in columns 0-15, up in 16-31)
// into y's columns 16 nb.. (row stride I).
AMX void store_silu(const float* sums, int rows, int64_t nb, int64_t I, uint16_t* y) {
    for (int r = 0; r < rows; ++r)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * I + nb * 16),
                            silu_mul_bf16(_mm512_load_ps(sums + r * 32), _mm512_load_ps(sums + r * 32 + 16)));
}

// store_silu's outputs into the rows of the down projection's input as pack_rows lays them out (KB
// k-steps a row): outputs 16 nb.. are half (nb % 2) of k-step nb / 2.
AMX void store_silu_packed(const float* sums, int rows, int64_t nb, int64_t m0, int64_t KB, uint16_t* ap) {
    for (int r = 0; r < rows; ++r) {
        const int64_t row = m0 + r;
        _mm256_store_si256(
            reinterpret_cast<__m256i*>(ap + ((row / 16 * KB + nb / 2) * 16 + row % 16) * 32 + nb % 2 * 16),
            silu_mul_bf16(_mm512_load_ps(sums + r * 32), _mm512_load_ps(sums + r * 32 + 16)));
    }
}

// x's rows, packed for the tile unit: 16-row tiles, each k-step of a tile one contiguous 1 KB
// ([M/16][KB][16 rows][32]), K and the last tile's rows zero-padded. A tile loads from here
// with a 64-byte stride, which the unit reads several times faster than rows K elements apart.
AMX void pack_rows(const uint16_t* x, int64_t M, int64_t K, int64_t KB, uint16_t* out, int threads) {
    const int64_t tiles = (M + 15) / 16;
    parallel_for(threads, tiles, 4, [&](int64_t t0, int64_t t1) AMX {
        for (int64_t t = t0; t < t1; ++t)
            for (int64_t kb = 0; kb < KB; ++kb) {
                const int64_t cols = std::min<int64_t>(32, K - kb * 32);
                const __mmask32 mask = cols >= 32 ? ~__mmask32(0) : (__mmask32(1) << cols) - 1;
                uint16_t* dst = out + (t * KB + kb) * 512;
                for (int r = 0; r < 16; ++r) {
                    const int64_t row = t * 16 + r;
                    const __m512i v =
                        row < M ? _mm512_maskz_loadu_epi16(mask, x + row * K + kb * 32) : _mm512_setzero_si512();
                    _mm512_store_si512(dst + r * 32, v);
                }
            }
    });
}

// One block of up to 32 rows x 32 outputs over its packed weights wb, all KB k-steps, x as it lies
// (a: the first ra rows, b: the next rb, nullptr: none; rows `stride` bytes apart), the sums stored
// into `sums` ([32][32], the first rows' in rows 0-15). The weights come from memory, each k-step
// staged through L1 one step ahead of its products (stage_kstep; two buffers, so a copy never
// overwrites tiles still to be loaded). Each step's loads are interleaved with the products that
// wait on them: the unit's tile registers are not renamed, so a load into tmm4 waits for the last
// product reading it, and a step that loaded all four tiles first would hold the next step's loads
// behind all four products.
AMX void amx_block(const uint16_t* a, const uint16_t* b, int64_t stride, const uint16_t* wb, int64_t KB, float* sums) {
    _tile_zero(0);
    _tile_zero(1);
    if (b) {
        _tile_zero(2);
        _tile_zero(3);
    }
    alignas(64) uint16_t stage[2][1024];
    stage_kstep(wb, stage[0]);
    for (int64_t kb = 0; kb < KB; ++kb) {
        if (kb + 1 < KB) stage_kstep(wb + (kb + 1) * 1024, stage[(kb + 1) & 1]);
        const uint16_t* w = stage[kb & 1];
        _tile_loadd(4, a + kb * 32, stride);
        _tile_loadd(6, w, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_loadd(7, w + 512, 64);
        _tile_dpbf16ps(1, 4, 7);
        if (b) {
            _tile_loadd(5, b + kb * 32, stride);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
    _tile_stored(0, sums, 128);
    _tile_stored(1, sums + 16, 128);
    if (b) {
        _tile_stored(2, sums + 16 * 32, 128);
        _tile_stored(3, sums + 16 * 32 + 16, 128);
    }
}

// One row block of pack_rows' tiles (a: the first ra rows, b: the next rb, nullptr: none) over the
// weight blocks [nb0, nb1), k-steps [k0, k1) of each. A block's first part (first) starts from zero
// sums, a later one from the float32 sums the part before it left in `parts` (1,024 a block: four
// 16 x 16 tiles, 64-byte rows); the last part (last) stores each block's sums into `sums` ([32][32],
// the first rows' in rows 0-15), any other into `parts`. Storing a float32 sum and loading it back
// is exact, so each output is the same chain of tile products in the same order however K is cut
// and whichever layout x is read from (amx_block's): the same bits.
// Each block's last k-step runs into the next block's first: an accumulator is stored and the next
// block's sums loaded (or zeroed) into it one tile at a time, each just before the product that
// needs it, so the tile unit does not sit idle while four tiles drain and four more arrive; the
// next block's kept sums are requested into L1 during the block before. The weights are read with the
// streaming hint: each tile is used by this row block once, and caching it in L1 would evict the
// row block's tiles, which every block of the sweep reads again.
// between(s, steps) runs vector work in the middle of k-step s of a block's `steps` while that
// step's products run, and once more (s = steps) before the block's sums are stored, so the work
// may read `sums` up to then; done(nb) runs once block nb's sums are in `sums` (last) or `parts`.
template <typename Between, typename Done>
AMX void amx_sweep(const uint16_t* a, const uint16_t* b, const uint16_t* wp, int64_t KB, int64_t nb0, int64_t nb1,
                   int64_t k0, int64_t k1, bool first, bool last, float* parts, float* sums, const Between& between,
                   const Done& done) {
    const int64_t steps = k1 - k0, lines = (64 + steps - 1) / steps;
    const int64_t rs = last ? 128 : 64, o1 = last ? 16 : 256, o2 = 512, o3 = last ? 528 : 768;
    float* out = nullptr;  // where the block before stores its sums (none before the first)
    for (int64_t nb = nb0; nb < nb1; ++nb) {
        const uint16_t *wb = wp + nb * KB * 1024, *w = wb + k0 * 1024;
        float* part = parts ? parts + (nb - nb0) * 1024 : nullptr;
        // The block before's sums out and this block's in, a tile at a time, within this block's first
        // k-step.
        if (out) _tile_stored(0, out, rs);
        if (first)
            _tile_zero(0);
        else
            _tile_loadd(0, part, 64);
        _tile_loadd(4, a + k0 * 512, 64);
        _tile_stream_loadd(6, w, 64);
        _tile_dpbf16ps(0, 4, 6);
        if (out) _tile_stored(1, out + o1, rs);
        if (first)
            _tile_zero(1);
        else
            _tile_loadd(1, part + 256, 64);
        _tile_stream_loadd(7, w + 512, 64);
        _tile_dpbf16ps(1, 4, 7);
        if (b) {
            if (out) _tile_stored(2, out + o2, rs);
            if (first)
                _tile_zero(2);
            else
                _tile_loadd(2, part + 512, 64);
            _tile_loadd(5, b + k0 * 512, 64);
            _tile_dpbf16ps(2, 5, 6);
            if (out) _tile_stored(3, out + o3, rs);
            if (first)
                _tile_zero(3);
            else
                _tile_loadd(3, part + 768, 64);
            _tile_dpbf16ps(3, 5, 7);
        }
        if (out) done(nb - 1);
        const char* ahead = !first && nb + 1 < nb1 ? reinterpret_cast<const char*>(part + 1024) : nullptr;
        for (int64_t kb = k0 + 1; kb < k1; ++kb) {
            if (ahead)
                for (int64_t l = (kb - k0) * lines; l < std::min<int64_t>(64, (kb - k0 + 1) * lines); ++l)
                    _mm_prefetch(ahead + l * 64, _MM_HINT_T0);
            w = wb + kb * 1024;
            _tile_loadd(4, a + kb * 512, 64);
            _tile_stream_loadd(6, w, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_stream_loadd(7, w + 512, 64);
            _tile_dpbf16ps(1, 4, 7);
            between(kb - k0, steps);
            if (b) {
                _tile_loadd(5, b + kb * 512, 64);
                _tile_dpbf16ps(2, 5, 6);
                _tile_dpbf16ps(3, 5, 7);
            }
        }
        between(steps, steps);
        out = last ? sums : part;
    }
    _tile_stored(0, out, rs);
    _tile_stored(1, out + o1, rs);
    if (b) {
        _tile_stored(2, out + o2, rs);
        _tile_stored(3, out + o3, rs);
    }
    done(nb1 - 1);
}

// Many rows (a prompt chunk), over x's rows as pack_rows lays them out (ap): each work item is one
// panel of weight blocks (kept in L2) x one chunk of rows, walked row block by row block (for a long
// K, range of K by range: PANEL_MIN_BLOCKS). Each packed row block stays in L1 while the panel's
// weight tiles stream past it; where K is too long for that, the row block is cut into parts of up
// to PANEL_MAX_KSTEPS k-steps, each part passing over the whole panel with the blocks' float32 sums
// kept between parts. The order over the weight blocks (amx_rows') reloads each row block from L2
// for every weight block instead, with strided tile loads, which are the kernel's bottleneck there.
// finish(sums, rows, nb, m0) stores a block's sums (store_sums, store_silu or store_silu_packed).
template <typename Finish>
AMX void amx_panels(const uint16_t* ap, const uint16_t* wp, int64_t M, int64_t N, int64_t K, int threads,
                    const Finish& finish) {
    const int64_t NB = (N + 31) / 32, KB = (K + 31) / 32;
    int64_t panel = PANEL_WEIGHT_BYTES / (KB * 2048), ranges = 1;
    if (panel < PANEL_MIN_BLOCKS) {
        panel = PANEL_MIN_BLOCKS;
        ranges = (KB + PANEL_WEIGHT_BYTES / (panel * 2048) - 1) / (PANEL_WEIGHT_BYTES / (panel * 2048));
    }
    const int64_t span = (KB + ranges - 1) / ranges;  // k-steps per range
    const int64_t panels = (NB + panel - 1) / panel, chunks = (M + PANEL_ROW_CHUNK - 1) / PANEL_ROW_CHUNK;
    const int64_t parts = (span + PANEL_MAX_KSTEPS - 1) / PANEL_MAX_KSTEPS, step = (span + parts - 1) / parts;
    const bool keep = KB > step;
    const int64_t kept_blocks = panel * (ranges > 1 ? PANEL_ROW_CHUNK / 32 : 1);
    run_parallel(threads, panels * chunks, 1, [&](WorkShare& share, int slot) AMX {
        alignas(64) float sums[32 * 32];
        // The last finished block's outputs: written a few rows at a time between the tile products of
        // the blocks after it, so the vector units and the stores work while the tile unit multiplies.
        struct {
            int rows = 0, done = 0;
            int64_t nb = 0, m0 = 0;
        } due;
        const auto between = [&](int64_t s, int64_t steps) AMX {
            if (due.done == due.rows) return;
            const int upto = s >= steps ? due.rows : static_cast<int>((due.rows * (s + 1) + steps - 1) / steps);
            if (upto <= due.done) return;
            finish(sums + due.done * 32, upto - due.done, due.nb, due.m0 + due.done);
            due.done = upto;
        };
        // 4 KB of sums per block of the panel (and per row block of the chunk when K is in ranges),
        // grown and kept
        static thread_local std::vector<Line> kept;
        if (keep && kept.size() < static_cast<size_t>(kept_blocks * 64))
            kept.resize(static_cast<size_t>(kept_blocks * 64));
        TileShape shape;
        for (int64_t i0, i1; share.claim(slot, i0, i1);)
            for (int64_t item = i0; item < i1; ++item) {
                const int64_t nb0 = item % panels * panel, nb1 = std::min(NB, nb0 + panel);
                const int64_t c0 = item / panels * PANEL_ROW_CHUNK, c1 = std::min(M, c0 + PANEL_ROW_CHUNK);
                for (int64_t r0 = 0; r0 < KB; r0 += span)
                    for (int64_t m0 = c0; m0 < c1; m0 += 32) {
                        const int rows = static_cast<int>(std::min<int64_t>(32, c1 - m0));
                        shape.fit(rows);
                        const int rb = shape.rb;
                        const uint16_t* a = ap + m0 / 16 * KB * 512;
                        Line* mine = kept.data() + (ranges > 1 ? (m0 - c0) / 32 * panel * 64 : 0);
                        for (int64_t k0 = r0; k0 < std::min(KB, r0 + span); k0 += step) {
                            const int64_t k1 = std::min({KB, r0 + span, k0 + step});
                            amx_sweep(a, rb ? a + KB * 512 : nullptr, wp, KB, nb0, nb1, k0, k1, k0 == 0, k1 == KB,
                                      keep ? reinterpret_cast<float*>(mine) : nullptr, sums, between,
                                      [&](int64_t nb) AMX {
                                          if (k1 == KB) due = {rows, 0, nb, m0};
                                      });
                        }
                    }
            }
        between(1, 1);
        shape.release();
    });
}

// Few rows, or x as it lies: over weight blocks, each thread starting on one contiguous slice of the
// weights (pool.h), a block's weights staying in L1/L2 while every row of a chunk uses them.
template <typename Finish>
AMX void amx_rows(const uint16_t* xp, const uint16_t* wp, int64_t M, int64_t N, int64_t K, int threads,
                  const Finish& finish) {
    const int64_t NB = (N + 31) / 32, KB = (K + 31) / 32, xs = KB * 32;
    std::vector<uint16_t> padded;  // x with K zero-padded to whole k-steps, when it is not already
    if (xs != K) {
        padded.assign(static_cast<size_t>(M * xs), 0);
        for (int64_t m = 0; m < M; ++m) std::memcpy(padded.data() + m * xs, xp + m * K, K * 2);
        xp = padded.data();
    }
    for (int64_t c0 = 0; c0 < M; c0 += AMX_ROW_CHUNK) {
        const int64_t c1 = std::min(M, c0 + AMX_ROW_CHUNK);
        run_parallel(threads, NB, 0, [&](WorkShare& share, int slot) AMX {
            alignas(64) float sums[32 * 32];
            TileShape shape;
            for (int64_t nb0, nb1; share.claim(slot, nb0, nb1);)
                for (int64_t nb = nb0; nb < nb1; ++nb)
                    for (int64_t m0 = c0; m0 < c1; m0 += 32) {
                        const int rows = static_cast<int>(std::min<int64_t>(32, c1 - m0));
                        shape.fit(rows);
                        const uint16_t* x = xp + m0 * xs;
                        amx_block(x, shape.rb ? x + 16 * xs : nullptr, xs * 2, wp + nb * KB * 1024, KB, sums);
                        finish(sums, rows, nb, m0);
                    }
            shape.release();
        });
    }
}

// Elements of x's rows as pack_rows lays them out (whole 16-row tiles x whole k-steps).
inline int64_t packed_rows_elems(int64_t M, int64_t K) { return (M + 15) / 16 * ((K + 31) / 32) * 512; }

// A buffer of the calling thread for `elems` bf16, grown and kept (a fresh one per call pays page
// faults on every touch); 64-byte elements keep each packed tile row on one cache line. Each caller
// names its own buffer, so two live at once do not share one.
inline uint16_t* kept_buffer(std::vector<Line>& buf, int64_t elems) {
    if (buf.size() < static_cast<size_t>((elems + 31) / 32)) buf.resize(static_cast<size_t>((elems + 31) / 32));
    return reinterpret_cast<uint16_t*>(buf.data());
}

// Many rows in panel order (the rows packed once), few as they lie (amx_rows).
template <typename Finish>
AMX void amx_gemm(const uint16_t* xp, const uint16_t* wp, int64_t M, int64_t N, int64_t K, int threads,
                  const Finish& finish) {
    if (M <= 32) return amx_rows(xp, wp, M, N, K, threads, finish);
    static thread_local std::vector<Line> rows;
    uint16_t* ap = kept_buffer(rows, packed_rows_elems(M, K));
    pack_rows(xp, M, K, (K + 31) / 32, ap, threads);
    amx_panels(ap, wp, M, N, K, threads, finish);
}

}  // namespace

int64_t packed_amx_elems(int64_t N, int64_t K) { return (N + 31) / 32 * ((K + 31) / 32) * 1024; }

// The weight row in tile j's output n of block nb (pack_amx's order; gated: gate rows, then up rows).
inline int64_t amx_row(int64_t nb, int64_t j, int64_t n, int64_t N, bool gated) {
    return gated ? j * (N / 2) + nb * 16 + n : nb * 32 + j * 16 + n;
}

namespace {

// One tile of the pack from 16 whole rows (row0 on) and 32 whole columns (col0 on) of a weight whose
// rows are an even number of elements: the tile wants bf16 pair p of row n at [p][n], a 16 x 16
// transpose of 32-bit pairs, gathered here a tile row (16 rows' pair p) at a time.
AVX512 void pack_amx_tile(const uint16_t* wp, uint16_t* tile, int64_t row0, int64_t col0, int64_t K) {
    const __m512i rows = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                            _mm512_set1_epi32(int(K / 2)));
    const auto* base = reinterpret_cast<const int*>(wp + row0 * K + col0);
    for (int p = 0; p < 16; ++p) _mm512_storeu_si512(tile + p * 32, _mm512_i32gather_epi32(rows, base + p, 4));
}

}  // namespace

void pack_amx(uintptr_t w, uintptr_t out, int64_t N, int64_t K, bool gated, int threads) {
    const auto* wp = reinterpret_cast<const uint16_t*>(w);
    auto* op = reinterpret_cast<uint16_t*>(out);
    const int64_t NB = (N + 31) / 32, KB = (K + 31) / 32;
    // Whole tiles of an even-K weight are gathered (the gather's 32-bit indices reach 15 rows on);
    // the edges, zero-padded, element by element: the same layout either way.
    static const bool avx512 = cpu_has_avx512();
    const bool gather = avx512 && K % 2 == 0 && 15 * K < (int64_t(1) << 31);
    parallel_for(threads, NB, 0, [&](int64_t nb0, int64_t nb1) {
        for (int64_t nb = nb0; nb < nb1; ++nb)
            for (int64_t kb = 0; kb < KB; ++kb)
                for (int64_t j = 0; j < 2; ++j) {
                    uint16_t* tile = op + ((nb * KB + kb) * 2 + j) * 512;
                    const int64_t row0 = amx_row(nb, j, 0, N, gated);
                    if (gather && row0 + 16 <= N && kb * 32 + 32 <= K) {
                        pack_amx_tile(wp, tile, row0, kb * 32, K);
                        continue;
                    }
                    for (int64_t pair = 0; pair < 16; ++pair)
                        for (int64_t n = 0; n < 16; ++n)
                            for (int64_t e = 0; e < 2; ++e) {
                                const int64_t row = amx_row(nb, j, n, N, gated), col = kb * 32 + 2 * pair + e;
                                tile[(pair * 16 + n) * 2 + e] = row < N && col < K ? wp[row * K + col] : 0;
                            }
                }
    });
}

// Rows `ids` of the weight pack_amx laid out, back in [count, K] order: the inverse of its index map,
// so a packed weight is the only copy the model needs (a tied embedding reads its rows from here).
void packed_rows_amx(uintptr_t packed, int64_t N, int64_t K, bool gated, uintptr_t ids, int64_t count, uintptr_t out,
                     int threads) {
    const auto* pp = reinterpret_cast<const uint16_t*>(packed);
    const auto* ip = reinterpret_cast<const int64_t*>(ids);
    auto* op = reinterpret_cast<uint16_t*>(out);
    const int64_t KB = (K + 31) / 32;
    parallel_for(threads, count, 16, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) {
            const int64_t row = ip[r], half = N / 2;  // amx_row's inverse
            const int64_t j = gated ? row / half : row % 32 / 16, within = gated ? row % half : row;
            const int64_t nb = gated ? within / 16 : row / 32, n = within % 16;
            for (int64_t col = 0; col < K; ++col) {
                const int64_t kb = col / 32, pair = col % 32 / 2, e = col % 2;
                op[r * K + col] = pp[((((nb * KB + kb) * 2 + j) * 16 + pair) * 16 + n) * 2 + e];
            }
        }
    });
}

AMX void linear_amx_packed(const uint16_t* ap, uintptr_t packed, uintptr_t bias, uintptr_t y, int64_t M, int64_t N,
                           int64_t K, int threads) {
    const auto* bp = reinterpret_cast<const uint16_t*>(bias);
    auto* yp = reinterpret_cast<uint16_t*>(y);
    amx_panels(ap, reinterpret_cast<const uint16_t*>(packed), M, N, K, threads,
               [&](const float* sums, int rows, int64_t nb, int64_t m0)
                   AMX { store_sums(sums, rows, nb * 32, N, bp, yp + m0 * N); });
}

AMX void linear_amx(uintptr_t x, uintptr_t packed, uintptr_t bias, uintptr_t y, int64_t M, int64_t N, int64_t K,
                    int threads, bool widen) {
    const auto* bp = reinterpret_cast<const uint16_t*>(bias);
    const auto* xp = reinterpret_cast<const uint16_t*>(x);
    const auto* wp = reinterpret_cast<const uint16_t*>(packed);
    if (widen) {
        auto* yp = reinterpret_cast<float*>(y);
        return amx_gemm(xp, wp, M, N, K, threads, [&](const float* sums, int rows, int64_t nb, int64_t m0) AMX {
            store_sums(sums, rows, nb * 32, N, bp, yp + m0 * N);
        });
    }
    auto* yp = reinterpret_cast<uint16_t*>(y);
    amx_gemm(xp, wp, M, N, K, threads, [&](const float* sums, int rows, int64_t nb, int64_t m0) AMX {
        store_sums(sums, rows, nb * 32, N, bp, yp + m0 * N);
    });
}

// y [M, I] = silu(gate) * up over a fused [gate | up] weight packed `gated` (N = 2I): the GEMM and
// silu_and_mul in one pass, the same bits as the two in turn.
AMX void linear_amx_silu(uintptr_t x, uintptr_t packed, uintptr_t y, int64_t M, int64_t I, int64_t K, int threads) {
    auto* yp = reinterpret_cast<uint16_t*>(y);
    amx_gemm(reinterpret_cast<const uint16_t*>(x), reinterpret_cast<const uint16_t*>(packed), M, 2 * I, K, threads,
             [&](const float* sums, int rows, int64_t nb, int64_t m0)
                 AMX { store_silu(sums, rows, nb, I, yp + m0 * I); });
}

// y [M, H] = (silu(x @ gate^T) * (x @ up^T)) @ down^T (+ bias) over the gated [gate | up] pack (2I x H)
// and down's pack (H x I). Past 32 rows the SiLU x up outputs go straight into the row layout the
// down projection's panels read, so the [M, I] intermediate is neither written as it lies nor packed
// again; the same sums and roundings as linear_amx_silu then linear_amx, so the same bits.
AMX void mlp_amx(uintptr_t x, uintptr_t gate_up, uintptr_t down, uintptr_t bias, uintptr_t y, int64_t M, int64_t I,
                 int64_t H, int threads) {
    static thread_local std::vector<Line> act;
    if (M <= 32 || I % 32) {
        const auto h = reinterpret_cast<uintptr_t>(kept_buffer(act, M * I));
        linear_amx_silu(x, gate_up, h, M, I, H, threads);
        return linear_amx(h, down, bias, y, M, H, I, threads);
    }
    static thread_local std::vector<Line> rows;
    uint16_t* ap = kept_buffer(rows, packed_rows_elems(M, H));
    pack_rows(reinterpret_cast<const uint16_t*>(x), M, H, (H + 31) / 32, ap, threads);
    mlp_amx_packed(ap, gate_up, down, bias, y, M, I, H, threads);
}

AMX void mlp_amx_packed(const uint16_t* ap, uintptr_t gate_up, uintptr_t down, uintptr_t bias, uintptr_t y, int64_t M,
                        int64_t I, int64_t H, int threads) {
    const auto* bp = reinterpret_cast<const uint16_t*>(bias);
    auto* yp = reinterpret_cast<uint16_t*>(y);
    static thread_local std::vector<Line> act;
    uint16_t* hp = kept_buffer(act, packed_rows_elems(M, I));
    const int64_t KB = I / 32;
    amx_panels(ap, reinterpret_cast<const uint16_t*>(gate_up), M, 2 * I, H, threads,
               [&](const float* sums, int n, int64_t nb, int64_t m0)
                   AMX { store_silu_packed(sums, n, nb, m0, KB, hp); });
    amx_panels(hp, reinterpret_cast<const uint16_t*>(down), M, H, I, threads,
               [&](const float* sums, int n, int64_t nb, int64_t m0)
                   AMX { store_sums(sums, n, nb * 32, H, bp, yp + m0 * H); });
}

}  // namespace minisgl::cpu
