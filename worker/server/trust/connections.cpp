// The connection slots of --max-connections (connections.h).
#include "trust/connections.h"

namespace dgr {

bool ConnectionSlots::take(const std::string & peer, size_t * held) {
    std::lock_guard<std::mutex> g(mu_);
    auto it = calls_.find(peer);
    if (it == calls_.end() && int64_t(calls_.size()) >= max_) {
        if (held) *held = calls_.size();
        return false;
    }
    ++calls_[peer];
    return true;
}

void ConnectionSlots::give_back(const std::string & peer) {
    std::lock_guard<std::mutex> g(mu_);
    auto it = calls_.find(peer);
    if (it != calls_.end() && --it->second <= 0) calls_.erase(it);
}

size_t ConnectionSlots::size() const {
    std::lock_guard<std::mutex> g(mu_);
    return calls_.size();
}

}  // namespace dgr
