// dgr_quantize: the pinned llama.cpp's own quantizer over a whole GGUF, with a uniform importance matrix
// (test models of every weight type).
#include "dgr_engine.h"
#include "dgr_engine_internal.h"

#include "ggml.h"
#include "gguf.h"
#include "llama.h"

#include <string>
#include <vector>

using namespace dgr_engine_detail;

extern "C" {

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
