// The stage worker itself (worker.h): built over the open engine, its address and trust, its card and a snapshot
// of its load (what it says about itself: metrics/description.h), the typed errors it answers, the unary stubs to
// its peers, and its end (stop on SIGTERM, the threads joined). Each RPC's handler has its file (rpc/*.cpp), the
// data path its own (frames.cpp lists them).
#include "worker.h"

#include "data_path.h"
#include "description/stage_description.h"
#include "wire/wire_common.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <chrono>
#include <stdexcept>
#include <string>
#include <thread>

namespace dgr {

namespace pb = dgr::v1;
using Clock = std::chrono::steady_clock;

StageWorker::StageWorker(const EngineLib & lib, dgr_engine * eng, StageIdentity identity, std::string address,
                         uint64_t max_message_bytes, Limits limits)
    : engine_(lib, eng), max_message_bytes_(max_message_bytes), limits_(limits), started_(Clock::now()),
      relay_(*this, std::move(address), RelaySettings{max_message_bytes, limits.link_keepalive_timeout_s,
                                                      limits.max_send_queue_bytes}),
      sched_(StepBounds{limits.max_queued_steps, limits.max_session_steps, limits.max_queued_steps_per_member},
             BatchSettings{limits.max_batch_tokens, limits.max_batch_sessions, limits.hold_batch},
             {[this](std::vector<Work> & batch) { engine_run_->run(batch); },
              [this] { return std::pair<uint64_t, size_t>(life_->opened_total(), sessions_.size()); }}) {
    card_.id = std::move(identity);
    dgr_memory memory{};
    {
        auto eg = engine_.lock();
        int32_t st = eg.describe(&info_);
        if (st != DGR_OK) throw std::runtime_error(lib.error(st));
        st = eg.memory(&memory);
        if (st != DGR_OK) throw std::runtime_error(lib.error(st));
        can_truncate_ = eg.can_truncate() != 0;
    }
    vocab_.emplace(engine_, info_.has_vocab != 0, [this] { return hop(); });
    if (limits_.prefix_cache_mib <= 0) prefix_off_ = "--prefix-cache-mib 0";
    else if (!lib.state_get || !lib.state_set) prefix_off_ = "the engine library predates it";
    // a recurrent or hybrid model, also one that rolls back its last step (per-step snapshots, --draft-max):
    // the engine's own words (dgr_session_state_set), as docs/families.md's "prefix cache" column has them
    else if (!can_truncate_ || (info_.n_draft_max > 0 && !info_.has_mtp)) {
        prefix_off_ = std::string(info_.arch) + " is a recurrent or hybrid model: a prefix of its state cannot be kept";
    }
    else if (!info_.batch_invariant) prefix_off_ = "the engine's results depend on the batch (fast kernels, or a GPU lane)";
    else if (info_.has_mtp) prefix_off_ = "a session's saved state does not hold its MTP context's cache";
    if (prefix_off_.empty()) prefix_ = std::make_unique<PrefixCache>(uint64_t(limits_.prefix_cache_mib) << 20);
    dtype_ = find_dtype(card_.id.wire_dtype);
    if (!dtype_) throw std::runtime_error("unknown wire dtype '" + card_.id.wire_dtype + "'");
    const bool lossy_ok = lib.fp16_to_fp32 && lib.fp32_to_fp16 && lib.bf16_to_fp32 && lib.fp32_to_bf16 &&
                          lib.quantize_q8_0 && lib.dequantize_q8_0;
    if (dtype_->code != pb::F32 && !lossy_ok) {
        throw std::runtime_error("--wire-dtype " + card_.id.wire_dtype + ": the engine library " + lib.path +
                                 " does not export ggml's converters; use --wire-dtype f32 or rebuild it");
    }
    fill_card(memory);
    pb::StageDescription me;
    describe_msg(card_, StageLoad{}, &me);
    schema_in_ = me.schema_in();
    schema_out_ = me.schema_out();
    seam_bytes_per_token_ = me.seam_bytes_per_token();
    origin_.emplace(static_cast<OriginPort &>(*this), sessions_, names_, sched_, engine_,
                    OriginSettings{info_.is_first != 0, info_.has_vocab != 0, int64_t(info_.n_ctx), max_message_bytes_});
    RingOutSettings out{info_.is_first != 0, int64_t(info_.n_streams) * info_.n_embd, int64_t(info_.n_streams),
                        int64_t(info_.n_embd), dtype_, schema_out_, seam_bytes_per_token_, max_message_bytes_,
                        limits_.link_keepalive_timeout_s};
    ring_out_.emplace(static_cast<RingOutPort &>(*this), relay_, sessions_, *origin_, metrics_, lib, std::move(out));
    SessionLifeSettings life{info_.is_first != 0, info_.is_last != 0, int64_t(info_.n_ctx), int64_t(info_.n_vocab),
                             int64_t(info_.max_sessions), uint32_t(card_.id.stage_count), max_message_bytes_,
                             limits_.max_sessions_per_member, limits_.session_ttl_s, limits_.rpc_timeout_s,
                             limits_.prefix_cache_shared, limits_.max_grammar_bytes, limits_.max_grammar_depth};
    life_.emplace(static_cast<SessionLifePort &>(*this), sessions_, engine_, relay_, sched_, *origin_, metrics_, prefix_.get(),
                  trust_, names_, net_, std::move(life));
    EngineRunSettings run{info_.is_first != 0, info_.is_last != 0, info_.has_mtp != 0, int64_t(info_.n_vocab),
                          int64_t(info_.n_ctx), int64_t(info_.n_draft_max), int64_t(info_.n_streams) * info_.n_embd,
                          uint32_t(card_.id.stage_index), max_message_bytes_, limits_.die_at, limits_.stop_at,
                          limits_.evict_at, limits_.break_origin_link_at};
    engine_run_.emplace(static_cast<EngineRunPort &>(*this), engine_, sessions_, sched_, *ring_out_, relay_, metrics_,
                        names_, std::move(run));
    FrameIntakeSettings in{info_.is_first != 0, info_.needs_token_ids != 0, int64_t(info_.n_ctx), int64_t(info_.n_streams),
                           int64_t(info_.n_embd), int64_t(info_.layer_begin), int64_t(info_.layer_end),
                           int64_t(card_.id.stage_index), dtype_, schema_in_, limits_.send_timeout_s,
                           limits_.max_send_queue_bytes, limits_.max_queued_steps, limits_.max_session_steps,
                           limits_.max_queued_steps_per_member};
    intake_.emplace(static_cast<FrameIntakePort &>(*this), engine_, sessions_, *life_, *origin_, sched_, relay_, metrics_,
                    trust_, names_, limits_.max_connections, std::move(in));
    sched_.start();                                  // last: its engine thread reads all of the above
}

std::string StageWorker::hop() const {
    return hop_name(uint32_t(card_.id.stage_index), relay_.address());
}

void StageWorker::set_address(const std::string & address) {
    relay_.set_address(address);
}

void StageWorker::set_trust(Trust trust) {
    trust_ = std::move(trust);
    card_.tls = trust_.tls;
    card_.mutual_tls = trust_.mutual;
    card_.member = trust_.member;
    names_ = SessionNames(trust_.mutual);
    relay_.set_credentials(trust_.channel);
}

// The card: the engine's stage info and memory and the worker's settings, copied once at start.
void StageWorker::fill_card(const dgr_memory & memory) {
    const dgr_stage_info & i = info_;
    StageCard & c = card_;
    c.arch = i.arch;
    c.layer_begin = i.layer_begin, c.layer_end = i.layer_end, c.n_layer = i.n_layer;
    c.n_embd = i.n_embd, c.n_streams = i.n_streams, c.n_vocab = i.n_vocab;
    c.is_first = i.is_first != 0, c.is_last = i.is_last != 0;
    c.needs_token_ids = i.needs_token_ids != 0, c.has_vocab = i.has_vocab != 0;
    c.n_ctx = i.n_ctx, c.max_sessions = i.max_sessions;
    c.batch_invariant = i.batch_invariant != 0;
    c.matmul_kernels = i.matmul_kernels;
    c.has_mtp = i.has_mtp != 0 && engine_.lib().mtp_draft != nullptr;
    c.n_draft_max = i.n_draft_max;
    c.weights_bytes = memory.weights_bytes, c.kv_bytes = memory.kv_bytes, c.compute_bytes = memory.compute_bytes;
    c.device_weights_bytes = memory.device_weights_bytes;
    c.device = memory.device;
    c.max_queued_steps = limits_.max_queued_steps, c.max_session_steps = limits_.max_session_steps;
    c.max_batch_tokens = limits_.max_batch_tokens, c.session_ttl_s = limits_.session_ttl_s;
    c.max_message_bytes = max_message_bytes_;
    c.can_roll_back = can_truncate_;
    c.prefix_cache_off = prefix_off_;
    c.dtype = *dtype_;
    c.error_codes.clear();
    const auto * codes = pb::ErrorCode_descriptor();
    for (int k = 0; k < codes->value_count(); ++k) {
        const std::string name = codes->value(k)->name();
        if (name != "ERROR_UNSPECIFIED") c.error_codes.push_back(name);
    }
}

// What metrics/description.h and rpc/describe.h write out: each counter under its own lock, one at a time
// (Metrics::mu, the prefix cache's, addr_mu_, the session table's, each session's record, the step queue's, the
// session life's, the link table's, the unary calls'): a snapshot of counters, not one instant (docs/worker.md
// "Locks and their order").
StageLoad StageWorker::load() {
    StageLoad l;
    l.address = relay_.address();
    l.max_frame_bytes_sent = relay_.max_frame_bytes_sent();
    l.uptime_s = std::chrono::duration<double>(Clock::now() - started_).count();
    l.counts = metrics_.counts();
    l.errors = l.counts.errors;
    l.reaped_sessions = l.counts.reaped;
    l.overloaded = l.counts.overloaded;
    l.decode = metrics_.times(0);
    l.prefill = metrics_.times(1);
    if (prefix_) l.prefix = prefix_->stats();
    {
        std::lock_guard<std::mutex> g(addr_mu_);
        l.metrics_url = metrics_url_;
    }
    l.open_sessions = sessions_.size();
    std::vector<SessionPtr> open;                    // copied out: a record's lock is never taken under the table's
    sessions_.for_each([&](const Key &, const SessionPtr & s) { open.push_back(s); });
    for (auto & s : open) l.cached_positions += s->steps.held();
    l.queued_steps = sched_.steps();
    l.opened_sessions = life_->opened_total();
    l.serving = life_->serving();
    l.outgoing_channels = relay_.size();
    if (calls_) {
        const UnaryCalls::Counts calls = calls_->counts();   // (its own lock, a leaf: never taken the other way)
        l.unary_running = calls.running, l.unary_waiting = calls.queued, l.unary_members = calls.members;
        l.unary_refused = calls.refused;
    }
    return l;
}

void StageWorker::describe(pb::StageDescription * me) {
    describe_msg(card_, load(), me);
}

void StageWorker::set_metrics_url(const std::string & url) {
    std::lock_guard<std::mutex> g(addr_mu_);
    metrics_url_ = url;
}

void StageWorker::count_error(pb::ErrorCode code) {
    metrics_.count_error(pb::ErrorCode_Name(code));
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

void StageWorker::stop() {
    const std::vector<std::pair<Key, SessionPtr>> open = life_->stop();   // no session opens from now on
    const std::vector<ReplyPtr> streams = intake_->stop();                 // no Frames call starts
    // tell the clients (through the origin) first, so they re-route (docs/worker.md, "Failures, drain, speculation,
    // metrics")
    const std::string bye = hop() + " is shutting down (SIGTERM): the session is closed; use another replica";
    for (auto & [k, sess] : open) {
        try {
            pb::Frame f;
            f.set_session_id(info_.is_first ? names_.wire_of(k.first) : sess->wire_down);
            f.set_epoch(k.second);
            *f.mutable_error() = err(pb::HOP_UNREACHABLE, bye);
            if (info_.is_first) {
                if (ReplyPtr client = origin_->unfinished_client(sess)) client->put(std::move(f));
            } else if (!sess->route.empty() && sess->route[0].address() != relay_.address()) {
                ring_out_->send(sess->route[0].address(), 0, std::move(f), sess);
            }
        } catch (const std::exception & e) {
            fprintf(stderr, "dgr-worker: could not tell the origin of %s: %s\n", k.first.c_str(), e.what());
        }
    }
    if (!open.empty()) std::this_thread::sleep_for(std::chrono::milliseconds(200));   // let those errors leave
    for (auto & s : streams) s->finish(true);
    for (auto & [k, sess] : open) life_->close_local(k.first, k.second);
    shutdown_threads();
}

void StageWorker::shutdown_threads() {
    sched_.stop();                                   // no batch or job starts from now on
    relay_.stop();                                   // no link opens from now on
    sched_.join();                                   // the engine thread, and a reader running a step inline
    if (!sched_.on_engine_thread()) intake_->wait_cleanups();   // the gone clients' cleanups
    relay_.close_all();                              // every link closed and destroyed here, outside the locks
}

StageWorker::~StageWorker() {
    try {
        shutdown_threads();
    } catch (...) {
    }
}

}  // namespace dgr
