// One string key of a GGUF file's header (tokenizer.chat_template), read without llama.cpp: the worker
// talks to the engine through its C ABI only, and the ABI does not carry the template.
#pragma once

#include <optional>
#include <string>

namespace dgr {

// The string value of `key`; nullopt when the header has no such key or it is not a string. Throws
// std::runtime_error naming the file when the header cannot be read.
std::optional<std::string> gguf_string(const std::string & path, const std::string & key);

}  // namespace dgr
