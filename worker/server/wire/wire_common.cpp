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

std::string utf8_replace(const std::string & s) {
    // Unicode's "maximal subpart" practice (what CPython's decoder does): each maximal prefix of a valid
    // sequence that cannot be completed becomes one U+FFFD
    static const char REPL[] = "\xEF\xBF\xBD";
    std::string out;
    out.reserve(s.size());
    auto u = [&](size_t i) { return static_cast<unsigned char>(s[i]); };
    size_t i = 0, n = s.size();
    while (i < n) {
        unsigned char c = u(i);
        if (c < 0x80) { out += char(c); ++i; continue; }
        int need;
        unsigned char lo = 0x80, hi = 0xBF;
        if (c >= 0xC2 && c <= 0xDF) need = 1;
        else if (c == 0xE0) { need = 2; lo = 0xA0; }
        else if (c == 0xED) { need = 2; hi = 0x9F; }
        else if (c >= 0xE1 && c <= 0xEF) need = 2;
        else if (c == 0xF0) { need = 3; lo = 0x90; }
        else if (c == 0xF4) { need = 3; hi = 0x8F; }
        else if (c >= 0xF1 && c <= 0xF3) need = 3;
        else { out += REPL; ++i; continue; }
        size_t j = i + 1;
        int got = 0;
        while (got < need && j < n) {
            unsigned char b = u(j);
            if (got == 0 ? (b < lo || b > hi) : (b < 0x80 || b > 0xBF)) break;
            ++j;
            ++got;
        }
        if (got == need) out.append(s, i, j - i);
        else out += REPL;
        i = j;
    }
    return out;
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
