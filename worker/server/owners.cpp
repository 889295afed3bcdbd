// Owners (docs/security.md): what a request may ask of the worker, bounded before any parser sees it, and the
// origin's map from the ids stage 0 gave its sessions to this worker's keys (kept by the session table,
// sessions/session_table.h). Whose a session is, from its key, is the part sessions/names.h.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <stdexcept>
#include <string>

#include "worker.h"

namespace dgr {

namespace pb = dgr::v1;

std::string StageWorker::origin_key(const std::string & wire) const {
    return trust_.mutual ? sessions_.origin_key(wire) : wire;
}

// The tests' hooks (--test-die-at SESSION:...) name a session as its client did (SessionNames::client_name)
bool StageWorker::hook_at(const std::set<std::tuple<std::string, uint64_t, int64_t>> & at, const std::string & key,
                          uint64_t epoch, int64_t p) const {
    return !at.empty() && at.count({names_.client_name(key), epoch, p}) > 0;
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
