// The Stage service's thin overrides: Describe, Tokenize and Detokenize, each call handed to the unary pool with
// the part its handler needs. rpc/describe.cpp writes the stage's card and a snapshot of its load (`card_`,
// `load()`) into the reply; rpc/tokenize.cpp turns a request into a call of the stage's vocabulary (`vocab_`).
// Those are all they touch of the worker.
#include "rpc/describe.h"
#include "rpc/tokenize.h"
#include "worker.h"

namespace dgr {

namespace pb = dgr::v1;

grpc::ServerUnaryReactor * StageWorker::Describe(Ctx * ctx, const pb::DescribeRequest *, pb::StageDescription * d) {
    return unary(ctx, [this, d] { return describe_rpc(card_, [this] { return load(); }, d); });
}

grpc::ServerUnaryReactor * StageWorker::Tokenize(Ctx * ctx, const pb::TokenizeRequest * req, pb::TokenizeReply * out) {
    return unary(ctx, [this, req, out] { return tokenize_rpc(*vocab_, *req, out); });
}

grpc::ServerUnaryReactor * StageWorker::Detokenize(Ctx * ctx, const pb::DetokenizeRequest * req, pb::DetokenizeReply * out) {
    return unary(ctx, [this, req, out] { return detokenize_rpc(*vocab_, *req, out); });
}

}  // namespace dgr
