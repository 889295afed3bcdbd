// The connection slots of --max-connections (connections.h) alone, as a hostile member would try them: filling
// every slot with connections of its own, then a new connection (refused, nothing counted, the count said), a
// connection already counted (never refused: it cannot be locked out by the others), slots freed only by a
// connection's last call, a give-back for a connection never counted (nothing), and 8 threads taking and giving
// back at once (the count ends at 0, never above max). No gRPC, no engine. `bazel test
// //worker/server:connections_test`, or the CMake target dgr-unit-connections_test (tests/worker/test_worker_units.py
// builds and runs it).
#include "unit_check.h"
#include "trust/connections.h"

#include <atomic>
#include <string>
#include <thread>
#include <vector>

namespace {

using dgr::ConnectionSlots;

void a_new_connection_past_max_is_refused_and_nothing_is_counted() {
    ConnectionSlots s(2);
    CHECK(s.take("ipv4:10.0.0.1:1"));
    CHECK(s.take("ipv4:10.0.0.1:2"));
    size_t held = 99;
    CHECK(!s.take("ipv4:10.0.0.9:1", &held));
    CHECK(held == 2);
    CHECK(s.size() == 2);
    CHECK(!s.take("ipv4:10.0.0.9:1"));                  // still refused: the refusal counted nothing
    CHECK(s.size() == 2 && s.max() == 2);
}

void a_connection_already_counted_is_never_refused() {
    ConnectionSlots s(1);
    CHECK(s.take("a"));
    for (int i = 0; i < 100; ++i) CHECK(s.take("a"));  // 101 calls of one connection hold one slot
    CHECK(s.size() == 1);
    CHECK(!s.take("b"));
}

void a_slot_is_freed_by_its_connections_last_call_only() {
    ConnectionSlots s(1);
    CHECK(s.take("a"));
    CHECK(s.take("a"));
    s.give_back("a");
    CHECK(s.size() == 1);
    CHECK(!s.take("b"));                               // one call of "a" still runs
    s.give_back("a");
    CHECK(s.size() == 0);
    CHECK(s.take("b"));
}

void giving_back_what_was_never_taken_changes_nothing() {
    ConnectionSlots s(1);
    s.give_back("stranger");
    CHECK(s.size() == 0);
    CHECK(s.take("a"));
    s.give_back("stranger");
    CHECK(s.size() == 1);
    CHECK(!s.take("b"));
}

void no_slot_means_every_new_connection_is_refused() {
    ConnectionSlots s(0);
    size_t held = 99;
    CHECK(!s.take("a", &held));
    CHECK(held == 0 && s.size() == 0);
}

void eight_threads_never_hold_more_than_max() {
    ConnectionSlots s(3);
    std::atomic<int> over{0}, taken{0};
    std::vector<std::thread> ts;
    for (int t = 0; t < 8; ++t) {
        ts.emplace_back([&, t] {
            const std::string peer = "peer-" + std::to_string(t % 5);
            for (int i = 0; i < 2000; ++i) {
                if (!s.take(peer)) continue;
                ++taken;
                if (s.size() > 3) ++over;
                s.give_back(peer);
            }
        });
    }
    for (auto & t : ts) t.join();
    CHECK(over == 0);
    CHECK(taken > 0);
    CHECK(s.size() == 0);
}

}  // namespace

int main() {
    a_new_connection_past_max_is_refused_and_nothing_is_counted();
    a_connection_already_counted_is_never_refused();
    a_slot_is_freed_by_its_connections_last_call_only();
    giving_back_what_was_never_taken_changes_nothing();
    no_slot_means_every_new_connection_is_refused();
    eight_threads_never_hold_more_than_max();
    return dgr::unit::finish("connections_test");
}
