// The origin's draft sources alone (speculation/drafts.h): the drafts proposed for a history (prompt lookup: the
// longest suffix match, at its latest earlier occurrence, at most k tokens, never past the history's end),
// nothing where nothing matches, the back-off while drafts miss, MTP's drafts handed out once and its back-off,
// the sources and bounds by name, and the Python twin's drafts (dgr.runtime.wire.drafts.NgramDrafts) on fixed
// cases. No gRPC, no engine: `bazel test //worker/server:drafts_test`, or the CMake target dgr-unit-drafts_test
// (tests/worker/test_worker_units.py builds and runs it).
#include "unit_check.h"
#include "speculation/drafts.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

using dgr::MtpDrafts;
using dgr::NgramDrafts;
using V = std::vector<int32_t>;

std::string show(const V & v) {
    std::string s = "{";
    for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
    return s + "}";
}

// CHECK(got == want), saying both when they differ
#define CHECK_DRAFTS(got, want) check_drafts((got), (want), __FILE__, __LINE__, #got)
void check_drafts(const V & got, const V & want, const char * file, int line, const char * what) {
    if (got == want) return;
    std::fprintf(stderr, "%s:%d: CHECK failed: %s is %s, not %s\n", file, line, what, show(got).c_str(), show(want).c_str());
    ++dgr::unit::failures;
}

// what a new source proposes for `history` (a source's history only grows: another history, another source)
V first(const V & history, int64_t k, int n_min = 2, int n_max = 4) { return NgramDrafts(n_min, n_max).propose(history, k); }

// the message of the std::invalid_argument f throws
template <class F>
std::string refusal(F f) {
    try {
        f();
    } catch (const std::invalid_argument & e) {
        return e.what();
    }
    return "(nothing thrown)";
}

// the drafts documented (drafts.h), by brute force: for n from n_max down to n_min, the latest e < len with
// history[e-n, e) == history's last n tokens gives history[e, e+k); else none
V reference(const V & h, int64_t k, int n_min, int n_max) {
    const int64_t len = int64_t(h.size());
    if (k <= 0 || len < n_min + 1) return {};
    for (int64_t n = n_max; n >= n_min; --n) {
        for (int64_t e = len - 1; e >= n; --e) {
            if (std::equal(h.begin() + (e - n), h.begin() + e, h.end() - n)) return V(h.begin() + e, h.begin() + std::min(len, e + k));
        }
    }
    return {};
}

// a session's rings over `tokens` (what the last stage draws): propose k, accept the drafts that equal the
// tokens, tell the source, go on after the accepted drafts and the token drawn (the origin's loop, next_step in
// origin/origin.cpp, with k fixed; tests/worker/test_worker_cpp_speculate.py's _predicted_rings); the drafts of every ring
std::vector<V> rings(const V & tokens, int n_min, int n_max, int64_t k, size_t start) {
    NgramDrafts src(n_min, n_max);
    V history(tokens.begin(), tokens.begin() + int64_t(start));
    std::vector<V> out;
    while (history.size() < tokens.size()) {
        const V d = src.propose(history, k);
        const size_t at = history.size();
        size_t acc = 0;
        while (acc < d.size() && at + acc < tokens.size() && d[acc] == tokens[at + acc]) ++acc;
        src.observe(uint32_t(d.size()), uint32_t(acc));
        out.push_back(d);
        const size_t take = std::min(acc + 1, tokens.size() - at);
        history.insert(history.end(), tokens.begin() + int64_t(at), tokens.begin() + int64_t(at + take));
    }
    return out;
}

// `n` tokens of `vocab` from an LCG (x = x * 1103515245 + 12345 mod 2^31 from 7, token (x >> 16) % vocab): with
// a small vocab short n-grams recur with other continuations, so drafts miss and the back-off runs
V lcg_tokens(size_t n, uint32_t vocab) {
    V out;
    uint64_t x = 7;
    while (out.size() < n) {
        x = (x * 1103515245u + 12345u) % (uint64_t(1) << 31);
        out.push_back(int32_t((x >> 16) % vocab));
    }
    return out;
}

void a_history_gets_what_followed_its_longest_latest_match() {
    const V h = {1, 2, 3, 4, 5, 9, 9, 1, 2, 3};
    CHECK_DRAFTS(first(h, 4), (V{4, 5, 9, 9}));                  // [1 2 3] ended at 3: what followed, k of it
    CHECK_DRAFTS(first(h, 2), (V{4, 5}));
    CHECK_DRAFTS(first(h, 1), (V{4}));
    CHECK_DRAFTS(first(h, 16), (V{4, 5, 9, 9, 1, 2, 3}));         // never past the history's end
    CHECK_DRAFTS(first({7, 8, 1, 7, 8, 2, 7, 8}, 4), (V{2, 7, 8}));   // [7 8] twice before: the latest
    CHECK_DRAFTS(first({9, 1, 2, 3, 0, 1, 2, 4, 9, 1, 2}, 4), (V{3, 0, 1, 2}));   // [9 1 2] beats a later [1 2]
    CHECK_DRAFTS(first({1, 1, 1}, 4), (V{1}));                    // [1 1] ended at 2: the last token follows
    CHECK_DRAFTS(first({5, 6, 7, 5}, 4, 1, 1), (V{6, 7, 5}));     // n_min 1: one token is a match
    CHECK_DRAFTS(first({9, 9, 1, 2, 3, 4, 5, 1, 2, 3, 4}, 4, 2, 2), (V{5, 1, 2, 3}));   // n_max 2: [3 4] ended at 6
}

void nothing_to_propose() {
    CHECK_DRAFTS(first({}, 4), V{});                             // an empty history
    CHECK_DRAFTS(first({1, 1}, 4), V{});                         // fewer than n_min + 1 tokens
    CHECK_DRAFTS(first({1, 1}, 4, 1, 2), (V{1}));                // ... which n_min 1 has
    CHECK_DRAFTS(first({1, 2, 3, 4, 5}, 4), V{});                // no earlier occurrence
    CHECK_DRAFTS(first({1, 2}, 4, 1, 2), V{});                   // the suffix itself is no match
    CHECK_DRAFTS(first({1, 2, 3, 1, 2}, 0), V{});                // k 0 or less: none, matching or not
    CHECK_DRAFTS(first({1, 2, 3, 1, 2}, -1), V{});
    CHECK_DRAFTS(first({1, 2, 3, 1, 2}, 1), (V{3}));
}

// on every prefix of token streams, with every k: the documented drafts (reference()), so at most k tokens,
// each a copy of what followed an earlier occurrence of the history's last n >= n_min tokens
void every_history_gets_the_documented_drafts() {
    const struct { V tokens; int n_min, n_max; } streams[] = {
        {lcg_tokens(200, 3), 2, 4}, {lcg_tokens(200, 2), 2, 4}, {lcg_tokens(120, 5), 1, 3}, {lcg_tokens(120, 3), 3, 6}};
    for (const auto & s : streams) {
        for (int64_t k : {int64_t(1), int64_t(3), int64_t(4), int64_t(dgr::MAX_DRAFT_K)}) {
            NgramDrafts src(s.n_min, s.n_max);        // one source, its history growing (its index kept up)
            int64_t proposed = 0, mismatched = 0, too_long = 0;
            for (size_t len = 0; len <= s.tokens.size(); ++len) {
                const V h(s.tokens.begin(), s.tokens.begin() + int64_t(len));
                const V d = src.propose(h, k);
                proposed += !d.empty();
                mismatched += d != reference(h, k, s.n_min, s.n_max);
                too_long += int64_t(d.size()) > k;
            }
            CHECK(mismatched == 0 && too_long == 0);
            CHECK(proposed > 20);                      // the streams do restate themselves
        }
    }
}

void the_same_history_gets_the_same_drafts() {
    const V tokens = lcg_tokens(150, 3);
    NgramDrafts grown, twin;
    for (size_t len = 0; len <= tokens.size(); ++len) {
        const V h(tokens.begin(), tokens.begin() + int64_t(len));
        const V d = grown.propose(h, 4);
        CHECK(twin.propose(h, 4) == d);                   // another source on the same calls
        const V again = grown.propose(h, 4);              // (a pause counts asks, so the twin asks again too)
        CHECK(twin.propose(h, 4) == again);
        if (!d.empty()) CHECK(again == d);                // asked again while drafting: the same drafts
        if (len % 7 == 0) {                               // the same verdicts: the same back-off
            grown.observe(uint32_t(d.size()), 0);
            twin.observe(uint32_t(d.size()), 0);
        }
    }
    CHECK(NgramDrafts().propose(tokens, 4) == reference(tokens, 4, 2, 4));   // asked only at the end: the same
}

void misses_ask_for_longer_matches_then_pause() {
    NgramDrafts d;
    const V h = {1, 2, 3, 4, 5, 1, 2};                    // only a 2-gram matches
    CHECK_DRAFTS(d.propose(h, 3), (V{3, 4, 5}));
    d.observe(3, 0);                                      // a miss: a 3-gram match needed now
    CHECK_DRAFTS(d.propose(h, 3), V{});
    d.observe(0, 0);                                      // nothing drafted: nothing learnt
    CHECK_DRAFTS(d.propose(h, 3), V{});
    d.observe(3, 1);                                      // one accepted draft resets it
    CHECK_DRAFTS(d.propose(h, 3), (V{3, 4, 5}));

    // a 4-gram keeps matching and missing: after the 3rd miss in a row, pauses of 2, 4, 8 ... MAX_PAUSE asks
    NgramDrafts p;
    const V g = {1, 2, 3, 4, 5, 6, 1, 2, 3, 4};
    CHECK_DRAFTS(p.propose(g, 4), (V{5, 6, 1, 2}));
    for (int64_t miss = 1; miss <= 9; ++miss) {
        p.observe(4, 0);
        int64_t empty = 0;
        while (p.propose(g, 4).empty() && empty <= 100) ++empty;
        const int64_t pause = miss <= 2 ? 0 : std::min<int64_t>(NgramDrafts::MAX_PAUSE, int64_t(1) << (miss - 2));
        CHECK(empty == pause);
    }
    CHECK(NgramDrafts::MAX_PAUSE == 32);
    p.observe(4, 0);                                      // paused again; only asks for drafts count
    for (int i = 0; i < 40; ++i) CHECK(p.propose(g, 0).empty());
    CHECK(p.propose(g, 4).empty());
    p.observe(4, 2);                                      // an accepted draft ends the pause
    CHECK_DRAFTS(p.propose(g, 4), (V{5, 6, 1, 2}));

    // n_min == n_max: the first miss pauses; the history asked about while paused is indexed all the same
    NgramDrafts q(4, 4);
    CHECK_DRAFTS(q.propose(g, 4), (V{5, 6, 1, 2}));
    q.observe(4, 0);
    V grown = g;
    grown.push_back(7);
    CHECK_DRAFTS(q.propose(grown, 4), V{});
    grown.insert(grown.end(), {1, 2, 3, 4});
    CHECK_DRAFTS(q.propose(grown, 4), V{});
    CHECK_DRAFTS(q.propose(grown, 4), (V{7, 1, 2, 3}));   // [1 2 3 4] last ended before the 7
}

void sources_and_bounds_by_name() {
    CHECK(dynamic_cast<NgramDrafts *>(dgr::make_draft_source("ngram").get()) != nullptr);
    CHECK(dynamic_cast<MtpDrafts *>(dgr::make_draft_source("mtp").get()) != nullptr);
    CHECK(dgr::make_draft_source("ngram")->remote_k(4) == 0);      // a local source asks the last stage for none
    CHECK(dgr::make_draft_source("mtp")->remote_k(4) == 4);
    CHECK(dgr::check_draft_k(1) == 1 && dgr::check_draft_k(dgr::MAX_DRAFT_K) == dgr::MAX_DRAFT_K);
    CHECK(dgr::DEFAULT_DRAFT_K == 4 && dgr::MAX_DRAFT_K == 16);
    CHECK(refusal([] { dgr::make_draft_source("NGRAM"); }) == "unknown draft source 'NGRAM': choose one of ngram, mtp");
    CHECK(refusal([] { NgramDrafts(0, 2); }) == "ngram drafts: need 1 <= n_min <= n_max, got 0, 2");
}

void mtp_hands_out_what_the_last_stage_drafted_once() {
    MtpDrafts m;
    const V h = {1, 2, 3, 1, 2};                          // the history plays no part
    CHECK_DRAFTS(m.propose(h, 4), V{});
    m.offer({7, 8, 9});
    CHECK_DRAFTS(m.propose(h, 4), (V{7, 8, 9}));
    CHECK_DRAFTS(m.propose(h, 4), V{});                   // once
    m.offer({1, 2, 3, 4, 5});
    CHECK_DRAFTS(m.propose(h, 2), (V{1, 2}));             // at most k; the rest is dropped, not kept
    CHECK_DRAFTS(m.propose(h, 2), V{});
    m.offer({5});
    CHECK_DRAFTS(m.propose(h, 0), V{});                   // k 0 takes the offer too
    CHECK_DRAFTS(m.propose(h, 4), V{});
}

void mtp_backs_off_while_its_drafts_miss() {
    MtpDrafts m;
    CHECK(m.remote_k(8) == 8 && m.remote_k(0) == 0 && m.remote_k(-1) == 0);
    // after the m-th miss in a row: 2^(2m-1) steps (at most MAX_PAUSE) asking none, then k >> m (at least 1)
    for (int64_t miss = 1; miss <= 5; ++miss) {
        m.observe(4, 0);
        for (int i = 0; i < 3; ++i) CHECK(m.remote_k(0) == 0);   // k 0 asks nothing and leaves the pause
        int64_t none = 0;
        uint32_t asked = 0;
        while ((asked = m.remote_k(8)) == 0 && none <= 200) ++none;
        CHECK(none == std::min<int64_t>(MtpDrafts::MAX_PAUSE, int64_t(1) << (2 * miss - 1)));
        CHECK(asked == std::max<uint32_t>(1, 8u >> miss));
    }
    m.observe(0, 0);                                      // nothing drafted: nothing learnt
    CHECK(m.remote_k(8) == 1);
    m.observe(1, 1);                                      // one accepted draft restores k
    CHECK(m.remote_k(8) == 8);
}

// The Python twin's answers (dgr.runtime.wire.drafts, computed once with it and written here), the C++ checked
// against them below; tests/wire/test_wire_drafts_twin.py reads these same literals out of this file and checks the
// Python against them, so a change on either side fails a test. Between the twin: markers: braces, numbers and
// "strings" only (no comments, no braces in a string), read there as JSON with [] for {}.
struct TwinLookup {
    std::string name;
    V history;
    int64_t k;
    V drafts;   // what a new NgramDrafts() proposes
};
struct TwinRings {
    std::string name;
    int n_min, n_max;
    int64_t k;
    size_t start;               // the prompt: tokens[0, start)
    V tokens;                   // what the last stage draws
    std::vector<V> drafts;      // rings(): the drafts of every ring
};
struct TwinRefusal {
    std::string kind, arg, message;   // "source" name, "k" k, "ngram" "n_min n_max": the message refusing it
};

const TwinLookup TWIN_LOOKUPS[] = {
    // twin:lookups {
    {"the longest match then k tokens", {1, 2, 3, 4, 5, 9, 9, 1, 2, 3}, 4, {4, 5, 9, 9}},
    {"fewer than k asked", {1, 2, 3, 4, 5, 9, 9, 1, 2, 3}, 2, {4, 5}},
    {"up to the history's end", {1, 2, 3, 4, 5, 9, 9, 1, 2, 3}, 16, {4, 5, 9, 9, 1, 2, 3}},
    {"the latest occurrence", {7, 8, 1, 7, 8, 2, 7, 8}, 4, {2, 7, 8}},
    {"longer beats later", {9, 1, 2, 3, 0, 1, 2, 4, 9, 1, 2}, 4, {3, 0, 1, 2}},
    {"a run of one token", {1, 1, 1}, 4, {1}},
    {"nothing to match", {1, 2, 3, 4, 5}, 4, {}},
    {"pi", {3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 3, 3, 8, 3, 2, 7, 9, 5, 0, 2, 8,
     8, 4, 1, 9, 7, 1, 6, 9, 3, 9, 9, 3, 7, 5, 1, 0, 5, 8, 2, 0, 9, 7, 4, 9, 4, 4, 5, 9, 2, 3, 0, 7, 8, 1, 6, 4, 0,
     6, 2, 8, 6, 2, 0, 8, 9, 9, 8, 6, 2, 8, 0, 3, 4, 8, 2, 5, 3, 4, 2, 1, 1, 7, 0, 6, 7, 9}, 5, {5, 0, 2, 8, 8}},
    // twin:lookups }
};

const TwinRings TWIN_RINGS[] = {
    // twin:rings {
    {"restated text", 2, 4, 4, 1, {1, 20, 21, 22, 23, 24, 25, 20, 21, 22, 23, 24, 25, 20, 21, 22, 23, 24, 25, 30,
     31, 20, 21, 22, 40, 41, 20, 21, 22, 23, 24, 25, 26, 20, 21, 22, 40, 41, 42}, {{}, {}, {}, {}, {}, {}, {}, {},
     {22, 23, 24, 25}, {21, 22, 23, 24}, {20, 21, 22, 23}, {}, {}, {}, {}, {23, 24, 25, 30}, {}, {}, {}, {}, {},
     {24, 25, 30, 31}, {}, {}, {22, 23, 24, 25}, {41, 20, 21, 22}}},
    {"three tokens at random", 2, 4, 4, 1, {1, 2, 2, 0, 2, 2, 0, 2, 2, 2, 2, 1, 2, 2, 2, 1, 1, 2, 1, 2, 0, 2, 0, 0,
     1, 2, 1, 0, 2, 2, 2, 1, 1, 2, 0, 1, 1, 0, 1, 1, 0, 2, 0, 1, 1, 0, 2, 0, 2, 2, 1, 1, 0, 2, 2, 0, 0, 2, 0, 1, 0,
     0, 0, 1, 2, 2, 0, 1, 2, 1, 1, 1, 2, 1, 2, 2, 1, 2, 0, 2, 1, 2, 1, 0, 2, 2, 0, 2, 1, 0}, {{}, {}, {}, {}, {},
     {0, 2, 2}, {2}, {}, {2, 0, 2, 2}, {1, 2, 2, 2}, {}, {2, 2, 1, 1}, {}, {2, 2, 1, 1}, {}, {}, {}, {}, {}, {}, {},
     {}, {}, {}, {2, 1, 2, 2}, {}, {}, {1, 2, 0, 2}, {}, {}, {}, {}, {}, {}, {1, 1, 0}, {}, {}, {}, {}, {}, {}, {},
     {}, {2, 2, 1, 2}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {2, 2, 0, 2}, {}, {}, {}, {},
     {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}}},
    {"three tokens at random n 1..3 k 3", 1, 3, 3, 1, {1, 2, 2, 0, 2, 2, 0, 2, 2, 2, 2, 1, 2, 2, 2, 1, 1, 2, 1, 2,
     0, 2, 0, 0, 1, 2, 1, 0, 2, 2, 2, 1, 1, 2, 0, 1, 1, 0, 1, 1, 0, 2, 0, 1, 1, 0, 2, 0, 2, 2, 1, 1, 0, 2, 2, 0, 0,
     2, 0, 1, 0, 0, 0, 1, 2, 2, 0, 1, 2, 1, 1, 1, 2, 1, 2, 2, 1, 2, 0, 2, 1, 2, 1, 0, 2, 2, 0, 2, 1, 0}, {{}, {},
     {2}, {}, {}, {0, 2, 2}, {2}, {2, 2, 0}, {1, 2, 2}, {1}, {2, 2, 1}, {}, {2, 2, 1}, {}, {}, {}, {}, {}, {}, {2,
     0, 2}, {}, {}, {}, {}, {1, 2, 1}, {2, 0, 0}, {2, 1, 0}, {}, {}, {}, {0, 1, 1}, {2, 2, 1}, {0, 1, 2}, {1, 0, 1},
     {0, 1, 1}, {0, 0, 1}, {2, 1, 1}, {1, 2, 0}, {2, 0, 2}, {1, 1, 0}, {2, 2, 2}, {1, 2, 1}, {}, {}, {1, 0, 2}, {},
     {}, {}, {}, {1, 0, 2}, {}, {}, {}, {}, {}, {}, {}, {}, {1, 1, 2}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {},
     {}, {}, {}, {}}},
    {"three tokens at random n 3 only k 2", 3, 3, 2, 1, {1, 2, 2, 0, 2, 2, 0, 2, 2, 2, 2, 1, 2, 2, 2, 1, 1, 2, 1, 2,
     0, 2, 0, 0, 1, 2, 1, 0, 2, 2, 2, 1, 1, 2, 0, 1, 1, 0, 1, 1, 0, 2, 0, 1, 1, 0, 2, 0, 2, 2, 1, 1, 0, 2, 2, 0, 0,
     2, 0, 1, 0, 0, 0, 1, 2, 2, 0, 1, 2, 1, 1, 1, 2, 1, 2, 2, 1, 2, 0, 2, 1, 2, 1, 0, 2, 2, 0, 2, 1, 0}, {{}, {},
     {}, {}, {}, {}, {2, 2}, {}, {2}, {}, {}, {0, 2}, {}, {}, {}, {}, {}, {2, 2}, {}, {}, {}, {}, {}, {}, {}, {},
     {}, {2, 2}, {1, 2}, {2, 0}, {}, {}, {}, {}, {0, 1}, {2, 2}, {}, {}, {0, 2}, {1, 1}, {}, {}, {1, 2}, {2, 0}, {1,
     1}, {}, {}, {}, {2, 2}, {}, {}, {}, {}, {2, 1}, {2, 1}, {}, {}, {2, 0}, {}, {}, {}, {}, {1, 1}, {}, {}, {}, {},
     {}, {}, {}, {}, {2, 2}, {}, {}, {}, {}, {}, {}}},
    // twin:rings }
};

const TwinRefusal TWIN_REFUSALS[] = {
    // twin:refusals {
    {"source", "eagle", "unknown draft source 'eagle': choose one of ngram, mtp"},
    {"source", "", "unknown draft source '': choose one of ngram, mtp"},
    {"k", "0", "draft k must be in 1..16 (positions verified per ring beyond the first), got 0"},
    {"k", "17", "draft k must be in 1..16 (positions verified per ring beyond the first), got 17"},
    {"ngram", "3 2", "ngram drafts: need 1 <= n_min <= n_max, got 3, 2"},
    {"ngram", "0 4", "ngram drafts: need 1 <= n_min <= n_max, got 0, 4"},
    // twin:refusals }
};

void the_python_twin_drafts_the_same() {
    for (const auto & c : TWIN_LOOKUPS) {
        const V got = first(c.history, c.k);
        if (got != c.drafts) std::fprintf(stderr, "twin lookup '%s': %s\n", c.name.c_str(), show(got).c_str());
        CHECK(got == c.drafts);
    }
    for (const auto & c : TWIN_RINGS) {
        const std::vector<V> got = rings(c.tokens, c.n_min, c.n_max, c.k, c.start);
        CHECK(got.size() == c.drafts.size());
        for (size_t i = 0; i < std::min(got.size(), c.drafts.size()); ++i) {
            if (got[i] == c.drafts[i]) continue;
            std::fprintf(stderr, "twin rings '%s', ring %zu: %s, not %s\n", c.name.c_str(), i, show(got[i]).c_str(),
                         show(c.drafts[i]).c_str());
            ++dgr::unit::failures;
            break;
        }
    }
    for (const auto & c : TWIN_REFUSALS) {
        std::string got;
        if (c.kind == "source") got = refusal([&] { dgr::make_draft_source(c.arg); });
        if (c.kind == "k") got = refusal([&] { dgr::check_draft_k(uint32_t(std::stoul(c.arg))); });
        if (c.kind == "ngram") got = refusal([&] { NgramDrafts(std::stoi(c.arg), std::stoi(c.arg.substr(c.arg.find(' ')))); });
        if (got != c.message) std::fprintf(stderr, "twin refusal %s '%s': %s\n", c.kind.c_str(), c.arg.c_str(), got.c_str());
        CHECK(got == c.message);
    }
}

}  // namespace

int main() {
    a_history_gets_what_followed_its_longest_latest_match();
    nothing_to_propose();
    every_history_gets_the_documented_drafts();
    the_same_history_gets_the_same_drafts();
    misses_ask_for_longer_matches_then_pause();
    sources_and_bounds_by_name();
    mtp_hands_out_what_the_last_stage_drafted_once();
    mtp_backs_off_while_its_drafts_miss();
    the_python_twin_drafts_the_same();
    return dgr::unit::finish("drafts_test");
}
