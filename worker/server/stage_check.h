// The stage file against its bundle manifest entry (stage_check.cpp).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "nlohmann/json.hpp"

namespace dgr::serve {

// The stage file against its manifest entry (dgr.toolchain.bundle.verify_bundle's check, its messages): present, the
// manifest's size, and unless `hash` is false every chunk of `chunk` bytes with the blake3 the manifest lists,
// read in order; the first bad chunk is named. Runs before the engine library is loaded. Returns what it read.
struct StageCheck {
    uint64_t bytes = 0;
    size_t chunks = 0;
    double seconds = 0;
};

StageCheck check_stage_file(const std::string & file, const nlohmann::json & entry, uint64_t chunk, int stage,
                            const std::string & mpath, bool hash);

}  // namespace dgr::serve
