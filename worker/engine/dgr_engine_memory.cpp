// dgr_engine_memory: what the stage holds, weights (and on which device), KV cache and compute buffers.
// llama-ext.h's breakdown (C++ API of the same library) and the model's own tensors, from internal headers
// (see the top of dgr_engine.cpp): the public API has neither the per-buffer breakdown nor the tensors'
// buffers; replace these when llama.h gains them.
#include "dgr_engine.h"
#include "dgr_engine_internal.h"

#include "ggml-backend.h"
#include "llama.h"

#include "llama-ext.h"
#include "llama-model.h"

#include <cstdio>
#include <mutex>

using namespace dgr_engine_detail;

extern "C" int32_t dgr_engine_memory(dgr_engine * eng, dgr_memory * out) {
    return guarded([&] {
        if (!eng || !out) throw dgr_exc(DGR_E_ENGINE, "memory: null argument");
        std::lock_guard<std::mutex> lock(eng->mu);
        dgr_memory m {};
        // the main context and, on an MTP stage, the MTP context beside it (its own KV and compute buffers)
        for (llama_context * c : { eng->ctx, eng->mtp }) {
            if (!c) continue;
            for (const auto & [buft, d] : llama_get_memory_breakdown(c)) {
                (void) buft;
                m.kv_bytes      += d.context;
                m.compute_bytes += d.compute;
            }
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
