// dgr-worker's data path (issue 21 phase 2, docs/worker.md): the Frames stream, the step queue and the
// one engine thread, the ring relay over one outgoing stream per peer, sampling on the last stage and
// generation control at the origin.
//
// It took over the retired Python worker's behaviour part for part (a route of dgr-workers generates the
// tokens and bit-identical logits of the whole model: tests/test_worker_cpp_frames.py). The parts: Frames,
// on_frame and check_step (a frame in); enqueue, take_batch and run_batch (the step queue and the engine
// thread); Link, emit_boundary, emit_last and send (the ring relay); deliver_to_client, next_step and
// send_token (the origin); start_speculation and the drafts (drafts.cpp; the client's dgr.wire.drafts is
// its twin for a client's own drafts).
// The draw is the engine library's dgr_sample (worker/engine/dgr_sample.cpp, the one sampler); wire dtypes
// use ggml's own converters from the same library. Speculation (phase 4): the origin drafts, every stage
// runs the k+1 positions and drops rejected drafts on the next step (rollback, dgr_session_truncate), the
// last stage verifies (tests/test_worker_cpp_speculate.py).
//
// Threads: gRPC's sync server gives each incoming Frames call a thread, which writes its reply queue;
// a reader thread per call checks and queues the frames it reads. One engine thread runs every forward
// (and the origin's detokenizing after it). Each Link has a writer and a reader thread. No exception
// leaves any of them.
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <csignal>
#include <cstring>
#include <stdexcept>

#include <unistd.h>

#include "worker.h"

namespace dgr {

namespace pb = dgr::v1;
using Clock = std::chrono::steady_clock;

namespace {

constexpr int LINK_KEEPALIVE_MS = 1000;   // each link pings its peer every second (docs/wire.md "Liveness of links")
constexpr uint64_t PER_TOKEN_IDS = 10;    // dgr.wire.codec.PER_TOKEN_IDS

int64_t mono_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count();
}

int64_t wall_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// The context error's text, word for word (tests/test_worker_cpp_frames.py writes it out too)
std::string context_full(int64_t position, int64_t n_ctx) {
    return "the session reached the context limit: position " + std::to_string(position) + " is beyond the " +
           std::to_string(n_ctx) + " positions (0.." + std::to_string(n_ctx - 1) +
           ") a session may hold on this worker; start the workers with a larger `dgr worker serve --n-ctx N` "
           "(every stage of the route), or use a shorter prompt or fewer tokens";
}

template <typename T> std::string list_str(const T & xs) {
    std::string out = "[";
    bool first = true;
    for (auto x : xs) {
        out += (first ? "" : ", ") + std::to_string(x);
        first = false;
    }
    return out + "]";
}

// dgr.wire.codec.tokens_per_frame (at least one: the worker refuses a wire dtype that does not fit at start)
uint64_t tokens_per_frame(uint64_t max_message_bytes, uint64_t bytes_per_token) {
    uint64_t per = bytes_per_token + PER_TOKEN_IDS;
    return max_message_bytes > FRAME_OVERHEAD + per ? (max_message_bytes - FRAME_OVERHEAD) / per : 1;
}

// Python's len(str): code points of valid UTF-8
size_t code_points(const std::string & s) {
    size_t n = 0;
    for (unsigned char c : s) n += (c & 0xC0) != 0x80;
    return n;
}

// the byte offset of code point `n` of valid UTF-8 (its size when shorter)
size_t byte_offset(const std::string & s, size_t n) {
    size_t i = 0;
    for (; i < s.size(); ++i) {
        if ((static_cast<unsigned char>(s[i]) & 0xC0) != 0x80) {
            if (n == 0) return i;
            --n;
        }
    }
    return s.size();
}

const char * body_name(pb::Frame::BodyCase c) {
    switch (c) {
        case pb::Frame::kStep: return "'step'";
        case pb::Frame::kGenerate: return "'generate'";
        case pb::Frame::kToken: return "'token'";
        case pb::Frame::kLogits: return "'logits'";
        case pb::Frame::kError: return "'error'";
        default: return "None";
    }
}

}  // namespace

// ---------------------------------------------------------------------------------------- FrameQueue

bool FrameQueue::put(pb::Frame f) {
    const int64_t size = int64_t(f.ByteSizeLong());
    std::lock_guard<std::mutex> g(mu);
    if (end || drain) return false;                  // its stream is over: nobody would write it
    if (cap > 0 && bytes + size > cap && !q.empty()) {
        failed = "its reader fell " + std::to_string(bytes + size) + " bytes behind (--max-send-queue-bytes " +
                 std::to_string(cap) + ")";
        drain = true;
        if (ctx) ctx->TryCancel();
        cv.notify_all();
        return false;
    }
    bytes += size;
    q.push_back(std::move(f));
    cv.notify_all();
    return true;
}

void FrameQueue::finish(bool draining) {
    std::lock_guard<std::mutex> g(mu);
    (draining ? drain : end) = true;
    cv.notify_all();
}

void FrameQueue::fail(const std::string & why) {
    std::lock_guard<std::mutex> g(mu);
    if (failed.empty()) failed = why;
    drain = true;
    if (ctx) ctx->TryCancel();
    cv.notify_all();
}

FrameQueue::Pop FrameQueue::pop(pb::Frame * out) {
    std::unique_lock<std::mutex> l(mu);
    cv.wait(l, [&] { return drain || end || !q.empty(); });
    if (drain) return DRAIN;
    if (!q.empty()) {
        *out = std::move(q.front());
        q.pop_front();
        bytes = q.empty() ? 0 : std::max<int64_t>(0, bytes - int64_t(out->ByteSizeLong()));
        writing_since = mono_ns();                   // the caller writes it now (the send deadline)
        return FRAME;
    }
    return END;
}

// ---------------------------------------------------------------------------------------------- Link

Link::Link(StageWorker * w, std::string address_, std::string label_, uint64_t max_message_bytes)
    : address(std::move(address_)), label(std::move(label_)), w_(w) {
    grpc::ChannelArguments args;                     // keepalive: docs/wire.md "Liveness of links"
    int limit = int(max_message_bytes + FRAME_OVERHEAD);
    args.SetMaxSendMessageSize(limit);
    args.SetMaxReceiveMessageSize(limit);
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 200);
    args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 200);
    args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 2000);
    args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, LINK_KEEPALIVE_MS);
    args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, int(w->limits_.link_keepalive_timeout_s * 1000));
    args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
    args.SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
    stub_ = pb::Stage::NewStub(grpc::CreateCustomChannel(address, w->channel_credentials(), args));
    stub_->async()->Frames(&ctx_, this);
    StartRead(&in_);
    StartCall();
}

Link::~Link() { close(); }

bool Link::send(pb::Frame & f) {
    const int64_t size = int64_t(f.ByteSizeLong());
    {
        std::lock_guard<std::mutex> g(mu_);
        if (broken_ || closing_) return false;
        const int64_t cap = w_->limits_.max_send_queue_bytes;
        if (cap > 0 && bytes_ + size > cap && in_flight_) {
            // the peer stopped reading: fail the link (its sessions hear HOP_UNREACHABLE), never block the engine
            cancel_locked("it fell " + std::to_string(bytes_ + size) + " bytes behind (--max-send-queue-bytes " +
                          std::to_string(cap) + ")");
            return false;
        }
        sessions_.emplace(f.session_id(), f.epoch());
        if (in_flight_) {                            // behind the write in flight: OnWriteDone starts it
            bytes_ += size;
            q_.push_back(std::move(f));
            return true;
        }
        in_flight_ = true;
        writing_ = std::move(f);
        writing_since_ = mono_ns();
    }
    StartWrite(&writing_);                           // this thread starts it: no writer thread to wake
    return true;
}

void Link::OnWriteDone(bool ok) {
    {
        std::lock_guard<std::mutex> g(mu_);
        writing_since_ = 0;
        if (!ok || broken_ || closing_ || q_.empty()) {
            in_flight_ = false;
            if (!ok) broken_ = true;                 // the stream is over: OnDone says why
            return;
        }
        writing_ = std::move(q_.front());
        q_.pop_front();
        bytes_ = q_.empty() ? 0 : std::max<int64_t>(0, bytes_ - int64_t(writing_.ByteSizeLong()));
        writing_since_ = mono_ns();
    }
    StartWrite(&writing_);
}

void Link::OnReadDone(bool ok) {
    if (!ok) {                                       // the peer ended the stream: OnDone follows
        std::lock_guard<std::mutex> g(mu_);
        broken_ = true;
        return;
    }
    try {
        w_->on_link_reply(std::move(in_));           // the peer's answers: errors about frames sent
    } catch (const std::exception & e) {
        fprintf(stderr, "dgr-worker: link to %s: %s\n", address.c_str(), e.what());
    } catch (...) {
    }
    in_.Clear();
    StartRead(&in_);
}

void Link::OnDone(const grpc::Status & st) {
    std::string why = st.ok() ? "closed the stream" : status_name(st.error_code()) + ": " + st.error_message();
    std::set<std::pair<std::string, uint64_t>> lost;
    bool closing;
    {
        std::lock_guard<std::mutex> g(mu_);
        broken_ = true;
        if (!failed_.empty()) why = "this worker failed the link: " + failed_;
        lost.swap(sessions_);
        closing = closing_;
        q_.clear();
        bytes_ = 0;
    }
    if (!closing) {
        try {
            w_->on_link_broken(this, why, lost);
        } catch (const std::exception & e) {
            fprintf(stderr, "dgr-worker: link to %s broke: %s\n", address.c_str(), e.what());
        } catch (...) {
        }
    }
    std::lock_guard<std::mutex> g(mu_);              // last: close() may destroy this link once it sees done_
    done_ = true;
    done_cv_.notify_all();
}

void Link::cancel_locked(const std::string & why) {
    if (failed_.empty()) failed_ = why;
    broken_ = true;
    ctx_.TryCancel();
}

void Link::check_stall(int64_t now_ns, int64_t timeout_ns) {
    std::lock_guard<std::mutex> g(mu_);
    if (broken_ || closing_ || !writing_since_ || now_ns - writing_since_ <= timeout_ns) return;
    cancel_locked("it did not take a frame for " + std::to_string(timeout_ns / 1000000) + " ms (--send-timeout)");
}

void Link::fail(const std::string & why) {
    std::lock_guard<std::mutex> g(mu_);
    if (broken_ || closing_) return;
    cancel_locked(why);
}

void Link::close() {
    std::unique_lock<std::mutex> l(mu_);
    if (!closing_) {
        closing_ = true;
        ctx_.TryCancel();
    }
    done_cv_.wait(l, [&] { return done_; });
}

// ------------------------------------------------------------------------------------ incoming frames

StageWorker::SessionPtr StageWorker::session(const Key & key) {
    std::lock_guard<std::mutex> g(mu_);
    auto it = sessions_.find(key);
    return it == sessions_.end() ? nullptr : it->second;
}

void StageWorker::reply_error(const ReplyPtr & reply, const pb::Frame & frame, pb::WireError e) {
    if (!reply) return;
    pb::Frame f;
    f.set_session_id(frame.session_id());
    f.set_epoch(frame.epoch());
    *f.mutable_error() = std::move(e);
    reply->put(std::move(f));
}

// --max-connections: every call of the Stage service holds its connection's slot while it runs
struct Admit {
    StageWorker * w;
    std::string peer, why;
    Admit(StageWorker * w_, const grpc::ServerContext * ctx) : w(w_) {
        why = w->admit(ctx);
        if (why.empty() && ctx) peer = ctx->peer();
    }
    ~Admit() {
        if (why.empty()) w->release(peer);
    }
};

std::string StageWorker::admit(const grpc::ServerContext * ctx) {
    if (!ctx) return "";
    const std::string peer = ctx->peer();
    std::lock_guard<std::mutex> g(mu_);
    auto it = conns_.find(peer);
    if (it == conns_.end() && int64_t(conns_.size()) >= limits_.max_connections) {
        ++overloaded_;
        return hop() + ": " + std::to_string(conns_.size()) + " connections have calls in progress (--max-connections " +
               std::to_string(limits_.max_connections) + "): retry later or use another replica";
    }
    ++conns_[peer];
    return "";
}

void StageWorker::release(const std::string & peer) {
    std::lock_guard<std::mutex> g(mu_);
    auto it = conns_.find(peer);
    if (it != conns_.end() && --it->second <= 0) conns_.erase(it);
}

void StageWorker::check_stalls() {
    const int64_t timeout = int64_t(limits_.send_timeout_s * 1e9);
    if (timeout <= 0) return;
    const int64_t now = mono_ns();
    std::vector<ReplyPtr> streams;
    std::vector<std::shared_ptr<Link>> links;
    {
        std::lock_guard<std::mutex> g(mu_);
        streams.assign(streams_.begin(), streams_.end());
        for (auto & kv : out_links_) links.push_back(kv.second);
    }
    for (auto & q : streams) {
        bool stalled;
        {
            std::lock_guard<std::mutex> g(q->mu);
            stalled = q->writing_since && now - q->writing_since > timeout;
        }
        if (stalled) q->fail("its reader did not take a frame for " + std::to_string(timeout / 1000000) + " ms (--send-timeout)");
    }
    for (auto & l : links) l->check_stall(now, timeout);
}

grpc::Status StageWorker::Frames(grpc::ServerContext * ctx, grpc::ServerReaderWriter<pb::Frame, pb::Frame> * stream) {
    Admit admitted(this, ctx);
    if (!admitted.why.empty()) return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, admitted.why);
    auto out = std::make_shared<FrameQueue>();
    out->cap = limits_.max_send_queue_bytes;
    out->ctx = ctx;
    {
        std::lock_guard<std::mutex> g(mu_);
        if (stopping_) return grpc::Status(grpc::StatusCode::UNAVAILABLE, hop() + " is shutting down");
        streams_.insert(out);
    }
    const std::optional<std::string> peer = trust_.mutual ? peer_identity(ctx) : std::nullopt;
    grpc::Status status = grpc::Status::OK;
    std::thread reader;
    try {
        reader = std::thread([&] {
            try {
                pb::Frame f;
                while (stream->Read(&f)) {
                    on_frame(std::move(f), out, &peer);
                    f.Clear();
                }
            } catch (const std::exception & e) {  // never let one stream take the worker down
                fprintf(stderr, "dgr-worker: frame stream failed: %s\n", e.what());
            } catch (...) {
                fprintf(stderr, "dgr-worker: frame stream failed (unknown exception)\n");
            }
            out->finish(false);
        });
        while (true) {
            pb::Frame f;
            FrameQueue::Pop what = out->pop(&f);
            if (what == FrameQueue::END) break;
            if (what == FrameQueue::DRAIN) {
                std::string failed;
                {
                    std::lock_guard<std::mutex> g(out->mu);
                    failed = out->failed;
                }
                if (!failed.empty()) {
                    fprintf(stderr, "dgr-worker: failed a Frames stream from %s: %s; its sessions are closed\n",
                            ctx->peer().c_str(), failed.c_str());
                    status = grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                                          hop() + " failed this stream: " + failed + "; its sessions are closed: read the "
                                                  "stream's frames as they come, then open the session again");
                } else {
                    status = grpc::Status(grpc::StatusCode::UNAVAILABLE, hop() + " is shutting down (SIGTERM): its sessions "
                                                                                 "are closed; use another replica");
                }
                ctx->TryCancel();
                break;
            }
            bool ok = stream->Write(f);
            {
                std::lock_guard<std::mutex> g(out->mu);
                out->writing_since = 0;
            }
            if (!ok) {                               // the caller went away (or the send deadline cancelled it)
                ctx->TryCancel();
                break;
            }
        }
    } catch (const std::exception & e) {
        status = grpc::Status(grpc::StatusCode::INTERNAL, std::string("Frames failed: ") + e.what());
        ctx->TryCancel();
    } catch (...) {
        status = grpc::Status(grpc::StatusCode::INTERNAL, "Frames failed (unknown exception)");
        ctx->TryCancel();
    }
    if (reader.joinable()) reader.join();
    {
        std::lock_guard<std::mutex> g(out->mu);
        out->ctx = nullptr;
        if (status.ok() && !out->failed.empty()) {
            fprintf(stderr, "dgr-worker: failed a Frames stream: %s; its sessions are closed\n", out->failed.c_str());
        }
        out->drain = true;                           // nothing more is queued for it
        out->q.clear();
    }
    {
        std::lock_guard<std::mutex> g(mu_);
        streams_.erase(out);
    }
    try {
        client_gone(out);
    } catch (...) {
    }
    return status;
}

// mTLS (docs/worker.md "Peer checks under mutual TLS"): a session's frames come only from the peer that opened it here;
// tokens back into the origin only from its last hop, errors from a hop of its route
void StageWorker::check_sender(const char * kind, const SessionPtr & sess, const std::optional<std::string> * peer,
                               const std::string & sid) {
    if (!trust_.mutual || !peer || !sess) return;
    std::set<std::string> want;
    std::string what;
    const std::string k = kind;
    {
        std::lock_guard<std::mutex> g(mu_);
        if (k == "token" || k == "logits") {
            if (!sess->returner.empty()) want.insert(sess->returner);
            what = "the route's last hop";
        } else if (k == "error") {
            want = sess->route_members;
            what = "a hop of the route";
        } else {
            if (sess->opener) want.insert(*sess->opener);
            what = std::string("the peer that opened it at this stage (") +
                   (info_.is_first ? "the client" : "stage " + std::to_string(id_.stage_index - 1)) + ")";
        }
    }
    if (want.empty() || (peer->has_value() && want.count(**peer))) return;
    std::string names;
    for (auto & n : want) names += (names.empty() ? "" : " or ") + n;
    throw Fault{pb::WRONG_STAGE, k + " frames of session " + sid + " are accepted here only from " +
                                     what + ", member " + names + "; this stream comes from member " +
                                     (peer->has_value() ? **peer : std::string("(no certificate name)"))};
}

std::string StageWorker::refuse_owner(const std::string & sid, uint64_t epoch, const grpc::ServerContext * ctx) {
    if (!trust_.mutual || !ctx) return "";
    const std::optional<std::string> peer = peer_identity(ctx);
    std::lock_guard<std::mutex> g(mu_);
    auto it = sessions_.find(Key{sid, epoch});
    if (it == sessions_.end() || !it->second->opener || (peer && *peer == *it->second->opener)) return "";
    return "session " + sid + " epoch " + std::to_string(epoch) + " was opened here by member " + *it->second->opener +
           "; only it may close it, and this call comes from member " + (peer ? *peer : std::string("(no certificate name)"));
}

void StageWorker::on_frame(pb::Frame frame, const ReplyPtr & reply, const std::optional<std::string> * peer) {
    const auto kind = frame.body_case();
    const int64_t sent = int64_t(frame.sent_unix_ns());
    const uint64_t transit = sent ? uint64_t(std::max<int64_t>(0, wall_ns() - sent)) : 0;
    const Key key{frame.session_id(), frame.epoch()};
    SessionPtr sess = session(key);
    if (kind == pb::Frame::kToken || kind == pb::Frame::kLogits || kind == pb::Frame::kError) {
        try {
            check_sender(kind == pb::Frame::kToken ? "token" : kind == pb::Frame::kLogits ? "logits" : "error", sess, peer, frame.session_id());
        } catch (Fault & f) {
            fprintf(stderr, "dgr-worker: refused a frame: %s\n", f.message.c_str());
            if (kind != pb::Frame::kError) reply_error(reply, frame, err(f.code, f.message));
            return;
        }
        if (kind == pb::Frame::kToken) {
            frame.mutable_token()->set_return_ns(transit);
            if (transit) {
                std::lock_guard<std::mutex> g(metrics_.mu);
                metrics_.transit_token.observe(double(transit) / 1e9);
            }
        }
        deliver_to_client(std::move(frame));         // returns into the origin
        return;
    }
    std::vector<float> x;
    try {
        if (!sess) {
            uint64_t latest = 0;
            bool known;
            {
                std::lock_guard<std::mutex> g(mu_);
                auto it = latest_epoch_.find(frame.session_id());
                known = it != latest_epoch_.end();
                if (known) latest = it->second;
            }
            if (known && latest > frame.epoch()) {
                throw Fault{pb::STALE_EPOCH, "session " + frame.session_id() + " epoch " + std::to_string(frame.epoch()) +
                                                 " was replaced by epoch " + std::to_string(latest)};
            }
            throw Fault{pb::UNKNOWN_SESSION, "no open session " + frame.session_id() + " epoch " +
                                                 std::to_string(frame.epoch()) + ": open it (OpenSession) first"};
        }
        try {
            check_sender(kind == pb::Frame::kGenerate ? "generate" : kind == pb::Frame::kStep ? "step" : "other", sess, peer, frame.session_id());
        } catch (Fault & f) {
            fprintf(stderr, "dgr-worker: refused a frame: %s\n", f.message.c_str());
            throw;
        }
        if (kind == pb::Frame::kGenerate) {
            if (!info_.is_first) throw Fault{pb::BAD_FRAME, "generate frames go to stage 0 only"};
            const auto & g = frame.generate();
            {
                std::lock_guard<std::mutex> l(mu_);
                sess->client = reply;
                sess->max_new = g.max_new_tokens();
                sess->stop_ids = std::set<int32_t>(g.stop_token_ids().begin(), g.stop_token_ids().end());
                sess->context_ids.assign(g.context_ids().begin(), g.context_ids().end());
                sess->history.assign(g.cached_ids().begin(), g.cached_ids().end());   // then the steps' tokens
                sess->text = g.context_text();
                sess->last_used = Clock::now();
            }
            start_speculation(sess, g);
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
    if (info_.is_first) {
        {
            std::lock_guard<std::mutex> g(mu_);
            if (!sess->client) sess->client = reply;
            const auto & ids = frame.step().token_ids();
            sess->history.insert(sess->history.end(), ids.begin(), ids.end());   // what draft sources look up
        }
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
void StageWorker::check_step(const pb::Step & step, std::vector<float> * x) {
    const int64_t n = step.positions_size();
    if (n == 0) throw Fault{pb::BAD_FRAME, "a step needs at least one position"};
    const int64_t p0 = step.positions(0);
    for (int64_t k = 0; k < n; ++k) {
        if (int64_t(step.positions(int(k))) != p0 + k) throw Fault{pb::BAD_FRAME, "positions must be contiguous and increasing"};
    }
    if (int64_t(step.cache_expect()) != p0) {
        throw Fault{pb::BAD_FRAME, "cache_expect " + std::to_string(step.cache_expect()) + " != first position " + std::to_string(p0)};
    }
    if (p0 + n > info_.n_ctx) throw Fault{pb::ENGINE, context_full(p0 + n - 1, info_.n_ctx)};
    if (step.drafts() && (int64_t(step.drafts()) >= n || !step.sample())) {
        throw Fault{pb::BAD_FRAME, "a speculative step carries its last token and then " + std::to_string(step.drafts()) +
                                       " drafts (" + std::to_string(step.drafts() + 1) + " positions, sampled), got " +
                                       std::to_string(n) + " positions"};
    }
    if (step.drafts() && step.token_ids_size() != n) {       // the last stage verifies the drafted ids
        throw Fault{pb::BAD_FRAME, "a speculative step carries one token id per position (" + std::to_string(n) + "), got " +
                                       std::to_string(step.token_ids_size())};
    }
    if (info_.is_first) {
        if (step.drafts() || step.rollback()) {
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
    const pb::BoundarySchema & want = schema_in_;
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
                                         std::to_string(info_.layer_begin) + ", " + std::to_string(info_.layer_end) + ")"};
    }
    if (info_.needs_token_ids && step.token_ids_size() != n) {
        throw Fault{pb::SCHEMA_MISMATCH, "this stage owns token-id layers and needs the token-id sideband (" + std::to_string(n) +
                                             " ids), got " + std::to_string(step.token_ids_size())};
    }
    const auto & b = step.boundary();
    std::vector<int64_t> shape = {n, info_.n_streams, info_.n_embd};
    std::vector<int64_t> got_shape(b.shape().begin(), b.shape().end());
    if (got_shape != shape) {
        throw Fault{pb::BAD_FRAME, "boundary shape " + list_str(got_shape) + " != " + list_str(shape) + " [n_tokens, n_streams, n_embd]"};
    }
    if (b.dtype() != want.dtype()) {
        const WireDtype * d = dtype_of(b.dtype());
        throw Fault{pb::SCHEMA_MISMATCH, "boundary dtype " + (d ? std::string(d->name) : std::to_string(int(b.dtype()))) +
                                             " != schema dtype " + dtype_->name};
    }
    const uint64_t values = uint64_t(n) * uint64_t(info_.n_streams) * uint64_t(info_.n_embd);
    const uint64_t need = nbytes(*dtype_, values);
    if (b.data().size() != need) {
        throw Fault{pb::BAD_FRAME, "boundary of shape " + list_str(got_shape) + " in " + dtype_->name + " needs " +
                                       std::to_string(need) + " bytes, got " + std::to_string(b.data().size())};
    }
    x->resize(values);
    const char * src = b.data().data();
    switch (dtype_->code) {
        case pb::F32: std::memcpy(x->data(), src, values * 4); break;
        case pb::F16: {
            std::vector<uint16_t> h(values);
            std::memcpy(h.data(), src, values * 2);
            lib_.fp16_to_fp32(h.data(), x->data(), int64_t(values));
            break;
        }
        case pb::BF16: {
            std::vector<uint16_t> h(values);
            std::memcpy(h.data(), src, values * 2);
            lib_.bf16_to_fp32(h.data(), x->data(), int64_t(values));
            break;
        }
        case pb::Q8_0: lib_.dequantize_q8_0(src, x->data(), int64_t(values)); break;
        default: throw Fault{pb::BAD_FRAME, "unknown boundary dtype"};
    }
}

// ------------------------------------------------------------------------- the queue and the engine

uint32_t StageWorker::retry_after_ms() {   // mu_ held
    return uint32_t(std::min(5000.0, std::max(50.0, batch_ms_ * double(1 + n_pending_))));
}

void StageWorker::enqueue(Work w, const SessionPtr & sess, bool own) {
    const Key key{w.frame.session_id(), w.frame.epoch()};
    std::string why;
    uint32_t retry = 0;
    {
        std::lock_guard<std::mutex> g(mu_);
        auto it = pending_.find(key);
        if (!own && n_pending_ >= limits_.max_queued_steps) {
            why = std::to_string(n_pending_) + " steps are queued (--max-queued-steps " + std::to_string(limits_.max_queued_steps) + ")";
        } else if (!own && it != pending_.end() && int64_t(it->second.size()) >= limits_.max_session_steps) {
            why = "session " + key.first + " has " + std::to_string(it->second.size()) + " steps queued (--max-session-steps " +
                  std::to_string(limits_.max_session_steps) + ")";
        }
        if (why.empty()) {
            sess->last_used = Clock::now();
            if (it == pending_.end()) {
                order_.push_back(key);
                it = pending_.emplace(key, std::deque<Work>()).first;
            }
            it->second.push_back(std::move(w));
            ++n_pending_;
            wake_.notify_all();
            return;
        }
        ++overloaded_;
        retry = retry_after_ms();
    }
    reply_error(w.reply, w.frame, err(pb::OVERLOADED, why + ": retry later", retry));
}

bool StageWorker::held_back() {   // mu_ held; --hold-batch (tests: force sharing)
    const int64_t hold = limits_.hold_batch;
    const int64_t need = int64_t(opened_total_) < hold ? hold : std::min<int64_t>(hold, int64_t(sessions_.size()));
    return hold > 0 && int64_t(pending_.size()) < need;
}

std::vector<StageWorker::Work> StageWorker::take_batch() {
    std::unique_lock<std::mutex> l(mu_);
    while (!threads_stopped_ && (!n_pending_ || held_back()) && jobs_.empty()) {
        wake_.wait_for(l, std::chrono::milliseconds(500));
    }
    std::vector<Work> batch;
    if (threads_stopped_ || held_back()) return batch;
    int64_t tokens = 0;
    std::deque<Key> kept, served;                    // round robin: served sessions go to the back
    for (auto & key : order_) {
        auto it = pending_.find(key);
        if (it == pending_.end() || it->second.empty()) continue;   // closed while queued
        const int64_t n = it->second.front().frame.step().positions_size();
        if (!batch.empty() && (tokens + n > limits_.max_batch_tokens || int64_t(batch.size()) >= limits_.max_batch_sessions)) {
            kept.push_back(key);
            continue;
        }
        batch.push_back(std::move(it->second.front()));
        it->second.pop_front();
        tokens += n;
        --n_pending_;
        if (it->second.empty()) pending_.erase(it);
        else served.push_back(key);
    }
    kept.insert(kept.end(), served.begin(), served.end());
    order_.swap(kept);
    return batch;
}

void StageWorker::engine_loop() {
    while (true) {
        try {
            {
                std::lock_guard<std::mutex> g(mu_);
                if (threads_stopped_) return;
            }
            std::vector<Work> batch = take_batch();
            if (!batch.empty()) {
                try {
                    run_batch(batch);
                } catch (const std::exception & e) {
                    fprintf(stderr, "dgr-worker: engine batch failed: %s\n", e.what());
                    for (auto & w : batch) reply_error(w.reply, w.frame, err(pb::INTERNAL, "the worker failed on this step; see its log"));
                }
            }
            while (true) {                           // deferred jobs: the origin's detokenizing
                std::function<void()> job;
                {
                    std::lock_guard<std::mutex> g(mu_);
                    if (jobs_.empty()) break;
                    job = std::move(jobs_.front());
                    jobs_.pop_front();
                }
                try {
                    job();
                } catch (const std::exception & e) {
                    fprintf(stderr, "dgr-worker: deferred job failed: %s\n", e.what());
                }
            }
        } catch (const std::exception & e) {
            fprintf(stderr, "dgr-worker: engine loop: %s\n", e.what());
        } catch (...) {
            fprintf(stderr, "dgr-worker: engine loop: unknown exception\n");
        }
    }
}

// --test-die-at (tests: a kill -9 at an exact step): about to run a step
// that holds a listed (session, epoch, position), the worker SIGKILLs itself, nothing flushed or closed.
void StageWorker::die_if_asked(size_t n, const std::function<const pb::Frame &(size_t)> & frame) {
    for (size_t k = 0; k < n; ++k) {
        const pb::Frame & f = frame(k);
        for (int64_t p : f.step().positions()) {
            if (limits_.die_at.count({f.session_id(), f.epoch(), p})) {
                fprintf(stderr, "dgr-worker: --test-die-at %s:%llu:%lld reached: SIGKILL\n", f.session_id().c_str(),
                        (unsigned long long)f.epoch(), (long long)p);
                fflush(stderr);
                kill(getpid(), SIGKILL);
            }
        }
    }
}

// --test-evict-at, --test-break-origin-link-at (tests: a fault at an exact step, which no timing can move)
void StageWorker::test_faults(const pb::Frame & f, const SessionPtr & sess) {
    const std::string & sid = f.session_id();
    for (int64_t p : f.step().positions()) {
        const auto at = std::make_tuple(sid, f.epoch(), p);
        if (limits_.evict_at.count(at)) {
            // the session's cache is lost (as under memory pressure): the session stays, its cache is empty
            fprintf(stderr, "dgr-worker: --test-evict-at %s:%llu:%lld reached: cache dropped\n", sid.c_str(),
                    (unsigned long long)f.epoch(), (long long)p);
            lib_.session_close(eng_, sid.c_str(), int64_t(f.epoch()));
            int32_t st = lib_.session_open(eng_, sid.c_str(), int64_t(f.epoch()));
            if (st != DGR_OK) fprintf(stderr, "dgr-worker: --test-evict-at: reopen failed: %s\n", lib_.error(st).c_str());
        }
        if (limits_.break_origin_link_at.count(at) && !info_.is_first) {
            std::shared_ptr<Link> l;
            {
                std::lock_guard<std::mutex> g(mu_);
                auto it = out_links_.find(sess->route[0].address());
                if (it != out_links_.end()) l = it->second;
            }
            fprintf(stderr, "dgr-worker: --test-break-origin-link-at %s:%llu:%lld reached: %s\n", sid.c_str(),
                    (unsigned long long)f.epoch(), (long long)p, l ? "link failed" : "no link to fail");
            if (l) l->fail("--test-break-origin-link-at");
        }
    }
}

void StageWorker::run_batch(std::vector<Work> & batch) {
    struct Ready {
        Work * w;
        SessionPtr sess;
        std::vector<float> out;
        dgr_step_out o{};
        bool ok = false;
    };
    const int64_t width = int64_t(info_.n_streams) * info_.n_embd;
    std::vector<Ready> ready;
    int64_t t0 = 0, compute = 0;
    {
        std::lock_guard<std::mutex> eg(engine_mu_);
        for (auto & w : batch) {
            const Key key{w.frame.session_id(), w.frame.epoch()};
            SessionPtr sess = session(key);
            if (!sess) continue;                     // closed while queued
            if (!limits_.evict_at.empty() || !limits_.break_origin_link_at.empty()) test_faults(w.frame, sess);
            int32_t held = 0;
            int32_t st = lib_.n_cached(eng_, key.first.c_str(), int64_t(key.second), &held);
            if (st != DGR_OK) {
                reply_error(w.reply, w.frame, err(pb::ENGINE, lib_.error(st)));
                continue;
            }
            const pb::Step & s = w.frame.step();
            const uint64_t expect = s.cache_expect();
            int64_t floor;
            {
                std::lock_guard<std::mutex> g(mu_);
                floor = sess->spec_floor;
            }
            // a step flagged rollback drops the drafts the last stage rejected, never below the first draft
            // of the session's last speculative step here
            if (uint64_t(held) > expect && s.rollback() && floor >= 0 && int64_t(expect) >= floor) {
                st = lib_.truncate(eng_, key.first.c_str(), int64_t(key.second), int32_t(expect));
                if (st != DGR_OK) {
                    reply_error(w.reply, w.frame, err(pb::ENGINE, lib_.error(st)));
                    continue;
                }
                held = int32_t(expect);
            }
            if (uint64_t(held) != expect) {
                pb::WireError e = err(pb::CACHE_MISS, "session " + key.first + " epoch " + std::to_string(key.second) + " holds " +
                                                          std::to_string(held) + " positions here but the frame expects " +
                                                          std::to_string(expect) + ": re-prefill at a new epoch");
                e.set_held(uint64_t(held));
                e.set_expected(expect);
                reply_error(w.reply, w.frame, std::move(e));
                continue;
            }
            ready.push_back(Ready{&w, sess, {}, {}, false});
        }
        if (ready.empty()) return;
        if (!limits_.die_at.empty()) die_if_asked(ready.size(), [&](size_t k) -> const pb::Frame & { return ready[k].w->frame; });
        std::vector<dgr_step> steps(ready.size());
        for (size_t k = 0; k < ready.size(); ++k) {
            Ready & r = ready[k];
            const pb::Step & s = r.w->frame.step();
            const int32_t n = s.positions_size();
            int want = DGR_LOGITS_NONE;
            if (info_.is_last && (s.sample() || r.sess->logits == pb::LOGITS_ALL)) {
                // a speculative step is verified at every position: one row per draw
                want = r.sess->logits == pb::LOGITS_ALL || s.drafts() ? DGR_LOGITS_ALL : DGR_LOGITS_LAST;
            }
            dgr_step & d = steps[k];
            d.session_id = r.w->frame.session_id().c_str();
            d.epoch = int64_t(r.w->frame.epoch());
            d.n_tokens = n;
            d.positions = s.positions().data();
            d.token_ids = s.token_ids_size() ? s.token_ids().data() : nullptr;
            d.boundary = r.w->x.empty() ? nullptr : r.w->x.data();
            d.boundary_width = r.w->x.empty() ? 0 : int32_t(width);
            d.want_logits = want;
            if (!info_.is_last) {
                r.out.resize(size_t(n) * size_t(width));
                r.o.boundary = r.out.data();
            } else if (want != DGR_LOGITS_NONE) {
                r.out.resize(size_t(want == DGR_LOGITS_ALL ? n : 1) * size_t(info_.n_vocab));
                r.o.logits = r.out.data();
            }
        }
        auto fail = [&](Ready & r, int32_t st, const std::string & why) {
            pb::WireError e;
            if (st == DGR_E_CACHE_MISS) {
                int64_t held = 0, expected = 0;
                lib_.last_cache_miss(&held, &expected);
                e = err(pb::CACHE_MISS, why);
                e.set_held(uint64_t(held));
                e.set_expected(uint64_t(expected));
            } else {
                e = err(st == DGR_E_SCHEMA ? pb::SCHEMA_MISMATCH : pb::ENGINE, why);
            }
            reply_error(r.w->reply, r.w->frame, std::move(e));
        };
        t0 = mono_ns();
        std::vector<dgr_step_out> outs(ready.size());
        for (size_t k = 0; k < ready.size(); ++k) outs[k] = ready[k].o;
        int32_t st = lib_.forward(eng_, int32_t(steps.size()), steps.data(), outs.data());
        metrics_.forward(steps.size());
        if (st == DGR_OK) {
            for (size_t k = 0; k < ready.size(); ++k) {
                ready[k].o = outs[k];
                ready[k].ok = true;
            }
        } else if (ready.size() == 1) {
            fail(ready[0], st, lib_.error(st));
        } else {
            // one session's fault never fails the others: run the steps one by one (the failed batch ran none)
            fprintf(stderr, "dgr-worker: batch of %zu failed (%s); running its steps one by one\n", ready.size(), lib_.error(st).c_str());
            for (size_t k = 0; k < ready.size(); ++k) {
                dgr_step_out o = ready[k].o;
                int32_t s1 = lib_.forward(eng_, 1, &steps[k], &o);
                if (s1 == DGR_OK) {
                    ready[k].o = o;
                    ready[k].ok = true;
                } else {
                    fail(ready[k], s1, lib_.error(s1));
                }
            }
        }
        compute = mono_ns() - t0;
    }
    auto now = Clock::now();
    {
        std::lock_guard<std::mutex> g(mu_);
        batch_ms_ = 0.8 * batch_ms_ + 0.2 * double(compute) / 1e6;
        for (auto & r : ready) {
            r.sess->last_used = now;
            if (!r.ok) continue;
            r.sess->held = uint64_t(std::max(0, r.o.n_cached));
            const pb::Step & s = r.w->frame.step();
            r.sess->spec_floor = s.drafts() ? int64_t(s.positions(0)) + 1 : -1;   // where a rollback may start
        }
    }
    for (auto & r : ready) {
        if (!r.ok) continue;
        pb::HopTiming timing;
        timing.set_stage_index(uint32_t(id_.stage_index));
        timing.set_queue_ns(uint64_t(std::max<int64_t>(0, t0 - r.w->t_recv)));
        timing.set_transit_ns(r.w->transit_ns);
        timing.set_compute_ns(uint64_t(compute));
        metrics_.step(r.w->frame.step().positions_size(), int64_t(timing.queue_ns()), compute);
        if (info_.is_last) emit_last(*r.w, r.sess, r.o.logits, r.o.n_logit_rows, timing);
        else emit_boundary(*r.w, r.sess, r.out.data(), timing);
    }
}

// ------------------------------------------------------------------------------------- outgoing

void StageWorker::encode(const float * x, int64_t n_tokens, pb::Boundary * b) const {
    const int64_t values = n_tokens * int64_t(info_.n_streams) * info_.n_embd;
    b->set_dtype(dtype_->code);
    b->add_shape(uint32_t(n_tokens));
    b->add_shape(uint32_t(info_.n_streams));
    b->add_shape(uint32_t(info_.n_embd));
    std::string * data = b->mutable_data();
    data->resize(nbytes(*dtype_, uint64_t(values)));
    switch (dtype_->code) {
        case pb::F32: std::memcpy(&(*data)[0], x, size_t(values) * 4); break;
        case pb::F16: {
            std::vector<uint16_t> h(static_cast<size_t>(values));
            lib_.fp32_to_fp16(x, h.data(), values);
            std::memcpy(&(*data)[0], h.data(), size_t(values) * 2);
            break;
        }
        case pb::BF16: {
            std::vector<uint16_t> h(static_cast<size_t>(values));
            lib_.fp32_to_bf16(x, h.data(), values);
            std::memcpy(&(*data)[0], h.data(), size_t(values) * 2);
            break;
        }
        case pb::Q8_0: lib_.quantize_q8_0(x, &(*data)[0], values); break;
        default: throw std::runtime_error("cannot encode wire dtype " + std::string(dtype_->name));
    }
}

void StageWorker::emit_boundary(Work & w, const SessionPtr & sess, const float * boundary, pb::HopTiming timing) {
    const int64_t t0 = mono_ns();
    const pb::Step & s = w.frame.step();
    const pb::Hop & nxt = sess->route[sess->hop_index + 1];
    const pb::BoundarySchema & schema = schema_out_;
    const int64_t width = int64_t(info_.n_streams) * info_.n_embd;
    const int64_t per = int64_t(tokens_per_frame(max_message_bytes_, seam_bytes_per_token_));
    const int64_t n = s.positions_size();
    std::vector<pb::Frame> frames;
    for (int64_t lo = 0; lo < n; lo += per) {
        const int64_t hi = std::min(n, lo + per);
        pb::Frame f;
        f.set_session_id(w.frame.session_id());
        f.set_epoch(w.frame.epoch());
        pb::Step * step = f.mutable_step();
        for (int64_t k = lo; k < hi; ++k) step->add_positions(s.positions(int(k)));
        for (int64_t k = lo; k < hi && k < s.token_ids_size(); ++k) step->add_token_ids(s.token_ids(int(k)));
        encode(boundary + lo * width, hi - lo, step->mutable_boundary());
        {
            std::lock_guard<std::mutex> g(metrics_.mu);
            metrics_.seam_out += step->boundary().data().size();
        }
        *step->mutable_schema() = schema;
        step->set_cache_expect(uint64_t(s.positions(int(lo))));
        step->set_sample(s.sample() && hi == n);
        step->set_drafts(hi == n ? s.drafts() : 0);
        step->set_rollback(s.rollback() && lo == 0);
        f.set_origin_sent_ns(w.frame.origin_sent_ns());
        *f.mutable_timings() = w.frame.timings();
        frames.push_back(std::move(f));
    }
    timing.set_wire_ns(uint64_t(mono_ns() - t0));
    for (auto & f : frames) {
        *f.add_timings() = timing;
        send(nxt.address(), sess->hop_index + 1, std::move(f), sess);
    }
}

void StageWorker::emit_last(Work & w, const SessionPtr & sess, const float * logits, int32_t rows, pb::HopTiming timing) {
    const int64_t t0 = mono_ns();
    const pb::Step & s = w.frame.step();
    const std::string origin = sess->route[0].address();
    const int64_t n = s.positions_size();
    const int64_t n_vocab = info_.n_vocab;
    std::vector<pb::Frame> frames;
    // The draws of a sampled step: at each of its last drafts+1 positions the token a
    // plain decode would draw there (greedy argmax, or the (seed, position)-keyed draw), while they match the
    // drafts; the first mismatch (or the position after the last draft) gives the next token.
    const int64_t k = s.drafts();
    std::vector<int32_t> draws;
    const float * vrows = nullptr;                   // the rows the draws came from
    if (s.sample()) {
        if (!logits || rows < k + 1) throw std::runtime_error("the engine returned too few logits rows to sample from");
        vrows = logits + int64_t(rows - (k + 1)) * n_vocab;
        const int64_t base = s.positions(int(n - k - 1));
        const pb::Sampling & sp = sess->sampling;
        for (int64_t j = 0; j <= k; ++j) {
            const float * row = vrows + j * n_vocab;
            if (sess->grammar) {                     // never with drafts (start_speculation refuses it): k == 0
                masked_.assign(row, row + n_vocab);
                const int32_t st = lib_.grammar_apply(sess->grammar.get(), masked_.data(), int32_t(n_vocab));
                if (st != DGR_OK) throw std::runtime_error(lib_.error(st));
                row = masked_.data();
            }
            const int32_t token = lib_.sample(row, int32_t(n_vocab), double(sp.temperature()), int32_t(sp.top_k()),
                                              double(sp.top_p()), sp.seed(), base + j);
            if (token < 0) throw std::runtime_error("dgr_sample refused the logits row");
            if (sess->grammar) {
                const int32_t st = lib_.grammar_accept(sess->grammar.get(), token);
                if (st != DGR_OK) throw std::runtime_error(lib_.error(st));
            }
            draws.push_back(token);
            if (j == k || token != s.token_ids(int(s.token_ids_size() - k + j))) break;
        }
    }
    if (!draws.empty()) {
        std::lock_guard<std::mutex> g(metrics_.mu);
        metrics_.sampled += draws.size();
    }
    if (sess->logits == pb::LOGITS_ALL && logits && rows > 0) {
        const int64_t per = std::max<int64_t>(1, int64_t(max_message_bytes_ - FRAME_OVERHEAD) / (n_vocab * 4 + 8));
        // positions computed from rejected drafts get no rows
        const int64_t valid = std::min<int64_t>(n, rows) - (s.sample() ? k + 1 - int64_t(draws.size()) : 0);
        for (int64_t lo = 0; lo < valid; lo += per) {
            const int64_t hi = std::min(valid, lo + per);
            pb::Frame f;
            f.set_session_id(w.frame.session_id());
            f.set_epoch(w.frame.epoch());
            pb::Logits * l = f.mutable_logits();
            for (int64_t k = lo; k < hi; ++k) l->add_positions(s.positions(int(k)));
            l->set_values(reinterpret_cast<const char *>(logits + lo * n_vocab), size_t((hi - lo) * n_vocab) * 4);
            frames.push_back(std::move(f));
        }
    }
    if (s.sample()) {
        const int32_t position = s.positions(int(n - k - 1)) + int32_t(draws.size()) - 1;
        pb::Frame f;
        f.set_session_id(w.frame.session_id());
        f.set_epoch(w.frame.epoch());
        pb::Token * t = f.mutable_token();
        t->set_token_id(draws.back());
        t->set_position(position);
        t->set_origin_sent_ns(w.frame.origin_sent_ns());
        for (size_t j = 0; j + 1 < draws.size(); ++j) t->add_accepted(draws[j]);
        t->set_drafted(uint32_t(k));
        if (sess->logits == pb::LOGITS_LAST) {
            t->set_logits(reinterpret_cast<const char *>(vrows), draws.size() * size_t(n_vocab) * 4);
        }
        const pb::Sampling & sp = sess->sampling;
        if (sp.logprobs() || sp.top_logprobs()) {   // the model's distribution: the raw rows, not the masked ones
            const int32_t top = int32_t(sp.top_logprobs());
            std::vector<int32_t> ids(size_t(std::max(top, 1)));
            std::vector<float> lps(ids.size());
            for (size_t j = 0; j < draws.size(); ++j) {
                float chosen = 0.0f;
                const int32_t n_top = lib_.logprobs(vrows + int64_t(j) * n_vocab, int32_t(n_vocab), draws[j], &chosen, top,
                                                    ids.data(), lps.data());
                if (n_top < 0) throw std::runtime_error("dgr_logprobs refused the logits row");
                pb::DrawLogprobs * d = t->add_logprobs();
                d->set_logprob(chosen);
                for (int32_t i = 0; i < n_top; ++i) {
                    pb::TokenLogprob * e = d->add_top();
                    e->set_token_id(ids[size_t(i)]);
                    e->set_logprob(lps[size_t(i)]);
                }
            }
        }
        f.set_origin_sent_ns(w.frame.origin_sent_ns());
        *f.mutable_timings() = w.frame.timings();
        frames.push_back(std::move(f));
    }
    timing.set_wire_ns(uint64_t(mono_ns() - t0));
    for (auto & f : frames) {
        if (f.has_token()) {
            *f.add_timings() = timing;
            *f.mutable_token()->mutable_timings() = f.timings();
        }
        send(origin, 0, std::move(f), sess);
    }
}

std::shared_ptr<Link> StageWorker::out_link(const std::string & address, uint32_t hop_index) {
    std::lock_guard<std::mutex> g(mu_);
    if (threads_stopped_) return nullptr;
    auto & l = out_links_[address];
    if (!l) l = std::make_shared<Link>(this, address, hop_name(hop_index, address), max_message_bytes_);
    return l;
}

void StageWorker::send(const std::string & address, uint32_t hop_index, pb::Frame frame, const SessionPtr & sess) {
    frame.set_sent_unix_ns(uint64_t(wall_ns()));
    const uint64_t size = frame.ByteSizeLong();
    if (size > max_message_bytes_) {                 // a bug if it happens: frames are sized below the limit
        pb::Frame e;
        e.set_session_id(frame.session_id());
        e.set_epoch(frame.epoch());
        *e.mutable_error() = err(pb::MESSAGE_TOO_LARGE, "a " + std::to_string(size) + "-byte frame would exceed the " +
                                                            std::to_string(max_message_bytes_) + "-byte limit");
        to_origin(sess, std::move(e));
        return;
    }
    bool self;
    {
        std::lock_guard<std::mutex> g(mu_);
        max_frame_bytes_sent_ = std::max(max_frame_bytes_sent_, size);
    }
    {
        std::lock_guard<std::mutex> g(addr_mu_);
        self = address == address_ && hop_index == 0 && info_.is_first;
    }
    if (self) {                                      // a one-stage route: the origin is this worker
        on_frame(std::move(frame), nullptr, nullptr);
        return;
    }
    for (int attempt = 0; attempt < 2; ++attempt) {
        std::shared_ptr<Link> l = out_link(address, hop_index);
        if (!l) return;                              // stopping
        if (l->send(frame)) return;
        // broken but not yet forgotten: forget it, the next try opens a new one
        std::lock_guard<std::mutex> g(mu_);
        auto it = out_links_.find(address);
        if (it != out_links_.end() && it->second == l) {
            dead_links_.push_back(l);
            out_links_.erase(it);
        }
    }
}

void StageWorker::to_origin(const SessionPtr & sess, pb::Frame frame) {
    if (info_.is_first) deliver_to_client(std::move(frame));
    else send(sess->route[0].address(), 0, std::move(frame), sess);
}

void StageWorker::on_link_reply(pb::Frame frame) {
    SessionPtr sess = session(Key{frame.session_id(), frame.epoch()});
    if (sess) to_origin(sess, std::move(frame));
}

void StageWorker::on_link_broken(Link * link, const std::string & why, const std::set<Key> & lost) {
    std::vector<std::pair<Key, SessionPtr>> sessions;
    {
        std::lock_guard<std::mutex> g(mu_);
        auto it = out_links_.find(link->address);
        if (it != out_links_.end() && it->second.get() == link) {   // never reused: the next frame opens a new one
            dead_links_.push_back(it->second);
            out_links_.erase(it);
        }
        for (auto & k : lost) {
            auto s = sessions_.find(k);
            if (s != sessions_.end()) sessions.emplace_back(k, s->second);
        }
    }
    const int keepalive = LINK_KEEPALIVE_MS + int(limits_.link_keepalive_timeout_s * 1000);
    for (auto & [key, sess] : sessions) {
        int idx = -1;
        for (size_t i = 0; i < sess->route.size(); ++i) {
            if (sess->route[i].address() == link->address) { idx = int(i); break; }
        }
        const std::string name = idx >= 0 ? hop_name(uint32_t(idx), link->address) : link->address;
        pb::Frame f;
        f.set_session_id(key.first);
        f.set_epoch(key.second);
        pb::WireError * e = f.mutable_error();
        e->set_code(pb::HOP_UNREACHABLE);
        e->set_hop(name);
        e->set_message(name + " is unreachable: " + hop() + " lost its stream to it (" + why + "); that worker died, stopped "
                       "answering (keepalive " + std::to_string(keepalive) + " ms) or shut down (a thin link carrying a long "
                       "prompt: raise --link-keepalive-timeout): use another replica or restart it");
        if (link->address != sess->route[0].address()) {
            count_error(pb::HOP_UNREACHABLE);
            to_origin(sess, std::move(f));
            continue;
        }
        bool tell;
        {
            std::lock_guard<std::mutex> g(mu_);
            tell = !sess->told_origin;
            sess->told_origin = true;
        }
        if (tell) {
            // the ring's token may be lost and a live origin would wait for it: say so on a new stream (once)
            count_error(pb::HOP_UNREACHABLE);
            e->set_hop(hop());
            e->set_message(hop() + " lost its stream back to the origin " + name + " (" + why +
                           "): the ring's last token may be lost; the session goes on in a new epoch");
            fprintf(stderr, "dgr-worker: stream to the origin broke for session %s: %s; telling the origin on a new stream\n",
                    f.session_id().c_str(), why.c_str());
            to_origin(sess, std::move(f));
        } else {
            fprintf(stderr, "dgr-worker: origin unreachable for session %s: %s\n", f.session_id().c_str(), e->message().c_str());
        }
    }
}

// ---------------------------------------------------------------------------------------- the origin

void StageWorker::deliver_to_client(pb::Frame frame) {
    SessionPtr sess = session(Key{frame.session_id(), frame.epoch()});
    if (!sess || !info_.is_first) return;
    ReplyPtr client;
    {
        std::lock_guard<std::mutex> g(mu_);
        client = sess->client;
    }
    if (!client) return;
    if (frame.has_error()) {
        // behind the tokens still being detokenized (jobs_, in order): an error never overtakes a token
        auto shared = std::make_shared<pb::Frame>(std::move(frame));
        std::lock_guard<std::mutex> g(mu_);
        sess->failed = true;
        jobs_.push_back([client, shared] { client->put(std::move(*shared)); });
        wake_.notify_all();
        return;
    }
    if (frame.has_logits()) {
        client->put(std::move(frame));
        return;
    }
    if (!frame.has_token()) return;
    pb::Token * tok = frame.mutable_token();
    if (tok->origin_sent_ns()) tok->set_ring_ns(uint64_t(mono_ns()) - tok->origin_sent_ns());
    // A speculative ring returns several draws: the accepted drafts, then token_id. Count them one by one;
    // a stop id or max_new_tokens among them ends the generation there (the rest are dropped).
    std::vector<int32_t> draws(tok->accepted().begin(), tok->accepted().end());
    draws.push_back(tok->token_id());
    const int64_t first = int64_t(tok->position()) - tok->accepted_size();
    bool next = false, full = false;
    size_t used = 0, n_ids;
    int64_t pos = 0;
    pb::Frame step;
    {
        std::lock_guard<std::mutex> g(mu_);
        if (sess->drafter && tok->drafted()) sess->drafter->observe(tok->drafted(), uint32_t(tok->accepted_size()));
        bool done = false;
        for (int32_t t : draws) {
            ++used;
            ++sess->produced;
            sess->context_ids.push_back(t);
            sess->history.push_back(t);
            if (sess->stop_ids.count(t) || sess->produced >= sess->max_new) break;
        }
        const int32_t last = draws[used - 1];
        done = sess->stop_ids.count(last) || sess->produced >= sess->max_new;
        tok->set_done(done);
        pos = first + int64_t(used);
        if (!done && !sess->failed) {
            if (pos >= info_.n_ctx) {
                sess->failed = true;
                full = true;
            } else {
                next = true;
                step = next_step(*sess, frame.session_id(), frame.epoch(), pos, last, tok->drafted() > 0);
            }
        } else {
            sess->done = true;
        }
        n_ids = sess->context_ids.size();
    }
    std::shared_ptr<pb::Frame> full_error;
    if (full) {                                      // sent after this ring's tokens (below)
        full_error = std::make_shared<pb::Frame>();
        full_error->set_session_id(frame.session_id());
        full_error->set_epoch(frame.epoch());
        *full_error->mutable_error() = err(pb::ENGINE, context_full(pos, info_.n_ctx));
    } else if (next) {
        // queue the next decode step first: the ring goes on while this token is detokenized and sent
        Work w;
        w.frame = std::move(step);
        w.reply = client;
        w.t_recv = mono_ns();
        enqueue(std::move(w), sess, true);
    }
    // What the client gets for the ring: a Token per draw (accepted drafts
    // marked speculated), the ring's own frame (timings, ring time) last; LOGITS_LAST rows split among them.
    std::vector<pb::Frame> out;
    const size_t width = tok->accepted_size() && !tok->logits().empty() ? tok->logits().size() / size_t(tok->accepted_size() + 1) : 0;
    for (size_t i = 0; i + 1 < used; ++i) {
        pb::Frame f;
        f.set_session_id(frame.session_id());
        f.set_epoch(frame.epoch());
        pb::Token * t = f.mutable_token();
        t->set_token_id(draws[i]);
        t->set_position(int32_t(first + int64_t(i)));
        t->set_speculated(true);
        if (width) t->set_logits(tok->logits().substr(i * width, width));
        if (int(i) < tok->logprobs_size()) *t->add_logprobs() = tok->logprobs(int(i));
        out.push_back(std::move(f));
    }
    tok->set_token_id(draws[used - 1]);
    tok->set_position(int32_t(first + int64_t(used) - 1));
    while (size_t(tok->accepted_size()) > used - 1) tok->mutable_accepted()->RemoveLast();
    if (width) tok->set_logits(tok->logits().substr((used - 1) * width, width));
    if (tok->logprobs_size() > 1 && int(used - 1) < tok->logprobs_size()) {   // this Token's own draw only
        pb::DrawLogprobs mine = tok->logprobs(int(used - 1));
        tok->clear_logprobs();
        *tok->add_logprobs() = std::move(mine);
    }
    out.push_back(std::move(frame));
    // detokenize on the engine thread once the next step's forward has started: text never delays the
    // ring, and the engine is never called from two threads
    const size_t n0 = n_ids - out.size();
    auto shared = std::make_shared<std::vector<pb::Frame>>(std::move(out));
    std::lock_guard<std::mutex> g(mu_);
    jobs_.push_back([this, sess, shared, n0, client, full_error] {
        for (size_t i = 0; i < shared->size(); ++i) send_token(sess, std::move((*shared)[i]), n0 + i + 1);
        if (full_error) client->put(std::move(*full_error));   // the context is full: after its last token
    });
    wake_.notify_all();
}

// The origin's next step: the last token at `pos`, plus what the session's draft source proposes (k+1
// positions, verified by the last stage in the same ring). `after_drafts`: the step answered was
// speculative, so stages may hold rejected positions >= pos to drop. mu_ held.
pb::Frame StageWorker::next_step(Session & s, const std::string & sid, uint64_t epoch, int64_t pos, int32_t token, bool after_drafts) {
    std::vector<int32_t> drafts;
    if (s.drafter) {
        const int64_t k = std::min<int64_t>({int64_t(s.draft_k), int64_t(s.max_new) - int64_t(s.produced) - 1,
                                             int64_t(info_.n_ctx) - 1 - pos});
        if (k > 0) {
            drafts = s.drafter->propose(s.history, k);
            if (int64_t(drafts.size()) > k) drafts.resize(size_t(k));
        }
    }
    pb::Frame f;
    f.set_session_id(sid);
    f.set_epoch(epoch);
    f.set_origin_sent_ns(uint64_t(mono_ns()));
    pb::Step * st = f.mutable_step();
    for (int64_t p = pos; p < pos + 1 + int64_t(drafts.size()); ++p) st->add_positions(int32_t(p));
    st->add_token_ids(token);
    for (int32_t d : drafts) st->add_token_ids(d);
    st->set_cache_expect(uint64_t(pos));
    st->set_sample(true);
    st->set_drafts(uint32_t(drafts.size()));
    st->set_rollback(after_drafts);
    return f;
}

// Starting speculation: a Generate that asks for drafts gets its session's draft source, if
// every hop of the route can roll back rejected drafts.
void StageWorker::start_speculation(const SessionPtr & sess, const pb::Generate & g) {
    if (g.draft_source().empty()) return;
    std::unique_ptr<DraftSource> drafter;
    uint32_t k;
    try {
        k = check_draft_k(g.draft_k() ? g.draft_k() : DEFAULT_DRAFT_K);
        drafter = make_draft_source(g.draft_source());
    } catch (const std::invalid_argument & e) {
        throw Fault{pb::BAD_FRAME, e.what()};
    }
    std::lock_guard<std::mutex> l(mu_);
    if (!sess->sampling.grammar().empty() || !sess->sampling.json_schema().empty()) {
        throw Fault{pb::ENGINE, "speculative decoding with a grammar (sampling.grammar or sampling.json_schema) is not "
                                "supported: generate without --speculate, or without the grammar"};
    }
    if (!sess->can_roll_back) {
        throw Fault{pb::ENGINE, "speculative decoding needs every stage to drop rejected drafts from its cache, and " +
                                    (sess->no_roll_back.empty() ? std::string("a hop of the route") : sess->no_roll_back) +
                                    " cannot (a recurrent or hybrid model keeps one running state, or the worker predates "
                                    "speculation): generate without --speculate"};
    }
    sess->drafter = std::move(drafter);
    sess->draft_k = uint32_t(std::min<uint64_t>(k, sess->spec_cap - 1));
}

void StageWorker::note_route(Session & s, const google::protobuf::RepeatedPtrField<pb::StageDescription> & hops) {
    std::string no;
    uint64_t cap = 0;
    for (int i = 0; i < hops.size(); ++i) {
        const pb::StageDescription & h = hops.Get(i);
        const size_t at = size_t(s.hop_index) + size_t(i);
        const std::string address = at < s.route.size() ? s.route[at].address() : std::string();
        if (!h.can_roll_back()) no += (no.empty() ? "" : ", ") + hop_name(h.identity().stage_index(), address);
        if (h.has_schema_out() && h.seam_bytes_per_token()) {
            uint64_t t = tokens_per_frame(std::min<uint64_t>(h.max_message_bytes(), max_message_bytes_), h.seam_bytes_per_token());
            cap = cap ? std::min(cap, t) : t;
        }
    }
    s.can_roll_back = no.empty();
    s.no_roll_back = no;
    s.spec_cap = cap ? cap : MAX_DRAFT_K + 1;
}

void StageWorker::send_token(const SessionPtr & sess, pb::Frame frame, size_t n_ids) {
    pb::Token * tok = frame.mutable_token();
    std::string full;
    if (info_.has_vocab) {
        std::vector<int32_t> ids;
        {
            std::lock_guard<std::mutex> g(mu_);
            ids.assign(sess->context_ids.begin(), sess->context_ids.begin() + long(std::min(n_ids, sess->context_ids.size())));
        }
        std::string buf(16 * ids.size() + 16, '\0');
        int32_t n;
        std::lock_guard<std::mutex> eg(engine_mu_);
        const int32_t dummy = 0;
        while (true) {
            n = lib_.detokenize(eng_, ids.empty() ? &dummy : ids.data(), int32_t(ids.size()), &buf[0], int32_t(buf.size()));
            if (n < 0) throw std::runtime_error("detokenize: " + lib_.error(DGR_E_ENGINE));
            if (size_t(n) <= buf.size()) break;
            buf.resize(size_t(n));
        }
        buf.resize(size_t(n));
        full = utf8_replace(buf);
    }
    static const std::string REPL = "\xEF\xBF\xBD";
    ReplyPtr client;
    {
        std::lock_guard<std::mutex> g(mu_);
        const bool unfinished = full.size() >= 3 && full.compare(full.size() - 3, 3, REPL) == 0;
        if (unfinished && !tok->done()) {
            tok->set_text("");                       // an unfinished UTF-8 sequence: wait for more
        } else {
            tok->set_text(full.substr(byte_offset(full, code_points(sess->text))));
            sess->text = full;
        }
        client = sess->client;
    }
    if (client) client->put(std::move(frame));
}

void StageWorker::client_gone(const ReplyPtr & out) {
    // the client's stream ended: stop decoding for it and free its sessions along the route
    std::vector<Key> orphans;
    {
        std::lock_guard<std::mutex> g(mu_);
        for (auto & kv : sessions_) {
            if (kv.second->client == out && !kv.second->done) {
                kv.second->failed = true;
                orphans.push_back(kv.first);
            }
        }
    }
    for (auto & k : orphans) close_chained(k.first, k.second, nullptr, nullptr);
}

void StageWorker::shutdown_threads() {
    std::vector<std::shared_ptr<Link>> links;
    {
        std::lock_guard<std::mutex> g(mu_);
        threads_stopped_ = true;
        wake_.notify_all();
        for (auto & kv : out_links_) links.push_back(kv.second);
        links.insert(links.end(), dead_links_.begin(), dead_links_.end());
    }
    if (engine_thread_.joinable() && engine_thread_.get_id() != std::this_thread::get_id()) engine_thread_.join();
    for (auto & l : links) l->close();
    {
        std::lock_guard<std::mutex> g(mu_);
        for (auto & kv : out_links_) links.push_back(kv.second);
        out_links_.clear();
        dead_links_.clear();
    }
    links.clear();                                   // destroyed here, outside the lock
}

}  // namespace dgr

namespace dgr {

void StageWorker::set_metrics_url(const std::string & url) {
    std::lock_guard<std::mutex> g(addr_mu_);
    metrics_url_ = url;
}

// Every metric family, name for name (docs/wire.md "Metrics and the descriptor"; tests/test_worker_cpp_metrics.py)
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
    for (auto & kv : sessions_) held += kv.second->held;
    auto gauge = [&](const char * name, const char * help, double v) {
        prom_family(o, std::string("dgr_worker_") + name, "gauge", help);
        prom_sample(o, std::string("dgr_worker_") + name, "", v);
    };
    gauge("sessions_open", "open sessions", double(sessions_.size()));
    gauge("queued_steps", "steps queued for the engine", double(n_pending_));
    gauge("cached_positions", "positions held over all open sessions", double(held));
    gauge("uptime_seconds", "seconds since the worker started",
          std::chrono::duration<double>(std::chrono::steady_clock::now() - started_).count());
    gauge("max_frame_bytes_sent", "largest frame sent so far", double(max_frame_bytes_sent_));
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
