#include "cache/prefix_cache.h"

#include <algorithm>
#include <cstring>

#include "blake3_c/blake3.h"

namespace dgr {

std::string PrefixCache::key(const std::string & seed, uint32_t block_tokens, const std::string & block) {
    // the seed's length first: a seed holds any bytes (a member's name is its certificate's commonName), and
    // none may end where another seed's key goes on
    return std::to_string(seed.size()) + ':' + seed + std::to_string(block_tokens) + ':' + block;
}

PrefixCache::Hit PrefixCache::find(const std::string & seed, const std::vector<std::string> & blocks, uint32_t block_tokens) {
    std::lock_guard<std::mutex> g(mu_);
    ++stats_.lookups;
    Hit hit;
    if (!capacity_ || !block_tokens) return hit;
    for (size_t j = blocks.size(); j-- > 0;) {      // the longest prefix first
        auto it = index_.find(key(seed, block_tokens, blocks[j]));
        if (it == index_.end()) continue;
        Entry & e = entries_.at(it->second.entry);
        lru_.splice(lru_.begin(), lru_, e.lru);
        hit.state = e.state;
        hit.tokens = e.tokens;
        hit.n_positions = e.n_positions;
        hit.n_keep = it->second.n_keep;
        hit.blocks = j + 1;
        ++stats_.hits;
        break;
    }
    return hit;
}

void PrefixCache::note_hit(int32_t tokens) {
    std::lock_guard<std::mutex> g(mu_);
    stats_.hit_tokens += uint64_t(std::max(0, tokens));
}

void PrefixCache::evict_one() {
    const uint64_t id = lru_.back();
    lru_.pop_back();
    Entry & e = entries_.at(id);
    for (auto & k : e.keys) {
        auto it = index_.find(k);
        if (it != index_.end() && it->second.entry == id) index_.erase(it);
    }
    bytes_ -= e.state->size();
    entries_.erase(id);
    ++stats_.evicted;
}

size_t PrefixCache::put(const std::string & seed, const std::vector<std::string> & blocks, uint32_t block_tokens,
                        std::string state, int32_t n_positions, std::vector<int32_t> tokens) {
    if (!block_tokens || n_positions <= 0) return 0;
    const size_t n = std::min(blocks.size(), size_t(n_positions) / block_tokens);
    if (n == 0) return 0;
    std::lock_guard<std::mutex> g(mu_);
    if (!capacity_ || state.size() > capacity_) return 0;
    const uint64_t id = next_++;
    Entry & e = entries_[id];
    e.state = std::make_shared<const std::string>(std::move(state));
    e.n_positions = n_positions;
    e.tokens = std::make_shared<const std::vector<int32_t>>(std::move(tokens));
    lru_.push_front(id);
    e.lru = lru_.begin();
    bytes_ += e.state->size();
    for (size_t j = 0; j < n; ++j) {                // every block it covers now points here (the newest state)
        std::string k = key(seed, block_tokens, blocks[j]);
        index_[k] = Slot{id, int32_t((j + 1) * block_tokens)};
        e.keys.push_back(std::move(k));
    }
    // an older entry none of whose blocks point to it any more is dead weight
    for (auto it = entries_.begin(); it != entries_.end();) {
        bool live = false;
        for (auto & k : it->second.keys) {
            auto s = index_.find(k);
            if (s != index_.end() && s->second.entry == it->first) { live = true; break; }
        }
        if (live) { ++it; continue; }
        lru_.erase(it->second.lru);
        bytes_ -= it->second.state->size();
        it = entries_.erase(it);
    }
    // then room, least recently used out: after the states this one replaced have given theirs back
    while (bytes_ > capacity_ && lru_.back() != id) evict_one();
    ++stats_.kept;
    return n;
}

std::vector<std::string> PrefixCache::block_hashes(const int32_t * ids, size_t n, uint32_t block_tokens) {
    static const char SEED[] = "dgr-prefix-v1";      // dgr.runtime.wire.prefix._SEED
    constexpr size_t HASH_BYTES = 16;                // dgr.runtime.wire.prefix.HASH_BYTES
    std::vector<std::string> out;
    if (!block_tokens) return out;
    std::string prev(SEED, sizeof SEED - 1);
    std::vector<uint8_t> le(size_t(block_tokens) * 4);
    for (size_t j = 0; (j + 1) * block_tokens <= n; ++j) {
        for (size_t k = 0; k < block_tokens; ++k) {
            const uint32_t v = uint32_t(ids[j * block_tokens + k]);
            for (int b = 0; b < 4; ++b) le[k * 4 + size_t(b)] = uint8_t(v >> (8 * b));
        }
        blake3_hasher h;
        blake3_hasher_init(&h);
        blake3_hasher_update(&h, prev.data(), prev.size());
        blake3_hasher_update(&h, le.data(), le.size());
        std::string d(HASH_BYTES, '\0');
        blake3_hasher_finalize(&h, reinterpret_cast<uint8_t *>(&d[0]), HASH_BYTES);
        out.push_back(d);
        prev = std::move(d);
    }
    return out;
}

PrefixCache::Stats PrefixCache::stats() {
    std::lock_guard<std::mutex> g(mu_);
    Stats s = stats_;
    s.capacity = capacity_;
    s.bytes = bytes_;
    s.entries = entries_.size();
    return s;
}

}  // namespace dgr
