// What the data path's files share (frames.cpp lists them): the steady clock's type (clock.h has the clocks),
// frame sizing, the context error's text and the small text helpers of its messages.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

#include "clock.h"
#include "dgr/v1/stage.pb.h"
#include "wire_constants.h"

namespace dgr {

namespace pb = dgr::v1;
using Clock = std::chrono::steady_clock;

// Reconnecting to a peer: RECONNECT_INITIAL_MS, RECONNECT_MAX_MS and CONNECT_TIMEOUT_MS (wire_constants.h,
// generated from dgr.runtime.wire.limits); every channel a worker opens sets the three (tests/wire/test_wire_limits.py).
// set on the threads that read an incoming Frames stream: they may run a lone decode step themselves
extern thread_local bool t_reads_frames;

// The context error's text, word for word (tests/worker/test_worker_cpp_frames.py writes it out too)
inline std::string context_full(int64_t position, int64_t n_ctx) {
    return "the session reached the context limit: position " + std::to_string(position) + " is beyond the " +
           std::to_string(n_ctx) + " positions (0.." + std::to_string(n_ctx - 1) +
           ") a session may hold on this worker; start the workers with a larger `dgr worker serve --n-ctx N` "
           "(every stage of the route), or use a shorter prompt or fewer tokens";
}

template <typename T> std::string list_str(const T & xs) {
    std::string out = "[";
    bool first = true;
    for (auto x : xs) {
        out += (first ? "" : ", ") + std::to_string(x);
        first = false;
    }
    return out + "]";
}

// dgr.runtime.wire.codec.tokens_per_frame (at least one: the worker refuses a wire dtype that does not fit at start)
inline uint64_t tokens_per_frame(uint64_t max_message_bytes, uint64_t bytes_per_token) {
    uint64_t per = bytes_per_token + PER_TOKEN_IDS;
    return max_message_bytes > FRAME_OVERHEAD + per ? (max_message_bytes - FRAME_OVERHEAD) / per : 1;
}

// Python's len(str): code points of valid UTF-8
inline size_t code_points(const std::string & s) {
    size_t n = 0;
    for (unsigned char c : s) n += (c & 0xC0) != 0x80;
    return n;
}

// the byte offset of code point `n` of valid UTF-8 (its size when shorter)
inline size_t byte_offset(const std::string & s, size_t n) {
    size_t i = 0;
    for (; i < s.size(); ++i) {
        if ((static_cast<unsigned char>(s[i]) & 0xC0) != 0x80) {
            if (n == 0) return i;
            --n;
        }
    }
    return s.size();
}

inline const char * body_name(pb::Frame::BodyCase c) {
    switch (c) {
        case pb::Frame::kStep: return "'step'";
        case pb::Frame::kGenerate: return "'generate'";
        case pb::Frame::kToken: return "'token'";
        case pb::Frame::kLogits: return "'logits'";
        case pb::Frame::kError: return "'error'";
        default: return "None";
    }
}

}  // namespace dgr
