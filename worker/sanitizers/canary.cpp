// A deliberate bug per sanitizer (scripts/sanitize compiles this with each kind's flags and checks that the
// report reaches the log file and the exit status): proof that a report in dgr-worker would fail the run.
//   canary heap   heap-use-after-free (ASan)
//   canary ub     signed integer overflow (UBSan)
//   canary leak   a leak at exit (LSan)
//   canary race   a data race between two threads (TSan)
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>

static volatile int sink;

int main(int argc, char ** argv) {
    const char * what = argc > 1 ? argv[1] : "";
    if (!strcmp(what, "heap")) {
        int * p = new int[2];
        delete[] p;
        sink = p[argc - 2];
    } else if (!strcmp(what, "ub")) {
        int x = INT_MAX - 1 + argc;      // argc == 2: INT_MAX + 1
        sink = x;
    } else if (!strcmp(what, "leak")) {
        static int * volatile p;
        p = new int[4];
        p = nullptr;
    } else if (!strcmp(what, "race")) {
        static int shared;
        std::thread t([] { shared++; });
        shared++;
        t.join();
        sink = shared;
    }
    puts("ok");
    return 0;
}
