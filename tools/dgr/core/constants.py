"""The one place for dgr's names: GGUF `dgr.*` keys, manifest fields, workspace paths.

The C++ engine reads the same GGUF keys and DEFAULT_N_CTX from worker/engine/dgr_keys.h, generated from
this module (`dgr wire protoc`, dgr.toolchain.cppgen; tests/wire/test_cpp_tables.py fails on drift). Wire dtypes
and the stage contract live in `dgr.core.contract`.
"""

# Version of the stage-GGUF / bundle format written by `dgr recipe build`.
FORMAT_VERSION = 1

# --- GGUF keys written into every stage file (half-open layer ranges [begin, end)).
class Keys:
    FORMAT_VERSION = "dgr.format_version"
    STAGE_INDEX = "dgr.stage.index"
    STAGE_COUNT = "dgr.stage.count"
    LAYER_BEGIN = "dgr.layer.begin"
    LAYER_END = "dgr.layer.end"
    LAYER_TOTAL = "dgr.layer.total"
    SOURCE_NAME = "dgr.source.name"
    SOURCE_BLAKE3 = "dgr.source.blake3"
    RECIPE_NAME = "dgr.recipe.name"
    RECIPE_BLAKE3 = "dgr.recipe.blake3"
    # Boundary schema: what crosses the seam into / out of this stage.
    BOUNDARY_N_STREAMS = "dgr.boundary.n_streams"   # 1 for plain residuals, hc_mult (4) for DeepSeek V4 mHC
    BOUNDARY_N_EMBD = "dgr.boundary.n_embd"
    BOUNDARY_DTYPE = "dgr.boundary.dtype"           # wire dtype: a name of dgr.core.contract.WIRE_DTYPES
    BOUNDARY_TOKEN_IDS = "dgr.boundary.token_ids"   # true when this stage needs the token-id sideband
    MTP = "dgr.mtp"                                 # true on the last stage of a bundle that includes MTP


# Bundle layout.
MANIFEST_NAME = "manifest.json"
DEFAULT_CHUNK_SIZE = 8 * 1024 * 1024

# Engine and worker defaults, for every entry point (dgr worker serve, Engine.open, parity, demo).
DEFAULT_N_CTX = 4096        # positions a session may hold
DEFAULT_MAX_SESSIONS = 8    # concurrent sessions per engine

# A parity run's schedule (`dgr baseline`, `dgr parity`: dgr.toolchain.parity), here so that the flags'
# defaults and help need no engine binding.
DEFAULT_PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time, in a land far away,"
DEFAULT_STEPS = 8           # greedy decode steps per session
DEFAULT_N_UBATCH = 512      # physical batch size (llama.cpp's default)

# Backend lanes (Bazel --config, Nix packages, manifests).
LANES = ("cpu", "cuda", "rocm", "vulkan", "metal")
# The CPU backend's instruction set (docs/numerics.md): the lane's declared baseline first (every build system
# compiles it by default, so their workers share a route), then "native", the build machine's own CPU.
CPU_VARIANTS = ("x86-64-v3", "native")

# The workspace: fetched upstream, builds and caches live here, ignored by git.
# Override with DGR_WORKSPACE (e.g. to share builds between clones).
WORKSPACE_ENV = "DGR_WORKSPACE"
WORKSPACE_DIRNAME = ".dgr"
