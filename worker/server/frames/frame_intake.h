// The stage's incoming frames: each Frames call (a gRPC callback reactor, bounded by --max-connections and refused
// from SIGTERM on), each frame on it checked (who may send it under mutual TLS, where it goes, a step's shape,
// schema and bounds, so that malformed frames never reach the engine), tokens and errors returning into the origin,
// steps into the scheduler (a refusal answered OVERLOADED with the bound that refused it), errors answered on the
// caller's stream, and the send deadlines of every reply stream.
//
// A part that owns the open Frames calls and the gone clients' cleanups (streams/open_streams.h: its own leaf lock)
// and the connection slots (trust/connections.h: its own leaf lock). It finds sessions in the session table and
// their owners' names in the session life, hands a Generate, a client's step and what returns to the origin, and
// steps to the scheduler; it asks its owner (`FrameIntakePort`: the worker) to word an error and for the stage's
// name. It links gRPC, so the process tests test it (tests/worker/test_worker_cpp_frames.py, the trust and hostile
// tests); its rules are the parts' it asks (trust/senders.h, trust/connections.h, streams/open_streams.h), each with
// a plain test.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "dgr/v1/stage.grpc.pb.h"
#include "engine_loop/scheduler.h"
#include "engine_loop/stage_engine.h"
#include "frame_queue.h"
#include "lifecycle/session_life.h"
#include "metrics/metrics.h"
#include "origin/origin.h"
#include "relay/relay.h"
#include "sessions/names.h"
#include "sessions/session.h"
#include "sessions/session_table.h"
#include "stage_calls.h"
#include "step_work.h"
#include "streams/open_streams.h"
#include "tls.h"
#include "trust/connections.h"
#include "wire/dtypes.h"

namespace dgr {

// What the incoming frames ask of their owner.
class FrameIntakePort {
  public:
    // a typed error from this stage (counted, named after it; retry_after_ms: when to try again)
    virtual dgr::v1::WireError error(dgr::v1::ErrorCode code, const std::string & message, uint32_t retry_after_ms) = 0;
    virtual std::string hop() const = 0;             // this stage's name in messages

  protected:
    ~FrameIntakePort() = default;
};

struct FrameIntakeSettings {
    bool is_first = false, needs_token_ids = false;
    int64_t n_ctx = 0, n_streams = 0, n_embd = 0, layer_begin = 0, layer_end = 0;
    int64_t stage_index = 0;                         // who opens sessions here: the client, or stage N-1
    const WireDtype * dtype = nullptr;               // the boundary's wire dtype (--wire-dtype)
    dgr::v1::BoundarySchema schema_in;               // what this stage takes
    double send_timeout_s = 0;                       // --send-timeout
    int64_t max_send_queue_bytes = 0;                // --max-send-queue-bytes (per reply stream)
    int64_t max_queued_steps = 0, max_session_steps = 0, max_queued_steps_per_member = 0;   // the refusals' words
};

class FrameIntake final : public FrameStreams {
  public:
    using Key = SessionKey;
    using Scheduler = StepScheduler<SessionKey, Work>;
    // `trust` and `names` are the worker's, fixed before serving
    FrameIntake(FrameIntakePort & port, StageEngine & engine, SessionTable<Session> & sessions, SessionLife & life,
                Origin & origin, Scheduler & sched, Relay & relay, Metrics & metrics, const Trust & trust,
                const SessionNames & names, int64_t max_connections, FrameIntakeSettings settings);
    FrameIntake(const FrameIntake &) = delete;
    FrameIntake & operator=(const FrameIntake &) = delete;

    // FrameStreams: a Frames call's reactor (the Stage service's)
    grpc::ServerBidiReactor<dgr::v1::Frame, dgr::v1::Frame> * frames(grpc::CallbackServerContext * ctx) override;
    // A frame in. `peer`: the sender's member name under mTLS (nullptr: this worker itself, never checked).
    void on_frame(dgr::v1::Frame frame, const ReplyPtr & reply, const std::optional<std::string> * peer);
    // A step into the scheduler (`own`: the origin's, never refused for a member's bound), or its refusal answered.
    void enqueue(Work w, const SessionPtr & sess, bool own);
    // An error about `frame` to its sender, naming the session as the sender does (as_named: the frame already
    // carries that name; else it carries this worker's key, wire_of).
    void reply_error(const ReplyPtr & reply, const dgr::v1::Frame & frame, dgr::v1::WireError e, bool as_named = false);
    // The send deadlines (--send-timeout) of every reply stream and link; called about 5 times a second.
    void check_stalls();
    // SIGTERM: no call starts from now on; the calls open now.
    std::vector<ReplyPtr> stop() { return streams_.stop(); }
    // The worker's end: the gone clients' cleanups finished, and none starts after.
    void wait_cleanups() { streams_.wait_cleanups(); }

  private:
    friend class FramesReactor;
    friend struct Admit;
    void check_sender(const char * kind, const SessionPtr & sess, const std::optional<std::string> * peer, const std::string & sid);
    void check_step(const dgr::v1::Step & step, std::vector<float> * x);
    void stream_done(const ReplyPtr & out);          // a Frames call's OnDone: client_gone on a thread of its own
    std::string admit(const grpc::ServerContextBase * ctx);   // --max-connections: "" admitted, else why not
    void release(const std::string & peer);
    dgr::v1::WireError err(dgr::v1::ErrorCode code, const std::string & message, uint32_t retry_after_ms = 0) {
        return port_.error(code, message, retry_after_ms);
    }
    std::string hop() const { return port_.hop(); }

    FrameIntakePort & port_;
    StageEngine & engine_;
    SessionTable<Session> & sessions_;
    SessionLife & life_;
    Origin & origin_;
    Scheduler & sched_;
    Relay & relay_;
    Metrics & metrics_;
    const Trust & trust_;
    const SessionNames & names_;
    const FrameIntakeSettings set_;
    ConnectionSlots conns_;                          // --max-connections: connections with calls in progress
    // the incoming Frames calls' reply streams and the threads closing a gone client's sessions (its own lock)
    OpenStreams<ReplyPtr> streams_;
};

}  // namespace dgr
