// The stage's vocabulary: what Tokenize and Detokenize do, over the engine (rpc/tokenize.cpp hands each request
// here and writes back the answer or the refusal).
//
// A part with no state of its own: the engine under its lock (engine_loop/locked_engine.h), whether the stage
// holds a vocabulary, and how the stage names itself in a refusal. Each call takes the engine's lock once and holds
// it across its grow-and-retry loop (the engine answers how many ids or bytes it needed when the buffer was too
// small, and is asked again with that much), and reads the engine's message for a refusal before letting it go.
// It takes the lock holding no other and takes none under it (docs/worker.md "Locks and their order").
// Detokenize's bytes become text as Python's decode(errors="replace") makes them (wire/utf8.h).
//
// A template over the library's table and the handle, as LockedEngine is, so vocabulary_test.cpp checks it with an
// engine of its own: a cc_test under Bazel, `dgr-worker-unit-tests` under CMake. dgr-worker's is
// Vocabulary<EngineLib, dgr_engine> (engine_loop/stage_engine.h: StageVocabulary).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "engine_loop/locked_engine.h"
#include "wire/utf8.h"

namespace dgr {

template <class Lib, class Handle>
class Vocabulary {
  public:
    // Why a call was refused: the stage holds no vocabulary, or the engine refused it (an id outside the
    // vocabulary, ...). The handlers answer FAILED_PRECONDITION and INVALID_ARGUMENT (rpc/tokenize.cpp).
    enum class Refused { none, no_vocabulary, engine };
    template <class T> struct Answer {
        Refused refused = Refused::none;
        std::string why;                             // the refusal's whole message (refused only)
        T value{};                                   // the ids, or the text (not refused)
    };

    // The status an engine's refusal is read with (`Lib::error`: the engine's last error, else "engine status 1"):
    // dgr_engine.h's DGR_E_ENGINE, which this part does not include (rpc/tokenize.cpp checks that they agree).
    static constexpr int32_t ENGINE_REFUSED = 1;

    // `engine` outlives this. `has_vocab`: the stage's (dgr_stage_info). `who`: the stage's name in a refusal, asked
    // only then (the hop's name: "stage 1 (HOST:PORT)").
    Vocabulary(LockedEngine<Lib, Handle> & engine, bool has_vocab, std::function<std::string()> who)
        : engine_(engine), has_vocab_(has_vocab), who_(std::move(who)) {}
    Vocabulary(const Vocabulary &) = delete;
    Vocabulary & operator=(const Vocabulary &) = delete;

    // The token ids of `text` (add_special: the model's BOS and the like, as the engine adds them).
    Answer<std::vector<int32_t>> tokenize(const std::string & text, bool add_special) {
        using A = Answer<std::vector<int32_t>>;
        if (!has_vocab_) return no_vocabulary<A>();
        std::vector<int32_t> ids(text.size() + 16);
        int32_t n;
        {
            auto eg = engine_.lock();
            while (true) {
                n = eg.tokenize(text.c_str(), add_special, ids.data(), int32_t(ids.size()));
                if (n < 0) return engine_refused<A>();   // its message read under the lock
                if (size_t(n) <= ids.size()) break;
                ids.resize(size_t(n));
            }
        }
        ids.resize(size_t(n));
        A a;
        a.value = std::move(ids);
        return a;
    }

    // The text of `ids`, invalid UTF-8 replaced by U+FFFD.
    Answer<std::string> detokenize(std::vector<int32_t> ids) {
        using A = Answer<std::string>;
        if (!has_vocab_) return no_vocabulary<A>();
        const int32_t n_ids = int32_t(ids.size());
        if (ids.empty()) ids.push_back(0);           // the array is never empty; n_ids says how many count
        std::string buf(16 * size_t(n_ids) + 16, '\0');
        int32_t n;
        {
            auto eg = engine_.lock();
            while (true) {
                n = eg.detokenize(ids.data(), n_ids, &buf[0], int32_t(buf.size()));
                if (n < 0) return engine_refused<A>();
                if (size_t(n) <= buf.size()) break;
                buf.resize(size_t(n));
            }
        }
        buf.resize(size_t(n));
        A a;
        a.value = utf8_replace(buf);
        return a;
    }

  private:
    template <class A> A no_vocabulary() const {
        A a;
        a.refused = Refused::no_vocabulary;
        a.why = who_() + " holds no vocabulary";
        return a;
    }
    template <class A> A engine_refused() const {
        A a;
        a.refused = Refused::engine;
        a.why = engine_.lib().error(ENGINE_REFUSED);
        return a;
    }

    LockedEngine<Lib, Handle> & engine_;
    const bool has_vocab_;
    const std::function<std::string()> who_;
};

}  // namespace dgr
