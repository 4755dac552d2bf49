// linear_dpbf16: y = x @ w^T (+ bias) at any row count on vdpbf16ps, the `avx512bf16` family's linear
// (AVX512-BF16 without AMX: AMD Zen 4/5, Intel Cooper Lake), and linear_dpbf16_silu, the same GEMM
// over a fused gate/up weight with SiLU x up applied on the way out.
//
// vdpbf16ps multiplies 16 (even, odd) bf16 pairs of one register by 16 pairs of another and adds both
// products into 16 float32 lanes: 32 multiply-adds per instruction, where a float32 FMA of the same
// width does 16, so the float32 split of linear_bf16 would cost about half the rate here. pack_dpbf16 lays the weights
// out once at load in the order the kernel reads them: panels of 64 outputs (the last one 16, 32 or 48), each [K/2
// pairs][outputs][2], so one k-pair of a panel is four 64-byte vectors and a panel is one contiguous run. A k-pair of
// an input row is one 32-bit broadcast; a 6-row x 64-output tile keeps 24 accumulators in registers.
//
// Bit-exactness: each output element is one vdpbf16ps chain over K in pair order, started at zero
// (K blocks spill the chain to float32 memory and reload it unchanged), then the bias add and one
// rounding to bf16. Its bits therefore depend only on its own input row and weight row: never on the
// row count, on which tile or chunk the row lands in, or on the thread count
// (tests/kernels/test_cpu_kernels.py), so the default and the batch-invariant forward share it, as they share
// linear_amx.

#include <algorithm>
#include <vector>

#include "common.h"
#include "kernels.h"

namespace minisgl::cpu {
namespace {

constexpr int DP_ROWS = 6;            // rows per register tile: 6 x 4 accumulators + 4 weights + 1 input
constexpr int64_t DP_ROW_CHUNK = 96;  // rows per pass over a panel: their K block of x stays in L2
// Chunks of rows that pass over every panel before the next group: their rows stay in L2 from one
// panel to the next (many rows of a small K ran ~10% faster than panel-major over every chunk).
constexpr int64_t DP_GROUP_CHUNKS = 2;
// Most k-pairs per block at many rows: a panel's block (up to 80 KB) stays in L2. K is cut into
// blocks of even length, so no short tail block spills and reloads the accumulators for a few pairs
// (K = 576, 288 pairs, is one block rather than 256 + 32 pairs).
constexpr int64_t DP_KC = 320;
// Lines of the panel this many bytes ahead are requested into L2: at one to a few rows a step is a
// weight stream, and the hardware prefetcher alone leaves it short of the memory's rate (into L2
// rather than L1: the same distance, a few percent faster at one row and more at four).
constexpr int64_t DP_PREFETCH_BYTES = 1024;

// R rows (x rows xs apart) x V vectors of 16 outputs, k-pairs p0..p1 of the panel, sums in c (row
// stride 64), started at zero when `first`. `stream`: the first tile over this block of the panel,
// which reads it from memory (the later tiles find it in cache).
template <int R, int V>
DPBF16 void dp_tile(const uint16_t* x, int64_t xs, const uint16_t* panel, int64_t p0, int64_t p1, float* c, bool first,
                    bool stream) {
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
                _mm_prefetch(reinterpret_cast<const char*>(wk) + DP_PREFETCH_BYTES + v * 64, _MM_HINT_T1);
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
        case 1:
            return dp_tile<1, V>;
        case 2:
            return dp_tile<2, V>;
        case 3:
            return dp_tile<3, V>;
        case 4:
            return dp_tile<4, V>;
        case 5:
            return dp_tile<5, V>;
        default:
            return dp_tile<6, V>;
    }
}

DpTile dp_tile_for(int rows, int vectors) {
    switch (vectors) {
        case 1:
            return dp_tile_of<1>(rows);
        case 2:
            return dp_tile_of<2>(rows);
        case 3:
            return dp_tile_of<3>(rows);
        default:
            return dp_tile_of<4>(rows);
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
    const int64_t blocks = (pairs + DP_KC - 1) / DP_KC;
    const int64_t kc = M <= DP_ROWS ? pairs : (pairs + blocks - 1) / blocks;
    // Over (group of rows, panel, chunk): within a group panel-major, a panel's K block staying in L2
    // while the group's chunks of rows pass over it, and the group's rows staying in L2 from one panel
    // to the next; each thread starts on one contiguous share (pool.h).
    // The items are dense (only the last group may hold fewer chunks), so each thread's share is real
    // work: at one chunk of rows (a decode step) every thread still starts on its own panels.
    const int64_t group = DP_GROUP_CHUNKS;
    parallel_for(threads, chunks * panels, 1, [&](int64_t i0, int64_t i1) DPBF16 {
        for (int64_t item = i0; item < i1; ++item) {
            alignas(64) float sums[DP_ROW_CHUNK * 64];
            const int64_t g = item / (group * panels), rest = item - g * group * panels;
            const int64_t in_group = std::min(group, chunks - g * group);
            const int64_t chunk = g * group + rest % in_group;
            const int64_t c0 = chunk * DP_ROW_CHUNK, c1 = std::min(M, c0 + DP_ROW_CHUNK);
            const int64_t n0 = rest / in_group * 64, width = std::min<int64_t>(64, np - n0);
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
    });
}

}  // namespace

// K is padded to whole pairs (a zero weight; linear_dpbf16 pads x the same way).
int64_t packed_dpbf16_elems(int64_t N, int64_t K) { return (N + 15) / 16 * 16 * (K + K % 2); }

// `gated` (a fused gate/up weight [gate | up], N = 2I with I a multiple of 32): panel p holds gate rows
// 32p..32p+31 then up rows I+32p..I+32p+31, so linear_dpbf16_silu finds both halves of its 32
// outputs in one panel.
namespace {

// Columns j0..j0+15 of a whole panel from 16 consecutive rows (row0 on) of a weight whose rows are an
// even number of elements: the panel wants bf16 pair `pair` of each row side by side, a transpose of
// 32-bit pairs, gathered here 16 rows' pair at a time.
AVX512 void pack_dpbf16_rows(const uint16_t* wp, uint16_t* panel, int64_t row0, int64_t j0, int64_t K) {
    const __m512i rows = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                            _mm512_set1_epi32(int(K / 2)));
    const auto* base = reinterpret_cast<const int*>(wp + row0 * K);
    auto* out = reinterpret_cast<int*>(panel) + j0;
    for (int64_t pair = 0; pair < K / 2; ++pair)
        _mm512_storeu_si512(out + pair * 64, _mm512_i32gather_epi32(rows, base + pair, 4));
}

}  // namespace

void pack_dpbf16(uintptr_t w, uintptr_t out, int64_t N, int64_t K, bool gated, int threads) {
    const auto* wp = reinterpret_cast<const uint16_t*>(w);
    auto* op = reinterpret_cast<uint16_t*>(out);
    const int64_t np = (N + 15) / 16 * 16, panels = (np + 63) / 64, kp = K + K % 2;
    // Whole panels of an even-K weight are gathered 16 rows at a time (the gather's 32-bit indices
    // reach 15 rows on); the last, partial panel and odd K element by element: the same layout.
    static const bool avx512 = cpu_has_avx512();
    const bool gather = avx512 && K % 2 == 0 && 15 * K < (int64_t(1) << 31);
    parallel_for(threads, panels, 0, [&](int64_t p0, int64_t p1) {
        for (int64_t p = p0; p < p1; ++p) {
            const int64_t n0 = p * 64, width = std::min<int64_t>(64, np - n0);
            uint16_t* panel = op + n0 * kp;
            if (gather && width == 64 && n0 + 64 <= N) {
                for (int64_t j0 = 0; j0 < 64; j0 += 16)
                    pack_dpbf16_rows(wp, panel, gated ? (j0 < 32 ? n0 / 2 + j0 : N / 2 + n0 / 2 + j0 - 32) : n0 + j0,
                                     j0, K);
                continue;
            }
            for (int64_t pair = 0; pair < kp / 2; ++pair)
                for (int64_t j = 0; j < width; ++j)
                    for (int64_t e = 0; e < 2; ++e) {
                        const int64_t n = gated ? (j < 32 ? n0 / 2 + j : N / 2 + n0 / 2 + j - 32) : n0 + j;
                        const int64_t k = 2 * pair + e;
                        panel[(pair * width + j) * 2 + e] = n < N && k < K ? wp[n * K + k] : 0;
                    }
        }
    });
}

// Rows `ids` of the weight pack_dpbf16 laid out (gated or not), back in [count, K] order: the inverse
// of its index map, so a packed weight is the only copy the model needs.
void packed_rows_dpbf16(uintptr_t packed, int64_t N, int64_t K, bool gated, uintptr_t ids, int64_t count, uintptr_t out,
                        int threads) {
    const auto* pp = reinterpret_cast<const uint16_t*>(packed);
    const auto* ip = reinterpret_cast<const int64_t*>(ids);
    auto* op = reinterpret_cast<uint16_t*>(out);
    const int64_t np = (N + 15) / 16 * 16, kp = K + K % 2;
    parallel_for(threads, count, 16, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) {
            const int64_t row = ip[r];
            int64_t p = row / 64, j = row % 64;
            if (gated) {  // panel p holds gate rows 32p.. then up rows N/2 + 32p..
                const int64_t half = N / 2, g = row < half ? row : row - half;
                p = g / 32;
                j = (row < half ? 0 : 32) + g % 32;
            }
            const int64_t n0 = p * 64, width = std::min<int64_t>(64, np - n0);
            const uint16_t* panel = pp + n0 * kp;
            for (int64_t k = 0; k < K; ++k) op[r * K + k] = panel[(k / 2 * width + j) * 2 + k % 2];
        }
    });
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
                          if (lanes == 0xffff)
                              _mm256_storeu_si256(reinterpret_cast<__m256i*>(yp + r * N + n), round_to_bf16_dp(s));
                          else
                              _mm256_mask_storeu_epi16(yp + r * N + n, lanes, round_to_bf16_dp(s));
                      }
                  }
              });
}

// y [M, I] = silu(gate) * up over a fused gate/up weight packed `gated` (N = 2I, pack_dpbf16): the
// GEMM and silu_and_mul in one pass, rounding as the two do in turn (the gate and up sums to bf16,
// SiLU to bf16, then the product), so the same bits without writing [M, 2I] out and reading it
// back (silu_and_mul was ~6% of a SmolLM2 prefill forward, docs/performance.md "Speed").
DPBF16 void linear_dpbf16_silu(uintptr_t x, uintptr_t packed, uintptr_t y, int64_t M, int64_t I, int64_t K,
                               int threads) {
    auto* yp = reinterpret_cast<uint16_t*>(y);
    dp_linear(reinterpret_cast<const uint16_t*>(x), reinterpret_cast<const uint16_t*>(packed), M, 2 * I, K, threads,
              [&](const float* sums, int64_t c0, int64_t c1, int64_t n0, int) DPBF16 {
                  for (int64_t r = c0; r < c1; ++r)
                      for (int h = 0; h < 2; ++h) {
                          const float* sr = sums + (r - c0) * 64 + h * 16;
                          _mm256_storeu_si256(reinterpret_cast<__m256i*>(yp + r * I + n0 / 2 + h * 16),
                                              silu_mul_bf16(_mm512_load_ps(sr), _mm512_load_ps(sr + 32)));
                      }
              });
}

}  // namespace minisgl::cpu
