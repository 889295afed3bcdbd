// Describe: the stage's description (identity, capacity, schemas, load) as dgr.v1.StageDescription
// (description/stage_description.h), with the descriptor JSON it carries, from the stage's card and a snapshot of its
// load (metrics/description.h).
// StageService::Describe runs describe_rpc on the unary calls' threads (rpc/stage_service.cpp); these know
// nothing of the worker.
#pragma once

#include <grpcpp/grpcpp.h>

#include <functional>

#include "dgr/v1/stage.pb.h"
#include "metrics/description.h"

namespace dgr {

// The RPC: `load` taken once, the message and its descriptor JSON written from it; a JSON that cannot be
// written is left out (said on stderr), never the call failed: a liveness probe never fails on the descriptor.
grpc::Status describe_rpc(const StageCard & card, const std::function<StageLoad()> & load, dgr::v1::StageDescription * d);

}  // namespace dgr
