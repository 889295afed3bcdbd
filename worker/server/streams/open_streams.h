// The incoming Frames calls' reply streams this worker serves now, and the threads closing a gone client's
// sessions: a part with its own leaf lock. A call is added when it starts (refused once the worker stops), removed
// when gRPC is done with it; the send deadlines and SIGTERM walk a copy. Generic over the stream's handle (the
// worker's ReplyPtr; plain values in its test), so it holds nothing of gRPC.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <set>
#include <vector>

namespace dgr {

template <class Stream>
class OpenStreams {
  public:
    // A call starts: false once the worker is stopping (the call is refused, never added).
    bool add(const Stream & s) {
        std::lock_guard<std::mutex> g(mu_);
        if (stopping_) return false;
        streams_.insert(s);
        return true;
    }

    // gRPC is done with a call; true when it had been added.
    bool remove(const Stream & s) {
        std::lock_guard<std::mutex> g(mu_);
        return streams_.erase(s) > 0;
    }

    std::vector<Stream> all() const {
        std::lock_guard<std::mutex> g(mu_);
        return {streams_.begin(), streams_.end()};
    }

    // SIGTERM: no call is added from now on; the calls open now.
    std::vector<Stream> stop() {
        std::lock_guard<std::mutex> g(mu_);
        stopping_ = true;
        return {streams_.begin(), streams_.end()};
    }

    bool stopping() const {
        std::lock_guard<std::mutex> g(mu_);
        return stopping_;
    }

    // A thread closing a gone client's sessions may start (false once the worker's end waits: it must not) and
    // ends; the worker's end waits until none runs, and none starts after.
    bool cleanup_started() {
        std::lock_guard<std::mutex> g(mu_);
        if (ending_) return false;
        ++cleanups_;
        return true;
    }
    void cleanup_ended() {
        std::lock_guard<std::mutex> g(mu_);
        if (--cleanups_ == 0) none_running_.notify_all();
    }
    void wait_cleanups() {
        std::unique_lock<std::mutex> l(mu_);
        ending_ = true;
        none_running_.wait(l, [&] { return cleanups_ == 0; });
    }

    size_t size() const {
        std::lock_guard<std::mutex> g(mu_);
        return streams_.size();
    }

  private:
    mutable std::mutex mu_;
    std::set<Stream> streams_;
    bool stopping_ = false;
    int64_t cleanups_ = 0;                           // threads closing a gone client's sessions
    bool ending_ = false;                            // wait_cleanups began: none starts
    std::condition_variable none_running_;           // cleanups_ fell to 0
};

}  // namespace dgr
