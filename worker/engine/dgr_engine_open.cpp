// The engine opened on a stage file (or a whole GGUF with a range override): the file's dgr.* keys read
// and checked against its tensors before llama.cpp loads it, the context made, the stage described.
#include "dgr_engine.h"
#include "dgr_engine_internal.h"
#include "dgr_contract.h"
#if DGR_WITH_HOOKS
#include "dgr_hooks.h"
#endif

#include "ggml.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"
#include "gguf.h"
#include "llama.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

using namespace dgr_engine_detail;

namespace {

// Given no threadpool, llama.cpp's CPU backend makes one for every graph it computes and joins it after: with
// n_threads > 1 each decode step starts threads on fresh stacks and joins them. llama.cpp's own tools attach one
// pool for a context's life (common_threadpools); so does the engine, for its contexts (their forwards never run
// at once: the engine is used under one lock). Threads still split only rows and columns: no bit changes.
// Looked up through the CPU backend's registry, as llama.cpp's tools do: where it has none, each graph keeps
// making its own.
// `poll`: dgr_open_params.poll (checked by the caller).
void attach_threadpool(dgr_engine * eng, int32_t n_threads, int32_t poll) {
    if (n_threads < 2) return;  // one thread: the caller's own, no pool
    ggml_backend_dev_t cpu = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    ggml_backend_reg_t reg = cpu ? ggml_backend_dev_backend_reg(cpu) : nullptr;
    auto make = reg ? (decltype(ggml_threadpool_new) *) ggml_backend_reg_get_proc_address(reg, "ggml_threadpool_new")
                    : nullptr;
    auto release = reg ? (decltype(ggml_threadpool_free) *) ggml_backend_reg_get_proc_address(reg, "ggml_threadpool_free")
                       : nullptr;
    if (!make || !release) return;
    ggml_threadpool_params tp = ggml_threadpool_params_default(n_threads);
    tp.poll = poll;
    eng->threadpool = make(&tp);
    if (!eng->threadpool) return;
    eng->threadpool_free = release;
    llama_attach_threadpool(eng->ctx, eng->threadpool, nullptr);
    if (eng->mtp) llama_attach_threadpool(eng->mtp, eng->threadpool, nullptr);
}

// --- what the stage file says about itself (read before llama.cpp loads it)

struct file_facts {
    std::string arch;
    int64_t n_layer = -1;
    int64_t n_embd  = -1;
    bool has_range = false;
    int64_t begin = 0, end = 0, total = 0;
    int64_t n_streams = 1;
    bool token_ids = false;
    int64_t arch_streams = 1;      // <arch>.hyper_connection.count (V4 mHC), else 1
    int64_t hash_layers  = 0;      // <arch>.hash_layer_count: layers that route by token id
    std::set<int64_t> blocks;             // block ids that have tensors
    bool has_tok_embd = false, has_output_norm = false, has_output = false;
    bool mtp = false;              // dgr.mtp: the last stage of an include_mtp bundle
    int64_t n_nextn = 0;           // <arch>.nextn_predict_layers
    bool has_eh_proj = false;      // blk.<n_layer>.nextn.eh_proj.weight: the MTP block is in the file
};

bool gguf_int(const gguf_context * g, const char * key, int64_t & out, const std::string & path) {
    const int64_t id = gguf_find_key(g, key);
    if (id < 0) {
        return false;
    }
    switch (gguf_get_kv_type(g, id)) {
        case GGUF_TYPE_UINT8:  out = gguf_get_val_u8 (g, id); break;
        case GGUF_TYPE_INT8:   out = gguf_get_val_i8 (g, id); break;
        case GGUF_TYPE_UINT16: out = gguf_get_val_u16(g, id); break;
        case GGUF_TYPE_INT16:  out = gguf_get_val_i16(g, id); break;
        case GGUF_TYPE_UINT32: out = gguf_get_val_u32(g, id); break;
        case GGUF_TYPE_INT32:  out = gguf_get_val_i32(g, id); break;
        case GGUF_TYPE_UINT64: out = (int64_t) gguf_get_val_u64(g, id); break;
        case GGUF_TYPE_INT64:  out = gguf_get_val_i64(g, id); break;
        default:
            throw dgr_exc(DGR_E_ARTIFACT, fmt("%s: key %s must be an integer", path.c_str(), key));
    }
    return true;
}

file_facts read_facts(const std::string & path) {
    gguf_init_params ip = { /*no_alloc =*/ true, /*ctx =*/ nullptr };
    gguf_context * g = gguf_init_from_file(path.c_str(), ip);
    if (!g) {
        throw dgr_exc(DGR_E_ARTIFACT, fmt("%s: not a readable GGUF file (missing, truncated or corrupt)", path.c_str()));
    }
    file_facts f;
    try {
        const int64_t aid = gguf_find_key(g, "general.architecture");
        if (aid < 0 || gguf_get_kv_type(g, aid) != GGUF_TYPE_STRING) {
            throw dgr_exc(DGR_E_ARTIFACT, fmt("%s: no general.architecture key", path.c_str()));
        }
        f.arch = gguf_get_val_str(g, aid);
        gguf_int(g, (f.arch + ".block_count").c_str(), f.n_layer, path);
        // block_count includes trailing MTP (nextn) blocks; the trunk is what a range divides
        int64_t n_nextn = 0;
        if (gguf_int(g, (f.arch + ".nextn_predict_layers").c_str(), n_nextn, path) && n_nextn > 0 && n_nextn < f.n_layer) {
            f.n_layer -= n_nextn;
            f.n_nextn = n_nextn;
        }
        gguf_int(g, (f.arch + ".embedding_length").c_str(), f.n_embd, path);

        const bool hb = gguf_int(g, DGR_KEY_LAYER_BEGIN, f.begin, path);
        const bool he = gguf_int(g, DGR_KEY_LAYER_END,   f.end,   path);
        const bool ht = gguf_int(g, DGR_KEY_LAYER_TOTAL, f.total, path);
        f.has_range = hb || he || ht;
        if (f.has_range && !(hb && he && ht)) {
            throw dgr_exc(DGR_E_ARTIFACT, fmt("%s: has only some of %s, %s, %s; rebuild the bundle",
                    path.c_str(), DGR_KEY_LAYER_BEGIN, DGR_KEY_LAYER_END, DGR_KEY_LAYER_TOTAL));
        }
        gguf_int(g, (f.arch + ".hyper_connection.count").c_str(), f.arch_streams, path);
        gguf_int(g, (f.arch + ".hash_layer_count").c_str(), f.hash_layers, path);
        if (!gguf_int(g, DGR_KEY_BOUNDARY_N_STREAMS, f.n_streams, path)) {
            f.n_streams = f.arch_streams;
        }
        const int64_t tid = gguf_find_key(g, DGR_KEY_BOUNDARY_TOKEN_IDS);
        if (tid >= 0 && gguf_get_kv_type(g, tid) == GGUF_TYPE_BOOL) {
            f.token_ids = gguf_get_val_bool(g, tid);
        }
        const int64_t mid = gguf_find_key(g, DGR_KEY_MTP);
        if (mid >= 0 && gguf_get_kv_type(g, mid) == GGUF_TYPE_BOOL) {
            f.mtp = gguf_get_val_bool(g, mid);
        }
        const std::string eh_proj = fmt("blk.%lld.nextn.eh_proj.weight", (long long) f.n_layer);
        int64_t bn = -1;
        if (gguf_int(g, DGR_KEY_BOUNDARY_N_EMBD, bn, path) && f.n_embd >= 0 && bn != f.n_embd) {
            throw dgr_exc(DGR_E_ARTIFACT, fmt("%s: %s = %lld but %s.embedding_length = %lld",
                    path.c_str(), DGR_KEY_BOUNDARY_N_EMBD, (long long) bn, f.arch.c_str(), (long long) f.n_embd));
        }
        int64_t si = -1, sc = -1;
        if (gguf_int(g, DGR_KEY_STAGE_INDEX, si, path) && gguf_int(g, DGR_KEY_STAGE_COUNT, sc, path) &&
                (si < 0 || si >= sc)) {
            throw dgr_exc(DGR_E_ARTIFACT, fmt("%s: %s = %lld is not below %s = %lld",
                    path.c_str(), DGR_KEY_STAGE_INDEX, (long long) si, DGR_KEY_STAGE_COUNT, (long long) sc));
        }
        for (int64_t i = 0; i < gguf_get_n_tensors(g); ++i) {
            const char * name = gguf_get_tensor_name(g, i);
            long long bid = -1;
            if (sscanf(name, "blk.%lld.", &bid) == 1) {
                f.blocks.insert(bid);
                f.has_eh_proj = f.has_eh_proj || eh_proj == name;
            } else if (strncmp(name, "token_embd.", 11) == 0) {
                f.has_tok_embd = true;
            } else if (strncmp(name, "output_norm.", 12) == 0) {
                f.has_output_norm = true;
            } else if (strncmp(name, "output.", 7) == 0) {
                f.has_output = true;
            }
        }
    } catch (...) {
        gguf_free(g);
        throw;
    }
    gguf_free(g);
    return f;
}

// A stage file's keys must agree with its tensors: exactly the owned blocks, the input on the first
// stage, the output on the last.
void check_stage_file(const std::string & path, const file_facts & f) {
    if (!f.has_range) {
        return;
    }
    const char * p = path.c_str();
    if (f.total != f.n_layer) {
        throw dgr_exc(DGR_E_ARTIFACT, fmt("%s: %s = %lld but %s.block_count (less MTP blocks) = %lld",
                p, DGR_KEY_LAYER_TOTAL, (long long) f.total, f.arch.c_str(), (long long) f.n_layer));
    }
    if (!dgr_range_valid(f.begin, f.end, f.total)) {
        throw dgr_exc(DGR_E_ARTIFACT, fmt("%s: layer range [%lld, %lld) is not inside [0, %lld)",
                p, (long long) f.begin, (long long) f.end, (long long) f.total));
    }
    for (int64_t il = f.begin; il < f.end; ++il) {
        if (!f.blocks.count(il)) {
            throw dgr_exc(DGR_E_ARTIFACT, fmt("%s: keys say layers [%lld, %lld) but it has no tensors of layer %lld",
                    p, (long long) f.begin, (long long) f.end, (long long) il));
        }
    }
    for (int64_t il : f.blocks) {
        if ((il < f.begin || il >= f.end) && il < f.total) {
            throw dgr_exc(DGR_E_ARTIFACT, fmt("%s: keys say layers [%lld, %lld) but it has tensors of layer %lld",
                    p, (long long) f.begin, (long long) f.end, (long long) il));
        }
    }
    if (f.begin == 0 && !f.has_tok_embd) {
        throw dgr_exc(DGR_E_ARTIFACT, fmt("%s: a first stage (begin = 0) needs token_embd", p));
    }
    // a head: output_norm (most), output, or the tied embedding (olmo's final norm has no weights)
    if (f.end == f.total && !(f.has_output_norm || f.has_output || f.has_tok_embd)) {
        throw dgr_exc(DGR_E_ARTIFACT, fmt("%s: a last stage (end = %lld) needs the output head (output_norm, output "
                "or the tied token_embd)", p, (long long) f.total));
    }
    if (f.end < f.total && (f.has_output_norm || f.has_output)) {
        throw dgr_exc(DGR_E_ARTIFACT, fmt("%s: a non-last stage must not hold the output tensors", p));
    }
    if (f.n_streams < 1) {
        throw dgr_exc(DGR_E_ARTIFACT, fmt("%s: %s must be >= 1", p, DGR_KEY_BOUNDARY_N_STREAMS));
    }
    if (f.mtp) {
        // the MTP context is made only when its graph has what it reads (llama.cpp aborts otherwise)
        if (f.end != f.total) {
            throw dgr_exc(DGR_E_ARTIFACT, fmt("%s: %s is set on a stage [%lld, %lld) that is not the last of %lld "
                    "layers; only the last stage owns MTP: rebuild the bundle", p, DGR_KEY_MTP,
                    (long long) f.begin, (long long) f.end, (long long) f.total));
        }
        if (f.n_nextn < 1 || !f.has_eh_proj || !f.has_tok_embd) {
            throw dgr_exc(DGR_E_ARTIFACT, fmt("%s: %s is set but the file lacks %s (%s.nextn_predict_layers = %lld, "
                    "blk.%lld.nextn.eh_proj.weight %s, token_embd %s): rebuild the bundle with bundle.include_mtp = true "
                    "from a model with an MTP block", p, DGR_KEY_MTP,
                    f.n_nextn < 1 ? "an MTP block" : (!f.has_eh_proj ? "the MTP block's tensors" : "the token embedding copy"),
                    f.arch.c_str(), (long long) f.n_nextn, (long long) f.total, f.has_eh_proj ? "present" : "missing",
                    f.has_tok_embd ? "present" : "missing"));
        }
    }
}

} // namespace

extern "C" {

int32_t dgr_engine_open(const char * path_c, const dgr_open_params * params, dgr_engine ** out) {
    return guarded([&] {
        if (!path_c || !params || !out) {
            throw dgr_exc(DGR_E_ENGINE, "engine_open: null argument");
        }
        *out = nullptr;
        init_backend_once();
        const std::string path = path_c;
        file_facts f = read_facts(path);
        check_stage_file(path, f);

        const bool override_range = params->layer_end > 0;
        if (override_range && f.has_range) {
            throw dgr_exc(DGR_E_ENGINE, fmt("%s: is a stage file (range [%lld, %lld)); a range override applies only to a whole GGUF",
                    path.c_str(), (long long) f.begin, (long long) f.end));
        }
        int64_t begin = 0, end = f.n_layer;
        if (f.has_range) {
            begin = f.begin; end = f.end;
        } else if (override_range) {
            begin = params->layer_begin; end = params->layer_end;
            if (!dgr_range_valid(begin, end, f.n_layer)) {
                throw dgr_exc(DGR_E_ENGINE, fmt("layer range [%lld, %lld) is not inside [0, %lld) of %s",
                        (long long) begin, (long long) end, (long long) f.n_layer, path.c_str()));
            }
        }
        const bool partial = begin != 0 || end != f.n_layer;
        if (partial && !DGR_WITH_HOOKS) {
            throw dgr_exc(DGR_E_UNSUPPORTED, "this engine was built without the dgr hooks (unpatched llama.cpp): it runs whole models only");
        }

        if (params->fast_kernels < DGR_KERNELS_REFERENCE || params->fast_kernels > DGR_KERNELS_INVARIANT) {
            throw dgr_exc(DGR_E_ENGINE, fmt("fast_kernels = %d: give 0 (the reference kernels), 1 (llama.cpp's "
                                            "shape-dependent kernels) or 2 (the batch-invariant dispatch)",
                                            (int) params->fast_kernels));
        }
        auto eng = std::make_unique<dgr_engine>();
        eng->path = path;

        std::vector<llama_model_kv_override> kvo;
        if (override_range) {
            auto add = [&](const char * key, int64_t v) {
                llama_model_kv_override o {};
                o.tag = LLAMA_KV_OVERRIDE_TYPE_INT;
                snprintf(o.key, sizeof(o.key), "%s", key);
                o.val_i64 = v;
                kvo.push_back(o);
            };
            add(DGR_KEY_LAYER_BEGIN, begin);
            add(DGR_KEY_LAYER_END,   end);
            add(DGR_KEY_LAYER_TOTAL, f.n_layer);
            add(DGR_KEY_BOUNDARY_N_STREAMS, f.n_streams);
            // what a bundle would write: the ids ride along into a stage that starts among the hash layers
            f.token_ids = dgr_needs_token_ids(begin, f.hash_layers);
            llama_model_kv_override o {};
            o.tag = LLAMA_KV_OVERRIDE_TYPE_BOOL;
            snprintf(o.key, sizeof(o.key), "%s", DGR_KEY_BOUNDARY_TOKEN_IDS);
            o.val_bool = f.token_ids;
            kvo.push_back(o);
            kvo.push_back(llama_model_kv_override {}); // terminator (key[0] == 0)
        }

        if (params->n_draft_max < 0) {
            throw dgr_exc(DGR_E_ENGINE, fmt("n_draft_max = %d: must be >= 0", params->n_draft_max));
        }
        if (params->poll < 0 || params->poll > 100) {
            throw dgr_exc(DGR_E_ENGINE, fmt("poll = %d: the threads' polling level must be 0-100 (0: sleep "
                                            "between graphs, 50: llama.cpp's default)", params->poll));
        }
        llama_model_params mp = llama_model_default_params();
        mp.load_mtp = f.mtp; // the MTP block (dgr_hooks: owned by the dgr.mtp last stage only)
        mp.n_gpu_layers = params->n_gpu_layers; // < 0: every owned layer on the lane's device, if it has one
        mp.kv_overrides = kvo.empty() ? nullptr : kvo.data();
        // batch invariance: a repacked weight layout (ggml's CPU "extra" buffer types: repack, AMX) is
        // multiplied by one kernel for a single row (gemv) and another for several (gemm), which round
        // differently. The invariant kernel set takes the repacked layouts whose two kernels give a row the same
        // bits (patch 0028: Q4_K as 8x8 on AVX2; the switch is process-wide and stays on, and only engines
        // that ask for extra buffer types see it). The reference kernels, a GPU lane and fast_kernels keep them
        // off: the AMX path crashed on this machine with one KV stream per session (SIGSEGV in
        // ggml_backend_amx_mul_mat), and fast_kernels only measures the CPU kernels.
        // without the hooks (an engine over the unpatched tree) the CPU backend keeps its fast kernels; a GPU
        // lane's kernels (and llama.cpp's offload of large batches to the GPU) are chosen by the batch's shape
        const bool gpu_lane = std::strcmp(dgr_engine_lane(), "cpu") != 0;
        const bool invariant_layouts = DGR_WITH_HOOKS && params->fast_kernels == DGR_KERNELS_INVARIANT && !gpu_lane;
#if DGR_WITH_HOOKS
        if (invariant_layouts) {
            dgr_cpu_invariant_layouts();
        }
#endif
        mp.use_extra_bufts = invariant_layouts;
        take_log_errors();
        eng->model = llama_model_load_from_file(path.c_str(), mp);
        if (!eng->model) {
            std::string why = take_log_errors();
            const bool unsupported = why.find("is not yet ported to layer ranges") != std::string::npos;
            throw dgr_exc(unsupported ? DGR_E_UNSUPPORTED : DGR_E_ARTIFACT,
                    fmt("%s: llama.cpp could not load it: %s", path.c_str(), why.empty() ? "(no reason logged)" : why.c_str()));
        }
        eng->vocab = llama_model_get_vocab(eng->model);

        const bool is_first = begin == 0;
        const bool is_last  = end == f.n_layer;
        const int32_t max_sessions = std::max(1, params->max_sessions);
        int32_t n_ctx_seq = params->n_ctx > 0 ? params->n_ctx : DGR_DEFAULT_N_CTX;
        const int32_t n_ctx_train = llama_model_n_ctx_train(eng->model);
        if (n_ctx_train > 0) {
            n_ctx_seq = std::min(n_ctx_seq, n_ctx_train);
        }

        bool shared_kv = false;
        llama_context_params cp = llama_context_default_params();
        cp.n_seq_max    = (uint32_t) max_sessions;
        // batch invariance: one KV stream per session. In one shared stream a session's cells land where
        // other sessions left room, and attention sums them in cell order, so its logits depended on its
        // neighbours. Sessions still share forwards (llama.cpp puts consecutive streams in one ubatch).
        // kimi-linear's and minimax-01's graphs cannot take several streams at the pin (graph_reserve
        // aborts on a broadcast add): they keep one shared stream. As hybrids they decode one session per
        // forward (below), so no other session's rows share their forwards, but a session's cells land in
        // the shared stream wherever there is room: not guaranteed invariant, and Describe says so.
        shared_kv = f.arch == "kimi-linear" || f.arch == "minimax-01";
        cp.kv_unified   = shared_kv;
        cp.n_ctx        = (uint32_t) n_ctx_seq * (uint32_t) max_sessions;
        cp.n_batch      = cp.n_ctx;
        cp.n_ubatch     = params->n_ubatch > 0 ? (uint32_t) params->n_ubatch : 512;
        const int32_t nt = params->n_threads > 0 ? params->n_threads : (int32_t) std::max(1u, std::thread::hardware_concurrency());
        cp.n_threads       = nt;
        cp.n_threads_batch = nt;
        cp.embeddings   = !is_last;              // a non-last stage outputs the residual
        cp.pooling_type = LLAMA_POOLING_TYPE_NONE;
        if (params->kv_f32) {
            cp.type_k = GGML_TYPE_F32;
            cp.type_v = GGML_TYPE_F32;
        }
        cp.no_perf      = true;
        // rollback depth: llama.cpp clamps it to 0 for an architecture without snapshots
        cp.n_rs_seq     = (uint32_t) (params->n_draft_max > 0 ? params->n_draft_max : (f.mtp ? DGR_MTP_MAX_K : 0));
        {
#if DGR_WITH_HOOKS
            // the hook reads the process-wide setting when the context creates its CPU backend
            static std::mutex init_mu;
            std::lock_guard<std::mutex> init_lock(init_mu);
            dgr_set_cpu_kernels(params->fast_kernels);
#endif
            eng->ctx = llama_init_from_model(eng->model, cp);
            if (!eng->ctx) {
                std::string why = take_log_errors();
                throw dgr_exc(DGR_E_ENGINE, fmt("%s: could not create a context: %s", path.c_str(), why.c_str()));
            }
            if (f.mtp) {
                if (llama_model_n_layer_nextn(eng->model) < 1) {
                    throw dgr_exc(DGR_E_ARTIFACT, fmt("%s: %s is set but llama.cpp loaded no MTP block", path.c_str(), DGR_KEY_MTP));
                }
                mtp_open(eng.get(), cp);
            }
        }
        attach_threadpool(eng.get(), nt, params->poll);
        eng->n_rs_seq = (int32_t) llama_n_rs_seq(eng->ctx);

        dgr_stage_info & in = eng->info;
        snprintf(in.arch, sizeof(in.arch), "%s", f.arch.c_str());
        in.layer_begin = (int32_t) begin;
        in.layer_end   = (int32_t) end;
        in.n_layer     = (int32_t) f.n_layer;
        in.n_embd      = llama_model_n_embd(eng->model);
        in.n_streams   = (int32_t) f.n_streams;
        in.n_vocab     = llama_vocab_n_tokens(eng->vocab);
        in.is_first    = is_first;
        in.is_last     = is_last;
        eng->batch_token_ids = dgr_takes_token_ids(begin, f.token_ids);
        // the MTP context pairs every position's token with h (docs/deepseek4.md 4, contract item 2)
        in.needs_token_ids = eng->batch_token_ids || (eng->mtp && !is_first);
        in.has_vocab   = in.n_vocab > 0;
        in.n_ctx       = n_ctx_seq;
        in.max_sessions = max_sessions;
        in.batch_invariant = DGR_WITH_HOOKS && params->fast_kernels != DGR_KERNELS_FAST && !shared_kv && !gpu_lane;
        in.has_mtp     = eng->mtp != nullptr;
        eng->numerics  = open_numerics(DGR_WITH_HOOKS ? params->fast_kernels : DGR_KERNELS_FAST, params->kv_f32 != 0);
        in.n_draft_max = eng->n_rs_seq;
        snprintf(in.matmul_kernels, sizeof(in.matmul_kernels), "%s",
                 open_matmul_kernels(*eng->model, params->fast_kernels, gpu_lane, is_last).c_str());
        for (int32_t s = max_sessions - 1; s >= 0; --s) {
            eng->free_seqs.push_back(s);
        }
        *out = eng.release();
    });
}

void dgr_engine_close(dgr_engine * eng) {
    delete eng;
}

int32_t dgr_engine_describe(dgr_engine * eng, dgr_stage_info * out) {
    return guarded([&] {
        if (!eng || !out) throw dgr_exc(DGR_E_ENGINE, "describe: null argument");
        *out = eng->info;
    });
}

} // extern "C"
