// What the parts' plain C++ tests share (worker/server/<part>/<name>_test.cpp, docs/worker.md "Parts and
// their owners"): CHECK, which counts a failed condition and says where, and the end of each test's main.
#pragma once

#include <cstdio>

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

}  // namespace dgr::unit

#define CHECK(cond)                                                                        \
    do {                                                                                   \
        if (!(cond)) {                                                                     \
            std::fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
            ++dgr::unit::failures;                                                         \
        }                                                                                  \
    } while (0)
