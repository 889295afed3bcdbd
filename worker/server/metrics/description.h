// What a stage says about itself: the descriptor JSON that Describe carries (dgr.core.descriptor.Descriptor,
// field for field) and the Prometheus text a scrape gets (docs/wire.md "Metrics and the descriptor"). Both are
// written from two pieces of plain data: the stage's card (what it is and how it is bounded: filled once, before
// it serves) and a snapshot of its load (what it is doing: taken for each call, under the worker's locks, by
// whoever holds them). Describe's message is filled from the same two (rpc/describe.h).
//
// A part with no state and no lock, nothing of gRPC, protobuf, the engine or the worker:
// metrics/description_test.cpp tests it alone.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "cache/prefix_cache.h"                     // PrefixCache::Stats (the plain struct only)
#include "certification.h"                          // HeldCertificate (the plain struct only)
#include "metrics/metrics.h"
#include "wire_constants.h"

namespace dgr {

// What the engine's stage info does not know: where the stage comes from.
struct StageIdentity {
    std::string model, bundle_id;
    int stage_index = 0, stage_count = 0;
    std::string upstream_commit, patch_series, lane, engine = "llama.cpp", wire_dtype = DEFAULT_WIRE_DTYPE;
    std::vector<int32_t> eos_token_ids;
    std::string chat_template;
    std::string engine_blake3;
    std::string worker_blake3;   // blake3 of this dgr-worker executable (/proc/self/exe), read once at start
    std::string numerics;        // the engine's dgr_engine_numerics: stages of one route must compute alike
};

// The stage as it serves: fixed once it serves (StageWorker fills it at start, its trust and certificates before
// serving). The engine's dgr_stage_info and dgr_memory are copied field by field, so nothing here needs the
// engine's header.
struct StageCard {
    StageIdentity id;
    // dgr_stage_info: layers [layer_begin, layer_end) of n_layer, the boundary's width (n_streams * n_embd)
    std::string arch;
    int layer_begin = 0, layer_end = 0, n_layer = 0;
    int n_embd = 0, n_streams = 0, n_vocab = 0;
    bool is_first = false, is_last = false, needs_token_ids = false, has_vocab = false;
    int n_ctx = 0, max_sessions = 0;
    bool batch_invariant = false;
    std::string matmul_kernels;   // dgr_stage_info.matmul_kernels
    bool has_mtp = false;                            // an MTP block and an engine library that drafts with it
    int n_draft_max = 0;
    // dgr_memory
    uint64_t weights_bytes = 0, kv_bytes = 0, compute_bytes = 0, device_weights_bytes = 0;
    std::string device;
    // the bounds Describe reports (`dgr worker serve`'s flags)
    int64_t max_queued_steps = 0, max_session_steps = 0, max_batch_tokens = 0;
    double session_ttl_s = 0;
    uint64_t max_message_bytes = 0;
    bool can_roll_back = false;                      // the engine can truncate a session
    std::string prefix_cache_off;                    // why the prefix cache is off ("" when on: its stats are the load's)
    WireDtype dtype{};                               // the boundary's wire dtype (id.wire_dtype's)
    // trust (tls.h's Trust, less its credentials)
    bool tls = false, mutual_tls = false;
    std::string member;
    std::vector<HeldCertificate> certificates;
    // dgr.v1.ErrorCode's names in the proto's order, ERROR_UNSPECIFIED left out: the errors family has a sample of
    // each, 0 until answered
    std::vector<std::string> error_codes;
};

// The stage's load at one moment (StageWorker::load).
struct StageLoad {
    std::string address;                             // HOST:PORT as the stage names itself
    std::string metrics_url;                         // --metrics-listen's URL ("" without)
    bool serving = true;                             // false once stopping (SIGTERM)
    double uptime_s = 0;
    uint64_t open_sessions = 0, cached_positions = 0, opened_sessions = 0;
    int64_t queued_steps = 0;
    uint64_t reaped_sessions = 0, overloaded = 0, max_frame_bytes_sent = 0;
    std::vector<std::pair<std::string, uint64_t>> errors;   // ErrorCode name -> answered, first seen first
    Metrics::Times decode, prefill;                  // the recent steps' times (Metrics::times)
    MetricCounts counts;                             // what Metrics counted (Metrics::counts)
    std::optional<PrefixCache::Stats> prefix;        // with the prefix cache on
    uint64_t outgoing_channels = 0;                  // links and channels to other workers
    uint64_t unary_running = 0, unary_waiting = 0, unary_members = 0, unary_refused = 0;   // UnaryCalls::Counts
};

// dgr.core.descriptor.Descriptor as pydantic's model_dump_json writes it (invalid UTF-8 replaced).
std::string descriptor_json(const StageCard & card, const StageLoad & load);
// Every metric family, name for name (docs/wire.md "Metrics and the descriptor";
// tests/worker/test_worker_cpp_metrics.py).
std::string metrics_text(const StageCard & card, const StageLoad & load);

}  // namespace dgr
