// stream_read: the machine's streaming read rate, what a weight stream can reach here. `bytes` of a
// buffer are read once, split in contiguous slices over the threads, each summed 64 bytes at a time
// with the family's ISA (AVX-512 or AVX2; the sum is returned so the loads cannot be dropped).
// minisgl bench divides a decode step's weight bytes by its time against this figure. A probe, not a
// kernel: its sum's bits are not a contract.

#include "common.h"
#include "kernels.h"

namespace minisgl::cpu {
namespace {

AVX512 double stream_read_avx512(const float* p, int64_t n, int threads) {
    double total = 0.0;
#pragma omp parallel for num_threads(threads) schedule(static) reduction(+ : total)
    for (int64_t i = 0; i < n; i += 4) {
        __m512 a = _mm512_loadu_ps(p + i * 16);
        for (int64_t j = 1; j < 4 && i + j < n; ++j) a = _mm512_add_ps(a, _mm512_loadu_ps(p + (i + j) * 16));
        total += _mm512_reduce_add_ps(a);
    }
    return total;
}

AVX2 double stream_read_avx2(const float* p, int64_t n, int threads) {
    double total = 0.0;
#pragma omp parallel for num_threads(threads) schedule(static) reduction(+ : total)
    for (int64_t i = 0; i < n; i += 4) {
        __m256 a = _mm256_setzero_ps();
        for (int64_t j = 0; j < 4 && i + j < n; ++j)
            a = _mm256_add_ps(a, _mm256_add_ps(_mm256_loadu_ps(p + (i + j) * 16), _mm256_loadu_ps(p + (i + j) * 16 + 8)));
        total += hsum8(a);
    }
    return total;
}

}  // namespace

double stream_read(uintptr_t buf, int64_t bytes, int threads, int isa) {
    const auto* p = reinterpret_cast<const float*>(buf);
    if (require_isa(isa) == ISA_AVX2) return stream_read_avx2(p, bytes / 64, threads);
    return stream_read_avx512(p, bytes / 64, threads);
}

}  // namespace minisgl::cpu
