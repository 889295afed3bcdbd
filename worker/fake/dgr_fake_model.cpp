// The fake model itself: its weights drawn from the seed, the head and one token through the owned layers
// (the formulas at the top of dgr_fake_engine.cpp), and a stage opened with its own weights only.
#include "dgr_fake_internal.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <vector>

namespace dgr_fake {

namespace {

// --- the weights (see the top of dgr_fake_engine.cpp)
uint64_t mix(uint64_t x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

enum Tensor : uint64_t { EMBED = 1, HEAD = 2, TOK = 3, LAYER_W = 4, LAYER_A = 5 };

struct Draw {
    uint64_t key;
    Draw(int64_t seed, Tensor t, int64_t layer) : key(mix(mix(mix(uint64_t(seed)) ^ uint64_t(t)) ^ uint64_t(layer + 1))) {}
    uint64_t bits(uint64_t i) const { return mix(key + (i + 1) * 0x9E3779B97F4A7C15ull); }
    double uniform(uint64_t i) const { return double(bits(i) >> 40) * (1.0 / 16777216.0); }
    double normal(uint64_t i) const {
        const uint64_t b = bits(i);
        double s = 0.0;
        for (int k = 0; k < 4; ++k) s += (double((b >> (16 * k)) & 0xFFFF) + 0.5) * (1.0 / 65536.0);
        return (s - 2.0) * 1.7320508075688772;
    }
    std::vector<float> normals(size_t n, double scale) const {
        std::vector<float> out(n);
        for (size_t i = 0; i < n; ++i) out[i] = float(normal(i) * scale);
        return out;
    }
};

}  // namespace

dgr_engine * open_engine(const Spec & spec) {
    auto e = std::make_unique<dgr_engine>();
    e->spec = spec;
    e->d = spec.width();
    if (spec.stage < 0) {
        e->begin = 0, e->end = spec.layers;
    } else {
        auto r = spec.ranges()[size_t(spec.stage)];
        e->begin = r.first, e->end = r.second;
    }
    e->first = e->begin == 0;
    e->last = e->end == spec.layers;
    e->needs_ids = dgr_needs_token_ids(e->begin, spec.hash_layers);
    const size_t vd = size_t(spec.vocab) * size_t(e->d);
    const double inv_sqrt_d = 1.0 / std::sqrt(double(e->d));
    if (e->first) e->embed = Draw(spec.seed, EMBED, 0).normals(vd, 1.0);
    if (e->last) e->head = Draw(spec.seed, HEAD, 0).normals(vd, inv_sqrt_d);
    if (e->begin < spec.hash_layers) e->tok = Draw(spec.seed, TOK, 0).normals(vd, 0.5);
    for (int64_t l = e->begin; l < e->end; ++l) {
        e->w.push_back(Draw(spec.seed, LAYER_W, l).normals(size_t(e->d) * size_t(e->d), inv_sqrt_d));
        Draw da(spec.seed, LAYER_A, l);
        std::vector<float> av(size_t(e->d));
        for (int64_t i = 0; i < e->d; ++i) av[size_t(i)] = float(0.5 + da.uniform(uint64_t(i)));
        e->a.push_back(std::move(av));
    }
    return e.release();
}

}  // namespace dgr_fake

using namespace dgr_fake;

void dgr_engine::logits(const float * h, float * out) const {
    double ss = 0.0;
    for (int64_t j = 0; j < d; ++j) ss += double(h[j]) * double(h[j]);
    const float den = std::max(float(std::sqrt(ss)), 1e-6f);
    std::vector<float> hn(static_cast<size_t>(d));
    for (int64_t j = 0; j < d; ++j) hn[size_t(j)] = h[j] / den;
    for (int64_t v = 0; v < spec.vocab; ++v) {
        const float * row = head.data() + v * d;
        double acc = 0.0;
        for (int64_t j = 0; j < d; ++j) acc += double(row[j]) * double(hn[size_t(j)]);
        out[v] = float(acc);
    }
}

void dgr_engine::token(Session & s, float * h, int32_t pos, int32_t id) {
    std::vector<float> next(static_cast<size_t>(d));
    const double count = double(pos) + 1.0;
    for (int64_t l = begin; l < end; ++l) {
        const size_t li = size_t(l - begin);
        double * sum = s.sums[li].data();
        for (int64_t j = 0; j < d; ++j) sum[j] += double(h[j]);
        s.inputs[li].insert(s.inputs[li].end(), h, h + d);
        const float * W = w[li].data();
        const float * A = a[li].data();
        const float * T = l < spec.hash_layers ? tok.data() + int64_t(id) * d : nullptr;
        for (int64_t i = 0; i < d; ++i) {
            double acc = 0.0;
            for (int64_t j = 0; j < d; ++j) acc += double(W[i * d + j]) * double(h[j]);
            const float mean = float(sum[i] / count);
            const float am = A[i] * mean;
            float z = float(acc) + am;
            if (T) z = z + T[i];
            const float q = z / (1.0f + std::fabs(z));
            next[size_t(i)] = h[i] + q;
        }
        std::copy(next.begin(), next.end(), h);
    }
}
