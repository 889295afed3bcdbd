// The ShardEngine: the C ABI of dgr_engine.h over (patched) llama.cpp, one job per file:
//   dgr_engine.cpp           the error state every call reports through, llama.cpp's log and backend, the
//                            version, lane, hooks and struct-size answers, what dgr_engine_internal.h shares
//   dgr_engine_open.cpp      a stage file checked against its keys, opened and described
//   dgr_engine_session.cpp   sessions: open, close, cached positions, truncate, their saved state
//   dgr_engine_forward.cpp   one llama_decode for the steps of several sessions
//   dgr_engine_vocab.cpp     the vocabulary: end-of-generation ids, tokenize, detokenize
//   dgr_engine_quantize.cpp  llama.cpp's own quantizer
//   dgr_engine_memory.cpp    the memory report
// Loading, sessions and forward use only llama.cpp's public API (llama.h, gguf.h), so the same files
// also build over the unpatched tree (DGR_WITH_HOOKS=0), which is how the patched library is checked
// to compute the whole model byte-identically. One exception, dgr_engine_memory.cpp: the memory
// report reads two internal headers of the same tree (llama-ext.h, llama-model.h), because the pinned
// public API has no per-buffer breakdown of weights, KV cache and compute, nor which device holds the
// weights. Each build reads them from its own tree (the patches leave both files as they are; only
// llama_hparams, which llama-model.h includes, gains the range), and the report only reads: nothing
// computed depends on it.
#include "dgr_engine.h"
#include "dgr_engine_internal.h"

#include "ggml.h"
#include "llama.h"

#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>

namespace {

// llama.cpp's own error lines (e.g. why a load failed), kept to explain a null return
std::mutex  g_log_mutex;
std::string g_log_errors;

void log_cb(ggml_log_level level, const char * text, void *) {
    static const bool verbose = getenv("DGR_ENGINE_VERBOSE") != nullptr;
    if (level == GGML_LOG_LEVEL_ERROR) {
        std::lock_guard<std::mutex> lock(g_log_mutex);
        g_log_errors += text;
        if (g_log_errors.size() > 4096) {
            g_log_errors.erase(0, g_log_errors.size() - 4096);
        }
    }
    if (verbose || level == GGML_LOG_LEVEL_ERROR) {
        fputs(text, stderr);
    }
}

}  // namespace

namespace dgr_engine_detail {

thread_local std::string g_last_error;
thread_local int64_t     g_miss_held     = 0;
thread_local int64_t     g_miss_expected = 0;

std::string fmt(const char * f, ...) {
    va_list ap;
    va_start(ap, f);
    char buf[1024];
    vsnprintf(buf, sizeof(buf), f, ap);
    va_end(ap);
    return buf;
}

std::string take_log_errors() {
    std::lock_guard<std::mutex> lock(g_log_mutex);
    std::string s;
    s.swap(g_log_errors);
    while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) {
        s.pop_back();
    }
    return s;
}

void init_backend_once() {
    static std::once_flag once;
    std::call_once(once, [] {
        llama_log_set(log_cb, nullptr);
        llama_backend_init();
    });
}

}  // namespace dgr_engine_detail

using namespace dgr_engine_detail;

extern "C" {

int32_t dgr_abi_version(void) { return DGR_ABI_VERSION; }

// The lane is a build setting (Bazel: toolchains/lanes.bzl; CMake: -DDGR_LANE=, dgr build-engine):
// a worker advertises the lane of the engine it really loaded.
#ifndef DGR_LANE
#define DGR_LANE cpu
#endif
#define DGR_STR2(x) #x
#define DGR_STR(x) DGR_STR2(x)
const char * dgr_engine_lane(void) { return DGR_STR(DGR_LANE); }
int32_t dgr_has_hooks(void)   { return DGR_WITH_HOOKS ? 1 : 0; }

const char * dgr_last_error(void) { return g_last_error.c_str(); }

void dgr_last_cache_miss(int64_t * held, int64_t * expected) {
    if (held)     *held     = g_miss_held;
    if (expected) *expected = g_miss_expected;
}

int32_t dgr_abi_struct_size(const char * name) {
    if (!name) return -1;
#define DGR_STRUCT_SIZE(s) if (strcmp(name, #s) == 0) return (int32_t) sizeof(s);
    DGR_ABI_STRUCTS(DGR_STRUCT_SIZE)
#undef DGR_STRUCT_SIZE
    return -1;
}

} // extern "C"

// ------------------------------------------------------------------ shared with the engine's other files

int32_t dgr_engine_guarded(const std::function<void()> & f) { return guarded(f); }

const llama_vocab * dgr_engine_llama_vocab(dgr_engine * eng) {
    return eng && eng->info.has_vocab ? eng->vocab : nullptr;
}

std::string dgr_engine_take_log_errors() { return take_log_errors(); }
