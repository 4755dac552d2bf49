// stream_read: the machine's streaming read rate, what a weight stream can reach here. `bytes` of a
// buffer are read once, split in contiguous slices over the threads, each summed 64 bytes at a time
// with the family's ISA (AVX-512 or AVX2; the sum is returned so the loads cannot be dropped).
// minisgl bench divides a decode step's weight bytes by its time against this figure. A probe, not a
// kernel: its sum's bits are not a contract.
//
// tile_rate: the AMX tile unit's sustained rate, the ceiling of the amx family's GEMMs. Each thread
// keeps two A and two B tiles loaded from `operands` and runs rounds of four independent products into
// four accumulators (the packed linear's 2 x 2 blocking) with nothing else in the loop: with the tiles
// resident, the unit's own rate; with each round loading its tiles (from L1 or L2, by the size of the
// operands), the ceiling of a GEMM's inner loop. Loaded tiles of nonzero values cost the unit more
// than zeros do, so the caller chooses the values: zeros give the rate a datasheet quotes, random
// values the one a GEMM can reach.

#include <algorithm>
#include <chrono>
#include <stdexcept>

#include "common.h"
#include "kernels.h"

namespace minisgl::cpu {
namespace {

// Groups of 4 vectors (256 bytes), claimed 1 MB at a time.
constexpr int64_t kGrain = 4096;

AVX512 double sum_avx512(const float* p, int64_t n, int64_t g0, int64_t g1) {
    double total = 0.0;
    for (int64_t i = g0 * 4; i < std::min(n, g1 * 4); i += 4) {
        __m512 a = _mm512_loadu_ps(p + i * 16);
        for (int64_t j = 1; j < 4 && i + j < n; ++j) a = _mm512_add_ps(a, _mm512_loadu_ps(p + (i + j) * 16));
        total += _mm512_reduce_add_ps(a);
    }
    return total;
}

AVX2 double sum_avx2(const float* p, int64_t n, int64_t g0, int64_t g1) {
    double total = 0.0;
    for (int64_t i = g0 * 4; i < std::min(n, g1 * 4); i += 4) {
        __m256 a = _mm256_setzero_ps();
        for (int64_t j = 0; j < 4 && i + j < n; ++j)
            a = _mm256_add_ps(a,
                              _mm256_add_ps(_mm256_loadu_ps(p + (i + j) * 16), _mm256_loadu_ps(p + (i + j) * 16 + 8)));
        total += hsum8(a);
    }
    return total;
}

// n vectors of 64 bytes.
double stream_sum(const float* p, int64_t n, int threads, bool avx2) {
    double partial[64] = {};
    run_parallel(threads, (n + 3) / 4, kGrain, [&](WorkShare& share, int slot) {
        for (int64_t g0, g1; share.claim(slot, g0, g1);)
            partial[slot] += avx2 ? sum_avx2(p, n, g0, g1) : sum_avx512(p, n, g0, g1);
    });
    double total = 0.0;
    for (double x : partial) total += x;
    return total;
}

// `rounds` rounds of four tile products (two A tiles by two B tiles). With `sets` 0 the four tiles are
// loaded from a once and stay; otherwise each round loads its four from the next of `sets`
// consecutive 4 KB sets of a, in turn, as a GEMM's inner loop loads them (the sets' total size
// decides the cache level they come from).
AMX void tile_rounds(const uint16_t* a, int64_t sets, int64_t rounds) {
    configure_full_tiles();
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    if (sets == 0) {
        _tile_loadd(4, a, 64);
        _tile_loadd(5, a + 512, 64);
        _tile_loadd(6, a + 1024, 64);
        _tile_loadd(7, a + 1536, 64);
        for (int64_t r = 0; r < rounds; ++r) {
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    } else {
        for (int64_t r = 0, set = 0; r < rounds; ++r, set = set + 1 == sets ? 0 : set + 1) {
            const uint16_t* t = a + set * 2048;
            _tile_loadd(4, t, 64);  // each load just before its first product (as linear_amx's)
            _tile_loadd(6, t + 1024, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_loadd(7, t + 1536, 64);
            _tile_dpbf16ps(1, 4, 7);
            _tile_loadd(5, t + 512, 64);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
    alignas(64) float sums[256];
    _tile_stored(0, sums, 64);  // waits for the last products
    _tile_release();
}

}  // namespace

double tile_rate(uintptr_t operands, int64_t sets, int64_t rounds, int threads) {
    if (!cpu_has_amx()) throw std::runtime_error("tile_rate: this CPU has no AMX-BF16 tile unit");
    const auto* a = reinterpret_cast<const uint16_t*>(operands);
    constexpr int64_t kPieces = 8;  // per thread: a late thread's pieces are taken by the others
    const auto start = std::chrono::steady_clock::now();
    parallel_for(threads, kPieces * threads, 1,
                 [&](int64_t p0, int64_t p1) { tile_rounds(a, sets, (p1 - p0) * (rounds / kPieces)); });
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const double flop = 2.0 * 16 * 16 * 32 * 4 * static_cast<double>(rounds / kPieces * kPieces) * threads;
    return flop / seconds;
}

double stream_read(uintptr_t buf, int64_t bytes, int threads, int isa) {
    const auto* p = reinterpret_cast<const float*>(buf);
    return stream_sum(p, bytes / 64, threads, require_isa(isa) == ISA_AVX2);
}

}  // namespace minisgl::cpu
