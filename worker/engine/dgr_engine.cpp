// The ShardEngine: the C ABI of dgr_engine.h over (patched) llama.cpp.
// Loading, sessions and forward use only llama.cpp's public API (llama.h, gguf.h), so the same file
// also builds over the unpatched tree (DGR_WITH_HOOKS=0), which is how the patched library is checked
// to compute the whole model byte-identically. One exception, at the end of this file: the memory
// report reads two internal headers of the same tree (llama-ext.h, llama-model.h), because the pinned
// public API has no per-buffer breakdown of weights, KV cache and compute, nor which device holds the
// weights. Each build reads them from its own tree (the patches leave both files as they are; only
// llama_hparams, which llama-model.h includes, gains the range), and the report only reads: nothing
// computed depends on it.
#include "dgr_engine.h"
#include "dgr_engine_internal.h"
#include "dgr_contract.h"
#if DGR_WITH_HOOKS
#include "dgr_hooks.h"
#endif

#include "ggml.h"
#include "ggml-backend.h"
#include "gguf.h"
#include "llama.h"

#include <algorithm>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#ifndef DGR_WITH_HOOKS
#define DGR_WITH_HOOKS 1
#endif

namespace {

thread_local std::string g_last_error;
thread_local int64_t     g_miss_held     = 0;
thread_local int64_t     g_miss_expected = 0;

// llama.cpp's own error lines (e.g. why a load failed), kept to explain a null return
std::mutex  g_log_mutex;
std::string g_log_errors;

using dgr_exc = dgr_engine_error;

std::string fmt(const char * f, ...) {
    va_list ap;
    va_start(ap, f);
    char buf[1024];
    vsnprintf(buf, sizeof(buf), f, ap);
    va_end(ap);
    return buf;
}

void log_cb(ggml_log_level level, const char * text, void *) {
    static const bool verbose = getenv("DGR_ENGINE_VERBOSE") != nullptr;
    if (level == GGML_LOG_LEVEL_ERROR) {
        std::lock_guard<std::mutex> lock(g_log_mutex);
        g_log_errors += text;
        if (g_log_errors.size() > 4096) {
            g_log_errors.erase(0, g_log_errors.size() - 4096);
        }
    }
    if (verbose || level == GGML_LOG_LEVEL_ERROR) {
        fputs(text, stderr);
    }
}

std::string take_log_errors() {
    std::lock_guard<std::mutex> lock(g_log_mutex);
    std::string s;
    s.swap(g_log_errors);
    while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) {
        s.pop_back();
    }
    return s;
}

void init_backend_once() {
    static std::once_flag once;
    std::call_once(once, [] {
        llama_log_set(log_cb, nullptr);
        llama_backend_init();
    });
}

template <typename F>
int32_t guarded(F && f) {
    try {
        f();
        return DGR_OK;
    } catch (const dgr_exc & e) {
        g_last_error = e.what();
        return e.code;
    } catch (const std::exception & e) {
        g_last_error = std::string("engine: ") + e.what();
        return DGR_E_ENGINE;
    } catch (...) {
        g_last_error = "engine: unknown failure";
        return DGR_E_ENGINE;
    }
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
}

struct session {
    int32_t seq = -1;
    int32_t n_cached = 0;
};

} // namespace

struct dgr_engine {
    std::string path;
    llama_model *   model = nullptr;
    llama_context * ctx   = nullptr;
    const llama_vocab * vocab = nullptr;
    dgr_stage_info info {};
    std::map<std::pair<std::string, int64_t>, session> sessions;
    std::vector<int32_t> free_seqs;
    std::mutex mu;

    ~dgr_engine() {
        if (ctx)   llama_free(ctx);
        if (model) llama_model_free(model);
    }

    int32_t width() const { return (int32_t) dgr_boundary_width(info.n_streams, info.n_embd); }
};

extern "C" {

int32_t dgr_abi_version(void) { return DGR_ABI_VERSION; }

// The lane is a build setting (Bazel: toolchains/lanes.bzl; CMake: -DDGR_LANE=, dgr build-engine):
// a worker advertises the lane of the engine it really loaded.
#ifndef DGR_LANE
#define DGR_LANE cpu
#endif
#define DGR_STR2(x) #x
#define DGR_STR(x) DGR_STR2(x)
const char * dgr_engine_lane(void) { return DGR_STR(DGR_LANE); }
int32_t dgr_has_hooks(void)   { return DGR_WITH_HOOKS ? 1 : 0; }

const char * dgr_last_error(void) { return g_last_error.c_str(); }

void dgr_last_cache_miss(int64_t * held, int64_t * expected) {
    if (held)     *held     = g_miss_held;
    if (expected) *expected = g_miss_expected;
}

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

        llama_model_params mp = llama_model_default_params();
        mp.n_gpu_layers = params->n_gpu_layers; // < 0: every owned layer on the lane's device, if it has one
        mp.kv_overrides = kvo.empty() ? nullptr : kvo.data();
        // batch invariance: a repacked weight layout (ggml's CPU "extra" buffer types: repack, AMX) is
        // multiplied by one kernel for a single row (gemv) and another for several (gemm), which round
        // differently. Off with fast_kernels too: the AMX path crashed on this machine with one KV stream
        // per session (SIGSEGV in ggml_backend_amx_mul_mat), and fast_kernels only measures the CPU kernels.
        mp.use_extra_bufts = false;
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
        {
#if DGR_WITH_HOOKS
            // the hook reads the process-wide setting when the context creates its CPU backend
            static std::mutex init_mu;
            std::lock_guard<std::mutex> init_lock(init_mu);
            dgr_set_reference_kernels(params->fast_kernels == 0);
#endif
            eng->ctx = llama_init_from_model(eng->model, cp);
        }
        if (!eng->ctx) {
            std::string why = take_log_errors();
            throw dgr_exc(DGR_E_ENGINE, fmt("%s: could not create a context: %s", path.c_str(), why.c_str()));
        }

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
        in.needs_token_ids = dgr_takes_token_ids(begin, f.token_ids);
        in.has_vocab   = in.n_vocab > 0;
        in.n_ctx       = n_ctx_seq;
        in.max_sessions = max_sessions;
        // without the hooks (an engine over the unpatched tree) the CPU backend keeps its fast kernels
        in.batch_invariant = DGR_WITH_HOOKS && params->fast_kernels == 0 && !shared_kv;
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

int32_t dgr_engine_memory(dgr_engine * eng, dgr_memory * out);

int32_t dgr_session_open(dgr_engine * eng, const char * sid, int64_t epoch) {
    return guarded([&] {
        if (!eng || !sid) throw dgr_exc(DGR_E_ENGINE, "session_open: null argument");
        std::lock_guard<std::mutex> lock(eng->mu);
        const auto key = std::make_pair(std::string(sid), epoch);
        if (eng->sessions.count(key)) {
            throw dgr_exc(DGR_E_ENGINE, fmt("session '%s' epoch %lld is already open", sid, (long long) epoch));
        }
        // a newer epoch of the same session replaces older ones (their caches are stale)
        llama_memory_t mem = llama_get_memory(eng->ctx);
        for (auto it = eng->sessions.begin(); it != eng->sessions.end();) {
            if (it->first.first == sid) {
                if (it->first.second > epoch) {
                    throw dgr_exc(DGR_E_ENGINE, fmt("session '%s' is already at epoch %lld > %lld",
                            sid, (long long) it->first.second, (long long) epoch));
                }
                llama_memory_seq_rm(mem, it->second.seq, -1, -1);
                eng->free_seqs.push_back(it->second.seq);
                it = eng->sessions.erase(it);
            } else {
                ++it;
            }
        }
        if (eng->free_seqs.empty()) {
            throw dgr_exc(DGR_E_ENGINE, fmt("all %d sessions are in use; close one first (or open the engine with more max_sessions)",
                    eng->info.max_sessions));
        }
        // the lowest free sequence: llama.cpp puts only consecutive streams into one ubatch, so compact
        // ids let more sessions share a forward
        session s;
        auto lowest = std::min_element(eng->free_seqs.begin(), eng->free_seqs.end());
        s.seq = *lowest;
        eng->free_seqs.erase(lowest);
        llama_memory_seq_rm(mem, s.seq, -1, -1);
        eng->sessions[key] = s;
    });
}

int32_t dgr_session_close(dgr_engine * eng, const char * sid, int64_t epoch) {
    return guarded([&] {
        if (!eng || !sid) throw dgr_exc(DGR_E_ENGINE, "session_close: null argument");
        std::lock_guard<std::mutex> lock(eng->mu);
        auto it = eng->sessions.find(std::make_pair(std::string(sid), epoch));
        if (it == eng->sessions.end()) {
            throw dgr_exc(DGR_E_ENGINE, fmt("session '%s' epoch %lld is not open", sid, (long long) epoch));
        }
        llama_memory_seq_rm(llama_get_memory(eng->ctx), it->second.seq, -1, -1);
        eng->free_seqs.push_back(it->second.seq);
        eng->sessions.erase(it);
    });
}

int32_t dgr_session_n_cached(dgr_engine * eng, const char * sid, int64_t epoch, int32_t * out) {
    return guarded([&] {
        if (!eng || !sid || !out) throw dgr_exc(DGR_E_ENGINE, "session_n_cached: null argument");
        std::lock_guard<std::mutex> lock(eng->mu);
        auto it = eng->sessions.find(std::make_pair(std::string(sid), epoch));
        if (it == eng->sessions.end()) {
            throw dgr_exc(DGR_E_ENGINE, fmt("session '%s' epoch %lld is not open", sid, (long long) epoch));
        }
        *out = it->second.n_cached;
    });
}

// A recurrent or hybrid model keeps one running state per sequence, not one cell per position: a
// partial range of it cannot be dropped, so speculation (which rolls back rejected drafts) is refused.
static bool can_truncate(const dgr_engine * eng) {
    return !(llama_model_is_recurrent(eng->model) || llama_model_is_hybrid(eng->model));
}

int32_t dgr_engine_can_truncate(dgr_engine * eng) {
    return eng && eng->model && can_truncate(eng) ? 1 : 0;
}

int32_t dgr_session_truncate(dgr_engine * eng, const char * sid, int64_t epoch, int32_t n_keep) {
    return guarded([&] {
        if (!eng || !sid) throw dgr_exc(DGR_E_ENGINE, "session_truncate: null argument");
        std::lock_guard<std::mutex> lock(eng->mu);
        auto it = eng->sessions.find(std::make_pair(std::string(sid), epoch));
        if (it == eng->sessions.end()) {
            throw dgr_exc(DGR_E_ENGINE, fmt("session '%s' epoch %lld is not open", sid, (long long) epoch));
        }
        session & s = it->second;
        if (n_keep < 0 || n_keep > s.n_cached) {
            throw dgr_exc(DGR_E_ENGINE, fmt("session '%s' holds positions [0, %d): cannot keep %d of them",
                    sid, s.n_cached, n_keep));
        }
        if (n_keep == s.n_cached) {
            return;
        }
        if (!can_truncate(eng)) {
            throw dgr_exc(DGR_E_UNSUPPORTED, fmt("%s is a recurrent or hybrid model: its state cannot drop positions "
                    "[%d, %d) (only the latest state is kept), so speculative decoding is not possible; generate "
                    "without --speculate", eng->info.arch, n_keep, s.n_cached));
        }
        if (!llama_memory_seq_rm(llama_get_memory(eng->ctx), s.seq, n_keep, -1)) {
            throw dgr_exc(DGR_E_UNSUPPORTED, fmt("llama.cpp refused to drop positions [%d, %d) of session '%s'",
                    n_keep, s.n_cached, sid));
        }
        s.n_cached = n_keep;
    });
}

int32_t dgr_session_state_get(dgr_engine * eng, const char * sid, int64_t epoch, void * buf, uint64_t cap,
                              uint64_t * size, int32_t * n_positions) {
    return guarded([&] {
        if (!eng || !sid || !size || !n_positions) throw dgr_exc(DGR_E_ENGINE, "session_state_get: null argument");
        std::lock_guard<std::mutex> lock(eng->mu);
        auto it = eng->sessions.find(std::make_pair(std::string(sid), epoch));
        if (it == eng->sessions.end()) {
            throw dgr_exc(DGR_E_ENGINE, fmt("session '%s' epoch %lld is not open", sid, (long long) epoch));
        }
        *n_positions = it->second.n_cached;
        *size = llama_state_seq_get_size(eng->ctx, it->second.seq);
        if (buf && cap >= *size) {
            const size_t n = llama_state_seq_get_data(eng->ctx, static_cast<uint8_t *>(buf), (size_t) cap, it->second.seq);
            if (n != *size) throw dgr_exc(DGR_E_ENGINE, fmt("llama.cpp wrote %zu bytes of a %llu-byte session state", n,
                                                            (unsigned long long) *size));
        }
    });
}

int32_t dgr_session_state_set(dgr_engine * eng, const char * sid, int64_t epoch, const void * buf, uint64_t size,
                              int32_t n_positions, int32_t n_keep) {
    return guarded([&] {
        if (!eng || !sid || !buf) throw dgr_exc(DGR_E_ENGINE, "session_state_set: null argument");
        std::lock_guard<std::mutex> lock(eng->mu);
        auto it = eng->sessions.find(std::make_pair(std::string(sid), epoch));
        if (it == eng->sessions.end()) {
            throw dgr_exc(DGR_E_ENGINE, fmt("session '%s' epoch %lld is not open", sid, (long long) epoch));
        }
        session & s = it->second;
        if (s.n_cached != 0) throw dgr_exc(DGR_E_ENGINE, fmt("session '%s' already holds %d positions", sid, s.n_cached));
        if (n_keep < 0 || n_keep > n_positions) {
            throw dgr_exc(DGR_E_ENGINE, fmt("cannot keep %d positions of a state of %d", n_keep, n_positions));
        }
        if (!can_truncate(eng)) {
            throw dgr_exc(DGR_E_UNSUPPORTED, fmt("%s is a recurrent or hybrid model: a prefix of its state cannot be kept",
                                                 eng->info.arch));
        }
        llama_memory_t mem = llama_get_memory(eng->ctx);
        if (llama_state_seq_set_data(eng->ctx, static_cast<const uint8_t *>(buf), (size_t) size, s.seq) == 0) {
            llama_memory_seq_rm(mem, s.seq, -1, -1);
            throw dgr_exc(DGR_E_ENGINE, "llama.cpp could not load the saved session state (another engine's, or no room)");
        }
        if (n_keep < n_positions && !llama_memory_seq_rm(mem, s.seq, n_keep, -1)) {
            llama_memory_seq_rm(mem, s.seq, -1, -1);
            throw dgr_exc(DGR_E_UNSUPPORTED, fmt("llama.cpp refused to drop positions [%d, %d)", n_keep, n_positions));
        }
        s.n_cached = n_keep;
    });
}

int32_t dgr_forward(dgr_engine * eng, int32_t n_steps, const dgr_step * steps, dgr_step_out * outs) {
    return guarded([&] {
        if (!eng || n_steps <= 0 || !steps || !outs) throw dgr_exc(DGR_E_ENGINE, "forward: needs at least one step");
        std::lock_guard<std::mutex> lock(eng->mu);
        const dgr_stage_info & in = eng->info;
        const int32_t width = eng->width();

        // validate everything before touching the cache: either all steps run or none
        std::vector<session *> ss(n_steps);
        int64_t n_total = 0;
        std::set<int32_t> seen;
        for (int32_t k = 0; k < n_steps; ++k) {
            const dgr_step & st = steps[k];
            const char * sid = st.session_id ? st.session_id : "";
            if (st.n_tokens <= 0 || !st.positions) {
                throw dgr_exc(DGR_E_ENGINE, fmt("step %d (session '%s'): no tokens", k, sid));
            }
            auto it = eng->sessions.find(std::make_pair(std::string(sid), st.epoch));
            if (it == eng->sessions.end()) {
                g_miss_held = 0;
                g_miss_expected = st.positions[0];
                throw dgr_exc(DGR_E_CACHE_MISS, fmt("session '%s' epoch %lld is not open here; open it and re-prefill from position 0",
                        sid, (long long) st.epoch));
            }
            session & s = it->second;
            if (!seen.insert(s.seq).second) {
                throw dgr_exc(DGR_E_ENGINE, fmt("step %d: session '%s' appears twice in one batch", k, sid));
            }
            for (int32_t i = 0; i < st.n_tokens; ++i) {
                if (st.positions[i] != s.n_cached + i) {
                    g_miss_held = s.n_cached;
                    g_miss_expected = st.positions[0];
                    throw dgr_exc(DGR_E_CACHE_MISS, fmt("session '%s' epoch %lld holds positions [0, %d) but the step's position %d is %d (expected %d); re-prefill at a new epoch",
                            sid, (long long) st.epoch, s.n_cached, i, st.positions[i], s.n_cached + i));
                }
            }
            if (s.n_cached + st.n_tokens > in.n_ctx) {
                throw dgr_exc(DGR_E_ENGINE, fmt("session '%s': %d + %d positions exceed n_ctx = %d",
                        sid, s.n_cached, st.n_tokens, in.n_ctx));
            }
            if (in.is_first || in.needs_token_ids) {
                if (!st.token_ids) {
                    throw dgr_exc(DGR_E_SCHEMA, fmt("step %d (session '%s'): this stage needs token ids%s",
                            k, sid, in.is_first ? "" : " (the token-id sideband)"));
                }
                for (int32_t i = 0; i < st.n_tokens; ++i) {
                    if (st.token_ids[i] < 0 || st.token_ids[i] >= in.n_vocab) {
                        throw dgr_exc(DGR_E_SCHEMA, fmt("step %d: token id %d is outside the vocabulary [0, %d)",
                                k, st.token_ids[i], in.n_vocab));
                    }
                }
            }
            if (in.is_first) {
                if (st.boundary) {
                    throw dgr_exc(DGR_E_SCHEMA, fmt("step %d: the first stage takes token ids, not a boundary", k));
                }
            } else {
                if (!st.boundary) {
                    throw dgr_exc(DGR_E_SCHEMA, fmt("step %d (session '%s'): this stage (layers [%d, %d)) needs the boundary [n_tokens, %d, %d]",
                            k, sid, in.layer_begin, in.layer_end, in.n_streams, in.n_embd));
                }
                if (st.boundary_width != width) {
                    throw dgr_exc(DGR_E_SCHEMA, fmt("step %d: boundary has %d floats per token, this stage takes n_streams * n_embd = %d * %d = %d",
                            k, st.boundary_width, in.n_streams, in.n_embd, width));
                }
            }
            ss[k] = &s;
            n_total += st.n_tokens;
        }
        if (n_total > (int64_t) llama_n_batch(eng->ctx)) {
            throw dgr_exc(DGR_E_ENGINE, fmt("batch of %lld tokens exceeds n_batch = %u", (long long) n_total, llama_n_batch(eng->ctx)));
        }

        llama_batch batch = llama_batch_init((int32_t) n_total, in.is_first ? 0 : width, 1);
        if (!in.is_first && in.needs_token_ids) {
            // the sideband: each entry carries its token id and its boundary row (freed by llama_batch_free)
            batch.token = (llama_token *) malloc(sizeof(llama_token) * n_total);
        }
        struct batch_guard { llama_batch & b; ~batch_guard() { llama_batch_free(b); } } bg { batch };
        // rows in sequence order: llama.cpp's per-stream split puts only consecutive sequences in one ubatch
        std::vector<int32_t> order(n_steps);
        for (int32_t k = 0; k < n_steps; ++k) order[k] = k;
        std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return ss[a]->seq < ss[b]->seq; });
        std::vector<int32_t> row_of_step(n_steps);
        int32_t j = 0;
        for (const int32_t k : order) {
            const dgr_step & st = steps[k];
            row_of_step[k] = j;
            for (int32_t i = 0; i < st.n_tokens; ++i, ++j) {
                if (batch.token) {
                    batch.token[j] = st.token_ids[i];
                }
                if (!in.is_first) {
                    memcpy(batch.embd + (int64_t) j * width, st.boundary + (int64_t) i * width, sizeof(float) * width);
                }
                batch.pos[j]       = st.positions[i];
                batch.n_seq_id[j]  = 1;
                batch.seq_id[j][0] = ss[k]->seq;
                bool out = true; // a non-last stage outputs every token
                if (in.is_last) {
                    out = st.want_logits == DGR_LOGITS_ALL || i == st.n_tokens - 1;
                }
                batch.logits[j] = out;
            }
        }
        batch.n_tokens = (int32_t) n_total;

        // dgr: a recurrent or hybrid model splits a batch into ubatches one sequence at a time when every
        // token is an output (a non-last stage: llama_memory_recurrent::init_batch uses split_seq) and
        // several sequences at a time otherwise (the whole model, the last stage: split_equal). Other
        // ubatches mean other matmul shapes and other rounding, so split != whole. Such a model therefore
        // decodes one session (= one sequence) per llama_decode at every stage: the same ubatches everywhere.
        const bool per_session = llama_model_is_recurrent(eng->model) || llama_model_is_hybrid(eng->model);
        for (int32_t c = 0; c < (per_session ? n_steps : 1); ++c) {
            const int32_t k0 = per_session ? c : 0;
            const int32_t k1 = per_session ? c + 1 : n_steps;
            llama_batch part = batch; // per session: a view of that session's rows (freed with `batch`)
            if (per_session) {
                const int32_t r = row_of_step[c];
                part.n_tokens = steps[c].n_tokens;
                part.token    = batch.token ? batch.token + r : nullptr;
                part.embd     = batch.embd ? batch.embd + (int64_t) r * width : nullptr;
                part.pos      = batch.pos + r;
                part.n_seq_id = batch.n_seq_id + r;
                part.seq_id   = batch.seq_id + r;
                part.logits   = batch.logits + r;
            }
            // dgr: an M-RoPE model (qwen2vl, qwen3vl, qwen35...) takes one position per token id, which
            // llama.cpp broadcasts to its 4 rope sections (the graph then zeroes the 4th), but 4 positions per
            // embedding row, section-major (pos[j*n_tokens + i]). A non-first stage feeds embedding rows: give
            // them what the token path computes, p in sections 0-2 (rope, and the KV cells' x/y) and 0 in 3.
            std::vector<llama_pos> pos4;
            const enum llama_rope_type rt = llama_model_rope_type(eng->model);
            if (part.embd && !part.token && (rt == LLAMA_ROPE_TYPE_MROPE || rt == LLAMA_ROPE_TYPE_IMROPE)) {
                const int32_t n = part.n_tokens;
                pos4.assign((size_t) n * 4, 0);
                for (int32_t i = 0; i < n; ++i) {
                    pos4[i] = pos4[(size_t) n + i] = pos4[(size_t) 2 * n + i] = part.pos[i];
                }
                part.pos = pos4.data();
            }
            const int32_t rc = llama_decode(eng->ctx, part);
            if (rc != 0) {
                std::string why = take_log_errors();
                llama_memory_t mem = llama_get_memory(eng->ctx);
                if (per_session) {
                    // dgr: a recurrent state cannot drop a partial range (only its latest state is kept), and
                    // the sessions before this one have already advanced: drop every session of the batch
                    // whole, so its next step is a cache miss that re-prefills from position 0
                    for (int32_t k = 0; k < n_steps; ++k) {
                        llama_memory_seq_rm(mem, ss[k]->seq, -1, -1);
                        ss[k]->n_cached = 0;
                    }
                } else if (rc < 0 || rc == 2) {
                    // on a failed decode, the cache may hold part of the batch: drop it for the sessions involved
                    for (int32_t k = 0; k < n_steps; ++k) {
                        llama_memory_seq_rm(mem, ss[k]->seq, ss[k]->n_cached, -1);
                    }
                }
                throw dgr_exc(DGR_E_ENGINE, fmt("llama_decode failed (%d)%s%s", rc,
                        rc == 1 ? ": no KV slot for the batch (cache full; close sessions or raise n_ctx)" : "",
                        why.empty() ? "" : (": " + why).c_str()));
            }

            for (int32_t k = k0; k < k1; ++k) {
                const dgr_step & st = steps[k];
                dgr_step_out & o = outs[k];
                o.n_logit_rows = 0;
                o.next_token = -1;
                const int32_t r0 = row_of_step[k] - (per_session ? row_of_step[k0] : 0); // row in this call's batch
                if (!in.is_last) {
                    if (o.boundary) {
                        for (int32_t i = 0; i < st.n_tokens; ++i) {
                            const float * e = llama_get_embeddings_ith(eng->ctx, r0 + i);
                            if (!e) throw dgr_exc(DGR_E_ENGINE, "no boundary output from llama.cpp");
                            memcpy(o.boundary + (int64_t) i * width, e, sizeof(float) * width);
                        }
                    }
                } else {
                    const int32_t n_vocab = in.n_vocab;
                    const int32_t first_row = st.want_logits == DGR_LOGITS_ALL ? 0 : st.n_tokens - 1;
                    for (int32_t i = first_row; i < st.n_tokens; ++i) {
                        const float * l = llama_get_logits_ith(eng->ctx, r0 + i);
                        if (!l) throw dgr_exc(DGR_E_ENGINE, "no logits from llama.cpp");
                        if (i == st.n_tokens - 1) {
                            o.next_token = (int32_t) (std::max_element(l, l + n_vocab) - l);
                        }
                        if (o.logits && st.want_logits != DGR_LOGITS_NONE) {
                            memcpy(o.logits + (int64_t) o.n_logit_rows * n_vocab, l, sizeof(float) * n_vocab);
                            o.n_logit_rows++;
                        }
                    }
                }
                ss[k]->n_cached += st.n_tokens;
                o.n_cached = ss[k]->n_cached;
            }
        }
    });
}

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

int32_t dgr_quantize(const char * src, const char * dst, int32_t ftype, int32_t n_threads) {
    return guarded([&] {
        if (!src || !dst) throw dgr_exc(DGR_E_ENGINE, "quantize: null argument");
        // a uniform importance matrix for every matrix (its row length, times the experts of a 3-D one)
        std::vector<std::string> names;
        std::vector<std::vector<float>> values;
        ggml_context * meta = nullptr;
        gguf_init_params gp {};
        gp.no_alloc = true;
        gp.ctx = &meta;
        gguf_context * g = gguf_init_from_file(src, gp);
        if (!g || !meta) throw dgr_exc(DGR_E_ARTIFACT, fmt("%s: not a readable GGUF", src));
        for (int64_t i = 0; i < gguf_get_n_tensors(g); ++i) {
            const ggml_tensor * t = ggml_get_tensor(meta, gguf_get_tensor_name(g, i));
            if (t && ggml_n_dims(t) >= 2) {
                names.emplace_back(t->name);
                values.emplace_back((size_t) (t->ne[0] * (ggml_n_dims(t) >= 3 ? t->ne[2] : 1)), 1.0f);
            }
        }
        ggml_free(meta);
        gguf_free(g);
        std::vector<llama_model_imatrix_data> im;
        for (size_t i = 0; i < names.size(); ++i) {
            im.push_back({names[i].c_str(), values[i].data(), values[i].size()});
        }
        im.push_back({nullptr, nullptr, 0});
        llama_model_quantize_params qp = llama_model_quantize_default_params();
        qp.nthread = n_threads;
        qp.ftype = (enum llama_ftype) ftype;
        qp.pure = true;
        qp.quantize_output_tensor = true;
        qp.imatrix = im.data();
        take_log_errors();
        if (llama_model_quantize(src, dst, &qp) != 0) {
            std::string why = take_log_errors();
            throw dgr_exc(DGR_E_ENGINE, fmt("llama_model_quantize %s -> %s (ftype %d) failed%s%s", src, dst, ftype,
                    why.empty() ? "" : ": ", why.c_str()));
        }
    });
}

} // extern "C"

// memory report: llama-ext.h's breakdown (C++ API of the same library) and the model's own tensors.
// Internal headers (see the top of this file): the public API has neither the per-buffer breakdown
// nor the tensors' buffers; replace these when llama.h gains them.
#include "llama-ext.h"
#include "llama-model.h"

extern "C" int32_t dgr_engine_memory(dgr_engine * eng, dgr_memory * out) {
    return guarded([&] {
        if (!eng || !out) throw dgr_exc(DGR_E_ENGINE, "memory: null argument");
        std::lock_guard<std::mutex> lock(eng->mu);
        dgr_memory m {};
        for (const auto & [buft, d] : llama_get_memory_breakdown(eng->ctx)) {
            (void) buft;
            m.kv_bytes      += d.context;
            m.compute_bytes += d.compute;
        }
        // the tensors the model created (with mmap, the mapped range of a whole file can be larger:
        // it spans skipped tensors that are never read)
        for (const auto & [name, t] : eng->model->tensors_by_name) {
            (void) name;
            m.weights_bytes += ggml_nbytes(t);
            if (t->buffer && !ggml_backend_buffer_is_host(t->buffer)) {
                m.device_weights_bytes += ggml_nbytes(t);
                if (!m.device[0]) {
                    snprintf(m.device, sizeof(m.device), "%s", ggml_backend_buft_name(ggml_backend_buffer_get_type(t->buffer)));
                }
            }
        }
        *out = m;
    });
}

// ------------------------------------------------------------------ shared with the engine's other files

int32_t dgr_engine_guarded(const std::function<void()> & f) { return guarded(f); }

const llama_vocab * dgr_engine_llama_vocab(dgr_engine * eng) {
    return eng && eng->info.has_vocab ? eng->vocab : nullptr;
}

std::string dgr_engine_take_log_errors() { return take_log_errors(); }
