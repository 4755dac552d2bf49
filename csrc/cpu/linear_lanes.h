// The few-row linear's loops (linear_fma.cpp), written once over the lane width and the weights'
// element type: linear_fma.cpp includes this file twice, in namespace avx512 (V = Lanes16,
// LANES_TARGET = AVX512: 32 weights per k-step, tiles of 4 weight rows) and in namespace avx2 (V =
// Lanes8, LANES_TARGET = AVX2: 16 weights per k-step, tiles of 2 weight rows, whose 4 x 2
// accumulators fit AVX2's 16 registers beside the weights), and instantiates each for bf16 (uint16_t)
// and float32 weights. No include guard, on purpose.

// Weight rows per tile: 4 x MM accumulators live in AVX-512's 32 registers; AVX2 has 16.
constexpr int TILE_ROWS = V::N == 16 ? 4 : 2;
constexpr int64_t KSTEP = 2 * V::N;  // weights per k-step: two float32 vectors' worth

// How one k-step of weights of type T becomes two float32 vectors (a, b), and where a row's input
// element k goes to meet its weight: into half 0 (the `a` lanes) or half 1 (`b`) of the row's split
// copy, at index `at`. Every weight is multiplied by its own input element; only the lane it is
// summed in differs between the types.
template <typename T>
struct Step;

// bf16: a load holds N (even, odd) pairs. `w << 16` is the even elements as float32 and
// `w & 0xffff0000` the odd ones (bf16 is the top half of a float32), so the pair becomes two FMAs
// against the input row split the same way: two float32 FMAs take less time than one vdpbf16ps on
// the CPUs this loop was tuned on, so the pair is split rather than fed to vdpbf16ps.
template <>
struct Step<uint16_t> {
    LANES_TARGET static void load(const uint16_t* w, int64_t n, typename V::F& a, typename V::F& b) {
        V::split(V::load_pairs(w, n), a, b);
    }
    static int half(int64_t k) { return static_cast<int>(k % 2); }
    static int64_t at(int64_t k) { return k / 2; }
    static float widen(uint16_t v) { return bf16_to_f32(v); }
    static uint16_t narrow(float v) { return f32_to_bf16(v); }
};

// float32: the k-step's first N weights, then its next N (zeros past the row's end).
template <>
struct Step<float> {
    LANES_TARGET static void load(const float* w, int64_t n, typename V::F& a, typename V::F& b) {
        a = n >= V::N ? V::loadu(w) : V::template loadn<float>(w, n);
        b = n >= KSTEP ? V::loadu(w + V::N) : V::template loadn<float>(w + V::N, n > V::N ? n - V::N : 0);
    }
    static int half(int64_t k) { return static_cast<int>(k % KSTEP >= V::N); }
    static int64_t at(int64_t k) { return k / KSTEP * V::N + k % V::N; }
    static float widen(float v) { return v; }
    static float narrow(float v) { return v; }
};

// MM input rows x TILE_ROWS weight rows: their float32 accumulators; each weight vector is loaded and
// split once per k-step and used by every input row. xa/xb: the input rows' two halves as Step lays
// them out, zero-padded to a whole k-step (row stride xs), so a short weight tail meets zeros.
template <int MM, typename T>
LANES_TARGET inline void tile(const float* xa, const float* xb, int64_t xs, const T* w, const T* bias, T* y, int64_t K,
                              int64_t N) {
    using F = typename V::F;
    constexpr int64_t LINE = 64 / sizeof(T);  // weights per cache line
    F acc[MM][TILE_ROWS];
#pragma GCC unroll 4
    for (int i = 0; i < MM; ++i)
#pragma GCC unroll 4
        for (int j = 0; j < TILE_ROWS; ++j) acc[i][j] = V::zero();
    for (int64_t k = 0; k < K; k += KSTEP) {
        F wa[TILE_ROWS], wb[TILE_ROWS];
        if (k % LINE == 0)  // the k-step's lines, PREFETCH_ROWS rows on (common.h)
            for (int64_t p = 0; p < KSTEP; p += LINE) prefetch_rows_ahead(w, K, k + p, TILE_ROWS);
#pragma GCC unroll 4
        for (int j = 0; j < TILE_ROWS; ++j) Step<T>::load(w + j * K + k, K - k, wa[j], wb[j]);
#pragma GCC unroll 4
        for (int i = 0; i < MM; ++i) {
            const F a = V::loadu(xa + i * xs + k / 2), b = V::loadu(xb + i * xs + k / 2);
#pragma GCC unroll 4
            for (int j = 0; j < TILE_ROWS; ++j) acc[i][j] = V::fmadd(b, wb[j], V::fmadd(a, wa[j], acc[i][j]));
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
        for (int j = 0; j < TILE_ROWS; ++j)
            y[i * N + j] = Step<T>::narrow(bias ? s[j] + Step<T>::widen(bias[j]) : s[j]);
    }
}

// The last N % TILE_ROWS outputs of one input row: the tile's arithmetic for one weight row, so the
// bits match a full tile's.
template <typename T>
LANES_TARGET void tail(const float* xa, const float* xb, const T* w, const T* bias, T* y, int64_t K) {
    using F = typename V::F;
    F acc = V::zero();
    const F z = V::zero();
    for (int64_t k = 0; k < K; k += KSTEP) {
        F wa, wb;
        Step<T>::load(w + k, K - k, wa, wb);
        acc = V::fmadd(V::loadu(xb + k / 2), wb, V::fmadd(V::loadu(xa + k / 2), wa, acc));
    }
    alignas(16) float s[4];
    _mm_store_ps(s, V::reduce4(acc, z, z, z));
    *y = Step<T>::narrow(bias ? s[0] + Step<T>::widen(*bias) : s[0]);
}

// Weight-row tile b (rows b * TILE_ROWS ...) against every input row, 4 input rows at a time.
template <typename T>
LANES_TARGET void tiles(const float* xa, const float* xb, int64_t xs, const T* w, const T* bias, T* y, int64_t M,
                        int64_t N, int64_t K, int64_t b) {
    const int64_t n0 = b * TILE_ROWS;
    const T* wt = w + n0 * K;
    const T* bt = bias ? bias + n0 : nullptr;
    int64_t m0 = 0;
    for (; m0 + 4 <= M; m0 += 4) tile<4>(xa + m0 * xs, xb + m0 * xs, xs, wt, bt, y + m0 * N + n0, K, N);
    switch (M - m0) {
        case 3:
            tile<3>(xa + m0 * xs, xb + m0 * xs, xs, wt, bt, y + m0 * N + n0, K, N);
            break;
        case 2:
            tile<2>(xa + m0 * xs, xb + m0 * xs, xs, wt, bt, y + m0 * N + n0, K, N);
            break;
        case 1:
            tile<1>(xa + m0 * xs, xb + m0 * xs, xs, wt, bt, y + m0 * N + n0, K, N);
            break;
        default:
            break;
    }
}

// Input rows per work item beyond a few rows: a thread runs every weight tile it claims against one
// block of rows, which stays in L2 while the weights stream past, so the weights are read once per
// block of rows rather than the rows once per weight tile.
constexpr int64_t ROW_BLOCK = 64;

// y = x @ w^T (+ bias): the input rows split once into their two float32 halves (Step's layout,
// zero-padded to whole k-steps), then (row block, weight tile) items over the threads.
template <typename T>
void linear(const T* xp, const T* wp, const T* bp, T* yp, int64_t M, int64_t N, int64_t K, int threads) {
    const int64_t xs = (K + KSTEP - 1) / KSTEP * V::N;  // float32 per half row, padded to whole k-steps
    std::vector<float> split(static_cast<size_t>(2 * M * xs), 0.0f);
    float* halves[2] = {split.data(), split.data() + M * xs};
    for (int64_t m = 0; m < M; ++m) {
        const T* row = xp + m * K;
        if constexpr (std::is_same_v<T, float>) {  // each k-step's two runs of N, copied whole
            for (int64_t k = 0; k < K; k += V::N)
                std::memcpy(halves[Step<T>::half(k)] + m * xs + Step<T>::at(k), row + k,
                            static_cast<size_t>(std::min<int64_t>(V::N, K - k)) * sizeof(float));
        } else {
            for (int64_t k = 0; k < K; ++k) halves[Step<T>::half(k)][m * xs + Step<T>::at(k)] = Step<T>::widen(row[k]);
        }
    }
    const float* xa = halves[0];
    const float* xb = halves[1];
    const int64_t blocks = N / TILE_ROWS, rest = N % TILE_ROWS;
    const int64_t rows = std::min(M, ROW_BLOCK), row_blocks = (M + rows - 1) / rows;
    // Each thread starts on one contiguous slice of the items (pool.h): at a few rows, of the weight
    // matrix; the split input rows stay in L1, and a weight tile stays there while every input row
    // uses it. The tail's single outputs come last.
    parallel_for(threads, row_blocks * blocks + M * rest, 0, [&](int64_t i0, int64_t i1) {
        for (int64_t i = i0; i < i1; ++i) {
            if (i < row_blocks * blocks) {
                const int64_t m0 = i / blocks * rows;
                tiles(xa + m0 * xs, xb + m0 * xs, xs, wp, bp, yp + m0 * N, std::min(rows, M - m0), N, K, i % blocks);
                continue;
            }
            const int64_t t = i - row_blocks * blocks, m = t / rest, n = blocks * TILE_ROWS + t % rest;
            tail(xa + m * xs, xb + m * xs, wp + n * K, bp ? bp + n : nullptr, yp + m * N + n, K);
        }
    });
}
