// What a stage says about itself, alone (metrics/description.h): the descriptor JSON, key for key in
// dgr.core.descriptor.Descriptor's order with the values of the card and the load it was given (a seam's bytes per
// token in every dtype its width fits, no seam before the first stage or after the last, errors in the order first
// seen, invalid UTF-8 replaced), and the Prometheus text (every family in its order, the seams a stage has, the
// prefix cache's families only with it on, a sample per error code, escaped labels). No sockets, no gRPC, no
// protobuf: `bazel test //worker/server:description_test`, or the CMake target dgr-worker-unit-tests
// (tests/worker/test_worker_units.py).
#include "unit_check.h"
#include "metrics/description.h"

#include <string>
#include <vector>

#include "nlohmann/json.hpp"

namespace {

using dgr::StageCard;
using dgr::StageLoad;
using J = nlohmann::ordered_json;

bool has(const std::string & text, const std::string & line) { return text.find(line + "\n") != std::string::npos; }

// Stage 1 of 3, layers [2, 4) of 6, a boundary of 1 x 48 floats in f16 (48: no whole q8_0 block of 32)
StageCard middle() {
    StageCard c;
    c.id.model = "tiny";
    c.id.bundle_id = "b1";
    c.id.stage_index = 1;
    c.id.stage_count = 3;
    c.id.upstream_commit = "abc";
    c.id.patch_series = "p";
    c.id.lane = "cpu";
    c.id.engine_blake3 = "e3";
    c.id.worker_blake3 = "w3";
    c.id.wire_dtype = "f16";
    c.id.numerics = "n";
    c.arch = "llama";
    c.layer_begin = 2, c.layer_end = 4, c.n_layer = 6;
    c.n_embd = 48, c.n_streams = 1, c.n_vocab = 100;
    c.needs_token_ids = true;
    c.n_ctx = 256, c.max_sessions = 8;
    c.weights_bytes = 1000, c.kv_bytes = 200, c.compute_bytes = 30, c.device_weights_bytes = 0;
    c.max_queued_steps = 512, c.max_session_steps = 128, c.max_batch_tokens = 512;
    c.session_ttl_s = 300.0;
    c.max_message_bytes = 4128768;
    c.dtype = dgr::WIRE_DTYPES[1];
    c.member = "m";
    c.certificates.push_back({"c1", "contract.json", "cb3", "cpu", "2026-01-01T00:00:00Z", "ok"});
    c.error_codes = {"BAD_FRAME", "OVERLOADED", "CACHE_MISS"};
    return c;
}

StageLoad busy() {
    StageLoad l;
    l.address = "127.0.0.1:5001";
    l.metrics_url = "http://127.0.0.1:9000/metrics";
    l.uptime_s = 1.5;
    l.open_sessions = 2, l.cached_positions = 40, l.opened_sessions = 5, l.queued_steps = 3;
    l.reaped_sessions = 1, l.overloaded = 4, l.max_frame_bytes_sent = 999;
    l.errors = {{"OVERLOADED", 4}, {"BAD_FRAME", 2}};
    l.decode.steps = 7, l.decode.compute_median = 2.5;
    l.counts.steps[0] = 7, l.counts.steps[1] = 1, l.counts.tokens[0] = 7, l.counts.tokens[1] = 20;
    l.counts.seam_in = 1234, l.counts.seam_out = 4321, l.counts.forwards[1] = 6;
    l.counts.compute.observe(0.002);
    l.outgoing_channels = 2, l.unary_running = 1, l.unary_refused = 9;
    return l;
}

std::vector<std::string> keys(const J & j) {
    std::vector<std::string> k;
    for (auto & [key, v] : j.items()) k.push_back(key);
    return k;
}

void the_descriptor_is_the_models_fields_in_order() {
    const std::string text = dgr::descriptor_json(middle(), busy());
    const J d = J::parse(text);
    CHECK((keys(d) == std::vector<std::string>{"schema_version", "address", "identity", "capacity", "load", "seam", "health",
                                               "security", "certificates", "metrics"}));
    CHECK(d["schema_version"] == dgr::DESCRIPTOR_SCHEMA_VERSION && d["address"] == "127.0.0.1:5001");
    CHECK((keys(d["identity"]) == std::vector<std::string>{"model", "bundle_id", "stage_index", "stage_count", "layer_begin",
                                                           "layer_end", "n_layer", "upstream_commit", "patch_series", "lane",
                                                           "arch", "engine", "engine_blake3", "worker_blake3", "wire_dtype",
                                                           "numerics"}));
    CHECK(d["identity"]["layer_begin"] == 2 && d["identity"]["engine"] == "llama.cpp" && d["identity"]["wire_dtype"] == "f16");
    CHECK(d["capacity"]["session_ttl_s"] == 300.0 && d["capacity"]["max_message_bytes"] == 4128768);
    CHECK(d["capacity"]["memory"]["kv_bytes"] == 200 && d["capacity"]["memory"]["device"] == "");
    CHECK(d["capacity"]["decode"]["steps"] == 7 && d["capacity"]["decode"]["compute_ms_median"] == 2.5);
    CHECK(d["capacity"]["prefill"]["steps"] == 0);
    CHECK(d["load"] == J::parse(R"({"open_sessions":2,"queued_steps":3,"cached_positions":40})"));
    CHECK(d["security"] == J::parse(R"({"tls":false,"mutual_tls":false,"member":"m"})"));
    CHECK(d["certificates"].size() == 1 && d["certificates"][0]["issued_at"] == "2026-01-01T00:00:00Z");
    CHECK(d["metrics"] == "http://127.0.0.1:9000/metrics");
    // errors in the order first seen; compact, as pydantic's model_dump_json writes it
    CHECK(text.find(R"("health":{"serving":true,"uptime_s":1.5,"errors":{"OVERLOADED":4,"BAD_FRAME":2},)"
                    R"("reaped_sessions":1,"overloaded":4,"restarts":0})") != std::string::npos);
}

void a_seam_per_side_the_stage_has_in_every_dtype_its_width_fits() {
    const J d = J::parse(dgr::descriptor_json(middle(), busy()));
    // 48 values: f32 192 bytes, f16 and bf16 96; q8_0 needs whole blocks of 32, so it is left out
    CHECK(d["seam"]["seam_in"] == J::parse(R"({"layer":2,"n_streams":1,"n_embd":48,"token_ids":true,"wire_dtype":"f16",)"
                                           R"("bytes_per_token":{"f32":192,"f16":96,"bf16":96}})"));
    CHECK(d["seam"]["seam_out"]["layer"] == 4 && d["seam"]["seam_out"]["token_ids"] == true);
    StageCard first = middle();
    first.is_first = true;
    first.n_embd = 64;                               // two q8_0 blocks: 68 bytes
    const J f = J::parse(dgr::descriptor_json(first, busy()));
    CHECK(f["seam"]["seam_in"].is_null() && f["seam"]["seam_out"]["bytes_per_token"]["q8_0"] == 68);
    StageCard last = middle();
    last.is_last = true;
    const J t = J::parse(dgr::descriptor_json(last, busy()));
    CHECK(t["seam"]["seam_out"].is_null() && !t["seam"]["seam_in"].is_null());
    last.is_first = true;                            // the whole model: no seam at all
    CHECK(J::parse(dgr::descriptor_json(last, busy()))["seam"] == J::parse(R"({"seam_in":null,"seam_out":null})"));
}

void invalid_utf8_is_replaced_not_refused() {
    StageCard c = middle();
    c.id.model = "a\xff" "b";
    const std::string text = dgr::descriptor_json(c, busy());
    CHECK(text.find("\"model\":\"a\xEF\xBF\xBD" "b\"") != std::string::npos);   // U+FFFD, as errors="replace"
}

void the_text_has_every_family_in_its_order() {
    const std::string o = dgr::metrics_text(middle(), busy());
    const std::vector<std::string> families = {
        "dgr_worker_steps_total", "dgr_worker_tokens_total", "dgr_worker_forwards_total", "dgr_worker_tokens_sampled_total",
        "dgr_worker_mtp_drafts_total", "dgr_worker_step_queue_seconds", "dgr_worker_step_compute_seconds",
        "dgr_worker_frame_transit_seconds", "dgr_worker_seam_bytes_total", "dgr_worker_sessions_opened_total",
        "dgr_worker_errors_total", "dgr_worker_sessions_open", "dgr_worker_queued_steps", "dgr_worker_cached_positions",
        "dgr_worker_uptime_seconds", "dgr_worker_max_frame_bytes_sent", "dgr_worker_outgoing_channels",
        "dgr_worker_unary_calls_running", "dgr_worker_unary_calls_waiting", "dgr_worker_unary_calls_members",
        "dgr_worker_unary_calls_refused_total", "dgr_worker_sessions_reaped_total", "dgr_worker_overloaded_total",
        "dgr_worker_info"};
    size_t at = 0;
    for (auto & f : families) {
        const size_t k = o.find("# TYPE " + f + " ");
        CHECK(k != std::string::npos && k >= at);
        if (k != std::string::npos) at = k;
    }
    CHECK(o.find("prefix_cache") == std::string::npos);   // off: no family of it
    CHECK(has(o, "dgr_worker_steps_total{kind=\"decode\"} 7.0") && has(o, "dgr_worker_tokens_total{kind=\"prefill\"} 20.0"));
    CHECK(has(o, "dgr_worker_forwards_total{sessions=\"shared\"} 6.0"));
    CHECK(has(o, "dgr_worker_step_compute_seconds_bucket{le=\"0.0025\"} 1.0") && has(o, "dgr_worker_step_compute_seconds_count 1.0"));
    CHECK(has(o, "dgr_worker_seam_bytes_total{direction=\"received\",layer=\"2\"} 1234.0"));
    CHECK(has(o, "dgr_worker_seam_bytes_total{direction=\"sent\",layer=\"4\"} 4321.0"));
    // a sample per code, in the card's order, 0 until answered
    CHECK(o.find("dgr_worker_errors_total{code=\"BAD_FRAME\"} 2.0\ndgr_worker_errors_total{code=\"OVERLOADED\"} 4.0\n"
                 "dgr_worker_errors_total{code=\"CACHE_MISS\"} 0.0\n") != std::string::npos);
    CHECK(has(o, "dgr_worker_sessions_opened_total 5.0") && has(o, "dgr_worker_sessions_open 2.0"));
    CHECK(has(o, "dgr_worker_uptime_seconds 1.5") && has(o, "dgr_worker_max_frame_bytes_sent 999.0"));
    CHECK(has(o, "dgr_worker_outgoing_channels 2.0") && has(o, "dgr_worker_unary_calls_refused_total 9.0"));
    CHECK(has(o, "dgr_worker_sessions_reaped_total 1.0") && has(o, "dgr_worker_overloaded_total 4.0"));
    CHECK(has(o, "dgr_worker_info{model=\"tiny\",bundle_id=\"b1\",stage=\"1\",stage_count=\"3\",layers=\"2-4\",lane=\"cpu\","
                 "engine=\"llama.cpp\"} 1.0"));
}

void the_seams_and_the_prefix_cache_only_where_the_stage_has_them() {
    StageCard first = middle();
    first.is_first = true;
    std::string o = dgr::metrics_text(first, busy());
    CHECK(o.find("direction=\"received\"") == std::string::npos && o.find("direction=\"sent\"") != std::string::npos);
    first.is_last = true;                            // the whole model: no seam family at all
    o = dgr::metrics_text(first, busy());
    CHECK(o.find("dgr_worker_seam_bytes") == std::string::npos);
    StageLoad l = busy();
    l.prefix = dgr::PrefixCache::Stats{};
    l.prefix->bytes = 4096, l.prefix->hits = 2, l.prefix->evicted = 1;
    o = dgr::metrics_text(middle(), l);
    CHECK(has(o, "dgr_worker_prefix_cache_bytes 4096.0") && has(o, "dgr_worker_prefix_cache_hits_total 2.0"));
    CHECK(has(o, "dgr_worker_prefix_cache_evicted_total 1.0") && has(o, "# TYPE dgr_worker_prefix_cache_entries gauge"));
}

void labels_are_escaped() {
    StageCard c = middle();
    c.id.model = "a \"b\"\\";
    c.id.lane = "x\ny";
    const std::string o = dgr::metrics_text(c, busy());
    CHECK(o.find("model=\"a \\\"b\\\"\\\\\"") != std::string::npos && o.find("lane=\"x\\ny\"") != std::string::npos);
}

void a_copy_of_the_counts_is_what_a_scrape_writes() {
    dgr::Metrics m;
    m.step(1, 1'000'000, 2'000'000);
    m.forward(1);
    StageLoad l = busy();
    l.counts = m.counts();
    m.step(1, 0, 0);                                 // after the copy: not in it
    CHECK(l.counts.steps[0] == 1 && l.counts.compute.count == 1 && l.counts.forwards[0] == 1);
    CHECK(has(dgr::metrics_text(middle(), l), "dgr_worker_steps_total{kind=\"decode\"} 1.0"));
}

}  // namespace

int main() {
    the_descriptor_is_the_models_fields_in_order();
    a_seam_per_side_the_stage_has_in_every_dtype_its_width_fits();
    invalid_utf8_is_replaced_not_refused();
    the_text_has_every_family_in_its_order();
    the_seams_and_the_prefix_cache_only_where_the_stage_has_them();
    labels_are_escaped();
    a_copy_of_the_counts_is_what_a_scrape_writes();
    return dgr::unit::finish("description_test");
}
