// The origin (stage 0) of every session that starts here: the client's stream, generation control (what a
// session may make and has made, ring/generation.h), the text the client has, and speculation (the draft source,
// how far the route can roll back). A ring's tokens come back here, are counted against the generation's bounds,
// the next step is queued (with drafts when speculating) and the tokens go to the client with their text.
//
// A part that owns each session's `OriginRole` (sessions/session.h) under its own lock (`Origin::mu_`): no other
// part reads or writes those fields; they ask through the calls below. It asks its owner (`OriginPort`: the
// worker) for what is not its own: queue a step, word an error, close a session along the route. It takes the
// session table's, the scheduler's and the engine's locks, never while holding its own across a call back
// (docs/worker.md "Locks and their order"). It links gRPC's messages, so the process tests test it
// (tests/worker/test_worker_cpp_frames.py and the speculation and trust tests); its pure rules are
// ring/generation.h's and speculation/drafts.h's, each with a plain test.
#pragma once

#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "dgr/v1/stage.pb.h"
#include "engine_loop/scheduler.h"
#include "engine_loop/stage_engine.h"
#include "frame_queue.h"
#include "sessions/names.h"
#include "sessions/session.h"
#include "sessions/session_table.h"
#include "step_work.h"

namespace dgr {

// What the origin asks of its owner.
class OriginPort {
  public:
    // queue the session's next step (the origin's own: its sender is never checked)
    virtual void enqueue_next(Work w, const SessionPtr & sess) = 0;
    // a typed error from this stage (counted, named after it)
    virtual dgr::v1::WireError error(dgr::v1::ErrorCode code, const std::string & message) = 0;
    // close the session along the route (its client is gone)
    virtual void close_route(const std::string & sid, uint64_t epoch) = 0;

  protected:
    ~OriginPort() = default;
};

struct OriginSettings {
    bool is_first = false;                           // stage 0: only then does any session start here
    bool has_vocab = false;                          // tokens get their text
    int64_t n_ctx = 0;                               // positions a session may hold
    uint64_t max_message_bytes = 0;                  // this worker's frame limit (a step's positions per frame)
};

class Origin {
  public:
    using Scheduler = StepScheduler<SessionKey, Work>;
    Origin(OriginPort & port, SessionTable<Session> & sessions, const SessionNames & names, Scheduler & sched,
           StageEngine & engine, OriginSettings settings);
    Origin(const Origin &) = delete;
    Origin & operator=(const Origin &) = delete;

    // A Generate frame: the session's client is `reply`, its bounds and context as the frame says; then its
    // draft source, if it asks for one (throws Fault: a bad draft_k or source, a grammar, a route that cannot
    // roll back, MTP without an MTP block).
    void begin(const SessionPtr & sess, const dgr::v1::Generate & g, const ReplyPtr & reply);
    // A client's step at stage 0: its client (if none yet), the ids it carries (what draft sources look up),
    // and on a prompt's last chunk the MTP drafts to ask for.
    void on_client_step(const SessionPtr & sess, const ReplyPtr & reply, dgr::v1::Step * step);
    // OpenSession's reply hops (this stage's and those after it): can the route roll back, how many positions
    // fit one frame, the most drafts every hop can roll back, whether the last hop drafts with MTP.
    void note_route(Session & s, const google::protobuf::RepeatedPtrField<dgr::v1::StageDescription> & hops);
    // What the ring returned for a session (a token, logits or an error), named by this worker's key: counted,
    // the next step queued, and delivered to the client (tokens with their text, on the engine thread).
    void deliver(dgr::v1::Frame frame);
    // The client's stream `out` ended: its unfinished sessions fail and are closed along the route.
    bool serves(const SessionPtr & sess, const ReplyPtr & out);   // an unfinished session of that client
    void client_gone(const ReplyPtr & out);
    // The session ends here without finishing (idle past --session-ttl): it fails; its client, if any, to tell.
    ReplyPtr fail(const SessionPtr & sess);
    // Its client while it is unfinished (SIGTERM tells it), else none.
    ReplyPtr unfinished_client(const SessionPtr & sess);
    bool failed(const SessionPtr & sess);            // a failed session leaves nothing in the prefix cache

  private:
    dgr::v1::Frame next_step(Session & s, const std::string & sid, uint64_t epoch, int64_t pos, int32_t token,
                             bool after_drafts);     // mu_ held
    void start_speculation(const SessionPtr & sess, const dgr::v1::Generate & g);
    void send_token(const SessionPtr & sess, dgr::v1::Frame frame, size_t n_ids);

    OriginPort & port_;
    SessionTable<Session> & sessions_;               // its own lock (a lookup)
    const SessionNames & names_;
    Scheduler & sched_;                              // jobs deferred to the engine thread (its own lock)
    StageEngine & engine_;                           // detokenizing (the engine's lock)
    const OriginSettings settings_;
    std::mutex mu_;                                  // every session's OriginRole (sessions/session.h)
};

}  // namespace dgr
