// Describe: the stage's description (identity, capacity, schemas, load) and the descriptor JSON it carries,
// field for field dgr.core.descriptor.Descriptor.
#include "rpc/guarded.h"
#include "wire/wire_common.h"
#include "worker.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>

#include "nlohmann/json.hpp"

namespace dgr {

namespace pb = dgr::v1;
using Clock = std::chrono::steady_clock;

void StageWorker::describe_msg(pb::StageDescription * d) {
    const dgr_stage_info & i = info_;
    auto * idn = d->mutable_identity();
    idn->set_model(id_.model);
    idn->set_bundle_id(id_.bundle_id);
    idn->set_stage_index(uint32_t(id_.stage_index));
    idn->set_stage_count(uint32_t(id_.stage_count));
    idn->set_layer_begin(uint32_t(i.layer_begin));
    idn->set_layer_end(uint32_t(i.layer_end));
    idn->set_n_layer(uint32_t(i.n_layer));
    idn->set_upstream_commit(id_.upstream_commit);
    idn->set_patch_series(id_.patch_series);
    idn->set_lane(id_.lane);
    idn->set_arch(i.arch);
    idn->set_numerics(id_.numerics);
    d->set_is_first(i.is_first);
    d->set_is_last(i.is_last);
    d->set_has_vocab(i.has_vocab);
    d->set_n_vocab(uint32_t(i.n_vocab));
    d->set_n_ctx(uint32_t(i.n_ctx));
    d->set_max_sessions(uint32_t(i.max_sessions));
    d->set_max_message_bytes(max_message_bytes_);
    d->set_engine(id_.engine);
    for (int32_t t : id_.eos_token_ids) d->add_eos_token_ids(uint32_t(t));
    d->set_chat_template(id_.chat_template);
    d->set_session_ttl_s(float(limits_.session_ttl_s));
    d->set_max_queued_steps(uint32_t(limits_.max_queued_steps));
    d->set_can_roll_back(can_truncate_);
    d->set_has_mtp(info_.has_mtp != 0 && engine_.lib().mtp_draft != nullptr);
    d->set_n_draft_max(uint32_t(std::max(0, info_.n_draft_max)));
    d->set_batch_invariant(i.batch_invariant);
    d->set_prefix_cache_off(prefix_off_);
    if (prefix_) {
        const PrefixCache::Stats ps = prefix_->stats();
        d->set_prefix_cache_capacity_bytes(ps.capacity);
        d->set_prefix_cache_bytes(ps.bytes);
        d->set_prefix_cache_entries(ps.entries);
        d->set_prefix_cache_hits(ps.hits);
        d->set_prefix_cache_lookups(ps.lookups);
    }
    d->set_tls(trust_.tls);
    d->set_mutual_tls(trust_.mutual);
    d->set_member(trust_.member);
    {
        std::lock_guard<std::mutex> g(mu_);
        d->set_open_sessions(uint32_t(sessions_.size()));
        d->set_reaped_sessions(reaped_);
        d->set_overloaded(overloaded_);
    }
    {
        std::lock_guard<std::mutex> g(mu_);
        d->set_queued_steps(uint32_t(steps_.steps()));
        d->set_max_frame_bytes_sent(max_frame_bytes_sent_);
        uint64_t cached = 0;
        sessions_.for_each([&](const Key &, const SessionPtr & s) { cached += s->held; });
        d->set_cached_positions(cached);
    }
    const uint32_t width = uint32_t(i.n_streams) * uint32_t(i.n_embd);
    if (!i.is_first) {
        auto * s = d->mutable_schema_in();
        s->set_n_streams(uint32_t(i.n_streams));
        s->set_n_embd(uint32_t(i.n_embd));
        s->set_dtype(dtype_code(*dtype_));
        s->set_token_ids(i.needs_token_ids);
        s->set_bundle_id(id_.bundle_id);
        s->set_layer(uint32_t(i.layer_begin));
    }
    if (!i.is_last) {
        // token ids always travel with the boundary: any later stage that needs them has them
        auto * s = d->mutable_schema_out();
        s->set_n_streams(uint32_t(i.n_streams));
        s->set_n_embd(uint32_t(i.n_embd));
        s->set_dtype(dtype_code(*dtype_));
        s->set_token_ids(true);
        s->set_bundle_id(id_.bundle_id);
        s->set_layer(uint32_t(i.layer_end));
        d->set_seam_bytes_per_token(nbytes(*dtype_, width));
    }
}

std::string StageWorker::descriptor_json() {
    // dgr.core.descriptor.Descriptor, field for field in its order (pydantic's model_dump_json)
    using J = nlohmann::ordered_json;
    const dgr_stage_info & i = info_;
    const uint64_t width = uint64_t(i.n_streams) * uint64_t(i.n_embd);
    auto seam = [&](int layer, bool token_ids) {
        J per = J::object();
        for (auto & d : wire_dtypes()) {
            if (width % d.block == 0) per[d.name] = nbytes(d, width);
        }
        return J{{"layer", layer}, {"n_streams", i.n_streams}, {"n_embd", i.n_embd}, {"token_ids", token_ids},
                 {"wire_dtype", dtype_->name}, {"bytes_per_token", per}};
    };
    auto times = [this](int kind) {
        Metrics::Times t = metrics_.times(kind);
        return J{{"steps", t.steps}, {"compute_ms_median", t.compute_median}, {"compute_ms_p90", t.compute_p90},
                 {"queue_ms_median", t.queue_median}, {"queue_ms_p90", t.queue_p90}};
    };
    J errors = J::object();
    size_t open;
    uint64_t reaped, overloaded, cached = 0;
    int64_t queued;
    bool stopping;
    {
        std::lock_guard<std::mutex> g(mu_);
        for (auto & e : errors_) errors[e.first] = e.second;
        open = sessions_.size();
        queued = steps_.steps();
        sessions_.for_each([&](const Key &, const SessionPtr & s) { cached += s->held; });
        reaped = reaped_;
        overloaded = overloaded_;
        stopping = stopping_;
    }
    double uptime = std::chrono::duration<double>(Clock::now() - started_).count();
    J d = {
        {"schema_version", DESCRIPTOR_SCHEMA_VERSION},
        {"address", [&] { std::lock_guard<std::mutex> g(addr_mu_); return address_; }()},
        {"identity", {{"model", id_.model}, {"bundle_id", id_.bundle_id}, {"stage_index", id_.stage_index},
                      {"stage_count", id_.stage_count}, {"layer_begin", i.layer_begin}, {"layer_end", i.layer_end},
                      {"n_layer", i.n_layer}, {"upstream_commit", id_.upstream_commit},
                      {"patch_series", id_.patch_series}, {"lane", id_.lane}, {"arch", i.arch},
                      {"engine", id_.engine}, {"engine_blake3", id_.engine_blake3}, {"worker_blake3", id_.worker_blake3},
                      {"wire_dtype", id_.wire_dtype}, {"numerics", id_.numerics}}},
        {"capacity", {{"max_sessions", i.max_sessions}, {"n_ctx", i.n_ctx},
                      {"max_queued_steps", limits_.max_queued_steps}, {"max_session_steps", limits_.max_session_steps},
                      {"max_batch_tokens", limits_.max_batch_tokens}, {"max_message_bytes", max_message_bytes_},
                      {"session_ttl_s", limits_.session_ttl_s},
                      {"memory", {{"weights_bytes", memory_.weights_bytes}, {"kv_bytes", memory_.kv_bytes},
                                  {"compute_bytes", memory_.compute_bytes},
                                  {"device_weights_bytes", memory_.device_weights_bytes},
                                  {"device", std::string(memory_.device)}}},
                      {"decode", times(0)}, {"prefill", times(1)}}},
        {"load", {{"open_sessions", open}, {"queued_steps", queued}, {"cached_positions", cached}}},
        {"seam", {{"seam_in", i.is_first ? J(nullptr) : seam(i.layer_begin, i.needs_token_ids != 0)},
                  {"seam_out", i.is_last ? J(nullptr) : seam(i.layer_end, true)}}},
        {"health", {{"serving", !stopping}, {"uptime_s", uptime}, {"errors", errors}, {"reaped_sessions", reaped},
                    {"overloaded", overloaded}, {"restarts", 0}}},
        {"security", {{"tls", trust_.tls}, {"mutual_tls", trust_.mutual}, {"member", trust_.member}}},
        {"certificates", [&] {
             J a = J::array();
             for (auto & c : certificates_)
                 a.push_back({{"id", c.id}, {"contract", c.contract}, {"contract_blake3", c.contract_blake3}, {"lane", c.lane},
                              {"issued_at", c.issued_at}, {"summary", c.summary}});
             return a;
         }()},
        {"metrics", [&] { std::lock_guard<std::mutex> g(addr_mu_); return metrics_url_; }()},
    };
    return d.dump(-1, ' ', false, J::error_handler_t::replace);
}

grpc::ServerUnaryReactor * StageWorker::Describe(Ctx * ctx, const pb::DescribeRequest *, pb::StageDescription * d) {
    return unary(ctx, [=] { return describe_rpc(d); });
}

grpc::Status StageWorker::describe_rpc(pb::StageDescription * d) {
    return guarded("Describe", [&] {
        describe_msg(d);
        try {                                        // a liveness probe never fails on the descriptor
            d->set_descriptor_json(descriptor_json());
        } catch (const std::exception & e) {
            fprintf(stderr, "dgr-worker: could not build the descriptor: %s\n", e.what());
        }
        return grpc::Status::OK;
    });
}

}  // namespace dgr
