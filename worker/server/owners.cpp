// Owners (issue 35, docs/security.md): under mutual TLS every session lives in the namespace of the member
// that opened it at this worker, so no other member can name, step, evict or close it at any epoch, and
// what a request may ask of the worker is bounded before any parser sees it.
//
// This worker's key for a session is qualify(opener, id as the opener named it): "<member>/<id>", the
// member's '%' and '/' escaped, so two members' keys never meet. Stage 0 names each session to the route's
// later hops and its origin by an id of its own (Session::wire_down: the client's id and 128 random bits),
// which no member off the route can guess; every later stage passes on the id it got. Without mutual TLS
// the worker has one tenant and a key is the id itself.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <stdexcept>
#include <string>

#include "worker.h"

namespace dgr {

namespace pb = dgr::v1;

std::string StageWorker::qualify(const std::optional<std::string> & member, const std::string & sid) const {
    if (!trust_.mutual) return sid;
    std::string out;
    for (char c : member.value_or("")) {
        if (c == '%') out += "%25";
        else if (c == '/') out += "%2F";
        else out += c;
    }
    return out + "/" + sid;
}

std::string StageWorker::wire_of(const std::string & key) const {
    if (!trust_.mutual) return key;
    const size_t slash = key.find('/');
    return slash == std::string::npos ? key : key.substr(slash + 1);
}

std::string StageWorker::owner_of(const std::string & key) const {
    if (!trust_.mutual) return "";
    const size_t slash = key.find('/');
    return slash == std::string::npos ? "" : key.substr(0, slash);
}

std::string StageWorker::origin_key(const std::string & wire) const {
    if (!trust_.mutual) return wire;
    auto it = down_.find(wire);
    return it == down_.end() ? std::string() : it->second;
}

// The tests' hooks (--test-die-at SESSION:...) name a session as its client did: the id without its owner
// (and, past stage 0, without the random part stage 0 added)
bool StageWorker::hook_at(const std::set<std::tuple<std::string, uint64_t, int64_t>> & at, const std::string & key,
                          uint64_t epoch, int64_t p) const {
    if (at.empty()) return false;
    std::string name = key;
    if (trust_.mutual) {
        if (size_t slash = name.rfind('/'); slash != std::string::npos) name = name.substr(slash + 1);
        if (size_t hash = name.rfind('#'); hash != std::string::npos) name = name.substr(0, hash);
    }
    return at.count({name, epoch, p}) > 0;
}

// 128 bits from the kernel, as hex: stage 0's part of a session's wire_down id
std::string random_hex16() {
    unsigned char b[16];
    size_t got = 0;
    int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
    if (fd >= 0) {
        while (got < sizeof b) {
            ssize_t n = read(fd, b + got, sizeof b - got);
            if (n <= 0) break;
            got += size_t(n);
        }
        close(fd);
    }
    if (got != sizeof b) throw std::runtime_error("could not read /dev/urandom for a session id");
    static const char * HEX = "0123456789abcdef";
    std::string out;
    for (unsigned char c : b) {
        out += HEX[c >> 4];
        out += HEX[c & 15];
    }
    return out;
}

namespace {

// How deep `text` nests: GBNF groups "(...)" outside literals, classes and comments (grammar), or JSON's
// objects and arrays outside strings (json). Stops counting past `limit`.
int64_t nesting(const std::string & text, bool json, int64_t limit) {
    int64_t depth = 0, most = 0;
    bool in_str = false, esc = false, in_class = false, comment = false;
    for (char c : text) {
        if (comment) { if (c == '\n' || c == '\r') comment = false; continue; }
        if (in_str) {
            if (esc) esc = false;
            else if (c == '\\') esc = true;
            else if (c == '"') in_str = false;
            continue;
        }
        if (in_class) {
            if (esc) esc = false;
            else if (c == '\\') esc = true;
            else if (c == ']') in_class = false;
            continue;
        }
        if (c == '"') { in_str = true; continue; }
        if (json) {
            if (c == '{' || c == '[') most = std::max(most, ++depth);
            else if ((c == '}' || c == ']') && depth > 0) --depth;
        } else {
            if (c == '#') comment = true;
            else if (c == '[') in_class = true;
            else if (c == '(') most = std::max(most, ++depth);
            else if (c == ')' && depth > 0) --depth;
        }
        if (most > limit) break;
    }
    return most;
}

}  // namespace

std::string StageWorker::refuse_grammar(const pb::Sampling & sp) const {
    const bool json = sp.grammar().empty();
    const std::string & text = json ? sp.json_schema() : sp.grammar();
    if (text.empty()) return "";
    const char * field = json ? "sampling.json_schema" : "sampling.grammar";
    if (int64_t(text.size()) > limits_.max_grammar_bytes) {
        return std::string(field) + " is " + std::to_string(text.size()) + " bytes, over this worker's bound of " +
               std::to_string(limits_.max_grammar_bytes) + " (--max-grammar-bytes): send a smaller one";
    }
    const int64_t depth = nesting(text, json, limits_.max_grammar_depth);
    if (depth > limits_.max_grammar_depth) {
        return std::string(field) + " nests " + (json ? "objects and arrays" : "groups") + " more than " +
               std::to_string(limits_.max_grammar_depth) + " levels deep (--max-grammar-depth " +
               std::to_string(limits_.max_grammar_depth) + "): flatten it";
    }
    return "";
}

}  // namespace dgr
