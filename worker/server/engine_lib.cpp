#include "engine_lib.h"

#include <dlfcn.h>
#include <limits.h>
#include <stdlib.h>
#include <unistd.h>

#include <stdexcept>

namespace dgr {

std::string EngineLib::error(int32_t status) const {
    const char * e = last_error ? last_error() : nullptr;
    return e && *e ? std::string(e) : "engine status " + std::to_string(status);
}

namespace {

// What a library of another build is refused with: both sides are compiled from one dgr_engine.h.
const char * REBUILD = "rebuild the engine and dgr-worker from one checkout: scripts/setup (or `dgr build-engine`)";

// The structs both sides compile from dgr_engine.h, byte for byte: a header changed on one side only (a field
// added, the version left as it was) would pass misread structs across the ABI.
void check_struct_sizes(const std::string & path, int32_t (*size_of)(const char *)) {
    struct Want {
        const char * name;
        size_t size;
    };
#define DGR_WANT(s) Want{#s, sizeof(s)},
    static const Want wants[] = {DGR_ABI_STRUCTS(DGR_WANT)};
#undef DGR_WANT
    std::string diff;
    for (const Want & w : wants) {
        const int32_t theirs = size_of(w.name);
        if (theirs == int32_t(w.size)) continue;
        diff += (diff.empty() ? "" : "; ") + std::string(w.name) +
                (theirs < 0 ? " is unknown to " + path : " is " + std::to_string(theirs) + " bytes in " + path) + ", " +
                std::to_string(w.size) + " in this dgr-worker";
    }
    if (!diff.empty()) throw std::runtime_error(diff + ": " + REBUILD);
}

// `env` names the library, else `file` beside this executable; `what` says which library in errors.
EngineLib load(const std::string & self_dir, const char * env_name, const char * file, const char * what) {
    const char * env = getenv(env_name);
    std::string path = env && *env ? env : self_dir + "/" + file;
    if (access(path.c_str(), R_OK) != 0) {
        throw std::runtime_error(std::string("no ") + what + " library at " + path +
                                 (env && *env ? std::string(" ($") + env_name + ")" : std::string()) +
                                 ": build it beside dgr-worker (`dgr build-engine --lane cpu`) or set " + env_name +
                                 " to a " + file);
    }
    char real[PATH_MAX];
    if (!realpath(path.c_str(), real)) throw std::runtime_error(path + ": cannot resolve the path");
    void * h = dlopen(real, RTLD_NOW | RTLD_LOCAL);
    if (!h) throw std::runtime_error(std::string("cannot load the ") + what + " library: " + dlerror());
    EngineLib lib{};
    lib.path = real;
    auto sym = [&](auto & fn, const char * name) {
        void * p = dlsym(h, name);
        if (!p) {
            throw std::runtime_error(lib.path + " has no " + name + ": it is older than this dgr-worker; rebuild it "
                                     "(`dgr build-engine --lane cpu`)");
        }
        fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(p);
    };
    sym(lib.abi_version, "dgr_abi_version");
    if (lib.abi_version() != DGR_ABI_VERSION) {
        throw std::runtime_error(lib.path + " speaks engine C ABI " + std::to_string(lib.abi_version()) +
                                 ", this dgr-worker C ABI " + std::to_string(DGR_ABI_VERSION) + ": " + REBUILD);
    }
    int32_t (*struct_size)(const char *) = nullptr;
    sym(struct_size, "dgr_abi_struct_size");
    check_struct_sizes(lib.path, struct_size);
    sym(lib.lane, "dgr_engine_lane");
    sym(lib.numerics, "dgr_engine_numerics");
    sym(lib.last_error, "dgr_last_error");
    sym(lib.open, "dgr_engine_open");
    sym(lib.close, "dgr_engine_close");
    sym(lib.describe, "dgr_engine_describe");
    sym(lib.memory, "dgr_engine_memory");
    sym(lib.session_open, "dgr_session_open");
    sym(lib.session_close, "dgr_session_close");
    sym(lib.can_truncate, "dgr_engine_can_truncate");
    sym(lib.truncate, "dgr_session_truncate");
    sym(lib.vocab, "dgr_engine_vocab");
    sym(lib.tokenize, "dgr_tokenize");
    sym(lib.detokenize, "dgr_detokenize");
    sym(lib.forward, "dgr_forward");
    sym(lib.n_cached, "dgr_session_n_cached");
    sym(lib.last_cache_miss, "dgr_last_cache_miss");
    sym(lib.sample, "dgr_sample");
    auto opt = [&](auto & fn, const char * name) {
        fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(h, name));
    };
    opt(lib.fp16_to_fp32, "ggml_fp16_to_fp32_row");
    opt(lib.fp32_to_fp16, "ggml_fp32_to_fp16_row");
    opt(lib.bf16_to_fp32, "ggml_bf16_to_fp32_row");
    opt(lib.fp32_to_bf16, "ggml_fp32_to_bf16_row_ref");     // the scalar one: round to nearest even, NaN kept
    opt(lib.quantize_q8_0, "quantize_row_q8_0_ref");
    opt(lib.dequantize_q8_0, "dequantize_row_q8_0");
    opt(lib.fake_spec, "dgr_fake_spec");
    opt(lib.logprobs, "dgr_logprobs");
    opt(lib.state_get, "dgr_session_state_get");
    opt(lib.state_set, "dgr_session_state_set");
    opt(lib.mtp_draft, "dgr_mtp_draft");
    opt(lib.grammar_open, "dgr_grammar_open");
    opt(lib.grammar_close, "dgr_grammar_close");
    opt(lib.grammar_apply, "dgr_grammar_apply");
    opt(lib.grammar_accept, "dgr_grammar_accept");
    if (!lib.grammar_open || !lib.grammar_close || !lib.grammar_apply || !lib.grammar_accept) {
        lib.grammar_open = nullptr;                  // all of it or none
    }
    return lib;
}

}  // namespace

EngineLib load_engine_lib(const std::string & self_dir) {
    return load(self_dir, "DGR_ENGINE_LIB", "libdgr_engine.so", "engine");
}

EngineLib load_fake_engine_lib(const std::string & self_dir) {
    EngineLib lib = load(self_dir, "DGR_FAKE_ENGINE_LIB", "libdgr_fake_engine.so", "fake engine");
    if (!lib.fake_spec) {
        throw std::runtime_error(lib.path + " is not the fake engine (it has no dgr_fake_spec): set DGR_FAKE_ENGINE_LIB "
                                 "to a libdgr_fake_engine.so (`dgr build-engine --lane cpu` builds one beside dgr-worker)");
    }
    return lib;
}

}  // namespace dgr
