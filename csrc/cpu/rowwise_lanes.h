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
            if (residual) {  // the sums rounded once, by join, as stored; split gives back rms_add's values
                F ae, ao;
                V::split(V::load_pairs(residual + i, dim - i), ae, ao);
                const typename V::W sum = V::join(V::add(e, ae), V::add(o, ao));
                V::store_pairs(sr + i, sum, dim - i);
                V::split(sum, e, o);
            }
            ss = V::fmadd(o, o, V::fmadd(e, e, ss));
        }
        const F inv = V::set1(1.0f / std::sqrt(V::hsum(ss) / static_cast<float>(dim) + eps));
        for (int64_t i = 0; i < dim; i += 2 * V::N) {
            F e, o, we, wo;
            V::split(V::load_pairs(src + i, dim - i), e, o);
            V::split(V::load_pairs(weight + i, dim - i), we, wo);
            T* dst = out + i / 32 * out_step + i % 32;
            if (!gemma) {  // rms_out's rounding of x * inv by join and split, both halves at once
                V::split(V::join(V::mul(e, inv), V::mul(o, inv)), e, o);
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

// One vector of RoPE: x1*cos - x2*sin and x2*cos + x1*sin, each product and the sum rounded to the
// dtype as torch's x * cos + rotate_half(x) * sin rounds them (the sums when stored).
template <typename T>
LANES_TARGET inline void rope_lanes(typename V::F x1, typename V::F x2, typename V::F c1, typename V::F c2,
                                    typename V::F s1, typename V::F s2, typename V::F& y1, typename V::F& y2) {
    using F = typename V::F;
    const F a = V::template round<T>(V::mul(x1, c1));
    const F b = V::template round<T>(V::mul(V::sub(V::zero(), x2), s1));
    const F c = V::template round<T>(V::mul(x2, c2));
    const F d = V::template round<T>(V::mul(x1, s2));
    y1 = V::add(a, b);
    y2 = V::add(c, d);
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
            // rope_lanes' four products of both halves, each pair rounded at once (join rounds both to
            // bf16 as round<T> does, split takes them back)
            F a[2], b[2], cc[2], d[2];
            for (int h = 0; h < 2; ++h) {
                a[h] = V::mul(x1[h], c1[h]);
                b[h] = V::mul(V::sub(V::zero(), x2[h]), s1[h]);
                cc[h] = V::mul(x2[h], c2[h]);
                d[h] = V::mul(x1[h], s2[h]);
            }
            V::split(V::join(a[0], a[1]), a[0], a[1]);
            V::split(V::join(b[0], b[1]), b[0], b[1]);
            V::split(V::join(cc[0], cc[1]), cc[0], cc[1]);
            V::split(V::join(d[0], d[1]), d[0], d[1]);
            for (int h = 0; h < 2; ++h) {
                y1[h] = V::add(a[h], b[h]);
                y2[h] = V::add(cc[h], d[h]);
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
