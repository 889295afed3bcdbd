// The scheduler alone (scheduler.h): which thread runs a batch, that one batch runs at a time, --hold-batch,
// the jobs' order, a refusal's retry hint, and stopping. No gRPC, no engine: `bazel test
// //worker/server:scheduler_test`, or the CMake target dgr-worker-unit-tests (tests/worker/test_worker_units.py).
#include "unit_check.h"
#include "engine_loop/scheduler.h"

#include <atomic>
#include <chrono>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace {

using Key = std::pair<std::string, uint64_t>;
struct Step {
    std::string session;
    int n;
};
using Sched = dgr::StepScheduler<Key, Step>;
using Refused = Sched::Refused;
using namespace std::chrono_literals;

Key k(const std::string & s) { return {s, 1}; }

// What the scheduler's owner sees: every batch, on which thread, and whether two ever ran at once.
struct Seen {
    std::mutex mu;
    std::vector<std::vector<std::string>> batches;
    std::vector<std::thread::id> threads;
    std::atomic<int> running{0};
    std::atomic<bool> overlapped{false};
    std::atomic<uint64_t> opened{0};
    std::atomic<size_t> open{0};
    std::chrono::milliseconds each{0};

    Sched::Owner owner() {
        return {[this](std::vector<Step> & batch) {
                    if (running.fetch_add(1) != 0) overlapped = true;
                    std::this_thread::sleep_for(each);
                    std::vector<std::string> names;
                    for (auto & s : batch) names.push_back(s.session + std::to_string(s.n));
                    {
                        std::lock_guard<std::mutex> g(mu);
                        batches.push_back(std::move(names));
                        threads.push_back(std::this_thread::get_id());
                    }
                    running.fetch_sub(1);
                },
                [this] { return std::pair<uint64_t, size_t>(opened.load(), open.load()); }};
    }
    size_t ran() {
        std::lock_guard<std::mutex> g(mu);
        size_t n = 0;
        for (auto & b : batches) n += b.size();
        return n;
    }
};

bool wait_until(const std::function<bool()> & f, std::chrono::milliseconds limit = 5000ms) {
    const auto end = std::chrono::steady_clock::now() + limit;
    while (!f()) {
        if (std::chrono::steady_clock::now() > end) return false;
        std::this_thread::sleep_for(1ms);
    }
    return true;
}

// A lone decode step read while the engine is idle runs on the reader's thread, before push returns; a prefill
// chunk, or a step of one of several sessions, goes to the engine thread.
void a_lone_short_step_runs_on_the_thread_that_read_it() {
    Seen seen;
    seen.open = 1;
    Sched s({64, 64, 0}, {512, 64, 0, 16}, seen.owner());
    s.start();
    CHECK(s.push(k("a"), "m", {"a", 0}, 1, false, true).refused == Refused::none);
    CHECK(seen.ran() == 1);                                        // ran before push returned
    CHECK(seen.threads.size() == 1 && seen.threads[0] == std::this_thread::get_id());
    CHECK(s.push(k("a"), "m", {"a", 1}, 64, false, true).refused == Refused::none);   // prefill: the engine's
    CHECK(wait_until([&] { return seen.ran() == 2; }));
    CHECK(seen.threads[1] != std::this_thread::get_id());
    seen.open = 2;                                                 // two sessions: their steps may batch
    CHECK(s.push(k("a"), "m", {"a", 2}, 1, false, true).refused == Refused::none);
    CHECK(wait_until([&] { return seen.ran() == 3; }));
    CHECK(seen.threads[2] != std::this_thread::get_id());
    CHECK(s.push(k("a"), "m", {"a", 3}, 1, false, false).refused == Refused::none);   // not a reader
    CHECK(wait_until([&] { return seen.ran() == 4; }));
    CHECK(seen.threads[3] != std::this_thread::get_id());
    s.stop();
    s.join();
}

// Readers and the engine thread never run two batches at once, and every step runs once.
void one_batch_at_a_time() {
    Seen seen;
    seen.open = 1;
    seen.each = 1ms;
    Sched s({1 << 20, 1 << 20, 0}, {512, 64, 0, 16}, seen.owner());
    s.start();
    std::vector<std::thread> readers;
    for (int t = 0; t < 4; ++t) {
        readers.emplace_back([&s, t] {
            for (int i = 0; i < 50; ++i) s.push(k("s" + std::to_string(t)), "m", {"s", i}, 1, false, true);
        });
    }
    for (auto & r : readers) r.join();
    CHECK(wait_until([&] { return seen.ran() == 200; }));
    CHECK(!seen.overlapped.load());
    s.stop();
    s.join();
}

// --hold-batch N: until N sessions have opened, a batch waits for N sessions' steps; after, for as many as are
// open (at most N)
void hold_batch_waits_for_sessions() {
    Seen seen;
    Sched s({64, 64, 0}, {512, 64, 2, 16}, seen.owner());
    s.start();
    seen.opened = 1, seen.open = 1;
    s.push(k("a"), "m", {"a", 0}, 1, false, false);
    std::this_thread::sleep_for(100ms);
    CHECK(seen.ran() == 0);                                        // held: one session of the 2
    seen.opened = 2, seen.open = 2;
    s.push(k("b"), "m", {"b", 0}, 1, false, false);
    CHECK(wait_until([&] { return seen.ran() == 2; }));
    CHECK(seen.batches.size() == 1 && seen.batches[0].size() == 2);   // one batch of both
    seen.open = 1;                                                 // b closed: a alone runs
    s.push(k("a"), "m", {"a", 1}, 1, false, false);
    CHECK(wait_until([&] { return seen.ran() == 3; }));
    s.stop();
    s.join();
}

// Jobs run on the engine thread, in the order given, after the batch running.
void jobs_run_in_order_on_the_engine_thread() {
    Seen seen;
    Sched s({64, 64, 0}, {512, 64, 0, 16}, seen.owner());
    s.start();
    std::mutex mu;
    std::vector<int> order;
    std::vector<std::thread::id> where;
    for (int i = 0; i < 20; ++i) {
        s.defer([&, i] {
            std::lock_guard<std::mutex> g(mu);
            order.push_back(i);
            where.push_back(std::this_thread::get_id());
        });
    }
    CHECK(wait_until([&] {
        std::lock_guard<std::mutex> g(mu);
        return order.size() == 20;
    }));
    for (int i = 0; i < 20; ++i) CHECK(order[size_t(i)] == i);
    CHECK(where[0] != std::this_thread::get_id());
    s.stop();
    s.join();
}

// A refused step stays with its caller, with the bound and a hint that grows with the queue and the pace.
void a_refusal_names_its_bound_and_when_to_retry() {
    Seen seen;
    Sched s({2, 8, 0}, {512, 64, 0, 16}, seen.owner());       // not started: nothing runs
    CHECK(s.push(k("a"), "m", {"a", 0}, 1, false, false).refused == Refused::none);
    CHECK(s.push(k("b"), "m", {"b", 0}, 1, false, false).refused == Refused::none);
    Step third{"c", 7};
    auto r = s.push(k("c"), "m", std::move(third), 1, false, false);
    CHECK(r.refused == Refused::worker_full && r.queued == 2);
    CHECK(third.session == "c" && third.n == 7);
    CHECK(r.retry_after_ms == 50);                                 // 1 ms x 3 batches: the floor
    s.note_batch(1000.0);                                          // batches now average 200.8 ms
    r = s.push(k("c"), "m", std::move(third), 1, false, false);
    CHECK(r.retry_after_ms == 602);                                // 200.8 ms x 3
    CHECK(s.drop(k("a")) == 1 && !s.has(k("a")) && s.steps() == 1);
    s.stop();
    s.join();
}

// Stopped, nothing more runs: queued steps stay unrun, a reader's step is queued, not run.
void nothing_runs_once_stopped() {
    Seen seen;
    seen.open = 1;
    Sched s({64, 64, 0}, {512, 64, 0, 16}, seen.owner());
    s.start();
    s.stop();
    s.join();
    CHECK(s.stopped());
    CHECK(s.push(k("a"), "m", {"a", 0}, 1, false, true).refused == Refused::none);
    s.defer([&] { seen.opened = 99; });
    std::this_thread::sleep_for(50ms);
    CHECK(seen.ran() == 0 && seen.opened == 0 && s.steps() == 1);
}

}  // namespace

int main() {
    a_lone_short_step_runs_on_the_thread_that_read_it();
    one_batch_at_a_time();
    hold_batch_waits_for_sessions();
    jobs_run_in_order_on_the_engine_thread();
    a_refusal_names_its_bound_and_when_to_retry();
    nothing_runs_once_stopped();
    return dgr::unit::finish("scheduler_test");
}
