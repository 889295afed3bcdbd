// The prefix cache (docs/worker.md "Prefix cache"): what this stage's layers held for a token
// sequence when its session closed, kept to start a later session that begins with the same tokens.
//
// Addressed by content: a chain of hashes over blocks of token ids (block j's hash covers positions
// [0, (j+1) * block_tokens)), computed by the workers from what they ran (block_hashes; never a client's
// word, docs/security.md); a seed names whose entry it is and what else the state depends on (the boundary
// dtype that arrived from the previous stage). One saved state (llama.cpp's session bytes for n positions) serves
// every block it covers: a later session restores it whole and keeps the first (j+1) * block_tokens
// positions. Bounded by bytes (--prefix-cache-mib), least recently used first out. Thread-safe.
//
// A part of the worker (docs/worker.md "Parts and their owners"): it owns its entries, index and LRU list under
// its one lock (mu_), and nothing of gRPC or the engine is in it; lifecycle/keep_prefix.cpp and lifecycle/open.cpp
// are the worker's glue. Its test: cache/prefix_cache_test.cpp.
#pragma once

#include <cstdint>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace dgr {

class PrefixCache {
  public:
    explicit PrefixCache(uint64_t capacity_bytes) : capacity_(capacity_bytes) {}

    struct Hit {
        std::shared_ptr<const std::string> state;   // llama.cpp's bytes for n_positions positions
        int32_t n_positions = 0;
        int32_t n_keep = 0;                          // the prefix the blocks matched: (j+1) * block_tokens
        size_t blocks = 0;                           // j+1
        std::shared_ptr<const std::vector<int32_t>> tokens;   // stage 0: the token ids the state ran (else empty)
    };
    // The longest prefix of `blocks` (block_tokens each) that a kept state covers; n_keep 0 when none.
    Hit find(const std::string & seed, const std::vector<std::string> & blocks, uint32_t block_tokens);
    // Keep `state` (n_positions positions) for the blocks it covers (at most n_positions / block_tokens of
    // them), replacing what those blocks pointed to, then evicting the least recently used for room. A state
    // larger than the whole capacity is not kept, nor anything at capacity 0. Returns the blocks indexed.
    size_t put(const std::string & seed, const std::vector<std::string> & blocks, uint32_t block_tokens,
               std::string state, int32_t n_positions, std::vector<int32_t> tokens = {});
    // The chain of hashes over every whole block of `ids` (dgr.runtime.wire.prefix.block_hashes: BLAKE3 over
    // the previous block's hash and the block's int32 little-endian ids, 16 bytes each)
    static std::vector<std::string> block_hashes(const int32_t * ids, size_t n, uint32_t block_tokens);

    struct Stats {
        uint64_t capacity = 0, bytes = 0, entries = 0;
        uint64_t lookups = 0, hits = 0, hit_tokens = 0, evicted = 0, kept = 0;
    };
    Stats stats();
    void note_hit(int32_t tokens);                  // a hit the route really used (after the min over stages)

  private:
    struct Entry {
        std::shared_ptr<const std::string> state;
        std::shared_ptr<const std::vector<int32_t>> tokens;
        int32_t n_positions = 0;
        std::vector<std::string> keys;
        std::list<uint64_t>::iterator lru;
    };
    struct Slot {
        uint64_t entry;
        int32_t n_keep;
    };
    static std::string key(const std::string & seed, uint32_t block_tokens, const std::string & block);
    void evict_one();                                // mu_ held

    std::mutex mu_;
    uint64_t capacity_;
    uint64_t bytes_ = 0, next_ = 1;
    std::map<uint64_t, Entry> entries_;
    std::map<std::string, Slot> index_;
    std::list<uint64_t> lru_;                        // front: most recently used
    Stats stats_;
};

}  // namespace dgr
