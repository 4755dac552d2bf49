// stream_read: the machine's streaming read rate, what a weight stream can reach here. `bytes` of a
// buffer are read once, split in contiguous slices over the threads, each summed 64 bytes at a time
// with the family's ISA (AVX-512 or AVX2; the sum is returned so the loads cannot be dropped).
// minisgl bench divides a decode step's weight bytes by its time against this figure. A probe, not a
// kernel: its sum's bits are not a contract.

#include <algorithm>

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

}  // namespace

double stream_read(uintptr_t buf, int64_t bytes, int threads, int isa) {
    const auto* p = reinterpret_cast<const float*>(buf);
    return stream_sum(p, bytes / 64, threads, require_isa(isa) == ISA_AVX2);
}

}  // namespace minisgl::cpu
