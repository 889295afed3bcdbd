// The step queue alone (step_queue.h): its bounds, its round robin, its batches' budget, a dropped session.
// No gRPC, no engine: `bazel test //worker/server:step_queue_test`, or the CMake target dgr-worker-unit-tests
// (tests/worker/test_worker_units.py builds and runs it).
#include "unit_check.h"
#include "engine_loop/step_queue.h"

#include <cstdio>
#include <cstdlib>
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
using Queue = dgr::StepQueue<Key, Step>;
using Refused = Queue::Refused;

Key k(const std::string & s) { return {s, 1}; }

std::vector<std::string> names(const std::vector<Step> & batch) {
    std::vector<std::string> out;
    for (auto & s : batch) out.push_back(s.session + std::to_string(s.n));
    return out;
}

void bounds_refuse_and_name_themselves() {
    Queue q({/*max_queued_steps=*/4, /*max_session_steps=*/2, /*max_queued_steps_per_member=*/3});
    CHECK(q.push(k("a"), "m1", {"a", 0}, 1, false).refused == Refused::none);
    CHECK(q.push(k("a"), "m1", {"a", 1}, 1, false).refused == Refused::none);
    auto r = q.push(k("a"), "m1", {"a", 2}, 1, false);          // a session holds at most 2
    CHECK(r.refused == Refused::session_full && r.queued == 2);
    CHECK(q.push(k("b"), "m1", {"b", 0}, 1, false).refused == Refused::none);
    r = q.push(k("c"), "m1", {"c", 0}, 1, false);               // m1 holds at most 3
    CHECK(r.refused == Refused::member_full && r.queued == 3);
    CHECK(q.member_steps("m1") == 3);
    CHECK(q.push(k("d"), "m2", {"d", 0}, 1, false).refused == Refused::none);   // another member is served
    r = q.push(k("e"), "m3", {"e", 0}, 1, false);               // the worker holds at most 4
    CHECK(r.refused == Refused::worker_full && r.queued == 4);
    CHECK(q.push(k("e"), "m3", {"e", 0}, 1, true).refused == Refused::none);    // the worker's own: never refused
    CHECK(q.steps() == 5 && q.sessions() == 4);
}

void a_refused_step_stays_with_its_caller() {
    Queue q({1, 8, 0});
    Step first{"a", 0}, second{"b", 7};
    CHECK(q.push(k("a"), "m", std::move(first), 1, false).refused == Refused::none);
    CHECK(q.push(k("b"), "m", std::move(second), 1, false).refused == Refused::worker_full);
    CHECK(second.session == "b" && second.n == 7);             // not moved from: the caller answers its sender
}

void per_member_off_counts_nothing() {
    Queue q({8, 8, 0});
    for (int i = 0; i < 6; ++i) CHECK(q.push(k("a" + std::to_string(i)), "m", {"a", i}, 1, false).refused == Refused::none);
    CHECK(q.member_steps("m") == 0);                           // off: not counted at all
}

void batches_are_round_robin_one_step_per_session() {
    Queue q({64, 64, 0});
    for (int i = 0; i < 3; ++i) q.push(k("a"), "m", {"a", i}, 1, false);
    q.push(k("b"), "m", {"b", 0}, 1, false);
    q.push(k("c"), "m", {"c", 0}, 1, false);
    // one step per session per batch, in arrival order
    CHECK((names(q.take(100, 100)) == std::vector<std::string>{"a0", "b0", "c0"}));
    q.push(k("b"), "m", {"b", 1}, 1, false);
    // a, served, went behind those not served; b is queued again behind it
    CHECK((names(q.take(100, 100)) == std::vector<std::string>{"a1", "b1"}));
    CHECK((names(q.take(100, 100)) == std::vector<std::string>{"a2"}));
    CHECK(q.take(100, 100).empty() && q.steps() == 0 && q.sessions() == 0);
}

void a_batch_keeps_its_budget_and_never_starves() {
    Queue q({64, 64, 0});
    q.push(k("long"), "m", {"long", 0}, 300, false);
    q.push(k("x"), "m", {"x", 0}, 100, false);
    q.push(k("y"), "m", {"y", 0}, 1, false);
    // the first step is taken however long; then only what fits in 256 positions
    CHECK((names(q.take(256, 64)) == std::vector<std::string>{"long0"}));
    CHECK((names(q.take(256, 64)) == std::vector<std::string>{"x0", "y0"}));
    for (int i = 0; i < 5; ++i) q.push(k("s" + std::to_string(i)), "m", {"s", i}, 1, false);
    CHECK(q.take(256, 2).size() == 2);                          // at most 2 sessions a batch
    CHECK(q.take(256, 2).size() == 2);
    CHECK(q.take(256, 2).size() == 1);
}

void a_dropped_session_leaves_nothing_behind() {
    Queue q({64, 64, 8});
    q.push(k("a"), "m", {"a", 0}, 1, false);
    q.push(k("a"), "m", {"a", 1}, 1, false);
    q.push(k("b"), "m", {"b", 0}, 1, false);
    CHECK(q.drop(k("a")) == 2 && q.drop(k("a")) == 0);
    CHECK(!q.has(k("a")) && q.has(k("b")) && q.steps() == 1 && q.member_steps("m") == 1);
    q.push(k("a"), "m", {"a", 2}, 1, false);                    // queued again: once in the round, not twice
    CHECK((names(q.take(100, 100)) == std::vector<std::string>{"b0", "a2"}));
    CHECK(q.member_steps("m") == 0 && q.steps() == 0);
}

void threads_share_it() {
    Queue q({1 << 20, 1 << 20, 1 << 20});
    std::vector<std::thread> ts;
    for (int t = 0; t < 4; ++t) {
        ts.emplace_back([&q, t] {
            for (int i = 0; i < 1000; ++i) q.push(k("s" + std::to_string(t)), "m" + std::to_string(t), {"s", i}, 1, false);
        });
    }
    int64_t taken = 0;
    while (taken < 4000) taken += int64_t(q.take(1 << 20, 1 << 20).size());
    for (auto & t : ts) t.join();
    CHECK(taken == 4000 && q.steps() == 0 && q.member_steps("m0") == 0);
}

}  // namespace

int main() {
    bounds_refuse_and_name_themselves();
    a_refused_step_stays_with_its_caller();
    per_member_off_counts_nothing();
    batches_are_round_robin_one_step_per_session();
    a_batch_keeps_its_budget_and_never_starves();
    a_dropped_session_leaves_nothing_behind();
    threads_share_it();
    return dgr::unit::finish("step_queue_test");
}
