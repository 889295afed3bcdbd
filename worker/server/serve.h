// What dgr-worker's main.cpp (the flags) hands the files that serve a stage: the options, the stage on its
// engine (stage_open.cpp), where it listens (listen.cpp), and the run until SIGTERM and the drain (drain.cpp).
#pragma once

#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "engine_lib.h"
#include "metrics_server.h"
#include "trust/net_policy.h"
#include "tls.h"
#include "rpc/stage_service.h"
#include "unary_calls.h"
#include "worker.h"

namespace dgr::serve {

// What the flags say (main.cpp's parse).
struct Options {
    std::string bundle, fake_engine, listen = "127.0.0.1:0", lane, wire_dtype;
    int stage = -1;
    bool stage_given = false, insecure = false, no_verify = false;
    bool check_config = false;   // --check-config: everything a start checks, then exit 0 without serving
    std::string probe;           // --probe HOST:PORT: a health check of that worker (probe.h), then exit
    bool fast_kernels = false;   // --fast-kernels: llama.cpp's shape-dependent kernels (numerics "fast")
    std::string kernels;         // --kernels reference|invariant|fast ("": reference, or fast with --fast-kernels)
    std::vector<std::string> blake3_files;           // --blake3 FILE (hidden): print digests and exit
    uint64_t max_message_bytes = dgr::DEFAULT_MAX_MESSAGE_BYTES;
    int64_t n_ctx = dgr::defaults::n_ctx, max_sessions = dgr::defaults::max_sessions, threads = 0;
    // --draft-max: the drafted positions a step may roll back on an architecture whose cache keeps per-step
    // snapshots (DeepSeek V4; llama.cpp's n_rs_seq, 0 on others); 0: such a stage cannot roll back
    int64_t draft_max = DGR_MTP_MAX_K;
    // --poll: with --threads > 1, how long the compute threads spin waiting for the next step before they sleep
    // (dgr_open_params.poll, 0-100); 0: at once, beside other stages on the same cores
    int64_t poll = 0;
    dgr::Limits limits;
    std::string tls_cert, tls_key, tls_ca, metrics_listen, certs, contract, advertise;
    // --handshake-timeout: a connection that has not finished its TLS handshake and HTTP/2 preface by then is
    // closed (gRPC's own default is 120 s: idle half-open connections would hold descriptors that long)
    double handshake_timeout_s = 10.0;
    // --peer-allow CIDR,...: where outgoing links and chained calls may go (trust/net_policy.h)
    dgr::NetPolicy net;
    // --max-rpc-memory-mib: gRPC's own buffers (ResourceQuota::Resize): what a flood of connections and streams
    // can make the transport hold
    int64_t max_rpc_memory_mib = 1024;
};

// The open-files limit (RLIMIT_NOFILE): its soft limit raised to the hard one, and checked against
// --max-connections; the limit now in force.
int64_t raise_open_files(const Options & o);

struct Stage {
    dgr::EngineLib lib;
    dgr_engine * eng = nullptr;
    dgr::StageIdentity id;
};

// The bundle's stage on the engine, and the identity it advertises (stage_open.cpp says how).
void open_stage(const Options & o, Stage & s);
// Stage --stage of the fake model --fake-engine SPEC on the fake engine library (stage_open.cpp says how).
void open_fake_stage(const Options & o, Stage & s);

// The addresses of --listen, --advertise and --metrics-listen, checked (TLS, or loopback, or --insecure) and
// the gRPC port free, before the engine loads.
struct Listen {
    std::string host, port;                          // --listen HOST:PORT
    std::string mhost, mport;                        // --metrics-listen HOST:PORT ("" when none)
    std::string adv_host, adv_port;                  // --advertise HOST[:PORT] ("" when none)
};
Listen check_listen(const Options & o, const Trust & trust);

// The worker serving: the gRPC server with the Stage service and health, the metrics endpoint, the address it
// names itself by. Destroyed in reverse: the server, then the service and the unary calls' pool (which runs
// what waits and joins its threads), so no call runs on a stage being taken apart.
struct Serving {
    std::unique_ptr<StageWorker> worker;
    std::unique_ptr<UnaryCalls> calls;               // the unary RPCs' pool (--max-rpc-threads, --max-rpc-per-member)
    std::unique_ptr<StageService> service;           // what gRPC calls: hands each call to the part that serves it
    std::unique_ptr<grpc::Server> server;
    std::unique_ptr<MetricsServer> metrics;
    std::string address;
};
Serving serve(const Options & o, const Trust & trust, const Listen & l, Stage & s);

// Serves until SIGTERM or SIGINT, then drains within --drain-timeout and leaves the process (never returns).
[[noreturn]] void serve_until_signal(const Options & o, Stage & s, Serving & sv);

}  // namespace dgr::serve
