// The vocabulary as llama.cpp sees it: the end-of-generation ids (of a file's vocabulary alone, or of an
// open engine), tokenize and detokenize.
#include "dgr_engine.h"
#include "dgr_engine_internal.h"

#include "llama.h"

#include <cstring>
#include <string>

using namespace dgr_engine_detail;

extern "C" {

static void fill_vocab(const llama_vocab * vocab, dgr_vocab_info * out, int32_t * eog, int32_t eog_cap) {
    dgr_vocab_info v {};
    v.n_vocab = llama_vocab_n_tokens(vocab);
    auto id = [](llama_token t) { return t == LLAMA_TOKEN_NULL ? -1 : (int32_t) t; };
    v.bos = id(llama_vocab_bos(vocab));
    v.eos = id(llama_vocab_eos(vocab));
    v.eot = id(llama_vocab_eot(vocab));
    for (int32_t t = 0; t < v.n_vocab; ++t) {
        if (llama_vocab_is_eog(vocab, t)) {
            if (eog && v.n_eog < eog_cap) eog[v.n_eog] = t;
            ++v.n_eog;
        }
    }
    *out = v;
}

int32_t dgr_vocab_read(const char * path, dgr_vocab_info * out, int32_t * eog, int32_t eog_cap) {
    return guarded([&] {
        if (!path || !out || (!eog && eog_cap > 0)) throw dgr_exc(DGR_E_ENGINE, "vocab_read: null argument");
        init_backend_once();
        llama_model_params mp = llama_model_default_params();
        mp.vocab_only = true;
        take_log_errors();
        llama_model * model = llama_model_load_from_file(path, mp);
        if (!model) {
            std::string why = take_log_errors();
            throw dgr_exc(DGR_E_ARTIFACT, fmt("%s: llama.cpp could not load its vocabulary: %s", path,
                    why.empty() ? "(no reason logged)" : why.c_str()));
        }
        struct freer { llama_model * m; ~freer() { llama_model_free(m); } } keep { model };
        fill_vocab(llama_model_get_vocab(model), out, eog, eog_cap);
    });
}

int32_t dgr_engine_vocab(dgr_engine * eng, dgr_vocab_info * out, int32_t * eog, int32_t eog_cap) {
    return guarded([&] {
        if (!eng || !out || (!eog && eog_cap > 0)) throw dgr_exc(DGR_E_ENGINE, "engine_vocab: null argument");
        fill_vocab(eng->vocab, out, eog, eog_cap);
    });
}

int32_t dgr_tokenize(dgr_engine * eng, const char * text, int32_t add_special, int32_t * out, int32_t cap) {
    int32_t n = -1;
    const int32_t rc = guarded([&] {
        if (!eng || !text) throw dgr_exc(DGR_E_ENGINE, "tokenize: null argument");
        const int32_t len = (int32_t) strlen(text);
        n = llama_tokenize(eng->vocab, text, len, out, cap, add_special != 0, true);
        if (n < 0) n = -n; // the caller's buffer was too small: report the size needed
    });
    return rc == DGR_OK ? n : -1;
}

int32_t dgr_detokenize(dgr_engine * eng, const int32_t * ids, int32_t n_ids, char * out, int32_t cap) {
    int32_t n = -1;
    const int32_t rc = guarded([&] {
        if (!eng || (!ids && n_ids > 0)) throw dgr_exc(DGR_E_ENGINE, "detokenize: null argument");
        for (int32_t i = 0; i < n_ids; ++i) {
            if (ids[i] < 0 || ids[i] >= eng->info.n_vocab) {
                throw dgr_exc(DGR_E_ENGINE, fmt("token id %d is outside the vocabulary [0, %d)", ids[i], eng->info.n_vocab));
            }
        }
        n = llama_detokenize(eng->vocab, ids, n_ids, out, cap, false, true); // render specials: round-trips tokenize()
        if (n < 0) n = -n;
    });
    return rc == DGR_OK ? n : -1;
}

} // extern "C"
