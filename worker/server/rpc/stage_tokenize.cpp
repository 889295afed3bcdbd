// The Stage service's Tokenize and Detokenize: each call handed to the unary pool, where rpc/tokenize.cpp turns
// it into a call of the stage's vocabulary. The only part of the worker they touch is `vocab_`.
#include "rpc/tokenize.h"
#include "worker.h"

namespace dgr {

namespace pb = dgr::v1;

grpc::ServerUnaryReactor * StageWorker::Tokenize(Ctx * ctx, const pb::TokenizeRequest * req, pb::TokenizeReply * out) {
    return unary(ctx, [this, req, out] { return tokenize_rpc(*vocab_, *req, out); });
}

grpc::ServerUnaryReactor * StageWorker::Detokenize(Ctx * ctx, const pb::DetokenizeRequest * req, pb::DetokenizeReply * out) {
    return unary(ctx, [this, req, out] { return detokenize_rpc(*vocab_, *req, out); });
}

}  // namespace dgr
