// json-schema-to-grammar.cpp (llama.cpp's common/, compiled into the engine for grammar sampling:
// dgr_grammar.cpp) uses three string helpers that live in common/common.cpp, whose other contents (argument
// parsing, model fitting, sampling, downloads) the engine does not want. These are their declarations in
// common.h, defined here. Compiled with those common/ files: into libdgr_engine.so by CMake
// (worker/CMakeLists.txt), into @llama_cpp//:json_schema_to_grammar by Bazel
// (toolchains/bazel/llama.cpp.BUILD.bazel), so that library stands on its own however it is linked.

#include "common.h"

#include <string>
#include <vector>

std::string string_join(const std::vector<std::string> & values, const std::string & separator) {
    std::string out;
    for (size_t i = 0; i < values.size(); ++i) {
        if (i) out += separator;
        out += values[i];
    }
    return out;
}

std::vector<std::string> string_split(const std::string & str, const std::string & delimiter) {
    std::vector<std::string> parts;
    if (delimiter.empty()) {
        parts.push_back(str);
        return parts;
    }
    size_t from = 0;
    for (size_t at; (at = str.find(delimiter, from)) != std::string::npos; from = at + delimiter.size()) {
        parts.push_back(str.substr(from, at - from));
    }
    parts.push_back(str.substr(from));
    return parts;
}

std::string string_repeat(const std::string & str, size_t n) {
    std::string out;
    out.reserve(str.size() * n);
    while (n--) out += str;
    return out;
}
