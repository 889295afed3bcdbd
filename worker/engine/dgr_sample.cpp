// The last stage's sampling (dgr_engine.h: dgr_sample), the one sampler: dgr-worker draws every token
// with it and the fake engine library compiles the same file. The draw for position p is keyed by
// (seed, p), not a running stream, so re-prefilling at a new epoch after a cache miss reproduces the text
// the first epoch would have produced. Every step is one IEEE 754 rounds the same way everywhere:
// float64 division, subtraction, multiplication and addition one at a time (no fused multiply-add), a
// stable sort, a sequential cumulative sum, e^x as a fixed polynomial (libm's exp may differ in the last
// bit), and an integer hash for the uniform draw. So a sampled token depends on the logits, the
// parameters and the position only, never on the compiler's flags.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include "dgr_engine.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

namespace {

constexpr double LN2_HI  = 6.93147180369123816490e-01;
constexpr double LN2_LO  = 1.90821492927058770002e-10;
constexpr double INV_LN2 = 1.44269504088896338700e+00;
constexpr int    EXP_TERMS = 13;
constexpr double EXP_MIN = -745.0;

uint64_t splitmix(uint64_t x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

} // namespace

extern "C" {

double dgr_exp_fixed(double d) {
    if (std::isinf(d) && d < 0) return 0.0;        // a logit the grammar masked: never drawn
    d = std::max(d, EXP_MIN);
    const double k = std::floor(d * INV_LN2 + 0.5);
    const double r = (d - k * LN2_HI) - k * LN2_LO;
    double p = 1.0;
    for (int n = EXP_TERMS; n > 0; --n) {
        p = 1.0 + (r / (double) n) * p;
    }
    return std::ldexp(p, (int) k);
}

double dgr_uniform(uint64_t seed, int64_t position) {
    const uint64_t x = splitmix(splitmix(seed) ^ (uint64_t) position);
    return (double) (x >> 11) * (1.0 / (double) (1ull << 53));
}

int32_t dgr_sample(const float * logits, int32_t n_vocab, double temperature, int32_t top_k, double top_p,
                   uint64_t seed, int64_t position) {
    if (!logits || n_vocab <= 0) return -1;
    if (temperature <= 0.0) {
        return (int32_t) (std::max_element(logits, logits + n_vocab) - logits);   // the first maximum
    }
    std::vector<double> z((size_t) n_vocab);
    for (int32_t i = 0; i < n_vocab; ++i) z[(size_t) i] = (double) logits[i] / temperature;
    std::vector<int32_t> order((size_t) n_vocab);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return z[(size_t) a] > z[(size_t) b]; });
    size_t n = order.size();
    if (top_k > 0 && (size_t) top_k < n) n = (size_t) top_k;
    std::vector<double> c(n);
    const double top = z[(size_t) order[0]];
    double acc = 0.0;
    for (size_t i = 0; i < n; ++i) {
        acc = acc + dgr_exp_fixed(z[(size_t) order[i]] - top);
        c[i] = acc;
    }
    size_t keep = n;
    if (top_p > 0.0 && top_p < 1.0) {               // the smallest head whose share reaches top_p
        const double mass = c[n - 1];
        size_t j = 0;
        while (j < n && c[j] / mass < top_p) ++j;    // searchsorted(c / mass, top_p, side="left")
        keep = std::min(n, j + 1);
    }
    const double target = dgr_uniform(seed, position) * c[keep - 1];
    const size_t i = (size_t) (std::upper_bound(c.begin(), c.begin() + (long) keep, target) - c.begin());
    return order[std::min(keep - 1, i)];
}

int32_t dgr_logprobs(const float * logits, int32_t n_vocab, int32_t chosen, float * chosen_lp, int32_t top,
                     int32_t * top_ids, float * top_lps) {
    if (!logits || n_vocab <= 0 || chosen >= n_vocab || top < 0 || (top > 0 && (!top_ids || !top_lps)) ||
        (chosen >= 0 && !chosen_lp)) {
        return -1;
    }
    double m = -INFINITY;
    for (int32_t i = 0; i < n_vocab; ++i) m = std::max(m, (double) logits[i]);
    if (std::isinf(m)) return -1;                    // nothing finite to normalise
    double s = 0.0;
    for (int32_t i = 0; i < n_vocab; ++i) s += std::exp((double) logits[i] - m);
    const double norm = m + std::log(s);
    auto lp = [&](int32_t i) { return (float) ((double) logits[i] - norm); };
    if (chosen >= 0) *chosen_lp = lp(chosen);
    const int32_t n = std::min(top, n_vocab);
    if (n > 0) {
        std::vector<int32_t> order((size_t) n_vocab);
        std::iota(order.begin(), order.end(), 0);
        std::partial_sort(order.begin(), order.begin() + n, order.end(), [&](int32_t a, int32_t b) {
            return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
        });
        for (int32_t j = 0; j < n; ++j) {
            top_ids[j] = order[(size_t) j];
            top_lps[j] = lp(order[(size_t) j]);
        }
    }
    return n;
}

} // extern "C"
