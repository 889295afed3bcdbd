// The step queue: steps per session, bounded (--max-queued-steps, --max-session-steps), taken in batches
// round robin by the one engine thread, which also runs the deferred jobs (the origin's detokenizing).
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <cstdio>

#include "frames_internal.h"
#include "worker.h"

namespace dgr {

namespace pb = dgr::v1;
using Clock = std::chrono::steady_clock;

thread_local bool t_reads_frames = false;

// While one thread runs a batch (and the jobs after it) no other does: engine_busy_, set with mu_ held,
// cleared on every way out (the lock is released in between)
struct Busy {
    StageWorker * w;
    std::unique_lock<std::mutex> & l;
    Busy(StageWorker * w_, std::unique_lock<std::mutex> & l_) : w(w_), l(l_) { w->engine_busy_ = true; }
    ~Busy() {
        if (!l.owns_lock()) l.lock();
        w->engine_busy_ = false;
        if (w->steps_.steps() || !w->jobs_.empty() || w->threads_stopped_) w->wake_.notify_all();
    }
};
constexpr int64_t INLINE_MAX_POSITIONS = 16;   // decode and speculation's verification steps; prefill chunks are longer

uint32_t StageWorker::retry_after_ms() {   // mu_ held
    return uint32_t(std::min(5000.0, std::max(50.0, batch_ms_ * double(1 + steps_.steps()))));
}

void StageWorker::enqueue(Work w, const SessionPtr & sess, bool own) {
    const Key key{w.frame.session_id(), w.frame.epoch()};
    std::string why;
    uint32_t retry = 0;
    std::vector<Work> batch;
    {
        std::unique_lock<std::mutex> g(mu_);
        using Refused = StepQueue<Key, Work>::Refused;
        const int64_t positions = w.frame.step().positions_size();
        const auto pushed = steps_.push(key, names_.owner_of(key.first), std::move(w), positions, own);
        switch (pushed.refused) {
            case Refused::none:
                if (!run_inline(positions)) {
                    wake_.notify_all();
                    return;
                }
                {
                    batch = ready_batch();
                    Busy busy(this, g);
                    g.unlock();
                    run_guarded(batch);
                }
                return;
            case Refused::worker_full:
                why = std::to_string(pushed.queued) + " steps are queued (--max-queued-steps " + std::to_string(limits_.max_queued_steps) + ")";
                break;
            case Refused::member_full: {
                const int64_t cap = limits_.max_queued_steps_per_member;
                why = "this member has " + std::to_string(cap) + " steps queued here (--max-queued-steps-per-member " +
                      std::to_string(cap) + ")";
                break;
            }
            case Refused::session_full:           // (--session-ttl counts steps run, not steps asked for)
                why = "session " + names_.wire_of(key.first) + " has " + std::to_string(pushed.queued) + " steps queued (--max-session-steps " +
                      std::to_string(limits_.max_session_steps) + ")";
                break;
        }
        ++overloaded_;
        retry = retry_after_ms();
    }
    reply_error(w.reply, w.frame, err(pb::OVERLOADED, why + ": retry later", retry));
}

// One wake-up fewer per hop: a lone session's decode step, read while the engine is idle, runs on the thread
// that read it (docs/worker-speed-plan.md). The engine thread stays for everything else: steps of several
// sessions (they batch), prefill chunks (reading the next chunk overlaps this one's forward) and the jobs.
bool StageWorker::run_inline(int64_t positions) {   // mu_ held
    return t_reads_frames && !engine_busy_ && !threads_stopped_ && positions <= INLINE_MAX_POSITIONS &&
           sessions_.size() <= 1 && jobs_.empty() && !held_back();
}

void StageWorker::run_guarded(std::vector<Work> & batch) {
    if (batch.empty()) return;
    try {
        run_batch(batch);
    } catch (const std::exception & e) {
        fprintf(stderr, "dgr-worker: engine batch failed: %s\n", e.what());
        for (auto & w : batch) reply_error(w.reply, w.frame, err(pb::INTERNAL, "the worker failed on this step; see its log"));
    }
}

bool StageWorker::held_back() {   // mu_ held; --hold-batch (tests: force sharing)
    const int64_t hold = limits_.hold_batch;
    const int64_t need = int64_t(opened_total_) < hold ? hold : std::min<int64_t>(hold, int64_t(sessions_.size()));
    return hold > 0 && int64_t(steps_.sessions()) < need;
}

std::vector<StageWorker::Work> StageWorker::ready_batch() {   // mu_ held
    if (threads_stopped_ || !steps_.steps() || held_back()) return {};
    return steps_.take(limits_.max_batch_tokens, limits_.max_batch_sessions);
}

void StageWorker::engine_loop() {
    while (true) {
        try {
            std::vector<Work> batch;
            std::unique_lock<std::mutex> l(mu_);
            while (!threads_stopped_ && (engine_busy_ || ((!steps_.steps() || held_back()) && jobs_.empty()))) {
                wake_.wait_for(l, std::chrono::milliseconds(500));
            }
            if (threads_stopped_) return;
            batch = ready_batch();
            Busy busy(this, l);
            l.unlock();
            run_guarded(batch);
            while (true) {                           // deferred jobs: the origin's detokenizing
                std::function<void()> job;
                {
                    std::lock_guard<std::mutex> g(mu_);
                    if (jobs_.empty()) break;
                    job = std::move(jobs_.front());
                    jobs_.pop_front();
                }
                try {
                    job();
                } catch (const std::exception & e) {
                    fprintf(stderr, "dgr-worker: deferred job failed: %s\n", e.what());
                }
            }
        } catch (const std::exception & e) {
            fprintf(stderr, "dgr-worker: engine loop: %s\n", e.what());
        } catch (...) {
            fprintf(stderr, "dgr-worker: engine loop: unknown exception\n");
        }
    }
}

}  // namespace dgr
