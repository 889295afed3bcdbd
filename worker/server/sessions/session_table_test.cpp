// The session table alone (session_table.h): the epoch rules OpenSession and frames rely on, expiry by
// --session-ttl, stage 0's wire_down index (one member's id never names another's session), a close removing
// every index, the counts per member and in all, and threads sharing it. No gRPC, no engine: `bazel test
// //worker/server:session_table_test`, or the CMake target dgr-worker-unit-tests (tests/worker/test_worker_units.py
// builds and runs it).
#include "unit_check.h"
#include "sessions/names.h"
#include "sessions/session_table.h"

#include <atomic>
#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace {

struct Session {
    std::string name;
};
using Table = dgr::SessionTable<Session>;
using Key = Table::Key;
using Refused = Table::Refused;
using Clock = Table::Clock;
using dgr::SessionNames;

const Clock::time_point T0 = Clock::now();
Clock::time_point at(double s) { return T0 + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s)); }

std::shared_ptr<Session> sess(const std::string & name) { return std::make_shared<Session>(Session{name}); }

// open as the worker does: admitted, its older epochs closed, then inserted
Refused open(Table & t, const Key & k, const std::string & owner = "", int64_t per_member = 0, int64_t max = 8,
             const std::string & wire = "", double when = 0) {
    auto a = t.admit(k, owner, per_member, max);
    if (a.refused != Refused::none) return a.refused;
    for (auto & old : a.older) t.erase(old);
    t.insert(k, sess(k.first + "@" + std::to_string(k.second)), owner, wire, at(when));
    return Refused::none;
}

void an_older_or_open_epoch_is_stale_and_a_newer_one_replaces_it() {
    Table t;
    CHECK(!t.latest_epoch("s"));
    CHECK(open(t, {"s", 2}) == Refused::none);
    CHECK(t.latest_epoch("s") == 2u);
    // the same epoch again, or an older one: refused, naming the epoch the id is at
    auto a = t.admit({"s", 2}, "", 0, 8);
    CHECK(a.refused == Refused::stale_epoch && a.at == 2);
    a = t.admit({"s", 1}, "", 0, 8);
    CHECK(a.refused == Refused::stale_epoch && a.at == 2);
    // a newer one is admitted with the open ones to close first; the old one is gone, the id at the new epoch
    a = t.admit({"s", 5}, "", 0, 8);
    CHECK(a.refused == Refused::none && a.older.size() == 1 && a.older[0] == Key("s", 2));
    CHECK(open(t, {"s", 5}) == Refused::none);
    CHECK(!t.find({"s", 2}) && t.find({"s", 5}) && t.find({"s", 5})->name == "s@5");
    CHECK(t.latest_epoch("s") == 5u && t.size() == 1);
    // another id's epochs are its own
    CHECK(open(t, {"s2", 1}) == Refused::none && t.latest_epoch("s2") == 1u && t.latest_epoch("s") == 5u);
    // once no epoch of it is open the id is forgotten: any epoch opens again (the client restarts it)
    CHECK(t.erase({"s", 5}) && !t.latest_epoch("s"));
    CHECK(open(t, {"s", 1}) == Refused::none);
    // closing what is not open answers nothing and keeps an open epoch's latest
    CHECK(!t.erase({"s", 9}) && t.latest_epoch("s") == 1u);
}

void the_worker_bound_leaves_out_the_ids_own_epochs() {
    Table t;
    CHECK(open(t, {"a", 1}, "", 0, 2) == Refused::none);
    CHECK(open(t, {"b", 1}, "", 0, 2) == Refused::none);
    CHECK(open(t, {"c", 1}, "", 0, 2) == Refused::worker_full);
    CHECK(t.size() == 2 && !t.find({"c", 1}));
    // a newer epoch of an open id takes its own place: not refused at the bound
    CHECK(open(t, {"a", 2}, "", 0, 2) == Refused::none && t.size() == 2);
}

void each_member_holds_at_most_its_bound_and_counts_fall_with_closes() {
    SessionNames n(true);
    Table t;
    auto k = [&](const std::string & member, const std::string & id, uint64_t e) { return Key{n.key(member, id), e}; };
    auto own = [&](const Key & key) { return n.owner_of(key.first); };
    CHECK(open(t, k("alice", "x", 1), own(k("alice", "x", 1)), 2) == Refused::none);
    CHECK(open(t, k("alice", "y", 1), own(k("alice", "y", 1)), 2) == Refused::none);
    auto a = t.admit(k("alice", "z", 1), "alice", 2, 8);
    CHECK(a.refused == Refused::member_full && a.member_held == 2);
    // bob is not alice: his sessions are counted apart
    CHECK(open(t, k("bob", "x", 1), "bob", 2) == Refused::none);
    CHECK(t.member_count("alice") == 2 && t.member_count("bob") == 1 && t.size() == 3);
    // a newer epoch of alice's own id is not a third session
    CHECK(open(t, k("alice", "x", 2), "alice", 2) == Refused::none && t.member_count("alice") == 2);
    // no bound (0): not refused, still counted
    CHECK(open(t, k("alice", "z", 1), "alice", 0) == Refused::none && t.member_count("alice") == 3);
    t.erase(k("alice", "z", 1));
    t.erase(k("alice", "y", 1));
    CHECK(t.member_count("alice") == 1);
    CHECK(open(t, k("alice", "z", 1), "alice", 2) == Refused::none);
    t.erase(k("bob", "x", 1));
    CHECK(t.member_count("bob") == 0);
}

void the_wire_down_index_names_only_the_session_stage_0_gave_it() {
    SessionNames n(true);
    Table t;
    // two members open sessions under the same id: two keys, each its own wire_down id
    const Key ka{n.key(std::string("alice"), "chat"), 1}, kb{n.key(std::string("bob"), "chat"), 1};
    const std::string wa = SessionNames::wire_down("chat"), wb = SessionNames::wire_down("chat");
    CHECK(open(t, ka, "alice", 0, 8, wa) == Refused::none);
    CHECK(open(t, kb, "bob", 0, 8, wb) == Refused::none);
    CHECK(t.origin_key(wa) == ka.first && t.origin_key(wb) == kb.first);
    // what a member names itself, its id or another's key, resolves to nothing
    CHECK(t.origin_key("chat").empty() && t.origin_key(ka.first).empty() && t.origin_key(kb.first).empty());
    CHECK(t.origin_key("").empty());
    // a session without a wire_down id (a later stage, plaintext) is not in the index
    CHECK(open(t, {"plain", 1}) == Refused::none && t.origin_key("plain").empty());
    // alice's newer epoch comes with a new wire_down id: the old one names nothing any more
    const std::string wa2 = SessionNames::wire_down("chat");
    CHECK(open(t, {ka.first, 2}, "alice", 0, 8, wa2) == Refused::none);
    CHECK(t.origin_key(wa).empty() && t.origin_key(wa2) == ka.first && t.origin_key(wb) == kb.first);
    // a replaced entry under one key leaves its wire_down id behind it
    const std::string wb2 = SessionNames::wire_down("chat");
    t.insert(kb, sess("again"), "bob", wb2, at(0));
    CHECK(t.origin_key(wb).empty() && t.origin_key(wb2) == kb.first && t.member_count("bob") == 1 && t.size() == 3);
}

void a_close_removes_every_index() {
    Table t;
    CHECK(open(t, {"s", 3}, "m", 0, 8, "s#w") == Refused::none);
    auto s = t.find({"s", 3});
    auto gone = t.erase({"s", 3});
    CHECK(gone == s && gone->name == "s@3");
    CHECK(!t.find({"s", 3}) && !t.latest_epoch("s") && t.origin_key("s#w").empty());
    CHECK(t.member_count("m") == 0 && t.size() == 0);
    CHECK(t.expired(at(1e6), 1).empty() && t.longest_idle_s(at(1e6)) == 0);
    int seen = 0;
    t.for_each([&](const Key &, const Table::Ptr &) { ++seen; });
    CHECK(seen == 0);
    // erased twice: nothing the second time
    CHECK(!t.erase({"s", 3}));
}

void idle_sessions_expire_after_the_ttl_and_a_step_keeps_one_alive() {
    Table t;
    CHECK(open(t, {"a", 1}, "", 0, 8, "", 0) == Refused::none);
    CHECK(open(t, {"b", 1}, "", 0, 8, "", 5) == Refused::none);
    CHECK(t.longest_idle_s(at(10)) == 10);
    CHECK(t.expired(at(10), 10).empty());                 // idle exactly the ttl: not yet (more than it)
    auto e = t.expired(at(10.5), 10);
    CHECK(e.size() == 1 && e[0].first == Key("a", 1) && e[0].second == t.find({"a", 1}));
    // a step that ran for it counts as use
    t.touch({"a", 1}, t.find({"a", 1}), at(9));
    CHECK(t.expired(at(10.5), 10).empty());
    CHECK(t.expired(at(19.5), 10).size() == 2);
    // a step of a session closed meanwhile touches nothing, not even a later one under the same key
    auto old = t.find({"b", 1});
    t.erase({"b", 1});
    CHECK(open(t, {"b", 1}, "", 0, 8, "", 1) == Refused::none);
    t.touch({"b", 1}, old, at(20));
    e = t.expired(at(12), 10);
    CHECK(e.size() == 1 && e[0].first == Key("b", 1));
    // expiry reports; it closes nothing (the worker reaps those without steps queued)
    CHECK(t.size() == 2);
}

void threads_share_it() {
    Table t;
    std::atomic<bool> stop{false};
    std::thread reader([&] {
        while (!stop) {
            (void) t.find({"k0", 1});
            (void) t.size();
            (void) t.expired(at(100), 1);
            t.for_each([](const Key &, const Table::Ptr & s) { (void) s->name; });
        }
    });
    std::vector<std::thread> openers;
    for (int w = 0; w < 4; ++w) {
        openers.emplace_back([&, w] {
            for (int i = 0; i < 200; ++i) {
                const Key k{"k" + std::to_string(w), uint64_t(i + 1)};
                CHECK(open(t, k, "m" + std::to_string(w), 0, 64, "w" + std::to_string(w) + "#" + std::to_string(i)) ==
                      Refused::none);
            }
        });
    }
    for (auto & o : openers) o.join();
    stop = true;
    reader.join();
    CHECK(t.size() == 4);
    for (int w = 0; w < 4; ++w) {
        const std::string id = "k" + std::to_string(w);
        CHECK(t.latest_epoch(id) == 200u && t.member_count("m" + std::to_string(w)) == 1);
        CHECK(t.origin_key("w" + std::to_string(w) + "#199") == id && t.origin_key("w" + std::to_string(w) + "#0").empty());
    }
}

}  // namespace

int main() {
    an_older_or_open_epoch_is_stale_and_a_newer_one_replaces_it();
    the_worker_bound_leaves_out_the_ids_own_epochs();
    each_member_holds_at_most_its_bound_and_counts_fall_with_closes();
    the_wire_down_index_names_only_the_session_stage_0_gave_it();
    a_close_removes_every_index();
    idle_sessions_expire_after_the_ttl_and_a_step_keeps_one_alive();
    threads_share_it();
    return dgr::unit::finish("session_table_test");
}
