// One batch through the engine (engine_run.h): each step's cache checked (a rollback first), one dgr_forward for
// all (one by one when it fails), then each step's output emitted.
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <cstdio>

#include "data_path.h"
#include "engine_run/engine_run.h"

namespace dgr {

namespace pb = dgr::v1;

void EngineRun::run_batch(std::vector<Work> & batch) {
    struct Ready {
        Work * w;
        SessionPtr sess;
        std::vector<float> out;
        dgr_step_out o{};
        bool ok = false;
    };
    const int64_t width = set_.width;
    std::vector<Ready> ready;
    int64_t t0 = 0, compute = 0;
    const EngineLib & lib = engine_.lib();
    {
        auto eg = engine_.lock();
        for (auto & w : batch) {
            const Key key{w.frame.session_id(), w.frame.epoch()};
            SessionPtr sess = sessions_.find(key);
            if (!sess) continue;                     // closed while queued
            if (!set_.evict_at.empty() || !set_.break_origin_link_at.empty()) test_faults(eg, w.frame, sess);
            int32_t held = 0;
            int32_t st = eg.n_cached(key.first.c_str(), int64_t(key.second), &held);
            if (st != DGR_OK) {
                reply_error(w.reply, w.frame, err(pb::ENGINE, lib.error(st)));
                continue;
            }
            const pb::Step & s = w.frame.step();
            const uint64_t expect = s.cache_expect();
            const int64_t floor = sess->steps.spec_floor();
            // a step flagged rollback drops the drafts the last stage rejected, never below the first draft
            // of the session's last speculative step here
            if (uint64_t(held) > expect && s.rollback() && floor >= 0 && int64_t(expect) >= floor) {
                st = eg.truncate(key.first.c_str(), int64_t(key.second), int32_t(expect));
                if (st != DGR_OK) {
                    reply_error(w.reply, w.frame, err(pb::ENGINE, lib.error(st)));
                    continue;
                }
                held = int32_t(expect);
            }
            if (uint64_t(held) != expect) {
                pb::WireError e = err(pb::CACHE_MISS, "session " + names_.wire_of(key.first) + " epoch "+ std::to_string(key.second) + " holds " +
                                                          std::to_string(held) + " positions here but the frame expects " +
                                                          std::to_string(expect) + ": re-prefill at a new epoch");
                e.set_held(uint64_t(held));
                e.set_expected(expect);
                reply_error(w.reply, w.frame, std::move(e));
                continue;
            }
            ready.push_back(Ready{&w, sess, {}, {}, false});
        }
        if (ready.empty()) return;
        if (!set_.die_at.empty() || !set_.stop_at.empty()) die_if_asked(ready.size(), [&](size_t k) -> const pb::Frame & { return ready[k].w->frame; });
        std::vector<dgr_step> steps(ready.size());
        for (size_t k = 0; k < ready.size(); ++k) {
            Ready & r = ready[k];
            const pb::Step & s = r.w->frame.step();
            const int32_t n = s.positions_size();
            int want = DGR_LOGITS_NONE;
            if (set_.is_last && (s.sample() || r.sess->logits == pb::LOGITS_ALL)) {
                // a speculative step is verified at every position: one row per draw
                want = r.sess->logits == pb::LOGITS_ALL || s.drafts() ? DGR_LOGITS_ALL : DGR_LOGITS_LAST;
            }
            dgr_step & d = steps[k];
            d.session_id = r.w->frame.session_id().c_str();
            d.epoch = int64_t(r.w->frame.epoch());
            d.n_tokens = n;
            d.positions = s.positions().data();
            d.token_ids = s.token_ids_size() ? s.token_ids().data() : nullptr;
            d.boundary = r.w->x.empty() ? nullptr : r.w->x.data();
            d.boundary_width = r.w->x.empty() ? 0 : int32_t(width);
            d.want_logits = want;
            if (!set_.is_last) {
                r.out.resize(size_t(n) * size_t(width));
                r.o.boundary = r.out.data();
            } else if (want != DGR_LOGITS_NONE) {
                r.out.resize(size_t(want == DGR_LOGITS_ALL ? n : 1) * size_t(set_.n_vocab));
                r.o.logits = r.out.data();
            }
        }
        auto fail = [&](Ready & r, int32_t st, const std::string & why) {
            pb::WireError e;
            if (st == DGR_E_CACHE_MISS) {
                int64_t held = 0, expected = 0;
                lib.last_cache_miss(&held, &expected);
                e = err(pb::CACHE_MISS, why);
                e.set_held(uint64_t(held));
                e.set_expected(uint64_t(expected));
            } else {
                e = err(st == DGR_E_SCHEMA ? pb::SCHEMA_MISMATCH : pb::ENGINE, why);
            }
            reply_error(r.w->reply, r.w->frame, std::move(e));
        };
        t0 = mono_ns();
        std::vector<dgr_step_out> outs(ready.size());
        for (size_t k = 0; k < ready.size(); ++k) outs[k] = ready[k].o;
        int32_t st = eg.forward(int32_t(steps.size()), steps.data(), outs.data());
        metrics_.forward(steps.size());
        if (st == DGR_OK) {
            for (size_t k = 0; k < ready.size(); ++k) {
                ready[k].o = outs[k];
                ready[k].ok = true;
            }
        } else if (ready.size() == 1) {
            fail(ready[0], st, lib.error(st));
        } else {
            // one session's fault never fails the others: run the steps one by one (the failed batch ran none)
            fprintf(stderr, "dgr-worker: batch of %zu failed (%s); running its steps one by one\n", ready.size(), lib.error(st).c_str());
            for (size_t k = 0; k < ready.size(); ++k) {
                dgr_step_out o = ready[k].o;
                int32_t s1 = eg.forward(1, &steps[k], &o);
                if (s1 == DGR_OK) {
                    ready[k].o = o;
                    ready[k].ok = true;
                } else {
                    fail(ready[k], s1, lib.error(s1));
                }
            }
        }
        compute = mono_ns() - t0;
    }
    auto now = Clock::now();
    sched_.note_batch(double(compute) / 1e6);
    for (auto & r : ready) {
        if (!r.ok) continue;
        // --session-ttl counts real progress: a step that ran
        sessions_.touch(Key{r.w->frame.session_id(), r.w->frame.epoch()}, r.sess, now);
        // what stage 0 ran (the prefix cache's blocks hash it), and where a rollback may start
        const pb::Step & s = r.w->frame.step();
        r.sess->steps.ran_step(uint64_t(std::max(0, r.o.n_cached)), set_.is_first != 0, size_t(s.positions(0)),
                               s.token_ids().data(), size_t(s.token_ids_size()), s.drafts() ? int64_t(s.positions(0)) + 1 : -1);
    }
    for (auto & r : ready) {
        if (!r.ok) continue;
        pb::HopTiming timing;
        timing.set_stage_index(uint32_t(set_.stage_index));
        timing.set_queue_ns(uint64_t(std::max<int64_t>(0, t0 - r.w->t_recv)));
        timing.set_transit_ns(r.w->transit_ns);
        timing.set_compute_ns(uint64_t(compute));
        metrics_.step(r.w->frame.step().positions_size(), int64_t(timing.queue_ns()), compute);
        if (set_.is_last) emit_last(*r.w, r.sess, r.o.logits, r.o.n_logit_rows, timing);
        else ring_out_.emit_boundary(*r.w, r.sess, r.out.data(), timing);
    }
}

}  // namespace dgr
