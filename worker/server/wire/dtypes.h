// The wire dtypes (WIRE_DTYPES: wire_constants.h, generated from dgr.core.contract) by name, and the bytes values
// take in one (dgr.runtime.wire.codec's sizes). Header-only and nothing of protobuf, so a part's plain test can
// use it (metrics/description.h); wire/wire_common.h adds what needs the messages (a dtype by its code).
#pragma once

#include <cstdint>
#include <iterator>
#include <string>
#include <vector>

#include "wire_constants.h"

namespace dgr {

// The wire dtypes in dgr.core.contract's order, and one by its name (null: no such dtype).
inline const std::vector<WireDtype> & wire_dtypes() {
    static const std::vector<WireDtype> t(std::begin(WIRE_DTYPES), std::end(WIRE_DTYPES));
    return t;
}

inline const WireDtype * find_dtype(const std::string & name) {
    for (auto & d : wire_dtypes()) {
        if (name == d.name) return &d;
    }
    return nullptr;
}

// The bytes `n_values` values take in `d`.
inline uint64_t nbytes(const WireDtype & d, uint64_t n_values) { return n_values / d.block * d.block_bytes; }

}  // namespace dgr
