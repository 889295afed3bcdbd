// Grammar-constrained sampling for the last stage (issue 23, docs/gateway.md "Structured output"): the
// pinned llama.cpp's grammar sampler (llama_sampler_init_grammar) over the engine's vocabulary, and its
// JSON-schema-to-grammar (common/json-schema-to-grammar.cpp, compiled into the engine with the few
// common/ files it needs; see worker/CMakeLists.txt and toolchains/llama_cpp.bzl). dgr-worker keeps one
// dgr_grammar per session and masks each logits row before dgr_sample draws from it.

#include "dgr_engine.h"
#include "dgr_engine_internal.h"

#include "json-schema-to-grammar.h"
#include "llama.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

struct dgr_grammar {
    llama_sampler * smpl = nullptr;
    const llama_vocab * vocab = nullptr;
    int32_t n_vocab = 0;
    std::vector<llama_token_data> cand;   // reused for every row
    ~dgr_grammar() {
        if (smpl) llama_sampler_free(smpl);
    }
};

// The most elements a grammar's repetitions may expand to (dgr_engine.h, dgr_grammar_open)
#define DGR_GRAMMAR_MAX_EXPANSION 500000

namespace {

std::string schema_to_gbnf(const char * schema) {
    common_json j;
    try {
        j = common_json::parse(schema);
    } catch (const std::exception & e) {
        throw dgr_engine_error(DGR_E_ENGINE, std::string("json_schema is not JSON: ") + e.what());
    }
    try {
        return json_schema_to_grammar(j);
    } catch (const std::exception & e) {
        throw dgr_engine_error(DGR_E_ENGINE, std::string("json_schema: llama.cpp's json_schema_to_grammar refused it: ") + e.what());
    }
}

// How many elements the GBNF's repetitions expand to in llama.cpp's parser (an upper estimate): each {m},
// {m,} or {m,n} copies the element before it n times (m + 1 when unbounded); a literal or a character class
// counts its bytes, a group or a rule name one (the parser makes a group a rule of its own). Stops past `limit`.
uint64_t repeat_expansion(const std::string & g, uint64_t limit) {
    uint64_t total = 0, last = 1;
    size_t i = 0;
    const size_t n = g.size();
    auto number = [&](uint64_t & v) {
        bool any = false;
        v = 0;
        while (i < n && g[i] >= '0' && g[i] <= '9') {
            v = std::min<uint64_t>(v * 10 + uint64_t(g[i] - '0'), UINT64_C(1) << 40);
            ++i;
            any = true;
        }
        return any;
    };
    while (i < n && total <= limit) {
        const char c = g[i];
        if (c == '#') {                              // a comment, to the end of its line
            while (i < n && g[i] != '\n' && g[i] != '\r') ++i;
        } else if (c == '"' || c == '[') {           // a literal or a class: its bytes, escapes included
            const char end = c == '"' ? '"' : ']';
            const size_t start = i++;
            while (i < n && g[i] != end) i += g[i] == '\\' ? 2 : 1;
            last = uint64_t(std::min(i, n) - start);
            ++i;
        } else if (c == '{') {
            ++i;
            uint64_t m = 0, most = 0;
            number(m);
            most = m;
            if (i < n && g[i] == ',') {
                ++i;
                if (!number(most)) most = m + 1;
            }
            total += std::max<uint64_t>(most, 1) * std::max<uint64_t>(last, 1);
            while (i < n && g[i] != '}') ++i;
            ++i;
        } else {
            if (c == ')' || std::isalnum((unsigned char) c) || c == '_' || c == '-') last = 1;
            ++i;
        }
    }
    return total;
}

}  // namespace

extern "C" {

int32_t dgr_json_schema_to_grammar(const char * schema, char * out, int32_t cap) {
    int32_t n = -1;
    const int32_t rc = dgr_engine_guarded([&] {
        if (!schema) throw dgr_engine_error(DGR_E_ENGINE, "json_schema_to_grammar: null schema");
        const std::string g = schema_to_gbnf(schema);
        n = (int32_t) g.size();
        if (out && cap > 0) {
            const size_t k = std::min<size_t>(g.size(), (size_t) cap);
            memcpy(out, g.data(), k);
        }
    });
    return rc == DGR_OK ? n : -1;
}

int32_t dgr_grammar_open(dgr_engine * eng, const char * gbnf, const char * json_schema, dgr_grammar ** out) {
    return dgr_engine_guarded([&] {
        if (!eng || !out) throw dgr_engine_error(DGR_E_ENGINE, "grammar_open: null argument");
        *out = nullptr;
        const bool has_g = gbnf && *gbnf, has_s = json_schema && *json_schema;
        if (has_g == has_s) throw dgr_engine_error(DGR_E_ENGINE, "grammar_open: give exactly one of grammar and json_schema");
        const llama_vocab * vocab = dgr_engine_llama_vocab(eng);
        if (!vocab) throw dgr_engine_error(DGR_E_UNSUPPORTED, "this stage has no vocabulary to constrain (not the last stage?)");
        const std::string text = has_g ? std::string(gbnf) : schema_to_gbnf(json_schema);
        if (const uint64_t x = repeat_expansion(text, DGR_GRAMMAR_MAX_EXPANSION); x > DGR_GRAMMAR_MAX_EXPANSION) {
            throw dgr_engine_error(DGR_E_ENGINE, std::string(has_g ? "grammar" : "json_schema") + ": its repetitions " +
                                                     (has_g ? "({m,n})" : "(minItems/maxItems, minLength/maxLength, {m,n} in patterns)") +
                                                     " expand to more than " + std::to_string(DGR_GRAMMAR_MAX_EXPANSION) +
                                                     " elements, the most this engine parses: use smaller or fewer counts");
        }
        dgr_engine_take_log_errors();
        llama_sampler * smpl = llama_sampler_init_grammar(vocab, text.c_str(), "root");
        if (!smpl) {
            const std::string why = dgr_engine_take_log_errors();
            throw dgr_engine_error(DGR_E_ENGINE, std::string(has_g ? "grammar" : "json_schema") +
                                                     ": llama.cpp's grammar parser refused it" + (why.empty() ? "" : ": " + why));
        }
        auto * g = new dgr_grammar();
        g->smpl = smpl;
        g->vocab = vocab;
        g->n_vocab = llama_vocab_n_tokens(vocab);
        *out = g;
    });
}

void dgr_grammar_close(dgr_grammar * g) { delete g; }

int32_t dgr_grammar_apply(dgr_grammar * g, float * logits, int32_t n_vocab) {
    return dgr_engine_guarded([&] {
        if (!g || !logits) throw dgr_engine_error(DGR_E_ENGINE, "grammar_apply: null argument");
        if (n_vocab != g->n_vocab) {
            throw dgr_engine_error(DGR_E_ENGINE, "grammar_apply: a row of " + std::to_string(n_vocab) + " logits for a vocabulary of " +
                                                     std::to_string(g->n_vocab));
        }
        g->cand.resize((size_t) n_vocab);
        for (int32_t i = 0; i < n_vocab; ++i) g->cand[(size_t) i] = llama_token_data{i, logits[i], 0.0f};
        llama_token_data_array arr{g->cand.data(), g->cand.size(), -1, false};
        llama_sampler_apply(g->smpl, &arr);
        bool any = false;
        for (size_t i = 0; i < arr.size; ++i) {
            const llama_token_data & d = arr.data[i];
            if (d.id >= 0 && d.id < n_vocab) logits[d.id] = d.logit;
            any = any || !std::isinf(d.logit) || d.logit > 0;
        }
        if (!any) throw dgr_engine_error(DGR_E_ENGINE, "the grammar allows no token here (the text so far cannot continue it)");
    });
}

int32_t dgr_grammar_accept(dgr_grammar * g, int32_t token) {
    return dgr_engine_guarded([&] {
        if (!g) throw dgr_engine_error(DGR_E_ENGINE, "grammar_accept: null grammar");
        if (token < 0 || token >= g->n_vocab) {
            throw dgr_engine_error(DGR_E_ENGINE, "token id " + std::to_string(token) + " is outside the vocabulary");
        }
        // llama.cpp aborts the process on an end-of-generation token its grammar does not allow, and throws
        // on other tokens it does not allow: ask the grammar first, so a bad token is refused and changes nothing
        llama_token_data one{token, 0.0f, 0.0f};
        llama_token_data_array arr{&one, 1, -1, false};
        llama_sampler_apply(g->smpl, &arr);
        if (std::isinf(one.logit) && one.logit < 0) {
            throw dgr_engine_error(DGR_E_ENGINE, "token " + std::to_string(token) + " does not follow the grammar here");
        }
        llama_sampler_accept(g->smpl, token);
    });
}

}  // extern "C"
