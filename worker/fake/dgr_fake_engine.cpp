// The fake engine (dgr_fake_engine.h): a deterministic toy model behind the ShardEngine's C ABI.
//
// The model (the semantics dgr.testing.fake_engine documents): token embeddings, `layers` residual layers
// and a head, drawn from `seed`. Each layer mixes the token with the running mean of everything the session
// has seen at that layer, so outputs depend on history and a stage holds a real per-session cache (a step
// whose positions do not continue it is a cache miss). The first `hash_layers` layers also add a vector
// picked by the token id (as DeepSeek V4's hash-routed layers do), so a later stage owning one of them
// needs the token-id sideband. For a token h (float32 [streams*embd]) at layer l:
//
//     sum_l += h                    (float64, in position order; a truncate re-adds the kept inputs in order)
//     z = W_l h + a_l * float32(sum_l / positions)           (W_l h: a float64 dot product per row)
//     z += tok[id]                  (l < hash_layers)
//     h = h + z / (1 + |z|)         (softsign: IEEE add, divide and abs only, the same bits on any machine)
//
// and the head is logits[v] = head_v . (h / max(|h|, 1e-6)). Every operation is a per-token scalar loop
// in a fixed order with no fused multiply-add (fp-contract off here and on every build's command line,
// no -ffast-math), so batching and chunking never change a bit, and the whole model's logits equal the
// composition of its stages' bit for bit.
//
// Weights: value i of a tensor is drawn from splitmix64(key + (i+1) * golden), key = a hash of (seed,
// tensor, layer). A uniform in [0, 1) is the top 24 bits; a "normal" the Irwin-Hall sum of four 16-bit
// uniforms, centred and scaled to unit variance (arithmetic only: no libm, the same weights everywhere).
// Per layer, so a stage draws only its own layers (and the embeddings on the first stage, the head on
// the last, the token vectors where it owns a hash layer). Not numpy's weights: the Python fake of old
// drew others.
//
// Vocabulary: 0 pad, 1 BOS, 2 EOS, 3..258 the bytes 0..255 (UTF-8), the rest unused.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include "dgr_fake_engine.h"

#include "dgr_contract.h"

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace {

thread_local std::string g_last_error;
thread_local int64_t     g_miss_held = 0, g_miss_expected = 0;

constexpr int32_t BOS = 1, EOS = 2, BYTE0 = 3;
const char * const KEYS[] = {"layers", "embd", "streams", "vocab", "seed", "cuts", "hash_layers", "ctx",
                             "sessions", "recurrent"};

// A refusal with its status (becomes the C status and dgr_last_error).
struct Fail : std::runtime_error {
    int32_t status;
    Fail(int32_t st, const std::string & msg) : std::runtime_error(msg), status(st) {}
};

int32_t fail(int32_t status, const std::string & msg) {
    g_last_error = msg;
    return status;
}

// Runs `fn` (which returns a status), turning every exception into a status and dgr_last_error.
template <typename F> int32_t guarded(F && fn) {
    try {
        g_last_error.clear();
        return fn();
    } catch (const Fail & e) {
        return fail(e.status, e.what());
    } catch (const std::bad_alloc &) {
        return fail(DGR_E_ENGINE, "fake engine: out of memory (a smaller spec: layers, embd, streams, vocab, ctx)");
    } catch (const std::exception & e) {
        return fail(DGR_E_ENGINE, std::string("fake engine: ") + e.what());
    } catch (...) {
        return fail(DGR_E_ENGINE, "fake engine: unknown exception");
    }
}

// Python's repr of a str without quotes or backslashes in it (the spec texts the messages quote)
std::string repr(const std::string & s) { return "'" + s + "'"; }

std::string strip(const std::string & s) {
    size_t b = s.find_first_not_of(" \t\n\r\f\v"), e = s.find_last_not_of(" \t\n\r\f\v");
    return b == std::string::npos ? "" : s.substr(b, e - b + 1);
}

struct Spec {
    int64_t layers = 6, embd = 16, streams = 1, vocab = 300, seed = 1;
    std::vector<int64_t> cuts{2, 4};
    int64_t hash_layers = 0, ctx = DGR_DEFAULT_N_CTX, sessions = 64, recurrent = 0;
    int64_t stage = -1;                                   // -1: the whole model

    int64_t width() const { return streams * embd; }
    std::vector<std::pair<int64_t, int64_t>> ranges() const {
        std::vector<int64_t> edges{0};
        edges.insert(edges.end(), cuts.begin(), cuts.end());
        edges.push_back(layers);
        std::vector<std::pair<int64_t, int64_t>> out;
        for (size_t i = 0; i + 1 < edges.size(); ++i) out.emplace_back(edges[i], edges[i + 1]);
        return out;
    }
    // FakeModel.to_spec
    std::string canonical() const {
        std::string cs;
        for (size_t i = 0; i < cuts.size(); ++i) cs += (i ? ":" : "") + std::to_string(cuts[i]);
        std::string s = "layers=" + std::to_string(layers) + ",embd=" + std::to_string(embd) + ",streams=" +
                        std::to_string(streams) + ",vocab=" + std::to_string(vocab) + ",seed=" + std::to_string(seed) +
                        ",cuts=" + cs + ",hash_layers=" + std::to_string(hash_layers) + ",ctx=" + std::to_string(ctx) +
                        ",sessions=" + std::to_string(sessions);
        if (recurrent) s += ",recurrent=" + std::to_string(recurrent);
        return s;
    }
};

int64_t to_int(const std::string & spec, const std::string & part, const std::string & v) {
    std::string t = strip(v);
    errno = 0;
    char * end = nullptr;
    long long x = t.empty() ? 0 : std::strtoll(t.c_str(), &end, 10);
    if (t.empty() || errno || *end) {
        throw Fail(DGR_E_ENGINE, "fake engine spec " + repr(spec) + ": bad item " + repr(part) + "; " + repr(v) +
                                     " is not an integer");
    }
    return x;
}

// FakeModel.from_spec and its checks, plus stage= (when allowed) and the bounds a C engine needs.
Spec parse(const std::string & text, bool allow_stage) {
    Spec s;
    std::string keys;
    for (const char * k : KEYS) keys += (keys.empty() ? "" : ", ") + std::string(k);
    size_t at = 0;
    while (at <= text.size()) {
        size_t comma = text.find(',', at);
        std::string part = strip(text.substr(at, comma == std::string::npos ? std::string::npos : comma - at));
        at = comma == std::string::npos ? text.size() + 1 : comma + 1;
        if (part.empty()) continue;
        size_t eq = part.find('=');
        std::string key = eq == std::string::npos ? part : part.substr(0, eq);
        std::string value = eq == std::string::npos ? "" : part.substr(eq + 1);
        bool known = allow_stage && key == "stage";
        for (const char * k : KEYS) known = known || key == k;
        if (eq == std::string::npos || !known) {
            throw Fail(DGR_E_ENGINE, "fake engine spec " + repr(text) + ": bad item " + repr(part) +
                                         "; expected key=value with key in " + keys + (allow_stage ? ", stage" : ""));
        }
        if (key == "cuts") {
            s.cuts.clear();
            size_t c0 = 0;
            while (c0 <= value.size()) {
                size_t c1 = value.find(':', c0);
                std::string c = value.substr(c0, c1 == std::string::npos ? std::string::npos : c1 - c0);
                c0 = c1 == std::string::npos ? value.size() + 1 : c1 + 1;
                if (!c.empty()) s.cuts.push_back(to_int(text, part, c));
            }
            continue;
        }
        int64_t x = to_int(text, part, value);
        if (key == "layers") s.layers = x;
        else if (key == "embd") s.embd = x;
        else if (key == "streams") s.streams = x;
        else if (key == "vocab") s.vocab = x;
        else if (key == "seed") s.seed = x;
        else if (key == "hash_layers") s.hash_layers = x;
        else if (key == "ctx") s.ctx = x;
        else if (key == "sessions") s.sessions = x;
        else if (key == "recurrent") s.recurrent = x;
        else s.stage = x;
    }
    if (s.vocab < BYTE0 + 256) {
        throw Fail(DGR_E_ENGINE, "fake model: vocab=" + std::to_string(s.vocab) + " must be at least " + std::to_string(BYTE0 + 256));
    }
    bool cuts_ok = true;
    for (size_t i = 0; i < s.cuts.size(); ++i) {
        cuts_ok = cuts_ok && 0 < s.cuts[i] && s.cuts[i] < s.layers && (i == 0 || s.cuts[i - 1] < s.cuts[i]);
    }
    if (!cuts_ok) {
        std::string cs;
        for (size_t i = 0; i < s.cuts.size(); ++i) cs += (i ? ", " : "") + std::to_string(s.cuts[i]);
        if (s.cuts.size() == 1) cs += ",";
        throw Fail(DGR_E_ENGINE, "fake model: cuts=(" + cs + ") must be increasing layer indices inside (0, " +
                                     std::to_string(s.layers) + ")");
    }
    // what a C engine needs besides (the Python dataclass never checked them)
    auto at_least = [](const char * k, int64_t v, int64_t lo, int64_t hi) {
        if (v < lo || v > hi) {
            throw Fail(DGR_E_ENGINE, "fake model: " + std::string(k) + "=" + std::to_string(v) + " must be in [" +
                                         std::to_string(lo) + ", " + std::to_string(hi) + "]");
        }
    };
    at_least("layers", s.layers, 1, 1 << 16);
    at_least("embd", s.embd, 1, 1 << 16);
    at_least("streams", s.streams, 1, 64);
    at_least("vocab", s.vocab, BYTE0 + 256, 1 << 24);
    at_least("hash_layers", s.hash_layers, 0, INT32_MAX);
    at_least("ctx", s.ctx, 1, INT32_MAX);
    at_least("sessions", s.sessions, 1, 1 << 20);
    if (s.width() > (1 << 16)) {
        throw Fail(DGR_E_ENGINE, "fake model: streams*embd=" + std::to_string(s.width()) + " must be at most 65536");
    }
    const int64_t n_stages = int64_t(s.cuts.size()) + 1;
    if (s.stage != -1 && (s.stage < 0 || s.stage >= n_stages)) {
        throw Fail(DGR_E_ENGINE, "fake bundle has " + std::to_string(n_stages) + " stages; there is no stage " +
                                     std::to_string(s.stage));
    }
    return s;
}

// --- the weights (see the top of this file)
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

struct Session {
    int32_t n = 0;
    std::vector<std::vector<double>> sums;     // per owned layer: the running sum of its inputs [d]
    std::vector<std::vector<float>>  inputs;   // per owned layer: its input at each position [n * d]
};

}  // namespace

struct dgr_engine {
    Spec spec;
    int64_t begin = 0, end = 0, d = 0;
    bool first = false, last = false, needs_ids = false;
    std::vector<float> embed, head, tok;                   // [vocab * d] each, where this stage needs them
    std::vector<std::vector<float>> w, a;                  // per owned layer: [d * d], [d]
    std::map<std::pair<std::string, int64_t>, Session> sessions;
    std::mutex mu;                                         // one call at a time

    std::string where() const { return "layers [" + std::to_string(begin) + ", " + std::to_string(end) + ")"; }

    Session & session(const std::string & sid, int64_t epoch) {
        auto it = sessions.find({sid, epoch});
        if (it == sessions.end()) {
            throw Fail(DGR_E_ENGINE, "no open session " + sid + " epoch " + std::to_string(epoch) + " on " + where() +
                                         "; open it first");
        }
        return it->second;
    }

    // the head on one row: logits[v] = head_v . (h / max(|h|, 1e-6))
    void logits(const float * h, float * out) const {
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

    // one token through the owned layers (h in place); `pos` its position, `id` its token (-1: none)
    void token(Session & s, float * h, int32_t pos, int32_t id) {
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
};

namespace {

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

void vocab_info(const Spec & s, dgr_vocab_info * out, int32_t * eog, int32_t eog_cap) {
    out->n_vocab = int32_t(s.vocab);
    out->bos = BOS;
    out->eos = EOS;
    out->eot = -1;
    out->n_eog = 1;
    if (eog && eog_cap >= 1) eog[0] = EOS;
}

std::string str(const char * s) { return s ? std::string(s) : std::string(); }

}  // namespace

extern "C" {

DGR_API int32_t dgr_abi_version(void) { return DGR_ABI_VERSION; }
DGR_API int32_t dgr_has_hooks(void) { return 0; }
// the lane a fake stage advertises (dgr.app.stages.fake_stage: "cpu"); its identity's engine is "fake"
DGR_API const char * dgr_engine_lane(void) { return "cpu"; }
DGR_API const char * dgr_last_error(void) { return g_last_error.c_str(); }

DGR_API void dgr_last_cache_miss(int64_t * held, int64_t * expected) {
    if (held) *held = g_miss_held;
    if (expected) *expected = g_miss_expected;
}

DGR_API int32_t dgr_fake_spec(const char * spec, char * out, int32_t cap, int32_t * n_stages) {
    int32_t len = -1;
    int32_t st = guarded([&] {
        if (!spec) throw Fail(DGR_E_ENGINE, "fake engine: no spec");
        Spec s = parse(spec, false);
        std::string c = s.canonical();
        if (out && cap > 0) {
            std::memcpy(out, c.data(), std::min<size_t>(c.size(), size_t(cap)));
            if (c.size() < size_t(cap)) out[c.size()] = '\0';
        }
        if (n_stages) *n_stages = int32_t(s.cuts.size() + 1);
        len = int32_t(c.size());
        return DGR_OK;
    });
    return st == DGR_OK ? len : -1;
}

DGR_API int32_t dgr_engine_open(const char * path, const dgr_open_params * params, dgr_engine ** out) {
    (void) params;
    return guarded([&] {
        if (!out) throw Fail(DGR_E_ENGINE, "dgr_engine_open: out is NULL");
        *out = nullptr;
        if (!path) throw Fail(DGR_E_ENGINE, "fake engine: no spec");
        *out = open_engine(parse(path, true));
        return DGR_OK;
    });
}

DGR_API void dgr_engine_close(dgr_engine * eng) { delete eng; }

DGR_API int32_t dgr_engine_describe(dgr_engine * eng, dgr_stage_info * out) {
    return guarded([&] {
        if (!eng || !out) throw Fail(DGR_E_ENGINE, "dgr_engine_describe: NULL argument");
        std::memset(out, 0, sizeof *out);
        std::snprintf(out->arch, sizeof out->arch, "fake");
        out->layer_begin = int32_t(eng->begin);
        out->layer_end = int32_t(eng->end);
        out->n_layer = int32_t(eng->spec.layers);
        out->n_embd = int32_t(eng->spec.embd);
        out->n_streams = int32_t(eng->spec.streams);
        out->n_vocab = int32_t(eng->spec.vocab);
        out->is_first = eng->first;
        out->is_last = eng->last;
        out->needs_token_ids = eng->needs_ids;
        out->has_vocab = 1;
        out->n_ctx = int32_t(eng->spec.ctx);
        out->max_sessions = int32_t(eng->spec.sessions);
        out->batch_invariant = 1;
        return DGR_OK;
    });
}

DGR_API int32_t dgr_engine_memory(dgr_engine * eng, dgr_memory * out) {
    return guarded([&] {
        if (!eng || !out) throw Fail(DGR_E_ENGINE, "dgr_engine_memory: NULL argument");
        std::lock_guard<std::mutex> g(eng->mu);
        std::memset(out, 0, sizeof *out);
        uint64_t weights = (eng->embed.size() + eng->head.size() + eng->tok.size()) * sizeof(float);
        for (size_t k = 0; k < eng->w.size(); ++k) weights += (eng->w[k].size() + eng->a[k].size()) * sizeof(float);
        uint64_t kv = 0;
        for (auto & kvp : eng->sessions) {
            for (size_t k = 0; k < kvp.second.sums.size(); ++k) {
                kv += kvp.second.sums[k].size() * sizeof(double) + kvp.second.inputs[k].size() * sizeof(float);
            }
        }
        out->weights_bytes = weights;
        out->kv_bytes = kv;
        return DGR_OK;
    });
}

DGR_API int32_t dgr_session_open(dgr_engine * eng, const char * session_id, int64_t epoch) {
    return guarded([&] {
        if (!eng) throw Fail(DGR_E_ENGINE, "dgr_session_open: NULL engine");
        std::lock_guard<std::mutex> g(eng->mu);
        const std::string sid = str(session_id);
        if (eng->sessions.count({sid, epoch})) {
            throw Fail(DGR_E_ENGINE, "session " + sid + " epoch " + std::to_string(epoch) + " is already open");
        }
        if (int64_t(eng->sessions.size()) >= eng->spec.sessions) {
            throw Fail(DGR_E_ENGINE, "all " + std::to_string(eng->spec.sessions) + " sessions are in use; close one first");
        }
        Session s;
        s.sums.assign(size_t(eng->end - eng->begin), std::vector<double>(size_t(eng->d), 0.0));
        s.inputs.assign(size_t(eng->end - eng->begin), std::vector<float>());
        eng->sessions.emplace(std::make_pair(sid, epoch), std::move(s));
        return DGR_OK;
    });
}

DGR_API int32_t dgr_session_close(dgr_engine * eng, const char * session_id, int64_t epoch) {
    return guarded([&] {
        if (!eng) throw Fail(DGR_E_ENGINE, "dgr_session_close: NULL engine");
        std::lock_guard<std::mutex> g(eng->mu);
        eng->sessions.erase({str(session_id), epoch});
        return DGR_OK;
    });
}

DGR_API int32_t dgr_session_n_cached(dgr_engine * eng, const char * session_id, int64_t epoch, int32_t * out) {
    return guarded([&] {
        if (!eng || !out) throw Fail(DGR_E_ENGINE, "dgr_session_n_cached: NULL argument");
        std::lock_guard<std::mutex> g(eng->mu);
        *out = eng->session(str(session_id), epoch).n;
        return DGR_OK;
    });
}

DGR_API int32_t dgr_engine_can_truncate(dgr_engine * eng) { return eng && !eng->spec.recurrent ? 1 : 0; }

// The sums become those of the first n_keep inputs, added in the order the forward added them: bit for
// bit the cache of the shorter history.
DGR_API int32_t dgr_session_truncate(dgr_engine * eng, const char * session_id, int64_t epoch, int32_t n_keep) {
    return guarded([&] {
        if (!eng) throw Fail(DGR_E_ENGINE, "dgr_session_truncate: NULL engine");
        std::lock_guard<std::mutex> g(eng->mu);
        const std::string sid = str(session_id);
        Session & s = eng->session(sid, epoch);
        if (n_keep < 0 || n_keep > s.n) {
            throw Fail(DGR_E_ENGINE, "session " + sid + " epoch " + std::to_string(epoch) + " holds " + std::to_string(s.n) +
                                         " positions: cannot keep " + std::to_string(n_keep));
        }
        if (n_keep == s.n) return DGR_OK;
        if (eng->spec.recurrent) {
            throw Fail(DGR_E_UNSUPPORTED, "fake recurrent model: its state cannot drop positions (only the latest state "
                                          "is kept), so speculative decoding is not possible; generate without --speculate");
        }
        const size_t d = size_t(eng->d);
        for (size_t li = 0; li < s.sums.size(); ++li) {
            s.inputs[li].resize(size_t(n_keep) * d);
            std::vector<double> sum(d, 0.0);
            for (int32_t p = 0; p < n_keep; ++p) {
                const float * h = s.inputs[li].data() + size_t(p) * d;
                for (size_t j = 0; j < d; ++j) sum[j] += double(h[j]);
            }
            s.sums[li] = std::move(sum);
        }
        s.n = n_keep;
        return DGR_OK;
    });
}

// Every step is checked (and the memory it needs reserved) before any cache changes: all or nothing.
DGR_API int32_t dgr_forward(dgr_engine * eng, int32_t n_steps, const dgr_step * steps, dgr_step_out * outs) {
    return guarded([&] {
        if (!eng) throw Fail(DGR_E_ENGINE, "dgr_forward: NULL engine");
        if (n_steps <= 0 || !steps || !outs) throw Fail(DGR_E_ENGINE, "forward needs at least one step");
        std::lock_guard<std::mutex> g(eng->mu);
        const int64_t d = eng->d, V = eng->spec.vocab;
        const std::string where = eng->where();
        std::vector<Session *> sess(static_cast<size_t>(n_steps));
        for (int32_t k = 0; k < n_steps; ++k) {
            const dgr_step & st = steps[k];
            const std::string sid = str(st.session_id);
            for (int32_t j = 0; j < k; ++j) {
                if (str(steps[j].session_id) == sid && steps[j].epoch == st.epoch) {
                    throw Fail(DGR_E_ENGINE, "one batch holds at most one step per session");
                }
            }
            Session & s = eng->session(sid, st.epoch);
            const int32_t n = st.n_tokens;
            if (n <= 0 || !st.positions) throw Fail(DGR_E_ENGINE, "a step needs at least one position");
            const int32_t p0 = st.positions[0];
            if (p0 != s.n) {
                g_miss_held = s.n;
                g_miss_expected = p0;
                throw Fail(DGR_E_CACHE_MISS, "session " + sid + " epoch " + std::to_string(st.epoch) + " holds " +
                                                 std::to_string(s.n) + " positions on " + where + " but the step starts at " +
                                                 std::to_string(p0) + ": re-prefill at a new epoch");
            }
            for (int32_t t = 1; t < n; ++t) {
                if (st.positions[t] != p0 + t) throw Fail(DGR_E_ENGINE, "positions must be contiguous and increasing");
            }
            if (int64_t(p0) + n - 1 >= eng->spec.ctx) {
                throw Fail(DGR_E_ENGINE, "position " + std::to_string(int64_t(p0) + n - 1) + " is beyond the context of " +
                                             std::to_string(eng->spec.ctx));
            }
            if ((eng->first || eng->needs_ids) && !st.token_ids) {
                throw Fail(DGR_E_SCHEMA, where + " need " + std::to_string(n) + " token ids with the step (got None)");
            }
            if (st.token_ids) {
                for (int32_t t = 0; t < n; ++t) {
                    if (st.token_ids[t] < 0 || st.token_ids[t] >= V) {
                        throw Fail(DGR_E_ENGINE, "token id out of range [0, " + std::to_string(V) + ")");
                    }
                }
            }
            if (!eng->first && (!st.boundary || st.boundary_width != d)) {
                std::string got = !st.boundary ? "None" : "float32[" + std::to_string(n) + " x " + std::to_string(st.boundary_width) + "]";
                throw Fail(DGR_E_SCHEMA, where + " take a float32 boundary [" + std::to_string(n) + ", " +
                                             std::to_string(eng->spec.streams) + ", " + std::to_string(eng->spec.embd) +
                                             "], got " + got);
            }
            if (st.want_logits < DGR_LOGITS_NONE || st.want_logits > DGR_LOGITS_ALL) {
                throw Fail(DGR_E_ENGINE, "want_logits must be 0 (none), 1 (last) or 2 (all), got " + std::to_string(st.want_logits));
            }
            if (eng->last ? (st.want_logits != DGR_LOGITS_NONE && !outs[k].logits) : !outs[k].boundary) {
                throw Fail(DGR_E_ENGINE, std::string("step ") + std::to_string(k) + ": no output buffer for its " +
                                             (eng->last ? "logits" : "boundary"));
            }
            for (auto & in : s.inputs) in.reserve(in.size() + size_t(n) * size_t(d));
            sess[size_t(k)] = &s;
        }
        for (int32_t k = 0; k < n_steps; ++k) {
            const dgr_step & st = steps[k];
            dgr_step_out & o = outs[k];
            Session & s = *sess[size_t(k)];
            const int32_t n = st.n_tokens;
            std::vector<float> x(size_t(n) * size_t(d));
            for (int32_t t = 0; t < n; ++t) {
                float * h = x.data() + size_t(t) * size_t(d);
                if (eng->first) std::copy_n(eng->embed.data() + int64_t(st.token_ids[t]) * d, d, h);
                else std::copy_n(st.boundary + size_t(t) * size_t(d), d, h);
                eng->token(s, h, s.n + t, st.token_ids ? st.token_ids[t] : -1);
            }
            s.n += n;
            o.n_cached = s.n;
            o.n_logit_rows = 0;
            o.next_token = -1;
            if (!eng->last) {
                std::copy(x.begin(), x.end(), o.boundary);
                continue;
            }
            std::vector<float> row(static_cast<size_t>(V));
            const int32_t first_row = st.want_logits == DGR_LOGITS_ALL ? 0 : n - 1;
            if (st.want_logits != DGR_LOGITS_NONE) {
                for (int32_t t = first_row; t < n; ++t) eng->logits(x.data() + size_t(t) * size_t(d), o.logits + size_t(t - first_row) * size_t(V));
                o.n_logit_rows = n - first_row;
                std::copy_n(o.logits + size_t(n - 1 - first_row) * size_t(V), V, row.data());
            } else {
                eng->logits(x.data() + size_t(n - 1) * size_t(d), row.data());
            }
            o.next_token = int32_t(std::max_element(row.begin(), row.end()) - row.begin());
        }
        return DGR_OK;
    });
}

DGR_API int32_t dgr_vocab_read(const char * path, dgr_vocab_info * out, int32_t * eog, int32_t eog_cap) {
    return guarded([&] {
        if (!path || !out) throw Fail(DGR_E_ENGINE, "dgr_vocab_read: NULL argument");
        vocab_info(parse(path, true), out, eog, eog_cap);
        return DGR_OK;
    });
}

DGR_API int32_t dgr_engine_vocab(dgr_engine * eng, dgr_vocab_info * out, int32_t * eog, int32_t eog_cap) {
    return guarded([&] {
        if (!eng || !out) throw Fail(DGR_E_ENGINE, "dgr_engine_vocab: NULL argument");
        vocab_info(eng->spec, out, eog, eog_cap);
        return DGR_OK;
    });
}

DGR_API int32_t dgr_tokenize(dgr_engine * eng, const char * text, int32_t add_special, int32_t * out, int32_t cap) {
    int32_t n = -1;
    guarded([&] {
        if (!eng || !text) throw Fail(DGR_E_ENGINE, "dgr_tokenize: NULL argument");
        std::vector<int32_t> ids;
        if (add_special) ids.push_back(BOS);
        for (const char * p = text; *p; ++p) ids.push_back(BYTE0 + int32_t(uint8_t(*p)));
        for (size_t i = 0; i < ids.size() && out && int64_t(i) < cap; ++i) out[i] = ids[i];
        n = int32_t(ids.size());
        return DGR_OK;
    });
    return n;
}

DGR_API int32_t dgr_detokenize(dgr_engine * eng, const int32_t * ids, int32_t n, char * out, int32_t cap) {
    int32_t len = -1;
    guarded([&] {
        if (!eng || (n > 0 && !ids)) throw Fail(DGR_E_ENGINE, "dgr_detokenize: NULL argument");
        std::string bytes;
        for (int32_t i = 0; i < n; ++i) {
            if (BYTE0 <= ids[i] && ids[i] < BYTE0 + 256) bytes.push_back(char(ids[i] - BYTE0));
        }
        if (out && cap > 0) std::memcpy(out, bytes.data(), std::min<size_t>(bytes.size(), size_t(cap)));
        len = int32_t(bytes.size());
        return DGR_OK;
    });
    return len;
}

}  // extern "C"

// ------------------------------------------------------------------ ggml's wire-dtype converters
//
// The six converters dgr-worker resolves from an engine library (worker/server/engine_lib.cpp) for the lossy
// wire dtypes, under ggml's own names, equal bit for bit to what a real engine library exports (ggml.c's
// ggml_*_row and ggml-quants.c's q8_0 reference of the pinned llama.cpp): here in plain C++, since the fake
// links nothing of ggml. tests/test_fake_engine_cpp.py compares them with the real library's.
//
//   f16:  ggml_compute_fp32_to_fp16 / _fp16_to_fp32 (ggml-impl.h, after Maratyszcza's FP16): round to nearest
//         even in IEEE arithmetic, subnormals kept, overflow an infinity; a NaN becomes sign|0x7E00 (its payload
//         dropped), and widening quiets a signalling NaN (the multiply does).
//   bf16: ggml_compute_fp32_to_bf16: round to nearest even on the bits, a NaN kept with its payload and quieted.
//   q8_0: quantize_row_q8_0_ref: per block of 32, amax by `amax > |x| ? amax : |x|` in order (a NaN resets it,
//         as ggml's MAX), d = amax / 127, id = d ? 1 / d : 0, the scale stored as f16, q = (int8) roundf(x * id).
//         ggml leaves that last cast undefined out of int8's range (NaN or infinity: a NaN block, or a block
//         whose d is subnormal so that 1 / d overflows); a real library built for x86 truncates to int32 as
//         cvttss2si does (out of range: INT32_MIN) and keeps the low byte, and so does this one, everywhere.
namespace {

inline uint32_t f32_bits(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    return u;
}

inline float f32_from(uint32_t u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

inline float fp16_to_fp32(uint16_t h) {
    const uint32_t w = uint32_t(h) << 16;
    const uint32_t sign = w & UINT32_C(0x80000000);
    const uint32_t two_w = w + w;
    const uint32_t exp_offset = UINT32_C(0xE0) << 23;
    const float exp_scale = 0x1.0p-112f;
    const float normalized = f32_from((two_w >> 4) + exp_offset) * exp_scale;
    const uint32_t magic_mask = UINT32_C(126) << 23;
    const float magic_bias = 0.5f;
    const float denormalized = f32_from((two_w >> 17) | magic_mask) - magic_bias;
    const uint32_t denormalized_cutoff = UINT32_C(1) << 27;
    return f32_from(sign | (two_w < denormalized_cutoff ? f32_bits(denormalized) : f32_bits(normalized)));
}

inline uint16_t fp32_to_fp16(float f) {
    const float scale_to_inf = 0x1.0p+112f;
    const float scale_to_zero = 0x1.0p-110f;
    float base = (std::fabs(f) * scale_to_inf) * scale_to_zero;
    const uint32_t w = f32_bits(f);
    const uint32_t shl1_w = w + w;
    const uint32_t sign = w & UINT32_C(0x80000000);
    uint32_t bias = shl1_w & UINT32_C(0xFF000000);
    if (bias < UINT32_C(0x71000000)) bias = UINT32_C(0x71000000);
    base = f32_from((bias >> 1) + UINT32_C(0x07800000)) + base;
    const uint32_t bits = f32_bits(base);
    const uint32_t exp_bits = (bits >> 13) & UINT32_C(0x00007C00);
    const uint32_t mantissa_bits = bits & UINT32_C(0x00000FFF);
    const uint32_t nonsign = exp_bits + mantissa_bits;
    return uint16_t((sign >> 16) | (shl1_w > UINT32_C(0xFF000000) ? UINT16_C(0x7E00) : nonsign));
}

inline uint16_t fp32_to_bf16(float f) {
    const uint32_t u = f32_bits(f);
    if ((u & UINT32_C(0x7fffffff)) > UINT32_C(0x7f800000)) return uint16_t((u >> 16) | 64);   // NaN: quiet
    return uint16_t((u + (UINT32_C(0x7fff) + ((u >> 16) & 1))) >> 16);
}

// (int8_t) of a float as x86's cvttss2si then a byte store: truncate toward zero to int32, INT32_MIN for a
// NaN or anything out of int32's range, keep the low byte.
inline int8_t x86_int8(float r) {
    const int32_t i = (r >= -2147483648.0f && r < 2147483648.0f) ? int32_t(r) : INT32_MIN;
    return int8_t(uint8_t(uint32_t(i) & 0xFFu));
}

constexpr int QK8_0 = 32;
struct BlockQ8_0 {
    uint16_t d;
    int8_t qs[QK8_0];
};
static_assert(sizeof(BlockQ8_0) == 34, "q8_0 block: an f16 scale, then 32 int8");

}  // namespace

extern "C" {

DGR_API void ggml_fp16_to_fp32_row(const uint16_t * x, float * y, int64_t n) {
    for (int64_t i = 0; i < n; ++i) y[i] = fp16_to_fp32(x[i]);
}

DGR_API void ggml_fp32_to_fp16_row(const float * x, uint16_t * y, int64_t n) {
    for (int64_t i = 0; i < n; ++i) y[i] = fp32_to_fp16(x[i]);
}

DGR_API void ggml_bf16_to_fp32_row(const uint16_t * x, float * y, int64_t n) {
    for (int64_t i = 0; i < n; ++i) y[i] = f32_from(uint32_t(x[i]) << 16);
}

DGR_API void ggml_fp32_to_bf16_row_ref(const float * x, uint16_t * y, int64_t n) {
    for (int64_t i = 0; i < n; ++i) y[i] = fp32_to_bf16(x[i]);
}

DGR_API void quantize_row_q8_0_ref(const float * x, void * vy, int64_t k) {
    BlockQ8_0 * y = static_cast<BlockQ8_0 *>(vy);
    const int64_t nb = k / QK8_0;
    for (int64_t i = 0; i < nb; ++i) {
        float amax = 0.0f;
        for (int j = 0; j < QK8_0; ++j) {
            const float a = std::fabs(x[i * QK8_0 + j]);
            amax = amax > a ? amax : a;
        }
        const float d = amax / ((1 << 7) - 1);
        const float id = d != 0.0f ? 1.0f / d : 0.0f;     // NaN is not 0: ggml's `d ? ... : 0`
        y[i].d = fp32_to_fp16(d);
        for (int j = 0; j < QK8_0; ++j) y[i].qs[j] = x86_int8(std::round(x[i * QK8_0 + j] * id));
    }
}

DGR_API void dequantize_row_q8_0(const void * vx, float * y, int64_t k) {
    const BlockQ8_0 * x = static_cast<const BlockQ8_0 *>(vx);
    const int64_t nb = k / QK8_0;
    for (int64_t i = 0; i < nb; ++i) {
        const float d = fp16_to_fp32(x[i].d);
        for (int j = 0; j < QK8_0; ++j) y[i * QK8_0 + j] = float(x[i].qs[j]) * d;
    }
}

}  // extern "C"
