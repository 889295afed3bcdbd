// The last stage's answer to a step (engine_run.h): the draws (the one sampler, after the grammar's mask; a speculative
// step verified at every position), their log-probabilities, logits rows, sent back to the origin.
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <stdexcept>

#include "data_path.h"
#include "engine_run/engine_run.h"

namespace dgr {

namespace pb = dgr::v1;
using Clock = std::chrono::steady_clock;

void EngineRun::emit_last(Work & w, const SessionPtr & sess, const float * logits, int32_t rows, pb::HopTiming timing) {
    const EngineLib & lib = engine_.lib();
    const int64_t t0 = mono_ns();
    const pb::Step & s = w.frame.step();
    const std::string origin = sess->route[0].address();
    const int64_t n = s.positions_size();
    const int64_t n_vocab = set_.n_vocab;
    std::vector<pb::Frame> frames;
    // The draws of a sampled step: at each of its last drafts+1 positions the token a
    // plain decode would draw there (greedy argmax, or the (seed, position)-keyed draw), while they match the
    // drafts; the first mismatch (or the position after the last draft) gives the next token.
    const int64_t k = s.drafts();
    std::vector<int32_t> draws;
    const float * vrows = nullptr;                   // the rows the draws came from
    if (s.sample()) {
        if (!logits || rows < k + 1) throw std::runtime_error("the engine returned too few logits rows to sample from");
        vrows = logits + int64_t(rows - (k + 1)) * n_vocab;
        const int64_t base = s.positions(int(n - k - 1));
        const pb::Sampling & sp = sess->sampling;
        for (int64_t j = 0; j <= k; ++j) {
            const float * row = vrows + j * n_vocab;
            if (sess->last.grammar) {                     // never with drafts (start_speculation refuses it): k == 0
                masked_.assign(row, row + n_vocab);
                const int32_t st = lib.grammar_apply(sess->last.grammar.get(), masked_.data(), int32_t(n_vocab));
                if (st != DGR_OK) throw std::runtime_error(lib.error(st));
                row = masked_.data();
            }
            const int32_t token = lib.sample(row, int32_t(n_vocab), double(sp.temperature()), int32_t(sp.top_k()),
                                              double(sp.top_p()), sp.seed(), base + j);
            if (token < 0) throw std::runtime_error("dgr_sample refused the logits row");
            if (sess->last.grammar) {
                const int32_t st = lib.grammar_accept(sess->last.grammar.get(), token);
                if (st != DGR_OK) throw std::runtime_error(lib.error(st));
            }
            draws.push_back(token);
            if (j == k || token != s.token_ids(int(s.token_ids_size() - k + j))) break;
        }
    }
    if (!draws.empty()) {
        std::lock_guard<std::mutex> g(metrics_.mu);
        metrics_.sampled += draws.size();
    }
    if (sess->logits == pb::LOGITS_ALL && logits && rows > 0) {
        const int64_t per = std::max<int64_t>(1, int64_t(set_.max_message_bytes - FRAME_OVERHEAD) / (n_vocab * 4 + 8));
        // positions computed from rejected drafts get no rows
        const int64_t valid = std::min<int64_t>(n, rows) - (s.sample() ? k + 1 - int64_t(draws.size()) : 0);
        for (int64_t lo = 0; lo < valid; lo += per) {
            const int64_t hi = std::min(valid, lo + per);
            pb::Frame f;
            f.set_session_id(sess->wire_down);       // as the origin knows it
            f.set_epoch(w.frame.epoch());
            pb::Logits * l = f.mutable_logits();
            for (int64_t k = lo; k < hi; ++k) l->add_positions(s.positions(int(k)));
            l->set_values(reinterpret_cast<const char *>(logits + lo * n_vocab), size_t((hi - lo) * n_vocab) * 4);
            frames.push_back(std::move(f));
        }
    }
    if (s.sample()) {
        const int32_t position = s.positions(int(n - k - 1)) + int32_t(draws.size()) - 1;
        pb::Frame f;
        f.set_session_id(sess->wire_down);
        f.set_epoch(w.frame.epoch());
        pb::Token * t = f.mutable_token();
        t->set_token_id(draws.back());
        t->set_position(position);
        t->set_origin_sent_ns(w.frame.origin_sent_ns());
        for (size_t j = 0; j + 1 < draws.size(); ++j) t->add_accepted(draws[j]);
        t->set_drafted(uint32_t(k));
        if (s.mtp_drafts()) mtp_draft(w, sess, position + 1, draws.back(), s.mtp_drafts(), t);
        if (sess->logits == pb::LOGITS_LAST) {
            t->set_logits(reinterpret_cast<const char *>(vrows), draws.size() * size_t(n_vocab) * 4);
        }
        const pb::Sampling & sp = sess->sampling;
        if (sp.logprobs() || sp.top_logprobs()) {   // the model's distribution: the raw rows, not the masked ones
            const int32_t top = int32_t(sp.top_logprobs());
            std::vector<int32_t> ids(size_t(std::max(top, 1)));
            std::vector<float> lps(ids.size());
            for (size_t j = 0; j < draws.size(); ++j) {
                float chosen = 0.0f;
                const int32_t n_top = lib.logprobs(vrows + int64_t(j) * n_vocab, int32_t(n_vocab), draws[j], &chosen, top,
                                                    ids.data(), lps.data());
                if (n_top < 0) throw std::runtime_error("dgr_logprobs refused the logits row");
                pb::DrawLogprobs * d = t->add_logprobs();
                d->set_logprob(chosen);
                for (int32_t i = 0; i < n_top; ++i) {
                    pb::TokenLogprob * e = d->add_top();
                    e->set_token_id(ids[size_t(i)]);
                    e->set_logprob(lps[size_t(i)]);
                }
            }
        }
        f.set_origin_sent_ns(w.frame.origin_sent_ns());
        *f.mutable_timings() = w.frame.timings();
        frames.push_back(std::move(f));
    }
    timing.set_wire_ns(uint64_t(mono_ns() - t0));
    for (auto & f : frames) {
        if (f.has_token()) {
            *f.add_timings() = timing;
            *f.mutable_token()->mutable_timings() = f.timings();
        }
        ring_out_.send(origin, 0, std::move(f), sess);
    }
}

// MTP drafts after the draw `token` for position `next` (Step.mtp_drafts; docs/deepseek4.md section 4): drop what
// the step computed past `next` (the drafts the draw rejected, here and in the MTP context: the next step then
// finds exactly `next` positions), then up to `want` chained greedy MTP drafts into Token.next_drafts. A stage
// without MTP, or a rollback the engine refuses, drafts nothing: the origin then sends a plain step, and the
// next step's own rollback says what was wrong.
void EngineRun::mtp_draft(Work & w, const SessionPtr & sess, int64_t next, int32_t token, uint32_t want, pb::Token * t) {
    if (!set_.has_mtp || !engine_.lib().mtp_draft) return;
    const std::string & sid = w.frame.session_id();
    const int64_t epoch = int64_t(w.frame.epoch());
    const int64_t k = std::min<int64_t>({int64_t(want), int64_t(set_.n_draft_max), int64_t(set_.n_ctx) - next - 1});
    if (k <= 0) return;
    std::vector<int32_t> drafts(size_t(k), 0);
    int32_t st = DGR_OK;
    {
        auto eg = engine_.lock();
        int32_t held = 0;
        st = eg.n_cached(sid.c_str(), epoch, &held);
        if (st == DGR_OK && held > next) st = eg.truncate(sid.c_str(), epoch, int32_t(next));
        if (st == DGR_OK) st = eg.mtp_draft(sid.c_str(), epoch, token, int32_t(k), drafts.data());
    }
    if (st != DGR_OK) {
        fprintf(stderr, "dgr-worker: no MTP drafts for session %s epoch %lld at %lld: %s\n", sid.c_str(), (long long)epoch,
                (long long)next, engine_.lib().error(st).c_str());
        return;
    }
    sess->steps.hold(uint64_t(next));
    for (int32_t d : drafts) t->add_next_drafts(d);
    std::lock_guard<std::mutex> g(metrics_.mu);
    metrics_.mtp_drafted += uint64_t(k);
}

}  // namespace dgr
