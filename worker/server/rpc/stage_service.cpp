// The Stage service's overrides (rpc/stage_service.h): each unary call handed to the pool with the handler of the
// part that serves it.
#include "rpc/stage_service.h"

#include "rpc/describe.h"
#include "rpc/tokenize.h"
#include "tls.h"

namespace dgr {

namespace pb = dgr::v1;

grpc::ServerUnaryReactor * StageService::unary(Ctx * ctx, UnaryCalls::Body body) {
    return p_.calls.start(ctx, peer_identity(ctx).value_or(""), p_.hop(), std::move(body));
}

grpc::ServerUnaryReactor * StageService::Describe(Ctx * ctx, const pb::DescribeRequest *, pb::StageDescription * d) {
    return unary(ctx, [this, d] { return describe_rpc(p_.card, p_.load, d); });
}

grpc::ServerUnaryReactor * StageService::Tokenize(Ctx * ctx, const pb::TokenizeRequest * req, pb::TokenizeReply * out) {
    return unary(ctx, [this, req, out] { return tokenize_rpc(p_.vocab, *req, out); });
}

grpc::ServerUnaryReactor * StageService::Detokenize(Ctx * ctx, const pb::DetokenizeRequest * req, pb::DetokenizeReply * out) {
    return unary(ctx, [this, req, out] { return detokenize_rpc(p_.vocab, *req, out); });
}

grpc::ServerUnaryReactor * StageService::OpenSession(Ctx * ctx, const pb::OpenSessionRequest * req, pb::OpenSessionReply * reply) {
    return unary(ctx, [this, ctx, req, reply] { return p_.sessions.open_session_rpc(ctx, req, reply); });
}

grpc::ServerUnaryReactor * StageService::CloseSession(Ctx * ctx, const pb::CloseSessionRequest * req, pb::CloseSessionReply * reply) {
    return unary(ctx, [this, ctx, req, reply] { return p_.sessions.close_session_rpc(ctx, req, reply); });
}

}  // namespace dgr
