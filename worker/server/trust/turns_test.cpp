// Slots that members take turns at (turns.h) alone, as a member flooding them would try: one member's many
// callers queued before another's one (the other's goes next, not after the flood), three members' callers
// queued in bursts (served in rotation), a member alone (takes every slot without waiting), a moved turn (given
// back once), and 8 threads of 4 members taking and giving back at once (never more than the slots, nothing
// left). No gRPC, no engine. `bazel test //worker/server:turns_test`, or the CMake target dgr-unit-turns_test
// (tests/worker/test_worker_units.py builds and runs it).
#include "unit_check.h"
#include "trust/turns.h"

#include <atomic>
#include <chrono>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace {

using dgr::FairTurns;

void wait_for_waiting(const FairTurns & t, size_t n) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (t.waiting() < n && std::chrono::steady_clock::now() < until) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    CHECK(t.waiting() == n);
}

// With the one slot held, `bursts` callers queue in that order (each waiting before the next comes); the slot is
// then given back. Returns the members in the order they were served.
std::string served_after(const std::vector<char> & bursts) {
    FairTurns t(1);
    std::optional<FairTurns::Turn> first(t.take("x"));
    std::mutex mu;
    std::string order;
    std::vector<std::thread> ts;
    for (size_t i = 0; i < bursts.size(); ++i) {
        const char m = bursts[i];
        ts.emplace_back([&, m] {
            auto turn = t.take(std::string(1, m));
            std::lock_guard<std::mutex> g(mu);
            order += m;                          // served one at a time: this is the order of the grants
        });
        wait_for_waiting(t, i + 1);
    }
    first.reset();
    for (auto & th : ts) th.join();
    CHECK(t.held() == 0 && t.waiting() == 0);
    return order;
}

void another_members_caller_goes_before_a_floods_rest() {
    const std::string got = served_after({'a', 'a', 'a', 'a', 'a', 'a', 'a', 'a', 'b'});
    CHECK(got == "abaaaaaaa");
    if (got != "abaaaaaaa") std::fprintf(stderr, "  served %s\n", got.c_str());
}

void three_members_are_served_in_rotation() {
    const std::string got = served_after({'a', 'a', 'a', 'b', 'b', 'b', 'c', 'c', 'c'});
    CHECK(got == "abcabcabc");
    if (got != "abcabcabc") std::fprintf(stderr, "  served %s\n", got.c_str());
}

void a_member_alone_takes_every_slot_without_waiting() {
    FairTurns t(2);
    auto one = t.take("a");
    auto two = t.take("a");
    CHECK(t.held() == 2 && t.waiting() == 0);
}

void a_moved_turn_is_given_back_once() {
    FairTurns t(1);
    {
        auto one = t.take("a");
        FairTurns::Turn moved(std::move(one));
        CHECK(t.held() == 1);
    }
    CHECK(t.held() == 0);
    auto again = t.take("b");                    // the slot is free again, and only one was given back
    CHECK(t.held() == 1);
}

void eight_threads_never_hold_more_than_the_slots() {
    FairTurns t(2);
    std::atomic<int> in{0}, most{0}, served{0};
    std::vector<std::thread> ts;
    for (int k = 0; k < 8; ++k) {
        ts.emplace_back([&, k] {
            for (int i = 0; i < 500; ++i) {
                auto turn = t.take("member-" + std::to_string(k % 4));
                const int now = ++in;
                int m = most.load();
                while (now > m && !most.compare_exchange_weak(m, now)) {}
                ++served;
                --in;
            }
        });
    }
    for (auto & th : ts) th.join();
    CHECK(most <= 2);
    CHECK(served == 8 * 500);
    CHECK(t.held() == 0 && t.waiting() == 0);
}

}  // namespace

int main() {
    another_members_caller_goes_before_a_floods_rest();
    three_members_are_served_in_rotation();
    a_member_alone_takes_every_slot_without_waiting();
    a_moved_turn_is_given_back_once();
    eight_threads_never_hold_more_than_the_slots();
    return dgr::unit::finish("turns_test");
}
