// The prefix cache alone (prefix_cache.h): what the worker relies on when it files a closing session's state and
// looks one up for a new session. Entries answer the same prefix blocks and no others, never another owner's
// seed (docs/security.md "The prefix cache cannot be poisoned or read across members"), block_hashes is the
// Python chain, the byte budget evicts least recently used first, a newer state replaces an older one without
// costing a third, a budget of 0 keeps nothing, a hit outlives its entry, and threads share it.
// No gRPC, no engine: `bazel test //worker/server:prefix_cache_test`, or the CMake target dgr-worker-unit-tests
// (tests/worker/test_worker_units.py builds and runs it).
#include "unit_check.h"
#include "cache/prefix_cache.h"

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

namespace {

using dgr::PrefixCache;
constexpr uint32_t BT = 32;                          // PREFIX_BLOCK_TOKENS

std::vector<int32_t> seq(int32_t first, size_t n) {
    std::vector<int32_t> out(n);
    for (size_t i = 0; i < n; ++i) out[i] = first + int32_t(i);
    return out;
}

std::vector<std::string> blocks_of(const std::vector<int32_t> & ids, uint32_t bt = BT) {
    return PrefixCache::block_hashes(ids.data(), ids.size(), bt);
}

std::string hex(const std::string & b) {
    static const char * H = "0123456789abcdef";
    std::string out;
    for (unsigned char c : b) {
        out += H[c >> 4];
        out += H[c & 15];
    }
    return out;
}

// the state a hit carries, "" on a miss
std::string state_of(const PrefixCache::Hit & h) { return h.state ? *h.state : std::string(); }

bool found(PrefixCache & c, const std::string & seed, const std::vector<std::string> & blocks, uint32_t bt = BT) {
    return c.find(seed, blocks, bt).n_keep > 0;
}

void block_hashes_are_the_python_chain() {
    // dgr.runtime.wire.prefix.block_hashes(ids, 4) with ids = -3..6, INT32_MAX, INT32_MIN (worked out in Python)
    std::vector<int32_t> ids = seq(-3, 10);
    ids.push_back(INT32_MAX);
    ids.push_back(INT32_MIN);
    auto b = PrefixCache::block_hashes(ids.data(), ids.size(), 4);
    CHECK(b.size() == 3);
    if (b.size() == 3) {
        CHECK(hex(b[0]) == "2b2ab4109b527f5eddb91c05954d12e3");
        CHECK(hex(b[1]) == "27448180b6ccfb60dd9843470029defc");
        CHECK(hex(b[2]) == "749f8417f9de218968b93b74de86bf9d");
    }
    auto part = PrefixCache::block_hashes(ids.data(), 7, 4);   // only whole blocks; block 0 is the same
    CHECK(part.size() == 1 && !b.empty() && part[0] == b[0]);
    CHECK(PrefixCache::block_hashes(ids.data(), ids.size(), 0).empty());
    CHECK(PrefixCache::block_hashes(ids.data(), 3, 4).empty());
}

void entries_are_found_by_their_prefix_blocks_and_no_others() {
    PrefixCache c(1 << 20);
    const std::string seed = "m|1/0";
    const auto ran = seq(100, 100);                  // 3 whole blocks, 4 positions over
    const auto blocks = blocks_of(ran);
    CHECK(blocks.size() == 3);
    CHECK(c.put(seed, blocks, BT, "STATE", 100, ran) == 3);

    auto h = c.find(seed, blocks, BT);               // the same prompt: every block
    CHECK(h.n_keep == 96 && h.blocks == 3 && h.n_positions == 100 && state_of(h) == "STATE");
    CHECK(h.tokens && *h.tokens == ran);

    auto longer = seq(100, 64);                      // shares the first two blocks, then goes elsewhere
    for (int32_t t : seq(900, 64)) longer.push_back(t);
    h = c.find(seed, blocks_of(longer), BT);
    CHECK(h.n_keep == 64 && h.blocks == 2 && state_of(h) == "STATE");

    auto shorter = seq(100, 40);                     // one whole block of it
    h = c.find(seed, blocks_of(shorter), BT);
    CHECK(h.n_keep == 32 && h.blocks == 1);

    auto other = seq(100, 96);                       // one token differs in block 0: no block matches
    other[5] = 7;
    h = c.find(seed, blocks_of(other), BT);
    CHECK(h.n_keep == 0 && h.blocks == 0 && !h.state && !h.tokens);

    CHECK(!found(c, "m|2/0", blocks));               // another boundary dtype upstream
    CHECK(!found(c, "m|1/3", blocks));               // another seam layer
    CHECK(!found(c, seed, blocks, 16));              // the same bytes under another block size
    CHECK(!found(c, seed, {}));
    CHECK(!found(c, seed, blocks, 0));

    // only the blocks its positions cover are filed: 70 positions cover 2 of the 3 blocks named
    const auto ran2 = seq(5000, 96);
    const auto b2 = blocks_of(ran2);
    CHECK(c.put(seed, b2, BT, "TWO", 70, ran2) == 2);
    h = c.find(seed, b2, BT);
    CHECK(h.n_keep == 64 && h.blocks == 2 && h.n_positions == 70);
    // fewer positions than a block, no block size, nothing named: nothing is kept
    const auto before = c.stats();
    CHECK(c.put(seed, blocks_of(seq(7000, 64)), BT, "X", 31) == 0);
    CHECK(c.put(seed, blocks_of(seq(7000, 64)), 0, "X", 64) == 0);
    CHECK(c.put(seed, {}, BT, "X", 64) == 0);
    CHECK(c.stats().entries == before.entries && c.stats().bytes == before.bytes);
}

void an_owner_never_gets_another_owners_entry() {
    PrefixCache c(1 << 20);
    const auto blocks = blocks_of(seq(0, 64));
    // the worker's seeds: "<owner>|<dtype>/<layer>", "*" for --prefix-cache-shared at stage 0
    CHECK(c.put("alice|1/0", blocks, BT, "alice's", 64) == 2);
    CHECK(!found(c, "bob|1/0", blocks));
    CHECK(!found(c, "*|1/0", blocks));
    CHECK(!found(c, "|1/0", blocks));                // no mutual TLS: the one tenant's owner is ""
    CHECK(c.put("bob|1/0", blocks, BT, "bob's", 64) == 2);   // bob's own state for the same prompt
    CHECK(state_of(c.find("alice|1/0", blocks, BT)) == "alice's");   // replaces nothing of alice's
    CHECK(state_of(c.find("bob|1/0", blocks, BT)) == "bob's");
    CHECK(c.stats().entries == 2);

    // The cache's own promise is about seeds, whatever bytes they hold (a member's name is its certificate's
    // commonName, which may hold any byte): a seed that ends in the key's separators must not reach another
    // seed's entry. Seed "a", block size 1, block "2\0X" against seed "a\0" "1", block size 2, block "X".
    PrefixCache d(1 << 20);
    CHECK(d.put("a", {std::string("2\0X", 3)}, 1, "a's", 1) == 1);
    CHECK(state_of(d.find(std::string("a\0" "1", 3), {"X"}, 2)) == "");
}

void the_budget_evicts_the_least_recently_used() {
    PrefixCache c(300);
    const auto a = blocks_of(seq(0, 32)), b = blocks_of(seq(1000, 32)), cc = blocks_of(seq(2000, 32)),
               d = blocks_of(seq(3000, 32)), e = blocks_of(seq(4000, 32));
    const std::string s = "m|1/0", hundred(100, 'x');
    c.put(s, a, BT, hundred, 32);
    c.put(s, b, BT, hundred, 32);
    c.put(s, cc, BT, hundred, 32);
    auto st = c.stats();
    CHECK(st.capacity == 300 && st.bytes == 300 && st.entries == 3 && st.evicted == 0 && st.kept == 3);
    CHECK(found(c, s, a));                           // a is used: b is now the least recently used
    CHECK(!found(c, s, d));                          // a miss touches nothing
    c.put(s, d, BT, hundred, 32);
    CHECK(!found(c, s, b));
    CHECK(found(c, s, a) && found(c, s, cc) && found(c, s, d));
    st = c.stats();
    CHECK(st.bytes == 300 && st.entries == 3 && st.evicted == 1);

    // order now (most recent first): d, cc, a. 250 bytes need all three out
    CHECK(c.put(s, e, BT, std::string(250, 'y'), 32) == 1);
    CHECK(!found(c, s, a) && !found(c, s, cc) && !found(c, s, d) && found(c, s, e));
    st = c.stats();
    CHECK(st.bytes == 250 && st.entries == 1 && st.evicted == 4);

    // larger than the whole budget: not kept, and nothing is evicted for it
    CHECK(c.put(s, a, BT, std::string(301, 'z'), 32) == 0);
    CHECK(found(c, s, e) && !found(c, s, a));
    st = c.stats();
    CHECK(st.bytes == 250 && st.entries == 1 && st.evicted == 4);
    // exactly the budget fits
    CHECK(c.put(s, a, BT, std::string(300, 'z'), 32) == 1);
    CHECK(found(c, s, a) && !found(c, s, e) && c.stats().bytes == 300);
}

void a_newer_state_replaces_the_older_one() {
    PrefixCache c(1 << 20);
    const std::string s = "m|1/0";
    const auto turn2 = seq(0, 96);
    const auto b3 = blocks_of(turn2);
    const std::vector<std::string> b2(b3.begin(), b3.begin() + 2);
    CHECK(c.put(s, b2, BT, "turn one", 64) == 2);
    CHECK(c.put(s, b3, BT, "turn two!", 96) == 3);  // a second turn covers every block of the first
    auto st = c.stats();
    CHECK(st.entries == 1 && st.bytes == 9 && st.evicted == 0);   // the first is dropped, not counted as evicted
    CHECK(state_of(c.find(s, b2, BT)) == "turn two!");
    CHECK(c.find(s, b2, BT).n_keep == 64);

    // a shorter newer state takes the blocks it covers; the longer one still answers its last block
    const std::vector<std::string> b1(b3.begin(), b3.begin() + 1);
    CHECK(c.put(s, b1, BT, "short", 32) == 1);
    st = c.stats();
    CHECK(st.entries == 2 && st.bytes == 14);
    auto h = c.find(s, b1, BT);
    CHECK(state_of(h) == "short" && h.n_keep == 32);
    h = c.find(s, b2, BT);                           // block 1 is still the long state's
    CHECK(state_of(h) == "turn two!" && h.n_keep == 64 && h.n_positions == 96);
    h = c.find(s, b3, BT);
    CHECK(state_of(h) == "turn two!" && h.n_keep == 96);

    // A full cache: replacing an entry frees its own bytes; it must not push out an unrelated one first
    PrefixCache f(200);
    const auto u = blocks_of(seq(5000, 32)), a = blocks_of(seq(6000, 32));
    f.put(s, u, BT, std::string(100, 'u'), 32);     // the least recently used
    f.put(s, a, BT, std::string(100, 'a'), 32);
    CHECK(f.put(s, a, BT, std::string(100, 'A'), 32) == 1);   // a again, newer
    CHECK(state_of(f.find(s, a, BT)) == std::string(100, 'A'));
    CHECK(found(f, s, u));
    st = f.stats();
    CHECK(st.entries == 2 && st.bytes == 200 && st.evicted == 0);
}

void a_budget_of_zero_keeps_nothing() {
    PrefixCache c(0);
    const auto b = blocks_of(seq(0, 64));
    CHECK(c.put("m|1/0", b, BT, "s", 64) == 0);
    CHECK(c.put("m|1/0", b, BT, "", 64) == 0);      // not even a state of no bytes
    CHECK(!found(c, "m|1/0", b));
    auto st = c.stats();
    CHECK(st.capacity == 0 && st.bytes == 0 && st.entries == 0 && st.hits == 0 && st.lookups == 1);
}

void a_hit_outlives_its_entry() {
    // the worker restores a hit's state after find returns, outside the cache's lock: eviction meanwhile must
    // not pull the bytes from under it
    PrefixCache c(100);
    const auto a = blocks_of(seq(0, 32)), b = blocks_of(seq(100, 32));
    const auto ran = seq(0, 32);
    c.put("m|1/0", a, BT, std::string(100, 'a'), 32, ran);
    auto h = c.find("m|1/0", a, BT);
    c.put("m|1/0", b, BT, std::string(100, 'b'), 32);   // evicts a
    CHECK(!found(c, "m|1/0", a));
    CHECK(h.state && *h.state == std::string(100, 'a'));
    CHECK(h.tokens && *h.tokens == ran);
}

void the_counters_count() {
    PrefixCache c(1 << 20);
    const auto a = blocks_of(seq(0, 64));
    c.put("m|1/0", a, BT, "s", 64);
    c.find("m|1/0", a, BT);
    c.find("m|1/0", blocks_of(seq(9, 64)), BT);
    c.note_hit(40);
    c.note_hit(-5);                                  // never subtracts
    auto st = c.stats();
    CHECK(st.lookups == 2 && st.hits == 1 && st.hit_tokens == 40 && st.kept == 1);
}

void threads_share_it() {
    // 8 owners file and look up their own prompts at once, in a budget that forces evictions: every hit is the
    // owner's own and is the state filed for those blocks, and the bytes never pass the budget
    constexpr int THREADS = 8, ROUNDS = 400;
    constexpr uint64_t CAP = 64 * 40;
    PrefixCache c(CAP);
    std::atomic<int> bad{0}, over{0}, hits{0};
    std::atomic<uint64_t> kept{0};
    std::vector<std::thread> ts;
    for (int t = 0; t < THREADS; ++t) {
        ts.emplace_back([&, t] {
            const std::string seed = "owner" + std::to_string(t) + "|1/0";
            for (int r = 0; r < ROUNDS; ++r) {
                const int p = r % 5;                 // five prompts each, the same token ids for every owner
                const auto ran = seq(p * 1000, size_t(32 * (1 + r % 3)));
                const auto blocks = blocks_of(ran);
                const std::string tag = std::to_string(t) + ":" + std::to_string(p) + ":";
                if (c.put(seed, blocks, BT, tag + std::string(40, char('a' + t)), int32_t(ran.size()), ran) > 0) ++kept;
                for (int q = 0; q < 5; ++q) {
                    const auto ask = seq(q * 1000, 96);
                    auto h = c.find(seed, blocks_of(ask), BT);
                    if (h.n_keep == 0) continue;
                    ++hits;
                    const std::string want = std::to_string(t) + ":" + std::to_string(q) + ":";
                    if (!h.state || h.state->compare(0, want.size(), want) != 0) ++bad;
                    if (!h.tokens || h.tokens->size() < size_t(h.n_keep) || (*h.tokens)[0] != q * 1000) ++bad;
                }
                if (c.stats().bytes > CAP) ++over;
            }
        });
    }
    for (auto & th : ts) th.join();
    auto st = c.stats();
    CHECK(bad == 0);
    CHECK(over == 0);
    CHECK(hits > 0);
    CHECK(st.bytes <= CAP && st.entries > 0 && st.evicted > 0);
    CHECK(st.kept == kept && st.lookups == uint64_t(THREADS) * ROUNDS * 5 && st.hits == uint64_t(hits));
}

}  // namespace

int main() {
    block_hashes_are_the_python_chain();
    entries_are_found_by_their_prefix_blocks_and_no_others();
    an_owner_never_gets_another_owners_entry();
    the_budget_evicts_the_least_recently_used();
    a_newer_state_replaces_the_older_one();
    a_budget_of_zero_keeps_nothing();
    a_hit_outlives_its_entry();
    the_counters_count();
    threads_share_it();
    return dgr::unit::finish("prefix_cache_test");
}
