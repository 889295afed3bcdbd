// BLAKE3 (hash mode, 32-byte output): what dgr's bundle ids, patch series, engine hashes and the stage
// files' chunk hashes are.
//
// A thin C++ face over the official BLAKE3 C implementation (its SIMD kernels picked at run time), pinned
// and hash-verified like llama.cpp: worker/third_party/blake3.json names the PyPI sdist of `blake3` that
// carries it; CMake (-DDGR_BLAKE3_SRC, from `dgr build-engine`) and Bazel (@blake3, toolchains/blake3.bzl)
// compile it and publish its header as "blake3_c/blake3.h" (this file's own name is upstream's too).
// tests/worker/test_worker_cpp_verify.py checks it against the Python `blake3` package (`dgr-worker --blake3 FILE`).
#pragma once

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>

#include "blake3_c/blake3.h"

namespace dgr {

class Blake3 {
  public:
    Blake3() { blake3_hasher_init(&h_); }
    void update(const void * data, size_t n) { blake3_hasher_update(&h_, data, n); }
    void reset() { blake3_hasher_reset(&h_); }
    // the 32-byte digest of everything so far, lower-case hex
    std::string hex() const {
        uint8_t out[BLAKE3_OUT_LEN];
        blake3_hasher_finalize(&h_, out, BLAKE3_OUT_LEN);
        static const char * digits = "0123456789abcdef";
        std::string s;
        s.reserve(2 * BLAKE3_OUT_LEN);
        for (uint8_t b : out) s += digits[b >> 4], s += digits[b & 15];
        return s;
    }

  private:
    blake3_hasher h_;
};

inline std::string blake3_hex(const void * data, size_t n) {
    Blake3 h;
    h.update(data, n);
    return h.hex();
}

inline std::string blake3_hex(const std::string & bytes) { return blake3_hex(bytes.data(), bytes.size()); }

// The digest of a file's bytes; throws std::runtime_error naming the file when it cannot be read.
inline std::string blake3_file(const std::string & path) {
    std::FILE * f = std::fopen(path.c_str(), "rb");
    if (!f) throw std::runtime_error(path + ": cannot read it (" + std::strerror(errno) + ")");
    Blake3 h;
    static thread_local char buf[1 << 16];
    size_t n;
    while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) h.update(buf, n);
    bool bad = std::ferror(f);
    std::fclose(f);
    if (bad) throw std::runtime_error(path + ": read error");
    return h.hex();
}

}  // namespace dgr
