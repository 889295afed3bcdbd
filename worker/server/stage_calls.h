// What the Stage service (rpc/stage_service.h) hands calls to, beside the parts it is given whole: the session
// RPCs' bodies and the Frames calls' reactors. The stage (StageWorker, worker.h) implements both; neither side
// includes the other.
#pragma once

#include <grpcpp/grpcpp.h>

#include "dgr/v1/stage.grpc.pb.h"

namespace dgr {

// OpenSession and CloseSession's bodies, run on a unary call's thread (the stage's sessions)
class SessionCalls {
  public:
    virtual ~SessionCalls() = default;
    virtual grpc::Status open_session_rpc(const grpc::ServerContextBase * ctx, const dgr::v1::OpenSessionRequest * req,
                                          dgr::v1::OpenSessionReply * reply) = 0;
    virtual grpc::Status close_session_rpc(const grpc::ServerContextBase * ctx, const dgr::v1::CloseSessionRequest * req,
                                           dgr::v1::CloseSessionReply * reply) = 0;
};

// A Frames call's reactor (the stage's data path)
class FrameStreams {
  public:
    virtual ~FrameStreams() = default;
    virtual grpc::ServerBidiReactor<dgr::v1::Frame, dgr::v1::Frame> * frames(grpc::CallbackServerContext * ctx) = 0;
};

}  // namespace dgr
