// The vocabulary alone (vocabulary.h): a buffer too small is grown to what the engine asked for and the engine
// asked again, every engine call (the retry and the refusal's message included) is made with the engine's lock
// held, invalid UTF-8 comes back as Python's decode(errors="replace") has it, an engine's refusal is its message,
// a stage without a vocabulary refuses before the engine is called, and threads share it.
// No gRPC, no engine library: a table of this test's own functions stands for it, as in locked_engine_test.cpp.
// `bazel test //worker/server:vocabulary_test`, or the CMake target dgr-worker-unit-tests
// (tests/worker/test_worker_units.py builds and runs it).
#include "unit_check.h"
#include "engine_loop/vocabulary.h"

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

namespace {

// The handle: what the test's engine does and saw.
struct FakeEngine {
    int ids_per_byte = 1;                            // tokenize: this many ids for each byte of the text
    int bytes_per_id = 1;                            // detokenize: this many bytes (the id's low byte) for each id
    bool refuse = false;                             // every call fails (-1)
    std::atomic<int> calls{0}, inside{0}, most{0};
    bool record = true;                              // note each call's buffer size in caps (one thread only)
    std::vector<int32_t> caps;
    int32_t add_special = -1, n_ids = -1, first_id = -1;
    bool unlocked_call = false;                      // a call (or the refusal's message) made without the lock
    bool (*lock_is_held)() = nullptr;                // set by a test: asked from inside each call
};

// The engine's last error, as the engine library keeps it (EngineLib::error reads it)
std::string last_error;

void enter(FakeEngine * e, int32_t cap) {
    const int now = ++e->inside;
    int most = e->most.load();
    while (now > most && !e->most.compare_exchange_weak(most, now)) {}
    if (e->lock_is_held && !e->lock_is_held()) e->unlocked_call = true;
    if (e->record) e->caps.push_back(cap);
    std::this_thread::yield();                       // widen the window a second caller would fall into
    ++e->calls;
    --e->inside;
}

int32_t fake_tokenize(FakeEngine * e, const char * text, int32_t add_special, int32_t * ids, int32_t cap) {
    enter(e, cap);
    if (e->refuse) {
        last_error = "cannot tokenize that";
        return -1;
    }
    e->add_special = add_special;
    const int32_t n = int32_t(std::strlen(text)) * e->ids_per_byte;
    for (int32_t i = 0; i < n && i < cap; ++i) ids[i] = int32_t(static_cast<unsigned char>(text[i / e->ids_per_byte])) * 10 + i % e->ids_per_byte;
    return n;
}

int32_t fake_detokenize(FakeEngine * e, const int32_t * ids, int32_t n, char * out, int32_t cap) {
    enter(e, cap);
    e->n_ids = n;
    e->first_id = ids ? ids[0] : -2;                 // the array is never empty, even for n == 0
    if (e->refuse) {
        last_error = "token id " + std::to_string(ids[0]) + " is outside the vocabulary";
        return -1;
    }
    const int32_t bytes = n * e->bytes_per_id;
    for (int32_t i = 0; i < bytes && i < cap; ++i) out[i] = char(ids[i / e->bytes_per_id] & 0xFF);
    return bytes;
}

// What the part calls: the two vocabulary functions and the last error, as EngineLib has them (engine_lib.h).
struct FakeLib {
    int32_t (*tokenize)(FakeEngine *, const char *, int32_t, int32_t *, int32_t) = fake_tokenize;
    int32_t (*detokenize)(FakeEngine *, const int32_t *, int32_t, char *, int32_t) = fake_detokenize;
    FakeEngine * engine = nullptr;                   // where the refusal's message is noted as read
    mutable int32_t asked = 0;                       // the status the last message was asked for
    std::string error(int32_t status) const {
        asked = status;
        if (engine && engine->lock_is_held && !engine->lock_is_held()) engine->unlocked_call = true;
        return last_error.empty() ? "engine status " + std::to_string(status) : last_error;
    }
};

using Engine = dgr::LockedEngine<FakeLib, FakeEngine>;
using Vocab = dgr::Vocabulary<FakeLib, FakeEngine>;
using Refused = Vocab::Refused;

using Probe = dgr::unit::LockProbe<Engine>;   // the lock probed from inside calls (unit_check.h)

// A test's engine and vocabulary, the lock probed from inside every call.
struct Rig {
    FakeLib lib;
    FakeEngine fe;
    Engine eng{lib, &fe};
    int asked_who = 0;
    Vocab vocab;
    explicit Rig(bool has_vocab = true)
        : vocab(eng, has_vocab, [this] { ++asked_who; return std::string("stage 1 (10.0.0.1:7000)"); }) {
        lib.engine = &fe;
        last_error.clear();
        Probe::probed = &eng;
        fe.lock_is_held = Probe::held;
    }
    ~Rig() {
        Probe::join();
        fe.lock_is_held = nullptr;
        Probe::probed = nullptr;
    }
};

std::vector<int32_t> ids_of(const std::string & text, int per_byte) {
    std::vector<int32_t> v;
    for (unsigned char c : text)
        for (int k = 0; k < per_byte; ++k) v.push_back(int32_t(c) * 10 + k);
    return v;
}

// Tokenize: a buffer of the text's length + 16 first; when the engine needs more it is asked again with exactly
// that, under the same lock; add_special passes through.
void tokenize_asks_again_with_what_the_engine_needs() {
    {
        Rig r;
        auto a = r.vocab.tokenize("hi", true);
        CHECK(a.refused == Refused::none && a.why.empty());
        CHECK(a.value == ids_of("hi", 1));
        CHECK(r.fe.calls == 1 && r.fe.caps == (std::vector<int32_t>{18}) && r.fe.add_special == 1);
    }
    {
        Rig r;
        r.fe.ids_per_byte = 3;                       // 12 bytes: 36 ids, more than 12 + 16
        auto a = r.vocab.tokenize("hello world!", false);
        CHECK(a.refused == Refused::none);
        CHECK(a.value == ids_of("hello world!", 3));
        CHECK(r.fe.calls == 2 && r.fe.caps == (std::vector<int32_t>{28, 36}) && r.fe.add_special == 0);
        Probe::join();
        CHECK(!r.fe.unlocked_call);
    }
    {
        Rig r;
        auto a = r.vocab.tokenize("", true);
        CHECK(a.refused == Refused::none && a.value.empty() && r.fe.caps == (std::vector<int32_t>{16}));
    }
}

// Detokenize: 16 bytes an id + 16 first, then what the engine asked for; no ids still hands the engine a
// one-element array with n 0.
void detokenize_asks_again_with_what_the_engine_needs() {
    {
        Rig r;
        r.fe.bytes_per_id = 40;                      // 2 ids: 80 bytes, more than 2 * 16 + 16
        auto a = r.vocab.detokenize({'A', 'b'});
        CHECK(a.refused == Refused::none);
        CHECK(a.value == std::string(40, 'A') + std::string(40, 'b'));
        CHECK(r.fe.calls == 2 && r.fe.caps == (std::vector<int32_t>{48, 80}) && r.fe.n_ids == 2);
        Probe::join();
        CHECK(!r.fe.unlocked_call);
    }
    {
        Rig r;
        auto a = r.vocab.detokenize({});
        CHECK(a.refused == Refused::none && a.value.empty());
        CHECK(r.fe.calls == 1 && r.fe.n_ids == 0 && r.fe.first_id == 0 && r.fe.caps == (std::vector<int32_t>{16}));
    }
}

// The engine's bytes as text: each maximal invalid subpart one U+FFFD, as CPython decodes (the expected strings
// are Python's bytes.decode("utf-8", "replace") of each case, encoded back to UTF-8).
void detokenize_replaces_invalid_utf8_as_python_does() {
    const std::string R = "\xEF\xBF\xBD";
    const std::vector<std::pair<std::string, std::string>> cases = {
        {"ok\xE2\x9C\x93", "ok\xE2\x9C\x93"},        // a whole sequence stays
        {"\xC3(", R + "("},                          // a lead byte whose continuation is not one
        {"\xF0\x9F\x98", R},                         // a sequence cut short: one replacement
        {"\xE2\x82", R},
        {"\xED\xA0\x80", R + R + R},                 // a surrogate: each byte on its own
        {"\xF4\x90\x80\x80", R + R + R + R},         // past U+10FFFF
        {"a\xFF" "b", "a" + R + "b"},
    };
    for (auto & [bytes, text] : cases) {
        Rig r;
        std::vector<int32_t> ids;
        for (unsigned char c : bytes) ids.push_back(int32_t(c));
        auto a = r.vocab.detokenize(ids);
        CHECK(a.refused == Refused::none);
        CHECK(a.value == text);
        CHECK(dgr::utf8_replace(bytes) == text);
    }
}

// An engine's refusal: the engine's own message, read with the lock still held and asked as ENGINE_REFUSED;
// without one, the status. Nothing else comes back.
void an_engines_refusal_is_its_message() {
    {
        Rig r;
        r.fe.refuse = true;
        auto a = r.vocab.detokenize({99999});
        CHECK(a.refused == Refused::engine && a.why == "token id 99999 is outside the vocabulary" && a.value.empty());
        CHECK(r.lib.asked == Vocab::ENGINE_REFUSED && r.asked_who == 0);
        Probe::join();
        CHECK(!r.fe.unlocked_call);
    }
    {
        Rig r;
        r.fe.refuse = true;
        auto a = r.vocab.tokenize("x", true);
        CHECK(a.refused == Refused::engine && a.why == "cannot tokenize that" && a.value.empty());
        CHECK(r.fe.calls == 1);
    }
    {
        Rig r;
        r.fe.refuse = true;
        r.lib.tokenize = [](FakeEngine * e, const char *, int32_t, int32_t *, int32_t) -> int32_t {
            ++e->calls;
            return -1;                               // a refusal that left no message
        };
        auto a = r.vocab.tokenize("x", true);
        CHECK(a.refused == Refused::engine && a.why == "engine status 1");
    }
}

// A stage without a vocabulary refuses before the engine is called, naming itself; with one, it never asks its name.
void no_vocabulary_refuses_without_the_engine() {
    Rig r(false);
    auto t = r.vocab.tokenize("hello", true);
    CHECK(t.refused == Refused::no_vocabulary && t.why == "stage 1 (10.0.0.1:7000) holds no vocabulary" && t.value.empty());
    auto d = r.vocab.detokenize({1, 2});
    CHECK(d.refused == Refused::no_vocabulary && d.why == "stage 1 (10.0.0.1:7000) holds no vocabulary");
    CHECK(r.fe.calls == 0 && r.asked_who == 2);
    Rig ok;
    ok.vocab.tokenize("hello", true);
    ok.vocab.detokenize({1});
    CHECK(ok.asked_who == 0);
}

// Threads tokenizing and detokenizing at once (some growing their buffers) never meet in the engine, and each
// gets its own answer.
void threads_share_it() {
    FakeLib lib;
    FakeEngine fe;
    fe.ids_per_byte = 2;
    fe.record = false;
    Engine eng(lib, &fe);
    Vocab vocab(eng, true, [] { return std::string("stage 0 (x)"); });
    constexpr int THREADS = 8, ROUNDS = 200;
    std::atomic<int> wrong{0};
    std::vector<std::thread> ts;
    for (int i = 0; i < THREADS; ++i) {
        ts.emplace_back([&, i] {
            const std::string text = "thread " + std::to_string(i) + std::string(size_t(i) * 3, 'x');
            for (int r = 0; r < ROUNDS; ++r) {
                if (vocab.tokenize(text, true).value != ids_of(text, 2)) ++wrong;
                if (vocab.detokenize({'a' + i, 'b'}).value != std::string{char('a' + i), 'b'}) ++wrong;
            }
        });
    }
    for (auto & t : ts) t.join();
    CHECK(wrong == 0);
    CHECK(fe.most == 1);
}

}  // namespace

int main() {
    tokenize_asks_again_with_what_the_engine_needs();
    detokenize_asks_again_with_what_the_engine_needs();
    detokenize_replaces_invalid_utf8_as_python_does();
    an_engines_refusal_is_its_message();
    no_vocabulary_refuses_without_the_engine();
    threads_share_it();
    return dgr::unit::finish("vocabulary_test");
}
