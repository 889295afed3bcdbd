// What the prefix cache (cache/prefix_cache.h) keeps of a closing session, and what a state depends on besides
// its tokens.
#include "worker.h"

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

namespace dgr {

namespace pb = dgr::v1;
using Clock = std::chrono::steady_clock;

std::vector<std::string> StageWorker::prefix_blocks(const google::protobuf::RepeatedPtrField<std::string> & b) const {
    return std::vector<std::string>(b.begin(), b.end());
}

// What a stage's state depends on besides the tokens: the boundary dtype the previous hop sent (a lossy
// wire dtype gives other values), and which upstream layer it came from
std::string StageWorker::prefix_seed(const pb::StageDescription & upstream) const {
    return std::to_string(int(upstream.schema_out().dtype())) + "/" + std::to_string(upstream.schema_out().layer());
}

std::vector<std::string> StageWorker::keep_prefix(const std::string & sid, uint64_t epoch, const pb::CloseSessionRequest & req) {
    const uint32_t block_tokens = req.prefix_block_tokens();
    if (!prefix_ || block_tokens == 0 || int64_t(block_tokens) > int64_t(info_.n_ctx)) return {};
    SessionPtr sess = session(Key{sid, epoch});
    if (!sess) return {};
    std::vector<int32_t> ran;
    std::string owner;
    {
        std::lock_guard<std::mutex> g(mu_);
        if (origin_->failed(sess) || sched_.has(Key{sid, epoch})) return {};   // failed or mid-step: keep nothing
        if (info_.is_first) {
            if (!sess->ran_ok) return {};
            ran = sess->ran;
        }
        owner = sess->prefix_owner;
    }
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
    if (info_.is_first) {
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
