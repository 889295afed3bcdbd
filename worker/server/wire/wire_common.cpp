// The wire dtypes and their sizes (WIRE_DTYPES: wire_constants.h, generated from dgr.core.contract), and the
// text every message is made of: hop names, a boundary schema, bytes as UTF-8 (wire/wire_common.h declares them).
#include "wire/wire_common.h"

#include <iterator>
#include <string>

namespace dgr {

namespace pb = dgr::v1;

const std::vector<WireDtype> & wire_dtypes() {
    static const std::vector<WireDtype> t(std::begin(WIRE_DTYPES), std::end(WIRE_DTYPES));
    return t;
}

const WireDtype * find_dtype(const std::string & name) {
    for (auto & d : wire_dtypes()) {
        if (name == d.name) return &d;
    }
    return nullptr;
}

const WireDtype * dtype_of(pb::Dtype code) {
    for (auto & d : wire_dtypes()) {
        if (d.code == code) return &d;
    }
    return nullptr;
}

uint64_t nbytes(const WireDtype & d, uint64_t n_values) { return n_values / d.block * d.block_bytes; }

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
