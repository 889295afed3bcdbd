// The fake model's spec, "layers=6,embd=16,cuts=2:4,...": parsed and checked as FakeModel.from_spec does,
// and its canonical form (dgr_fake_spec, which dgr-worker hashes into the fake bundle id).
#include "dgr_fake_internal.h"

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <string>

namespace dgr_fake {

namespace {

const char * const KEYS[] = {"layers", "embd", "streams", "vocab", "seed", "cuts", "hash_layers", "ctx",
                             "sessions", "recurrent"};

// Python's repr of a str without quotes or backslashes in it (the spec texts the messages quote)
std::string repr(const std::string & s) { return "'" + s + "'"; }

std::string strip(const std::string & s) {
    size_t b = s.find_first_not_of(" \t\n\r\f\v"), e = s.find_last_not_of(" \t\n\r\f\v");
    return b == std::string::npos ? "" : s.substr(b, e - b + 1);
}

int64_t to_int(const std::string & spec, const std::string & part, const std::string & v) {
    std::string t = strip(v);
    errno = 0;
    char * end = nullptr;
    long long x = t.empty() ? 0 : std::strtoll(t.c_str(), &end, 10);
    if (t.empty() || errno || *end) {
        throw Fail(DGR_E_ENGINE, "fake engine spec " + repr(spec) + ": bad item " + repr(part) + "; " + repr(v) +
                                     " is not an integer");
    }
    return x;
}

}  // namespace

// FakeModel.from_spec and its checks, plus stage= (when allowed) and the bounds a C engine needs.
Spec parse(const std::string & text, bool allow_stage) {
    Spec s;
    std::string keys;
    for (const char * k : KEYS) keys += (keys.empty() ? "" : ", ") + std::string(k);
    size_t at = 0;
    while (at <= text.size()) {
        size_t comma = text.find(',', at);
        std::string part = strip(text.substr(at, comma == std::string::npos ? std::string::npos : comma - at));
        at = comma == std::string::npos ? text.size() + 1 : comma + 1;
        if (part.empty()) continue;
        size_t eq = part.find('=');
        std::string key = eq == std::string::npos ? part : part.substr(0, eq);
        std::string value = eq == std::string::npos ? "" : part.substr(eq + 1);
        bool known = allow_stage && key == "stage";
        for (const char * k : KEYS) known = known || key == k;
        if (eq == std::string::npos || !known) {
            throw Fail(DGR_E_ENGINE, "fake engine spec " + repr(text) + ": bad item " + repr(part) +
                                         "; expected key=value with key in " + keys + (allow_stage ? ", stage" : ""));
        }
        if (key == "cuts") {
            s.cuts.clear();
            size_t c0 = 0;
            while (c0 <= value.size()) {
                size_t c1 = value.find(':', c0);
                std::string c = value.substr(c0, c1 == std::string::npos ? std::string::npos : c1 - c0);
                c0 = c1 == std::string::npos ? value.size() + 1 : c1 + 1;
                if (!c.empty()) s.cuts.push_back(to_int(text, part, c));
            }
            continue;
        }
        int64_t x = to_int(text, part, value);
        if (key == "layers") s.layers = x;
        else if (key == "embd") s.embd = x;
        else if (key == "streams") s.streams = x;
        else if (key == "vocab") s.vocab = x;
        else if (key == "seed") s.seed = x;
        else if (key == "hash_layers") s.hash_layers = x;
        else if (key == "ctx") s.ctx = x;
        else if (key == "sessions") s.sessions = x;
        else if (key == "recurrent") s.recurrent = x;
        else s.stage = x;
    }
    if (s.vocab < BYTE0 + 256) {
        throw Fail(DGR_E_ENGINE, "fake model: vocab=" + std::to_string(s.vocab) + " must be at least " + std::to_string(BYTE0 + 256));
    }
    bool cuts_ok = true;
    for (size_t i = 0; i < s.cuts.size(); ++i) {
        cuts_ok = cuts_ok && 0 < s.cuts[i] && s.cuts[i] < s.layers && (i == 0 || s.cuts[i - 1] < s.cuts[i]);
    }
    if (!cuts_ok) {
        std::string cs;
        for (size_t i = 0; i < s.cuts.size(); ++i) cs += (i ? ", " : "") + std::to_string(s.cuts[i]);
        if (s.cuts.size() == 1) cs += ",";
        throw Fail(DGR_E_ENGINE, "fake model: cuts=(" + cs + ") must be increasing layer indices inside (0, " +
                                     std::to_string(s.layers) + ")");
    }
    // what a C engine needs besides (the Python dataclass never checked them)
    auto at_least = [](const char * k, int64_t v, int64_t lo, int64_t hi) {
        if (v < lo || v > hi) {
            throw Fail(DGR_E_ENGINE, "fake model: " + std::string(k) + "=" + std::to_string(v) + " must be in [" +
                                         std::to_string(lo) + ", " + std::to_string(hi) + "]");
        }
    };
    at_least("layers", s.layers, 1, 1 << 16);
    at_least("embd", s.embd, 1, 1 << 16);
    at_least("streams", s.streams, 1, 64);
    at_least("vocab", s.vocab, BYTE0 + 256, 1 << 24);
    at_least("hash_layers", s.hash_layers, 0, INT32_MAX);
    at_least("ctx", s.ctx, 1, INT32_MAX);
    at_least("sessions", s.sessions, 1, 1 << 20);
    if (s.width() > (1 << 16)) {
        throw Fail(DGR_E_ENGINE, "fake model: streams*embd=" + std::to_string(s.width()) + " must be at most 65536");
    }
    const int64_t n_stages = int64_t(s.cuts.size()) + 1;
    if (s.stage != -1 && (s.stage < 0 || s.stage >= n_stages)) {
        throw Fail(DGR_E_ENGINE, "fake bundle has " + std::to_string(n_stages) + " stages; there is no stage " +
                                     std::to_string(s.stage));
    }
    return s;
}

}  // namespace dgr_fake

using namespace dgr_fake;

extern "C" {

DGR_API int32_t dgr_fake_spec(const char * spec, char * out, int32_t cap, int32_t * n_stages) {
    int32_t len = -1;
    int32_t st = guarded([&] {
        if (!spec) throw Fail(DGR_E_ENGINE, "fake engine: no spec");
        Spec s = parse(spec, false);
        std::string c = s.canonical();
        if (out && cap > 0) {
            std::memcpy(out, c.data(), std::min<size_t>(c.size(), size_t(cap)));
            if (c.size() < size_t(cap)) out[c.size()] = '\0';
        }
        if (n_stages) *n_stages = int32_t(s.cuts.size() + 1);
        len = int32_t(c.size());
        return DGR_OK;
    });
    return st == DGR_OK ? len : -1;
}

}  // extern "C"
