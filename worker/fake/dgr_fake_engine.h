// The fake engine: a tiny deterministic model behind the ShardEngine's C ABI (worker/engine/dgr_engine.h),
// for the protocol, wire and worker tests (milliseconds, no llama.cpp). libdgr_fake_engine.so exports every
// symbol of dgr_engine.h that a caller resolves (dgr_quantize aside) and ggml's six wire-dtype converters
// (ggml_fp32_to_fp16_row ... dequantize_row_q8_0, in plain C++, bit for bit ggml's), so the real dgr-worker
// (`dgr-worker --fake-engine SPEC --stage N`, any --wire-dtype) and Python (dgr.testing.fake_engine, through
// dgr.runtime.engine's ctypes) run it as they run the real engine. docs/worker.md, "The fake engine".
//
// dgr_engine_open's `path` is a spec, "layers=6,embd=16,cuts=2:4,seed=3,stage=1" (the keys of
// dgr.testing.fake_engine.FakeModel, plus stage=; no stage: the whole model); dgr_open_params is ignored
// (n_ctx and max_sessions are the spec's ctx= and sessions=).
#pragma once

#include "dgr_engine.h"

#ifdef __cplusplus
extern "C" {
#endif

// The canonical form of the fake model `spec` (FakeModel.to_spec: every key in order, recurrent only when
// set), written to `out` up to `cap` bytes (NUL-terminated when it fits). Returns its length, or -1 when
// the spec is bad (dgr_last_error says why; a stage= key is refused here: a model has no stage). `n_stages`
// (may be NULL): how many stages its cuts make. dgr-worker hashes it into the fake bundle id.
DGR_API int32_t dgr_fake_spec(const char * spec, char * out, int32_t cap, int32_t * n_stages);

#ifdef __cplusplus
}
#endif
