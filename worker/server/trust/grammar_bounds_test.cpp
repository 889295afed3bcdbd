// A session's grammar within --max-grammar-bytes and --max-grammar-depth (grammar_bounds.h) alone, as a hostile
// request would try it: one byte over the size bound, groups or objects one level too deep in GBNF and JSON, far
// too deep (what overflowed llama.cpp's parser), and brackets that are text (inside literals, strings,
// character classes, comments, behind escapes) never counted. Each refusal is checked word for word. No gRPC, no
// engine. `bazel test //worker/server:grammar_bounds_test`, or the CMake target dgr-unit-grammar_bounds_test
// (tests/worker/test_worker_units.py builds and runs it).
#include "unit_check.h"
#include "trust/grammar_bounds.h"

#include <cstdint>
#include <cstdio>
#include <string>

namespace {

using dgr::refuse_grammar;

bool admitted(const std::string & text, bool json, int64_t max_bytes, int64_t max_depth) {
    const std::string why = refuse_grammar(text, json, max_bytes, max_depth);
    if (!why.empty()) std::fprintf(stderr, "  '%s' refused: %s\n", text.substr(0, 80).c_str(), why.c_str());
    return why.empty();
}

bool refused_as(const std::string & text, bool json, int64_t max_bytes, int64_t max_depth, const std::string & want) {
    const std::string why = refuse_grammar(text, json, max_bytes, max_depth);
    if (why != want) std::fprintf(stderr, "  '%s':\n    got  %s\n    want %s\n", text.substr(0, 80).c_str(), why.c_str(), want.c_str());
    return why == want;
}

std::string too_deep(const char * field, const char * what, int64_t depth) {
    return std::string(field) + " nests " + what + " more than " + std::to_string(depth) + " levels deep (--max-grammar-depth " +
           std::to_string(depth) + "): flatten it";
}

std::string gbnf_too_deep(int64_t depth) { return too_deep("sampling.grammar", "groups", depth); }
std::string json_too_deep(int64_t depth) { return too_deep("sampling.json_schema", "objects and arrays", depth); }

void no_grammar_is_no_check() {
    CHECK(admitted("", false, 0, 0));
    CHECK(admitted("", true, 0, 0));
}

void size_is_bounded_before_anything_is_read() {
    const std::string ten = "root ::= a";
    CHECK(admitted(ten, false, 10, 64));
    CHECK(refused_as(ten + " ", false, 10, 64,
                     "sampling.grammar is 11 bytes, over this worker's bound of 10 (--max-grammar-bytes): send a smaller one"));
    CHECK(refused_as("{\"type\": \"string\"}", true, 17, 64,
                     "sampling.json_schema is 18 bytes, over this worker's bound of 17 (--max-grammar-bytes): send a smaller one"));
    // over both bounds: the size is what is said
    CHECK(refused_as(std::string(100, '('), false, 10, 2,
                     "sampling.grammar is 100 bytes, over this worker's bound of 10 (--max-grammar-bytes): send a smaller one"));
}

void gbnf_groups_are_counted() {
    const std::string three = "root ::= ((( \"a\" ) \"b\" ) \"c\" )";
    CHECK(admitted(three, false, 1024, 3));
    CHECK(refused_as(three, false, 1024, 2, gbnf_too_deep(2)));
    // groups side by side are one level each
    CHECK(admitted("root ::= (\"a\") (\"b\") (\"c\") (\"d\")", false, 1024, 1));
    // closers with no opener do not pay for openers after them
    CHECK(refused_as("root ::= ))) (((\"a\")))", false, 1024, 2, gbnf_too_deep(2)));
    // JSON's brackets mean nothing in GBNF ([...] is a class there, {m,n} a repetition)
    CHECK(admitted("root ::= \"a\"{1,3} [{{{]", false, 1024, 0));
    // what overflowed llama.cpp's parser's stack, refused without being walked to its end
    CHECK(refused_as("root ::= " + std::string(20000, '(') + "\"a\"" + std::string(20000, ')'), false, 1 << 20, 64,
                     gbnf_too_deep(64)));
}

void gbnf_text_is_not_counted() {
    // literals, escapes inside them, character classes (an escaped ']' does not end one), comments to the line's end
    CHECK(admitted("root ::= \"((((((\" (\"a\")", false, 1024, 1));
    CHECK(admitted("root ::= \"\\\"((((((\" (\"a\")", false, 1024, 1));
    CHECK(admitted("root ::= [((((((] (\"a\")", false, 1024, 1));
    CHECK(admitted("root ::= [\\](((((] (\"a\")", false, 1024, 1));
    CHECK(admitted("# ((((((\nroot ::= (\"a\")", false, 1024, 1));
    CHECK(admitted("# ((((((\rroot ::= (\"a\")", false, 1024, 1));
    // ... and the groups after them still are
    CHECK(refused_as("# (\nroot ::= \"(\" [(] ((\"a\"))", false, 1024, 1, gbnf_too_deep(1)));
}

void json_objects_and_arrays_are_counted() {
    const std::string three = "{\"a\": [{\"b\": 1}]}";
    CHECK(admitted(three, true, 1024, 3));
    CHECK(refused_as(three, true, 1024, 2, json_too_deep(2)));
    CHECK(refused_as(std::string(20000, '[') + std::string(20000, ']'), true, 1 << 20, 64, json_too_deep(64)));
    // GBNF's groups mean nothing in JSON
    CHECK(admitted("{\"a\": 1} ((((", true, 1024, 1));
}

void json_strings_are_not_counted() {
    CHECK(admitted("{\"k\": \"[[[[{{{{\"}", true, 1024, 1));
    CHECK(admitted("{\"k\": \"\\\"[[[[{{{{\"}", true, 1024, 1));
    CHECK(admitted("{\"[[[[\": {\"b\": 1}}", true, 1024, 2));
    // '#' is no comment in JSON: the brackets after it count
    CHECK(refused_as("{\"a\": 1, \"#\": 2} # [[", true, 1024, 1, json_too_deep(1)));
}

}  // namespace

int main() {
    no_grammar_is_no_check();
    size_is_bounded_before_anything_is_read();
    gbnf_groups_are_counted();
    gbnf_text_is_not_counted();
    json_objects_and_arrays_are_counted();
    json_strings_are_not_counted();
    return dgr::unit::finish("grammar_bounds_test");
}
