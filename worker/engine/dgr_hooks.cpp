// Layer-range ownership: the logic behind the call sites the patch stack inserts (see dgr_hooks.h).
#include "dgr_hooks.h"
#include "dgr_contract.h"
#include "dgr_engine.h"

#include "llama-arch.h"
#include "llama-graph.h"
#include "llama-hparams.h"
#include "llama-impl.h"
#include "llama-model-loader.h"

#include "ggml.h"
#include "ggml-backend.h"
#include "gguf.h"

#include <atomic>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>

namespace {

// An integer key from the kv overrides (tests) or the file; any integer GGUF type is accepted.
bool read_int_key(const llama_model_loader & ml, const char * key, int64_t & out) {
    auto it = ml.kv_overrides.find(key);
    if (it != ml.kv_overrides.end()) {
        if (it->second.tag != LLAMA_KV_OVERRIDE_TYPE_INT) {
            throw std::runtime_error(format("dgr: override of %s must be an integer", key));
        }
        out = it->second.val_i64;
        return true;
    }
    const int64_t id = gguf_find_key(ml.metadata, key);
    if (id < 0) {
        return false;
    }
    switch (gguf_get_kv_type(ml.metadata, id)) {
        case GGUF_TYPE_UINT8:  out = gguf_get_val_u8 (ml.metadata, id); return true;
        case GGUF_TYPE_INT8:   out = gguf_get_val_i8 (ml.metadata, id); return true;
        case GGUF_TYPE_UINT16: out = gguf_get_val_u16(ml.metadata, id); return true;
        case GGUF_TYPE_INT16:  out = gguf_get_val_i16(ml.metadata, id); return true;
        case GGUF_TYPE_UINT32: out = gguf_get_val_u32(ml.metadata, id); return true;
        case GGUF_TYPE_INT32:  out = gguf_get_val_i32(ml.metadata, id); return true;
        case GGUF_TYPE_UINT64: out = (int64_t) gguf_get_val_u64(ml.metadata, id); return true;
        case GGUF_TYPE_INT64:  out = gguf_get_val_i64(ml.metadata, id); return true;
        default:
            throw std::runtime_error(format("dgr: key %s must be an integer, got %s", key,
                    gguf_type_name(gguf_get_kv_type(ml.metadata, id))));
    }
}

// The boundary input of a non-first stage: the residual from ubatch.embd and, with the sideband, the
// token ids from ubatch.token (the same batch entry carries both).
class dgr_graph_input_boundary : public llm_graph_input_i {
public:
    explicit dgr_graph_input_boundary(int64_t width) : width(width) {}

    void set_input(const llama_ubatch * ubatch) override {
        GGML_ASSERT(ubatch->embd && "dgr: a non-first stage needs the boundary (batch.embd)");
        ggml_backend_tensor_set(embd, ubatch->embd, 0, ubatch->n_tokens*width*ggml_element_size(embd));
        if (tokens) {
            GGML_ASSERT(ubatch->token && "dgr: this stage needs the token-id sideband (batch.token)");
            // an architecture that does not read the ids leaves the tensor out of the graph (no buffer)
            if (tokens->buffer) {
                ggml_backend_tensor_set(tokens, ubatch->token, 0, ubatch->n_tokens*ggml_element_size(tokens));
            }
        }
    }

    bool can_reuse(const llm_graph_params & params) override {
        return params.ubatch.embd && embd->ne[1] == params.ubatch.n_tokens &&
            (!tokens || (params.ubatch.token && tokens->ne[0] == params.ubatch.n_tokens));
    }

    ggml_tensor * embd   = nullptr; // F32 [width, n_tokens]
    ggml_tensor * tokens = nullptr; // I32 [n_tokens], sideband only
    const int64_t width;
};

bool read_bool_key(const llama_model_loader & ml, const char * key, bool & out) {
    auto it = ml.kv_overrides.find(key);
    if (it != ml.kv_overrides.end()) {
        if (it->second.tag != LLAMA_KV_OVERRIDE_TYPE_BOOL) {
            throw std::runtime_error(format("dgr: override of %s must be a bool", key));
        }
        out = it->second.val_bool;
        return true;
    }
    const int64_t id = gguf_find_key(ml.metadata, key);
    if (id < 0) {
        return false;
    }
    if (gguf_get_kv_type(ml.metadata, id) != GGUF_TYPE_BOOL) {
        throw std::runtime_error(format("dgr: key %s must be a bool", key));
    }
    out = gguf_get_val_bool(ml.metadata, id);
    return true;
}

} // namespace

bool dgr_arch_supports_range(int arch) {
    // An architecture opts in when its graph builder calls dgr_layer_begin/end and
    // dgr_build_boundary_out (one patch per architecture).
    switch ((llm_arch) arch) {
        case LLM_ARCH_LLAMA:
        case LLM_ARCH_QWEN2:
        case LLM_ARCH_QWEN3:
        case LLM_ARCH_QWEN3MOE:
        case LLM_ARCH_GEMMA3:
        case LLM_ARCH_DEEPSEEK2:
        case LLM_ARCH_DEEPSEEK4:
// the family groups' opt-ins: one DGR_PORTED(LLM_ARCH_X) line per architecture, per group file
#define DGR_PORTED(a) case a:
#include "dgr_ported_dense_a.def"
#include "dgr_ported_dense_b.def"
#include "dgr_ported_dense_c.def"
#include "dgr_ported_moe_a.def"
#include "dgr_ported_moe_b.def"
#include "dgr_ported_ssm.def"
#include "dgr_ported_linear.def"
#undef DGR_PORTED
            return true;
        default:
            return false;
    }
}

bool dgr_is_stage_file(const llama_model_loader & ml) {
    int64_t v = 0;
    return read_int_key(ml, DGR_KEY_LAYER_BEGIN, v) || read_int_key(ml, DGR_KEY_LAYER_END, v) ||
        read_int_key(ml, DGR_KEY_LAYER_TOTAL, v);
}

void dgr_load_range(llama_model_loader & ml, int arch, llama_hparams & hp) {
    hp.dgr = dgr_layer_range{};

    int64_t begin = 0, end = 0, total = 0;
    const bool has_b = read_int_key(ml, DGR_KEY_LAYER_BEGIN, begin);
    const bool has_e = read_int_key(ml, DGR_KEY_LAYER_END,   end);
    const bool has_t = read_int_key(ml, DGR_KEY_LAYER_TOTAL, total);
    if (!has_b && !has_e && !has_t) {
        return; // a whole model
    }
    if (!(has_b && has_e && has_t)) {
        throw std::runtime_error(format("dgr: a stage needs all of %s, %s and %s (got only some); rebuild the bundle",
                DGR_KEY_LAYER_BEGIN, DGR_KEY_LAYER_END, DGR_KEY_LAYER_TOTAL));
    }
    const int64_t n_layer = hp.n_layer();
    if (total != n_layer) {
        throw std::runtime_error(format("dgr: %s = %lld but the model has %lld layers (%s)",
                DGR_KEY_LAYER_TOTAL, (long long) total, (long long) n_layer, "block_count"));
    }
    if (!dgr_range_valid(begin, end, n_layer)) {
        throw std::runtime_error(format("dgr: layer range [%lld, %lld) is not inside [0, %lld)",
                (long long) begin, (long long) end, (long long) n_layer));
    }
    int64_t n_streams = 1;
    read_int_key(ml, DGR_KEY_BOUNDARY_N_STREAMS, n_streams);
    bool token_ids = false;
    read_bool_key(ml, DGR_KEY_BOUNDARY_TOKEN_IDS, token_ids);
    bool mtp = false;
    read_bool_key(ml, DGR_KEY_MTP, mtp);
    if (mtp && end != n_layer) {
        throw std::runtime_error(format("dgr: %s is set on a stage [%lld, %lld) that is not the last of %lld layers; "
                "only the last stage owns the MTP block: rebuild the bundle", DGR_KEY_MTP,
                (long long) begin, (long long) end, (long long) n_layer));
    }
    if (begin == 0 && end == n_layer) {
        return; // the whole range: nothing to restrict
    }
    // residual streams crossing the seam: deepseek4's hyper-connection count, else one
    const int64_t want_streams = (llm_arch) arch == LLM_ARCH_DEEPSEEK4 ? (int64_t) hp.dsv4_hc_mult : 1;
    if (n_streams != want_streams) {
        throw std::runtime_error(format("dgr: %s = %lld but %s carries %lld residual stream(s) across a seam",
                DGR_KEY_BOUNDARY_N_STREAMS, (long long) n_streams, llm_arch_name((llm_arch) arch), (long long) want_streams));
    }
    if (!dgr_arch_supports_range(arch)) {
        throw std::runtime_error(format("dgr: architecture '%s' is not yet ported to layer ranges (`dgr synth "
                "--list` names the ported ones); run it as a single stage [0, %lld) or port it (docs/engine.md)",
                llm_arch_name((llm_arch) arch), (long long) n_layer));
    }
    hp.dgr.active    = true;
    hp.dgr.begin     = (int32_t) begin;
    hp.dgr.end       = (int32_t) end;
    hp.dgr.n_streams = (uint32_t) n_streams;
    hp.dgr.token_ids = dgr_takes_token_ids(begin, token_ids);
    hp.dgr.mtp       = mtp;
    LLAMA_LOG_INFO("dgr: this model owns layers [%d, %d) of %lld (first = %d, last = %d)%s\n",
            hp.dgr.begin, hp.dgr.end, (long long) n_layer, dgr_is_first(hp), dgr_is_last(hp),
            mtp ? " and the MTP block" : "");
}

bool dgr_is_first(const llama_hparams & hp) {
    return !hp.dgr.active || hp.dgr.begin == 0;
}

bool dgr_is_last(const llama_hparams & hp) {
    return !hp.dgr.active || hp.dgr.end == (int32_t) hp.n_layer();
}

int dgr_layer_begin(const llama_hparams & hp) {
    return hp.dgr.active ? hp.dgr.begin : 0;
}

int dgr_layer_end(const llama_hparams & hp) {
    return hp.dgr.active ? hp.dgr.end : (int) hp.n_layer();
}

bool dgr_layer_owned(const llama_hparams & hp, uint32_t il) {
    if (!hp.dgr.active) {
        return true;
    }
    // the MTP (nextn) blocks after the trunk: the dgr.mtp last stage's, nobody else's
    if (il >= hp.n_layer()) {
        return hp.dgr.mtp;
    }
    return (int32_t) il >= hp.dgr.begin && (int32_t) il < hp.dgr.end;
}

bool dgr_tensor_owned(const llama_hparams & hp, const LLM_TN_IMPL & tn, int flags) {
    if (!hp.dgr.active) {
        return true;
    }
    if (tn.bid >= 0) {
        return dgr_layer_owned(hp, (uint32_t) tn.bid);
    }
    // the token embedding created a second time (TENSOR_DUPLICATED) is the tied output head
    llm_tensor tensor = tn.tensor;
    if (tensor == LLM_TENSOR_TOKEN_EMBD && (flags & llama_model_loader::TENSOR_DUPLICATED)) {
        tensor = LLM_TENSOR_OUTPUT;
    }
    switch (llm_tensor_info_for(tensor).layer) {
        // the MTP graph looks up each position's token: the dgr.mtp last stage keeps its own copy
        case LLM_TENSOR_LAYER_INPUT:  return dgr_is_first(hp) || (hp.dgr.mtp && tensor == LLM_TENSOR_TOKEN_EMBD);
        case LLM_TENSOR_LAYER_OUTPUT: return dgr_is_last(hp);
        default:                      return true;
    }
}

ggml_tensor * dgr_build_inp_boundary(const llm_graph_context & g) {
    const int64_t width = dgr_boundary_width(g.hparams.dgr.n_streams, g.hparams.n_embd);

    auto inp = std::make_unique<dgr_graph_input_boundary>(width);
    inp->embd = ggml_new_tensor_2d(g.ctx0, GGML_TYPE_F32, width, g.n_tokens);
    ggml_set_input(inp->embd);
    g.cb(inp->embd, "dgr_inp_boundary", -1);

    if (g.hparams.dgr.token_ids) {
        inp->tokens = ggml_new_tensor_1d(g.ctx0, GGML_TYPE_I32, g.n_tokens);
        ggml_set_input(inp->tokens);
        g.cb(inp->tokens, "dgr_inp_tokens", -1);
        g.res->t_inp_tokens = inp->tokens;
    }

    ggml_tensor * cur = inp->embd;
    g.res->t_inp_embd = cur;
    g.res->add_input(std::move(inp));
    ggml_build_forward_expand(g.gf, cur);
    return cur;
}

bool dgr_build_boundary_out(const llm_graph_context & g, ggml_tensor * cur, ggml_tensor * inp_out_ids) {
    if (dgr_is_last(g.hparams)) {
        return false;
    }
    // the engine marks every token as an output, so this selects all rows in batch order; it also
    // keeps the out_ids input in the graph (an input outside the graph has no buffer)
    if (inp_out_ids) {
        cur = ggml_get_rows(g.ctx0, cur, inp_out_ids);
    }
    g.cb(cur, "dgr_boundary_out", -1);
    g.res->t_embd = cur;
    ggml_build_forward_expand(g.gf, cur);
    return true;
}

namespace {
std::atomic<int> g_cpu_kernels{DGR_KERNELS_REFERENCE};
}

void dgr_set_cpu_kernels(int kernels) {
    g_cpu_kernels.store(kernels);
}

int dgr_cpu_kernels() {
    return g_cpu_kernels.load();
}

void dgr_cpu_invariant_layouts() {
    ggml_backend_reg_t reg = ggml_backend_reg_by_name("CPU");
    using set_t = void (*)(bool);
    auto set = reg ? (set_t) ggml_backend_reg_get_proc_address(reg, "ggml_cpu_set_batch_invariant_layouts") : nullptr;
    if (!set) {
        throw std::runtime_error("dgr: the CPU backend has no ggml_cpu_set_batch_invariant_layouts: the invariant kernels need it");
    }
    set(true);
}

void dgr_configure_cpu_backend(ggml_backend * backend_cpu) {
    ggml_backend_dev_t dev = ggml_backend_get_device(backend_cpu);
    ggml_backend_reg_t reg = dev ? ggml_backend_dev_backend_reg(dev) : nullptr;
    using set_flag_t = void (*)(ggml_backend_t, bool);
    auto find = [&](const char * name) {
        auto f = reg ? (set_flag_t) ggml_backend_reg_get_proc_address(reg, name) : nullptr;
        if (!f) {
            throw std::runtime_error(std::string("dgr: the CPU backend has no ") + name + ": batch invariance needs it");
        }
        return f;
    };
    const int kernels = dgr_cpu_kernels();
    find("ggml_backend_cpu_set_use_ref")(backend_cpu, kernels == DGR_KERNELS_REFERENCE);
    find("ggml_backend_cpu_set_batch_invariant")(backend_cpu, kernels == DGR_KERNELS_INVARIANT);
}
