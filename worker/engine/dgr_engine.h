// The ShardEngine's C ABI: one stage of a model (layers [begin, end)) over the patched llama.cpp.
//
// Opaque handles, plain structs, status codes; no C++ exception crosses this boundary. On a non-zero
// status, dgr_last_error() (thread-local) says what was wrong and what to do.
//
// Boundary: float32 [n_tokens, n_streams, n_embd], row-major, one row per token in step order.
#pragma once

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32)
#  define DGR_API __declspec(dllexport)
#else
#  define DGR_API __attribute__((visibility("default")))
#endif

// The ABI's version. Every function declared here is part of it (none is optional): an engine library of
// this version exports all of them, and its structs are those below, byte for byte (dgr_abi_struct_size).
// A caller checks both when it loads a library and refuses one of another version or other struct sizes
// (dgr-worker: worker/server/engine_lib.cpp). The fake engine (worker/fake), a test stand-in of the same
// version, leaves out what its toy model has no use for: dgr_quantize, the session state, the grammar sampler.
#define DGR_ABI_VERSION 10

enum dgr_status {
    DGR_OK              = 0,
    DGR_E_ENGINE        = 1, // generic refusal / failure (EngineError)
    DGR_E_CACHE_MISS    = 2, // positions do not continue the session's cache (CacheMiss)
    DGR_E_SCHEMA        = 3, // boundary / sideband does not match the stage's schema (SchemaMismatch)
    DGR_E_ARTIFACT      = 4, // the stage file is unreadable or its dgr.* keys contradict its tensors
    DGR_E_UNSUPPORTED   = 5, // e.g. an architecture that has not opted in to layer ranges
};

typedef struct dgr_engine dgr_engine;

typedef struct dgr_open_params {
    int32_t n_ctx;          // KV positions per session (0: 4096, capped by the model's training context)
    int32_t max_sessions;   // sessions that may hold a cache at once (llama seq ids), >= 1
    int32_t n_ubatch;       // physical batch (0: 512)
    int32_t n_threads;      // 0: all cores
    // Range override for a whole GGUF (tests): layer_end > 0 makes [layer_begin, layer_end) the owned
    // range (passed to llama.cpp as kv overrides of dgr.layer.*). Refused on a stage file.
    int32_t layer_begin;
    int32_t layer_end;
    // Owned layers to place on the lane's device (Vulkan, CUDA, ...): < 0 all of them, 0 none (host
    // only). A CPU-lane engine has no such device and ignores it.
    int32_t n_gpu_layers;
    // 1: keep the KV cache in F32 (all-F32 reference runs, comparisons across backends); 0: llama.cpp's
    // default (F16).
    int32_t kv_f32;
    // The CPU kernels (DGR_KERNELS_*). 0 (the default): batch invariant. A session's logits are
    // bit-identical (CPU) whatever shares its forwards and however its own tokens are cut into batches:
    // ggml's reference kernels (every row alone through vec_dot), one KV stream per session, no repacked
    // weights. 1: llama.cpp's shape-dependent fast kernels (results then depend on the batch; for measuring
    // what invariance costs). 2: batch invariant too, ggml's batch_invariant switch (patch 0026): flash
    // attention's tiled kernel for every number of queries, vec_dot for every matrix row: much faster
    // prefill of long prompts than 0 (docs/batching.md).
    int32_t fast_kernels;
    // The longest speculative draft this stage must be able to roll back after its verification step
    // (llama.cpp's n_rs_seq, for architectures whose cache keeps per-step snapshots: DeepSeek V4). 0: none,
    // as before (a V4 stage then cannot truncate), except on an MTP last stage: DGR_MTP_MAX_K.
    int32_t n_draft_max;
    // With n_threads > 1: how long the compute threads wait for the next graph spinning before they sleep,
    // ggml's polling level (0-100; llama.cpp's tools use 50, about 0.1-0.4 s of spinning after each graph).
    // 0 (the default): they sleep at once, for a stage that shares its cores; 50 keeps a dedicated host's
    // threads hot between decode steps, as llama.cpp does. No bit of a result depends on it.
    int32_t poll;
} dgr_open_params;

#define DGR_KERNELS_REFERENCE 0
#define DGR_KERNELS_FAST      1
#define DGR_KERNELS_INVARIANT 2

// The longest MTP draft (and so the rollback depth) of an MTP last stage opened with n_draft_max = 0.
#define DGR_MTP_MAX_K 8

typedef struct dgr_stage_info {
    char    arch[64];
    int32_t layer_begin, layer_end, n_layer;   // [begin, end) of n_layer
    int32_t n_embd, n_streams, n_vocab;
    int32_t is_first, is_last, needs_token_ids, has_vocab;
    int32_t n_ctx, max_sessions;
    int32_t batch_invariant;   // 1: results do not depend on the batch (see dgr_open_params.fast_kernels)
    int32_t has_mtp;           // 1: the last stage of an include_mtp bundle (dgr.mtp): owns the MTP block, drafts
    int32_t n_draft_max;       // positions a truncate may roll back after one step (0: a V4 stage cannot truncate)
    // The kernel each weight type of the stage's matrices takes on the CPU, "TYPES: kernel; ...": under the
    // invariant kernels, which run a fast kernel and which fall back to the reference vec_dot (docs/batching.md)
    char    matmul_kernels[512];
} dgr_stage_info;

// The vocabulary's special tokens, as llama.cpp itself sees them (llama_vocab_* over the loaded vocabulary).
typedef struct dgr_vocab_info {
    int32_t n_vocab;
    int32_t bos, eos, eot;   // -1 where the vocabulary has none
    int32_t n_eog;           // how many ids llama_vocab_is_eog marks (may exceed the caller's eog_cap)
} dgr_vocab_info;

enum dgr_want_logits { DGR_LOGITS_NONE = 0, DGR_LOGITS_LAST = 1, DGR_LOGITS_ALL = 2 };

typedef struct dgr_step {
    const char *    session_id;
    int64_t         epoch;
    int32_t         n_tokens;
    const int32_t * positions;      // [n_tokens], must be n_cached, n_cached+1, ...
    const int32_t * token_ids;      // [n_tokens]: first stage (and needs_token_ids); else NULL
    const float *   boundary;       // [n_tokens * boundary_width]: non-first stages; else NULL
    int32_t         boundary_width; // floats per token the caller sends (must be n_streams*n_embd)
    int32_t         want_logits;    // last stage: dgr_want_logits
} dgr_step;

typedef struct dgr_step_out {
    float * boundary;         // non-last: caller buffer [n_tokens * n_streams * n_embd]
    float * logits;           // last: caller buffer [n_tokens * n_vocab] (rows used: n_logit_rows)
    int32_t n_logit_rows;     // out
    int32_t next_token;       // out: greedy argmax of the last position (last stage), else -1
    int32_t n_cached;         // out: positions the session holds after the step
} dgr_step_out;

typedef struct dgr_memory {
    uint64_t weights_bytes;   // bytes of the weight tensors the model created (owned ones only)
    uint64_t kv_bytes;        // KV cache and other per-layer state
    uint64_t compute_bytes;   // compute buffers
    uint64_t device_weights_bytes; // of weights_bytes, those in a device (non-host) buffer
    char     device[64];      // that buffer's type (e.g. "Vulkan0"), "" when all weights are on the host
} dgr_memory;

// Every struct this header shares, X(name) each (the opaque dgr_engine and dgr_grammar are the library's own).
#define DGR_ABI_STRUCTS(X) \
    X(dgr_open_params) X(dgr_stage_info) X(dgr_vocab_info) X(dgr_step) X(dgr_step_out) X(dgr_memory)

DGR_API int32_t      dgr_abi_version(void);
// sizeof(name) in this library for each struct of DGR_ABI_STRUCTS ("dgr_step", ...), -1 for any other name.
DGR_API int32_t      dgr_abi_struct_size(const char * name);
DGR_API int32_t      dgr_has_hooks(void);          // 1 when built over the patched tree
DGR_API const char * dgr_engine_lane(void);        // the backend lane it was built for: "cpu", "vulkan", ...
// The numerics of this build (docs/numerics.md): what decides the bits of a result besides the model and
// the input, as one line: "<lane>/<isa> <compiler> llama.cpp-<commit>+<n patches>.<series>", e.g.
// "cpu/x86-64-v3 gcc-12.2.0 llama.cpp-0c1e57098bba+26.1f2e3d4c5b6a". <isa> is what ggml's CPU backend
// was compiled for (its ggml_cpu_has_* answers), "native-..." for a build for its build host's own CPU.
DGR_API const char * dgr_numerics_build(void);
// The numerics of an opened engine: the build's, then the switches of this open that change rounding
// ("reference" or "fast" kernels, the KV cache type, flash attention). Two stages compute the same bits for
// the same input only when these strings are equal. Owned by the engine.
DGR_API const char * dgr_engine_numerics(dgr_engine * eng);
DGR_API const char * dgr_last_error(void);
// details of the last DGR_E_CACHE_MISS on this thread
DGR_API void         dgr_last_cache_miss(int64_t * held, int64_t * expected);

DGR_API int32_t dgr_engine_open (const char * path, const dgr_open_params * params, dgr_engine ** out);
DGR_API void    dgr_engine_close(dgr_engine * eng);
DGR_API int32_t dgr_engine_describe(dgr_engine * eng, dgr_stage_info * out);
DGR_API int32_t dgr_engine_memory  (dgr_engine * eng, dgr_memory * out);

DGR_API int32_t dgr_session_open    (dgr_engine * eng, const char * session_id, int64_t epoch);
DGR_API int32_t dgr_session_close   (dgr_engine * eng, const char * session_id, int64_t epoch);
DGR_API int32_t dgr_session_n_cached(dgr_engine * eng, const char * session_id, int64_t epoch, int32_t * out);
// Speculative decoding: drop the session's cached positions >= n_keep (the drafted positions the last
// stage rejected), so the next step may start at n_keep. n_keep must be in [0, n_cached]. A recurrent
// or hybrid model keeps only its latest state and cannot drop a partial range: DGR_E_UNSUPPORTED. A stage
// with n_draft_max > 0 (V4's snapshots) rolls back only positions of the session's last step, at most
// n_draft_max of them, once per step; anything else is DGR_E_CACHE_MISS (re-prefill at a new epoch). An MTP
// stage rolls its MTP context back too.
DGR_API int32_t dgr_session_truncate(dgr_engine * eng, const char * session_id, int64_t epoch, int32_t n_keep);
// 1 when dgr_session_truncate can drop a partial range for this model, 0 when it cannot (recurrent, hybrid).
DGR_API int32_t dgr_engine_can_truncate(dgr_engine * eng);

// The prefix cache (issue 23, docs/worker.md "Prefix cache"): a session's cached positions on this stage's
// layers as bytes (llama_state_seq_get_data), and back into an open, empty session of the same engine
// (llama_state_seq_set_data), keeping only its first n_keep positions (a prefix of what was saved; the rest
// is dropped as dgr_session_truncate does, so only where dgr_engine_can_truncate). get: *size gets the
// bytes needed; the state is written when cap >= that.
DGR_API int32_t dgr_session_state_get(dgr_engine * eng, const char * session_id, int64_t epoch, void * buf,
                                      uint64_t cap, uint64_t * size, int32_t * n_positions);
DGR_API int32_t dgr_session_state_set(dgr_engine * eng, const char * session_id, int64_t epoch, const void * buf,
                                      uint64_t size, int32_t n_positions, int32_t n_keep);

// One llama_decode for all steps (distinct sessions). Either every step runs or none does. On an MTP stage
// (has_mtp) it also feeds the session's MTP context the same positions (the MTP block's KV covers them all).
DGR_API int32_t dgr_forward(dgr_engine * eng, int32_t n_steps, const dgr_step * steps, dgr_step_out * outs);

// MTP drafting (has_mtp; docs/deepseek4.md section 4): `token` is the token just drawn for the session's next
// position (n_cached); k chained greedy MTP steps write drafts[0..k). The MTP cache is left as it was (the
// draft rows are removed), so the verification step [token, drafts...] feeds them again. 1 <= k <= n_draft_max.
// DGR_E_UNSUPPORTED on a stage without MTP (bundle.include_mtp off, or not the last stage).
DGR_API int32_t dgr_mtp_draft(dgr_engine * eng, const char * session_id, int64_t epoch, int32_t token, int32_t k,
                              int32_t * drafts);

// End of generation, llama.cpp's own notion: bos, eos, eot, and every id llama_vocab_is_eog marks (eos, eot,
// eom, fim pad/rep/sep and the known end-of-turn texts such as <|im_end|>, <end_of_turn>, <|eot_id|>),
// ascending, written to `eog` up to `eog_cap` (out->n_eog says how many there are: call again with a larger
// array when it is more). dgr_vocab_read loads only the vocabulary of the GGUF at `path` (a whole model or
// any stage file: every stage keeps the tokenizer), no weights; dgr_engine_vocab reads an open engine's.
DGR_API int32_t dgr_vocab_read  (const char * path, dgr_vocab_info * out, int32_t * eog, int32_t eog_cap);
DGR_API int32_t dgr_engine_vocab(dgr_engine * eng, dgr_vocab_info * out, int32_t * eog, int32_t eog_cap);

// Returns the number of ids (written up to cap), or -1 on error.
DGR_API int32_t dgr_tokenize  (dgr_engine * eng, const char * text, int32_t add_special, int32_t * out, int32_t cap);
// Returns the number of bytes (written up to cap), or -1 on error.
DGR_API int32_t dgr_detokenize(dgr_engine * eng, const int32_t * ids, int32_t n, char * out, int32_t cap);

// The pinned llama.cpp's own quantizer (llama_model_quantize) on a whole GGUF: `ftype` is a llama_ftype
// (LLAMA_FTYPE_MOSTLY_Q4_K_M = 15, ...), every matrix the quantizer would quantize gets its default type
// (`pure`), the output and embedding matrices included. Types that need an importance matrix (IQ1/IQ2/
// IQ3_XXS) get a uniform one. For test models of every weight type; n_threads 0: all cores.
DGR_API int32_t dgr_quantize(const char * src, const char * dst, int32_t ftype, int32_t n_threads);

// The one sampler (dgr_sample.cpp): the last stage's draw from one logits row. dgr-worker's last stage draws
// every token with it (worker/server/last_stage.cpp), the fake engine library carries the same code, and tests
// draw with it to compare. Greedy when temperature <= 0, else temperature, top_k (0: off), top_p (0 or 1:
// off), the uniform keyed by (seed, position). Returns the token id, -1 on bad arguments. No fused
// multiply-add: each product and sum is rounded on its own, so a token does not depend on the compiler.
DGR_API int32_t dgr_sample(const float * logits, int32_t n_vocab, double temperature, int32_t top_k, double top_p,
                           uint64_t seed, int64_t position);
// Log-probabilities of one logits row (the model's distribution: log-softmax of the raw row, in double):
// *chosen_lp gets token `chosen`'s (chosen < 0: skipped), and the `top` most likely tokens (most likely
// first, ties: lower id first) go to top_ids/top_lps. Returns how many were written (min(top, n_vocab)),
// -1 on bad arguments. A -INFINITY logit (masked) has log-probability -INFINITY.
DGR_API int32_t dgr_logprobs(const float * logits, int32_t n_vocab, int32_t chosen, float * chosen_lp, int32_t top,
                             int32_t * top_ids, float * top_lps);
// Its parts, for cross-checks: e^d for d <= 0 (a fixed polynomial in exact IEEE steps), and the uniform
// in [0, 1) keyed by (seed, position).
DGR_API double  dgr_exp_fixed(double d);
DGR_API double  dgr_uniform(uint64_t seed, int64_t position);

// Grammar-constrained sampling (dgr_grammar.cpp): the pinned llama.cpp's grammar sampler over an open
// engine's vocabulary. Exactly one of `gbnf` (GBNF, root rule "root") and `json_schema` (a JSON Schema,
// turned into GBNF by llama.cpp's json_schema_to_grammar).
// apply sets every logit the grammar forbids next to -INFINITY (DGR_E_ENGINE when it forbids all of them);
// accept advances the grammar over a token, refusing (and changing nothing) when the grammar forbids it.
// open refuses (DGR_E_ENGINE) a grammar whose repetitions ({m}, {m,}, {m,n}) would expand to more than
// DGR_GRAMMAR_MAX_EXPANSION (dgr_grammar.cpp: 500,000) elements: llama.cpp's parser copies what a repetition
// repeats up to n times, so 157 KB of `"a"{0,2000}` took 34 s and 5 GB (it refuses one count over 2000,
// never their sum).
typedef struct dgr_grammar dgr_grammar;
DGR_API int32_t dgr_grammar_open  (dgr_engine * eng, const char * gbnf, const char * json_schema, dgr_grammar ** out);
DGR_API void    dgr_grammar_close (dgr_grammar * g);
DGR_API int32_t dgr_grammar_apply (dgr_grammar * g, float * logits, int32_t n_vocab);
DGR_API int32_t dgr_grammar_accept(dgr_grammar * g, int32_t token);
// The GBNF llama.cpp's json_schema_to_grammar makes of a JSON Schema: returns its length in bytes (written
// up to cap; call again with a larger buffer when it is more), -1 on error (dgr_last_error says why).
DGR_API int32_t dgr_json_schema_to_grammar(const char * json_schema, char * out, int32_t cap);

#ifdef __cplusplus
}
#endif
