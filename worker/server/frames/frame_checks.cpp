// A frame in: who may send it (mutual TLS), where it goes (tokens and errors into the origin, steps to the
// queue), and a step's checks, so that malformed frames never reach the engine.
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <set>
#include <stdexcept>

#include "data_path.h"
#include "trust/senders.h"
#include "wire/wire_common.h"
#include "frames/frame_intake.h"

namespace dgr {

namespace pb = dgr::v1;
using Clock = std::chrono::steady_clock;

// mTLS (docs/worker.md "Peer checks under mutual TLS"): a session's frames come only from the peer that opened it here;
// tokens back into the origin only from its last hop, errors from a hop of its route (the part trust/senders.h).
// The session's senders answer under their own lock (trust/senders.h).
void FrameIntake::check_sender(const char * kind, const SessionPtr & sess, const std::optional<std::string> * peer,
                               const std::string & sid) {
    if (!trust_.mutual || !peer || !sess) return;
    const std::string who_opens = set_.is_first ? "the client" : "stage " + std::to_string(set_.stage_index - 1);
    const std::string why = sess->senders.refuse(kind, *peer, who_opens, sid);
    if (!why.empty()) throw Fault{pb::WRONG_STAGE, why};
}

void FrameIntake::on_frame(pb::Frame frame, const ReplyPtr & reply, const std::optional<std::string> * peer) {
    const auto kind = frame.body_case();
    const int64_t sent = int64_t(frame.sent_unix_ns());
    const uint64_t transit = sent ? uint64_t(std::max<int64_t>(0, wall_ns() - sent)) : 0;
    // the id as the sender named it; this worker's key for the session (sessions/names.h): a client's or a previous
    // hop's frame names a session in the sender's own namespace; what returns into the origin names the id
    // stage 0 gave the route (wire_down), and a frame this worker sent itself names its own key
    const std::string named = frame.session_id();
    const bool returning = kind == pb::Frame::kToken || kind == pb::Frame::kLogits || kind == pb::Frame::kError;
    if (peer) {
        if (!returning) {
            frame.set_session_id(names_.key(*peer, named));
        } else {
            frame.set_session_id(set_.is_first ? life_.origin_key(named) : std::string());
        }
    }
    const Key key{frame.session_id(), frame.epoch()};
    SessionPtr sess = key.first.empty() ? nullptr : sessions_.find(key);   // the table's lock alone
    if (returning) {
        if (!sess) {                                 // no session of this origin's route has that id
            if (kind != pb::Frame::kError) {
                frame.set_session_id(named);
                reply_error(reply, frame, err(pb::UNKNOWN_SESSION, "no open session " + named + " epoch " +
                                                                       std::to_string(frame.epoch()) + " returns here"), true);
            }
            return;
        }
        try {
            check_sender(kind == pb::Frame::kToken ? "token" : kind == pb::Frame::kLogits ? "logits" : "error", sess, peer, named);
        } catch (Fault & f) {
            fprintf(stderr, "dgr-worker: refused a frame: %s\n", f.message.c_str());
            frame.set_session_id(named);
            if (kind != pb::Frame::kError) reply_error(reply, frame, err(f.code, f.message), true);
            return;
        }
        if (kind == pb::Frame::kToken) {
            frame.mutable_token()->set_return_ns(transit);
            if (transit) {
                std::lock_guard<std::mutex> g(metrics_.mu);
                metrics_.transit_token.observe(double(transit) / 1e9);
            }
        }
        origin_.deliver(std::move(frame));           // returns into the origin
        return;
    }
    std::vector<float> x;
    try {
        if (!sess) {
            const std::optional<uint64_t> latest = sessions_.latest_epoch(frame.session_id());
            if (latest && *latest > frame.epoch()) {
                throw Fault{pb::STALE_EPOCH, "session " + named + " epoch " + std::to_string(frame.epoch()) +
                                                 " was replaced by epoch " + std::to_string(*latest)};
            }
            throw Fault{pb::UNKNOWN_SESSION, "no open session " + named + " epoch " +
                                                 std::to_string(frame.epoch()) + ": open it (OpenSession) first"};
        }
        try {
            check_sender(kind == pb::Frame::kGenerate ? "generate" : kind == pb::Frame::kStep ? "step" : "other", sess, peer, named);
        } catch (Fault & f) {
            fprintf(stderr, "dgr-worker: refused a frame: %s\n", f.message.c_str());
            throw;
        }
        if (kind == pb::Frame::kGenerate) {
            if (!set_.is_first) throw Fault{pb::BAD_FRAME, "generate frames go to stage 0 only"};
            const auto & g = frame.generate();
            // every repeated field bounded by what one session can hold (n_ctx positions)
            for (auto [field, n] : {std::pair<const char *, int>{"context_ids", g.context_ids_size()},
                                    {"cached_ids", g.cached_ids_size()}, {"stop_token_ids", g.stop_token_ids_size()}}) {
                if (int64_t(n) > int64_t(set_.n_ctx)) {
                    throw Fault{pb::BAD_FRAME, std::string("generate.") + field + " holds " + std::to_string(n) +
                                                   " ids, more than the session's context (" + std::to_string(set_.n_ctx) + ")"};
                }
            }
            origin_.begin(sess, g, reply);             // its client, bounds and drafts (throws Fault)
            return;
        }
        if (kind != pb::Frame::kStep) throw Fault{pb::BAD_FRAME, std::string("unexpected frame body ") + body_name(kind)};
        check_step(frame.step(), &x);
        std::lock_guard<std::mutex> g(metrics_.mu);
        if (transit) metrics_.transit_step.observe(double(transit) / 1e9);
        if (!x.empty()) metrics_.seam_in += frame.step().boundary().data().size();
    } catch (const Fault & f) {
        pb::WireError e = err(f.code, f.message, f.retry_after_ms);
        e.set_held(f.held);
        e.set_expected(f.expected);
        reply_error(reply, frame, std::move(e));
        return;
    }
    if (set_.is_first) {
        origin_.on_client_step(sess, reply, frame.mutable_step());
        frame.set_origin_sent_ns(uint64_t(mono_ns()));
    }
    Work w;
    w.frame = std::move(frame);
    w.reply = reply;
    w.t_recv = mono_ns();
    w.x = std::move(x);
    w.transit_ns = transit;
    enqueue(std::move(w), sess, false);
}

// A step frame's checks: malformed frames never reach the engine queue; *x gets the boundary
void FrameIntake::check_step(const pb::Step & step, std::vector<float> * x) {
    const int64_t n = step.positions_size();
    if (n == 0) throw Fault{pb::BAD_FRAME, "a step needs at least one position"};
    const int64_t p0 = step.positions(0);
    for (int64_t k = 0; k < n; ++k) {
        if (int64_t(step.positions(int(k))) != p0 + k) throw Fault{pb::BAD_FRAME, "positions must be contiguous and increasing"};
    }
    if (int64_t(step.cache_expect()) != p0) {
        throw Fault{pb::BAD_FRAME, "cache_expect " + std::to_string(step.cache_expect()) + " != first position " + std::to_string(p0)};
    }
    if (p0 + n > set_.n_ctx) throw Fault{pb::ENGINE, context_full(p0 + n - 1, set_.n_ctx)};
    if (step.drafts() && (int64_t(step.drafts()) >= n || !step.sample())) {
        throw Fault{pb::BAD_FRAME, "a speculative step carries its last token and then " + std::to_string(step.drafts()) +
                                       " drafts (" + std::to_string(step.drafts() + 1) + " positions, sampled), got " +
                                       std::to_string(n) + " positions"};
    }
    if (step.mtp_drafts() > MAX_DRAFT_K || (step.mtp_drafts() && !step.sample())) {
        throw Fault{pb::BAD_FRAME, "mtp_drafts asks the last stage for up to " + std::to_string(MAX_DRAFT_K) +
                                       " MTP drafts after a sampled step's draw, got " + std::to_string(step.mtp_drafts()) +
                                       (step.sample() ? "" : " on a step that does not sample")};
    }
    if (step.drafts() && step.token_ids_size() != n) {       // the last stage verifies the drafted ids
        throw Fault{pb::BAD_FRAME, "a speculative step carries one token id per position (" + std::to_string(n) + "), got " +
                                       std::to_string(step.token_ids_size())};
    }
    if (set_.is_first) {
        if (step.drafts() || step.rollback() || step.mtp_drafts()) {
            throw Fault{pb::BAD_FRAME, "drafts and rollbacks are the origin's own steps: a client sends "
                                       "Generate(draft_source=...) instead"};
        }
        if (step.token_ids_size() != n) {
            throw Fault{pb::BAD_FRAME, "stage 0 needs one token id per position (" + std::to_string(n) + "), got " +
                                           std::to_string(step.token_ids_size())};
        }
        if (step.has_boundary()) throw Fault{pb::SCHEMA_MISMATCH, "stage 0 takes token ids, not a boundary"};
        return;
    }
    const pb::BoundarySchema & want = set_.schema_in;
    if (!step.has_schema()) throw Fault{pb::SCHEMA_MISMATCH, "the frame names no schema; this stage takes " + schema_str(want)};
    const auto & got = step.schema();
    std::string diff;
    auto differs = [&](bool d, const char * name) { if (d) diff += (diff.empty() ? "" : ", ") + std::string(name); };
    differs(got.n_streams() != want.n_streams(), "n_streams");
    differs(got.n_embd() != want.n_embd(), "n_embd");
    differs(got.dtype() != want.dtype(), "dtype");
    differs(got.bundle_id() != want.bundle_id(), "bundle_id");
    if (!diff.empty()) {
        throw Fault{pb::SCHEMA_MISMATCH, "frame schema " + schema_str(got) + " differs from this stage's " + schema_str(want) + " in " + diff};
    }
    if (got.layer() != want.layer()) {
        throw Fault{pb::WRONG_RANGE, "the boundary is for layer " + std::to_string(got.layer()) + " but this stage owns [" +
                                         std::to_string(set_.layer_begin) + ", " + std::to_string(set_.layer_end) + ")"};
    }
    if (set_.needs_token_ids && step.token_ids_size() != n) {
        throw Fault{pb::SCHEMA_MISMATCH, "this stage owns token-id layers and needs the token-id sideband (" + std::to_string(n) +
                                             " ids), got " + std::to_string(step.token_ids_size())};
    }
    const auto & b = step.boundary();
    std::vector<int64_t> shape = {n, set_.n_streams, set_.n_embd};
    std::vector<int64_t> got_shape(b.shape().begin(), b.shape().end());
    if (got_shape != shape) {
        throw Fault{pb::BAD_FRAME, "boundary shape " + list_str(got_shape) + " != " + list_str(shape) + " [n_tokens, n_streams, n_embd]"};
    }
    if (b.dtype() != want.dtype()) {
        const WireDtype * d = dtype_of(b.dtype());
        throw Fault{pb::SCHEMA_MISMATCH, "boundary dtype " + (d ? std::string(d->name) : std::to_string(int(b.dtype()))) +
                                             " != schema dtype " + set_.dtype->name};
    }
    const uint64_t values = uint64_t(n) * uint64_t(set_.n_streams) * uint64_t(set_.n_embd);
    const uint64_t need = nbytes(*set_.dtype, values);
    if (b.data().size() != need) {
        throw Fault{pb::BAD_FRAME, "boundary of shape " + list_str(got_shape) + " in " + set_.dtype->name + " needs " +
                                       std::to_string(need) + " bytes, got " + std::to_string(b.data().size())};
    }
    x->resize(values);
    const char * src = b.data().data();
    switch (set_.dtype->code) {
        case pb::F32: std::memcpy(x->data(), src, values * 4); break;
        case pb::F16: {
            std::vector<uint16_t> h(values);
            std::memcpy(h.data(), src, values * 2);
            engine_.lib().fp16_to_fp32(h.data(), x->data(), int64_t(values));
            break;
        }
        case pb::BF16: {
            std::vector<uint16_t> h(values);
            std::memcpy(h.data(), src, values * 2);
            engine_.lib().bf16_to_fp32(h.data(), x->data(), int64_t(values));
            break;
        }
        case pb::Q8_0: engine_.lib().dequantize_q8_0(src, x->data(), int64_t(values)); break;
        default: throw Fault{pb::BAD_FRAME, "unknown boundary dtype"};
    }
}

}  // namespace dgr
