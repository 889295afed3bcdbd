// dgr-worker's data path (issue 21 phase 2, docs/worker.md): the Frames stream, the step queue and the
// one engine thread, the ring relay over one outgoing stream per peer, sampling on the last stage and
// generation control at the origin.
//
// It took over the retired Python worker's behaviour part for part (a route of dgr-workers generates the
// tokens and bit-identical logits of the whole model: tests/test_worker_cpp_frames.py). The parts, a file
// each: Frames, the incoming stream and who may open one (this file); on_frame and check_step, a frame in
// (frame_checks.cpp); FrameQueue, a stream's bounded reply queue (frame_queue.cpp); enqueue, ready_batch and
// the engine thread (step_queue.cpp); run_batch, one batch through the engine (run_batch.cpp); Link, an
// outgoing stream (link.cpp); emit_boundary and send, the ring relay (relay.cpp); emit_last, the last
// stage's draws (last_stage.cpp); deliver_to_client, next_step and send_token, the origin, and
// start_speculation (origin.cpp; the drafts: drafts.cpp, whose twin for a client's own drafts is
// dgr.runtime.wire.drafts); the metrics' text (metrics_text.cpp). frames_internal.h holds what they share.
// The draw is the engine library's dgr_sample (worker/engine/dgr_sample.cpp, the one sampler); wire dtypes
// use ggml's own converters from the same library. Speculation (phase 4): the origin drafts, every stage
// runs the k+1 positions and drops rejected drafts on the next step (rollback, dgr_session_truncate), the
// last stage verifies (tests/test_worker_cpp_speculate.py).
//
// Threads: gRPC's sync server gives each incoming Frames call a thread, which writes its reply queue;
// a reader thread per call checks and queues the frames it reads. One engine thread runs every forward
// (and the origin's detokenizing after it). Each Link is a gRPC callback reactor (no thread of its own:
// gRPC's threads run its reads and write completions). No exception leaves any of them.
#include <grpcpp/grpcpp.h>

#include <memory>
#include <stdexcept>
#include <thread>

#include "frames_internal.h"
#include "worker.h"

namespace dgr {

namespace pb = dgr::v1;
using Clock = std::chrono::steady_clock;

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
            t_reads_frames = true;
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

}  // namespace dgr
