// dgr-worker's data path (docs/worker.md): the Frames stream, the step queue and the
// one engine thread, the ring relay over one outgoing stream per peer, sampling on the last stage and
// generation control at the origin.
//
// It took over the retired Python worker's behaviour part for part (a route of dgr-workers generates the
// tokens and bit-identical logits of the whole model: tests/worker/test_worker_cpp_frames.py). The parts: the
// incoming frames (frame_intake.h, FrameIntake): the Frames calls and who may open one (this file), on_frame and
// check_step, a frame in (frame_checks.cpp), enqueue, steps into the scheduler (step_queue.cpp,
// engine_loop/scheduler.h); FrameQueue, a stream's bounded reply queue (frame_queue.cpp); run_batch, one batch
// through the engine, and emit_last, the last stage's draws (engine_run/); Link, an outgoing stream (link.cpp);
// emit_boundary and send, what the stage sends round the ring (relay/ring_out.cpp, over the relay: relay/relay.h);
// deliver, next_step and send_token, the origin, and start_speculation (origin/origin.cpp; the drafts:
// speculation/drafts.cpp, whose twin for a client's own drafts is dgr.runtime.wire.drafts); a session's life
// (lifecycle/); the metrics' counters (metrics/metrics.h). data_path.h holds what they share.
// The draw is the engine library's dgr_sample (worker/engine/dgr_sample.cpp, the one sampler); wire dtypes
// use ggml's own converters from the same library. Speculation (phase 4): the origin drafts, every stage
// runs the k+1 positions and drops rejected drafts on the next step (rollback, dgr_session_truncate), the
// last stage verifies (tests/worker/test_worker_cpp_speculate.py).
//
// Threads: each incoming Frames call is a gRPC callback reactor (FramesReactor): the gRPC thread that
// reads a frame checks and queues it, or runs a lone decode step itself when the engine is idle, and the
// thread that puts a reply starts its write. One engine thread runs every other forward (and the origin's
// detokenizing after it). Each Link is a gRPC callback reactor too (no thread of its own: gRPC's threads
// run its reads and write completions). No exception leaves any of them.
#include <grpcpp/grpcpp.h>

#include <algorithm>

#include <memory>
#include <optional>
#include <stdexcept>
#include <thread>

#include "data_path.h"
#include "frames/frame_intake.h"

namespace dgr {

namespace pb = dgr::v1;
using Clock = std::chrono::steady_clock;

FrameIntake::FrameIntake(FrameIntakePort & port, StageEngine & engine, SessionTable<Session> & sessions, SessionLife & life,
                         Origin & origin, Scheduler & sched, Relay & relay, Metrics & metrics, const Trust & trust,
                         const SessionNames & names, int64_t max_connections, FrameIntakeSettings settings)
    : port_(port), engine_(engine), sessions_(sessions), life_(life), origin_(origin), sched_(sched), relay_(relay),
      metrics_(metrics), trust_(trust), names_(names), set_(std::move(settings)), conns_(max_connections) {}

// --max-connections: every call of the Stage service holds its connection's slot while it runs
struct Admit {
    FrameIntake * w;
    std::string peer, why;
    Admit(FrameIntake * w_, const grpc::ServerContextBase * ctx) : w(w_) {
        why = w->admit(ctx);
        if (why.empty() && ctx) peer = ctx->peer();
    }
    ~Admit() {
        if (why.empty()) w->release(peer);
    }
};

std::string FrameIntake::admit(const grpc::ServerContextBase * ctx) {
    if (!ctx) return "";
    size_t held = 0;
    if (conns_.take(ctx->peer(), &held)) return "";
    metrics_.count_overloaded();
    return hop() + ": " + std::to_string(held) + " connections have calls in progress (--max-connections " +
           std::to_string(conns_.max()) + "): retry later or use another replica";
}

void FrameIntake::release(const std::string & peer) { conns_.give_back(peer); }

void FrameIntake::check_stalls() {
    const int64_t timeout = int64_t(set_.send_timeout_s * 1e9);
    if (timeout <= 0) return;
    const int64_t now = mono_ns();
    const std::vector<ReplyPtr> streams = streams_.all();
    for (auto & q : streams) {
        bool stalled;
        {
            std::lock_guard<std::mutex> g(q->mu);
            stalled = q->writing_since && now - q->writing_since > timeout;
        }
        if (stalled) q->fail("its reader did not take a frame for " + std::to_string(timeout / 1000000) + " ms (--send-timeout)");
    }
    relay_.check_stalls(now, timeout);
}

// One incoming Frames call on gRPC's callback API: the thread that reads a frame (one of gRPC's) checks it
// and queues it (on_frame), or runs it at once when it is a lone decode step and the engine is idle
// (step_queue.cpp); replies go out through the call's FrameQueue. No thread of the worker's own waits on
// the call, and no exception leaves a reaction.
class FramesReactor final : public grpc::ServerBidiReactor<pb::Frame, pb::Frame> {
  public:
    FramesReactor(FrameIntake * w, grpc::CallbackServerContext * ctx) : w_(w), admitted_(w, ctx) {
        std::string refused = admitted_.why;
        if (refused.empty()) {
            auto out = std::make_shared<FrameQueue>();
            out->cap = w->set_.max_send_queue_bytes;
            out->ctx = ctx;
            out->who = w->hop();
            out->stream = this;                      // before stop() can see it in streams_ and finish it
            if (w->trust_.mutual) peer_ = peer_identity(ctx);
            out_ = out;
            if (!w->streams_.add(out)) refused = w->hop() + " is shutting down";
        }
        if (!refused.empty()) {
            out_.reset();                            // never in streams_: nothing to undo in OnDone
            refusal_ = grpc::Status(admitted_.why.empty() ? grpc::StatusCode::UNAVAILABLE
                                                          : grpc::StatusCode::RESOURCE_EXHAUSTED, refused);
        }
        ordered();                                   // every field above is set before gRPC may react
        // A refused call is finished from a reaction, after gRPC bound it: a Finish here would park the
        // status in gRPC's pre-bind backlog, which gRPC then moves on its own thread (TSan cannot see that
        // hand-off, 2026-12-02); the refusal costs its caller the initial metadata's round, nothing more.
        if (!refused.empty()) StartSendInitialMetadata();
        else StartRead(&in_);
    }

    void OnSendInitialMetadataDone(bool) override {
        ordered();
        Finish(refusal_);                            // only a refused call sends its metadata first
    }

    void OnReadDone(bool ok) override {
        ordered();
        if (!ok) {                                   // the caller is done sending (or gone): finish once written
            out_->finish(false);
            return;
        }
        t_reads_frames = true;
        try {
            w_->on_frame(std::move(in_), out_, &peer_);
        } catch (const std::exception & e) {         // never let one stream take the worker down
            fprintf(stderr, "dgr-worker: frame stream failed: %s\n", e.what());
            out_->fail(std::string("the worker failed on a frame: ") + e.what());
        } catch (...) {
            fprintf(stderr, "dgr-worker: frame stream failed (unknown exception)\n");
            out_->fail("the worker failed on a frame");
        }
        t_reads_frames = false;
        in_.Clear();
        ordered();
        if (!out_->finished()) StartRead(&in_);      // a finished call reads nothing more
    }

    void OnWriteDone(bool ok) override {
        ordered();
        out_->write_done(ok);
    }

    void OnDone() override {
        ordered();
        if (out_) {
            {
                std::lock_guard<std::mutex> g(out_->mu);
                out_->stream = nullptr;
                out_->ctx = nullptr;
                out_->drain = true;                  // nothing more is queued for it
                out_->q.clear();
            }
            w_->stream_done(out_);
        }
        delete this;
    }

  private:
    // gRPC runs this call's reactions one after another, possibly each on another of its threads, and
    // orders them with its own atomics. Debian's gRPC is not built with TSan, so TSan sees none of that
    // order: the constructor's writes read in OnDone looked like a race (CI, 2026-12-02). Each reaction,
    // and the constructor before it starts an operation, takes this uncontended lock, which gives TSan
    // (and any reader) the order gRPC already guarantees. It is never held while gRPC is called.
    void ordered() { std::lock_guard<std::mutex> g(order_); }

    std::mutex order_;
    FrameIntake * w_;
    Admit admitted_;                                 // --max-connections: held until the call is done
    std::optional<std::string> peer_;
    grpc::Status refusal_;                           // why the call is refused (--max-connections, SIGTERM)
    ReplyPtr out_;
    pb::Frame in_;
};

grpc::ServerBidiReactor<pb::Frame, pb::Frame> * FrameIntake::frames(grpc::CallbackServerContext * ctx) {
    return new FramesReactor(this, ctx);
}

// A Frames call is over: its sessions' client is gone. Closing them chains CloseSession along the route
// (blocking calls), so it runs on a thread of its own, never in gRPC's reaction; stop() waits for it.
void FrameIntake::stream_done(const ReplyPtr & out) {
    streams_.remove(out);
    if (sched_.stopped()) return;                    // stop() closed every session already
    std::vector<SessionPtr> open;                    // a stream that carried no session (a Describe-like
    sessions_.for_each([&](const Key &, const SessionPtr & s) { open.push_back(s); });   //   probe, a reset stream)
    if (std::none_of(open.begin(), open.end(), [&](const SessionPtr & s) { return origin_.serves(s, out); })) return;

    if (!streams_.cleanup_started()) return;         // shutdown_threads waits for it, or the end began
    std::thread([this, out] {
        try {
            origin_.client_gone(out);
        } catch (const std::exception & e) {
            fprintf(stderr, "dgr-worker: closing a gone client's sessions: %s\n", e.what());
        } catch (...) {
        }
        streams_.cleanup_ended();
    }).detach();
}

void FrameIntake::reply_error(const ReplyPtr & reply, const pb::Frame & frame, pb::WireError e, bool as_named) {
    if (!reply) return;
    pb::Frame f;
    f.set_session_id(as_named ? frame.session_id() : names_.wire_of(frame.session_id()));
    f.set_epoch(frame.epoch());
    *f.mutable_error() = std::move(e);
    reply->put(std::move(f));
}

}  // namespace dgr
