// The ShardEngine library, loaded at run time through its C ABI (worker/engine/dgr_engine.h).
//
// dlopen rather than a link dependency: one dgr-worker binary serves any lane's engine library (the
// one beside it in a build or release folder, or $DGR_ENGINE_LIB, as the Python tooling finds it), and
// building the worker never rebuilds llama.cpp. The library's own path is what engine_blake3 hashes.
#pragma once

#include <string>

#include "dgr_engine.h"

namespace dgr {

struct EngineLib {
    std::string path;   // the file loaded (resolved)
    int32_t      (*abi_version)(void);
    const char * (*lane)(void);
    const char * (*numerics)(dgr_engine *);   // dgr_engine_numerics: what decides the bits (docs/numerics.md)
    const char * (*last_error)(void);
    int32_t (*open)(const char *, const dgr_open_params *, dgr_engine **);
    void    (*close)(dgr_engine *);
    int32_t (*describe)(dgr_engine *, dgr_stage_info *);
    int32_t (*memory)(dgr_engine *, dgr_memory *);
    int32_t (*session_open)(dgr_engine *, const char *, int64_t);
    int32_t (*session_close)(dgr_engine *, const char *, int64_t);
    int32_t (*can_truncate)(dgr_engine *);
    int32_t (*truncate)(dgr_engine *, const char *, int64_t, int32_t);   // speculation: drop rejected drafts
    int32_t (*vocab)(dgr_engine *, dgr_vocab_info *, int32_t *, int32_t);
    int32_t (*tokenize)(dgr_engine *, const char *, int32_t, int32_t *, int32_t);
    int32_t (*detokenize)(dgr_engine *, const int32_t *, int32_t, char *, int32_t);
    // the data path (phase 2): forward, the cache, the last stage's draw (dgr_sample.cpp, the one sampler)
    int32_t (*forward)(dgr_engine *, int32_t, const dgr_step *, dgr_step_out *);
    int32_t (*n_cached)(dgr_engine *, const char *, int64_t, int32_t *);
    void    (*last_cache_miss)(int64_t *, int64_t *);
    int32_t (*sample)(const float *, int32_t, double, int32_t, double, uint64_t, int64_t);
    // ggml's own wire-dtype converters, exported by the engine library (null when it does not: lossy wire
    // dtypes are then refused at start). Layouts: f16/bf16 one uint16 a value; q8_0 blocks of 32 values,
    // an f16 scale then 32 int8 (34 bytes).
    void (*fp16_to_fp32)(const uint16_t *, float *, int64_t);
    void (*fp32_to_fp16)(const float *, uint16_t *, int64_t);
    void (*bf16_to_fp32)(const uint16_t *, float *, int64_t);
    void (*fp32_to_bf16)(const float *, uint16_t *, int64_t);
    void (*quantize_q8_0)(const float *, void *, int64_t);
    void (*dequantize_q8_0)(const void *, float *, int64_t);
    // log-probabilities of a row, llama.cpp's grammar sampler (null in the fake engine, which has no
    // vocabulary to constrain), a session's state (the prefix cache; null in the fake engine)
    int32_t (*logprobs)(const float *, int32_t, int32_t, float *, int32_t, int32_t *, float *);
    int32_t (*grammar_open)(dgr_engine *, const char *, const char *, dgr_grammar **);
    void    (*grammar_close)(dgr_grammar *);
    int32_t (*grammar_apply)(dgr_grammar *, float *, int32_t);
    int32_t (*grammar_accept)(dgr_grammar *, int32_t);
    int32_t (*state_get)(dgr_engine *, const char *, int64_t, void *, uint64_t, uint64_t *, int32_t *);
    int32_t (*state_set)(dgr_engine *, const char *, int64_t, const void *, uint64_t, int32_t, int32_t);
    // MTP drafts on the last stage of an include_mtp bundle (null in the fake engine)
    int32_t (*mtp_draft)(dgr_engine *, const char *, int64_t, int32_t, int32_t, int32_t *);
    // the fake engine's canonical spec (worker/fake/dgr_fake_engine.h: dgr_fake_spec); null in a real engine
    int32_t (*fake_spec)(const char *, char *, int32_t, int32_t *);

    std::string error(int32_t status) const;   // dgr_last_error(), or the status
};

// $DGR_ENGINE_LIB, else libdgr_engine.so beside this executable. Throws std::runtime_error saying
// which file was tried and how to get one.
EngineLib load_engine_lib(const std::string & self_dir);

// The fake engine (worker/fake: a toy model behind the same C ABI, for tests; --fake-engine):
// $DGR_FAKE_ENGINE_LIB, else libdgr_fake_engine.so beside this executable.
EngineLib load_fake_engine_lib(const std::string & self_dir);

}  // namespace dgr
