// The engine thread's work: one batch of steps through the engine (each step's cache checked, a rollback first,
// one forward for all, one by one when it fails), each step's output sent on (the boundary to the next hop, or at
// the last stage the draws, their log-probabilities, logits rows and MTP drafts back to the origin), and the
// tests' faults at an exact step.
//
// A part that runs only on the thread the scheduler hands a batch to (engine_loop/scheduler.h: one batch at a
// time), so the one state it keeps, the masked logits row, has no lock. It finds sessions in the session table,
// records what their steps left (sessions/step_record.h), sends through the ring's outgoing side
// (relay/ring_out.h), and asks its owner (`EngineRunPort`: the worker) to word an error and answer a step with
// it. It links gRPC's messages, so the process tests test it (tests/worker/test_worker_cpp_frames.py, the
// batching, speculation, MTP and recovery tests); the engine under it is engine_loop/locked_engine.h, tested on
// its own.
#pragma once

#include <cstdint>
#include <functional>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "dgr/v1/stage.pb.h"
#include "engine_loop/scheduler.h"
#include "engine_loop/stage_engine.h"
#include "frame_queue.h"
#include "metrics/metrics.h"
#include "relay/relay.h"
#include "relay/ring_out.h"
#include "sessions/names.h"
#include "sessions/session.h"
#include "sessions/session_table.h"
#include "step_work.h"

namespace dgr {

// What the engine's work asks of its owner.
class EngineRunPort {
  public:
    // a typed error from this stage (counted, named after it)
    virtual dgr::v1::WireError error(dgr::v1::ErrorCode code, const std::string & message, uint32_t retry_after_ms) = 0;
    // an error about a step to its sender, naming the session as the sender does
    virtual void answer_error(const ReplyPtr & reply, const dgr::v1::Frame & frame, dgr::v1::WireError e) = 0;

  protected:
    ~EngineRunPort() = default;
};

// A step the tests' hooks name (--test-die-at SESSION:EPOCH:POSITION, ...)
using StepHooks = std::set<std::tuple<std::string, uint64_t, int64_t>>;

struct EngineRunSettings {
    bool is_first = false, is_last = false, has_mtp = false;
    int64_t n_vocab = 0, n_ctx = 0, n_draft_max = 0;
    int64_t width = 0;                               // values per token of the boundary in (n_streams x n_embd)
    uint32_t stage_index = 0;                        // in each step's timing
    uint64_t max_message_bytes = 0;                  // a frame's limit (logits rows per frame)
    StepHooks die_at, stop_at, evict_at, break_origin_link_at;   // the tests' hooks (worker.h's Limits)
};

class EngineRun {
  public:
    EngineRun(EngineRunPort & port, StageEngine & engine, SessionTable<Session> & sessions,
              StepScheduler<SessionKey, Work> & sched, RingOut & ring_out, Relay & relay, Metrics & metrics,
              const SessionNames & names, EngineRunSettings settings);
    EngineRun(const EngineRun &) = delete;
    EngineRun & operator=(const EngineRun &) = delete;

    // One batch (the scheduler's): run, and every step answered INTERNAL if the batch throws.
    void run(std::vector<Work> & batch);

  private:
    using Key = SessionKey;
    void run_batch(std::vector<Work> & batch);
    void die_if_asked(size_t n, const std::function<const dgr::v1::Frame &(size_t)> & frame);
    // --test-evict-at, --test-break-origin-link-at: about to run this step (under the engine's lock: `eg`)
    void test_faults(StageEngine::Guard & eg, const dgr::v1::Frame & frame, const SessionPtr & sess);
    bool hook_at(const StepHooks & at, const std::string & key, uint64_t epoch, int64_t p) const;
    void emit_last(Work & w, const SessionPtr & sess, const float * logits, int32_t rows, dgr::v1::HopTiming timing);
    void mtp_draft(Work & w, const SessionPtr & sess, int64_t next, int32_t token, uint32_t want, dgr::v1::Token * t);
    dgr::v1::WireError err(dgr::v1::ErrorCode code, const std::string & message) { return port_.error(code, message, 0); }
    void reply_error(const ReplyPtr & reply, const dgr::v1::Frame & frame, dgr::v1::WireError e) {
        port_.answer_error(reply, frame, std::move(e));
    }

    EngineRunPort & port_;
    StageEngine & engine_;
    SessionTable<Session> & sessions_;
    StepScheduler<SessionKey, Work> & sched_;
    RingOut & ring_out_;
    Relay & relay_;
    Metrics & metrics_;
    const SessionNames & names_;
    const EngineRunSettings set_;
    std::vector<float> masked_;                      // a logits row after the grammar's mask (this thread's alone)
};

}  // namespace dgr
