// What the parts' plain C++ tests share (worker/server/<part>/<name>_test.cpp, docs/worker.md "Parts and
// their owners"): CHECK, which counts a failed condition and says where, the end of each test's main, and a probe
// of whether a part's lock is held.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdio>
#include <memory>
#include <thread>
#include <vector>

namespace dgr::unit {

inline int failures = 0;

// main's last line: "<name>: all checks passed" (tests/worker/test_worker_units.py reads it) and 0; else how many
// checks failed, and 1
inline int finish(const char * name) {
    if (failures) {
        std::fprintf(stderr, "%s: %d check(s) failed\n", name, failures);
        return 1;
    }
    std::printf("%s: all checks passed\n", name);
    return 0;
}

// Whether `Locked`'s lock (a part with `lock()` handing back a guard: engine_loop/locked_engine.h) is held, asked
// from inside a call: another thread takes a guard; if it gets one within 50 ms the lock was free. A held lock lets
// that thread through only once the call's guard goes, so it is joined then (join), never in held. Static, so a
// fake engine's plain function pointer can be `held`; the main thread's alone.
template <typename Locked> struct LockProbe {
    static inline Locked * probed = nullptr;
    static inline std::vector<std::thread> probes;
    static bool held() {
        auto got = std::make_shared<std::atomic<bool>>(false);
        Locked * eng = probed;
        probes.emplace_back([eng, got] {
            auto g = eng->lock();
            *got = true;
        });
        const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(50);
        while (!*got && std::chrono::steady_clock::now() < until) std::this_thread::sleep_for(std::chrono::milliseconds(1));
        return !*got;
    }
    static void join() {
        for (auto & t : probes) t.join();
        probes.clear();
    }
};

}  // namespace dgr::unit

#define CHECK(cond)                                                                        \
    do {                                                                                   \
        if (!(cond)) {                                                                     \
            std::fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
            ++dgr::unit::failures;                                                         \
        }                                                                                  \
    } while (0)
