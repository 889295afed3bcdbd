// Unary calls (Describe, Tokenize, Detokenize, OpenSession, CloseSession): a part that owns its queue,
// its threads and its per-member counts, and nothing of the worker's state.
//
// Why not gRPC's sync server: in gRPC 1.51 a call that arrives while every sync thread is busy waits in
// the server's pending list, unbounded, until a thread takes it, even when its stream was reset at once.
// A member that opens and resets streams as fast as it can (HTTP/2 rapid reset, CVE-2023-44487) grew a
// worker by 280 MiB per 20,000 resets. The callback API matches every call at once (no pending list); a
// unary call reaches this part only after its request arrived (a reset stream never does), and this part
// bounds what waits: at most `threads` calls run and `queued` wait, each member has at most `per_member`
// running or waiting, and anything past that is refused at once (RESOURCE_EXHAUSTED, naming the flag).
#pragma once

#include <grpcpp/grpcpp.h>

#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <string>

namespace dgr {

class UnaryCalls {
  public:
    struct Bounds {
        size_t threads = 256;                        // --max-rpc-threads: calls running at once
        size_t queued = 256;                         // calls waiting for a thread
        size_t per_member = 64;                      // --max-rpc-per-member: running or waiting, per member
    };
    using Body = std::function<grpc::Status()>;

    explicit UnaryCalls(Bounds b) : b_(b) {}
    ~UnaryCalls();                                   // refuses new calls, runs what waits, joins its threads
    UnaryCalls(const UnaryCalls &) = delete;
    UnaryCalls & operator=(const UnaryCalls &) = delete;

    // Runs `body` on one of this part's threads and finishes the call with its status; refused at once
    // (the call finished RESOURCE_EXHAUSTED) when the member or the worker is at its bound. `member` is the
    // caller's identity ("" for a plaintext worker's one tenant); `who` names this hop in refusals.
    grpc::ServerUnaryReactor * start(grpc::CallbackServerContext * ctx, const std::string & member,
                                     const std::string & who, Body body);

    struct Counts {
        size_t running, queued, threads, members;
        uint64_t refused;
    };
    Counts counts() const;

  private:
    class Reactor;                                   // one call (unary_calls.cpp)
    struct Call {
        Reactor * reactor;
        std::string member;
    };
    void submit(Reactor * r);                        // after gRPC bound the call: queue it, or refuse it
    void loop();
    void done(const std::string & member);           // under mu_

    const Bounds b_;
    mutable std::mutex mu_;                          // guards everything below (a leaf lock: nothing is
    std::condition_variable work_, idle_;            //   called while it is held)
    std::deque<Call> q_;
    std::map<std::string, size_t> per_member_;       // running or waiting; a member at 0 is erased
    size_t threads_ = 0, waiting_threads_ = 0, running_ = 0;
    uint64_t refused_ = 0;
    bool stopping_ = false;
};

}  // namespace dgr
