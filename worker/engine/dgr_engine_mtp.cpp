// MTP on the last stage of an include_mtp bundle (docs/deepseek4.md section 4, "Probed with the pinned
// build" 4.1): the MTP context beside the main one, fed every position the main context computes (token p
// with h of p-1), drafting by chained greedy MTP steps, rolled back with the main context.
//
// Reads llama.cpp's staging header llama-ext.h (llama_set_embeddings_nextn, llama_get_embeddings_nextn_ith):
// the pinned public API has no other way to the main graph's pre-head residual h.
#include "dgr_engine.h"
#include "dgr_engine_internal.h"

#include "llama.h"
#include "llama-ext.h"

#include <algorithm>
#include <cstring>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

using namespace dgr_engine_detail;

namespace dgr_engine_detail {

namespace {

struct batch_ext {
    llama_batch_ext * b;
    explicit batch_ext(llama_context * ctx) : b(llama_batch_ext_init(ctx)) {
        if (!b) throw dgr_exc(DGR_E_ENGINE, "llama.cpp could not make a batch for the MTP context");
    }
    ~batch_ext() { llama_batch_ext_free(b); }

    // one row: token `tok` at `pos`, paired with h (n floats)
    int32_t add(int32_t seq, int32_t tok, int32_t pos, const float * h, int32_t n, bool out) {
        const int32_t idx = llama_batch_ext_add_token(b, seq, tok);
        llama_pos p = pos;
        if (idx < 0 || !llama_batch_ext_set_pos(b, idx, &p) ||
                !llama_batch_ext_set_embd_token(b, idx, { h, 1, (size_t) n }) ||
                !llama_batch_ext_set_output_logits(b, idx, out)) {
            throw dgr_exc(DGR_E_ENGINE, fmt("llama.cpp refused an MTP batch row (position %d, token %d, idx %d)", pos, tok, idx));
        }
        return idx;
    }
};

void decode(dgr_engine * eng, llama_batch_ext * b, const char * what) {
    const int32_t rc = llama_process(eng->mtp, LLAMA_PROCESS_TYPE_DECODE, b);
    if (rc != 0) {
        std::string why = take_log_errors();
        throw dgr_exc(DGR_E_ENGINE, fmt("the MTP context's %s failed (%d)%s", what, rc, why.empty() ? "" : (": " + why).c_str()));
    }
}

// h of position p (p = -1: zeros) from what the session keeps
const float * h_at(const dgr_engine * eng, const session & s, int32_t p, const std::vector<float> & zeros) {
    if (p < 0) return zeros.data();
    if (p < s.h_pos0 || (int64_t) (p - s.h_pos0 + 1) * eng->n_embd_h > (int64_t) s.h.size()) {
        throw dgr_exc(DGR_E_ENGINE, fmt("MTP: h of position %d is not kept (kept from %d)", p, s.h_pos0));
    }
    return s.h.data() + (size_t) (p - s.h_pos0) * eng->n_embd_h;
}

}  // namespace

void mtp_open(dgr_engine * eng, const llama_context_params & main_params) {
    eng->n_embd_h = llama_model_n_embd_out(eng->model);
    // every row of a main step exposes h, output or not (masked = false)
    llama_set_embeddings_nextn(eng->ctx, true, false);
    llama_context_params cm = main_params;
    cm.ctx_type  = LLAMA_CONTEXT_TYPE_MTP;
    cm.n_rs_seq  = 0;          // ordinary KV: any tail can be dropped
    cm.ctx_other = eng->ctx;   // what llama.cpp's driver passes; DEEPSEEK4 shares no memory through it
    cm.embeddings = false;
    eng->mtp = llama_init_from_model(eng->model, cm);
    if (!eng->mtp) {
        std::string why = take_log_errors();
        throw dgr_exc(DGR_E_ENGINE, fmt("%s: could not create the MTP context: %s", eng->path.c_str(), why.c_str()));
    }
    llama_set_embeddings_nextn(eng->mtp, true, true);
}

void mtp_feed(dgr_engine * eng, session & s, const dgr_step & st, int32_t r0) {
    const int32_t w = eng->n_embd_h, n = st.n_tokens, pos0 = st.positions[0];
    const std::vector<float> zeros(w, 0.0f);
    std::vector<const float *> rows(n);
    for (int32_t i = 0; i < n; ++i) {
        rows[i] = llama_get_embeddings_nextn_ith(eng->ctx, r0 + i);
        if (!rows[i]) throw dgr_exc(DGR_E_ENGINE, "MTP: the main context gave no h row");
    }
    batch_ext b(eng->mtp);
    for (int32_t i = 0; i < n; ++i) {
        b.add(s.seq, st.token_ids[i], pos0 + i, i == 0 ? h_at(eng, s, pos0 - 1, zeros) : rows[i - 1], w, false);
    }
    decode(eng, b.b, "feed");
    // keep h of the positions a truncate may go back to: the step's own rows, at most n_rs_seq back
    const int32_t last = pos0 + n - 1;
    const int32_t from = std::max(pos0 - 1, last - eng->n_rs_seq);
    std::vector<float> kept((size_t) (last - from + 1) * w);
    for (int32_t p = from; p <= last; ++p) {
        memcpy(kept.data() + (size_t) (p - from) * w, p < pos0 ? h_at(eng, s, p, zeros) : rows[p - pos0], sizeof(float) * w);
    }
    s.h = std::move(kept);
    s.h_pos0 = from;
}

void mtp_forget(dgr_engine * eng, session & s) {
    if (eng->mtp && s.seq >= 0) {
        llama_memory_seq_rm(llama_get_memory(eng->mtp), s.seq, -1, -1);
    }
    s.h.clear();
    s.h_pos0 = -1;
}

void mtp_truncate(dgr_engine * eng, session & s, int32_t n_keep) {
    if (!llama_memory_seq_rm(llama_get_memory(eng->mtp), s.seq, n_keep, -1)) {
        throw dgr_exc(DGR_E_ENGINE, fmt("llama.cpp refused to drop the MTP context's positions from %d", n_keep));
    }
}

}  // namespace dgr_engine_detail

extern "C" {

int32_t dgr_mtp_draft(dgr_engine * eng, const char * sid, int64_t epoch, int32_t token, int32_t k, int32_t * drafts) {
    return guarded([&] {
        if (!eng || !sid || !drafts) throw dgr_exc(DGR_E_ENGINE, "mtp_draft: null argument");
        std::lock_guard<std::mutex> lock(eng->mu);
        const dgr_stage_info & in = eng->info;
        if (!eng->mtp) {
            throw dgr_exc(DGR_E_UNSUPPORTED, fmt("%s (layers [%d, %d) of %s) has no MTP block: MTP drafts come from the "
                    "last stage of a bundle built with bundle.include_mtp = true", eng->path.c_str(), in.layer_begin,
                    in.layer_end, in.arch));
        }
        auto it = eng->sessions.find(std::make_pair(std::string(sid), epoch));
        if (it == eng->sessions.end()) {
            throw dgr_exc(DGR_E_ENGINE, fmt("session '%s' epoch %lld is not open", sid, (long long) epoch));
        }
        session & s = it->second;
        if (k < 1 || k > eng->n_rs_seq) {
            throw dgr_exc(DGR_E_ENGINE, fmt("mtp_draft: k = %d, this stage drafts 1 to n_draft_max = %d tokens", k, eng->n_rs_seq));
        }
        if (token < 0 || token >= in.n_vocab) {
            throw dgr_exc(DGR_E_ENGINE, fmt("mtp_draft: token %d is outside the vocabulary [0, %d)", token, in.n_vocab));
        }
        if (s.n_cached + k > in.n_ctx) {
            throw dgr_exc(DGR_E_ENGINE, fmt("session '%s': %d + %d draft positions exceed n_ctx = %d", sid, s.n_cached, k, in.n_ctx));
        }
        const int32_t w = eng->n_embd_h, n_vocab = in.n_vocab, pos0 = s.n_cached;
        const std::vector<float> zeros(w, 0.0f);
        std::vector<float> h(h_at(eng, s, pos0 - 1, zeros), h_at(eng, s, pos0 - 1, zeros) + w);
        int32_t tok = token;
        try {
            // step i: (d_i, pos0 + i, h' of step i-1); step 0: (token, pos0, h of pos0-1)
            for (int32_t i = 0; i < k; ++i) {
                batch_ext b(eng->mtp);
                const int32_t idx = b.add(s.seq, tok, pos0 + i, h.data(), w, true);
                decode(eng, b.b, "draft");
                const float * l = llama_get_logits_ith(eng->mtp, idx);
                const float * hn = llama_get_embeddings_nextn_ith(eng->mtp, idx);
                if (!l || !hn) throw dgr_exc(DGR_E_ENGINE, "MTP: no logits or h from the draft step");
                tok = (int32_t) (std::max_element(l, l + n_vocab) - l);
                drafts[i] = tok;
                h.assign(hn, hn + w);
            }
        } catch (...) {
            llama_memory_seq_rm(llama_get_memory(eng->mtp), s.seq, pos0, -1);
            throw;
        }
        // the MTP cache again holds exactly the session's positions: verification feeds the rows it keeps
        mtp_truncate(eng, s, pos0);
    });
}

}  // extern "C"
