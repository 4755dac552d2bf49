// The row-wise kernels' vector loops (rowwise.cpp), written once over the lane width: rowwise.cpp
// includes this file twice, in namespace avx512 (V = Lanes16, LANES_TARGET = AVX512) and in namespace
// avx2 (V = Lanes8, LANES_TARGET = AVX2), so each family gets its own compiled copy (common.h,
// "one name per operation for both widths"). No include guard, on purpose.
//
// Roundings follow the torch expressions the kernels replace step by step (rowwise.cpp's header):
// RoPE and SiLU keep each element's operations, so their bits are the same at either width; RMSNorm's
// sum of squares is summed by lanes, then by V::hsum's tree, so its bits depend on the width (a
// family's own, fixed order), never on the other rows.

// RMSNorm of one row, with the residual add: x + residual, rounded to the model dtype as torch's add
// does, is the row normalised and (sr) the new residual stream.
template <typename T>
LANES_TARGET void rms_norm_row(T* xr, const T* residual, T* sr, const T* weight, T* out, int64_t dim, float eps,
                               bool gemma) {
    using F = typename V::F;
    F ss = V::zero();
    for (int64_t i = 0; i < dim; i += V::N) {
        F v = V::loadn(xr + i, dim - i);
        if (residual) {
            v = V::template round<T>(V::add(v, V::loadn(residual + i, dim - i)));
            V::storen(sr + i, v, dim - i);
        }
        ss = V::fmadd(v, v, ss);
    }
    const F inv = V::set1(1.0f / std::sqrt(V::hsum(ss) / static_cast<float>(dim) + eps));
    const T* src = residual ? sr : xr;
    for (int64_t i = 0; i < dim; i += V::N) {
        const F n = V::mul(V::loadn(src + i, dim - i), inv), w = V::loadn(weight + i, dim - i);
        // gemma: (x * rsqrt) * (1 + w) in float32, rounded once; else rounded to the dtype, then w * it
        V::storen(out + i, gemma ? V::mul(n, V::add(V::set1(1.0f), w)) : V::mul(w, V::template round<T>(n)), dim - i);
    }
}

// The first 2 * half features of one head rotated in place by cos/sin: x1*cos - x2*sin and
// x2*cos + x1*sin, each product and the sum rounded to the dtype as torch's
// x * cos + rotate_half(x) * sin rounds them.
template <typename T>
LANES_TARGET void rope_head(T* xh, const T* c, const T* s, int64_t half) {
    using F = typename V::F;
    for (int64_t i = 0; i < half; i += V::N) {
        const int64_t n = half - i;
        const F x1 = V::loadn(xh + i, n), x2 = V::loadn(xh + i + half, n);
        const F a = V::template round<T>(V::mul(x1, V::loadn(c + i, n)));
        const F b = V::template round<T>(V::mul(V::sub(V::zero(), x2), V::loadn(s + i, n)));
        const F c2 = V::template round<T>(V::mul(x2, V::loadn(c + i + half, n)));
        const F d = V::template round<T>(V::mul(x1, V::loadn(s + i + half, n)));
        V::storen(xh + i, V::add(a, b), n);
        V::storen(xh + i + half, V::add(c2, d), n);
    }
}

// out[i] = silu(g[i]) * u[i]: torch's F.silu(gate) * up, its silu rounded to the dtype before the product.
template <typename T>
LANES_TARGET void silu_and_mul_row(const T* g, const T* u, T* out, int64_t dim) {
    using F = typename V::F;
    const F one = V::set1(1.0f);
    for (int64_t i = 0; i < dim; i += V::N) {
        const F x = V::loadn(g + i, dim - i);
        const F act = V::template round<T>(V::div(x, V::add(one, V::exp(V::sub(V::zero(), x)))));
        V::storen(out + i, V::mul(act, V::loadn(u + i, dim - i)), dim - i);
    }
}
