// Tokenize and Detokenize: each request handed to the stage's vocabulary (engine_loop/vocabulary.h), and what it
// answers written back as the wire has it. StageService::Tokenize and ::Detokenize run these on the unary calls'
// threads (rpc/stage_service.cpp); they know nothing of the worker.
#pragma once

#include <grpcpp/grpcpp.h>

#include "dgr/v1/stage.pb.h"
#include "engine_loop/stage_engine.h"

namespace dgr {

grpc::Status tokenize_rpc(StageVocabulary & vocab, const dgr::v1::TokenizeRequest & req, dgr::v1::TokenizeReply * out);
grpc::Status detokenize_rpc(StageVocabulary & vocab, const dgr::v1::DetokenizeRequest & req, dgr::v1::DetokenizeReply * out);

}  // namespace dgr
