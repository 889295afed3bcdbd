// dgr_forward: the steps of several sessions checked (all or none run) and decoded in one llama_decode
// (one per session for a recurrent or hybrid model), then each step's boundary rows or logits.
#include "dgr_engine.h"
#include "dgr_engine_internal.h"

#include "llama.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <set>
#include <string>
#include <vector>

using namespace dgr_engine_detail;

extern "C" {

int32_t dgr_forward(dgr_engine * eng, int32_t n_steps, const dgr_step * steps, dgr_step_out * outs) {
    return guarded([&] {
        if (!eng || n_steps <= 0 || !steps || !outs) throw dgr_exc(DGR_E_ENGINE, "forward: needs at least one step");
        std::lock_guard<std::mutex> lock(eng->mu);
        const dgr_stage_info & in = eng->info;
        const int32_t width = eng->width();

        // validate everything before touching the cache: either all steps run or none
        std::vector<session *> ss(n_steps);
        int64_t n_total = 0;
        std::set<int32_t> seen;
        for (int32_t k = 0; k < n_steps; ++k) {
            const dgr_step & st = steps[k];
            const char * sid = st.session_id ? st.session_id : "";
            if (st.n_tokens <= 0 || !st.positions) {
                throw dgr_exc(DGR_E_ENGINE, fmt("step %d (session '%s'): no tokens", k, sid));
            }
            auto it = eng->sessions.find(std::make_pair(std::string(sid), st.epoch));
            if (it == eng->sessions.end()) {
                g_miss_held = 0;
                g_miss_expected = st.positions[0];
                throw dgr_exc(DGR_E_CACHE_MISS, fmt("session '%s' epoch %lld is not open here; open it and re-prefill from position 0",
                        sid, (long long) st.epoch));
            }
            session & s = it->second;
            if (!seen.insert(s.seq).second) {
                throw dgr_exc(DGR_E_ENGINE, fmt("step %d: session '%s' appears twice in one batch", k, sid));
            }
            for (int32_t i = 0; i < st.n_tokens; ++i) {
                if (st.positions[i] != s.n_cached + i) {
                    g_miss_held = s.n_cached;
                    g_miss_expected = st.positions[0];
                    throw dgr_exc(DGR_E_CACHE_MISS, fmt("session '%s' epoch %lld holds positions [0, %d) but the step's position %d is %d (expected %d); re-prefill at a new epoch",
                            sid, (long long) st.epoch, s.n_cached, i, st.positions[i], s.n_cached + i));
                }
            }
            if (s.n_cached + st.n_tokens > in.n_ctx) {
                throw dgr_exc(DGR_E_ENGINE, fmt("session '%s': %d + %d positions exceed n_ctx = %d",
                        sid, s.n_cached, st.n_tokens, in.n_ctx));
            }
            if (in.is_first || in.needs_token_ids) {
                if (!st.token_ids) {
                    throw dgr_exc(DGR_E_SCHEMA, fmt("step %d (session '%s'): this stage needs token ids%s",
                            k, sid, in.is_first ? "" : " (the token-id sideband)"));
                }
                for (int32_t i = 0; i < st.n_tokens; ++i) {
                    if (st.token_ids[i] < 0 || st.token_ids[i] >= in.n_vocab) {
                        throw dgr_exc(DGR_E_SCHEMA, fmt("step %d: token id %d is outside the vocabulary [0, %d)",
                                k, st.token_ids[i], in.n_vocab));
                    }
                }
            }
            if (in.is_first) {
                if (st.boundary) {
                    throw dgr_exc(DGR_E_SCHEMA, fmt("step %d: the first stage takes token ids, not a boundary", k));
                }
            } else {
                if (!st.boundary) {
                    throw dgr_exc(DGR_E_SCHEMA, fmt("step %d (session '%s'): this stage (layers [%d, %d)) needs the boundary [n_tokens, %d, %d]",
                            k, sid, in.layer_begin, in.layer_end, in.n_streams, in.n_embd));
                }
                if (st.boundary_width != width) {
                    throw dgr_exc(DGR_E_SCHEMA, fmt("step %d: boundary has %d floats per token, this stage takes n_streams * n_embd = %d * %d = %d",
                            k, st.boundary_width, in.n_streams, in.n_embd, width));
                }
            }
            ss[k] = &s;
            n_total += st.n_tokens;
        }
        if (n_total > (int64_t) llama_n_batch(eng->ctx)) {
            throw dgr_exc(DGR_E_ENGINE, fmt("batch of %lld tokens exceeds n_batch = %u", (long long) n_total, llama_n_batch(eng->ctx)));
        }

        llama_batch batch = llama_batch_init((int32_t) n_total, in.is_first ? 0 : width, 1);
        if (!in.is_first && eng->batch_token_ids) {
            // the sideband: each entry carries its token id and its boundary row (freed by llama_batch_free)
            batch.token = (llama_token *) malloc(sizeof(llama_token) * n_total);
        }
        struct batch_guard { llama_batch & b; ~batch_guard() { llama_batch_free(b); } } bg { batch };
        // rows in sequence order: llama.cpp's per-stream split puts only consecutive sequences in one ubatch
        std::vector<int32_t> order(n_steps);
        for (int32_t k = 0; k < n_steps; ++k) order[k] = k;
        std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return ss[a]->seq < ss[b]->seq; });
        std::vector<int32_t> row_of_step(n_steps);
        int32_t j = 0;
        for (const int32_t k : order) {
            const dgr_step & st = steps[k];
            row_of_step[k] = j;
            for (int32_t i = 0; i < st.n_tokens; ++i, ++j) {
                if (batch.token) {
                    batch.token[j] = st.token_ids[i];
                }
                if (!in.is_first) {
                    memcpy(batch.embd + (int64_t) j * width, st.boundary + (int64_t) i * width, sizeof(float) * width);
                }
                batch.pos[j]       = st.positions[i];
                batch.n_seq_id[j]  = 1;
                batch.seq_id[j][0] = ss[k]->seq;
                bool out = true; // a non-last stage outputs every token
                if (in.is_last) {
                    out = st.want_logits == DGR_LOGITS_ALL || i == st.n_tokens - 1;
                }
                batch.logits[j] = out;
            }
        }
        batch.n_tokens = (int32_t) n_total;

        // dgr: a recurrent or hybrid model splits a batch into ubatches one sequence at a time when every
        // token is an output (a non-last stage: llama_memory_recurrent::init_batch uses split_seq) and
        // several sequences at a time otherwise (the whole model, the last stage: split_equal). Other
        // ubatches mean other matmul shapes and other rounding, so split != whole. Such a model therefore
        // decodes one session (= one sequence) per llama_decode at every stage: the same ubatches everywhere.
        const bool per_session = llama_model_is_recurrent(eng->model) || llama_model_is_hybrid(eng->model);
        for (int32_t c = 0; c < (per_session ? n_steps : 1); ++c) {
            const int32_t k0 = per_session ? c : 0;
            const int32_t k1 = per_session ? c + 1 : n_steps;
            llama_batch part = batch; // per session: a view of that session's rows (freed with `batch`)
            if (per_session) {
                const int32_t r = row_of_step[c];
                part.n_tokens = steps[c].n_tokens;
                part.token    = batch.token ? batch.token + r : nullptr;
                part.embd     = batch.embd ? batch.embd + (int64_t) r * width : nullptr;
                part.pos      = batch.pos + r;
                part.n_seq_id = batch.n_seq_id + r;
                part.seq_id   = batch.seq_id + r;
                part.logits   = batch.logits + r;
            }
            // dgr: an M-RoPE model (qwen2vl, qwen3vl, qwen35...) takes one position per token id, which
            // llama.cpp broadcasts to its 4 rope sections (the graph then zeroes the 4th), but 4 positions per
            // embedding row, section-major (pos[j*n_tokens + i]). A non-first stage feeds embedding rows: give
            // them what the token path computes, p in sections 0-2 (rope, and the KV cells' x/y) and 0 in 3.
            std::vector<llama_pos> pos4;
            const enum llama_rope_type rt = llama_model_rope_type(eng->model);
            if (part.embd && !part.token && (rt == LLAMA_ROPE_TYPE_MROPE || rt == LLAMA_ROPE_TYPE_IMROPE)) {
                const int32_t n = part.n_tokens;
                pos4.assign((size_t) n * 4, 0);
                for (int32_t i = 0; i < n; ++i) {
                    pos4[i] = pos4[(size_t) n + i] = pos4[(size_t) 2 * n + i] = part.pos[i];
                }
                part.pos = pos4.data();
            }
            const int32_t rc = llama_decode(eng->ctx, part);
            if (rc != 0) {
                std::string why = take_log_errors();
                llama_memory_t mem = llama_get_memory(eng->ctx);
                if (per_session) {
                    // dgr: a recurrent state cannot drop a partial range (only its latest state is kept), and
                    // the sessions before this one have already advanced: drop every session of the batch
                    // whole, so its next step is a cache miss that re-prefills from position 0
                    for (int32_t k = 0; k < n_steps; ++k) {
                        llama_memory_seq_rm(mem, ss[k]->seq, -1, -1);
                        ss[k]->n_cached = 0;
                        mtp_forget(eng, *ss[k]);
                    }
                } else if (rc < 0 || rc == 2) {
                    // on a failed decode, the cache may hold part of the batch: drop it for the sessions involved
                    for (int32_t k = 0; k < n_steps; ++k) {
                        llama_memory_seq_rm(mem, ss[k]->seq, ss[k]->n_cached, -1);
                    }
                }
                throw dgr_exc(DGR_E_ENGINE, fmt("llama_decode failed (%d)%s%s", rc,
                        rc == 1 ? ": no KV slot for the batch (cache full; close sessions or raise n_ctx)" : "",
                        why.empty() ? "" : (": " + why).c_str()));
            }

            for (int32_t k = k0; k < k1; ++k) {
                const dgr_step & st = steps[k];
                dgr_step_out & o = outs[k];
                o.n_logit_rows = 0;
                o.next_token = -1;
                const int32_t r0 = row_of_step[k] - (per_session ? row_of_step[k0] : 0); // row in this call's batch
                if (!in.is_last) {
                    if (o.boundary) {
                        for (int32_t i = 0; i < st.n_tokens; ++i) {
                            const float * e = llama_get_embeddings_ith(eng->ctx, r0 + i);
                            if (!e) throw dgr_exc(DGR_E_ENGINE, "no boundary output from llama.cpp");
                            memcpy(o.boundary + (int64_t) i * width, e, sizeof(float) * width);
                        }
                    }
                } else {
                    const int32_t n_vocab = in.n_vocab;
                    const int32_t first_row = st.want_logits == DGR_LOGITS_ALL ? 0 : st.n_tokens - 1;
                    for (int32_t i = first_row; i < st.n_tokens; ++i) {
                        const float * l = llama_get_logits_ith(eng->ctx, r0 + i);
                        if (!l) throw dgr_exc(DGR_E_ENGINE, "no logits from llama.cpp");
                        if (i == st.n_tokens - 1) {
                            o.next_token = (int32_t) (std::max_element(l, l + n_vocab) - l);
                        }
                        if (o.logits && st.want_logits != DGR_LOGITS_NONE) {
                            memcpy(o.logits + (int64_t) o.n_logit_rows * n_vocab, l, sizeof(float) * n_vocab);
                            o.n_logit_rows++;
                        }
                    }
                }
                ss[k]->n_cached += st.n_tokens;
                ss[k]->step_pos0 = st.positions[0];
                ss[k]->step_rows = st.n_tokens;
                ss[k]->rolled_back = false;
                o.n_cached = ss[k]->n_cached;
            }
            if (eng->mtp) {
                // the MTP context gets the same positions (token p with h of p-1), so its KV covers them all
                try {
                    for (int32_t k = k0; k < k1; ++k) {
                        mtp_feed(eng, *ss[k], steps[k], row_of_step[k] - (per_session ? row_of_step[k0] : 0));
                    }
                } catch (...) {
                    // the contexts disagree now: drop the batch's sessions whole (their next step re-prefills)
                    for (int32_t k = 0; k < n_steps; ++k) {
                        llama_memory_seq_rm(llama_get_memory(eng->ctx), ss[k]->seq, -1, -1);
                        ss[k]->n_cached = 0;
                        mtp_forget(eng, *ss[k]);
                    }
                    throw;
                }
            }
        }
    });
}

} // extern "C"
