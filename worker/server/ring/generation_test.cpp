// The origin's generation control alone (ring/generation.h): a ring's draws counted up to a stop id or max_new,
// the next step or a full context, the history drafts are looked up in, and the room a step has for drafts.
// No gRPC, no engine: `bazel test //worker/server:generation_test`, or the CMake target dgr-worker-unit-tests.
#include "unit_check.h"
#include "ring/generation.h"

#include <cstdint>
#include <vector>

namespace {

using dgr::Generation;
using V = std::vector<int32_t>;

Generation started(uint32_t max_new, V stops, V generated = {}, V cached = {1, 2, 3}) {
    Generation g;
    g.begin(max_new, stops, generated, cached);
    return g;
}

void one_token_a_ring_goes_on_until_max_new() {
    Generation g = started(3, {99});
    auto r = g.count({10}, 3, 100);
    CHECK(r.used == 1 && r.last == 10 && r.next == 4 && r.step && !r.done && !r.full);
    r = g.count({11}, 4, 100);
    CHECK(r.step && !r.done);
    r = g.count({12}, 5, 100);                       // the third: max_new
    CHECK(r.done && !r.step && g.done && !g.failed);
    CHECK((g.context_ids == V{10, 11, 12}) && (g.history == V{1, 2, 3, 10, 11, 12}) && g.produced == 3);
}

void a_stop_id_among_drafts_ends_it_there() {
    Generation g = started(10, {99});
    auto r = g.count({10, 99, 11, 12}, 3, 100);      // accepted drafts 10, 99, 11, then 12: 99 ends it
    CHECK(r.used == 2 && r.last == 99 && r.done && !r.step && r.next == 5);
    CHECK((g.context_ids == V{10, 99}) && g.produced == 2);   // the draws after it are dropped
}

void max_new_among_drafts_ends_it_there() {
    Generation g = started(2, {});
    auto r = g.count({10, 11, 12}, 3, 100);
    CHECK(r.used == 2 && r.last == 11 && r.done && (g.context_ids == V{10, 11}));
}

void a_full_context_fails_the_session() {
    Generation g = started(10, {});
    auto r = g.count({10, 11}, 6, 8);                // positions 6 and 7: the next would be 8 of 8
    CHECK(r.full && !r.step && !r.done && g.failed && !g.done);
    g = started(10, {});
    r = g.count({10}, 6, 8);                         // the next is 7: still room
    CHECK(r.step && !r.full);
}

void a_failed_session_takes_no_next_step() {
    Generation g = started(10, {});
    g.failed = true;                                 // the client was told of an error
    auto r = g.count({10}, 3, 100);
    CHECK(!r.step && !r.full && g.done);
}

void a_recovery_goes_on_where_it_was() {
    Generation g = started(3, {}, {10, 11}, {1, 2, 3, 10, 11});
    CHECK(g.produced == 0);                          // counted by this origin from here on
    auto r = g.count({12}, 5, 100);
    CHECK(r.step && (g.context_ids == V{10, 11, 12}) && (g.history == V{1, 2, 3, 10, 11, 12}));
}

void draft_room_stops_at_max_new_and_the_context() {
    Generation g = started(10, {});
    CHECK(g.draft_room(4, 3, 100) == 4);
    g.count({10, 11, 12, 13, 14, 15, 16}, 3, 100);   // 7 of 10 made: the next token and 2 drafts at most
    CHECK(g.draft_room(4, 10, 100) == 2);
    CHECK(g.draft_room(4, 97, 100) == 2);
    CHECK(g.draft_room(4, 98, 100) == 1);            // only position 99 is left after 98
    CHECK(g.draft_room(4, 99, 100) == 0);
}

}  // namespace

int main() {
    one_token_a_ring_goes_on_until_max_new();
    a_stop_id_among_drafts_ends_it_there();
    max_new_among_drafts_ends_it_there();
    a_full_context_fails_the_session();
    a_failed_session_takes_no_next_step();
    a_recovery_goes_on_where_it_was();
    draft_room_stops_at_max_new_and_the_context();
    return dgr::unit::finish("generation_test");
}
