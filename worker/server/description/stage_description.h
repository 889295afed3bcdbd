// The stage's description in the wire's form: its card and a snapshot of its load (metrics/description.h) into
// dgr.v1.StageDescription, field for field (the descriptor JSON aside). Describe answers with it
// (rpc/describe.h); OpenSession's reply carries it for each hop; the worker reads its seam schemas from it once.
#pragma once

#include "dgr/v1/stage.pb.h"
#include "metrics/description.h"

namespace dgr {

void describe_msg(const StageCard & card, const StageLoad & load, dgr::v1::StageDescription * d);

}  // namespace dgr
