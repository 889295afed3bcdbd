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

uint32_t StageWorker::retry_after_ms() {   // mu_ held
    return uint32_t(std::min(5000.0, std::max(50.0, batch_ms_ * double(1 + n_pending_))));
}

void StageWorker::enqueue(Work w, const SessionPtr & sess, bool own) {
    const Key key{w.frame.session_id(), w.frame.epoch()};
    std::string why;
    uint32_t retry = 0;
    {
        std::lock_guard<std::mutex> g(mu_);
        auto it = pending_.find(key);
        if (!own && n_pending_ >= limits_.max_queued_steps) {
            why = std::to_string(n_pending_) + " steps are queued (--max-queued-steps " + std::to_string(limits_.max_queued_steps) + ")";
        } else if (!own && it != pending_.end() && int64_t(it->second.size()) >= limits_.max_session_steps) {
            why = "session " + key.first + " has " + std::to_string(it->second.size()) + " steps queued (--max-session-steps " +
                  std::to_string(limits_.max_session_steps) + ")";
        }
        if (why.empty()) {
            sess->last_used = Clock::now();
            if (it == pending_.end()) {
                order_.push_back(key);
                it = pending_.emplace(key, std::deque<Work>()).first;
            }
            it->second.push_back(std::move(w));
            ++n_pending_;
            wake_.notify_all();
            return;
        }
        ++overloaded_;
        retry = retry_after_ms();
    }
    reply_error(w.reply, w.frame, err(pb::OVERLOADED, why + ": retry later", retry));
}

bool StageWorker::held_back() {   // mu_ held; --hold-batch (tests: force sharing)
    const int64_t hold = limits_.hold_batch;
    const int64_t need = int64_t(opened_total_) < hold ? hold : std::min<int64_t>(hold, int64_t(sessions_.size()));
    return hold > 0 && int64_t(pending_.size()) < need;
}

std::vector<StageWorker::Work> StageWorker::take_batch() {
    std::unique_lock<std::mutex> l(mu_);
    while (!threads_stopped_ && (!n_pending_ || held_back()) && jobs_.empty()) {
        wake_.wait_for(l, std::chrono::milliseconds(500));
    }
    std::vector<Work> batch;
    if (threads_stopped_ || held_back()) return batch;
    int64_t tokens = 0;
    std::deque<Key> kept, served;                    // round robin: served sessions go to the back
    for (auto & key : order_) {
        auto it = pending_.find(key);
        if (it == pending_.end() || it->second.empty()) continue;   // closed while queued
        const int64_t n = it->second.front().frame.step().positions_size();
        if (!batch.empty() && (tokens + n > limits_.max_batch_tokens || int64_t(batch.size()) >= limits_.max_batch_sessions)) {
            kept.push_back(key);
            continue;
        }
        batch.push_back(std::move(it->second.front()));
        it->second.pop_front();
        tokens += n;
        --n_pending_;
        if (it->second.empty()) pending_.erase(it);
        else served.push_back(key);
    }
    kept.insert(kept.end(), served.begin(), served.end());
    order_.swap(kept);
    return batch;
}

void StageWorker::engine_loop() {
    while (true) {
        try {
            {
                std::lock_guard<std::mutex> g(mu_);
                if (threads_stopped_) return;
            }
            std::vector<Work> batch = take_batch();
            if (!batch.empty()) {
                try {
                    run_batch(batch);
                } catch (const std::exception & e) {
                    fprintf(stderr, "dgr-worker: engine batch failed: %s\n", e.what());
                    for (auto & w : batch) reply_error(w.reply, w.frame, err(pb::INTERNAL, "the worker failed on this step; see its log"));
                }
            }
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
