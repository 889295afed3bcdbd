// The step queue: the steps waiting for the engine, per session, bounded, taken in batches round robin.
//
// A part that owns its containers and its lock. The lock is a leaf (nothing is called while it is held, and
// the worker may hold its own table's lock around a call here: docs/worker.md "Locks and their order"). It
// knows nothing of gRPC, frames or sessions beyond their keys, so it is tested on its own
// (step_queue_test.cpp: a cc_test under Bazel, `dgr-worker-unit-tests` under CMake).
#pragma once

#include <algorithm>
#include <cstdint>
#include <deque>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace dgr {

struct StepBounds {
    int64_t max_queued_steps = 512;                  // --max-queued-steps: steps queued in this worker
    int64_t max_session_steps = 128;                 // --max-session-steps: steps queued for one session
    int64_t max_queued_steps_per_member = 0;         // --max-queued-steps-per-member (0: off, and not counted)
};

template <class Key, class Item>
class StepQueue {
  public:
    enum class Refused { none, worker_full, member_full, session_full };
    struct Pushed {
        Refused refused = Refused::none;             // which bound refused it (none: queued)
        int64_t queued = 0;                          // what was queued at that bound when it refused
    };

    explicit StepQueue(StepBounds b) : b_(b) {}
    StepQueue(const StepQueue &) = delete;
    StepQueue & operator=(const StepQueue &) = delete;

    // Queues `item`, a step of `tokens` positions of session `key` opened by `member`. `own`: a step this
    // worker made itself (it never waits behind a bound). Moved from only when queued: refused, the caller
    // still has it (to answer its sender) and the bound is named.
    Pushed push(const Key & key, const std::string & member, Item && item, int64_t tokens, bool own) {
        std::lock_guard<std::mutex> g(mu_);
        auto it = q_.find(key);
        if (!own) {
            if (n_ >= b_.max_queued_steps) return {Refused::worker_full, n_};
            if (b_.max_queued_steps_per_member > 0) {
                auto m = per_member_.find(member);
                if (m != per_member_.end() && m->second >= b_.max_queued_steps_per_member)
                    return {Refused::member_full, m->second};
            }
            if (it != q_.end() && int64_t(it->second.steps.size()) >= b_.max_session_steps)
                return {Refused::session_full, int64_t(it->second.steps.size())};
        }
        if (it == q_.end()) {
            order_.push_back(key);
            it = q_.emplace(key, Queued{member, {}}).first;
        }
        it->second.steps.emplace_back(tokens, std::move(item));
        ++n_;
        if (b_.max_queued_steps_per_member > 0) ++per_member_[member];
        return {};
    }

    // One batch: the first step of each session with steps queued, sessions taken round robin (those served
    // go to the back), until the next would pass `max_tokens` positions or `max_sessions` sessions. A batch
    // holds at least one step whenever one is queued, however long it is.
    std::vector<Item> take(int64_t max_tokens, int64_t max_sessions) {
        std::lock_guard<std::mutex> g(mu_);
        std::vector<Item> batch;
        int64_t tokens = 0;
        std::deque<Key> kept, served;
        for (auto & key : order_) {
            auto it = q_.find(key);
            if (it == q_.end() || it->second.steps.empty()) continue;   // dropped while queued
            const int64_t n = it->second.steps.front().first;
            if (!batch.empty() && (tokens + n > max_tokens || int64_t(batch.size()) >= max_sessions)) {
                kept.push_back(key);
                continue;
            }
            batch.push_back(std::move(it->second.steps.front().second));
            it->second.steps.pop_front();
            tokens += n;
            --n_;
            gone(it->second.member, 1);
            if (it->second.steps.empty()) q_.erase(it);
            else served.push_back(key);
        }
        kept.insert(kept.end(), served.begin(), served.end());
        order_.swap(kept);
        return batch;
    }

    // A closed session's queued steps are forgotten: how many there were.
    int64_t drop(const Key & key) {
        std::lock_guard<std::mutex> g(mu_);
        auto it = q_.find(key);
        if (it == q_.end()) return 0;
        const int64_t n = int64_t(it->second.steps.size());
        n_ -= n;
        gone(it->second.member, n);
        q_.erase(it);
        order_.erase(std::remove(order_.begin(), order_.end(), key), order_.end());   // queued again later: once
        return n;
    }

    bool has(const Key & key) const {
        std::lock_guard<std::mutex> g(mu_);
        return q_.count(key) != 0;
    }
    int64_t steps() const {                          // queued, every session
        std::lock_guard<std::mutex> g(mu_);
        return n_;
    }
    size_t sessions() const {                        // sessions with steps queued
        std::lock_guard<std::mutex> g(mu_);
        return q_.size();
    }
    int64_t member_steps(const std::string & member) const {   // counted only under the per-member bound
        std::lock_guard<std::mutex> g(mu_);
        auto m = per_member_.find(member);
        return m == per_member_.end() ? 0 : m->second;
    }
    const StepBounds & bounds() const { return b_; }

  private:
    struct Queued {
        std::string member;
        std::deque<std::pair<int64_t, Item>> steps;  // (positions, step), oldest first
    };
    void gone(const std::string & member, int64_t n) {   // mu_ held: n of member's steps left
        if (b_.max_queued_steps_per_member <= 0) return;
        auto m = per_member_.find(member);
        if (m != per_member_.end() && (m->second -= n) <= 0) per_member_.erase(m);
    }

    const StepBounds b_;
    mutable std::mutex mu_;                          // guards everything below; a leaf
    std::map<Key, Queued> q_;
    std::deque<Key> order_;                          // sessions with steps queued, round robin
    int64_t n_ = 0;
    std::map<std::string, int64_t> per_member_;      // steps queued per member (a member at 0 is erased)
};

}  // namespace dgr
