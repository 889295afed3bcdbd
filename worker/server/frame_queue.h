// The reply queue of one incoming Frames call (frame_queue.cpp): it knows nothing of the worker.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>

#include <grpcpp/grpcpp.h>

#include "dgr/v1/stage.grpc.pb.h"

namespace dgr {

// The replies of one incoming Frames call (errors, and at the origin the client's tokens), written by
// gRPC's callback API: the thread that puts a frame (the engine thread, or the one that read a frame) starts
// its write when none is in flight, and the write that completes starts the next, so no thread is woken
// per frame. `end`: the call's reads are over (write what is queued, then finish OK); `drain`: finish now
// (the worker is shutting down: UNAVAILABLE; or the stream was failed: RESOURCE_EXHAUSTED, `failed` says
// why). The queue is bounded (bytes): a reader that falls behind by more, or a write that waits past the
// send deadline, fails the stream (its call is cancelled) and never blocks whoever puts.
struct FrameQueue {
    std::mutex mu;
    std::deque<dgr::v1::Frame> q;
    bool end = false, drain = false, gone = false;   // gone: a write failed (the caller went away)
    int64_t bytes = 0, cap = 0;                      // queued bytes; cap 0: unbounded
    int64_t writing_since = 0;                       // steady ns the write in progress began (0: none)
    grpc::ServerContextBase * ctx = nullptr;         // the call, while it runs (cancelled on failure)
    grpc::ServerBidiReactor<dgr::v1::Frame, dgr::v1::Frame> * stream = nullptr;   // while it runs
    std::string failed;                              // why the stream was failed ("" while it is not)
    std::string who;                                 // this hop, for the status it ends with
    bool put(dgr::v1::Frame f);                      // false: the stream is over or was just failed
    void finish(bool draining);
    void fail(const std::string & why);
    void write_done(bool ok);                        // the reactor's OnWriteDone
    void pump();                                     // start the next write, or finish the call
    bool finished() {
        std::lock_guard<std::mutex> g(mu);
        return finished_;
    }

  private:
    dgr::v1::Frame writing_;                         // the write in flight (gRPC reads it until it is done)
    bool in_flight_ = false, finished_ = false;
};
using ReplyPtr = std::shared_ptr<FrameQueue>;

}  // namespace dgr
