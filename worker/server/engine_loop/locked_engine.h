// The engine under its lock: the engine library's table and the open engine, with the one lock that keeps the
// engine from being called from two threads at once.
//
// A part that owns the engine handle and its lock. The handle is reached only through a Guard (`lock()`), which
// holds the lock for as long as it lives, so no call on the model or a session can be made without it. What needs
// no engine (the sampler, log-probabilities, a grammar's mask and advance, the wire-dtype converters, the last
// error) is the table's, through `lib()`: those functions take no handle, and every function that takes one is
// called here. The one engine call made outside the lock is `grammar_open` (below, and why).
//
// The lock is taken holding no other lock of the worker's; under it the worker takes its own (docs/worker.md
// "Locks and their order"). A template over the library's table and the handle, so locked_engine_test.cpp checks
// it with a table of its own, nothing of the engine library: a cc_test under Bazel, `dgr-worker-unit-tests` under
// CMake. dgr-worker uses LockedEngine<EngineLib, dgr_engine> (engine_lib.h).
#pragma once

#include <mutex>
#include <utility>

namespace dgr {

template <class Lib, class Handle>
class LockedEngine {
  public:
    // `lib` outlives this (the worker's loaded library); `eng` is open, and closed by its opener once nothing
    // calls it (drain.cpp: after the engine thread is joined)
    LockedEngine(const Lib & lib, Handle * eng) : lib_(lib), eng_(eng) {}
    LockedEngine(const LockedEngine &) = delete;
    LockedEngine & operator=(const LockedEngine &) = delete;

    // The lock, held until the guard goes: the one way to call the engine. Each call is named after the C ABI's
    // function it makes (dgr_engine.h) and takes that function's arguments less the handle.
    class Guard {
      public:
        Guard(const Guard &) = delete;
        Guard & operator=(const Guard &) = delete;

        // the stage (once, at start)
        template <class... A> auto describe(A &&... a) { return call(&Lib::describe, std::forward<A>(a)...); }
        template <class... A> auto memory(A &&... a) { return call(&Lib::memory, std::forward<A>(a)...); }
        template <class... A> auto can_truncate(A &&... a) { return call(&Lib::can_truncate, std::forward<A>(a)...); }
        // a session's cache: open, close, how much it holds, a rollback, its state (the prefix cache)
        template <class... A> auto session_open(A &&... a) { return call(&Lib::session_open, std::forward<A>(a)...); }
        template <class... A> auto session_close(A &&... a) { return call(&Lib::session_close, std::forward<A>(a)...); }
        template <class... A> auto n_cached(A &&... a) { return call(&Lib::n_cached, std::forward<A>(a)...); }
        template <class... A> auto truncate(A &&... a) { return call(&Lib::truncate, std::forward<A>(a)...); }
        template <class... A> auto state_get(A &&... a) { return call(&Lib::state_get, std::forward<A>(a)...); }
        template <class... A> auto state_set(A &&... a) { return call(&Lib::state_set, std::forward<A>(a)...); }
        // the steps, and the last stage's MTP drafts
        template <class... A> auto forward(A &&... a) { return call(&Lib::forward, std::forward<A>(a)...); }
        template <class... A> auto mtp_draft(A &&... a) { return call(&Lib::mtp_draft, std::forward<A>(a)...); }
        // the vocabulary
        template <class... A> auto tokenize(A &&... a) { return call(&Lib::tokenize, std::forward<A>(a)...); }
        template <class... A> auto detokenize(A &&... a) { return call(&Lib::detokenize, std::forward<A>(a)...); }

      private:
        friend class LockedEngine;
        explicit Guard(LockedEngine & e) : e_(e), held_(e.mu_) {}
        template <class F, class... A> auto call(F Lib::*fn, A &&... a) {
            return (e_.lib_.*fn)(e_.eng_, std::forward<A>(a)...);
        }
        LockedEngine & e_;
        std::lock_guard<std::mutex> held_;
    };

    // Takes the lock (waiting for whoever holds it) and hands back the guard: `auto eg = engine_.lock();`.
    Guard lock() { return Guard(*this); }

    // The table: the functions that take no engine, and whether the library has a function at all (an older
    // library or the fake engine leaves some null).
    const Lib & lib() const { return lib_; }

    // A grammar (Sampling.grammar / json_schema) is converted outside the lock: it reads only the model's
    // vocabulary, which no step changes, so a slow conversion holds up its own request alone (the worker bounds
    // how many run at once: lifecycle/open.cpp). The grammar it makes is then used by the engine thread alone.
    template <class... A> auto grammar_open(A &&... a) const {
        return lib_.grammar_open(eng_, std::forward<A>(a)...);
    }

  private:
    const Lib & lib_;
    Handle * const eng_;
    std::mutex mu_;                                  // the engine: every call that takes eng_ but grammar_open
};

}  // namespace dgr
