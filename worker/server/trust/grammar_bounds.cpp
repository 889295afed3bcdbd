#include "trust/grammar_bounds.h"

#include <algorithm>

namespace dgr {

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

std::string refuse_grammar(const std::string & text, bool json, int64_t max_bytes, int64_t max_depth) {
    if (text.empty()) return "";
    const char * field = json ? "sampling.json_schema" : "sampling.grammar";
    if (int64_t(text.size()) > max_bytes) {
        return std::string(field) + " is " + std::to_string(text.size()) + " bytes, over this worker's bound of " +
               std::to_string(max_bytes) + " (--max-grammar-bytes): send a smaller one";
    }
    const int64_t depth = nesting(text, json, max_depth);
    if (depth > max_depth) {
        return std::string(field) + " nests " + (json ? "objects and arrays" : "groups") + " more than " +
               std::to_string(max_depth) + " levels deep (--max-grammar-depth " + std::to_string(max_depth) +
               "): flatten it";
    }
    return "";
}

}  // namespace dgr
