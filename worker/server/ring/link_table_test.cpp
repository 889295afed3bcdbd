// The link table alone (link_table.h): one link per peer address however many threads ask at once, a broken
// link never handed out again and kept until gRPC is done with it, pruning what no open session goes to (so
// addresses a member names do not pile up), and stopping. No gRPC: `bazel test //worker/server:link_table_test`,
// or the CMake target dgr-worker-unit-tests (tests/worker/test_worker_units.py builds and runs it).
#include "unit_check.h"
#include "ring/link_table.h"

#include <atomic>
#include <cstdio>
#include <functional>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

namespace {

struct FakeLink {
    std::string address;
    std::atomic<bool> is_idle{true}, is_done{false};
    explicit FakeLink(std::string a) : address(std::move(a)) {}
    bool idle() { return is_idle; }
    bool done() { return is_done; }
};
struct FakeChannel {
    std::string address;
};
using Table = dgr::LinkTable<FakeLink, FakeChannel>;
using LinkPtr = Table::LinkPtr;

std::atomic<int> made{0};
std::function<LinkPtr()> maker(const std::string & address) {
    return [address] {
        ++made;
        return std::make_shared<FakeLink>(address);
    };
}

void one_link_per_address() {
    Table t;
    LinkPtr lost;
    LinkPtr a = t.open("10.0.0.1:7001", maker("10.0.0.1:7001"), &lost);
    CHECK(a && a->address == "10.0.0.1:7001" && !lost);
    CHECK(t.open("10.0.0.1:7001", maker("10.0.0.1:7001"), &lost) == a && !lost);   // kept: not made again
    LinkPtr b = t.open("10.0.0.2:7002", maker("10.0.0.2:7002"), &lost);
    CHECK(b && b != a && t.find("10.0.0.2:7002") == b && t.find("10.0.0.3:7003") == nullptr);
    CHECK(t.live().size() == 2 && t.size() == 2);
}

void a_broken_link_is_never_handed_out_again() {
    Table t;
    LinkPtr lost;
    LinkPtr a = t.open("h:1", maker("h:1"), &lost);
    t.retire("h:1", a.get());
    CHECK(t.find("h:1") == nullptr && t.live().empty() && t.size() == 1);   // kept until done
    LinkPtr a2 = t.open("h:1", maker("h:1"), &lost);
    CHECK(a2 && a2 != a);
    t.retire("h:1", a.get());                        // the old one again: the new one stays
    CHECK(t.find("h:1") == a2);
    auto stopped = t.stop();
    CHECK(stopped.size() == 2);                      // the broken one is closed at stop too
}

void prune_drops_what_no_session_uses() {
    Table t;
    LinkPtr lost;
    LinkPtr used = t.open("used:1", maker("used:1"), &lost);
    LinkPtr busy = t.open("busy:1", maker("busy:1"), &lost);
    LinkPtr idle = t.open("idle:1", maker("idle:1"), &lost);
    LinkPtr broken = t.open("broken:1", maker("broken:1"), &lost);
    busy->is_idle = false;
    t.retire("broken:1", broken.get());
    t.channel("used:1", [] { return std::make_shared<FakeChannel>(FakeChannel{"used:1"}); });
    t.channel("gone:1", [] { return std::make_shared<FakeChannel>(FakeChannel{"gone:1"}); });
    CHECK(t.size() == 6);
    auto p = t.prune({"used:1"});
    // the idle link and the channel to an address nobody uses; the broken link waits until gRPC is done with it
    CHECK(p.links.size() == 1 && p.links[0] == idle);
    CHECK(p.channels.size() == 1 && p.channels[0]->address == "gone:1");
    CHECK(t.find("used:1") == used && t.find("busy:1") == busy && t.find("idle:1") == nullptr);
    broken->is_done = true;
    busy->is_idle = true;
    p = t.prune({"used:1"});
    CHECK(p.links.size() == 2 && p.channels.empty() && t.size() == 2);
    // a channel once pruned is made again when asked for
    int n = 0;
    auto c = t.channel("gone:1", [&] { ++n; return std::make_shared<FakeChannel>(FakeChannel{"gone:1"}); });
    CHECK(c && n == 1 && t.channel("gone:1", [&] { ++n; return nullptr; }) == c && n == 1);
}

void stopped_it_opens_nothing() {
    Table t;
    LinkPtr lost;
    t.open("h:1", maker("h:1"), &lost);
    CHECK(t.stop().size() == 1);
    const int before = made;
    CHECK(t.open("h:2", maker("h:2"), &lost) == nullptr && t.find("h:2") == nullptr);
    CHECK(made == before && !lost);                  // not even made
    // one being made while the table stops is handed back to be closed, never kept
    Table u;
    LinkPtr late = u.open("h:3", [&] { u.stop(); return std::make_shared<FakeLink>("h:3"); }, &lost);
    CHECK(late == nullptr && lost && lost->address == "h:3" && u.size() == 0);
    auto all = t.clear();
    CHECK(all.links.size() == 1 && t.size() == 0 && t.live().empty());
}

void threads_asking_at_once_share_one_link() {
    Table t;
    constexpr int N = 8;
    std::vector<LinkPtr> got(N), lost(N);
    std::atomic<bool> go{false};
    const int made_before = made;
    std::vector<std::thread> ts;
    for (int i = 0; i < N; ++i) {
        ts.emplace_back([&, i] {
            while (!go) std::this_thread::yield();
            got[i] = t.open("h:1", maker("h:1"), &lost[i]);
        });
    }
    go = true;
    for (auto & th : ts) th.join();
    int losers = 0;
    for (int i = 0; i < N; ++i) {
        CHECK(got[i] == got[0]);                     // every thread sends on the one link kept
        if (lost[i]) {
            ++losers;
            CHECK(lost[i] != got[0]);
        }
    }
    CHECK(t.live().size() == 1 && made - made_before == 1 + losers);   // each loser made one, handed back
    // the race made certain: while this thread makes its link, another keeps one for the address first
    Table u;
    LinkPtr first, outer_lost, inner_lost;
    LinkPtr kept = u.open("h:2", [&] {
        first = u.open("h:2", maker("h:2"), &inner_lost);
        return std::make_shared<FakeLink>("h:2");
    }, &outer_lost);
    CHECK(kept && kept == first && !inner_lost && outer_lost && outer_lost != kept && u.live().size() == 1);
    // the loser is buried, not waited for: kept with the broken ones until done, never handed out
    FakeLink * loser = outer_lost.get();
    u.bury(std::move(outer_lost));
    CHECK(u.find("h:2") == kept && u.size() == 2 && u.prune({}).links.empty() == false);   // kept is idle: pruned
    LinkPtr again = u.open("h:2", maker("h:2"), &inner_lost);
    CHECK(again != kept && u.size() == 2);          // the new link and the buried loser, not yet done
    CHECK(u.prune({"h:2"}).links.empty());
    loser->is_done = true;
    auto p = u.prune({"h:2"});
    CHECK(p.links.size() == 1 && p.links[0].get() == loser && u.size() == 1);
    std::printf("link_table_test: %d of %d threads made a link another thread's beat\n", losers, N);
}

}  // namespace

int main() {
    one_link_per_address();
    a_broken_link_is_never_handed_out_again();
    prune_drops_what_no_session_uses();
    stopped_it_opens_nothing();
    threads_asking_at_once_share_one_link();
    return dgr::unit::finish("link_table_test");
}
