// dgr-engine-bench: one model's prefill and decode speed through dgr's engine library (its C ABI,
// worker/engine/dgr_engine.h), in C++ as dgr-worker drives it, for `dgr bench kernels` (docs/batching.md).
// It is the dgr side of that benchmark's comparison with llama.cpp's own `llama-batched-bench`, and it
// measures the same things the same way, so that neither side carries a harness the other has not:
//
//   dgr-engine-bench --model MODEL.gguf [--kernels reference|invariant|fast] [--threads 1] [--poll 50]
//                    [--npp 64,256,1024] [--ntg 32] [--n-ubatch 512] [--seed 7]
//
// The engine library is loaded as dgr-worker loads it (worker/server/engine_lib.cpp: $DGR_ENGINE_LIB, else
// libdgr_engine.so beside this program; its ABI version and struct sizes checked).
//
// - prefill: for each --npp length, a new session, one forward of that many tokens (the engine cuts it into
//   --n-ubatch batches), the last position's logits; tokens/s (llama-batched-bench's S_PP, one sequence);
// - decode: after the prompt of the shortest length, in its session, --ntg forwards of one token each, each the
//   greedy token of the one before (the engine's argmax, as a route's last stage gives it); tokens/s (S_TG).
// --poll: the compute threads' polling level (dgr_open_params.poll), by default llama-batched-bench's (50).
// Before measuring, one small forward warms the caches and the thread pool (llama-batched-bench warms up
// too). Prompt tokens are random ids in [100, min(n_vocab, 30000)) from --seed.
// Output: one JSON object on stdout: {"kernels", "threads", "numerics", "load_s", "prefill_tok_s":
// {"64": ...}, "decode_tok_s"}. Errors: a message on stderr, exit 1 (bad flags: 2).
#include "engine_lib.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace {

struct Usage : std::runtime_error {
    using std::runtime_error::runtime_error;
};

struct Options {
    std::string model;
    std::string kernels = "reference";
    int threads = 1;
    int poll = 50;
    std::vector<int> npp = {64, 256, 1024};
    int ntg = 32;
    int n_ubatch = 512;
    unsigned seed = 7;
};

int to_int(const std::string & flag, const std::string & v, int lo) {
    char * end = nullptr;
    long x = std::strtol(v.c_str(), &end, 10);
    if (v.empty() || *end || x < lo || x > (1L << 30)) {
        throw Usage(flag + " wants a whole number >= " + std::to_string(lo) + ", got '" + v + "'");
    }
    return int(x);
}

Options parse(int argc, char ** argv) {
    Options o;
    for (int i = 1; i < argc; ++i) {
        std::string a = argv[i];
        if (a == "-h" || a == "--help") {
            throw Usage("");
        }
        if (i + 1 >= argc) {
            throw Usage(a + " wants a value");
        }
        std::string v = argv[++i];
        if (a == "--model") {
            o.model = v;
        } else if (a == "--kernels") {
            o.kernels = v;
        } else if (a == "--threads") {
            o.threads = to_int(a, v, 1);
        } else if (a == "--poll") {
            o.poll = to_int(a, v, 0);
            if (o.poll > 100) throw Usage("--poll is 0-100, got '" + v + "'");
        } else if (a == "--ntg") {
            o.ntg = to_int(a, v, 1);
        } else if (a == "--n-ubatch") {
            o.n_ubatch = to_int(a, v, 1);
        } else if (a == "--seed") {
            o.seed = unsigned(to_int(a, v, 0));
        } else if (a == "--npp") {
            o.npp.clear();
            for (size_t p = 0; p <= v.size();) {
                size_t q = v.find(',', p);
                if (q == std::string::npos) q = v.size();
                o.npp.push_back(to_int(a, v.substr(p, q - p), 1));
                p = q + 1;
            }
        } else {
            throw Usage("unknown flag " + a);
        }
    }
    if (o.model.empty()) {
        throw Usage("--model MODEL.gguf is required");
    }
    if (o.kernels != "reference" && o.kernels != "invariant" && o.kernels != "fast") {
        throw Usage("--kernels is reference, invariant or fast, got '" + o.kernels + "'");
    }
    return o;
}

int kernel_set(const std::string & k) {
    return k == "fast" ? DGR_KERNELS_FAST : k == "invariant" ? DGR_KERNELS_INVARIANT : DGR_KERNELS_REFERENCE;
}

const dgr::EngineLib * lib = nullptr;

void check(int32_t st, const char * what) {
    if (st != DGR_OK) {
        throw std::runtime_error(std::string(what) + " failed: " + lib->error(st));
    }
}

double now_s() {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

struct Bench {
    dgr_engine * eng;
    int n_vocab;
    std::vector<float> logits;

    // one forward of `ids` at positions [pos, pos + n) of `session`; the greedy token of its last position
    int32_t forward(const char * session, const int32_t * ids, int n, int pos) {
        std::vector<int32_t> positions(n);
        for (int i = 0; i < n; ++i) positions[i] = pos + i;
        dgr_step st{session, 1, n, positions.data(), ids, nullptr, 0, DGR_LOGITS_LAST};
        dgr_step_out out{nullptr, logits.data(), 0, -1, 0};
        check(lib->forward(eng, 1, &st, &out), "dgr_forward");
        return out.next_token;
    }

    // seconds for one prefill of `ids` in a new session, and (ntg > 0) for ntg one-token forwards after it,
    // each the greedy token of the one before: llama-batched-bench's pp then tg in one sequence
    std::pair<double, double> run(const std::vector<int32_t> & ids, int ntg) {
        const char * session = "bench";
        check(lib->session_open(eng, session, 1), "dgr_session_open");
        double t0 = now_s();
        int32_t tok = forward(session, ids.data(), int(ids.size()), 0);
        const double tp = now_s() - t0;
        int pos = int(ids.size());
        t0 = now_s();
        for (int i = 0; i < ntg; ++i, ++pos) {
            tok = forward(session, &tok, 1, pos);
        }
        const double tg = now_s() - t0;
        check(lib->session_close(eng, session, 1), "dgr_session_close");
        return {tp, tg};
    }
};

}  // namespace

int main(int argc, char ** argv) {
    Options o;
    try {
        o = parse(argc, argv);
    } catch (const Usage & e) {
        if (*e.what()) fprintf(stderr, "dgr-engine-bench: %s\n", e.what());
        fprintf(stderr, "usage: %s --model MODEL.gguf [--kernels reference|invariant|fast] [--threads 1] [--poll 50] "
                        "[--npp 64,256,1024] [--ntg 32] [--n-ubatch 512] [--seed 7]\n", argv[0]);
        return *e.what() ? 2 : 0;
    }
    dgr_engine * eng = nullptr;
    try {
        std::string self = argv[0];
        static const dgr::EngineLib loaded = dgr::load_engine_lib(self.substr(0, self.find_last_of('/') + 1));
        lib = &loaded;
        const int longest = *std::max_element(o.npp.begin(), o.npp.end());
        const int shortest = *std::min_element(o.npp.begin(), o.npp.end());
        dgr_open_params p{};
        p.n_ctx = std::max(longest, shortest + o.ntg) + 64;
        p.max_sessions = 1;
        p.n_ubatch = o.n_ubatch;
        p.n_threads = o.threads;
        p.poll = o.poll;
        p.n_gpu_layers = -1;
        p.fast_kernels = kernel_set(o.kernels);
        double t0 = now_s();
        check(lib->open(o.model.c_str(), &p, &eng), "dgr_engine_open");
        const double load_s = now_s() - t0;
        dgr_stage_info info{};
        check(lib->describe(eng, &info), "dgr_engine_describe");
        if (!info.is_first || !info.is_last) {
            throw std::runtime_error(o.model + " is one stage of a split model: give a whole model");
        }
        Bench b{eng, info.n_vocab, std::vector<float>(size_t(info.n_vocab))};

        std::mt19937 rng(o.seed);
        std::uniform_int_distribution<int32_t> pick(100, std::min(info.n_vocab, 30000) - 1);
        std::vector<int32_t> ids(static_cast<size_t>(longest));
        for (auto & t : ids) t = pick(rng);

        b.run(std::vector<int32_t>(ids.begin(), ids.begin() + std::min(longest, 16)), 0);   // warm-up

        std::string pre;
        double td = 0.0;
        bool decoded = false;
        for (int n : o.npp) {
            const bool tg = n == shortest && !decoded;
            auto [tp, t] = b.run(std::vector<int32_t>(ids.begin(), ids.begin() + n), tg ? o.ntg : 0);
            pre += (pre.empty() ? "" : ", ") + ("\"" + std::to_string(n) + "\": ") + std::to_string(n / tp);
            if (tg) td = t, decoded = true;
        }
        std::string numerics = lib->numerics(eng);
        for (char & c : numerics) {
            if (c == '"' || c == '\\' || (unsigned char) c < 0x20) c = ' ';
        }
        printf("{\"kernels\": \"%s\", \"threads\": %d, \"numerics\": \"%s\", \"load_s\": %.3f, "
               "\"prefill_tok_s\": {%s}, \"decode_tok_s\": %.4f}\n",
               o.kernels.c_str(), o.threads, numerics.c_str(), load_s, pre.c_str(), o.ntg / td);
        lib->close(eng);
        return 0;
    } catch (const std::exception & e) {
        fprintf(stderr, "dgr-engine-bench: %s\n", e.what());
        if (eng) lib->close(eng);
        return 1;
    }
}
