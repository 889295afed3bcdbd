// What a session's steps left on this stage: the positions its cache holds, stage 0's record of the tokens it ran
// (what the prefix cache's blocks are hashed from, never the client's word), and where a rollback may start. One
// per session (sessions/session.h), under its own leaf lock: the engine thread writes it after each step, the
// session RPCs at open and close, the load counts it; no two sessions' records are read together.
#pragma once

#include <cstdint>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>

namespace dgr {

class StepRecord {
  public:
    // At open: the positions restored from the prefix cache and (stage 0) the tokens they hold.
    void restore(uint64_t held, std::vector<int32_t> ran) {
        std::lock_guard<std::mutex> g(mu_);
        held_ = held;
        ran_ = std::move(ran);
    }

    // Only the first `held` positions stay (a later hop kept less of a prefix; the last stage dropped what an MTP
    // draft will replace).
    void hold(uint64_t held) {
        std::lock_guard<std::mutex> g(mu_);
        held_ = held;
        if (ran_.size() > held_) ran_.resize(size_t(held_));
    }

    // A step ran here: the cache holds `held` positions. Stage 0 (`record`) notes the step's tokens from its first
    // position `p0` on; a gap before `p0` makes the record unknown for good. `spec_floor`: the step's first draft
    // position (-1: it carried none), below which a later rollback never drops positions.
    void ran_step(uint64_t held, bool record, size_t p0, const int32_t * tokens, size_t n, int64_t spec_floor) {
        std::lock_guard<std::mutex> g(mu_);
        held_ = held;
        if (record && ran_ok_) {
            if (ran_.size() < p0) {
                ran_ok_ = false;
                ran_.clear();
            } else {
                ran_.resize(p0);
                ran_.insert(ran_.end(), tokens, tokens + n);
                if (ran_.size() > held_) ran_.resize(size_t(held_));
            }
        }
        spec_floor_ = spec_floor;
    }

    uint64_t held() const {
        std::lock_guard<std::mutex> g(mu_);
        return held_;
    }

    int64_t spec_floor() const {
        std::lock_guard<std::mutex> g(mu_);
        return spec_floor_;
    }

    // Stage 0: the tokens at positions [0, size) it ran or restored, when every one is known.
    std::optional<std::vector<int32_t>> ran() const {
        std::lock_guard<std::mutex> g(mu_);
        if (!ran_ok_) return std::nullopt;
        return ran_;
    }

  private:
    mutable std::mutex mu_;
    uint64_t held_ = 0;                              // positions cached after its last step here
    std::vector<int32_t> ran_;                       // stage 0: token ids at [0, ran_.size()) (when ran_ok_)
    bool ran_ok_ = true;
    int64_t spec_floor_ = -1;
};

}  // namespace dgr
