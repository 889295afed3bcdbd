// dgr.runtime.wire.drafts in C++ (speculation/drafts.h): the n-gram draft source and its back-off, line for line.
#include "speculation/drafts.h"

#include <algorithm>
#include <stdexcept>

namespace dgr {

NgramDrafts::NgramDrafts(int n_min, int n_max) : n_min_(n_min), n_max_(n_max) {
    if (!(1 <= n_min && n_min <= n_max)) {
        throw std::invalid_argument("ngram drafts: need 1 <= n_min <= n_max, got " + std::to_string(n_min) + ", " + std::to_string(n_max));
    }
    for (int n = n_min; n <= n_max; ++n) index_[n];
}

// index the n-grams ending at e for e < len(history): each has a continuation history[e]
void NgramDrafts::catch_up(const std::vector<int32_t> & history) {
    const int64_t stop = int64_t(history.size()) - 1;
    for (int64_t e = std::max<int64_t>(seen_, 1); e <= stop; ++e) {
        for (auto & [n, idx] : index_) {
            if (e >= n) idx[std::vector<int32_t>(history.begin() + (e - n), history.begin() + e)] = e;
        }
    }
    seen_ = std::max(seen_, stop + 1);
}

std::vector<int32_t> NgramDrafts::propose(const std::vector<int32_t> & history, int64_t k) {
    if (k <= 0 || int64_t(history.size()) < n_min_ + 1) return {};
    catch_up(history);
    if (pause_) {
        --pause_;
        return {};
    }
    const int64_t n_least = std::min<int64_t>(n_max_, n_min_ + misses_);
    const int64_t end = int64_t(history.size());
    for (int64_t n = n_max_; n >= n_least; --n) {
        if (end < n) continue;
        const auto & idx = index_.at(int(n));
        auto it = idx.find(std::vector<int32_t>(history.begin() + (end - n), history.end()));
        if (it != idx.end()) {
            const int64_t e = it->second;
            return std::vector<int32_t>(history.begin() + e, history.begin() + std::min(end, e + k));
        }
    }
    return {};
}

void NgramDrafts::observe(uint32_t drafted, uint32_t accepted) {
    if (!drafted) return;
    if (accepted) {
        misses_ = pause_ = 0;
        return;
    }
    ++misses_;
    const int64_t beyond = misses_ - (n_max_ - n_min_);   // misses with the longest match required
    if (beyond > 0) pause_ = std::min<int64_t>(MAX_PAUSE, int64_t(1) << std::min<int64_t>(beyond, 20));
}

std::vector<int32_t> MtpDrafts::propose(const std::vector<int32_t> & /*history*/, int64_t k) {
    std::vector<int32_t> out;
    out.swap(offered_);
    if (k <= 0) return {};
    if (int64_t(out.size()) > k) out.resize(size_t(k));
    return out;
}

void MtpDrafts::observe(uint32_t drafted, uint32_t accepted) {
    if (!drafted) return;
    if (accepted) {
        misses_ = pause_ = 0;
        return;
    }
    ++misses_;
    // after each miss in a row: a pause of 2, 8, 32, MAX_PAUSE steps without drafts (nor MTP steps), and half
    // the drafts (at least one) when it tries again; one accepted draft ends both
    pause_ = std::min<int64_t>(MAX_PAUSE, int64_t(1) << std::min<int64_t>(2 * misses_ - 1, 20));
}

uint32_t MtpDrafts::remote_k(int64_t k) {
    if (k <= 0) return 0;
    if (pause_) {
        --pause_;
        return 0;
    }
    return uint32_t(std::max<int64_t>(1, k >> std::min<int64_t>(misses_, 20)));
}

std::unique_ptr<DraftSource> make_draft_source(const std::string & name) {
    if (name == "ngram") return std::make_unique<NgramDrafts>();
    if (name == "mtp") return std::make_unique<MtpDrafts>();
    throw std::invalid_argument("unknown draft source '" + name + "': choose one of ngram, mtp");
}

uint32_t check_draft_k(uint32_t k) {
    if (k < 1 || k > MAX_DRAFT_K) {
        throw std::invalid_argument("draft k must be in 1..16 (positions verified per ring beyond the first), got " + std::to_string(k));
    }
    return k;
}

}  // namespace dgr
