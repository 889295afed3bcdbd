// What the engine's own source files share beyond the C ABI. Not installed, not part of the ABI.
// dgr_grammar.cpp uses the first part (dgr_engine.cpp defines it); the files of the ABI itself
// (dgr_engine.cpp and dgr_engine_*.cpp, one job each) share the engine and its error state below.
#pragma once

#include "dgr_contract.h"
#include "dgr_engine.h"

#include "llama.h"

#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#ifndef DGR_WITH_HOOKS
#define DGR_WITH_HOOKS 1
#endif

struct dgr_engine;
struct llama_vocab;

// A refusal with its dgr_status code; dgr_engine_guarded turns it into the status and dgr_last_error().
struct dgr_engine_error : std::runtime_error {
    int32_t code;
    dgr_engine_error(int32_t code_, const std::string & msg) : std::runtime_error(msg), code(code_) {}
};

// Runs f; no exception escapes: DGR_OK, or the error's code (DGR_E_ENGINE for any other exception).
int32_t dgr_engine_guarded(const std::function<void()> & f);

// The open engine's vocabulary, or null when its stage has none.
const llama_vocab * dgr_engine_llama_vocab(dgr_engine * eng);

// llama.cpp's error lines logged since the last call (why a parser or loader refused), emptied.
std::string dgr_engine_take_log_errors();

// ------------------------------------------------------------------ the ABI's files (dgr_engine*.cpp)

namespace dgr_engine_detail {

using dgr_exc = dgr_engine_error;

// this thread's last error (dgr_last_error) and last cache miss (dgr_last_cache_miss)
extern thread_local std::string g_last_error;
extern thread_local int64_t     g_miss_held;
extern thread_local int64_t     g_miss_expected;

// printf into a std::string (messages are short: 1 KiB at most)
std::string fmt(const char * f, ...);

// llama.cpp's error lines logged since the last call (why a load failed), emptied
std::string take_log_errors();

// llama.cpp's log callback and backend, set up once per process
void init_backend_once();
// dgr_engine_numerics of an engine opened with these switches (dgr_engine_numerics.cpp)
std::string open_numerics(int kernels, bool kv_f32);
// the kernel each weight type of the stage's matrices takes on the CPU (Describe's matmul_kernels): under the
// invariant kernels, which types run a fast kernel and which fall back to the reference vec_dot
std::string open_matmul_kernels(const llama_model & model, int kernels, bool gpu_lane, bool is_last);

// Runs f; no exception escapes: DGR_OK, or the error's code with dgr_last_error() set.
template <typename F>
int32_t guarded(F && f) {
    try {
        f();
        return DGR_OK;
    } catch (const dgr_exc & e) {
        g_last_error = e.what();
        return e.code;
    } catch (const std::exception & e) {
        g_last_error = std::string("engine: ") + e.what();
        return DGR_E_ENGINE;
    } catch (...) {
        g_last_error = "engine: unknown failure";
        return DGR_E_ENGINE;
    }
}

struct session {
    int32_t seq = -1;
    int32_t n_cached = 0;
    // the session's last forward: its first position and rows, and whether a truncate already rolled it
    // back (a snapshot cache restores only rows of the last decode, once: docs/deepseek4.md 4.1)
    int32_t step_pos0 = 0;
    int32_t step_rows = 0;
    bool    rolled_back = false;
    // MTP stage: h (the main graph's residual before the head, n_embd_h floats a row) of positions
    // h_pos0, h_pos0+1, ... up to n_cached-1 at least: the row the next step's first MTP row pairs with, and
    // those a truncate may go back to. Position -1 is zeros.
    std::vector<float> h;
    int32_t h_pos0 = -1;
};

// --- MTP (dgr_engine_mtp.cpp): the MTP context of a dgr.mtp last stage, beside the main one
// Creates eng->mtp from the main context's parameters; turns on the main context's h rows.
void mtp_open(dgr_engine * eng, const llama_context_params & main_params);
// After a main decode: feeds session s's step (its rows start at batch row r0) to the MTP context. Throws.
void mtp_feed(dgr_engine * eng, session & s, const dgr_step & st, int32_t r0);
// Drops all of s's MTP positions and h (session open, close, a failed feed).
void mtp_forget(dgr_engine * eng, session & s);
// Drops s's MTP positions >= n_keep (after the main context's rollback).
void mtp_truncate(dgr_engine * eng, session & s, int32_t n_keep);

}  // namespace dgr_engine_detail

struct dgr_engine {
    std::string path;
    llama_model *   model = nullptr;
    llama_context * ctx   = nullptr;
    const llama_vocab * vocab = nullptr;
    dgr_stage_info info {};
    std::map<std::pair<std::string, int64_t>, dgr_engine_detail::session> sessions;
    std::vector<int32_t> free_seqs;
    std::mutex mu;
    llama_context * mtp = nullptr;  // the MTP context (a dgr.mtp last stage), else null
    int32_t n_embd_h = 0;           // width of h (llama_model_n_embd_out: V4's 4 streams)
    int32_t n_rs_seq = 0;           // the main context's rollback depth (llama_n_rs_seq)
    bool batch_token_ids = false;   // the main batch carries the ids (its graph reads them: the sideband)
    std::string numerics;           // dgr_engine_numerics
    // the CPU backend's compute threads, kept for the engine's life (attach_threadpool), else null
    struct ggml_threadpool * threadpool = nullptr;
    void (*threadpool_free)(struct ggml_threadpool *) = nullptr;

    ~dgr_engine() {
        if (mtp)   llama_free(mtp);
        if (ctx)   llama_free(ctx);
        if (threadpool) threadpool_free(threadpool);  // after the contexts that compute with it
        if (model) llama_model_free(model);
    }

    int32_t width() const { return (int32_t) dgr_boundary_width(info.n_streams, info.n_embd); }
};
