#include "worker.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <future>
#include <stdexcept>

#include "nlohmann/json.hpp"

namespace dgr {

namespace pb = dgr::v1;
using Clock = std::chrono::steady_clock;

const std::vector<WireDtype> & wire_dtypes() {
    static const std::vector<WireDtype> t = {
        {"f32", 1, 4, pb::F32}, {"f16", 1, 2, pb::F16}, {"bf16", 1, 2, pb::BF16}, {"q8_0", 32, 34, pb::Q8_0}};
    return t;
}

const WireDtype * find_dtype(const std::string & name) {
    for (auto & d : wire_dtypes()) {
        if (name == d.name) return &d;
    }
    return nullptr;
}

const WireDtype * dtype_of(pb::Dtype code) {
    for (auto & d : wire_dtypes()) {
        if (d.code == code) return &d;
    }
    return nullptr;
}

uint64_t nbytes(const WireDtype & d, uint64_t n_values) { return n_values / d.block * d.block_bytes; }

std::string utf8_replace(const std::string & s) {
    // Unicode's "maximal subpart" practice (what CPython's decoder does): each maximal prefix of a valid
    // sequence that cannot be completed becomes one U+FFFD
    static const char REPL[] = "\xEF\xBF\xBD";
    std::string out;
    out.reserve(s.size());
    auto u = [&](size_t i) { return static_cast<unsigned char>(s[i]); };
    size_t i = 0, n = s.size();
    while (i < n) {
        unsigned char c = u(i);
        if (c < 0x80) { out += char(c); ++i; continue; }
        int need;
        unsigned char lo = 0x80, hi = 0xBF;
        if (c >= 0xC2 && c <= 0xDF) need = 1;
        else if (c == 0xE0) { need = 2; lo = 0xA0; }
        else if (c == 0xED) { need = 2; hi = 0x9F; }
        else if (c >= 0xE1 && c <= 0xEF) need = 2;
        else if (c == 0xF0) { need = 3; lo = 0x90; }
        else if (c == 0xF4) { need = 3; hi = 0x8F; }
        else if (c >= 0xF1 && c <= 0xF3) need = 3;
        else { out += REPL; ++i; continue; }
        size_t j = i + 1;
        int got = 0;
        while (got < need && j < n) {
            unsigned char b = u(j);
            if (got == 0 ? (b < lo || b > hi) : (b < 0x80 || b > 0xBF)) break;
            ++j;
            ++got;
        }
        if (got == need) out.append(s, i, j - i);
        else out += REPL;
        i = j;
    }
    return out;
}

std::string status_name(grpc::StatusCode c) {
    static const char * names[] = {"OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED",
                                   "NOT_FOUND", "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED",
                                   "FAILED_PRECONDITION", "ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED", "INTERNAL",
                                   "UNAVAILABLE", "DATA_LOSS", "UNAUTHENTICATED"};
    int i = int(c);
    return i >= 0 && i < int(sizeof names / sizeof *names) ? names[i] : std::to_string(i);
}

std::string hop_name(uint32_t index, const std::string & address) {
    return "stage " + std::to_string(index) + " (" + address + ")";
}

std::string schema_str(const pb::BoundarySchema & s) {
    const WireDtype * d = dtype_of(s.dtype());
    return "[n, " + std::to_string(s.n_streams()) + ", " + std::to_string(s.n_embd()) + "] " +
           (d ? std::string(d->name) : std::to_string(int(s.dtype()))) + " at layer " + std::to_string(s.layer()) +
           (s.token_ids() ? " +token ids" : "") + " of bundle " + s.bundle_id();
}

static const char * py_bool(bool b) { return b ? "True" : "False"; }

// Every handler runs inside this: no exception leaves a gRPC handler (INTERNAL with its message).
template <typename F> static grpc::Status guarded(const char * rpc, F && f) {
    try {
        return f();
    } catch (const std::exception & e) {
        return grpc::Status(grpc::StatusCode::INTERNAL, std::string(rpc) + " failed: " + e.what());
    } catch (...) {
        return grpc::Status(grpc::StatusCode::INTERNAL, std::string(rpc) + " failed (unknown exception)");
    }
}

StageWorker::StageWorker(const EngineLib & lib, dgr_engine * eng, StageIdentity identity, std::string address,
                         uint64_t max_message_bytes, Limits limits)
    : lib_(lib), eng_(eng), id_(std::move(identity)), address_(std::move(address)),
      max_message_bytes_(max_message_bytes), limits_(limits), started_(Clock::now()) {
    int32_t st = lib_.describe(eng_, &info_);
    if (st != DGR_OK) throw std::runtime_error(lib_.error(st));
    st = lib_.memory(eng_, &memory_);
    if (st != DGR_OK) throw std::runtime_error(lib_.error(st));
    can_truncate_ = lib_.can_truncate(eng_) != 0;
    if (limits_.prefix_cache_mib <= 0) prefix_off_ = "--prefix-cache-mib 0";
    else if (!lib_.state_get || !lib_.state_set) prefix_off_ = "the engine library predates it";
    else if (!can_truncate_) prefix_off_ = std::string(info_.arch) + " keeps one running state per session (recurrent or hybrid)";
    else if (!info_.batch_invariant) prefix_off_ = "the engine's results depend on the batch (fast kernels)";
    if (prefix_off_.empty()) prefix_ = std::make_unique<PrefixCache>(uint64_t(limits_.prefix_cache_mib) << 20);
    dtype_ = find_dtype(id_.wire_dtype);
    if (!dtype_) throw std::runtime_error("unknown wire dtype '" + id_.wire_dtype + "'");
    const bool lossy_ok = lib_.fp16_to_fp32 && lib_.fp32_to_fp16 && lib_.bf16_to_fp32 && lib_.fp32_to_bf16 &&
                          lib_.quantize_q8_0 && lib_.dequantize_q8_0;
    if (dtype_->code != pb::F32 && !lossy_ok) {
        throw std::runtime_error("--wire-dtype " + id_.wire_dtype + ": the engine library " + lib_.path +
                                 " does not export ggml's converters; use --wire-dtype f32 or rebuild it");
    }
    pb::StageDescription me;
    describe_msg(&me);
    schema_in_ = me.schema_in();
    schema_out_ = me.schema_out();
    seam_bytes_per_token_ = me.seam_bytes_per_token();
    engine_thread_ = std::thread([this] { engine_loop(); });   // last: it reads all of the above
}

std::string StageWorker::hop() const {
    std::lock_guard<std::mutex> g(addr_mu_);
    return hop_name(uint32_t(id_.stage_index), address_);
}

void StageWorker::set_address(const std::string & address) {
    std::lock_guard<std::mutex> g(addr_mu_);
    address_ = address;
}

void StageWorker::set_trust(Trust trust) { trust_ = std::move(trust); }

std::shared_ptr<grpc::ChannelCredentials> StageWorker::channel_credentials() const {
    return trust_.channel ? trust_.channel : grpc::InsecureChannelCredentials();
}

void StageWorker::count_error(pb::ErrorCode code) {
    std::string name = pb::ErrorCode_Name(code);
    std::lock_guard<std::mutex> g(mu_);
    for (auto & e : errors_) {
        if (e.first == name) { ++e.second; return; }
    }
    errors_.emplace_back(name, 1);
}

pb::WireError StageWorker::err(pb::ErrorCode code, const std::string & message, uint32_t retry_after_ms) {
    count_error(code);
    pb::WireError e;
    e.set_code(code);
    e.set_message(hop() + ": " + message);
    e.set_hop(hop());
    e.set_retry_after_ms(retry_after_ms);
    return e;
}

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
    d->set_batch_invariant(i.batch_invariant);
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
        d->set_queued_steps(uint32_t(n_pending_));
        d->set_max_frame_bytes_sent(max_frame_bytes_sent_);
        uint64_t cached = 0;
        for (auto & kv : sessions_) cached += kv.second->held;
        d->set_cached_positions(cached);
    }
    const uint32_t width = uint32_t(i.n_streams) * uint32_t(i.n_embd);
    if (!i.is_first) {
        auto * s = d->mutable_schema_in();
        s->set_n_streams(uint32_t(i.n_streams));
        s->set_n_embd(uint32_t(i.n_embd));
        s->set_dtype(dtype_->code);
        s->set_token_ids(i.needs_token_ids);
        s->set_bundle_id(id_.bundle_id);
        s->set_layer(uint32_t(i.layer_begin));
    }
    if (!i.is_last) {
        // token ids always travel with the boundary: any later stage that needs them has them
        auto * s = d->mutable_schema_out();
        s->set_n_streams(uint32_t(i.n_streams));
        s->set_n_embd(uint32_t(i.n_embd));
        s->set_dtype(dtype_->code);
        s->set_token_ids(true);
        s->set_bundle_id(id_.bundle_id);
        s->set_layer(uint32_t(i.layer_end));
        d->set_seam_bytes_per_token(nbytes(*dtype_, width));
    }
}

std::string StageWorker::descriptor_json() {
    // dgr.descriptor.Descriptor, field for field in its order (pydantic's model_dump_json)
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
        queued = n_pending_;
        for (auto & kv : sessions_) cached += kv.second->held;
        reaped = reaped_;
        overloaded = overloaded_;
        stopping = stopping_;
    }
    double uptime = std::chrono::duration<double>(Clock::now() - started_).count();
    J d = {
        {"schema_version", 1},
        {"address", [&] { std::lock_guard<std::mutex> g(addr_mu_); return address_; }()},
        {"identity", {{"model", id_.model}, {"bundle_id", id_.bundle_id}, {"stage_index", id_.stage_index},
                      {"stage_count", id_.stage_count}, {"layer_begin", i.layer_begin}, {"layer_end", i.layer_end},
                      {"n_layer", i.n_layer}, {"upstream_commit", id_.upstream_commit},
                      {"patch_series", id_.patch_series}, {"lane", id_.lane}, {"arch", i.arch},
                      {"engine", id_.engine}, {"engine_blake3", id_.engine_blake3}, {"worker_blake3", id_.worker_blake3},
                      {"wire_dtype", id_.wire_dtype}}},
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

grpc::Status StageWorker::Describe(grpc::ServerContext *, const pb::DescribeRequest *, pb::StageDescription * d) {
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

grpc::Status StageWorker::Tokenize(grpc::ServerContext *, const pb::TokenizeRequest * req, pb::TokenizeReply * out) {
    return guarded("Tokenize", [&] {
        if (!info_.has_vocab) return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, hop() + " holds no vocabulary");
        const std::string & text = req->text();
        std::vector<int32_t> ids(text.size() + 16);
        int32_t n;
        {
            std::lock_guard<std::mutex> g(engine_mu_);
            while (true) {
                n = lib_.tokenize(eng_, text.c_str(), req->add_special(), ids.data(), int32_t(ids.size()));
                if (n < 0) return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, lib_.error(DGR_E_ENGINE));
                if (size_t(n) <= ids.size()) break;
                ids.resize(size_t(n));
            }
        }
        for (int32_t k = 0; k < n; ++k) out->add_token_ids(ids[size_t(k)]);
        return grpc::Status::OK;
    });
}

grpc::Status StageWorker::Detokenize(grpc::ServerContext *, const pb::DetokenizeRequest * req, pb::DetokenizeReply * out) {
    return guarded("Detokenize", [&] {
        if (!info_.has_vocab) return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, hop() + " holds no vocabulary");
        std::vector<int32_t> ids(req->token_ids().begin(), req->token_ids().end());
        if (ids.empty()) ids.push_back(0);           // the array is never empty; n says how many count
        std::string buf(16 * size_t(req->token_ids_size()) + 16, '\0');
        int32_t n;
        {
            std::lock_guard<std::mutex> g(engine_mu_);
            while (true) {
                n = lib_.detokenize(eng_, ids.data(), req->token_ids_size(), &buf[0], int32_t(buf.size()));
                if (n < 0) return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, lib_.error(DGR_E_ENGINE));
                if (size_t(n) <= buf.size()) break;
                buf.resize(size_t(n));
            }
        }
        buf.resize(size_t(n));
        out->set_text(utf8_replace(buf));
        return grpc::Status::OK;
    });
}

std::chrono::system_clock::time_point StageWorker::chain_deadline(size_t hops_after, const grpc::ServerContext * ctx) const {
    // one rpc_timeout per hop still to go (the hop nearest a fault times out first), never past the
    // caller's own deadline (less 0.2 s to answer), at least 0.1 s
    double t = limits_.rpc_timeout_s * double(std::max<size_t>(1, hops_after));
    auto now = std::chrono::system_clock::now();
    auto theirs = ctx ? ctx->deadline() : std::chrono::system_clock::time_point::max();
    if (theirs != std::chrono::system_clock::time_point::max()) {
        double left = std::chrono::duration<double>(theirs - now).count();
        t = std::max(0.1, std::min(t, left - 0.2));
    }
    return now + std::chrono::duration_cast<std::chrono::system_clock::duration>(std::chrono::duration<double>(t));
}

pb::Stage::Stub * StageWorker::link(const std::string & address) {
    std::lock_guard<std::mutex> g(mu_);
    auto & stub = links_[address];
    if (!stub) {
        grpc::ChannelArguments args;
        int limit = int(max_message_bytes_ + FRAME_OVERHEAD);
        args.SetMaxSendMessageSize(limit);
        args.SetMaxReceiveMessageSize(limit);
        // its own connection: a peer restarted in place is not stuck behind a shared connection's backoff
        args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
        stub = pb::Stage::NewStub(grpc::CreateCustomChannel(address, channel_credentials(), args));
    }
    return stub.get();
}

uint32_t StageWorker::session_retry_ms() {
    // when a slot may free up: the next idle session's reaping, else a second (mu_ held)
    double ttl = limits_.session_ttl_s;
    if (ttl <= 0 || sessions_.empty()) return 1000;
    double idle = 0;
    auto now = Clock::now();
    for (auto & kv : sessions_) idle = std::max(idle, std::chrono::duration<double>(now - kv.second->last_used).count());
    return uint32_t(std::min(ttl, std::max(0.1, ttl - idle)) * 1000);
}

grpc::Status StageWorker::OpenSession(grpc::ServerContext * ctx, const pb::OpenSessionRequest * req, pb::OpenSessionReply * reply) {
    return guarded("OpenSession", [&] {
        auto fail = [&](pb::ErrorCode code, const std::string & msg, uint32_t retry = 0) {
            *reply->mutable_error() = err(code, msg, retry);
            return grpc::Status::OK;
        };
        bool stopping;
        { std::lock_guard<std::mutex> g(mu_); stopping = stopping_; }
        if (stopping) return fail(pb::HOP_UNREACHABLE, "this worker is shutting down: open the session on another replica");
        pb::StageDescription me;
        describe_msg(&me);
        const auto & ident = me.identity();
        if (req->hop_index() >= uint32_t(req->route_size())) return fail(pb::BAD_FRAME, "hop_index is outside the route");
        const pb::Hop & at = req->route(int(req->hop_index()));
        auto range = [](uint32_t s, uint32_t b, uint32_t e, const std::string & bundle) {
            return "stage " + std::to_string(s) + " [" + std::to_string(b) + ", " + std::to_string(e) + ") of bundle " + bundle;
        };
        std::string mine = range(ident.stage_index(), ident.layer_begin(), ident.layer_end(), ident.bundle_id());
        std::string want = range(at.stage_index(), at.layer_begin(), at.layer_end(), at.bundle_id());
        if (at.bundle_id() != ident.bundle_id() || at.stage_index() != ident.stage_index()) {
            return fail(pb::WRONG_STAGE, "the route expects " + want + " at " + at.address() + " but this worker serves " +
                                             mine + ": fix the route or start the right worker");
        }
        if (at.layer_begin() != ident.layer_begin() || at.layer_end() != ident.layer_end()) {
            return fail(pb::WRONG_RANGE, "the route expects " + want + " but this worker serves " + mine);
        }
        const bool last_hop = req->hop_index() == uint32_t(req->route_size() - 1);
        if ((req->hop_index() == 0) != bool(info_.is_first) || last_hop != bool(info_.is_last)) {
            return fail(pb::WRONG_STAGE, "this worker serves " + mine + " (first=" + py_bool(info_.is_first) + ", last=" +
                                             py_bool(info_.is_last) + ") but is hop " + std::to_string(req->hop_index()) +
                                             " of a " + std::to_string(req->route_size()) +
                                             "-hop route: the route must cover every layer in order");
        }
        if (req->hop_index() > 0) {
            const auto & up = req->upstream();
            if (!up.has_schema_out()) return fail(pb::WRONG_STAGE, "the previous hop did not say what it sends (no schema_out)");
            std::string theirs = hop_name(up.identity().stage_index(), req->route(int(req->hop_index()) - 1).address());
            const auto & so = up.schema_out();
            const auto & si = me.schema_in();
            std::vector<std::string> diff;
            if (so.n_streams() != si.n_streams()) diff.push_back("n_streams");
            if (so.n_embd() != si.n_embd()) diff.push_back("n_embd");
            if (so.dtype() != si.dtype()) diff.push_back("dtype");
            if (so.bundle_id() != si.bundle_id()) diff.push_back("bundle_id");
            if (si.token_ids() && !so.token_ids()) diff.push_back("token_ids");
            if (!diff.empty()) {
                std::string d;
                for (auto & f : diff) d += (d.empty() ? "" : ", ") + f;
                return fail(pb::SCHEMA_MISMATCH, theirs + " sends " + schema_str(so) + " but this stage takes " + schema_str(si) +
                                                     " (differs in " + d + "): both hops must serve stages of the same bundle");
            }
            if (so.layer() != si.layer()) {
                return fail(pb::WRONG_RANGE, theirs + " hands over at layer " + std::to_string(so.layer()) +
                                                 " but this stage begins at layer " + std::to_string(si.layer()));
            }
        }
        if (info_.is_last) {
            uint64_t vocab_bytes = uint64_t(info_.n_vocab) * 4 + FRAME_OVERHEAD;
            if (req->logits() != pb::LOGITS_NONE && vocab_bytes > max_message_bytes_) {
                return fail(pb::MESSAGE_TOO_LARGE, "one logits row needs " + std::to_string(vocab_bytes) + " bytes, over the " +
                                                       std::to_string(max_message_bytes_) + "-byte message limit");
            }
        }
        // what the last stage does with each draw (issue 23): log-probabilities, a grammar
        const pb::Sampling & sp = req->sampling();
        if (sp.top_logprobs() > MAX_TOP_LOGPROBS) {
            return fail(pb::ENGINE, "sampling.top_logprobs is " + std::to_string(sp.top_logprobs()) + ", at most " +
                                        std::to_string(MAX_TOP_LOGPROBS));
        }
        if (!sp.grammar().empty() && !sp.json_schema().empty()) {
            return fail(pb::ENGINE, "sampling.grammar and sampling.json_schema are both set: give one of them");
        }
        std::shared_ptr<dgr_grammar> grammar;
        if (info_.is_last) {
            if ((sp.logprobs() || sp.top_logprobs()) && !lib_.logprobs) {
                return fail(pb::ENGINE, "sampling.logprobs: " + lib_.path + " reports no log-probabilities (built before "
                                        "them): rebuild it (`dgr build-engine`)");
            }
            if (!sp.grammar().empty() || !sp.json_schema().empty()) {
                const char * field = sp.grammar().empty() ? "sampling.json_schema" : "sampling.grammar";
                if (!lib_.grammar_open) {
                    return fail(pb::ENGINE, std::string(field) + ": " + lib_.path + " has no grammar sampler (the fake "
                                            "engine has no vocabulary; an engine built before grammars): serve a real "
                                            "model, or rebuild the engine (`dgr build-engine`)");
                }
                dgr_grammar * g = nullptr;
                std::string refused;
                {
                    std::lock_guard<std::mutex> eg(engine_mu_);
                    int32_t st = lib_.grammar_open(eng_, sp.grammar().empty() ? nullptr : sp.grammar().c_str(),
                                                   sp.json_schema().empty() ? nullptr : sp.json_schema().c_str(), &g);
                    if (st != DGR_OK) refused = lib_.error(st);
                    if (g) grammar.reset(g, lib_.grammar_close);
                    for (int i = 0; refused.empty() && i < sp.grammar_accepted_size(); ++i) {
                        st = lib_.grammar_accept(g, sp.grammar_accepted(i));
                        if (st != DGR_OK) refused = "sampling.grammar_accepted[" + std::to_string(i) + "]: " + lib_.error(st);
                    }
                }
                if (!refused.empty()) return fail(pb::ENGINE, refused);
            }
        }
        const Key key{req->session_id(), req->epoch()};
        std::vector<Key> old;
        {
            std::unique_lock<std::mutex> g(mu_);
            auto le = latest_epoch_.find(req->session_id());
            if ((le != latest_epoch_.end() && req->epoch() < le->second) || sessions_.count(key)) {
                std::string at = std::to_string(latest_epoch_[req->session_id()]);
                g.unlock();
                return fail(pb::STALE_EPOCH, "session " + req->session_id() + " is already at epoch " + at + "; open a newer epoch");
            }
            for (auto & kv : sessions_) {
                if (kv.first.first == req->session_id()) old.push_back(kv.first);
            }
            if (sessions_.size() - old.size() >= size_t(info_.max_sessions)) {
                ++overloaded_;
                uint32_t retry = session_retry_ms();
                g.unlock();
                return fail(pb::OVERLOADED, "all " + std::to_string(info_.max_sessions) +
                                                " sessions are in use: retry later or use another route", retry);
            }
        }
        for (auto & k : old) close_local(k.first, k.second);
        {
            std::lock_guard<std::mutex> g(engine_mu_);
            int32_t st = lib_.session_open(eng_, req->session_id().c_str(), int64_t(req->epoch()));
            if (st != DGR_OK) {
                std::string msg = lib_.error(st);
                return fail(pb::ENGINE, msg);
            }
        }
        // the prefix cache: the longest kept prefix of the blocks the previous hop matched
        int32_t restored = 0;
        size_t matched = 0;
        if (prefix_ && req->prefix_blocks_size() > 0 && req->prefix_block_tokens() > 0) {
            PrefixCache::Hit hit = prefix_->find(prefix_seed(req->upstream()), prefix_blocks(req->prefix_blocks()),
                                                 req->prefix_block_tokens());
            if (hit.n_keep > 0) {
                std::lock_guard<std::mutex> eg(engine_mu_);
                int32_t st = lib_.state_set(eng_, req->session_id().c_str(), int64_t(req->epoch()), hit.state->data(),
                                            hit.state->size(), hit.n_positions, hit.n_keep);
                if (st == DGR_OK) {
                    restored = hit.n_keep;
                    matched = hit.blocks;
                } else {                             // an ordinary miss: prefill it all
                    fprintf(stderr, "dgr-worker: the prefix cache's state did not load: %s\n", lib_.error(st).c_str());
                }
            }
        }
        {
            std::lock_guard<std::mutex> g(mu_);
            auto s = std::make_shared<Session>();
            s->route.assign(req->route().begin(), req->route().end());
            s->hop_index = req->hop_index();
            s->last_used = Clock::now();
            s->sampling = req->sampling();
            s->sampling.clear_grammar_accepted();    // used above; not kept
            s->grammar = std::move(grammar);
            s->logits = int(req->logits());
            s->held = uint64_t(restored);
            s->prefix_seed = prefix_seed(req->upstream());
            if (trust_.mutual) s->opener = peer_identity(ctx);
            sessions_[key] = std::move(s);
            ++opened_total_;
            latest_epoch_[req->session_id()] = req->epoch();
        }
        *reply->add_hops() = me;
        if (!info_.is_last) {
            const pb::Hop & nxt = req->route(int(req->hop_index()) + 1);
            pb::OpenSessionRequest fwd = *req;
            fwd.set_hop_index(req->hop_index() + 1);
            *fwd.mutable_upstream() = me;
            while (size_t(fwd.prefix_blocks_size()) > matched) fwd.mutable_prefix_blocks()->RemoveLast();
            pb::OpenSessionReply theirs;
            grpc::ClientContext cc;
            cc.set_deadline(chain_deadline(size_t(req->route_size()) - 1 - req->hop_index(), ctx));
            grpc::Status st = link(nxt.address())->OpenSession(&cc, fwd, &theirs);
            if (!st.ok()) {
                std::string name = hop_name(req->hop_index() + 1, nxt.address());
                count_error(pb::HOP_UNREACHABLE);
                theirs.Clear();
                auto * e = theirs.mutable_error();
                e->set_code(pb::HOP_UNREACHABLE);
                e->set_hop(name);
                e->set_message(name + " is unreachable: " + hop() + " could not open the session there (" +
                               status_name(st.error_code()) + ": " + st.error_message() + "): is that worker running?");
            }
            if (theirs.has_error()) {
                close_local(key.first, key.second);
                reply->Clear();
                *reply->mutable_error() = theirs.error();
                return grpc::Status::OK;
            }
            for (auto & h : theirs.hops()) *reply->add_hops() = h;
            if (int32_t(theirs.cached_tokens()) < restored) {   // a later hop kept less: hold what every hop holds
                std::lock_guard<std::mutex> eg(engine_mu_);
                int32_t st = lib_.truncate(eng_, req->session_id().c_str(), int64_t(req->epoch()), int32_t(theirs.cached_tokens()));
                if (st != DGR_OK) return fail(pb::ENGINE, lib_.error(st));
                restored = int32_t(theirs.cached_tokens());
                std::lock_guard<std::mutex> g(mu_);
                auto it = sessions_.find(key);
                if (it != sessions_.end()) it->second->held = uint64_t(restored);
            }
        }
        reply->set_cached_tokens(uint32_t(restored));
        if (prefix_ && restored > 0) prefix_->note_hit(restored);
        {
            // the origin takes tokens back only from the last hop, errors from any hop of the route (mTLS)
            std::lock_guard<std::mutex> g(mu_);
            auto it = sessions_.find(key);
            if (it != sessions_.end() && reply->hops_size() > 0) {
                note_route(*it->second, reply->hops());
                it->second->returner = reply->hops(reply->hops_size() - 1).member();
                for (auto & h : reply->hops()) {
                    if (!h.member().empty()) it->second->route_members.insert(h.member());
                }
            }
        }
        return grpc::Status::OK;
    });
}

void StageWorker::close_local(const std::string & sid, uint64_t epoch) {
    bool held;
    {
        std::lock_guard<std::mutex> g(mu_);
        held = sessions_.erase(Key{sid, epoch}) > 0;
        auto it = pending_.find(Key{sid, epoch});   // its queued steps are forgotten
        if (it != pending_.end()) {
            n_pending_ -= int64_t(it->second.size());
            pending_.erase(it);
        }
    }
    if (held) {
        std::lock_guard<std::mutex> g(engine_mu_);
        int32_t st = lib_.session_close(eng_, sid.c_str(), int64_t(epoch));
        if (st != DGR_OK) fprintf(stderr, "dgr-worker: closing session %s epoch %llu: %s\n", sid.c_str(),
                                  (unsigned long long) epoch, lib_.error(st).c_str());
    }
}

std::vector<std::string> StageWorker::prefix_blocks(const google::protobuf::RepeatedPtrField<std::string> & b) const {
    return std::vector<std::string>(b.begin(), b.end());
}

// What a stage's state depends on besides the tokens: the boundary dtype the previous hop sent (a lossy
// wire dtype gives other values), and which upstream layer it came from
std::string StageWorker::prefix_seed(const pb::StageDescription & upstream) const {
    return std::to_string(int(upstream.schema_out().dtype())) + "/" + std::to_string(upstream.schema_out().layer());
}

void StageWorker::keep_prefix(const std::string & sid, uint64_t epoch, const pb::CloseSessionRequest & req) {
    if (!prefix_ || req.prefix_block_tokens() == 0) return;
    SessionPtr sess = session(Key{sid, epoch});
    if (!sess) return;
    {
        std::lock_guard<std::mutex> g(mu_);
        if (sess->failed || pending_.count(Key{sid, epoch})) return;   // failed or mid-step: keep nothing
    }
    uint64_t size = 0;
    int32_t n = 0;
    std::string state;
    {
        std::lock_guard<std::mutex> eg(engine_mu_);
        int32_t st = lib_.state_get(eng_, sid.c_str(), int64_t(epoch), nullptr, 0, &size, &n);
        if (st != DGR_OK || n < int32_t(req.prefix_block_tokens())) return;
        state.resize(size);
        st = lib_.state_get(eng_, sid.c_str(), int64_t(epoch), state.data(), size, &size, &n);
        if (st != DGR_OK) {
            fprintf(stderr, "dgr-worker: keeping session %s's prefix: %s\n", sid.c_str(), lib_.error(st).c_str());
            return;
        }
    }
    prefix_->put(sess->prefix_seed, prefix_blocks(req.prefix_blocks()), req.prefix_block_tokens(),
                 std::move(state), n);
}

void StageWorker::close_chained(const std::string & sid, uint64_t epoch, const grpc::ServerContext * ctx,
                                pb::CloseSessionReply * reply, const pb::CloseSessionRequest * keep) {
    std::vector<pb::Hop> route;
    uint32_t hop_index = 0;
    bool had;
    const Key key{sid, epoch};
    std::shared_ptr<std::promise<void>> mine;        // this call closes it along the route
    std::shared_future<void> theirs;                 // another call is closing it along the route now
    {
        std::lock_guard<std::mutex> g(mu_);
        auto it = sessions_.find(key);
        had = it != sessions_.end();
        if (had) {
            route = it->second->route;
            hop_index = it->second->hop_index;
            mine = std::make_shared<std::promise<void>>();
            closing_[key] = mine->get_future().share();
        } else if (auto c = closing_.find(key); c != closing_.end()) {
            theirs = c->second;
        }
    }
    if (!had) {
        // e.g. the client's stream ended (client_gone) just before its CloseSession came: answer once that
        // close has gone along the route, never while later hops still hold the session
        if (theirs.valid()) theirs.wait_for(std::chrono::duration<double>(limits_.rpc_timeout_s * double(id_.stage_count + 1)));
        return;
    }
    struct Done {                                    // however this returns: waiters go on, the entry goes
        StageWorker * w;
        Key key;
        std::shared_ptr<std::promise<void>> p;
        ~Done() {
            {
                std::lock_guard<std::mutex> g(w->mu_);
                w->closing_.erase(key);
            }
            p->set_value();
        }
    } done{this, key, mine};
    close_local(sid, epoch);
    if (!info_.is_last && hop_index + 1 < route.size()) {
        const pb::Hop & nxt = route[hop_index + 1];
        pb::CloseSessionRequest req;
        req.set_session_id(sid);
        req.set_epoch(epoch);
        req.set_chain(true);
        if (keep) {
            *req.mutable_prefix_blocks() = keep->prefix_blocks();
            req.set_prefix_block_tokens(keep->prefix_block_tokens());
        }
        pb::CloseSessionReply theirs;
        grpc::ClientContext cc;
        cc.set_deadline(chain_deadline(route.size() - 1 - hop_index, ctx));
        grpc::Status st = link(nxt.address())->CloseSession(&cc, req, &theirs);
        if (!st.ok() && reply) {
            *reply->mutable_error() = err(pb::HOP_UNREACHABLE, "could not close on " + hop_name(hop_index + 1, nxt.address()) +
                                                                   ": " + status_name(st.error_code()));
        }
    }
}

grpc::Status StageWorker::CloseSession(grpc::ServerContext * ctx, const pb::CloseSessionRequest * req, pb::CloseSessionReply * reply) {
    return guarded("CloseSession", [&] {
        if (std::string why = refuse_owner(req->session_id(), req->epoch(), ctx); !why.empty()) {
            fprintf(stderr, "dgr-worker: refused a close: %s\n", why.c_str());
            *reply->mutable_error() = err(pb::WRONG_STAGE, why);
            return grpc::Status::OK;
        }
        if (req->prefix_blocks_size() > 0) keep_prefix(req->session_id(), req->epoch(), *req);
        if (req->chain()) close_chained(req->session_id(), req->epoch(), ctx, reply, req);
        else close_local(req->session_id(), req->epoch());
        return grpc::Status::OK;
    });
}

int StageWorker::reap() {
    double ttl = limits_.session_ttl_s;
    if (ttl <= 0) return 0;
    std::vector<Key> idle;
    std::vector<SessionPtr> told;
    {
        std::lock_guard<std::mutex> g(mu_);
        auto now = Clock::now();
        for (auto & kv : sessions_) {
            if (std::chrono::duration<double>(now - kv.second->last_used).count() > ttl && !pending_.count(kv.first)) {
                idle.push_back(kv.first);
                told.push_back(kv.second);
            }
        }
    }
    for (size_t n = 0; n < idle.size(); ++n) {
        const Key & k = idle[n];
        SessionPtr sess = told[n];
        ReplyPtr client;
        {
            std::lock_guard<std::mutex> g(mu_);
            if (sess->client && !sess->done) {
                sess->failed = true;
                client = sess->client;
            }
        }
        if (client) {
            char ttl_s[32];
            snprintf(ttl_s, sizeof ttl_s, "%g", ttl);
            pb::Frame f;
            f.set_session_id(k.first);
            f.set_epoch(k.second);
            *f.mutable_error() = err(pb::UNKNOWN_SESSION, "session " + k.first + " epoch " + std::to_string(k.second) +
                                                              " was closed after " + ttl_s + " s idle (--session-ttl): open it again");
            client->put(std::move(f));
        }
        close_local(k.first, k.second);
        std::lock_guard<std::mutex> g(mu_);
        ++reaped_;
    }
    return int(idle.size());
}

void StageWorker::stop() {
    std::vector<std::pair<Key, SessionPtr>> open;
    std::set<ReplyPtr> streams;
    {
        std::lock_guard<std::mutex> g(mu_);
        stopping_ = true;
        for (auto & kv : sessions_) open.emplace_back(kv.first, kv.second);
        streams = streams_;
    }
    // tell the clients (through the origin) first, so they re-route (docs/worker.md, phase 4)
    const std::string bye = hop() + " is shutting down (SIGTERM): the session is closed; use another replica";
    for (auto & [k, sess] : open) {
        try {
            pb::Frame f;
            f.set_session_id(k.first);
            f.set_epoch(k.second);
            *f.mutable_error() = err(pb::HOP_UNREACHABLE, bye);
            if (info_.is_first) {
                ReplyPtr client;
                {
                    std::lock_guard<std::mutex> g(mu_);
                    if (!sess->done) client = sess->client;
                }
                if (client) client->put(std::move(f));
            } else if (!sess->route.empty() && sess->route[0].address() != [&] { std::lock_guard<std::mutex> g(addr_mu_); return address_; }()) {
                send(sess->route[0].address(), 0, std::move(f), sess);
            }
        } catch (const std::exception & e) {
            fprintf(stderr, "dgr-worker: could not tell the origin of %s: %s\n", k.first.c_str(), e.what());
        }
    }
    if (!open.empty()) std::this_thread::sleep_for(std::chrono::milliseconds(200));   // let those errors leave
    for (auto & s : streams) s->finish(true);
    for (auto & [k, sess] : open) close_local(k.first, k.second);
    shutdown_threads();
}

StageWorker::~StageWorker() {
    try {
        shutdown_threads();
    } catch (...) {
    }
}

}  // namespace dgr
