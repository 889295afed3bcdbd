// What the engine's own source files share beyond the C ABI (dgr_engine.cpp defines these; dgr_grammar.cpp
// uses them). Not installed, not part of the ABI.
#pragma once

#include <cstdint>
#include <functional>
#include <stdexcept>
#include <string>

struct dgr_engine;
struct llama_vocab;

// A refusal with its dgr_status code; dgr_engine_guarded turns it into the status and dgr_last_error().
struct dgr_engine_error : std::runtime_error {
    int32_t code;
    dgr_engine_error(int32_t code_, const std::string & msg) : std::runtime_error(msg), code(code_) {}
};

// Runs f; no exception escapes: DGR_OK, or the error's code (DGR_E_ENGINE for any other exception).
int32_t dgr_engine_guarded(const std::function<void()> & f);

// The open engine's vocabulary, or null when its stage has none.
const llama_vocab * dgr_engine_llama_vocab(dgr_engine * eng);

// llama.cpp's error lines logged since the last call (why a parser or loader refused), emptied.
std::string dgr_engine_take_log_errors();
