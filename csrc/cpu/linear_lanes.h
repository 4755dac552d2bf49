// The few-row bf16 linear's loops (linear_fma.cpp), written once over the lane width: linear_fma.cpp
// includes this file twice, in namespace avx512 (V = Lanes16, LANES_TARGET = AVX512: 32 weights per
// k-step, tiles of 4 weight rows) and in namespace avx2 (V = Lanes8, LANES_TARGET = AVX2: 16 weights
// per k-step, tiles of 2 weight rows, whose 4 x 2 accumulators fit AVX2's 16 registers beside the
// weights). No include guard, on purpose.

// Weight rows per tile: 4 x MM accumulators live in AVX-512's 32 registers; AVX2 has 16.
constexpr int TILE_ROWS = V::N == 16 ? 4 : 2;
constexpr int64_t KSTEP = 2 * V::N;  // bf16 weights per k-step: N (even, odd) pairs

// Each 64 bytes of a tile's rows request the same line of TILE_ROWS rows PREFETCH_AHEAD rows further
// on (past the matrix a prefetch never faults), into L1 (AVX-512: the next tile, as common.h
// prefetch_next_tile) or into L2 (AVX2: 8 rows ahead; the next tile into L1 comes too late to hide a
// weight stream from memory at one row and one thread, a distance the L2 prefetch covers).
constexpr int PREFETCH_AHEAD = V::N == 16 ? 4 : 8;
constexpr auto PREFETCH_HINT = V::N == 16 ? _MM_HINT_T0 : _MM_HINT_T1;

// One k-step of 2N weights: a load holds N (even, odd) bf16 pairs. `w << 16` is the even elements as
// float32 and `w & 0xffff0000` the odd ones (bf16 is the top half of a float32), so the pair becomes
// two FMAs against the input row split the same way: two float32 FMAs take less time than one
// vdpbf16ps on the CPUs this loop was tuned on, so the pair is split rather than fed to vdpbf16ps.
//
// MM input rows x TILE_ROWS weight rows: their float32 accumulators; each weight vector is loaded and
// split once per k-step and used by every input row. xe/xo: the input rows' even/odd elements as
// float32, zero-padded to a whole k-step (row stride xs), so a short weight tail meets zeros.
template <int MM>
LANES_TARGET inline void tile_bf16(const float* xe, const float* xo, int64_t xs, const uint16_t* w,
                                   const uint16_t* bias, uint16_t* y, int64_t K, int64_t N) {
    using F = typename V::F;
    F acc[MM][TILE_ROWS];
#pragma GCC unroll 4
    for (int i = 0; i < MM; ++i)
#pragma GCC unroll 4
        for (int j = 0; j < TILE_ROWS; ++j) acc[i][j] = V::zero();
    for (int64_t k = 0; k < K; k += KSTEP) {
        F we[TILE_ROWS], wo[TILE_ROWS];
        if (k % 32 == 0)
            for (int j = PREFETCH_AHEAD; j < PREFETCH_AHEAD + TILE_ROWS; ++j)
                _mm_prefetch(reinterpret_cast<const char*>(w + j * K + k), PREFETCH_HINT);
#pragma GCC unroll 4
        for (int j = 0; j < TILE_ROWS; ++j) V::split(V::load_pairs(w + j * K + k, K - k), we[j], wo[j]);
#pragma GCC unroll 4
        for (int i = 0; i < MM; ++i) {
            const F e = V::loadu(xe + i * xs + k / 2), o = V::loadu(xo + i * xs + k / 2);
#pragma GCC unroll 4
            for (int j = 0; j < TILE_ROWS; ++j) acc[i][j] = V::fmadd(o, wo[j], V::fmadd(e, we[j], acc[i][j]));
        }
    }
    // V::reduce4's sum of a vector depends on that vector's lanes alone, so a zero stands in for a
    // missing fourth (or third) weight row
#pragma GCC unroll 4
    for (int i = 0; i < MM; ++i) {
        alignas(16) float s[4];
        const F z = V::zero();
        _mm_store_ps(s, V::reduce4(acc[i][0], acc[i][1], TILE_ROWS > 2 ? acc[i][2 % TILE_ROWS] : z,
                                   TILE_ROWS > 3 ? acc[i][3 % TILE_ROWS] : z));
        for (int j = 0; j < TILE_ROWS; ++j) y[i * N + j] = f32_to_bf16(bias ? s[j] + bf16_to_f32(bias[j]) : s[j]);
    }
}

// The last N % TILE_ROWS outputs of one input row: the tile's arithmetic for one weight row, so the
// bits match a full tile's.
LANES_TARGET void tail_bf16(const float* xe, const float* xo, const uint16_t* w, const uint16_t* bias, uint16_t* y,
                            int64_t K) {
    using F = typename V::F;
    F acc = V::zero();
    const F z = V::zero();
    for (int64_t k = 0; k < K; k += KSTEP) {
        F we, wo;
        V::split(V::load_pairs(w + k, K - k), we, wo);
        acc = V::fmadd(V::loadu(xo + k / 2), wo, V::fmadd(V::loadu(xe + k / 2), we, acc));
    }
    alignas(16) float s[4];
    _mm_store_ps(s, V::reduce4(acc, z, z, z));
    *y = f32_to_bf16(bias ? s[0] + bf16_to_f32(*bias) : s[0]);
}

// Weight-row tile b (rows b * TILE_ROWS ...) against every input row, 4 input rows at a time.
LANES_TARGET void tiles_bf16(const float* xe, const float* xo, int64_t xs, const uint16_t* w, const uint16_t* bias,
                             uint16_t* y, int64_t M, int64_t N, int64_t K, int64_t b) {
    const int64_t n0 = b * TILE_ROWS;
    const uint16_t* wb = w + n0 * K;
    const uint16_t* bb = bias ? bias + n0 : nullptr;
    int64_t m0 = 0;
    for (; m0 + 4 <= M; m0 += 4) tile_bf16<4>(xe + m0 * xs, xo + m0 * xs, xs, wb, bb, y + m0 * N + n0, K, N);
    switch (M - m0) {
        case 3:
            tile_bf16<3>(xe + m0 * xs, xo + m0 * xs, xs, wb, bb, y + m0 * N + n0, K, N);
            break;
        case 2:
            tile_bf16<2>(xe + m0 * xs, xo + m0 * xs, xs, wb, bb, y + m0 * N + n0, K, N);
            break;
        case 1:
            tile_bf16<1>(xe + m0 * xs, xo + m0 * xs, xs, wb, bb, y + m0 * N + n0, K, N);
            break;
        default:
            break;
    }
}

// y = x @ w^T (+ bias) for M <= 4 rows: the input rows split once into even / odd float32 halves
// (zero-padded to whole k-steps), then the weight tiles over the threads.
inline void linear(const uint16_t* xp, const uint16_t* wp, const uint16_t* bp, uint16_t* yp, int64_t M, int64_t N,
                   int64_t K, int threads) {
    const int64_t xs = (K + KSTEP - 1) / KSTEP * V::N;  // float32 per half row, padded to whole k-steps
    std::vector<float> split(static_cast<size_t>(2 * M * xs), 0.0f);
    float* xe = split.data();
    float* xo = xe + M * xs;
    for (int64_t m = 0; m < M; ++m)
        for (int64_t k = 0; k < K; ++k) (k % 2 ? xo : xe)[m * xs + k / 2] = bf16_to_f32(xp[m * K + k]);
    const int64_t blocks = N / TILE_ROWS, tail = N % TILE_ROWS;
    // Each thread starts on one contiguous slice of the weight matrix (pool.h); the split input rows
    // stay in L1, and a weight tile stays there while every input row uses it. The tail's single
    // outputs come last.
    parallel_for(threads, blocks + M * tail, 0, [&](int64_t i0, int64_t i1) {
        for (int64_t i = i0; i < i1; ++i) {
            if (i < blocks) {
                tiles_bf16(xe, xo, xs, wp, bp, yp, M, N, K, i);
                continue;
            }
            const int64_t t = i - blocks, m = t / tail, n = blocks * TILE_ROWS + t % tail;
            tail_bf16(xe + m * xs, xo + m * xs, wp + n * K, bp ? bp + n : nullptr, yp + m * N + n, K);
        }
    });
}
