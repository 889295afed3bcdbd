// What the prefix cache (prefix_cache.h) keeps of a closing session, and what a state depends on besides
// its tokens.
#include "worker.h"

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

void StageWorker::keep_prefix(const std::string & sid, uint64_t epoch, const pb::CloseSessionRequest & req) {
    if (!prefix_ || req.prefix_block_tokens() == 0) return;
    SessionPtr sess = session(Key{sid, epoch});
    if (!sess) return;
    {
        std::lock_guard<std::mutex> g(mu_);
        if (sess->failed || pending_.count(Key{sid, epoch})) return;   // failed or mid-step: keep nothing
    }
    uint64_t size = 0;
    int32_t n = 0;
    std::string state;
    {
        std::lock_guard<std::mutex> eg(engine_mu_);
        int32_t st = lib_.state_get(eng_, sid.c_str(), int64_t(epoch), nullptr, 0, &size, &n);
        if (st != DGR_OK || n < int32_t(req.prefix_block_tokens())) return;
        state.resize(size);
        st = lib_.state_get(eng_, sid.c_str(), int64_t(epoch), state.data(), size, &size, &n);
        if (st != DGR_OK) {
            fprintf(stderr, "dgr-worker: keeping session %s's prefix: %s\n", sid.c_str(), lib_.error(st).c_str());
            return;
        }
    }
    prefix_->put(sess->prefix_seed, prefix_blocks(req.prefix_blocks()), req.prefix_block_tokens(),
                 std::move(state), n);
}

}  // namespace dgr
