// Slots that members take turns at (turns.h).
#include "trust/turns.h"

namespace dgr {

FairTurns::Turn FairTurns::take(const std::string & member) {
    Waiter me;
    std::unique_lock<std::mutex> lk(mu_);
    auto & q = waiting_[member];
    if (q.empty()) rotation_.push_back(member);
    q.push_back(&me);
    grant_locked();
    granted_.wait(lk, [&] { return me.granted; });
    return Turn(this);
}

void FairTurns::grant_locked() {
    bool any = false;
    while (free_ > 0 && !rotation_.empty()) {
        const std::string member = rotation_.front();
        rotation_.pop_front();
        auto it = waiting_.find(member);
        Waiter * w = it->second.front();
        it->second.pop_front();
        if (it->second.empty()) waiting_.erase(it);
        else rotation_.push_back(member);        // its next caller waits for the member's next turn
        w->granted = true;
        --free_;
        ++held_;
        any = true;
    }
    if (any) granted_.notify_all();
}

void FairTurns::give_back() {
    std::lock_guard<std::mutex> g(mu_);
    ++free_;
    --held_;
    grant_locked();
}

size_t FairTurns::waiting() const {
    std::lock_guard<std::mutex> g(mu_);
    size_t n = 0;
    for (auto & kv : waiting_) n += kv.second.size();
    return n;
}

int64_t FairTurns::held() const {
    std::lock_guard<std::mutex> g(mu_);
    return held_;
}

}  // namespace dgr
