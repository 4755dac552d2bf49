// Row-wise ops: RMSNorm (with the residual add fused), RoPE in place, SiLU x up. One pass per row
// instead of 2-8 torch ops, each of which costs more in dispatch than in arithmetic at decode sizes;
// 16 elements at a time on AVX-512, scalar loops for CPUs without it.
//
// Bit-exactness: each row is computed alone in a fixed order, so its bits never depend on the other
// rows: these are shared by the default and the batch-invariant forward. Roundings follow the torch
// expressions they replace (model/layers.py RMSNorm / GemmaRMSNorm, model/rope.py apply_rotary,
// F.silu(gate) * up) step by step. The AVX-512 loops keep those roundings (RoPE and SiLU keep each
// element's operations; RMSNorm's sum of squares is summed by lanes, then by hsum16's tree: a fixed
// order, not the scalar one).

#include <cmath>

#include "common.h"
#include "kernels.h"

namespace minisgl::cpu {
namespace {

template <typename T>
void rms_norm_row(T* xr, const T* residual, T* sr, const T* weight, T* out, int64_t dim, float eps, bool gemma) {
    // x + residual, rounded to the model dtype as torch's add does, is the row normalised and
    // (sum_out) the new residual stream.
    float ss = 0.0f;
    for (int64_t i = 0; i < dim; ++i) {
        float v = load(xr, i);
        if (residual) {
            v += load(residual, i);
            store(sr, i, v);
            v = load(sr, i);
        }
        ss += v * v;
    }
    const float inv = 1.0f / std::sqrt(ss / static_cast<float>(dim) + eps);
    const T* src = residual ? sr : xr;
    for (int64_t i = 0; i < dim; ++i) {
        const float n = load(src, i) * inv;
        if (gemma) {  // (x * rsqrt) * (1 + w) in float32, rounded once
            store(out, i, n * (1.0f + load(weight, i)));
        } else {  // rounded to the dtype, then weight * it in the dtype
            T nd;
            store(&nd, 0, n);
            store(out, i, load(weight, i) * load(&nd, 0));
        }
    }
}

template <typename T>
AVX512 void rms_norm_row16(T* xr, const T* residual, T* sr, const T* weight, T* out, int64_t dim, float eps,
                           bool gemma) {
    __m512 ss = _mm512_setzero_ps();
    for (int64_t i = 0; i < dim; i += 16) {
        const __mmask16 m = first_lanes(dim - i);
        __m512 v = load16m(xr + i, m);
        if (residual) {
            v = round16<T>(_mm512_add_ps(v, load16m(residual + i, m)));
            store16m(sr + i, v, m);
        }
        ss = _mm512_fmadd_ps(v, v, ss);
    }
    const __m512 inv = _mm512_set1_ps(1.0f / std::sqrt(hsum16(ss) / static_cast<float>(dim) + eps));
    const T* src = residual ? sr : xr;
    for (int64_t i = 0; i < dim; i += 16) {
        const __mmask16 m = first_lanes(dim - i);
        const __m512 n = _mm512_mul_ps(load16m(src + i, m), inv), w = load16m(weight + i, m);
        store16m(out + i, gemma ? _mm512_mul_ps(n, _mm512_add_ps(_mm512_set1_ps(1.0f), w)) : _mm512_mul_ps(w, round16<T>(n)), m);
    }
}

// In place on x [rows, heads, head_dim] (row stride sr, head stride sh, unit feature stride): the
// first `rot` features of every head rotated by cos/sin [rows, rot] (contiguous), the rest unchanged.
// x1*cos - x2*sin and x2*cos + x1*sin, each product and the sum rounded to the dtype as torch's
// x * cos + rotate_half(x) * sin rounds them.
template <typename T>
void rope_head(T* xh, const T* c, const T* s, int64_t half) {
    for (int64_t i = 0; i < half; ++i) {
        const float x1 = load(xh, i), x2 = load(xh, i + half);
        T a, b, c2, d;
        store(&a, 0, x1 * load(c, i));
        store(&b, 0, -x2 * load(s, i));
        store(&c2, 0, x2 * load(c, i + half));
        store(&d, 0, x1 * load(s, i + half));
        store(xh, i, load(&a, 0) + load(&b, 0));
        store(xh, i + half, load(&c2, 0) + load(&d, 0));
    }
}

template <typename T>
AVX512 void rope_head16(T* xh, const T* c, const T* s, int64_t half) {
    for (int64_t i = 0; i < half; i += 16) {
        const __mmask16 m = first_lanes(half - i);
        const __m512 x1 = load16m(xh + i, m), x2 = load16m(xh + i + half, m);
        const __m512 a = round16<T>(_mm512_mul_ps(x1, load16m(c + i, m)));
        const __m512 b = round16<T>(_mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), x2), load16m(s + i, m)));
        const __m512 c2 = round16<T>(_mm512_mul_ps(x2, load16m(c + i + half, m)));
        const __m512 d = round16<T>(_mm512_mul_ps(x1, load16m(s + i + half, m)));
        store16m(xh + i, _mm512_add_ps(a, b), m);
        store16m(xh + i + half, _mm512_add_ps(c2, d), m);
    }
}

// out[r, i] = silu(gate[r, i]) * up[r, i] with gate_up = [gate | up] per row: torch's
// F.silu(gate) * up, its silu rounded to the dtype before the product.
template <typename T>
void silu_and_mul_row(const T* g, const T* u, T* out, int64_t dim) {
    for (int64_t i = 0; i < dim; ++i) {
        const float x = load(g, i);
        T act;
        store(&act, 0, x / (1.0f + std::exp(-x)));
        store(out, i, load(&act, 0) * load(u, i));
    }
}

template <typename T>
AVX512 void silu_and_mul_row16(const T* g, const T* u, T* out, int64_t dim) {
    const __m512 one = _mm512_set1_ps(1.0f);
    for (int64_t i = 0; i < dim; i += 16) {
        const __mmask16 m = first_lanes(dim - i);
        const __m512 x = load16m(g + i, m);
        const __m512 act = round16<T>(_mm512_div_ps(x, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), x)))));
        store16m(out + i, _mm512_mul_ps(act, load16m(u + i, m)), m);
    }
}

}  // namespace

template <typename T>
void rms_norm_t(T* x, const T* residual, T* sum_out, const T* weight, T* out, int64_t rows, int64_t dim,
                float eps, bool gemma, int threads) {
    static const bool avx512 = cpu_has_avx512();
#pragma omp parallel for num_threads(threads) schedule(static) if (rows >= 32)
    for (int64_t r = 0; r < rows; ++r) {
        T* sr = sum_out ? sum_out + r * dim : nullptr;
        const T* res = residual ? residual + r * dim : nullptr;
        if (avx512)
            rms_norm_row16(x + r * dim, res, sr, weight, out + r * dim, dim, eps, gemma);
        else
            rms_norm_row(x + r * dim, res, sr, weight, out + r * dim, dim, eps, gemma);
    }
}
// The decode stack's (bf16).
template void rms_norm_t(uint16_t*, const uint16_t*, uint16_t*, const uint16_t*, uint16_t*, int64_t, int64_t, float,
                         bool, int);


void rms_norm(uintptr_t x, uintptr_t residual, uintptr_t sum_out, uintptr_t weight, uintptr_t out, int64_t rows,
              int64_t dim, double eps, bool gemma, bool bf16, int threads) {
    if (bf16)
        rms_norm_t(reinterpret_cast<uint16_t*>(x), reinterpret_cast<const uint16_t*>(residual),
                   reinterpret_cast<uint16_t*>(sum_out), reinterpret_cast<const uint16_t*>(weight),
                   reinterpret_cast<uint16_t*>(out), rows, dim, static_cast<float>(eps), gemma, threads);
    else
        rms_norm_t(reinterpret_cast<float*>(x), reinterpret_cast<const float*>(residual),
                   reinterpret_cast<float*>(sum_out), reinterpret_cast<const float*>(weight),
                   reinterpret_cast<float*>(out), rows, dim, static_cast<float>(eps), gemma, threads);
}

template <typename T>
void rope_t(T* x, const T* cos, const T* sin, int64_t rows, int64_t heads, int64_t rot, int64_t sr, int64_t sh,
            int threads) {
    static const bool avx512 = cpu_has_avx512();
#pragma omp parallel for num_threads(threads) schedule(static) if (rows >= 32)
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t h = 0; h < heads; ++h) {
            if (avx512)
                rope_head16(x + r * sr + h * sh, cos + r * rot, sin + r * rot, rot / 2);
            else
                rope_head(x + r * sr + h * sh, cos + r * rot, sin + r * rot, rot / 2);
        }
}
template void rope_t(uint16_t*, const uint16_t*, const uint16_t*, int64_t, int64_t, int64_t, int64_t, int64_t, int);


void rope(uintptr_t x, uintptr_t cos, uintptr_t sin, int64_t rows, int64_t heads, int64_t rot, int64_t sr,
          int64_t sh, bool bf16, int threads) {
    if (bf16)
        rope_t(reinterpret_cast<uint16_t*>(x), reinterpret_cast<const uint16_t*>(cos),
               reinterpret_cast<const uint16_t*>(sin), rows, heads, rot, sr, sh, threads);
    else
        rope_t(reinterpret_cast<float*>(x), reinterpret_cast<const float*>(cos), reinterpret_cast<const float*>(sin),
               rows, heads, rot, sr, sh, threads);
}

template <typename T>
void silu_and_mul_t(const T* gate_up, T* out, int64_t rows, int64_t dim, int threads) {
    static const bool avx512 = cpu_has_avx512();
#pragma omp parallel for num_threads(threads) schedule(static) if (rows >= 32)
    for (int64_t r = 0; r < rows; ++r) {
        const T* g = gate_up + r * 2 * dim;
        if (avx512)
            silu_and_mul_row16(g, g + dim, out + r * dim, dim);
        else
            silu_and_mul_row(g, g + dim, out + r * dim, dim);
    }
}
template void silu_and_mul_t(const uint16_t*, uint16_t*, int64_t, int64_t, int);


void silu_and_mul(uintptr_t gate_up, uintptr_t out, int64_t rows, int64_t dim, bool bf16, int threads) {
    if (bf16)
        silu_and_mul_t(reinterpret_cast<const uint16_t*>(gate_up), reinterpret_cast<uint16_t*>(out), rows, dim,
                       threads);
    else
        silu_and_mul_t(reinterpret_cast<const float*>(gate_up), reinterpret_cast<float*>(out), rows, dim, threads);
}

}  // namespace minisgl::cpu
