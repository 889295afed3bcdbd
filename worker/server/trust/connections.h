// --max-connections (docs/worker.md "Bounds"): the connections (gRPC peers, by `peer()`) that have calls in
// progress here, each counted while any of its calls runs (the worker counts its Frames calls: frames.cpp's
// Admit guard), as a part with its own (leaf) lock. A new
// connection is refused while `max` others have calls in progress; a connection already counted is never
// refused, so a member's own calls cannot lock it out. What to answer a refusal, and the counter of refusals,
// are the worker's (frames.cpp:admit).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>

namespace dgr {

class ConnectionSlots {
  public:
    explicit ConnectionSlots(int64_t max) : max_(max) {}

    // One more call of `peer` in progress: true, or false (nothing counted) when `peer` has none and `max`
    // connections have some; `*held` (when given) is then how many do.
    bool take(const std::string & peer, size_t * held = nullptr);
    // One call of `peer` ended (one `take` that returned true); the last one frees its slot.
    void give_back(const std::string & peer);
    // Connections with calls in progress now.
    size_t size() const;
    int64_t max() const { return max_; }

  private:
    mutable std::mutex mu_;
    std::map<std::string, int64_t> calls_;       // peer -> its calls in progress (mu_)
    const int64_t max_;
};

}  // namespace dgr
