// BLAKE3 (hash mode, 32-byte output): what dgr's bundle ids, patch series and engine hashes are.
//
// A small portable implementation written from the BLAKE3 specification (the reference
// implementation's structure: chunk state, chaining-value stack), single-threaded, no SIMD.
// tests/test_worker_cpp.py checks it against the Python `blake3` package. The BLAKE3 step of issue 21
// replaces it with the upstream C implementation from a pinned, hash-verified source (SIMD, for
// checking stage files chunk by chunk before loading); this interface stays.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace dgr {

class Blake3 {
  public:
    Blake3();
    void update(const void * data, size_t n);
    std::string hex() const;   // the 32-byte digest of everything so far, lower-case hex

  private:
    void add_chunk_cv(const uint32_t cv[8], uint64_t total_chunks);
    uint32_t cv_stack_[54][8];
    size_t   cv_len_ = 0;
    uint32_t chunk_cv_[8];
    uint64_t chunk_counter_ = 0;
    uint8_t  block_[64];
    size_t   block_len_ = 0;
    size_t   blocks_done_ = 0;   // blocks compressed in the current chunk
};

std::string blake3_hex(const std::string & bytes);
// The digest of a file's bytes; throws std::runtime_error naming the file when it cannot be read.
std::string blake3_file(const std::string & path);

}  // namespace dgr
