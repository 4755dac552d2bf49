// keyed_draw_screen: the keyed Gumbel-max draw's scores over a whole vocabulary row, to screen it
// (minisgl_backend/sampling/sampler.py draws with it). A draw is the argmax over tokens t of
// x[t] / T - log(-log(u(seed, position, t))), u a stateless 64-bit hash; in numpy that is ~20
// full-row passes, most of a sampled decode row's time on the CPU. Here one pass bounds every
// token's score without a log, scores in float64 only the tokens whose bound reaches the largest
// logit's score (the hash bit for bit as sampler.hash_uniform computes it, the logs to about 1e-15
// relative), and returns the best token, its score, its noise, and a bound on every other token's
// score. The caller recomputes the winner's score exactly (numpy, as the full draw does) and keeps
// it only when it clears that bound by more than any error here could move a score: the token is
// then the full draw's, whatever the last bits of these logs are, and a near tie takes the full draw.
//
// keyed_best_ids: the top-k / top-p prefilter's selection (sampler._best_ids) without numpy's
// passes over the row: the `width` tokens of largest x / T, in its order.
//
// log_sum_exp: top-p's and min-p's normaliser of the whole row, its max m and log(sum exp(x / T - m)),
// the sum to about 1e-15; the sampler takes it only where no filter decision lies within 1e-9 of it.

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include "common.h"
#include "kernels.h"

namespace minisgl::cpu {
namespace {

constexpr uint64_t SEED_XOR = 0x9E3779B97F4A7C15ull;  // SplitMix64's increment
constexpr uint64_t POSITION_MUL = 0xD1B54A32D192ED03ull;
constexpr uint64_t TOKEN_MUL = 0xA24BAED4963EE407ull;
constexpr int64_t CHUNK = 512;  // tokens bounded (vectorised) before their candidates are scored

__attribute__((always_inline)) inline uint64_t mix64(uint64_t h) {
    h = (h ^ (h >> 30)) * 0xBF58476D1CE4E5B9ull;
    h = (h ^ (h >> 27)) * 0x94D049BB133111EBull;
    return h ^ (h >> 31);
}

// log(x) for a positive normal x, without branches (so the loop below vectorises): x = m * 2^e with
// m in [sqrt(1/2), sqrt(2)), where m - 1 is exact; log(m) = 2 atanh(s), s = (m - 1) / (m + 1),
// |s| < 0.172, by its series to s^19 (the next term is below 1e-16 of the sum).
__attribute__((always_inline)) inline double log_normal(double x) {
    uint64_t bits;
    std::memcpy(&bits, &x, 8);
    double e = static_cast<double>(static_cast<int64_t>(bits >> 52) - 1023);
    const uint64_t mbits = (bits & 0x000FFFFFFFFFFFFFull) | 0x3FF0000000000000ull;
    double m;
    std::memcpy(&m, &mbits, 8);
    const bool high = m > 1.4142135623730951;
    m = high ? m * 0.5 : m;
    e = high ? e + 1.0 : e;
    const double f = m - 1.0;
    const double s = f / (2.0 + f), z = s * s;
    double p = 1.0 / 19.0;
    p = p * z + 1.0 / 17.0;
    p = p * z + 1.0 / 15.0;
    p = p * z + 1.0 / 13.0;
    p = p * z + 1.0 / 11.0;
    p = p * z + 1.0 / 9.0;
    p = p * z + 1.0 / 7.0;
    p = p * z + 1.0 / 5.0;
    p = p * z + 1.0 / 3.0;
    // ln 2 in two parts: e * LN2_HI is exact for |e| < 2^11
    return e * 6.93147180369123816490e-01 + (e * 1.90821492927058770002e-10 + (f - s * (f - 2.0 * z * p)));
}

// The noise's 53 bits for token t: u = (k + 0.5) / 2^53 (sampler.hash_uniform).
__attribute__((always_inline)) inline uint64_t noise_bits(uint64_t key, int64_t t) {
    return mix64(key ^ (static_cast<uint64_t>(t) * TOKEN_MUL)) >> 11;
}

__attribute__((always_inline)) inline double uniform(uint64_t k) {
    return (static_cast<double>(k) + 0.5) * (1.0 / 9007199254740992.0);  // / 2^53, exact
}

// The Gumbel noise -log(-log(u)), to about 1e-15.
__attribute__((always_inline)) inline double noise(uint64_t k) { return -log_normal(-log_normal(uniform(k))); }

// An upper bound of noise(k) in a few vector operations, without a log: -log(u) >= 1 - u, so the
// noise is at most -log(1 - u), and 1 - u = (m + 0.5) / 2^53 with m = 2^53 - 1 - k is above
// 2^floor(log2 m) / 2^53, so the noise is below (53 - floor(log2 m)) ln 2. Loose
// by up to ~2 for a small u, tight where the noise is large (u near 1), which is what decides a draw.
__attribute__((always_inline)) inline double noise_bound(uint64_t k) {
    const uint64_t m = (uint64_t{1} << 53) - 1 - k;
    const double md = static_cast<double>(m);  // exact below 2^53
    uint64_t bits;
    std::memcpy(&bits, &md, 8);
    // m = 0 (one k in 2^53) reads as 2^-1023 here: a bound far above the noise, which is all it must be
    const double floor_log2 = static_cast<double>(static_cast<int64_t>(bits >> 52) - 1023);
    return (53.0 - floor_log2) * 0.6931471805599454;  // ln 2, rounded up
}

// A score's bound must not fall below the score itself through the roundings of either: by far less than this.
constexpr double BOUND_SLACK = 1e-6;

__attribute__((always_inline)) inline ScreenedDraw screen_body(const float* x, int64_t vocab, double temperature,
                                                               uint64_t seed, int64_t position) {
    const uint64_t key = mix64(mix64(seed ^ SEED_XOR) + static_cast<uint64_t>(position) * POSITION_MUL);
    // x * (1 / T) rather than x / T: a rounding apart, far inside the margin the caller allows
    const double inv_t = 1.0 / temperature;
    ScreenedDraw r{-1, -INFINITY, -INFINITY, 0.0, false};
    float xmax = -INFINITY;
    int nan = 0;
#pragma omp simd reduction(max : xmax) reduction(| : nan)
    for (int64_t t = 0; t < vocab; ++t) {
        xmax = x[t] > xmax ? x[t] : xmax;
        nan |= x[t] != x[t];
    }
    r.nan = nan != 0;
    if (r.nan || !std::isfinite(xmax)) return r;  // a NaN, an infinity or nothing but -inf: the full draw decides
    // The largest logit's score: no token whose bound is below it can win the draw.
    const int64_t first = std::find(x, x + vocab, xmax) - x;
    double threshold = static_cast<double>(x[first]) * inv_t + noise(noise_bits(key, first));
    double left_out = -INFINITY;  // the largest bound of a token neither scored nor the winner
    alignas(64) double buf[CHUNK];
    for (int64_t t0 = 0; t0 < vocab; t0 += CHUNK) {
        const int64_t n = std::min(CHUNK, vocab - t0);
#pragma omp simd
        for (int64_t i = 0; i < n; ++i)
            buf[i] = static_cast<double>(x[t0 + i]) * inv_t + noise_bound(noise_bits(key, t0 + i)) + BOUND_SLACK;
        int64_t candidates = 0;
        double dropped = -INFINITY;
#pragma omp simd reduction(+ : candidates) reduction(max : dropped)
        for (int64_t i = 0; i < n; ++i) {
            const bool in = buf[i] >= threshold;
            const double d = in ? -INFINITY : buf[i];
            candidates += in;
            dropped = d > dropped ? d : dropped;
        }
        if (candidates == 0) {
            left_out = std::max(left_out, dropped);
            continue;
        }
        const bool dense = candidates * 8 > n;  // then every score of the chunk, vectorised
        if (dense) {
#pragma omp simd
            for (int64_t i = 0; i < n; ++i)
                buf[i] = static_cast<double>(x[t0 + i]) * inv_t + noise(noise_bits(key, t0 + i));
        } else {
            left_out = std::max(left_out, dropped);
        }
        for (int64_t i = 0; i < n; ++i) {
            if (!dense && buf[i] < threshold) continue;
            const int64_t t = t0 + i;
            const double s = dense ? buf[i] : static_cast<double>(x[t]) * inv_t + noise(noise_bits(key, t));
            if (r.token < 0) {
                r.token = t;
                r.score = s;
            } else if (s > r.score) {  // a tie stays the runner-up: the caller then draws in full
                r.second = r.score;
                r.score = s;
                r.token = t;
            } else if (s > r.second) {
                r.second = s;
            }
        }
        threshold = std::max(threshold, r.score);
    }
    r.second = std::max(r.second, left_out);
    if (r.token >= 0) r.u = uniform(noise_bits(key, r.token));
    return r;
}

AVX512 ScreenedDraw screen_avx512(const float* x, int64_t vocab, double temperature, uint64_t seed, int64_t position) {
    return screen_body(x, vocab, temperature, seed, position);
}

// Token ids t with x[t] >= cut into ids (room for vocab + 16); returns their count, or -1 if the row
// holds a NaN.
AVX512 int64_t at_or_above(const float* x, int64_t vocab, float cut, int32_t* ids) {
    const __m512 c = _mm512_set1_ps(cut);
    const __m512i step = _mm512_set1_epi32(16);
    __m512i t = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    int64_t n = 0;
    __mmask16 nan = 0;
    for (int64_t t0 = 0; t0 < vocab; t0 += 16, t = _mm512_add_epi32(t, step)) {
        const __mmask16 lanes = first_lanes(vocab - t0);
        const __m512 v = _mm512_maskz_loadu_ps(lanes, x + t0);
        nan |= _mm512_mask_cmp_ps_mask(lanes, v, v, _CMP_UNORD_Q);
        const __mmask16 in = _mm512_mask_cmp_ps_mask(lanes, v, c, _CMP_GE_OQ);
        // compress into a register, then a full store (ids has 16 spare slots): the compressing
        // store to memory is microcoded, and far slower, on some CPUs
        _mm512_storeu_si512(ids + n, _mm512_maskz_compress_epi32(in, t));
        n += __builtin_popcount(in);
    }
    return nan ? -1 : n;
}

// exp(y) for y <= 0 (-inf included), to a few units in the last place: y = n ln 2 + r, |r| <= ln 2 / 2,
// exp(r) by its series to r^13, times 2^n built in the exponent bits; results below 2^-1022 are 0.
__attribute__((always_inline)) inline double exp_nonpositive(double y) {
    y = y < -745.0 ? -745.0 : y;
    const double n = std::nearbyint(y * 1.4426950408889634);
    const double r = (y - n * 6.93147180369123816490e-01) - n * 1.90821492927058770002e-10;
    double p = 1.0 / 6227020800.0;  // 1 / 13!
    const double inv_fact[13] = {1.0 / 479001600.0,
                                 1.0 / 39916800.0,
                                 1.0 / 3628800.0,
                                 1.0 / 362880.0,
                                 1.0 / 40320.0,
                                 1.0 / 5040.0,
                                 1.0 / 720.0,
                                 1.0 / 120.0,
                                 1.0 / 24.0,
                                 1.0 / 6.0,
                                 0.5,
                                 1.0,
                                 1.0};
    for (int i = 0; i < 13; ++i) p = p * r + inv_fact[i];
    const int64_t e = static_cast<int64_t>(n) + 1023;
    const uint64_t bits = static_cast<uint64_t>(e > 0 ? e : 0) << 52;
    double scale;
    std::memcpy(&scale, &bits, 8);
    return e > 0 ? p * scale : 0.0;
}

AVX512 LogSumExp log_sum_exp_avx512(const float* x, int64_t vocab, double temperature) {
    double m = -INFINITY;
    int nan = 0;
#pragma omp simd reduction(max : m) reduction(| : nan)
    for (int64_t t = 0; t < vocab; ++t) {
        const double v = static_cast<double>(x[t]) / temperature;
        m = v > m ? v : m;
        nan |= v != v;
    }
    if (nan || !std::isfinite(m)) return {m, NAN, false};
    double sum = 0.0;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < vocab; ++t) sum += exp_nonpositive(static_cast<double>(x[t]) / temperature - m);
    return {m, std::log(sum), true};
}

// The three entry points run AVX-512 code only: the hash's 64-bit multiplies and conversions
// vectorise there alone, and without them these passes are slower than numpy's.
void require_avx512(int isa, const char* op) {
    if (require_isa(isa) == ISA_AVX2) throw std::invalid_argument(std::string(op) + " runs on AVX-512 only");
}

struct Scored {
    double v;
    int64_t id;
};

// sampler._best_ids' order: larger x / T first, then the lower id.
inline bool before(const Scored& a, const Scored& b) { return a.v > b.v || (a.v == b.v && a.id < b.id); }

}  // namespace

// A cut is guessed in float32 from every 16th logit, the tokens at or above it are gathered and
// divided by T as numpy divides (so two logits that round to one x / T tie, as in numpy), and the
// first `width` of them by _best_ids' order are the answer, unless the width-th one ties with the
// cut itself (a token below the cut could then tie with it too): the caller then selects in numpy,
// as it does for a NaN, a width of a quarter of the row or more, or a guess that keeps too few.
int64_t keyed_best_ids(uintptr_t x, int64_t vocab, double temperature, int64_t width, uintptr_t out, int isa) {
    require_avx512(isa, "keyed_best_ids");
    const auto* xp = reinterpret_cast<const float*>(x);
    auto* op = reinterpret_cast<int64_t*>(out);
    if (width < 1 || width >= vocab / 4) return -1;
    std::vector<float> sample;
    for (int64_t t = 0; t < vocab; t += 16) sample.push_back(xp[t]);
    const int64_t stride_sample = static_cast<int64_t>(sample.size());
    thread_local std::vector<int32_t> ids;  // a decode step selects for every row: keep the buffer
    ids.resize(static_cast<size_t>(vocab + 16));
    for (int64_t guess = width / 16 + width / 32 + 2; guess < stride_sample; guess *= 4) {
        std::nth_element(sample.begin(), sample.begin() + (guess - 1), sample.end(), std::greater<float>());
        const float cut = sample[guess - 1];
        const int64_t n = at_or_above(xp, vocab, cut, ids.data());
        if (n < 0) return -1;
        if (n < width) continue;
        std::vector<Scored> s(static_cast<size_t>(n));
        for (int64_t i = 0; i < n; ++i) s[i] = {static_cast<double>(xp[ids[i]]) / temperature, ids[i]};
        std::nth_element(s.begin(), s.begin() + (width - 1), s.end(), before);
        std::sort(s.begin(), s.begin() + width, before);
        if (!(s[width - 1].v > static_cast<double>(cut) / temperature)) return -1;
        for (int64_t i = 0; i < width; ++i) op[i] = s[i].id;
        return width;
    }
    return -1;
}

LogSumExp log_sum_exp(uintptr_t x, int64_t vocab, double temperature, int isa) {
    require_avx512(isa, "log_sum_exp");
    return log_sum_exp_avx512(reinterpret_cast<const float*>(x), vocab, temperature);
}

ScreenedDraw keyed_draw_screen(uintptr_t x, int64_t vocab, double temperature, uint64_t seed, int64_t position,
                               int isa) {
    require_avx512(isa, "keyed_draw_screen");
    return screen_avx512(reinterpret_cast<const float*>(x), vocab, temperature, seed, position);
}

}  // namespace minisgl::cpu
