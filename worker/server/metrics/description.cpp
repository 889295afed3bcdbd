// The descriptor JSON and the Prometheus text, written from a stage's card and a snapshot of its load
// (metrics/description.h).
#include "metrics/description.h"

#include "nlohmann/json.hpp"
#include "wire/dtypes.h"

namespace dgr {

std::string descriptor_json(const StageCard & c, const StageLoad & l) {
    // dgr.core.descriptor.Descriptor, field for field in its order (pydantic's model_dump_json)
    using J = nlohmann::ordered_json;
    const uint64_t width = uint64_t(c.n_streams) * uint64_t(c.n_embd);
    auto seam = [&](int layer, bool token_ids) {
        J per = J::object();
        for (auto & d : wire_dtypes()) {
            if (width % d.block == 0) per[d.name] = nbytes(d, width);
        }
        return J{{"layer", layer}, {"n_streams", c.n_streams}, {"n_embd", c.n_embd}, {"token_ids", token_ids},
                 {"wire_dtype", c.dtype.name}, {"bytes_per_token", per}};
    };
    auto times = [](const Metrics::Times & t) {
        return J{{"steps", t.steps}, {"compute_ms_median", t.compute_median}, {"compute_ms_p90", t.compute_p90},
                 {"queue_ms_median", t.queue_median}, {"queue_ms_p90", t.queue_p90}};
    };
    J errors = J::object();
    for (auto & e : l.errors) errors[e.first] = e.second;
    const StageIdentity & id = c.id;
    J d = {
        {"schema_version", DESCRIPTOR_SCHEMA_VERSION},
        {"address", l.address},
        {"identity", {{"model", id.model}, {"bundle_id", id.bundle_id}, {"stage_index", id.stage_index},
                      {"stage_count", id.stage_count}, {"layer_begin", c.layer_begin}, {"layer_end", c.layer_end},
                      {"n_layer", c.n_layer}, {"upstream_commit", id.upstream_commit},
                      {"patch_series", id.patch_series}, {"lane", id.lane}, {"arch", c.arch},
                      {"engine", id.engine}, {"engine_blake3", id.engine_blake3}, {"worker_blake3", id.worker_blake3},
                      {"wire_dtype", id.wire_dtype}, {"numerics", id.numerics}}},
        {"capacity", {{"max_sessions", c.max_sessions}, {"n_ctx", c.n_ctx},
                      {"max_queued_steps", c.max_queued_steps}, {"max_session_steps", c.max_session_steps},
                      {"max_batch_tokens", c.max_batch_tokens}, {"max_message_bytes", c.max_message_bytes},
                      {"session_ttl_s", c.session_ttl_s},
                      {"memory", {{"weights_bytes", c.weights_bytes}, {"kv_bytes", c.kv_bytes},
                                  {"compute_bytes", c.compute_bytes},
                                  {"device_weights_bytes", c.device_weights_bytes},
                                  {"device", c.device}}},
                      {"decode", times(l.decode)}, {"prefill", times(l.prefill)}}},
        {"load", {{"open_sessions", l.open_sessions}, {"queued_steps", l.queued_steps},
                  {"cached_positions", l.cached_positions}}},
        {"seam", {{"seam_in", c.is_first ? J(nullptr) : seam(c.layer_begin, c.needs_token_ids)},
                  {"seam_out", c.is_last ? J(nullptr) : seam(c.layer_end, true)}}},
        {"health", {{"serving", l.serving}, {"uptime_s", l.uptime_s}, {"errors", errors},
                    {"reaped_sessions", l.reaped_sessions}, {"overloaded", l.overloaded}, {"restarts", 0}}},
        {"security", {{"tls", c.tls}, {"mutual_tls", c.mutual_tls}, {"member", c.member}}},
        {"certificates", [&] {
             J a = J::array();
             for (auto & h : c.certificates)
                 a.push_back({{"id", h.id}, {"contract", h.contract}, {"contract_blake3", h.contract_blake3}, {"lane", h.lane},
                              {"issued_at", h.issued_at}, {"summary", h.summary}});
             return a;
         }()},
        {"metrics", l.metrics_url},
    };
    return d.dump(-1, ' ', false, J::error_handler_t::replace);
}

std::string metrics_text(const StageCard & c, const StageLoad & l) {
    std::string o;
    // a family of one unlabelled sample (a counter's sample carries _total)
    auto gauge = [&](const char * name, const char * help, double v) {
        prom_family(o, std::string("dgr_worker_") + name, "gauge", help);
        prom_sample(o, std::string("dgr_worker_") + name, "", v);
    };
    auto counter = [&](const char * name, const char * help, double v) {
        prom_family(o, std::string("dgr_worker_") + name, "counter", help);
        prom_sample(o, std::string("dgr_worker_") + name + "_total", "", v);
    };
    const MetricCounts & m = l.counts;
    const char * kinds[2] = {"decode", "prefill"};
    prom_family(o, "dgr_worker_steps", "counter", "engine steps run (one session's frame of positions)");
    for (int k = 0; k < 2; ++k) prom_sample(o, "dgr_worker_steps_total", std::string("kind=\"") + kinds[k] + "\"", double(m.steps[k]));
    prom_family(o, "dgr_worker_tokens", "counter", "positions run through the engine");
    for (int k = 0; k < 2; ++k) prom_sample(o, "dgr_worker_tokens_total", std::string("kind=\"") + kinds[k] + "\"", double(m.tokens[k]));
    prom_family(o, "dgr_worker_forwards", "counter", "engine forwards run, by how many sessions' steps each "
                "carried (shared: more than one; --max-batch-sessions, docs/batching.md)");
    prom_sample(o, "dgr_worker_forwards_total", "sessions=\"one\"", double(m.forwards[0]));
    prom_sample(o, "dgr_worker_forwards_total", "sessions=\"shared\"", double(m.forwards[1]));
    counter("tokens_sampled", "tokens sampled (last stage)", double(m.sampled));
    counter("mtp_drafts", "tokens the MTP block drafted (last stage of an include_mtp bundle, --speculate mtp)",
            double(m.mtp_drafted));
    prom_histogram(o, "dgr_worker_step_queue_seconds", "a step's wait for the engine thread", "", {{"", &m.queue}});
    prom_histogram(o, "dgr_worker_step_compute_seconds", "the engine call a step ran in", "", {{"", &m.compute}});
    prom_histogram(o, "dgr_worker_frame_transit_seconds", "from the sender handing a frame to gRPC to this worker "
                   "reading it (wall clocks): steps in, tokens back at the origin", "frame",
                   {{"step", &m.transit_step}, {"token", &m.transit_token}});
    if (!c.is_first || !c.is_last) {
        prom_family(o, "dgr_worker_seam_bytes", "counter", "boundary bytes across this worker's seams (layer: the seam's global layer index)");
        if (!c.is_first) {
            prom_sample(o, "dgr_worker_seam_bytes_total", "direction=\"received\",layer=\"" + std::to_string(c.layer_begin) + "\"",
                        double(m.seam_in));
        }
        if (!c.is_last) {
            prom_sample(o, "dgr_worker_seam_bytes_total", "direction=\"sent\",layer=\"" + std::to_string(c.layer_end) + "\"",
                        double(m.seam_out));
        }
    }
    if (l.prefix) {                                  // docs/worker.md "Prefix cache"
        const PrefixCache::Stats & ps = *l.prefix;
        gauge("prefix_cache_bytes", "session state kept for later sessions (--prefix-cache-mib)", double(ps.bytes));
        gauge("prefix_cache_entries", "session states kept", double(ps.entries));
        counter("prefix_cache_lookups", "sessions opened with a prompt's prefix blocks", double(ps.lookups));
        counter("prefix_cache_hits", "of those, sessions that restored a kept prefix", double(ps.hits));
        counter("prefix_cache_hit_tokens", "positions restored and used (what the whole route held)", double(ps.hit_tokens));
        counter("prefix_cache_evicted", "states dropped for room, least recently used first", double(ps.evicted));
    }
    counter("sessions_opened", "sessions opened here", double(l.opened_sessions));
    prom_family(o, "dgr_worker_errors", "counter", "typed errors this worker answered, by dgr.v1.ErrorCode");
    for (const std::string & name : c.error_codes) {
        uint64_t n = 0;
        for (auto & e : l.errors) {
            if (e.first == name) n = e.second;
        }
        prom_sample(o, "dgr_worker_errors_total", "code=\"" + name + "\"", double(n));
    }
    gauge("sessions_open", "open sessions", double(l.open_sessions));
    gauge("queued_steps", "steps queued for the engine", double(l.queued_steps));
    gauge("cached_positions", "positions held over all open sessions", double(l.cached_positions));
    gauge("uptime_seconds", "seconds since the worker started", l.uptime_s);
    gauge("max_frame_bytes_sent", "largest frame sent so far", double(l.max_frame_bytes_sent));
    gauge("outgoing_channels", "channels and links to other workers this worker holds (pruned when unused)",
          double(l.outgoing_channels));
    gauge("unary_calls_running", "unary calls (Describe, OpenSession, ...) running", double(l.unary_running));
    gauge("unary_calls_waiting", "unary calls waiting for a thread", double(l.unary_waiting));
    gauge("unary_calls_members", "members with unary calls running or waiting", double(l.unary_members));
    counter("unary_calls_refused", "unary calls refused at once (--max-rpc-per-member, --max-rpc-threads)",
            double(l.unary_refused));
    counter("sessions_reaped", "sessions closed after --session-ttl idle", double(l.reaped_sessions));
    counter("overloaded", "requests answered OVERLOADED", double(l.overloaded));
    prom_family(o, "dgr_worker_info", "gauge", "what this worker serves (always 1)");
    prom_sample(o, "dgr_worker_info",
                "model=\"" + prom_escape(c.id.model) + "\",bundle_id=\"" + prom_escape(c.id.bundle_id) + "\",stage=\"" +
                    std::to_string(c.id.stage_index) + "\",stage_count=\"" + std::to_string(c.id.stage_count) + "\",layers=\"" +
                    std::to_string(c.layer_begin) + "-" + std::to_string(c.layer_end) + "\",lane=\"" +
                    prom_escape(c.id.lane) + "\",engine=\"" + prom_escape(c.id.engine) + "\"",
                1.0);
    return o;
}

}  // namespace dgr
