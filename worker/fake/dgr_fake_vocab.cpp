// The fake model's vocabulary: 0 pad, 1 BOS, 2 EOS, 3..258 the bytes 0..255 (UTF-8); EOS ends a generation.
#include "dgr_fake_internal.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

using namespace dgr_fake;

namespace {

void vocab_info(const Spec & s, dgr_vocab_info * out, int32_t * eog, int32_t eog_cap) {
    out->n_vocab = int32_t(s.vocab);
    out->bos = BOS;
    out->eos = EOS;
    out->eot = -1;
    out->n_eog = 1;
    if (eog && eog_cap >= 1) eog[0] = EOS;
}

}  // namespace

extern "C" {

DGR_API int32_t dgr_vocab_read(const char * path, dgr_vocab_info * out, int32_t * eog, int32_t eog_cap) {
    return guarded([&] {
        if (!path || !out) throw Fail(DGR_E_ENGINE, "dgr_vocab_read: NULL argument");
        vocab_info(parse(path, true), out, eog, eog_cap);
        return DGR_OK;
    });
}

DGR_API int32_t dgr_engine_vocab(dgr_engine * eng, dgr_vocab_info * out, int32_t * eog, int32_t eog_cap) {
    return guarded([&] {
        if (!eng || !out) throw Fail(DGR_E_ENGINE, "dgr_engine_vocab: NULL argument");
        vocab_info(eng->spec, out, eog, eog_cap);
        return DGR_OK;
    });
}

DGR_API int32_t dgr_tokenize(dgr_engine * eng, const char * text, int32_t add_special, int32_t * out, int32_t cap) {
    int32_t n = -1;
    guarded([&] {
        if (!eng || !text) throw Fail(DGR_E_ENGINE, "dgr_tokenize: NULL argument");
        std::vector<int32_t> ids;
        if (add_special) ids.push_back(BOS);
        for (const char * p = text; *p; ++p) ids.push_back(BYTE0 + int32_t(uint8_t(*p)));
        for (size_t i = 0; i < ids.size() && out && int64_t(i) < cap; ++i) out[i] = ids[i];
        n = int32_t(ids.size());
        return DGR_OK;
    });
    return n;
}

DGR_API int32_t dgr_detokenize(dgr_engine * eng, const int32_t * ids, int32_t n, char * out, int32_t cap) {
    int32_t len = -1;
    guarded([&] {
        if (!eng || (n > 0 && !ids)) throw Fail(DGR_E_ENGINE, "dgr_detokenize: NULL argument");
        std::string bytes;
        for (int32_t i = 0; i < n; ++i) {
            if (BYTE0 <= ids[i] && ids[i] < BYTE0 + 256) bytes.push_back(char(ids[i] - BYTE0));
        }
        if (out && cap > 0) std::memcpy(out, bytes.data(), std::min<size_t>(bytes.size(), size_t(cap)));
        len = int32_t(bytes.size());
        return DGR_OK;
    });
    return len;
}

}  // extern "C"
