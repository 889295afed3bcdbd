// dgr's GGUF keys, mirrored from tools/dgr/core/constants.py (class Keys). tests/engine/test_engine_keys.py
// fails when the two drift: change both together.
#pragma once

#define DGR_KEY_FORMAT_VERSION      "dgr.format_version"
#define DGR_KEY_STAGE_INDEX         "dgr.stage.index"
#define DGR_KEY_STAGE_COUNT         "dgr.stage.count"
#define DGR_KEY_LAYER_BEGIN         "dgr.layer.begin"
#define DGR_KEY_LAYER_END           "dgr.layer.end"
#define DGR_KEY_LAYER_TOTAL         "dgr.layer.total"
#define DGR_KEY_SOURCE_NAME         "dgr.source.name"
#define DGR_KEY_SOURCE_BLAKE3       "dgr.source.blake3"
#define DGR_KEY_RECIPE_NAME         "dgr.recipe.name"
#define DGR_KEY_RECIPE_BLAKE3       "dgr.recipe.blake3"
#define DGR_KEY_BOUNDARY_N_STREAMS  "dgr.boundary.n_streams"
#define DGR_KEY_BOUNDARY_N_EMBD     "dgr.boundary.n_embd"
#define DGR_KEY_BOUNDARY_DTYPE      "dgr.boundary.dtype"
#define DGR_KEY_BOUNDARY_TOKEN_IDS  "dgr.boundary.token_ids"
#define DGR_KEY_MTP                 "dgr.mtp"
