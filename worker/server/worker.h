// dgr-worker's stage: what it serves (identity, engine, sessions) and the dgr.v1.Stage service over it.
//
// Phase 1 of issue 21 (docs/worker.md): Describe (with the descriptor JSON), Tokenize/Detokenize,
// OpenSession/CloseSession (the session table, chained along the route), the standard health service.
// Frames answers UNIMPLEMENTED until phase 2 brings the data path. Behaviour, errors and messages are
// those of the Python worker (tools/dgr/wire/servicer.py, state.py); tests/test_worker_cpp.py runs
// both on one stage and compares them.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "dgr/v1/stage.grpc.pb.h"
#include "engine_lib.h"

namespace dgr {

// What a worker bounds and how long it waits: `dgr worker serve`'s flags (dgr.wire.state.Limits).
struct Limits {
    int64_t max_batch_tokens = 512;
    int64_t max_batch_sessions = 64;
    int64_t hold_batch = 0;
    int64_t max_queued_steps = 512;
    int64_t max_session_steps = 128;
    double  session_ttl_s = 300.0;
    double  rpc_timeout_s = 5.0;
    double  drain_timeout_s = 5.0;
    double  link_keepalive_timeout_s = 2.0;
};

// What the engine's stage info does not know: where the stage comes from (dgr.wire.state.StageIdentity).
struct StageIdentity {
    std::string model, bundle_id;
    int stage_index = 0, stage_count = 0;
    std::string upstream_commit, patch_series, lane, engine = "llama.cpp", wire_dtype = "f32";
    std::vector<int32_t> eos_token_ids;
    std::string chat_template;
    std::string engine_blake3;
};

// A wire dtype (dgr.contract.WIRE_DTYPES): `block_bytes` bytes for every `block` values.
struct WireDtype {
    const char * name;
    int block, block_bytes;
    dgr::v1::Dtype code;
};
const std::vector<WireDtype> & wire_dtypes();
const WireDtype * find_dtype(const std::string & name);

// Bytes of one message beyond a boundary's payload (dgr.wire.codec.FRAME_OVERHEAD).
constexpr uint64_t FRAME_OVERHEAD = 4096;
constexpr uint64_t DEFAULT_MAX_MESSAGE_BYTES = 4 * 1024 * 1024 - 64 * 1024;

// Bytes as text, each invalid UTF-8 sequence replaced by U+FFFD as Python's decode(errors="replace").
std::string utf8_replace(const std::string & bytes);

class StageWorker final : public dgr::v1::Stage::Service {
  public:
    StageWorker(const EngineLib & lib, dgr_engine * eng, StageIdentity identity, std::string address,
                uint64_t max_message_bytes, Limits limits);

    grpc::Status Describe(grpc::ServerContext *, const dgr::v1::DescribeRequest *, dgr::v1::StageDescription *) override;
    grpc::Status Tokenize(grpc::ServerContext *, const dgr::v1::TokenizeRequest *, dgr::v1::TokenizeReply *) override;
    grpc::Status Detokenize(grpc::ServerContext *, const dgr::v1::DetokenizeRequest *, dgr::v1::DetokenizeReply *) override;
    grpc::Status OpenSession(grpc::ServerContext *, const dgr::v1::OpenSessionRequest *, dgr::v1::OpenSessionReply *) override;
    grpc::Status CloseSession(grpc::ServerContext *, const dgr::v1::CloseSessionRequest *, dgr::v1::CloseSessionReply *) override;
    grpc::Status Frames(grpc::ServerContext *, grpc::ServerReaderWriter<dgr::v1::Frame, dgr::v1::Frame> *) override;

    const dgr_stage_info & info() const { return info_; }
    std::string hop() const;
    void set_address(const std::string & address);
    // Idle sessions past --session-ttl are closed (once a second at most); returns how many.
    int reap();
    // SIGTERM: refuse new sessions, close every open one (engine included).
    void stop();
    std::string descriptor_json();

  private:
    struct Session {
        std::vector<dgr::v1::Hop> route;
        uint32_t hop_index = 0;
        std::chrono::steady_clock::time_point last_used;
    };
    using Key = std::pair<std::string, uint64_t>;

    void describe_msg(dgr::v1::StageDescription * d);
    dgr::v1::WireError err(dgr::v1::ErrorCode code, const std::string & message, uint32_t retry_after_ms = 0);
    void count_error(dgr::v1::ErrorCode code);
    void close_local(const std::string & sid, uint64_t epoch);
    uint32_t session_retry_ms();
    std::chrono::system_clock::time_point chain_deadline(size_t hops_after, const grpc::ServerContext * ctx) const;
    dgr::v1::Stage::Stub * link(const std::string & address);

    const EngineLib & lib_;
    dgr_engine * eng_;
    StageIdentity id_;
    mutable std::mutex addr_mu_;
    std::string address_;                            // HOST:PORT as it names itself (addr_mu_)
    uint64_t max_message_bytes_;
    Limits limits_;
    dgr_stage_info info_{};
    dgr_memory memory_{};
    bool can_truncate_ = false;
    const WireDtype * dtype_;
    std::chrono::steady_clock::time_point started_;

    std::mutex engine_mu_;                           // the engine is never called from two threads at once
    std::mutex mu_;                                  // everything below
    std::map<Key, Session> sessions_;
    std::map<std::string, uint64_t> latest_epoch_;
    std::vector<std::pair<std::string, uint64_t>> errors_;   // ErrorCode name -> answered, first seen first
    uint64_t reaped_ = 0, overloaded_ = 0, opened_total_ = 0;
    bool stopping_ = false;
    std::map<std::string, std::unique_ptr<dgr::v1::Stage::Stub>> links_;
};

}  // namespace dgr
