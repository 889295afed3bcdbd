// The fake engine (dgr_fake_engine.h): a deterministic toy model behind the ShardEngine's C ABI.
//
// The model (the semantics dgr.testing.fake_engine documents): token embeddings, `layers` residual layers
// and a head, drawn from `seed`. Each layer mixes the token with the running mean of everything the session
// has seen at that layer, so outputs depend on history and a stage holds a real per-session cache (a step
// whose positions do not continue it is a cache miss). The first `hash_layers` layers also add a vector
// picked by the token id (as DeepSeek V4's hash-routed layers do), so a later stage owning one of them
// needs the token-id sideband. For a token h (float32 [streams*embd]) at layer l:
//
//     sum_l += h                    (float64, in position order; a truncate re-adds the kept inputs in order)
//     z = W_l h + a_l * float32(sum_l / positions)           (W_l h: a float64 dot product per row)
//     z += tok[id]                  (l < hash_layers)
//     h = h + z / (1 + |z|)         (softsign: IEEE add, divide and abs only, the same bits on any machine)
//
// and the head is logits[v] = head_v . (h / max(|h|, 1e-6)). Every operation is a per-token scalar loop
// in a fixed order with no fused multiply-add (fp-contract off here and on every build's command line,
// no -ffast-math), so batching and chunking never change a bit, and the whole model's logits equal the
// composition of its stages' bit for bit.
//
// Weights: value i of a tensor is drawn from splitmix64(key + (i+1) * golden), key = a hash of (seed,
// tensor, layer). A uniform in [0, 1) is the top 24 bits; a "normal" the Irwin-Hall sum of four 16-bit
// uniforms, centred and scaled to unit variance (arithmetic only: no libm, the same weights everywhere).
// Per layer, so a stage draws only its own layers (and the embeddings on the first stage, the head on
// the last, the token vectors where it owns a hash layer). Not numpy's weights: the Python fake of old
// drew others.
//
// Vocabulary: 0 pad, 1 BOS, 2 EOS, 3..258 the bytes 0..255 (UTF-8), the rest unused.
//
// One job per file: dgr_fake_engine.cpp the error state, the version answers, open, describe and memory;
// dgr_fake_spec.cpp the spec; dgr_fake_model.cpp the weights and the math above; dgr_fake_session.cpp the
// sessions; dgr_fake_forward.cpp dgr_forward; dgr_fake_vocab.cpp the byte vocabulary; dgr_fake_convert.cpp
// ggml's wire-dtype converters; dgr_fake_internal.h what they share.
#include "dgr_fake_internal.h"

#include <cstdio>
#include <cstring>
#include <mutex>
#include <string>

namespace dgr_fake {

thread_local std::string g_last_error;
thread_local int64_t     g_miss_held = 0, g_miss_expected = 0;

int32_t fail(int32_t status, const std::string & msg) {
    g_last_error = msg;
    return status;
}

}  // namespace dgr_fake

using namespace dgr_fake;

extern "C" {

DGR_API int32_t dgr_abi_version(void) { return DGR_ABI_VERSION; }
DGR_API int32_t dgr_has_hooks(void) { return 0; }
// the lane a fake stage advertises ("cpu", read by open_fake_stage in worker/server/stage_open.cpp); its
// identity's engine is "fake"
DGR_API const char * dgr_engine_lane(void) { return "cpu"; }
// Its arithmetic is plain C++ compiled with -ffp-contract=off (no fused multiply-add): the same bits from
// any x86-64 compiler and flags, so every fake stage shares one numerics.
DGR_API const char * dgr_numerics_build(void) { return "fake/fp-contract-off"; }
DGR_API const char * dgr_engine_numerics(dgr_engine * eng) { return eng ? "fake/fp-contract-off" : ""; }
DGR_API const char * dgr_last_error(void) { return g_last_error.c_str(); }

DGR_API void dgr_last_cache_miss(int64_t * held, int64_t * expected) {
    if (held) *held = g_miss_held;
    if (expected) *expected = g_miss_expected;
}

DGR_API int32_t dgr_abi_struct_size(const char * name) {
    if (!name) return -1;
#define DGR_STRUCT_SIZE(s) if (std::strcmp(name, #s) == 0) return int32_t(sizeof(s));
    DGR_ABI_STRUCTS(DGR_STRUCT_SIZE)
#undef DGR_STRUCT_SIZE
    return -1;
}

DGR_API int32_t dgr_engine_open(const char * path, const dgr_open_params * params, dgr_engine ** out) {
    (void) params;
    return guarded([&] {
        if (!out) throw Fail(DGR_E_ENGINE, "dgr_engine_open: out is NULL");
        *out = nullptr;
        if (!path) throw Fail(DGR_E_ENGINE, "fake engine: no spec");
        *out = open_engine(parse(path, true));
        return DGR_OK;
    });
}

DGR_API void dgr_engine_close(dgr_engine * eng) { delete eng; }

DGR_API int32_t dgr_engine_describe(dgr_engine * eng, dgr_stage_info * out) {
    return guarded([&] {
        if (!eng || !out) throw Fail(DGR_E_ENGINE, "dgr_engine_describe: NULL argument");
        std::memset(out, 0, sizeof *out);
        std::snprintf(out->arch, sizeof out->arch, "fake");
        out->layer_begin = int32_t(eng->begin);
        out->layer_end = int32_t(eng->end);
        out->n_layer = int32_t(eng->spec.layers);
        out->n_embd = int32_t(eng->spec.embd);
        out->n_streams = int32_t(eng->spec.streams);
        out->n_vocab = int32_t(eng->spec.vocab);
        out->is_first = eng->first;
        out->is_last = eng->last;
        out->needs_token_ids = eng->needs_ids;
        out->has_vocab = 1;
        out->n_ctx = int32_t(eng->spec.ctx);
        out->max_sessions = int32_t(eng->spec.sessions);
        out->batch_invariant = 1;
        return DGR_OK;
    });
}

DGR_API int32_t dgr_engine_memory(dgr_engine * eng, dgr_memory * out) {
    return guarded([&] {
        if (!eng || !out) throw Fail(DGR_E_ENGINE, "dgr_engine_memory: NULL argument");
        std::lock_guard<std::mutex> g(eng->mu);
        std::memset(out, 0, sizeof *out);
        uint64_t weights = (eng->embed.size() + eng->head.size() + eng->tok.size()) * sizeof(float);
        for (size_t k = 0; k < eng->w.size(); ++k) weights += (eng->w[k].size() + eng->a[k].size()) * sizeof(float);
        uint64_t kv = 0;
        for (auto & kvp : eng->sessions) {
            for (size_t k = 0; k < kvp.second.sums.size(); ++k) {
                kv += kvp.second.sums[k].size() * sizeof(double) + kvp.second.inputs[k].size() * sizeof(float);
            }
        }
        out->weights_bytes = weights;
        out->kv_bytes = kv;
        return DGR_OK;
    });
}

}  // extern "C"
