"""The Bazel CUDA lane (toolchains/cuda.bzl): toolkit discovery, one real nvcc compile and link, and
the message a missing cuBLAS gives. Nothing here runs CUDA code (no GPU): it proves the lane builds.

Runs Bazel in this checkout in its own output base (one per test module, so the other Bazel servers
on the machine are not blocked). Affordable in CI (a few minutes on 2 cores):
- `@cuda_toolkit` finds the nvcc, cudart and cuBLAS that this test finds on its own, and honours
  $CUBLAS_ROOT;
- one upstream .cu (ggml-cuda/arange.cu) compiled by the lane's nvcc rule with the lane's flags, with
  no disk cache (nvcc really runs), and linked into a shared library that needs cudart and cuBLAS;
- a cuBLAS that cannot be found fails the CUDA targets with what to install, while the analysis of
  every other target still passes (the repository rule writes a stub, it does not fail);
- scripts/setup-cuda finds what is installed and installs nothing.
The whole lane (~200 nvcc compiles: 45 minutes or more on 2 cores) is checked by scripts/check-cuda-lane,
which a person or scripts/device-check runs: it does not fit CI, and a test CI always skips proves nothing.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from support.bazel_cuda import PROBE, REPO, Bazel, dynamic_symbols, find_nvcc, needed

NVCC = find_nvcc()
pytestmark = pytest.mark.skipif(NVCC is None, reason="no CUDA toolkit (nvcc) on this machine")


@pytest.fixture(scope="module")
def pristine() -> Path:
    """The verified upstream tree that @llama_cpp copies (fetched and verified if missing)."""
    from dgr.toolchain import upstream
    tree = upstream.layout(upstream.load_pin()).pristine
    if not tree.is_dir():
        upstream.ensure_patched()
    return tree


@pytest.fixture(scope="module")
def bz(pristine, tmp_path_factory) -> Bazel:
    return Bazel(tmp_path_factory.mktemp("cuda") / "output_base")


def test_toolkit_discovery_finds_nvcc_cudart_and_cublas(bz):
    info = bz.toolkit()
    assert not info["missing"], (f"@cuda_toolkit: {info['missing']}\n"
                                 "(scripts/setup-cuda installs cuBLAS)")
    assert Path(info["nvcc"]) == NVCC
    version = subprocess.run([str(NVCC), "--version"], capture_output=True, text=True, check=True).stdout
    assert f"release {info['version']}," in version
    major = info["version"].split(".")[0]
    assert Path(info["cudart"]) == NVCC.parent.parent / "lib64" / f"libcudart.so.{major}"
    assert (Path(info["cublas_include"]) / "cublas_v2.h").is_file()
    assert [Path(p).name for p in info["cublas_libs"]] == [f"libcublas.so.{major}", f"libcublasLt.so.{major}"]
    assert all(Path(p).is_file() for p in info["cublas_libs"])

    # CUBLAS_ROOT, when set, is the only place looked at.
    root = Path(info["cublas_libs"][0]).parent.parent
    pinned = bz.toolkit(f"--repo_env=CUBLAS_ROOT={root}")
    assert pinned["cublas_from"] == "CUBLAS_ROOT" and not pinned["missing"]
    assert pinned["cublas_libs"] == info["cublas_libs"]


def test_one_upstream_cu_compiles_and_links_against_cudart_and_cublas(bz):
    # No disk cache: nvcc itself compiles arange.cu (seconds), the lane's flags and includes included.
    bz.ok("build", "--disk_cache=", PROBE)
    lib = bz.bin_dir() / "external/llama_cpp/ggml_cuda_backend_probe.so"
    major = bz.toolkit()["version"].split(".")[0]
    libs = needed(lib)
    for soname in (f"libcudart.so.{major}", f"libcublas.so.{major}", f"libcublasLt.so.{major}"):
        assert soname in libs, f"{lib} does not need {soname}: {libs}"
    assert dynamic_symbols(lib).get("_Z19ggml_cuda_op_arangeR25ggml_backend_cuda_contextP11ggml_tensor") == "T"
    # One architecture, sm_90 by default, another with --define=cuda_arch: other device code.
    objs = bz.bin_dir() / "external/llama_cpp/_objs/ggml_cuda_backend_probe_objects"
    obj90 = next(objs.rglob("*.pic.o")).read_bytes()
    cmd = bz.ok("aquery", "mnemonic(NvccCompile, %s_objects)" % PROBE.removesuffix(".so")).stdout
    assert "arch=compute_90,code=sm_90" in cmd and "-DGGML_CUDA_NO_VMM" in cmd, cmd
    bz.ok("build", "--disk_cache=", "--define=cuda_arch=80", PROBE)
    objs80 = bz.bin_dir("--define=cuda_arch=80") / "external/llama_cpp/_objs/ggml_cuda_backend_probe_objects"
    assert next(objs80.rglob("*.pic.o")).read_bytes() != obj90


def test_missing_cublas_fails_the_cuda_targets_with_what_to_install(bz, tmp_path):
    empty = tmp_path / "no-cublas"
    empty.mkdir()
    flag = f"--repo_env=CUBLAS_ROOT={empty}"
    info = bz.toolkit(flag)  # the repository rule itself succeeds (a stub)
    assert "no cuBLAS" in info["missing"] and "scripts/setup-cuda" in info["missing"]

    bad = bz.run("build", "--disk_cache=", flag, PROBE)
    assert bad.returncode != 0, "the CUDA probe built without cuBLAS"
    assert "the CUDA lane cannot be built here: no cuBLAS" in bad.stderr, bad.stderr[-4000:]
    assert "scripts/setup-cuda" in bad.stderr, bad.stderr[-4000:]
    assert str(empty) in bad.stderr, bad.stderr[-4000:]

    # Everything that `bazel test //...` builds still analyses, and so does the CUDA lane itself.
    bz.ok("build", "--nobuild", flag, "//...")
    bz.ok("build", "--nobuild", flag, "--config=cuda", "//:release_cuda")


def test_setup_cuda_finds_the_installed_cublas_and_installs_nothing(bz):
    info = bz.toolkit()
    proc = subprocess.run([str(REPO / "scripts/setup-cuda")], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "nothing to install" in proc.stdout, proc.stdout
    assert str(Path(info["cublas_include"]).parent) in proc.stdout or info["cublas_from"] == "the CUDA toolkit"
