// A wire dtype by its code (the dtypes and their sizes: wire/dtypes.h), and the
// text every message is made of: hop names, a boundary schema, bytes as UTF-8 (wire/wire_common.h declares them).
#include "wire/wire_common.h"

#include <string>

namespace dgr {

namespace pb = dgr::v1;

const WireDtype * dtype_of(pb::Dtype code) {
    for (auto & d : wire_dtypes()) {
        if (d.code == code) return &d;
    }
    return nullptr;
}

std::string hop_name(uint32_t index, const std::string & address) {
    return "stage " + std::to_string(index) + " (" + address + ")";
}

std::string schema_str(const pb::BoundarySchema & s) {
    const WireDtype * d = dtype_of(s.dtype());
    return "[n, " + std::to_string(s.n_streams()) + ", " + std::to_string(s.n_embd()) + "] " +
           (d ? std::string(d->name) : std::to_string(int(s.dtype()))) + " at layer " + std::to_string(s.layer()) +
           (s.token_ids() ? " +token ids" : "") + " of bundle " + s.bundle_id();
}

}  // namespace dgr
