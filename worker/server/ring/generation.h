// The origin's generation control of one session (stage 0): how many tokens it may still make, which ids end it,
// what it has made and run, and what a ring's draws do to it.
//
// A part with no lock and no I/O: a value inside the worker's Session, guarded by whoever holds the session (the
// worker's mu_). It knows nothing of gRPC, frames or the engine, so it is tested on its own
// (ring/generation_test.cpp: a cc_test under Bazel, `dgr-worker-unit-tests` under CMake).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <set>
#include <vector>

namespace dgr {

struct Generation {
    uint32_t max_new = 0;                            // Generate.max_new_tokens
    uint32_t produced = 0;                           // tokens counted so far (all epochs)
    std::set<int32_t> stop_ids;                      // Generate.stop_token_ids: a draw of one ends it
    std::vector<int32_t> context_ids;                // the tokens generated so far (all epochs)
    // the tokens the session has run, prompt and generated: where draft sources look up what comes next
    std::vector<int32_t> history;
    bool done = false;                               // ended by a stop id or max_new
    bool failed = false;                             // ended by an error (the client was told)

    // Generate: a generation begins (or goes on after a recovery: `generated` and `cached` say how far it got)
    template <class Ids> void begin(uint32_t max_new_tokens, const Ids & stops, const Ids & generated, const Ids & cached) {
        max_new = max_new_tokens;
        stop_ids = std::set<int32_t>(stops.begin(), stops.end());
        context_ids.assign(generated.begin(), generated.end());
        history.assign(cached.begin(), cached.end());
    }

    // What one ring's draws did.
    struct Ring {
        size_t used = 0;                             // draws counted (the rest, past a stop id or max_new, dropped)
        int32_t last = 0;                            // the last draw counted
        int64_t next = 0;                            // the position after it
        bool done = false;                           // the generation ended with it
        bool step = false;                           // the next decode step goes on at `next`
        bool full = false;                           // it would, but the context is full: the session fails
    };

    // A ring's draws (the accepted drafts, then the token drawn) at positions first, first+1, ...: counted one by one
    // until a stop id or max_new ends the generation; then whether the next step goes on, within `n_ctx` positions.
    // (At least one draw.)
    Ring count(const std::vector<int32_t> & draws, int64_t first, int64_t n_ctx) {
        Ring r;
        for (int32_t t : draws) {
            ++r.used;
            ++produced;
            context_ids.push_back(t);
            history.push_back(t);
            if (ends(t)) break;
        }
        r.last = draws[r.used - 1];
        r.done = ends(r.last);
        r.next = first + int64_t(r.used);
        if (!r.done && !failed) {
            if (r.next >= n_ctx) {
                failed = true;
                r.full = true;
            } else {
                r.step = true;
            }
        } else {
            done = true;
        }
        return r;
    }

    // the drafts the next step at `pos` may carry: at most `k`, never past max_new or the context's last position
    int64_t draft_room(int64_t k, int64_t pos, int64_t n_ctx) const {
        return std::min<int64_t>({k, int64_t(max_new) - int64_t(produced) - 1, n_ctx - 1 - pos});
    }

  private:
    bool ends(int32_t t) const { return stop_ids.count(t) || produced >= max_new; }
};

}  // namespace dgr
