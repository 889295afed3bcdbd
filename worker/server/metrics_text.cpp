// The worker's Prometheus text (--metrics-listen): every metric family, and the URL Describe reports.
#include <grpcpp/grpcpp.h>

#include <chrono>
#include <string>

#include "worker.h"

namespace dgr {

namespace pb = dgr::v1;
using Clock = std::chrono::steady_clock;

void StageWorker::set_metrics_url(const std::string & url) {
    std::lock_guard<std::mutex> g(addr_mu_);
    metrics_url_ = url;
}

// Every metric family, name for name (docs/wire.md "Metrics and the descriptor"; tests/worker/test_worker_cpp_metrics.py)
std::string StageWorker::metrics_text() {
    std::string o;
    const char * kinds[2] = {"decode", "prefill"};
    {
        std::lock_guard<std::mutex> g(metrics_.mu);
        prom_family(o, "dgr_worker_steps", "counter", "engine steps run (one session's frame of positions)");
        for (int k = 0; k < 2; ++k) prom_sample(o, "dgr_worker_steps_total", std::string("kind=\"") + kinds[k] + "\"", double(metrics_.steps[k]));
        prom_family(o, "dgr_worker_tokens", "counter", "positions run through the engine");
        for (int k = 0; k < 2; ++k) prom_sample(o, "dgr_worker_tokens_total", std::string("kind=\"") + kinds[k] + "\"", double(metrics_.tokens[k]));
        prom_family(o, "dgr_worker_forwards", "counter", "engine forwards run, by how many sessions' steps each "
                    "carried (shared: more than one; --max-batch-sessions, docs/batching.md)");
        prom_sample(o, "dgr_worker_forwards_total", "sessions=\"one\"", double(metrics_.forwards[0]));
        prom_sample(o, "dgr_worker_forwards_total", "sessions=\"shared\"", double(metrics_.forwards[1]));
        prom_family(o, "dgr_worker_tokens_sampled", "counter", "tokens sampled (last stage)");
        prom_sample(o, "dgr_worker_tokens_sampled_total", "", double(metrics_.sampled));
        prom_family(o, "dgr_worker_mtp_drafts", "counter", "tokens the MTP block drafted (last stage of an include_mtp "
                    "bundle, --speculate mtp)");
        prom_sample(o, "dgr_worker_mtp_drafts_total", "", double(metrics_.mtp_drafted));
        prom_histogram(o, "dgr_worker_step_queue_seconds", "a step's wait for the engine thread", "", {{"", &metrics_.queue}});
        prom_histogram(o, "dgr_worker_step_compute_seconds", "the engine call a step ran in", "", {{"", &metrics_.compute}});
        prom_histogram(o, "dgr_worker_frame_transit_seconds", "from the sender handing a frame to gRPC to this worker "
                       "reading it (wall clocks): steps in, tokens back at the origin", "frame",
                       {{"step", &metrics_.transit_step}, {"token", &metrics_.transit_token}});
        if (!info_.is_first || !info_.is_last) {
            prom_family(o, "dgr_worker_seam_bytes", "counter", "boundary bytes across this worker's seams (layer: the seam's global layer index)");
            if (!info_.is_first) {
                prom_sample(o, "dgr_worker_seam_bytes_total", "direction=\"received\",layer=\"" + std::to_string(info_.layer_begin) + "\"",
                            double(metrics_.seam_in));
            }
            if (!info_.is_last) {
                prom_sample(o, "dgr_worker_seam_bytes_total", "direction=\"sent\",layer=\"" + std::to_string(info_.layer_end) + "\"",
                            double(metrics_.seam_out));
            }
        }
    }
    if (prefix_) {                                   // docs/worker.md "Prefix cache"
        const PrefixCache::Stats ps = prefix_->stats();
        prom_family(o, "dgr_worker_prefix_cache_bytes", "gauge", "session state kept for later sessions (--prefix-cache-mib)");
        prom_sample(o, "dgr_worker_prefix_cache_bytes", "", double(ps.bytes));
        prom_family(o, "dgr_worker_prefix_cache_entries", "gauge", "session states kept");
        prom_sample(o, "dgr_worker_prefix_cache_entries", "", double(ps.entries));
        prom_family(o, "dgr_worker_prefix_cache_lookups", "counter", "sessions opened with a prompt's prefix blocks");
        prom_sample(o, "dgr_worker_prefix_cache_lookups_total", "", double(ps.lookups));
        prom_family(o, "dgr_worker_prefix_cache_hits", "counter", "of those, sessions that restored a kept prefix");
        prom_sample(o, "dgr_worker_prefix_cache_hits_total", "", double(ps.hits));
        prom_family(o, "dgr_worker_prefix_cache_hit_tokens", "counter", "positions restored and used (what the whole route held)");
        prom_sample(o, "dgr_worker_prefix_cache_hit_tokens_total", "", double(ps.hit_tokens));
        prom_family(o, "dgr_worker_prefix_cache_evicted", "counter", "states dropped for room, least recently used first");
        prom_sample(o, "dgr_worker_prefix_cache_evicted_total", "", double(ps.evicted));
    }
    std::lock_guard<std::mutex> g(mu_);
    prom_family(o, "dgr_worker_sessions_opened", "counter", "sessions opened here");
    prom_sample(o, "dgr_worker_sessions_opened_total", "", double(opened_total_));
    prom_family(o, "dgr_worker_errors", "counter", "typed errors this worker answered, by dgr.v1.ErrorCode");
    const auto * codes = pb::ErrorCode_descriptor();
    for (int i = 0; i < codes->value_count(); ++i) {
        const std::string name = codes->value(i)->name();
        if (name == "ERROR_UNSPECIFIED") continue;
        uint64_t n = 0;
        for (auto & e : errors_) {
            if (e.first == name) n = e.second;
        }
        prom_sample(o, "dgr_worker_errors_total", "code=\"" + name + "\"", double(n));
    }
    uint64_t held = 0;
    sessions_.for_each([&](const Key &, const SessionPtr & s) { held += s->held; });
    auto gauge = [&](const char * name, const char * help, double v) {
        prom_family(o, std::string("dgr_worker_") + name, "gauge", help);
        prom_sample(o, std::string("dgr_worker_") + name, "", v);
    };
    gauge("sessions_open", "open sessions", double(sessions_.size()));
    gauge("queued_steps", "steps queued for the engine", double(steps_.steps()));
    gauge("cached_positions", "positions held over all open sessions", double(held));
    gauge("uptime_seconds", "seconds since the worker started",
          std::chrono::duration<double>(std::chrono::steady_clock::now() - started_).count());
    gauge("max_frame_bytes_sent", "largest frame sent so far", double(max_frame_bytes_sent_));
    gauge("outgoing_channels", "channels and links to other workers this worker holds (pruned when unused)",
          double(links_.size()));
    const UnaryCalls::Counts calls = calls_->counts();   // (its own lock, a leaf: never taken the other way)
    gauge("unary_calls_running", "unary calls (Describe, OpenSession, ...) running", double(calls.running));
    gauge("unary_calls_waiting", "unary calls waiting for a thread", double(calls.queued));
    gauge("unary_calls_members", "members with unary calls running or waiting", double(calls.members));
    prom_family(o, "dgr_worker_unary_calls_refused", "counter",
                "unary calls refused at once (--max-rpc-per-member, --max-rpc-threads)");
    prom_sample(o, "dgr_worker_unary_calls_refused_total", "", double(calls.refused));
    prom_family(o, "dgr_worker_sessions_reaped", "counter", "sessions closed after --session-ttl idle");
    prom_sample(o, "dgr_worker_sessions_reaped_total", "", double(reaped_));
    prom_family(o, "dgr_worker_overloaded", "counter", "requests answered OVERLOADED");
    prom_sample(o, "dgr_worker_overloaded_total", "", double(overloaded_));
    prom_family(o, "dgr_worker_info", "gauge", "what this worker serves (always 1)");
    prom_sample(o, "dgr_worker_info",
                "model=\"" + prom_escape(id_.model) + "\",bundle_id=\"" + prom_escape(id_.bundle_id) + "\",stage=\"" +
                    std::to_string(id_.stage_index) + "\",stage_count=\"" + std::to_string(id_.stage_count) + "\",layers=\"" +
                    std::to_string(info_.layer_begin) + "-" + std::to_string(info_.layer_end) + "\",lane=\"" +
                    prom_escape(id_.lane) + "\",engine=\"" + prom_escape(id_.engine) + "\"",
                1.0);
    return o;
}

}  // namespace dgr
