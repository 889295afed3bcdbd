// FrameQueue (frame_queue.h): the bounded reply queue of one incoming Frames call, written through gRPC's
// callback API; a reader that falls behind, or a write past the send deadline, fails its stream rather
// than block whoever puts.
#include "frame_queue.h"

#include <algorithm>
#include <cstdio>

#include "clock.h"

namespace dgr {

namespace pb = dgr::v1;

bool FrameQueue::put(pb::Frame f) {
    const int64_t size = int64_t(f.ByteSizeLong());
    bool over = false;
    {
        std::lock_guard<std::mutex> g(mu);
        if (end || drain || finished_) return false;   // its stream is over: nobody would write it
        if (cap > 0 && bytes + size > cap && !q.empty()) {
            failed = "its reader fell " + std::to_string(bytes + size) + " bytes behind (--max-send-queue-bytes " +
                     std::to_string(cap) + ")";
            drain = true;
            if (ctx) ctx->TryCancel();               // the write in flight ends (cancelled), then the call
            over = true;
        }
    }
    if (over) {
        pump();
        return false;
    }
    {
        std::lock_guard<std::mutex> g(mu);
        if (end || drain || finished_) return false;
        bytes += size;
        q.push_back(std::move(f));
        if (in_flight_) return true;                 // the write in flight starts it when it is done
    }
    pump();
    return true;
}

void FrameQueue::finish(bool draining) {
    {
        std::lock_guard<std::mutex> g(mu);
        (draining ? drain : end) = true;
    }
    pump();
}

void FrameQueue::fail(const std::string & why) {
    {
        std::lock_guard<std::mutex> g(mu);
        if (failed.empty()) failed = why;
        drain = true;
        if (ctx) ctx->TryCancel();
    }
    pump();
}

void FrameQueue::write_done(bool ok) {
    {
        std::lock_guard<std::mutex> g(mu);
        in_flight_ = false;
        writing_since = 0;
        writing_.Clear();
        if (!ok) {                                   // the caller went away (or the send deadline cancelled it)
            gone = true;
            drain = true;
        }
    }
    pump();
}

void FrameQueue::pump() {
    grpc::ServerBidiReactor<pb::Frame, pb::Frame> * s = nullptr;
    grpc::Status status = grpc::Status::OK;
    bool write = false;
    {
        std::lock_guard<std::mutex> g(mu);
        if (!stream || finished_ || in_flight_) return;
        if (drain) {
            if (!failed.empty()) {
                fprintf(stderr, "dgr-worker: failed a Frames stream%s%s: %s; its sessions are closed\n",
                        ctx ? " from " : "", ctx ? ctx->peer().c_str() : "", failed.c_str());
                status = grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                                      who + " failed this stream: " + failed + "; its sessions are closed: read the "
                                            "stream's frames as they come, then open the session again");
            } else if (gone) {
                status = grpc::Status(grpc::StatusCode::CANCELLED, "the caller went away");
            } else {
                status = grpc::Status(grpc::StatusCode::UNAVAILABLE, who + " is shutting down (SIGTERM): its sessions "
                                                                           "are closed; use another replica");
            }
        } else if (!q.empty()) {
            writing_ = std::move(q.front());
            q.pop_front();
            bytes = q.empty() ? 0 : std::max<int64_t>(0, bytes - int64_t(writing_.ByteSizeLong()));
            writing_since = mono_ns();               // the send deadline
            in_flight_ = write = true;
        } else if (!end) {
            return;                                  // nothing to write yet
        }
        if (!write) {
            finished_ = true;
            q.clear();
            bytes = 0;
        }
        s = stream;
    }
    // outside the lock: gRPC may run this call's reactions on another thread at once
    if (write) s->StartWrite(&writing_);
    else s->Finish(status);
}

}  // namespace dgr
