// The clocks dgr-worker's parts share: steady nanoseconds (deadlines, durations) and wall-clock nanoseconds
// (the frames' sent_unix_ns, compared across hosts).
#pragma once

#include <chrono>
#include <cstdint>

namespace dgr {

inline int64_t mono_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

inline int64_t wall_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch()).count();
}

}  // namespace dgr
