// linear_bf16 and linear_f32: y = x @ w^T (+ bias) for a few rows on float32 FMAs, one source for
// both widths and both weight types (linear_lanes.h). linear_bf16 is the few-row linear of the
// `avx512` family (the CPU has neither AMX nor AVX512-BF16: 16 lanes) and of the `avx2` family (AVX2 +
// FMA: 8 lanes); linear_f32 serves float32 models on every family. At 1-8 rows a decode step is a
// weight stream: every weight byte is read once per step and used by M rows. oneDNN's bf16 path, and
// the BLAS's float32 matrix-vector path on some CPUs, read weights well below the memory's rate there
// (docs/performance.md); this kernel reads each weight row once for up to four input rows, over the
// weights as stored (no packing).
//
// Bit-exactness: each output is one dot product over K in a fixed order (FMAs in k order, then
// reduce4's tree), plus the bias (bf16: rounded once); its bits depend only on its input row and
// weight row, not on M, the tile the row lands in or the thread count. They differ between the two
// widths (the lanes a k-step sums into).

#include <algorithm>
#include <vector>

#include "common.h"
#include "kernels.h"

namespace minisgl::cpu {

namespace avx512 {
namespace {
using V = Lanes16;
#define LANES_TARGET AVX512
#include "linear_lanes.h"
#undef LANES_TARGET
}  // namespace
}  // namespace avx512

namespace avx2 {
namespace {
using V = Lanes8;
#define LANES_TARGET AVX2
#include "linear_lanes.h"
#undef LANES_TARGET
}  // namespace
}  // namespace avx2

namespace {

// One entry point per weight type over the two widths' bodies.
template <typename T>
void linear_fma(uintptr_t x, uintptr_t w, uintptr_t bias, uintptr_t y, int64_t M, int64_t N, int64_t K, int threads,
                int isa) {
    const auto* xp = reinterpret_cast<const T*>(x);
    const auto* wp = reinterpret_cast<const T*>(w);
    const auto* bp = reinterpret_cast<const T*>(bias);
    auto* yp = reinterpret_cast<T*>(y);
    if (require_isa(isa) != ISA_AVX2)
        avx512::linear(xp, wp, bp, yp, M, N, K, threads);
    else
        avx2::linear(xp, wp, bp, yp, M, N, K, threads);
}

}  // namespace

void linear_bf16(uintptr_t x, uintptr_t w, uintptr_t bias, uintptr_t y, int64_t M, int64_t N, int64_t K, int threads,
                 int isa) {
    linear_fma<uint16_t>(x, w, bias, y, M, N, K, threads, isa);
}

void linear_f32(uintptr_t x, uintptr_t w, uintptr_t bias, uintptr_t y, int64_t M, int64_t N, int64_t K, int threads,
                int isa) {
    linear_fma<float>(x, w, bias, y, M, N, K, threads, isa);
}

}  // namespace minisgl::cpu
