// What the fake engine's files share (worker/fake/*.cpp, one job each): the spec, the engine and its
// sessions, the error state and the guard every C call runs in.
#pragma once

// Every file of the fake includes this first: no fused multiply-add in any of them (fp-contract off here and
// on every build's command line; see the top of dgr_fake_engine.cpp).
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include "dgr_fake_engine.h"

#include "dgr_contract.h"

#include <cstdint>
#include <exception>
#include <map>
#include <mutex>
#include <new>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace dgr_fake {

// this thread's last error (dgr_last_error) and last cache miss (dgr_last_cache_miss)
extern thread_local std::string g_last_error;
extern thread_local int64_t     g_miss_held, g_miss_expected;

constexpr int32_t BOS = 1, EOS = 2, BYTE0 = 3;

// A refusal with its status (becomes the C status and dgr_last_error).
struct Fail : std::runtime_error {
    int32_t status;
    Fail(int32_t st, const std::string & msg) : std::runtime_error(msg), status(st) {}
};

// Sets dgr_last_error; returns `status`.
int32_t fail(int32_t status, const std::string & msg);

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

// FakeModel.from_spec and its checks, plus stage= (when allowed) and the bounds a C engine needs.
Spec parse(const std::string & text, bool allow_stage);

struct Session {
    int32_t n = 0;
    std::vector<std::vector<double>> sums;     // per owned layer: the running sum of its inputs [d]
    std::vector<std::vector<float>>  inputs;   // per owned layer: its input at each position [n * d]
};

// The stage `spec` names (spec.stage < 0: the whole model) with its weights drawn.
dgr_engine * open_engine(const Spec & spec);

inline std::string str(const char * s) { return s ? std::string(s) : std::string(); }

}  // namespace dgr_fake

struct dgr_engine {
    dgr_fake::Spec spec;
    int64_t begin = 0, end = 0, d = 0;
    bool first = false, last = false, needs_ids = false;
    std::vector<float> embed, head, tok;                   // [vocab * d] each, where this stage needs them
    std::vector<std::vector<float>> w, a;                  // per owned layer: [d * d], [d]
    std::map<std::pair<std::string, int64_t>, dgr_fake::Session> sessions;
    std::mutex mu;                                         // one call at a time

    std::string where() const { return "layers [" + std::to_string(begin) + ", " + std::to_string(end) + ")"; }

    dgr_fake::Session & session(const std::string & sid, int64_t epoch) {
        auto it = sessions.find({sid, epoch});
        if (it == sessions.end()) {
            throw dgr_fake::Fail(DGR_E_ENGINE, "no open session " + sid + " epoch " + std::to_string(epoch) + " on " +
                                                   where() + "; open it first");
        }
        return it->second;
    }

    // the head on one row: logits[v] = head_v . (h / max(|h|, 1e-6))
    void logits(const float * h, float * out) const;
    // one token through the owned layers (h in place); `pos` its position, `id` its token (-1: none)
    void token(dgr_fake::Session & s, float * h, int32_t pos, int32_t id);
};
