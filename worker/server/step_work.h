// What the data path's parts hand each other: one queued step (`Work`) and a frame refused (`Fault`).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "dgr/v1/stage.pb.h"
#include "frame_queue.h"

namespace dgr {

// One queued step: the frame, where errors about it go, its boundary decoded to float32.
struct Work {
    dgr::v1::Frame frame;
    ReplyPtr reply;
    int64_t t_recv = 0;
    std::vector<float> x;
    uint64_t transit_ns = 0;
};

// A frame refused: becomes a WireError to its sender.
struct Fault {
    dgr::v1::ErrorCode code;
    std::string message;
    uint64_t held = 0, expected = 0;
    uint32_t retry_after_ms = 0;
};

}  // namespace dgr
