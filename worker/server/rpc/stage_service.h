// The dgr.v1.Stage service: the object gRPC calls, and nothing else. Each RPC is a thin override that hands the
// call to the part that serves it:
//
// - Describe, Tokenize, Detokenize, OpenSession, CloseSession run on the unary calls' pool (unary_calls.h: bounded,
//   per member), whose thread runs the handler: rpc/describe.h over the stage's card and a snapshot of its load,
//   rpc/tokenize.h over its vocabulary, and the session RPCs over `SessionCalls` (a session's life, here and along the
//   route: lifecycle/session_life.h);
// - Frames is a reactor the data path makes (`FrameStreams`: frames.cpp).
//
// It holds no state of the stage's: what it needs is handed to it (`Parts`), so the stage (StageWorker) is not
// the object every RPC hangs off, and this file knows nothing of it.
#pragma once

#include <grpcpp/grpcpp.h>

#include <functional>
#include <string>

#include "dgr/v1/stage.grpc.pb.h"
#include "engine_loop/stage_engine.h"
#include "metrics/description.h"
#include "stage_calls.h"
#include "unary_calls.h"

namespace dgr {

class StageService final : public dgr::v1::Stage::CallbackService {
  public:
    struct Parts {
        UnaryCalls & calls;                          // the pool the unary RPCs run on
        const StageCard & card;                      // fixed once serving
        std::function<StageLoad()> load;             // a snapshot of the stage's load (Describe)
        StageVocabulary & vocab;                     // Tokenize, Detokenize
        SessionCalls & sessions;                     // OpenSession, CloseSession
        FrameStreams & frames;                       // Frames
        std::function<std::string()> hop;            // this hop's name, for the pool's refusals
    };
    explicit StageService(Parts parts) : p_(std::move(parts)) {}

    using Ctx = grpc::CallbackServerContext;
    grpc::ServerUnaryReactor * Describe(Ctx *, const dgr::v1::DescribeRequest *, dgr::v1::StageDescription *) override;
    grpc::ServerUnaryReactor * Tokenize(Ctx *, const dgr::v1::TokenizeRequest *, dgr::v1::TokenizeReply *) override;
    grpc::ServerUnaryReactor * Detokenize(Ctx *, const dgr::v1::DetokenizeRequest *, dgr::v1::DetokenizeReply *) override;
    grpc::ServerUnaryReactor * OpenSession(Ctx *, const dgr::v1::OpenSessionRequest *, dgr::v1::OpenSessionReply *) override;
    grpc::ServerUnaryReactor * CloseSession(Ctx *, const dgr::v1::CloseSessionRequest *, dgr::v1::CloseSessionReply *) override;
    grpc::ServerBidiReactor<dgr::v1::Frame, dgr::v1::Frame> * Frames(Ctx * ctx) override { return p_.frames.frames(ctx); }

  private:
    // the call onto the pool, under the caller's member name (mutual TLS; "" in plaintext)
    grpc::ServerUnaryReactor * unary(Ctx * ctx, UnaryCalls::Body body);
    Parts p_;
};

}  // namespace dgr
