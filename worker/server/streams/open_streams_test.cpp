// The open streams alone (open_streams.h): a call that starts after SIGTERM is refused and never added, so none
// is left out of the stop's copy; the worker's end waits for every gone client's cleanup.
#include "unit_check.h"
#include "streams/open_streams.h"

#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

namespace {

using dgr::OpenStreams;

void calls_come_and_go() {
    OpenStreams<int> s;
    CHECK(s.add(1) && s.add(2) && s.size() == 2);
    CHECK(s.remove(1) && !s.remove(1));             // removed once
    CHECK(s.all() == std::vector<int>({2}));
}

void none_added_after_the_stop() {
    OpenStreams<int> s;
    CHECK(s.add(1));
    CHECK(s.stop() == std::vector<int>({1}) && s.stopping());
    CHECK(!s.add(2) && s.size() == 1);               // refused, never in the table
}

void the_stop_sees_every_call_added_before_it() {
    // calls start while SIGTERM comes: each is either in the stop's copy or refused, never both or neither
    OpenStreams<int> s;
    std::vector<int> added;
    std::thread calls([&] {
        for (int i = 0; i < 5000; ++i) {
            if (s.add(i)) added.push_back(i);
        }
    });
    std::this_thread::sleep_for(std::chrono::microseconds(200));
    const std::vector<int> seen = s.stop();
    calls.join();
    CHECK(seen == added);
}

void the_end_waits_for_cleanups() {
    OpenStreams<int> s;
    CHECK(s.cleanup_started());
    std::atomic<bool> ended{false};
    std::thread t([&] {
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
        ended = true;
        s.cleanup_ended();
    });
    s.wait_cleanups();
    CHECK(ended.load());
    t.join();
    s.wait_cleanups();                               // none running: returns at once
    CHECK(!s.cleanup_started());                     // and none starts after the end began
}

void a_cleanup_starts_before_the_end_or_not_at_all() {
    // a stream ends while the worker ends: either its cleanup is counted (the end waits for it) or it never runs
    for (int round = 0; round < 200; ++round) {
        OpenStreams<int> s;
        std::atomic<int> running{0};
        std::atomic<bool> after_end{false};
        std::thread t([&] {
            if (!s.cleanup_started()) return;
            running = 1;
            std::this_thread::sleep_for(std::chrono::microseconds(50));
            running = 0;
            s.cleanup_ended();
        });
        s.wait_cleanups();
        after_end = running.load() != 0;             // a cleanup still running after the end returned
        t.join();
        CHECK(!after_end);
    }
}

}  // namespace

int main() {
    calls_come_and_go();
    none_added_after_the_stop();
    the_stop_sees_every_call_added_before_it();
    the_end_waits_for_cleanups();
    a_cleanup_starts_before_the_end_or_not_at_all();
    return dgr::unit::finish("open_streams_test");
}
