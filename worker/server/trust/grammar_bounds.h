// What a session's grammar may be (docs/worker.md "Bounds": --max-grammar-bytes, --max-grammar-depth), checked on
// the text alone before llama.cpp's parser sees it: that parser recurses once per nesting level (20,000 levels
// overflowed the stack). A pure function; no state.
#pragma once

#include <cstdint>
#include <string>

namespace dgr {

// "" when `text` (Sampling.grammar, GBNF; or Sampling.json_schema when `json`) is at most `max_bytes` long and
// nests at most `max_depth` levels, else why not, naming the field, the bound and its flag. Nesting counts GBNF
// groups "(...)" outside literals, character classes and comments, or JSON's objects and arrays outside strings.
// An empty text is no grammar: "".
std::string refuse_grammar(const std::string & text, bool json, int64_t max_bytes, int64_t max_depth);

}  // namespace dgr
