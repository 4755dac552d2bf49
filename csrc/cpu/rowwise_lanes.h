// The row-wise kernels' vector loops (rowwise.cpp), written once over the lane width: rowwise.cpp
// includes this file twice, in namespace avx512 (V = Lanes16, LANES_TARGET = AVX512) and in namespace
// avx2 (V = Lanes8, LANES_TARGET = AVX2), so each family gets its own compiled copy (common.h,
// "one name per operation for both widths"). No include guard, on purpose.
//
// Roundings follow the torch expressions the kernels replace step by step (rowwise.cpp's header):
// RoPE keeps each element's operations, so its bits are the same at either width; SiLU's exp is each
// width's own (common.h exp16, exp8) and RMSNorm's sum of squares is summed by lanes, then by
// V::hsum's tree, so their bits depend on the width (a family's own, fixed order), never on the
// other rows.

// RMSNorm's steps on one vector (n elements from p): the residual add (rounded to the dtype as
// torch's add, stored as the new residual stream), and the normalised output (gemma: (x * rsqrt) *
// (1 + w) in float32, rounded once; else rounded to the dtype, then w * it).
template <typename T>
LANES_TARGET inline typename V::F rms_add(typename V::F x, typename V::F add) {
    return V::template round<T>(V::add(x, add));
}
template <typename T>
LANES_TARGET inline typename V::F rms_out(typename V::F x, typename V::F inv, typename V::F w, bool gemma) {
    const typename V::F n = V::mul(x, inv);
    return gemma ? V::mul(n, V::add(V::set1(1.0f), w)) : V::mul(w, V::template round<T>(n));
}

// Two bf16 vectors rounded at once, each as round<uint16_t> would (join rounds both; split takes the
// rounded values back). Returns the joined pairs, ready to store.
LANES_TARGET inline typename V::W round_pair(typename V::F& even, typename V::F& odd) {
    const typename V::W both = V::join(even, odd);
    V::split(both, even, odd);
    return both;
}

// RMSNorm of one row, with the residual add: x + residual is the row normalised and (sr) the new
// residual stream. The sum of squares runs by lanes, then V::hsum's tree; bf16 rows go 2N elements
// per step as even/odd halves (each lane then takes an element pair per step): a load widens and a
// store narrows with one shift or mask per vector, and each pair of vectors is rounded by one join
// (both at once where the ISA has vcvtne2ps2bf16) instead of two roundings.
// out_step: elements from one 32-element group of the output row to the next (32: the row as it
// lies; 512: pack_rows' tile layout, linear_amx.cpp, for a bf16 row with dim a multiple of 32).
template <typename T>
LANES_TARGET void rms_norm_row(T* xr, const T* residual, T* sr, const T* weight, T* out, int64_t dim, float eps,
                               bool gemma, int64_t out_step = 32) {
    using F = typename V::F;
    F ss = V::zero();
    const T* src = residual ? sr : xr;
    if constexpr (std::is_same_v<T, uint16_t>) {
        for (int64_t i = 0; i < dim; i += 2 * V::N) {
            F e, o;
            V::split(V::load_pairs(xr + i, dim - i), e, o);
            if (residual) {  // the sums rounded once, as stored: rms_add's values
                F ae, ao;
                V::split(V::load_pairs(residual + i, dim - i), ae, ao);
                e = V::add(e, ae);
                o = V::add(o, ao);
                V::store_pairs(sr + i, round_pair(e, o), dim - i);
            }
            ss = V::fmadd(o, o, V::fmadd(e, e, ss));
        }
        const F inv = V::set1(1.0f / std::sqrt(V::hsum(ss) / static_cast<float>(dim) + eps));
        for (int64_t i = 0; i < dim; i += 2 * V::N) {
            F e, o, we, wo;
            V::split(V::load_pairs(src + i, dim - i), e, o);
            V::split(V::load_pairs(weight + i, dim - i), we, wo);
            T* dst = out + i / 32 * out_step + i % 32;
            if (!gemma) {  // rms_out's rounding of x * inv, both halves at once
                e = V::mul(e, inv);
                o = V::mul(o, inv);
                round_pair(e, o);
                V::store_pairs(dst, V::join(V::mul(we, e), V::mul(wo, o)), dim - i);
                continue;
            }
            V::store_pairs(dst, V::join(rms_out<T>(e, inv, we, gemma), rms_out<T>(o, inv, wo, gemma)), dim - i);
        }
    } else {
        for (int64_t i = 0; i < dim; i += V::N) {
            F v = V::loadn(xr + i, dim - i);
            if (residual) {
                v = rms_add<T>(v, V::loadn(residual + i, dim - i));
                V::storen(sr + i, v, dim - i);
            }
            ss = V::fmadd(v, v, ss);
        }
        const F inv = V::set1(1.0f / std::sqrt(V::hsum(ss) / static_cast<float>(dim) + eps));
        for (int64_t i = 0; i < dim; i += V::N)
            V::storen(out + i, rms_out<T>(V::loadn(src + i, dim - i), inv, V::loadn(weight + i, dim - i), gemma),
                      dim - i);
    }
}

// RoPE's four products on one vector, unrounded: p = {x1*cos, -x2*sin, x2*cos, x1*sin}; y1 = p0 + p1
// and y2 = p2 + p3, each product and each sum rounded to the dtype as torch's x * cos +
// rotate_half(x) * sin rounds them (the sums when stored).
LANES_TARGET inline void rope_products(typename V::F x1, typename V::F x2, typename V::F c1, typename V::F c2,
                                       typename V::F s1, typename V::F s2, typename V::F (&p)[4]) {
    p[0] = V::mul(x1, c1);
    p[1] = V::mul(V::sub(V::zero(), x2), s1);
    p[2] = V::mul(x2, c2);
    p[3] = V::mul(x1, s2);
}

// One vector of RoPE (rope_products, each product rounded alone).
template <typename T>
LANES_TARGET inline void rope_lanes(typename V::F x1, typename V::F x2, typename V::F c1, typename V::F c2,
                                    typename V::F s1, typename V::F s2, typename V::F& y1, typename V::F& y2) {
    typename V::F p[4];
    rope_products(x1, x2, c1, c2, s1, s2, p);
    for (auto& v : p) v = V::template round<T>(v);
    y1 = V::add(p[0], p[1]);
    y2 = V::add(p[2], p[3]);
}

// One vector of silu(g) * u: torch's F.silu(gate) * up, its silu rounded to the dtype before the product.
template <typename T>
LANES_TARGET inline typename V::F silu_lanes(typename V::F g, typename V::F u) {
    return V::mul(V::template round<T>(V::div(g, V::add(V::set1(1.0f), V::exp(V::sub(V::zero(), g))))), u);
}

// RoPE and SiLU x up are elementwise, so bf16 rows go 2N elements per step as the even and odd halves
// of one load (V::split, as the linear's weights): the same bits as N ordered elements at a time, with
// one shift or mask per vector where the ordered load widens and the store narrows (AVX2 has no
// 32 -> 16-bit narrowing within a register, which makes the ordered store the costly part there).

// The first 2 * half features of one head rotated in place by cos/sin.
template <typename T>
LANES_TARGET void rope_head(T* xh, const T* c, const T* s, int64_t half) {
    using F = typename V::F;
    if constexpr (std::is_same_v<T, uint16_t>) {
        for (int64_t i = 0; i < half; i += 2 * V::N) {
            const int64_t n = half - i;
            F x1[2], x2[2], c1[2], c2[2], s1[2], s2[2], y1[2], y2[2];
            V::split(V::load_pairs(xh + i, n), x1[0], x1[1]);
            V::split(V::load_pairs(xh + i + half, n), x2[0], x2[1]);
            V::split(V::load_pairs(c + i, n), c1[0], c1[1]);
            V::split(V::load_pairs(c + i + half, n), c2[0], c2[1]);
            V::split(V::load_pairs(s + i, n), s1[0], s1[1]);
            V::split(V::load_pairs(s + i + half, n), s2[0], s2[1]);
            // rope_products of both halves, each product rounded with its twin of the other half
            F p[2][4];
            for (int h = 0; h < 2; ++h) rope_products(x1[h], x2[h], c1[h], c2[h], s1[h], s2[h], p[h]);
            for (int j = 0; j < 4; ++j) round_pair(p[0][j], p[1][j]);
            for (int h = 0; h < 2; ++h) {
                y1[h] = V::add(p[h][0], p[h][1]);
                y2[h] = V::add(p[h][2], p[h][3]);
            }
            V::store_pairs(xh + i, V::join(y1[0], y1[1]), n);
            V::store_pairs(xh + i + half, V::join(y2[0], y2[1]), n);
        }
    } else {
        for (int64_t i = 0; i < half; i += V::N) {
            const int64_t n = half - i;
            F y1, y2;
            rope_lanes<T>(V::loadn(xh + i, n), V::loadn(xh + i + half, n), V::loadn(c + i, n),
                          V::loadn(c + i + half, n), V::loadn(s + i, n), V::loadn(s + i + half, n), y1, y2);
            V::storen(xh + i, y1, n);
            V::storen(xh + i + half, y2, n);
        }
    }
}

// out[i] = silu(g[i]) * u[i].
template <typename T>
LANES_TARGET void silu_and_mul_row(const T* g, const T* u, T* out, int64_t dim) {
    using F = typename V::F;
    if constexpr (std::is_same_v<T, uint16_t>) {
        for (int64_t i = 0; i < dim; i += 2 * V::N) {
            F ge, go, ue, uo;
            V::split(V::load_pairs(g + i, dim - i), ge, go);
            V::split(V::load_pairs(u + i, dim - i), ue, uo);
            V::store_pairs(out + i, V::join(silu_lanes<T>(ge, ue), silu_lanes<T>(go, uo)), dim - i);
        }
    } else {
        for (int64_t i = 0; i < dim; i += V::N)
            V::storen(out + i, silu_lanes<T>(V::loadn(g + i, dim - i), V::loadn(u + i, dim - i)), dim - i);
    }
}
