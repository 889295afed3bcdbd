// Bytes as text: each invalid UTF-8 sequence replaced by U+FFFD, as Python's bytes.decode(errors="replace") does
// (the client compares the text a worker sends with its own decode). What Detokenize answers
// (engine_loop/vocabulary.h) and what the origin streams to its client (origin/origin.cpp).
//
// Header-only and nothing but the standard library: a part's plain C++ test can use it without linking anything
// of wire/ (wire/wire_common.h, which includes this, is over the generated messages).
#pragma once

#include <cstddef>
#include <string>

namespace dgr {

inline std::string utf8_replace(const std::string & s) {
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

}  // namespace dgr
