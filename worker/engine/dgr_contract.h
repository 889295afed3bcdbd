// The stage contract, once in C++: the rules tools/dgr/core/contract.py states for Python (StageContract,
// needs_token_ids), used by the engine (dgr_engine*.cpp) and the hooks inside llama (dgr_hooks.cpp).
// Change a rule here and in contract.py together; tests/engine/test_engine_keys.py checks the mirrored values.
//
// A stage owns the half-open layer range [begin, end) of the model's n_layer trunk layers (MTP blocks
// excluded). Across each seam travels the boundary: float32 [n_tokens, n_streams, n_embd], plus the
// token ids when the receiving stage needs them (the sideband).
#pragma once

#include "dgr_keys.h"

#include <cstdint>

// Positions a session may hold when the caller gives no n_ctx (dgr.core.constants.DEFAULT_N_CTX).
#define DGR_DEFAULT_N_CTX 4096

// [begin, end) is a non-empty part of [0, n_layer).
inline bool dgr_range_valid(int64_t begin, int64_t end, int64_t n_layer) {
    return 0 <= begin && begin < end && end <= n_layer;
}

// The sideband rule (contract.py's needs_token_ids): a stage needs the token ids beside the residual
// when it is not the first (the first reads them anyway) and its range starts inside the leading
// token-routed layers (DeepSeek V4's hash layers). A range is contiguous, so only its first layer matters.
inline bool dgr_needs_token_ids(int64_t layer_begin, int64_t n_hash_layers) {
    return 0 < layer_begin && layer_begin < n_hash_layers;
}

// Whether a stage takes the sideband its file declares (dgr.boundary.token_ids): never on the first
// stage, which reads the ids as its input (StageContract refuses token_ids_in there).
inline bool dgr_takes_token_ids(int64_t layer_begin, bool declared) {
    return layer_begin > 0 && declared;
}

// Floats per token in a boundary (BoundarySchema.values_per_token).
inline int64_t dgr_boundary_width(int64_t n_streams, int64_t n_embd) {
    return n_streams * n_embd;
}
