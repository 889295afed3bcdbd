// Tokenize and Detokenize: the stage's vocabulary through the engine.
#include "wire/wire_common.h"
#include "worker.h"
#include "worker_internal.h"

#include <grpcpp/grpcpp.h>

#include <string>
#include <vector>

namespace dgr {

namespace pb = dgr::v1;
using Clock = std::chrono::steady_clock;

grpc::ServerUnaryReactor * StageWorker::Tokenize(Ctx * ctx, const pb::TokenizeRequest * req, pb::TokenizeReply * out) {
    return unary(ctx, [=] { return tokenize_rpc(req, out); });
}

grpc::ServerUnaryReactor * StageWorker::Detokenize(Ctx * ctx, const pb::DetokenizeRequest * req, pb::DetokenizeReply * out) {
    return unary(ctx, [=] { return detokenize_rpc(req, out); });
}

grpc::Status StageWorker::tokenize_rpc(const pb::TokenizeRequest * req, pb::TokenizeReply * out) {
    return guarded("Tokenize", [&] {
        if (!info_.has_vocab) return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, hop() + " holds no vocabulary");
        const std::string & text = req->text();
        std::vector<int32_t> ids(text.size() + 16);
        int32_t n;
        {
            auto eg = engine_.lock();
            while (true) {
                n = eg.tokenize(text.c_str(), req->add_special(), ids.data(), int32_t(ids.size()));
                if (n < 0) return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, engine_.lib().error(DGR_E_ENGINE));
                if (size_t(n) <= ids.size()) break;
                ids.resize(size_t(n));
            }
        }
        for (int32_t k = 0; k < n; ++k) out->add_token_ids(ids[size_t(k)]);
        return grpc::Status::OK;
    });
}

grpc::Status StageWorker::detokenize_rpc(const pb::DetokenizeRequest * req, pb::DetokenizeReply * out) {
    return guarded("Detokenize", [&] {
        if (!info_.has_vocab) return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, hop() + " holds no vocabulary");
        std::vector<int32_t> ids(req->token_ids().begin(), req->token_ids().end());
        if (ids.empty()) ids.push_back(0);           // the array is never empty; n says how many count
        std::string buf(16 * size_t(req->token_ids_size()) + 16, '\0');
        int32_t n;
        {
            auto eg = engine_.lock();
            while (true) {
                n = eg.detokenize(ids.data(), req->token_ids_size(), &buf[0], int32_t(buf.size()));
                if (n < 0) return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, engine_.lib().error(DGR_E_ENGINE));
                if (size_t(n) <= buf.size()) break;
                buf.resize(size_t(n));
            }
        }
        buf.resize(size_t(n));
        out->set_text(utf8_replace(buf));
        return grpc::Status::OK;
    });
}

}  // namespace dgr
