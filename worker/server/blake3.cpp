#include "blake3.h"

#include <cstdio>
#include <cstring>
#include <stdexcept>

namespace dgr {
namespace {

constexpr uint32_t IV[8] = {0x6A09E667, 0xBB67AE85, 0x3C6EF372, 0xA54FF53A,
                            0x510E527F, 0x9B05688C, 0x1F83D9AB, 0x5BE0CD19};
constexpr size_t MSG_PERMUTATION[16] = {2, 6, 3, 10, 7, 0, 4, 13, 1, 11, 12, 5, 9, 14, 15, 8};
constexpr uint32_t CHUNK_START = 1, CHUNK_END = 2, PARENT = 4, ROOT = 8;
constexpr size_t BLOCK_LEN = 64, CHUNK_LEN = 1024;

inline uint32_t rotr(uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }

inline void g(uint32_t * s, int a, int b, int c, int d, uint32_t mx, uint32_t my) {
    s[a] = s[a] + s[b] + mx; s[d] = rotr(s[d] ^ s[a], 16);
    s[c] = s[c] + s[d];      s[b] = rotr(s[b] ^ s[c], 12);
    s[a] = s[a] + s[b] + my; s[d] = rotr(s[d] ^ s[a], 8);
    s[c] = s[c] + s[d];      s[b] = rotr(s[b] ^ s[c], 7);
}

// The compression function; out gets the first 8 words (a chaining value, or the root's digest).
void compress(const uint32_t cv[8], const uint8_t block[64], uint64_t counter, uint32_t block_len,
              uint32_t flags, uint32_t out[8]) {
    uint32_t m[16];
    for (int i = 0; i < 16; ++i) {
        m[i] = uint32_t(block[4 * i]) | uint32_t(block[4 * i + 1]) << 8 | uint32_t(block[4 * i + 2]) << 16 |
               uint32_t(block[4 * i + 3]) << 24;
    }
    uint32_t s[16] = {cv[0], cv[1], cv[2], cv[3], cv[4], cv[5], cv[6], cv[7], IV[0], IV[1], IV[2], IV[3],
                      uint32_t(counter), uint32_t(counter >> 32), block_len, flags};
    for (int r = 0; r < 7; ++r) {
        g(s, 0, 4, 8, 12, m[0], m[1]);   g(s, 1, 5, 9, 13, m[2], m[3]);
        g(s, 2, 6, 10, 14, m[4], m[5]);  g(s, 3, 7, 11, 15, m[6], m[7]);
        g(s, 0, 5, 10, 15, m[8], m[9]);  g(s, 1, 6, 11, 12, m[10], m[11]);
        g(s, 2, 7, 8, 13, m[12], m[13]); g(s, 3, 4, 9, 14, m[14], m[15]);
        if (r < 6) {
            uint32_t p[16];
            for (int i = 0; i < 16; ++i) p[i] = m[MSG_PERMUTATION[i]];
            std::memcpy(m, p, sizeof m);
        }
    }
    for (int i = 0; i < 8; ++i) out[i] = s[i] ^ s[i + 8];
}

void parent_block(const uint32_t l[8], const uint32_t r[8], uint8_t block[64]) {
    for (int i = 0; i < 8; ++i) {
        for (int k = 0; k < 4; ++k) {
            block[4 * i + k] = uint8_t(l[i] >> (8 * k));
            block[32 + 4 * i + k] = uint8_t(r[i] >> (8 * k));
        }
    }
}

}  // namespace

Blake3::Blake3() { std::memcpy(chunk_cv_, IV, sizeof chunk_cv_); }

void Blake3::add_chunk_cv(const uint32_t cv_in[8], uint64_t total_chunks) {
    uint32_t cv[8];
    std::memcpy(cv, cv_in, sizeof cv);
    // merge completed subtrees: one per trailing zero bit of the chunk count
    while ((total_chunks & 1) == 0) {
        uint8_t block[64];
        parent_block(cv_stack_[--cv_len_], cv, block);
        compress(IV, block, 0, BLOCK_LEN, PARENT, cv);
        total_chunks >>= 1;
    }
    std::memcpy(cv_stack_[cv_len_++], cv, sizeof cv);
}

void Blake3::update(const void * data, size_t n) {
    auto p = static_cast<const uint8_t *>(data);
    while (n > 0) {
        // a full chunk is finished only when more input follows (the last one may be the root)
        if (blocks_done_ * BLOCK_LEN + block_len_ == CHUNK_LEN) {
            uint32_t cv[8];
            compress(chunk_cv_, block_, chunk_counter_, BLOCK_LEN, blocks_done_ == 0 ? CHUNK_START | CHUNK_END : CHUNK_END,
                     cv);
            add_chunk_cv(cv, ++chunk_counter_);
            std::memcpy(chunk_cv_, IV, sizeof chunk_cv_);
            blocks_done_ = block_len_ = 0;
        }
        // a full block is compressed only when more input follows (the last one carries CHUNK_END)
        if (block_len_ == BLOCK_LEN) {
            compress(chunk_cv_, block_, chunk_counter_, BLOCK_LEN, blocks_done_ == 0 ? CHUNK_START : 0, chunk_cv_);
            ++blocks_done_;
            block_len_ = 0;
        }
        size_t take = std::min(BLOCK_LEN - block_len_, n);
        std::memcpy(block_ + block_len_, p, take);
        block_len_ += take;
        p += take;
        n -= take;
    }
}

std::string Blake3::hex() const {
    uint8_t block[64] = {0};
    std::memcpy(block, block_, block_len_);
    uint32_t flags = (blocks_done_ == 0 ? CHUNK_START : 0) | CHUNK_END;
    uint32_t cv[8];
    std::memcpy(cv, chunk_cv_, sizeof cv);
    uint32_t block_len = uint32_t(block_len_);
    uint64_t counter = chunk_counter_;
    // walk up the stack: each level's output becomes the right child of a parent node
    for (size_t i = cv_len_; i > 0; --i) {
        uint32_t child[8];
        compress(cv, block, counter, block_len, flags, child);
        parent_block(cv_stack_[i - 1], child, block);
        std::memcpy(cv, IV, sizeof cv);
        counter = 0;
        block_len = BLOCK_LEN;
        flags = PARENT;
    }
    uint32_t out[8];
    compress(cv, block, counter, block_len, flags | ROOT, out);
    static const char * digits = "0123456789abcdef";
    std::string s;
    for (int i = 0; i < 8; ++i) {
        for (int k = 0; k < 4; ++k) {
            uint8_t b = uint8_t(out[i] >> (8 * k));
            s += digits[b >> 4];
            s += digits[b & 15];
        }
    }
    return s;
}

std::string blake3_hex(const std::string & bytes) {
    Blake3 h;
    h.update(bytes.data(), bytes.size());
    return h.hex();
}

std::string blake3_file(const std::string & path) {
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
