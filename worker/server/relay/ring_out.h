// What this stage sends round the ring, over the relay (relay.h): a step's boundary encoded in the wire dtype and
// cut into frames that fit, for the next hop; any frame for the session's origin (the last stage's tokens, errors
// about a session); and what a peer's answer or a broken link means for a session (the relay's RelayOwner calls,
// which the worker hands on).
//
// A part that owns nothing that changes but one flag per session, `LastStageRole::told_origin` (atomic: the last
// stage tells the origin once that its stream back broke). It asks its owner (`RingOutPort`: the worker) to take a
// frame that a one-stage route sends itself and to word and count errors; it reaches the origin part directly
// when this stage is the origin. It links gRPC's messages, so the process tests test it.
#pragma once

#include <cstdint>
#include <set>
#include <string>

#include "dgr/v1/stage.pb.h"
#include "engine_lib.h"
#include "metrics/metrics.h"
#include "origin/origin.h"
#include "relay/relay.h"
#include "sessions/session.h"
#include "sessions/session_table.h"
#include "step_work.h"
#include "wire/dtypes.h"

namespace dgr {

// What the ring's outgoing side asks of its owner.
class RingOutPort {
  public:
    // a frame a one-stage route sends itself (named by this worker's key): taken as if it came in, unchecked
    virtual void take_own(dgr::v1::Frame frame) = 0;
    // a typed error from this stage (counted, named after it), and a count of one sent on as it is
    virtual dgr::v1::WireError error(dgr::v1::ErrorCode code, const std::string & message) = 0;
    virtual void count_error(dgr::v1::ErrorCode code) = 0;
    virtual std::string hop() const = 0;             // this stage's name in messages

  protected:
    ~RingOutPort() = default;
};

struct RingOutSettings {
    bool is_first = false;
    int64_t width = 0;                               // values per token of the boundary (n_streams x n_embd)
    int64_t n_streams = 0, n_embd = 0;
    const WireDtype * dtype = nullptr;               // the wire dtype it sends (--wire-dtype)
    dgr::v1::BoundarySchema schema_out;              // what it sends
    uint64_t seam_bytes_per_token = 0;
    uint64_t max_message_bytes = 0;                  // a frame's limit
    double link_keepalive_timeout_s = 0;             // for the broken link's message
};

class RingOut {
  public:
    RingOut(RingOutPort & port, Relay & relay, SessionTable<Session> & sessions, Origin & origin, Metrics & metrics,
            const EngineLib & lib, RingOutSettings settings);
    RingOut(const RingOut &) = delete;
    RingOut & operator=(const RingOut &) = delete;

    // The step's output boundary (one row per position) to the next hop of the session's route, in frames that fit.
    void emit_boundary(const Work & w, const SessionPtr & sess, const float * boundary, dgr::v1::HopTiming timing);
    // A frame to hop `hop_index` of the session's route at `address` (named as that hop knows the session).
    void send(const std::string & address, uint32_t hop_index, dgr::v1::Frame frame, const SessionPtr & sess);
    // A frame for the session's origin: delivered here when this stage is the origin, else sent to stage 0.
    void to_origin(const SessionPtr & sess, dgr::v1::Frame frame);
    // The relay's news (RelayOwner, through the worker): a peer's answer about a session it was sent, and the
    // sessions a broken link took with it.
    void on_reply(const SessionKey & mine, dgr::v1::Frame frame);
    void on_broken(const std::string & address, const std::string & why, const std::set<SessionKey> & lost);

  private:
    void encode(const float * x, int64_t n_tokens, dgr::v1::Boundary * b) const;

    RingOutPort & port_;
    Relay & relay_;
    SessionTable<Session> & sessions_;
    Origin & origin_;
    Metrics & metrics_;
    const EngineLib & lib_;
    const RingOutSettings settings_;
};

}  // namespace dgr
