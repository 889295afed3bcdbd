// What every message of the wire is made of, shared by the handlers, the data path and the program: the wire
// dtypes and their sizes (WIRE_DTYPES: wire_constants.h, generated from dgr.core.contract; the sizes are
// dgr.runtime.wire.codec's) and the text of messages (hop names, a boundary schema, bytes as UTF-8: wire/utf8.h).
// Free functions over the generated messages and nothing of the worker's (no worker.h): a file that names one
// of them includes this header (wire/wire_common.cpp defines them).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "dgr/v1/stage.pb.h"
#include "wire/utf8.h"                              // utf8_replace
#include "wire_constants.h"

namespace dgr {

// The wire dtypes in dgr.core.contract's order, and one by its name (null: no such dtype).
const std::vector<WireDtype> & wire_dtypes();
const WireDtype * find_dtype(const std::string & name);

// A dtype by its code on the wire (null: none), and the bytes `n_values` values take in it.
const WireDtype * dtype_of(dgr::v1::Dtype code);
uint64_t nbytes(const WireDtype & d, uint64_t n_values);

// "stage 1 (127.0.0.1:5001)": how every message names a hop.
std::string hop_name(uint32_t index, const std::string & address);
// "[n, 1, 64] f32 at layer 2 +token ids of bundle ...": a boundary schema as refusals name it.
std::string schema_str(const dgr::v1::BoundarySchema & s);

}  // namespace dgr
