// The engine's scheduler: when a batch of queued steps runs, and on which thread.
//
// A part that owns its state and its lock: the step queue (step_queue.h), the deferred jobs (work after a
// forward, in order: the origin's detokenizing), the engine thread, whether a batch is running, the moving
// average of a batch's time (retry hints), and whether it was stopped. It knows nothing of gRPC, frames or
// sessions beyond their keys and its owner's two answers (Owner): what one batch does, and how many sessions
// the worker has. Tested on its own (scheduler_test.cpp: a cc_test under Bazel, `dgr-worker-unit-tests` under
// CMake).
//
// Locks (docs/worker.md "Locks and their order"): its lock is taken after the worker's mu_ (mu_ may be held
// around every call here) and before the session table's, which Owner::sessions takes. It is never held while
// a batch or a job runs, nor while anything of the owner but Owner::sessions is called.
//
// One thread runs a batch at a time: the engine thread, or (push's may_run_here) the thread that read a lone
// decode step while the engine was idle, which runs it itself: one wake-up fewer per hop
// (docs/worker-speed-plan.md). The engine thread stays for everything else: steps of several sessions (they
// batch), prefill chunks (reading the next chunk overlaps this one's forward) and the jobs.
#pragma once

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "step_queue.h"

namespace dgr {

struct BatchSettings {
    int64_t max_batch_tokens = 512;                  // --max-batch-tokens: positions in one batch
    int64_t max_batch_sessions = 64;                 // --max-batch-sessions: sessions in one batch
    int64_t hold_batch = 0;                          // --hold-batch (tests: force sharing): wait for this many
                                                     //   sessions' steps before a batch runs
    int64_t inline_max_positions = 16;               // decode and speculation's verification steps; prefill
                                                     //   chunks are longer and go to the engine thread
};

template <class Key, class Work>
class StepScheduler {
  public:
    using Queue = StepQueue<Key, Work>;
    using Refused = typename Queue::Refused;

    struct Owner {
        // one batch (never empty), on the engine thread or a reader's, no lock of the scheduler held
        std::function<void(std::vector<Work> &)> run;
        // (sessions ever opened, sessions open now): called with the scheduler's lock held, so it may take only
        // leaf locks (the session table's)
        std::function<std::pair<uint64_t, size_t>()> sessions;
    };

    struct Pushed {
        Refused refused = Refused::none;             // which bound refused it (none: queued, or run)
        int64_t queued = 0;                          // what was queued at that bound
        uint32_t retry_after_ms = 0;                 // refused: when to try again
    };

    StepScheduler(StepBounds bounds, BatchSettings settings, Owner owner)
        : steps_(bounds), settings_(settings), owner_(std::move(owner)) {}
    StepScheduler(const StepScheduler &) = delete;
    StepScheduler & operator=(const StepScheduler &) = delete;
    ~StepScheduler() {
        stop();
        join();
    }

    // the engine thread (once, after the owner is ready for Owner's calls)
    void start() {
        thread_ = std::thread([this] { loop(); });
    }

    // Queues `work` (a step of `positions` positions of session `key`, opened by `member`; `own`: a step this
    // worker made itself, never refused by a bound). Refused, `work` is left to the caller to answer its sender.
    // `may_run_here`: the caller reads frames and may run the batch itself when it is a lone short step and the
    // engine is idle (it returns after the batch ran).
    Pushed push(const Key & key, const std::string & member, Work && work, int64_t positions, bool own, bool may_run_here) {
        std::unique_lock<std::mutex> l(mu_);
        const auto pushed = steps_.push(key, member, std::move(work), positions, own);
        if (pushed.refused != Refused::none) return {pushed.refused, pushed.queued, retry_after_ms_locked()};
        if (!(may_run_here && run_inline(positions))) {
            wake_.notify_all();
            return {};
        }
        std::vector<Work> batch = ready_batch();
        Busy busy(*this, l);
        l.unlock();
        run(batch);
        return {};
    }

    // Work for the engine thread after the batch it is running (or now, when idle), in the order given.
    void defer(std::function<void()> job) {
        std::lock_guard<std::mutex> g(mu_);
        jobs_.push_back(std::move(job));
        wake_.notify_all();
    }

    // a closed session's queued steps are forgotten: how many there were
    int64_t drop(const Key & key) { return steps_.drop(key); }
    bool has(const Key & key) const { return steps_.has(key); }
    int64_t steps() const { return steps_.steps(); }

    // when a refused step should be tried again: the batches ahead of it at the recent pace
    uint32_t retry_after_ms() {
        std::lock_guard<std::mutex> g(mu_);
        return retry_after_ms_locked();
    }
    // a batch's compute time, for the pace (by whoever ran it)
    void note_batch(double ms) {
        std::lock_guard<std::mutex> g(mu_);
        batch_ms_ = 0.8 * batch_ms_ + 0.2 * ms;
    }

    // No batch or job starts from now on (one running finishes); then join().
    void stop() {
        std::lock_guard<std::mutex> g(mu_);
        stopped_ = true;
        wake_.notify_all();
    }
    bool stopped() const {
        std::lock_guard<std::mutex> g(mu_);
        return stopped_;
    }
    // After stop(): the engine thread has ended and no reader runs a batch (on the engine thread itself, a job
    // that stops the worker: returns at once, the thread ends after the job).
    void join() {
        if (thread_.get_id() == std::this_thread::get_id()) return;
        if (thread_.joinable()) thread_.join();
        std::unique_lock<std::mutex> l(mu_);
        wake_.wait(l, [&] { return !busy_; });
    }
    bool on_engine_thread() const { return thread_.get_id() == std::this_thread::get_id(); }

  private:
    // while one thread runs a batch (and the jobs after it) no other does: busy_, set with mu_ held, cleared on
    // every way out (the lock is released in between)
    struct Busy {
        StepScheduler & s;
        std::unique_lock<std::mutex> & l;
        Busy(StepScheduler & s_, std::unique_lock<std::mutex> & l_) : s(s_), l(l_) { s.busy_ = true; }
        ~Busy() {
            if (!l.owns_lock()) l.lock();
            s.busy_ = false;
            if (s.steps_.steps() || !s.jobs_.empty() || s.stopped_) s.wake_.notify_all();
        }
    };

    uint32_t retry_after_ms_locked() const {
        return uint32_t(std::min(5000.0, std::max(50.0, batch_ms_ * double(1 + steps_.steps()))));
    }

    bool run_inline(int64_t positions) {             // mu_ held
        return !busy_ && !stopped_ && positions <= settings_.inline_max_positions && owner_.sessions().second <= 1 &&
               jobs_.empty() && !held_back();
    }

    bool held_back() {                               // mu_ held; --hold-batch
        const int64_t hold = settings_.hold_batch;
        if (hold <= 0) return false;
        const auto [opened, open] = owner_.sessions();
        const int64_t need = int64_t(opened) < hold ? hold : std::min<int64_t>(hold, int64_t(open));
        return int64_t(steps_.sessions()) < need;
    }

    std::vector<Work> ready_batch() {                // mu_ held
        if (stopped_ || !steps_.steps() || held_back()) return {};
        return steps_.take(settings_.max_batch_tokens, settings_.max_batch_sessions);
    }

    void run(std::vector<Work> & batch) {
        if (batch.empty()) return;
        owner_.run(batch);
    }

    void loop() {
        while (true) {
            try {
                std::unique_lock<std::mutex> l(mu_);
                while (!stopped_ && (busy_ || ((!steps_.steps() || held_back()) && jobs_.empty()))) {
                    wake_.wait_for(l, std::chrono::milliseconds(500));
                }
                if (stopped_) return;
                std::vector<Work> batch = ready_batch();
                Busy busy(*this, l);
                l.unlock();
                run(batch);
                while (true) {                       // the deferred jobs
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
                        std::fprintf(stderr, "dgr-worker: deferred job failed: %s\n", e.what());
                    }
                }
            } catch (const std::exception & e) {
                std::fprintf(stderr, "dgr-worker: engine loop: %s\n", e.what());
            } catch (...) {
                std::fprintf(stderr, "dgr-worker: engine loop: unknown exception\n");
            }
        }
    }

    Queue steps_;                                    // its own leaf lock, taken under mu_
    const BatchSettings settings_;
    const Owner owner_;
    mutable std::mutex mu_;                          // everything below
    std::condition_variable wake_;
    std::deque<std::function<void()>> jobs_;
    double batch_ms_ = 1.0;                          // moving average of one batch's compute
    bool busy_ = false;                              // a thread (the engine's, or a reader's) runs a batch
    bool stopped_ = false;
    std::thread thread_;                             // last: it reads all of the above
};

}  // namespace dgr
