// Layer-range ownership inside llama.cpp: the logic behind the call sites that
// patches/llama.cpp/*.patch insert. Compiled into the `llama` target (worker/CMakeLists.txt), so it
// may use llama.cpp's internal headers. Nothing here is part of the C ABI (see dgr_engine.h).
//
// A model owns layers [begin, end) of n_layer (global numbering kept). The range comes from the
// stage GGUF's dgr.layer.* keys, or from kv overrides of the same keys (tests on a full GGUF).
// Without a range (`active == false`) every hook is the identity: the model is the whole model.
#pragma once

#include <cstdint>

struct ggml_tensor;
struct llama_hparams;
struct llama_model_loader;
struct llm_graph_context;
struct LLM_TN_IMPL;

struct dgr_layer_range {
    bool     active    = false; // a range was given
    int32_t  begin     = 0;     // first owned layer
    int32_t  end       = 0;     // one past the last owned layer
    uint32_t n_streams = 1;     // residual streams crossing the seam (V4 mHC: 4)
    bool     token_ids = false; // a non-first stage also takes the token ids (sideband, V4 hash layers)
    bool     mtp       = false; // a last stage that owns the MTP (nextn) blocks past n_layer() and token_embd (dgr.mtp)
};

// patch 0001: read the range after the arch hparams are known; throws std::runtime_error when the
// range is inconsistent or the architecture has not opted in (see dgr_arch_supports_range).
// (`arch` is an llm_arch; int here so this header stays light enough for llama-hparams.h.)
void dgr_load_range(llama_model_loader & ml, int arch, llama_hparams & hparams);
bool dgr_arch_supports_range(int arch);
// whether the file (or the kv overrides) carries a dgr layer range: for arch probes that run before
// the range is loaded (deepseek4's MTP probe)
bool dgr_is_stage_file(const llama_model_loader & ml);

// patch 0002: whether the model creates (and loads) this tensor. Non-owned repeating tensors,
// input tensors past the first stage and output tensors before the last stage are not created. A last
// stage marked dgr.mtp also owns the MTP blocks (>= n_layer()) and token_embd, which the MTP graph reads.
bool dgr_tensor_owned(const llama_hparams & hparams, const LLM_TN_IMPL & tn, int flags);

// patch 0003: whether a layer gets KV cache / recurrent state (an MTP block: only on a dgr.mtp last stage).
bool dgr_layer_owned(const llama_hparams & hparams, uint32_t il);

// patch 0004 and the per-arch opt-ins.
bool dgr_is_first(const llama_hparams & hparams);
bool dgr_is_last(const llama_hparams & hparams);
int  dgr_layer_begin(const llama_hparams & hparams);   // loop start of a graph
int  dgr_layer_end(const llama_hparams & hparams);     // loop end of a graph

// A non-first stage: the graph input is the incoming boundary [n_streams*n_embd, n_tokens] taken from
// ubatch.embd (no token lookup, no embedding scaling). With the token-id sideband (dgr.boundary.token_ids)
// the ubatch's token ids become the graph's token input too (res->t_inp_tokens, as build_inp_embd sets it).
ggml_tensor * dgr_build_inp_boundary(const llm_graph_context & g);

// After the owned layers: on a non-last stage, make `cur` (the raw residual, every output token in
// batch order) the graph's embeddings output and return true; the arch then returns without norm/head.
bool dgr_build_boundary_out(const llm_graph_context & g, ggml_tensor * cur, ggml_tensor * inp_out_ids);

// Batch invariance (the patches "the CPU backend runs its reference kernels" and "the CPU backend's
// batch-invariant dispatch"): llama.cpp's CPU backend picks kernels by the batch's shape (a tiled GEMM for K-
// and I-quant matrices at 8 rows or more, llamafile's sgemm from 2 rows, a tiled or KV-split flash
// attention), and each rounds differently, so a session's logits depended on how many rows shared its
// forward. ggml's reference kernels compute every row alone; its batch_invariant switch chooses every kernel
// by its operands (the tiled attention for every number of queries, vec_dot for every row). Every context's
// CPU backend gets the process-wide setting (DGR_KERNELS_*, dgr_engine.h) when it is made.
struct ggml_backend;
void dgr_set_cpu_kernels(int kernels);
int dgr_cpu_kernels();
void dgr_configure_cpu_backend(ggml_backend * backend_cpu);
// The invariant kernel set's weight layouts, process-wide, before a model loads: the CPU's extra buffer types take
// only the repacked layouts whose one-row and many-row kernels give a row the same bits (patch 0028: Q4_K as 8x8 on
// AVX2), never AMX. Throws when the CPU backend lacks the switch.
void dgr_cpu_invariant_layouts();
