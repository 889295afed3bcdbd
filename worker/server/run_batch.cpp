// One batch through the engine: each step's cache checked (a rollback first), one dgr_forward for all (one
// by one when it fails), then each step's output emitted; the tests' faults at an exact step.
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <csignal>
#include <cstdio>

#include <unistd.h>

#include "data_path.h"
#include "worker.h"

namespace dgr {

namespace pb = dgr::v1;

// The tests' hooks (--test-die-at SESSION:...) name a session as its client did (SessionNames::client_name)
bool StageWorker::hook_at(const std::set<std::tuple<std::string, uint64_t, int64_t>> & at, const std::string & key,
                          uint64_t epoch, int64_t p) const {
    return !at.empty() && at.count({names_.client_name(key), epoch, p}) > 0;
}
using Clock = std::chrono::steady_clock;

// --test-die-at (tests: a kill -9 at an exact step): about to run a step
// that holds a listed (session, epoch, position), the worker SIGKILLs itself, nothing flushed or closed.
// --test-stop-at: the same, SIGSTOP (a hung worker; it runs the step when it gets SIGCONT).
void StageWorker::die_if_asked(size_t n, const std::function<const pb::Frame &(size_t)> & frame) {
    for (size_t k = 0; k < n; ++k) {
        const pb::Frame & f = frame(k);
        for (int64_t p : f.step().positions()) {
            if (hook_at(limits_.die_at, f.session_id(), f.epoch(), p)) {
                fprintf(stderr, "dgr-worker: --test-die-at %s:%llu:%lld reached: SIGKILL\n", f.session_id().c_str(),
                        (unsigned long long)f.epoch(), (long long)p);
                fflush(stderr);
                kill(getpid(), SIGKILL);
            }
            if (hook_at(limits_.stop_at, f.session_id(), f.epoch(), p)) {
                fprintf(stderr, "dgr-worker: --test-stop-at %s:%llu:%lld reached: SIGSTOP\n", f.session_id().c_str(),
                        (unsigned long long)f.epoch(), (long long)p);
                fflush(stderr);
                kill(getpid(), SIGSTOP);
            }
        }
    }
}

// --test-evict-at, --test-break-origin-link-at (tests: a fault at an exact step, which no timing can move)
void StageWorker::test_faults(Engine::Guard & eg, const pb::Frame & f, const SessionPtr & sess) {
    const std::string & sid = f.session_id();
    for (int64_t p : f.step().positions()) {
        if (hook_at(limits_.evict_at, sid, f.epoch(), p)) {
            // the session's cache is lost (as under memory pressure): the session stays, its cache is empty
            fprintf(stderr, "dgr-worker: --test-evict-at %s:%llu:%lld reached: cache dropped\n", sid.c_str(),
                    (unsigned long long)f.epoch(), (long long)p);
            eg.session_close(sid.c_str(), int64_t(f.epoch()));
            int32_t st = eg.session_open(sid.c_str(), int64_t(f.epoch()));
            if (st != DGR_OK) fprintf(stderr, "dgr-worker: --test-evict-at: reopen failed: %s\n", engine_.lib().error(st).c_str());
        }
        if (hook_at(limits_.break_origin_link_at, sid, f.epoch(), p) && !info_.is_first) {
            std::shared_ptr<Link> l = relay_.find(sess->route[0].address());
            fprintf(stderr, "dgr-worker: --test-break-origin-link-at %s:%llu:%lld reached: %s\n", sid.c_str(),
                    (unsigned long long)f.epoch(), (long long)p, l ? "link failed" : "no link to fail");
            if (l) l->fail("--test-break-origin-link-at");
        }
    }
}

void StageWorker::run_batch(std::vector<Work> & batch) {
    struct Ready {
        Work * w;
        SessionPtr sess;
        std::vector<float> out;
        dgr_step_out o{};
        bool ok = false;
    };
    const int64_t width = int64_t(info_.n_streams) * info_.n_embd;
    std::vector<Ready> ready;
    int64_t t0 = 0, compute = 0;
    const EngineLib & lib = engine_.lib();
    {
        auto eg = engine_.lock();
        for (auto & w : batch) {
            const Key key{w.frame.session_id(), w.frame.epoch()};
            SessionPtr sess = sessions_.find(key);
            if (!sess) continue;                     // closed while queued
            if (!limits_.evict_at.empty() || !limits_.break_origin_link_at.empty()) test_faults(eg, w.frame, sess);
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
        if (!limits_.die_at.empty() || !limits_.stop_at.empty()) die_if_asked(ready.size(), [&](size_t k) -> const pb::Frame & { return ready[k].w->frame; });
        std::vector<dgr_step> steps(ready.size());
        for (size_t k = 0; k < ready.size(); ++k) {
            Ready & r = ready[k];
            const pb::Step & s = r.w->frame.step();
            const int32_t n = s.positions_size();
            int want = DGR_LOGITS_NONE;
            if (info_.is_last && (s.sample() || r.sess->logits == pb::LOGITS_ALL)) {
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
            if (!info_.is_last) {
                r.out.resize(size_t(n) * size_t(width));
                r.o.boundary = r.out.data();
            } else if (want != DGR_LOGITS_NONE) {
                r.out.resize(size_t(want == DGR_LOGITS_ALL ? n : 1) * size_t(info_.n_vocab));
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
        r.sess->steps.ran_step(uint64_t(std::max(0, r.o.n_cached)), info_.is_first != 0, size_t(s.positions(0)),
                               s.token_ids().data(), size_t(s.token_ids_size()), s.drafts() ? int64_t(s.positions(0)) + 1 : -1);
    }
    for (auto & r : ready) {
        if (!r.ok) continue;
        pb::HopTiming timing;
        timing.set_stage_index(uint32_t(card_.id.stage_index));
        timing.set_queue_ns(uint64_t(std::max<int64_t>(0, t0 - r.w->t_recv)));
        timing.set_transit_ns(r.w->transit_ns);
        timing.set_compute_ns(uint64_t(compute));
        metrics_.step(r.w->frame.step().positions_size(), int64_t(timing.queue_ns()), compute);
        if (info_.is_last) emit_last(*r.w, r.sess, r.o.logits, r.o.n_logit_rows, timing);
        else ring_out_->emit_boundary(*r.w, r.sess, r.out.data(), timing);
    }
}

}  // namespace dgr
