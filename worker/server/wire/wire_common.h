// What every message of the wire is made of, shared by the handlers, the data path and the program: the wire
// dtypes and their sizes (wire/dtypes.h, over wire_constants.h, generated from dgr.core.contract; the sizes are
// dgr.runtime.wire.codec's), their codes (wire_dtype_codes.h) and the text of messages (hop names, a boundary schema, bytes as UTF-8: wire/utf8.h).
// Free functions over the generated messages and nothing of the worker's (no worker.h): a file that names one
// of them includes this header (wire/wire_common.cpp defines them).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "dgr/v1/stage.pb.h"
#include "wire/dtypes.h"                            // wire_dtypes, find_dtype, nbytes
#include "wire/utf8.h"                              // utf8_replace
#include "wire_dtype_codes.h"                       // dtype_code

namespace dgr {

// A dtype by its code on the wire (null: none).
const WireDtype * dtype_of(dgr::v1::Dtype code);

// "stage 1 (127.0.0.1:5001)": how every message names a hop.
std::string hop_name(uint32_t index, const std::string & address);
// "[n, 1, 64] f32 at layer 2 +token ids of bundle ...": a boundary schema as refusals name it.
std::string schema_str(const dgr::v1::BoundarySchema & s);

}  // namespace dgr
