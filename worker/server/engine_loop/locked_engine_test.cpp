// The engine under its lock alone (locked_engine.h): every call a guard makes reaches the engine with the lock
// held and never beside another, the guard passes the arguments and the answer through, a second guard waits for
// the first, the table is the library's own, and a grammar is opened without the lock.
// No gRPC, no engine library: a table of this test's own functions stands for it. `bazel test
// //worker/server:locked_engine_test`, or the CMake target dgr-worker-unit-tests (tests/worker/test_worker_units.py
// builds and runs it).
#include "unit_check.h"
#include "engine_loop/locked_engine.h"

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

namespace {

// The handle: what the test's engine saw. `inside` counts the calls in the engine now; `most` the most at once.
struct FakeEngine {
    std::atomic<int> inside{0}, most{0};
    std::atomic<int> calls{0};
    std::atomic<bool> unlocked_call{false};          // a locked call that found the lock free
    std::atomic<int> grammar_opens{0};
    std::string last;                                // the last call's name and arguments (checked single-threaded)
    // set by the test: whether the lock is held now, asked from inside a call (another thread tries it)
    bool (*lock_is_held)() = nullptr;
};

struct Step {
    int n = 0;
};
struct StepOut {
    int n_cached = 0;
};

// The engine's side of a call: one at a time, and (when asked) the lock held while it runs.
void enter(FakeEngine * e, const std::string & what, bool check_lock = true) {
    const int now = ++e->inside;
    int most = e->most.load();
    while (now > most && !e->most.compare_exchange_weak(most, now)) {}
    if (check_lock && e->lock_is_held && !e->lock_is_held()) e->unlocked_call = true;
    std::this_thread::yield();                       // widen the window a second caller would fall into
    e->last = what;
    ++e->calls;
    --e->inside;
}

// One entry per function the guard calls: the same names as EngineLib's (engine_lib.h), taking the handle first.
int32_t fake_describe(FakeEngine * e, int * info) { enter(e, "describe"); *info = 7; return 0; }
int32_t fake_memory(FakeEngine * e, long * bytes) { enter(e, "memory"); *bytes = 1 << 20; return 0; }
int32_t fake_can_truncate(FakeEngine * e) { enter(e, "can_truncate"); return 1; }
int32_t fake_session_open(FakeEngine * e, const char * sid, int64_t epoch) {
    enter(e, std::string("session_open ") + sid + " " + std::to_string(epoch));
    return 0;
}
int32_t fake_session_close(FakeEngine * e, const char * sid, int64_t epoch) {
    enter(e, std::string("session_close ") + sid + " " + std::to_string(epoch));
    return 0;
}
int32_t fake_n_cached(FakeEngine * e, const char * sid, int64_t, int32_t * held) { enter(e, std::string("n_cached ") + sid); *held = 5; return 0; }
int32_t fake_truncate(FakeEngine * e, const char * sid, int64_t, int32_t n) {
    enter(e, std::string("truncate ") + sid + " " + std::to_string(n));
    return n < 0 ? -3 : 0;                           // a refusal's status comes back as it is
}
int32_t fake_state_get(FakeEngine * e, const char *, int64_t, void *, uint64_t, uint64_t * size, int32_t * n) {
    enter(e, "state_get");
    *size = 64;
    *n = 4;
    return 0;
}
int32_t fake_state_set(FakeEngine * e, const char *, int64_t, const void *, uint64_t, int32_t, int32_t) { enter(e, "state_set"); return 0; }
int32_t fake_forward(FakeEngine * e, int32_t n, const Step * steps, StepOut * outs) {
    enter(e, "forward " + std::to_string(n));
    for (int32_t k = 0; k < n; ++k) outs[k].n_cached = steps[k].n + 1;
    return 0;
}
int32_t fake_mtp_draft(FakeEngine * e, const char *, int64_t, int32_t token, int32_t k, int32_t * out) {
    enter(e, "mtp_draft");
    for (int32_t i = 0; i < k; ++i) out[i] = token + 1 + i;
    return 0;
}
int32_t fake_tokenize(FakeEngine * e, const char * text, int32_t, int32_t * ids, int32_t cap) {
    enter(e, std::string("tokenize ") + text);
    const int32_t n = int32_t(std::strlen(text));
    for (int32_t i = 0; i < n && i < cap; ++i) ids[i] = text[i];
    return n;
}
int32_t fake_detokenize(FakeEngine * e, const int32_t * ids, int32_t n, char * out, int32_t cap) {
    enter(e, "detokenize");
    for (int32_t i = 0; i < n && i < cap; ++i) out[i] = char(ids[i]);
    return n;
}
int32_t fake_grammar_open(FakeEngine * e, const char *, const char *, int ** out) {
    enter(e, "grammar_open", /*check_lock=*/false);
    ++e->grammar_opens;
    *out = nullptr;
    return 0;
}
// takes no engine: the table's, reached through lib()
int32_t fake_sample(const float * row, int32_t n) { return n > 0 ? int32_t(row[0]) : -1; }

struct FakeLib {
    int32_t (*describe)(FakeEngine *, int *) = fake_describe;
    int32_t (*memory)(FakeEngine *, long *) = fake_memory;
    int32_t (*can_truncate)(FakeEngine *) = fake_can_truncate;
    int32_t (*session_open)(FakeEngine *, const char *, int64_t) = fake_session_open;
    int32_t (*session_close)(FakeEngine *, const char *, int64_t) = fake_session_close;
    int32_t (*n_cached)(FakeEngine *, const char *, int64_t, int32_t *) = fake_n_cached;
    int32_t (*truncate)(FakeEngine *, const char *, int64_t, int32_t) = fake_truncate;
    int32_t (*state_get)(FakeEngine *, const char *, int64_t, void *, uint64_t, uint64_t *, int32_t *) = fake_state_get;
    int32_t (*state_set)(FakeEngine *, const char *, int64_t, const void *, uint64_t, int32_t, int32_t) = fake_state_set;
    int32_t (*forward)(FakeEngine *, int32_t, const Step *, StepOut *) = fake_forward;
    int32_t (*mtp_draft)(FakeEngine *, const char *, int64_t, int32_t, int32_t, int32_t *) = fake_mtp_draft;
    int32_t (*tokenize)(FakeEngine *, const char *, int32_t, int32_t *, int32_t) = fake_tokenize;
    int32_t (*detokenize)(FakeEngine *, const int32_t *, int32_t, char *, int32_t) = fake_detokenize;
    int32_t (*grammar_open)(FakeEngine *, const char *, const char *, int **) = fake_grammar_open;
    int32_t (*sample)(const float *, int32_t) = fake_sample;
};

using Engine = dgr::LockedEngine<FakeLib, FakeEngine>;

using Probe = dgr::unit::LockProbe<Engine>;   // the lock probed from inside calls (unit_check.h)

// Every call a guard makes runs with the lock held (a probe from inside each finds it taken), and passes its
// arguments and answer through.
void every_call_holds_the_lock() {
    FakeLib lib;
    FakeEngine fe;
    Engine eng(lib, &fe);
    Probe::probed = &eng;
    fe.lock_is_held = Probe::held;
    {
        auto g = eng.lock();
        CHECK(Probe::held());                        // the probe sees a held lock as held
        int info = 0;
        CHECK(g.describe(&info) == 0 && info == 7 && fe.last == "describe");
        long bytes = 0;
        CHECK(g.memory(&bytes) == 0 && bytes == (1 << 20));
        CHECK(g.can_truncate() == 1);
        CHECK(g.session_open("s", 3) == 0 && fe.last == "session_open s 3");
        int32_t held = 0;
        CHECK(g.n_cached("s", 3, &held) == 0 && held == 5 && fe.last == "n_cached s");
        CHECK(g.truncate("s", 3, 2) == 0 && fe.last == "truncate s 2");
        CHECK(g.truncate("s", 3, -1) == -3);
        uint64_t size = 0;
        int32_t n = 0;
        CHECK(g.state_get("s", 3, nullptr, 0, &size, &n) == 0 && size == 64 && n == 4);
        CHECK(g.state_set("s", 3, nullptr, 0, 4, 4) == 0 && fe.last == "state_set");
        std::vector<Step> steps{{1}, {2}};
        std::vector<StepOut> outs(2);
        CHECK(g.forward(int32_t(steps.size()), steps.data(), outs.data()) == 0 && fe.last == "forward 2");
        CHECK(outs[0].n_cached == 2 && outs[1].n_cached == 3);
        std::vector<int32_t> drafts(3);
        CHECK(g.mtp_draft("s", 3, 10, 3, drafts.data()) == 0 && drafts == (std::vector<int32_t>{11, 12, 13}));
        std::vector<int32_t> ids(8);
        CHECK(g.tokenize("hi", 1, ids.data(), int32_t(ids.size())) == 2 && ids[0] == 'h' && ids[1] == 'i');
        std::string text(8, '\0');
        CHECK(g.detokenize(ids.data(), 2, &text[0], int32_t(text.size())) == 2 && text.substr(0, 2) == "hi");
        CHECK(g.session_close("s", 3) == 0 && fe.last == "session_close s 3");
    }
    Probe::join();                                   // each got the lock once the guard went
    CHECK(fe.calls == 14);
    CHECK(!fe.unlocked_call);
    CHECK(!Probe::held());                           // the guard gone, the lock is free
    Probe::join();
    fe.lock_is_held = nullptr;
    Probe::probed = nullptr;
}

// A second guard waits for the first: taken on another thread while one is held, it is had only once that one goes.
void a_second_guard_waits_for_the_first() {
    FakeLib lib;
    FakeEngine fe;
    Engine eng(lib, &fe);
    std::atomic<bool> second{false};
    std::thread t;
    {
        auto g = eng.lock();
        t = std::thread([&] {
            auto g2 = eng.lock();
            second = true;
            g2.can_truncate();
        });
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
        CHECK(!second);
        g.can_truncate();
    }
    t.join();
    CHECK(second);
    CHECK(fe.calls == 2 && fe.most == 1);
}

// Threads racing through their guards: the engine never sees two calls at once, and none is lost.
void threads_never_meet_in_the_engine() {
    FakeLib lib;
    FakeEngine fe;
    Engine eng(lib, &fe);
    constexpr int THREADS = 8, ROUNDS = 500;
    std::vector<std::thread> ts;
    for (int i = 0; i < THREADS; ++i) {
        ts.emplace_back([&, i] {
            const std::string sid = "s" + std::to_string(i);
            for (int r = 0; r < ROUNDS; ++r) {
                auto g = eng.lock();
                int32_t held = 0;
                g.n_cached(sid.c_str(), 1, &held);
                Step s{r};
                StepOut o;
                g.forward(1, &s, &o);
            }
        });
    }
    for (auto & t : ts) t.join();
    CHECK(fe.most == 1);
    CHECK(fe.calls == THREADS * ROUNDS * 2);
}

// The table is the library's own (what needs no engine is called through it, and a null entry is seen as one),
// and a grammar is opened on the engine without the lock: a guard held elsewhere does not hold it up.
void the_table_and_a_grammar_need_no_lock() {
    FakeLib lib;
    lib.mtp_draft = nullptr;                         // a library without MTP
    FakeEngine fe;
    Engine eng(lib, &fe);
    CHECK(&eng.lib() == &lib);
    CHECK(eng.lib().mtp_draft == nullptr);
    const float row[2] = {4.0f, 1.0f};
    CHECK(eng.lib().sample(row, 2) == 4);
    auto g = eng.lock();                             // held here, on this thread, all along
    std::atomic<bool> opened{false};
    std::thread t([&] {
        int * gr = nullptr;
        CHECK(eng.grammar_open("root ::= \"a\"", nullptr, &gr) == 0);
        opened = true;
    });
    t.join();                                        // would never return if grammar_open took the lock
    CHECK(opened && fe.grammar_opens == 1);
}

}  // namespace

int main() {
    every_call_holds_the_lock();
    a_second_guard_waits_for_the_first();
    threads_never_meet_in_the_engine();
    the_table_and_a_grammar_need_no_lock();
    return dgr::unit::finish("locked_engine_test");
}
