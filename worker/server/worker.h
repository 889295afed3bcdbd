// dgr-worker's stage: the composition root. It opens the engine, describes the stage (its card), makes the parts
// that serve it and hands each what it needs (docs/worker.md "Parts and their owners"): the relay (links and
// channels to every peer), the origin, the ring's outgoing side, a session's life (OpenSession, CloseSession, the
// reaper), the engine thread's work, the incoming frames, and the scheduler between them. Each part owns its state
// under its own lock; this object keeps only the settings fixed before serving, and answers the parts' ports:
// the stage's name, its typed errors, its description. The Stage service (rpc/stage_service.h) is handed the parts,
// never this object; serve.h is its one includer besides worker.cpp.
//
// Behaviour, errors and messages are those the retired Python worker had (docs/worker.md);
// tests/worker/test_worker_cpp*.py hold them against the bundle, the engine and the messages they write out.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include <functional>
#include <future>

#include "dgr/v1/stage.grpc.pb.h"
#include "certification.h"
#include "speculation/drafts.h"
#include "engine_lib.h"
#include "engine_loop/stage_engine.h"
#include "engine_loop/scheduler.h"
#include "sessions/names.h"
#include "sessions/session.h"
#include "sessions/session_table.h"
#include "cache/prefix_cache.h"
#include "stage_calls.h"
#include "step_work.h"
#include "unary_calls.h"
#include "metrics/description.h"
#include "metrics/metrics.h"
#include "trust/net_policy.h"
#include "trust/connections.h"
#include "trust/senders.h"
#include "trust/turns.h"
#include "tls.h"
#include "grpc_status.h"
#include "frame_queue.h"
#include "link.h"
#include "relay/relay.h"
#include "origin/origin.h"
#include "lifecycle/session_life.h"
#include "engine_run/engine_run.h"
#include "frames/frame_intake.h"
#include "relay/ring_out.h"
#include "ring/generation.h"
#include "wire_constants.h"

namespace dgr {

// What a worker bounds and how long it waits: `dgr worker serve`'s flags (its front end passes
// dgr.runtime.wire.limits.Limits' values explicitly; the defaults both have are generated from it into
// wire_constants.h, the others are dgr-worker's own).
struct Limits {
    int64_t max_batch_tokens = defaults::max_batch_tokens;
    int64_t max_batch_sessions = defaults::max_batch_sessions;
    int64_t hold_batch = defaults::hold_batch;
    int64_t max_queued_steps = defaults::max_queued_steps;
    int64_t max_session_steps = defaults::max_session_steps;
    double  session_ttl_s = defaults::session_ttl_s;
    double  rpc_timeout_s = defaults::rpc_timeout_s;
    double  drain_timeout_s = defaults::drain_timeout_s;
    double  link_keepalive_timeout_s = defaults::link_keepalive_timeout_s;
    // phase 3 bounds (docs/worker.md "Bounds"): a peer that stops reading fails its own stream or link
    double  send_timeout_s = 10.0;                   // --send-timeout: one write may wait this long
    int64_t max_send_queue_bytes = 64 << 20;         // --max-send-queue-bytes: per reply stream and per link
    int64_t max_connections = 256;                   // --max-connections: connections with calls in progress
    int64_t prefix_cache_mib = defaults::prefix_cache_mib;  // --prefix-cache-mib: what closed sessions leave (0: off)
    // --prefix-cache-shared: stage 0 serves a kept prefix to any member whose prompt begins with it (keys are
    // always computed from what ran, so safe; but a hit tells a member that someone sent that prefix). Off:
    // each member finds only its own (docs/security.md)
    bool    prefix_cache_shared = false;
    // --max-grammar-bytes, --max-grammar-depth: Sampling.grammar / json_schema bounds, checked before either is
    // parsed (llama.cpp's parser recurses per nesting level: 20,000 levels overflowed the stack)
    int64_t max_grammar_bytes = 256 * 1024;
    int64_t max_grammar_depth = 64;
    // --max-sessions-per-member: the sessions one member (under mutual TLS: the certificate that opened them
    // here) may hold at once; 0: only --max-sessions bounds them (a gateway is one member: docs/security.md)
    int64_t max_sessions_per_member = 0;
    // --max-queued-steps-per-member: the steps one member's sessions may have queued here at once; 0: only
    // --max-queued-steps and --max-session-steps bound them (past stage 0 the member is the previous hop)
    int64_t max_queued_steps_per_member = 0;
    // --max-rpc-threads, --max-rpc-per-member: the unary calls (Describe, Tokenize, Detokenize, OpenSession,
    // CloseSession) running at once, and one member's running or waiting (unary_calls.h)
    int64_t max_rpc_threads = 256;
    int64_t max_rpc_per_member = 64;
    // --test-die-at SESSION:EPOCH:POSITION (tests only): SIGKILL itself about to run that step
    std::set<std::tuple<std::string, uint64_t, int64_t>> die_at;
    // --test-stop-at SESSION:EPOCH:POSITION (tests only): SIGSTOP itself about to run that step (a hung
    // worker, exactly there; SIGCONT lets it go on with that step)
    std::set<std::tuple<std::string, uint64_t, int64_t>> stop_at;
    // --test-evict-at SESSION:EPOCH:POSITION (tests only): about to run that step, drop the session's engine
    // cache (close and reopen it in the engine), so the step answers CACHE_MISS exactly there
    std::set<std::tuple<std::string, uint64_t, int64_t>> evict_at;
    // --test-break-origin-link-at SESSION:EPOCH:POSITION (tests only): about to run that step, fail this
    // worker's link to the session's origin (what a stream that breaks under it does)
    std::set<std::tuple<std::string, uint64_t, int64_t>> break_origin_link_at;
};

class StageWorker final : private RelayOwner, private OriginPort, private RingOutPort, private SessionLifePort,
                          private EngineRunPort, private FrameIntakePort {
  public:
    StageWorker(const EngineLib & lib, dgr_engine * eng, StageIdentity identity, std::string address,
                uint64_t max_message_bytes, Limits limits);

    // what the Stage service (rpc/stage_service.h, which knows nothing of this class) hands its calls to
    // (stage_calls.h): the session RPCs' bodies (the session life, lifecycle/session_life.h, on the unary calls'
    // pool) and the Frames calls' reactors (the incoming frames, frames/frame_intake.h)
    SessionCalls & session_calls() { return *life_; }
    FrameStreams & frame_streams() { return *intake_; }
    // what the service's Describe, Tokenize and Detokenize are handed: the card (fixed once serving), a snapshot of
    // the load (every counter read under its lock), the vocabulary
    const StageCard & card() const { return card_; }
    StageLoad load();
    StageVocabulary & vocabulary() { return *vocab_; }
    // the unary calls' pool the service runs calls on, whose counts the load reports (set before serving; it
    // outlives every call into this object: serve.h)
    void count_calls(const UnaryCalls * calls) { calls_ = calls; }

    const dgr_stage_info & info() const { return info_; }
    std::string hop() const override;                // this stage's name in messages (the parts' ports)
    void set_address(const std::string & address);
    // TLS (before serving): the links' credentials, what Describe reports, the peer checks under mTLS
    void set_trust(Trust trust);
    // The send deadlines (--send-timeout) of every reply stream and link; called about 5 times a second.
    void check_stalls() { intake_->check_stalls(); }
    // Idle sessions past --session-ttl are closed (once a second at most); returns how many. Outgoing links
    // and channels no open session uses any more are closed and forgotten (prune_links).
    int reap() { return life_->reap(); }
    // SIGTERM: refuse new sessions, tell the clients, end every stream, close every session (engine
    // included), stop the engine thread and the links.
    void stop();
    ~StageWorker();
    // --metrics-listen: the Prometheus text (metrics/description.h, from card_ and a snapshot of its load; the names
    // in docs/wire.md "Metrics and the descriptor"). Describe writes the descriptor JSON from the same two.
    std::string metrics_text() { return dgr::metrics_text(card_, load()); }
    // the URL Describe's descriptor reports
    void set_metrics_url(const std::string & url);
    // the certificates of certification it advertises (certification.h: already checked against its identity); set before serving
    void set_certificates(std::vector<HeldCertificate> c) { card_.certificates = std::move(c); }
    // where it may connect (--peer-allow; trust/net_policy.h); set before serving
    void set_net_policy(NetPolicy p) { net_ = std::move(p); }

  private:
    using Key = SessionKey;                          // a session (sessions/session.h: by role)

    // the parts' ports: each hands a part's question to the part that answers it, or answers it from the card
    // RelayOwner: the relay's news, to the ring's outgoing side (relay/ring_out.h)
    void on_reply(const Key & mine, dgr::v1::Frame frame) override { ring_out_->on_reply(mine, std::move(frame)); }
    void on_broken(const std::string & address, const std::string & why, const std::set<Key> & lost) override {
        ring_out_->on_broken(address, why, lost);
    }
    // RingOutPort: a one-stage route's own frame, taken as if it came in (unchecked)
    void take_own(dgr::v1::Frame frame) override { intake_->on_frame(std::move(frame), nullptr, nullptr); }
    // OriginPort: the origin's next step, and a client's sessions closed along the route
    void enqueue_next(Work w, const SessionPtr & sess) override { intake_->enqueue(std::move(w), sess, true); }
    dgr::v1::WireError error(dgr::v1::ErrorCode code, const std::string & message) override { return err(code, message); }
    void close_route(const std::string & sid, uint64_t epoch) override { life_->close_chained(sid, epoch, nullptr, nullptr); }
    // SessionLifePort, EngineRunPort, FrameIntakePort: this stage's description now, a typed error with its retry
    // hint, an error about a step to its sender
    void describe(dgr::v1::StageDescription * me) override;
    dgr::v1::WireError error(dgr::v1::ErrorCode code, const std::string & message, uint32_t retry_after_ms) override {
        return err(code, message, retry_after_ms);
    }
    void answer_error(const ReplyPtr & reply, const dgr::v1::Frame & frame, dgr::v1::WireError e) override {
        intake_->reply_error(reply, frame, std::move(e));
    }
    void count_error(dgr::v1::ErrorCode code) override;
    dgr::v1::WireError err(dgr::v1::ErrorCode code, const std::string & message, uint32_t retry_after_ms = 0);
    void shutdown_threads();
    // the card (metrics/description.h) from the engine's stage info and memory and the worker's own settings: once,
    // at start (set_trust and set_certificates add theirs before serving)
    void fill_card(const dgr_memory & memory);

    // fixed before serving (the constructor, then set_trust, set_net_policy, set_certificates), read by the parts
    StageEngine engine_;                             // the engine under its lock: calls through engine_.lock()'s guard
    std::optional<StageVocabulary> vocab_;           // Tokenize, Detokenize over engine_ (set once the stage is described)
    Trust trust_;
    // Owners (docs/security.md): under mutual TLS a session lives in the namespace of the member that opened
    // it here; this worker's key for it is names_.key(member, id as named). Plaintext: one tenant, the id.
    SessionNames names_;                             // whose a session is, from its key (sessions/names.h)
    NetPolicy net_;
    uint64_t max_message_bytes_;
    Limits limits_;
    dgr_stage_info info_{};
    bool can_truncate_ = false;
    const WireDtype * dtype_;
    dgr::v1::BoundarySchema schema_in_, schema_out_;   // what this stage takes and sends (rpc/describe.h's describe_msg)
    uint64_t seam_bytes_per_token_ = 0;
    std::chrono::steady_clock::time_point started_;
    StageCard card_;                                 // fixed once serving (fill_card, set_trust, set_certificates)
    mutable std::mutex addr_mu_;                     // metrics_url_
    std::string metrics_url_;                        // (addr_mu_)
    const UnaryCalls * calls_ = nullptr;             // count_calls

    // the parts, each owning its state under its own lock (docs/worker.md "Locks and their order")
    // where this worker's frames and chained calls go: the links and channels to every peer, its address, the
    // credentials (relay/relay.h). Declared first of them: destroyed after everything that sends.
    Relay relay_;
    Metrics metrics_;                                // what is counted (metrics/metrics.h)
    // the prefix cache (cache/prefix_cache.h); null where off (--prefix-cache-mib 0, or an engine that cannot keep a
    // prefix of a session: no truncation, results that depend on the batch, an engine built before it)
    std::unique_ptr<PrefixCache> prefix_;
    std::string prefix_off_;                         // why it is off ("" when on)
    // the open sessions, their epochs, stage 0's wire_down ids, their owners' counts and when each was last used
    // (sessions/session_table.h), shared with the parts that find sessions there; a session's changing fields
    // have their own owners (sessions/session.h)
    SessionTable<Session> sessions_;
    // the queued steps (per session, bounded, round robin), the deferred jobs, the engine thread and which thread
    // runs a batch (engine_loop/scheduler.h); after everything its Owner reads
    StepScheduler<Key, Work> sched_;
    // made once the stage is described, before the scheduler starts: the origin of the sessions that start here
    // (origin/origin.h), what this stage sends round the ring (relay/ring_out.h), a session's life here
    // (lifecycle/session_life.h), the engine thread's work (engine_run/engine_run.h) and the incoming frames
    // (frames/frame_intake.h)
    std::optional<Origin> origin_;
    std::optional<RingOut> ring_out_;
    std::optional<SessionLife> life_;
    std::optional<EngineRun> engine_run_;
    std::optional<FrameIntake> intake_;
};

}  // namespace dgr
