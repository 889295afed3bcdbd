// Draft sources for speculative decoding at the origin (stage 0): the C++ port of dgr.runtime.wire.drafts, the one
// place dgr-worker drafts. The origin asks its session's source for up to k tokens that may follow the
// history (prompt + tokens so far), sends them with the last accepted token as one step of k+1 positions,
// and tells the source how many the last stage accepted. Same proposals as the Python NgramDrafts for the
// same history (tests/worker/test_worker_cpp_speculate.py compares routes of both).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace dgr {

constexpr uint32_t DEFAULT_DRAFT_K = 4;
constexpr uint32_t MAX_DRAFT_K = 16;     // a speculative step is never split into frames: k+1 positions stay small

class DraftSource {
  public:
    virtual ~DraftSource() = default;
    // up to k tokens that may follow `history` (append-only between calls); empty for none
    virtual std::vector<int32_t> propose(const std::vector<int32_t> & history, int64_t k) = 0;
    // the last stage accepted `accepted` of the `drafted` tokens last proposed
    virtual void observe(uint32_t drafted, uint32_t accepted) = 0;
    // A source whose drafts come from the last stage (MTP): how many it asks the last stage to draft after the
    // draw of the step about to go out (Step.mtp_drafts; 0 none), and what came back with that draw
    // (Token.next_drafts), which the next propose() returns. Local sources ask for none.
    virtual uint32_t remote_k(int64_t /*k*/) { return 0; }
    virtual void offer(const std::vector<int32_t> & /*drafts*/) {}
};

// MTP (docs/deepseek4.md section 4): the last stage drafts with the model's MTP block after each draw and
// sends the drafts back with the token; propose() hands them out once. While drafts keep being rejected it
// backs off: after the m-th miss in a row it asks for none for 2^(2m-1) steps (2, 8, 32, MAX_PAUSE), then for
// k >> m drafts (at least one), so a workload the MTP block predicts badly costs few wasted positions and MTP
// steps; one accepted draft restores k.
class MtpDrafts final : public DraftSource {
  public:
    static constexpr int64_t MAX_PAUSE = 64;
    std::vector<int32_t> propose(const std::vector<int32_t> & history, int64_t k) override;
    void observe(uint32_t drafted, uint32_t accepted) override;
    uint32_t remote_k(int64_t k) override;
    void offer(const std::vector<int32_t> & drafts) override { offered_ = drafts; }

  private:
    std::vector<int32_t> offered_;
    int64_t misses_ = 0, pause_ = 0;
};

// Prompt lookup (dgr.runtime.wire.drafts.NgramDrafts): match the history's last n tokens (n from n_max down to
// n_min, fewer after misses) against their latest earlier occurrence and propose what followed; back off
// (longer matches, then pauses of 2, 4, 8 ... MAX_PAUSE plain steps) while drafts keep missing.
class NgramDrafts final : public DraftSource {
  public:
    static constexpr int64_t MAX_PAUSE = 32;
    explicit NgramDrafts(int n_min = 2, int n_max = 4);
    std::vector<int32_t> propose(const std::vector<int32_t> & history, int64_t k) override;
    void observe(uint32_t drafted, uint32_t accepted) override;

  private:
    void catch_up(const std::vector<int32_t> & history);
    int n_min_, n_max_;
    std::map<int, std::map<std::vector<int32_t>, int64_t>> index_;   // n -> n-gram -> its latest end
    int64_t seen_ = 0, misses_ = 0, pause_ = 0;
};

// The source called `name` (one per session); throws std::invalid_argument with dgr.runtime.wire.drafts' message
// for an unknown or reserved name.
std::unique_ptr<DraftSource> make_draft_source(const std::string & name);
// A draft count a route accepts (1..MAX_DRAFT_K); throws std::invalid_argument saying so.
uint32_t check_draft_k(uint32_t k);

}  // namespace dgr
