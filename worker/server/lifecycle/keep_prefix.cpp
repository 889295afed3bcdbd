// What the prefix cache (cache/prefix_cache.h) keeps of a closing session, and what a state depends on besides
// its tokens.
#include "lifecycle/session_life.h"

#include <algorithm>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

namespace dgr {

namespace pb = dgr::v1;
using Clock = std::chrono::steady_clock;

std::vector<std::string> SessionLife::prefix_blocks(const google::protobuf::RepeatedPtrField<std::string> & b) const {
    return std::vector<std::string>(b.begin(), b.end());
}

// What a stage's state depends on besides the tokens: the boundary dtype the previous hop sent (a lossy
// wire dtype gives other values), and which upstream layer it came from
std::string SessionLife::prefix_seed(const pb::StageDescription & upstream) const {
    return std::to_string(int(upstream.schema_out().dtype())) + "/" + std::to_string(upstream.schema_out().layer());
}

std::vector<std::string> SessionLife::keep_prefix(const std::string & sid, uint64_t epoch, const pb::CloseSessionRequest & req) {
    const uint32_t block_tokens = req.prefix_block_tokens();
    if (!prefix_ || block_tokens == 0 || int64_t(block_tokens) > int64_t(set_.n_ctx)) return {};
    SessionPtr sess = sessions_.find(Key{sid, epoch});
    if (!sess) return {};
    if (origin_.failed(sess) || sched_.has(Key{sid, epoch})) return {};   // failed or mid-step: keep nothing
    std::vector<int32_t> ran;
    if (set_.is_first) {
        std::optional<std::vector<int32_t>> known = sess->steps.ran();
        if (!known) return {};
        ran = std::move(*known);
    }
    const std::string & owner = sess->prefix_owner;  // fixed at open
    uint64_t size = 0;
    int32_t n = 0;
    std::string state;
    {
        auto eg = engine_.lock();
        int32_t st = eg.state_get(sid.c_str(), int64_t(epoch), nullptr, 0, &size, &n);
        if (st != DGR_OK || n < int32_t(block_tokens)) return {};
        state.resize(size);
        st = eg.state_get(sid.c_str(), int64_t(epoch), state.data(), size, &size, &n);
        if (st != DGR_OK) {
            fprintf(stderr, "dgr-worker: keeping session %s's prefix: %s\n", names_.wire_of(sid).c_str(), engine_.lib().error(st).c_str());
            return {};
        }
    }
    // Stage 0 hashes the blocks from the tokens it ran itself: a client's hashes are never filed. A later stage
    // files what its opener (the previous hop, a worker) passed on, in that opener's own namespace.
    std::vector<std::string> blocks;
    if (set_.is_first) {
        if (ran.size() < size_t(n)) return {};
        blocks = PrefixCache::block_hashes(ran.data(), size_t(n), block_tokens);
        ran.resize(size_t(n));
    } else {
        blocks = prefix_blocks(req.prefix_blocks());
    }
    prefix_->put(owner + "|" + sess->prefix_seed, blocks, block_tokens, std::move(state), n, std::move(ran));
    blocks.resize(std::min(blocks.size(), size_t(n) / block_tokens));
    return blocks;
}

}  // namespace dgr
