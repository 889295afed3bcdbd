// A stage's sessions (one llama.cpp sequence each): open, close, cached positions, dropping rejected
// drafts (truncate), and a session's cached state saved and restored (the prefix cache).
#include "dgr_engine.h"
#include "dgr_engine_internal.h"

#include "llama.h"

#include <algorithm>
#include <mutex>
#include <string>
#include <utility>

using namespace dgr_engine_detail;

extern "C" {

int32_t dgr_session_open(dgr_engine * eng, const char * sid, int64_t epoch) {
    return guarded([&] {
        if (!eng || !sid) throw dgr_exc(DGR_E_ENGINE, "session_open: null argument");
        std::lock_guard<std::mutex> lock(eng->mu);
        const auto key = std::make_pair(std::string(sid), epoch);
        if (eng->sessions.count(key)) {
            throw dgr_exc(DGR_E_ENGINE, fmt("session '%s' epoch %lld is already open", sid, (long long) epoch));
        }
        // a newer epoch of the same session replaces older ones (their caches are stale)
        llama_memory_t mem = llama_get_memory(eng->ctx);
        for (auto it = eng->sessions.begin(); it != eng->sessions.end();) {
            if (it->first.first == sid) {
                if (it->first.second > epoch) {
                    throw dgr_exc(DGR_E_ENGINE, fmt("session '%s' is already at epoch %lld > %lld",
                            sid, (long long) it->first.second, (long long) epoch));
                }
                llama_memory_seq_rm(mem, it->second.seq, -1, -1);
                mtp_forget(eng, it->second);
                eng->free_seqs.push_back(it->second.seq);
                it = eng->sessions.erase(it);
            } else {
                ++it;
            }
        }
        if (eng->free_seqs.empty()) {
            throw dgr_exc(DGR_E_ENGINE, fmt("all %d sessions are in use; close one first (or open the engine with more max_sessions)",
                    eng->info.max_sessions));
        }
        // the lowest free sequence: llama.cpp puts only consecutive streams into one ubatch, so compact
        // ids let more sessions share a forward
        session s;
        auto lowest = std::min_element(eng->free_seqs.begin(), eng->free_seqs.end());
        s.seq = *lowest;
        eng->free_seqs.erase(lowest);
        llama_memory_seq_rm(mem, s.seq, -1, -1);
        mtp_forget(eng, s);
        eng->sessions[key] = s;
    });
}

int32_t dgr_session_close(dgr_engine * eng, const char * sid, int64_t epoch) {
    return guarded([&] {
        if (!eng || !sid) throw dgr_exc(DGR_E_ENGINE, "session_close: null argument");
        std::lock_guard<std::mutex> lock(eng->mu);
        auto it = eng->sessions.find(std::make_pair(std::string(sid), epoch));
        if (it == eng->sessions.end()) {
            throw dgr_exc(DGR_E_ENGINE, fmt("session '%s' epoch %lld is not open", sid, (long long) epoch));
        }
        llama_memory_seq_rm(llama_get_memory(eng->ctx), it->second.seq, -1, -1);
        mtp_forget(eng, it->second);
        eng->free_seqs.push_back(it->second.seq);
        eng->sessions.erase(it);
    });
}

int32_t dgr_session_n_cached(dgr_engine * eng, const char * sid, int64_t epoch, int32_t * out) {
    return guarded([&] {
        if (!eng || !sid || !out) throw dgr_exc(DGR_E_ENGINE, "session_n_cached: null argument");
        std::lock_guard<std::mutex> lock(eng->mu);
        auto it = eng->sessions.find(std::make_pair(std::string(sid), epoch));
        if (it == eng->sessions.end()) {
            throw dgr_exc(DGR_E_ENGINE, fmt("session '%s' epoch %lld is not open", sid, (long long) epoch));
        }
        *out = it->second.n_cached;
    });
}

// A saved state keeps every cell of the sequence, sliding-window ones too (patch 0025): a restore lays them out
// as the run that computed them had them and can drop later positions. An engine over pristine llama.cpp (the
// reference build, tests/engine/test_engine_reference.py) saves what llama.cpp saves.
#ifdef LLAMA_STATE_SEQ_FLAGS_ALL_CELLS
static constexpr llama_state_seq_flags DGR_STATE_FLAGS = LLAMA_STATE_SEQ_FLAGS_ALL_CELLS;
#else
static constexpr llama_state_seq_flags DGR_STATE_FLAGS = 0;
#endif

// A recurrent or hybrid model keeps one running state per sequence, not one cell per position: a
// partial range of it cannot be dropped, so speculation (which rolls back rejected drafts) is refused.
static bool can_truncate(const dgr_engine * eng) {
    return !(llama_model_is_recurrent(eng->model) || llama_model_is_hybrid(eng->model));
}

// A recurrent or hybrid cache opened with snapshots (n_draft_max > 0: llama.cpp's n_rs_seq, e.g. V4) can
// roll back the rows of its last step (the limits are checked in dgr_session_truncate).
static bool rolls_back(const dgr_engine * eng) {
    return eng->n_rs_seq > 0;
}

int32_t dgr_engine_can_truncate(dgr_engine * eng) {
    return eng && eng->model && (can_truncate(eng) || rolls_back(eng)) ? 1 : 0;
}

int32_t dgr_session_truncate(dgr_engine * eng, const char * sid, int64_t epoch, int32_t n_keep) {
    return guarded([&] {
        if (!eng || !sid) throw dgr_exc(DGR_E_ENGINE, "session_truncate: null argument");
        std::lock_guard<std::mutex> lock(eng->mu);
        auto it = eng->sessions.find(std::make_pair(std::string(sid), epoch));
        if (it == eng->sessions.end()) {
            throw dgr_exc(DGR_E_ENGINE, fmt("session '%s' epoch %lld is not open", sid, (long long) epoch));
        }
        session & s = it->second;
        if (n_keep < 0 || n_keep > s.n_cached) {
            throw dgr_exc(DGR_E_ENGINE, fmt("session '%s' holds positions [0, %d): cannot keep %d of them",
                    sid, s.n_cached, n_keep));
        }
        if (n_keep == s.n_cached) {
            return;
        }
        if (!can_truncate(eng) && !rolls_back(eng)) {
            throw dgr_exc(DGR_E_UNSUPPORTED, fmt("%s is a recurrent or hybrid model: its state cannot drop positions "
                    "[%d, %d) (only the latest state is kept), so speculative decoding is not possible; generate "
                    "without --speculate", eng->info.arch, n_keep, s.n_cached));
        }
        if (rolls_back(eng)) {
            // a snapshot cache (V4) restores only rows of the session's last step, at most n_rs_seq of them,
            // once; llama.cpp's seq_rm says yes to deeper rollbacks and computes wrong results after them
            // (docs/deepseek4.md 4.1), so they are refused here, as a cache miss: re-prefill at a new epoch
            const int32_t back = s.n_cached - n_keep;
            const char * why = s.rolled_back ? "it was already rolled back since its last step"
                : back > eng->n_rs_seq ? "that is more than the n_draft_max positions this stage can roll back"
                : n_keep < s.step_pos0 ? "that reaches before its last step" : nullptr;
            if (why) {
                g_miss_held = s.n_cached;
                g_miss_expected = n_keep;
                throw dgr_exc(DGR_E_CACHE_MISS, fmt("session '%s' epoch %lld cannot drop positions [%d, %d): %s (n_draft_max "
                        "= %d, last step at [%d, %d)); re-prefill at a new epoch", sid, (long long) epoch, n_keep, s.n_cached,
                        why, eng->n_rs_seq, s.step_pos0, s.step_pos0 + s.step_rows));
            }
        }
        if (!llama_memory_seq_rm(llama_get_memory(eng->ctx), s.seq, n_keep, -1)) {
            throw dgr_exc(DGR_E_UNSUPPORTED, fmt("llama.cpp refused to drop positions [%d, %d) of session '%s'",
                    n_keep, s.n_cached, sid));
        }
        s.n_cached = n_keep;
        s.rolled_back = true;
        if (eng->mtp) {
            mtp_truncate(eng, s, n_keep);
        }
    });
}

int32_t dgr_session_state_get(dgr_engine * eng, const char * sid, int64_t epoch, void * buf, uint64_t cap,
                              uint64_t * size, int32_t * n_positions) {
    return guarded([&] {
        if (!eng || !sid || !size || !n_positions) throw dgr_exc(DGR_E_ENGINE, "session_state_get: null argument");
        std::lock_guard<std::mutex> lock(eng->mu);
        auto it = eng->sessions.find(std::make_pair(std::string(sid), epoch));
        if (it == eng->sessions.end()) {
            throw dgr_exc(DGR_E_ENGINE, fmt("session '%s' epoch %lld is not open", sid, (long long) epoch));
        }
        *n_positions = it->second.n_cached;
        *size = llama_state_seq_get_size_ext(eng->ctx, it->second.seq, DGR_STATE_FLAGS);
        if (buf && cap >= *size) {
            const size_t n = llama_state_seq_get_data_ext(eng->ctx, static_cast<uint8_t *>(buf), (size_t) cap,
                                                          it->second.seq, DGR_STATE_FLAGS);
            if (n != *size) throw dgr_exc(DGR_E_ENGINE, fmt("llama.cpp wrote %zu bytes of a %llu-byte session state", n,
                                                            (unsigned long long) *size));
        }
    });
}

int32_t dgr_session_state_set(dgr_engine * eng, const char * sid, int64_t epoch, const void * buf, uint64_t size,
                              int32_t n_positions, int32_t n_keep) {
    return guarded([&] {
        if (!eng || !sid || !buf) throw dgr_exc(DGR_E_ENGINE, "session_state_set: null argument");
        std::lock_guard<std::mutex> lock(eng->mu);
        auto it = eng->sessions.find(std::make_pair(std::string(sid), epoch));
        if (it == eng->sessions.end()) {
            throw dgr_exc(DGR_E_ENGINE, fmt("session '%s' epoch %lld is not open", sid, (long long) epoch));
        }
        session & s = it->second;
        if (s.n_cached != 0) throw dgr_exc(DGR_E_ENGINE, fmt("session '%s' already holds %d positions", sid, s.n_cached));
        if (n_keep < 0 || n_keep > n_positions) {
            throw dgr_exc(DGR_E_ENGINE, fmt("cannot keep %d positions of a state of %d", n_keep, n_positions));
        }
        if (!can_truncate(eng)) {
            throw dgr_exc(DGR_E_UNSUPPORTED, fmt("%s is a recurrent or hybrid model: a prefix of its state cannot be kept",
                                                 eng->info.arch));
        }
        if (eng->mtp) {
            // the saved state is the main context's alone: the MTP context would lack those positions
            throw dgr_exc(DGR_E_UNSUPPORTED, fmt("%s: an MTP stage cannot restore a saved session state (its MTP "
                    "context's cache is not in it); re-prefill", eng->path.c_str()));
        }
        llama_memory_t mem = llama_get_memory(eng->ctx);
        if (llama_state_seq_set_data_ext(eng->ctx, static_cast<const uint8_t *>(buf), (size_t) size, s.seq,
                                         DGR_STATE_FLAGS) == 0) {
            llama_memory_seq_rm(mem, s.seq, -1, -1);
            throw dgr_exc(DGR_E_ENGINE, "llama.cpp could not load the saved session state (another engine's, or no room)");
        }
        if (n_keep < n_positions && !llama_memory_seq_rm(mem, s.seq, n_keep, -1)) {
            llama_memory_seq_rm(mem, s.seq, -1, -1);
            throw dgr_exc(DGR_E_UNSUPPORTED, fmt("llama.cpp refused to drop positions [%d, %d)", n_keep, n_positions));
        }
        s.n_cached = n_keep;
        s.step_pos0 = n_keep;   // no step to roll back into (a snapshot cache: docs/deepseek4.md 4.1)
        s.step_rows = 0;
    });
}

} // extern "C"
