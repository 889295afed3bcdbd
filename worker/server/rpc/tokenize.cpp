// Tokenize and Detokenize (rpc/tokenize.h): a request into the vocabulary's call, its answer into the reply, a
// refusal into its status: no vocabulary here FAILED_PRECONDITION, the engine's refusal (an id outside the
// vocabulary) INVALID_ARGUMENT with the engine's message.
#include "rpc/tokenize.h"

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "rpc/guarded.h"

namespace dgr {

namespace pb = dgr::v1;

static_assert(StageVocabulary::ENGINE_REFUSED == DGR_E_ENGINE, "the vocabulary reads an engine's refusal as DGR_E_ENGINE");

namespace {

template <class A> grpc::Status refusal(const A & a) {
    return grpc::Status(a.refused == StageVocabulary::Refused::no_vocabulary ? grpc::StatusCode::FAILED_PRECONDITION
                                                                              : grpc::StatusCode::INVALID_ARGUMENT,
                        a.why);
}

}  // namespace

grpc::Status tokenize_rpc(StageVocabulary & vocab, const pb::TokenizeRequest & req, pb::TokenizeReply * out) {
    return guarded("Tokenize", [&] {
        auto a = vocab.tokenize(req.text(), req.add_special());
        if (a.refused != StageVocabulary::Refused::none) return refusal(a);
        for (int32_t id : a.value) out->add_token_ids(id);
        return grpc::Status::OK;
    });
}

grpc::Status detokenize_rpc(StageVocabulary & vocab, const pb::DetokenizeRequest & req, pb::DetokenizeReply * out) {
    return guarded("Detokenize", [&] {
        auto a = vocab.detokenize(std::vector<int32_t>(req.token_ids().begin(), req.token_ids().end()));
        if (a.refused != StageVocabulary::Refused::none) return refusal(a);
        out->set_text(std::move(a.value));
        return grpc::Status::OK;
    });
}

}  // namespace dgr
