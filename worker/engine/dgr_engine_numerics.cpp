// The numerics of this build and of an opened engine (dgr_engine.h, docs/numerics.md): the things that
// decide the bits of a result besides the model and the input. ggml's kernels round differently per
// instruction set (an FMA or a wider vector sums in another order), per compiler and per kernel switch,
// so two stages of one route compute the whole model's bits only when these strings are equal.
#include "dgr_engine.h"
#include "dgr_engine_internal.h"

#include "ggml-backend.h"
#include "ggml-cpu.h"

#include "llama-model.h"

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <cstring>
#include <map>
#include <set>
#include <string>
#include <vector>

// Set by the build (worker/CMakeLists.txt from `dgr build-engine`, Bazel from the verified pin: the
// @llama_cpp//:dgr_upstream library): the pinned commit (12 hex), the number of patches applied and the
// patch series hash (dgr.core.hashing.series_hash, 12 hex). DGR_CPU_VARIANT: "x86-64-v3" (the lane's
// declared baseline, the default everywhere) or "native" (built for the build host's own CPU).
#ifndef DGR_UPSTREAM_COMMIT
#define DGR_UPSTREAM_COMMIT unknown
#endif
#ifndef DGR_UPSTREAM_PATCHES
#define DGR_UPSTREAM_PATCHES 0
#endif
#ifndef DGR_UPSTREAM_SERIES
#define DGR_UPSTREAM_SERIES none
#endif
#ifndef DGR_CPU_VARIANT
#define DGR_CPU_VARIANT baseline
#endif
#define DGR_NSTR2(x) #x
#define DGR_NSTR(x) DGR_NSTR2(x)

using namespace dgr_engine_detail;

namespace {

// What ggml's CPU backend was compiled for (every lane computes some ops there). Its ggml_cpu_has_*
// answer from the compiler's own macros: this is what runs, whatever flags were meant.
std::string cpu_isa() {
    std::string isa;
#if defined(__x86_64__) || defined(_M_X64)
    const bool v3 = ggml_cpu_has_avx2() && ggml_cpu_has_fma() && ggml_cpu_has_f16c() && ggml_cpu_has_bmi2();
    isa = v3 ? "x86-64-v3" : ggml_cpu_has_avx() ? "x86-64-avx" : ggml_cpu_has_ssse3() ? "x86-64-ssse3" : "x86-64";
    const struct { int (*has)(void); const char * name; } extra[] = {
        {ggml_cpu_has_avx_vnni, "avxvnni"}, {ggml_cpu_has_avx512, "avx512"},
        {ggml_cpu_has_avx512_vbmi, "avx512vbmi"}, {ggml_cpu_has_avx512_vnni, "avx512vnni"},
        {ggml_cpu_has_avx512_bf16, "avx512bf16"}, {ggml_cpu_has_amx_int8, "amxint8"},
    };
    for (const auto & e : extra) {
        if (e.has()) isa += "+" + std::string(e.name);
    }
#elif defined(__aarch64__)
    isa = "arm64";
    const struct { int (*has)(void); const char * name; } extra[] = {
        {ggml_cpu_has_neon, "neon"}, {ggml_cpu_has_fp16_va, "fp16"}, {ggml_cpu_has_dotprod, "dotprod"},
        {ggml_cpu_has_matmul_int8, "i8mm"}, {ggml_cpu_has_sve, "sve"}, {ggml_cpu_has_sme, "sme"},
    };
    for (const auto & e : extra) {
        if (e.has()) isa += "+" + std::string(e.name);
    }
#else
    isa = "generic";
#endif
    const std::string variant = DGR_NSTR(DGR_CPU_VARIANT);
    return variant == "native" ? "native-" + isa : isa;
}

std::string compiler() {
#if defined(__clang__)
    return "clang-" DGR_NSTR(__clang_major__) "." DGR_NSTR(__clang_minor__) "." DGR_NSTR(__clang_patchlevel__);
#elif defined(__GNUC__)
    return "gcc-" DGR_NSTR(__GNUC__) "." DGR_NSTR(__GNUC_MINOR__) "." DGR_NSTR(__GNUC_PATCHLEVEL__);
#else
    return "cc-unknown";
#endif
}

// A GPU lane's device rounds as that device does (lavapipe is not an RTX): its description, spaces as '_'.
std::string gpu_device() {
    for (size_t i = 0; i < ggml_backend_dev_count(); ++i) {
        ggml_backend_dev_t dev = ggml_backend_dev_get(i);
        if (ggml_backend_dev_type(dev) == GGML_BACKEND_DEVICE_TYPE_CPU) continue;
        std::string d = ggml_backend_dev_description(dev);
        for (char & c : d) {
            if (c == ' ') c = '_';
        }
        return d;
    }
    return "no-device";
}

}  // namespace

extern "C" {

const char * dgr_numerics_build(void) {
    static const std::string s = [] {
        init_backend_once();
        std::string lane = dgr_engine_lane();
        std::string head = lane == "cpu" ? "cpu/" + cpu_isa() : lane + "(" + gpu_device() + ")/" + cpu_isa();
        return head + " " + compiler() + " llama.cpp-" DGR_NSTR(DGR_UPSTREAM_COMMIT) "+" DGR_NSTR(DGR_UPSTREAM_PATCHES)
               "." DGR_NSTR(DGR_UPSTREAM_SERIES);
    }();
    return s.c_str();
}

const char * dgr_engine_numerics(dgr_engine * eng) {
    return eng ? eng->numerics.c_str() : "";
}

}  // extern "C"

namespace dgr_engine_detail {

std::string open_numerics(int kernels, bool kv_f32) {
    // flash attention stays llama.cpp's default (auto) in every engine; named so that a switch would show
    const char * name = kernels == DGR_KERNELS_INVARIANT ? " invariant" : kernels == DGR_KERNELS_FAST ? " fast" : " reference";
    // ggml's own test switch takes the tiled K-quant GEMM for every row count: other rounding, so it is named
    // (the reference kernels never take it)
    const char * forced = std::getenv("GGML_CPU_TILED_MM_FORCE");
    const bool tiled_forced = kernels != DGR_KERNELS_REFERENCE && forced && std::atoi(forced) == 1;
    return std::string(dgr_numerics_build()) + name + (tiled_forced ? "+tiled-mm" : "") +
           (kv_f32 ? " kv-f32" : " kv-f16") + " fa-auto";
}

std::string open_matmul_kernels(const llama_model & model, int kernels, bool gpu_lane, bool is_last) {
    if (gpu_lane) {
        return "the lane's device kernels (not batch invariant)";
    }
    if (!DGR_WITH_HOOKS || kernels == DGR_KERNELS_FAST) {
        return "llama.cpp's own choice by the number of rows (not batch invariant)";
    }
    if (kernels == DGR_KERNELS_REFERENCE) {
        return "every matrix: vec_dot, each row alone (the reference kernels)";
    }
#if DGR_WITH_HOOKS
    // the weights the stage multiplies: 2-D and larger, not norms, not the rows looked up by id (token and
    // position embeddings, except a last stage's token embedding that is also its output matrix), not the
    // recurrent blocks' element-wise tensors
    const bool tied = model.get_tensor("output.weight") == nullptr;
    std::map<std::string, std::set<std::string>> by_kernel;   // kernel -> weight types
    for (const auto & [name, t] : model.tensors_by_name) {
        if (ggml_n_dims(t) < 2 || name.find("norm") != std::string::npos || name.rfind("pos_embd", 0) == 0 ||
            name.find("ssm_a") != std::string::npos || name.find("ssm_d") != std::string::npos ||
            name.find("conv1d") != std::string::npos || (name.rfind("token_embd", 0) == 0 && !(tied && is_last))) {
            continue;
        }
        const char * buft = t->buffer ? ggml_backend_buft_name(ggml_backend_buffer_get_type(t->buffer)) : "";
        const bool repacked = std::strncmp(buft, "CPU_REPACK", 10) == 0;
        const bool mul_mat_id = name.find("_exps") != std::string::npos;
        std::string k = ggml_cpu_batch_invariant_matmul(t->type, repacked, mul_mat_id);
        if (k.rfind("vec_dot", 0) == 0) {
            k += k == "vec_dot" ? ", each row alone" : "";
            k += " (the reference kernel: no invariant fast path)";
        }
        std::string type = ggml_type_name(t->type);   // "q4_K": named as GGUF files and quantizers name it
        std::transform(type.begin(), type.end(), type.begin(), [](unsigned char c) { return (char) std::toupper(c); });
        by_kernel[k].insert(type);
    }
    std::string out;
    for (const auto & [k, types] : by_kernel) {
        std::string names;
        for (const auto & ty : types) names += (names.empty() ? "" : ", ") + ty;
        out += (out.empty() ? "" : "; ") + names + ": " + k;
    }
    // a build with AMX (--cpu-variant native on such a host) keeps it off under invariance: its kernels are not
    // proved batch invariant (ggml_cpu_set_batch_invariant_layouts leaves its buffer type out)
    if (ggml_cpu_has_amx_int8()) {
        out += std::string(out.empty() ? "" : "; ") + "AMX: built in, not used (not proved batch invariant)";
    }
    return out;
#else
    (void) model;
    (void) is_last;
    return "";
#endif
}

}  // namespace dgr_engine_detail
