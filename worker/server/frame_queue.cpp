// FrameQueue (worker.h): the bounded queue of frames one stream writes; a reader that falls behind, or a
// write past the send deadline, fails its stream rather than block whoever puts.
#include <grpcpp/grpcpp.h>

#include <algorithm>

#include "frames_internal.h"
#include "worker.h"

namespace dgr {

namespace pb = dgr::v1;
using Clock = std::chrono::steady_clock;

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

}  // namespace dgr
