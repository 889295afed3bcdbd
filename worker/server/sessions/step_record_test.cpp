// A session's step record alone (step_record.h): what stage 0 ran is known only while every position is, it never
// outgrows what the cache holds, a cut keeps a prefix, and a rollback's floor follows the last step.
#include "unit_check.h"
#include "sessions/step_record.h"

#include <thread>
#include <vector>

namespace {

using dgr::StepRecord;

void steps_extend_and_roll_back_the_record() {
    StepRecord r;
    r.restore(4, {1, 2, 3, 4});                      // a prefix restored at open
    CHECK(r.held() == 4 && r.ran() == std::vector<int32_t>({1, 2, 3, 4}));
    const int32_t next[] = {5, 6, 7};
    r.ran_step(7, true, 4, next, 3, -1);
    CHECK(r.held() == 7 && r.ran() == std::vector<int32_t>({1, 2, 3, 4, 5, 6, 7}));
    // a rolled-back step from position 5: what followed is replaced
    const int32_t again[] = {9};
    r.ran_step(6, true, 5, again, 1, -1);
    CHECK(r.ran() == std::vector<int32_t>({1, 2, 3, 4, 5, 9}));
}

void never_more_than_the_cache_holds() {
    StepRecord r;
    const int32_t t[] = {1, 2, 3, 4};
    r.ran_step(2, true, 0, t, 4, -1);                // the engine kept 2 of the 4 (drafts rejected)
    CHECK(r.held() == 2 && r.ran() == std::vector<int32_t>({1, 2}));
    r.restore(3, {1, 2, 3});
    r.hold(1);                                       // a later hop kept less
    CHECK(r.held() == 1 && r.ran() == std::vector<int32_t>({1}));
}

void a_gap_makes_it_unknown_for_good() {
    StepRecord r;
    const int32_t t[] = {1, 2};
    r.ran_step(4, true, 2, t, 2, -1);                // positions 0 and 1 were never seen here
    CHECK(!r.ran().has_value() && r.held() == 4);
    r.ran_step(6, true, 4, t, 2, -1);
    CHECK(!r.ran().has_value());                     // not known again later
}

void later_stages_record_no_tokens() {
    StepRecord r;
    const int32_t t[] = {1, 2};
    r.ran_step(2, false, 0, t, 2, -1);
    CHECK(r.held() == 2 && r.ran() == std::vector<int32_t>());
}

void the_floor_follows_the_last_step() {
    StepRecord r;
    CHECK(r.spec_floor() == -1);
    const int32_t t[] = {1, 2, 3};
    r.ran_step(10, false, 7, t, 3, 8);               // drafts from position 8 on
    CHECK(r.spec_floor() == 8);
    r.ran_step(11, false, 10, t, 1, -1);             // a plain step: no floor
    CHECK(r.spec_floor() == -1);
}

void readers_and_a_writer_at_once() {
    // the engine thread writes while the load and the session RPCs read: under TSan this is the check
    StepRecord r;
    std::thread w([&] {
        int32_t tok = 1;
        for (uint64_t p = 0; p < 2000; ++p) r.ran_step(p + 1, true, size_t(p), &tok, 1, -1);
    });
    uint64_t last = 0;
    for (int i = 0; i < 2000; ++i) {
        const uint64_t h = r.held();
        CHECK(h >= last);
        last = h;
        auto ran = r.ran();
        CHECK(ran && ran->size() <= 2000);
    }
    w.join();
    CHECK(r.held() == 2000 && r.ran()->size() == 2000);
}

}  // namespace

int main() {
    steps_extend_and_roll_back_the_record();
    never_more_than_the_cache_holds();
    a_gap_makes_it_unknown_for_good();
    later_stages_record_no_tokens();
    the_floor_follows_the_last_step();
    readers_and_a_writer_at_once();
    return dgr::unit::finish("step_record_test");
}
