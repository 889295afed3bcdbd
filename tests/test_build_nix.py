"""The flake parses and evaluates against a stand-in nixpkgs, and has the attributes users type.

nixpkgs cannot be fetched here, so the test writes a minimal stand-in flake (every attribute dgr's
Nix files use, as trivial derivations) and evaluates the real flake.nix against it with
`--override-input nixpkgs path:<stand-in>`: the packages and shells per lane exist, derivations
instantiate, the llama.cpp source and patch series are the pin's, and each lane's switches are set.
A stand-in that lacks an attribute the flake needs makes the evaluation fail (negative control).
Only the real nixpkgs build is out of reach here (docs/build.md).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from dgr import upstream
from dgr.constants import LANES

REPO = Path(__file__).resolve().parents[1]
SYSTEM = "x86_64-linux"

STANDIN_FLAKE = """{
  description = "stand-in for nixpkgs (dgr tests)";
  outputs = { self }: { };
}
"""

# `import nixpkgs { system; config; }` gives this set. Derivations build nothing (they are only
# instantiated); python3.withPackages and buildPythonApplication force every package they name.
STANDIN_DEFAULT = r"""{ system ? builtins.currentSystem, config ? { }, ... }:
let
  drv = name: extra: (derivation {
    inherit name system;
    builder = "/bin/sh";
    args = [ "-c" "echo stand-in > $out" ];
  }) // extra;
  # Every input becomes part of the derivation, so instantiating it forces (and checks) them all.
  mkDerivation = args:
    let
      name = args.name or "${args.pname}-${args.version}";
      d = derivation (builtins.removeAttrs args [ "passthru" "meta" "pname" "version" ] // {
        inherit name system;
        # bash, and `outputs` in the environment: `nix develop` runs its get-env.sh with the builder.
        builder = "/bin/bash";
        outputs = [ "out" ];
        args = [ "-c" "echo stand-in > $out" ];
      });
    in args // (args.passthru or { }) // d // { passthru = args.passthru or { }; meta = args.meta or { }; };
  callPackageWith = scope: f: args:
    let
      fn = if builtins.isFunction f then f else import f;
      result = fn (builtins.intersectAttrs (builtins.functionArgs fn) scope // args);
    in result // { override = more: callPackageWith scope f (args // more); };
  forceNames = ds: builtins.deepSeq (map (d: d.name) ds) null;
  python3Packages = builtins.listToAttrs (map (n: { name = n; value = drv "python3-${n}" { }; }) [
    @PYTHON_PACKAGES@
  ]) // {
    buildPythonApplication = args: builtins.seq (forceNames args.dependencies) (mkDerivation args);
  };
  tool = name: drv name { };
  pkgs = {
    inherit config system python3Packages;
    stdenv = { inherit mkDerivation; isDarwin = false; isLinux = true; };
    callPackage = callPackageWith pkgs;
    mkShell = args: mkDerivation ({ name = "shell"; } // args);
    writeShellScript = name: text: drv name { };
    fetchPypi = args: drv "${args.pname}-${args.version}.tar.gz" { };
    python3 = (tool "python3") // {
      withPackages = f: builtins.seq (forceNames (f python3Packages)) (tool "python3-env");
    };
    cudaPackages = builtins.listToAttrs (map (n: { name = n; value = tool n; }) [
      @CUDA_PACKAGES@
    ]);
    rocmPackages = { clr = tool "clr"; hipblas = tool "hipblas"; rocblas = tool "rocblas"; };
  } // builtins.listToAttrs (map (n: { name = n; value = tool n; }) [
    "cmake" "ninja" "shaderc" "vulkan-headers" "vulkan-loader" "bazel_7" "ccache" "git"
  ]);
in
pkgs
"""

PYTHON_PACKAGES = ["gguf", "numpy", "pydantic", "blake3", "tomli-w", "cookiecutter", "requests", "tqdm",
                   "grpcio", "grpcio-tools", "grpcio-health-checking", "protobuf", "pytest", "setuptools"]
CUDA_PACKAGES = ["cuda_nvcc", "cuda_cudart", "libcublas", "cuda_cccl"]


def write_standin(dest: Path, cuda_packages=CUDA_PACKAGES) -> Path:
    dest.mkdir(parents=True)
    quote = lambda names: " ".join(f'"{n}"' for n in names)  # noqa: E731
    (dest / "flake.nix").write_text(STANDIN_FLAKE)
    (dest / "default.nix").write_text(
        STANDIN_DEFAULT.replace("@PYTHON_PACKAGES@", quote(PYTHON_PACKAGES))
        .replace("@CUDA_PACKAGES@", quote(cuda_packages))
    )
    return dest


def nix_eval(standin: Path, attr: str, apply: str | None = None) -> subprocess.CompletedProcess:
    nix = shutil.which("nix")
    assert nix, "nix is not installed (Debian: apt-get install nix-bin; scripts/setup does)"
    cmd = [nix, "--extra-experimental-features", "nix-command flakes", "eval", "--offline", "--json",
           "--no-write-lock-file", "--override-input", "nixpkgs", f"path:{standin}", f".#{attr}"]
    if apply:
        cmd += ["--apply", apply]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "NIX_CONFIG": "warn-dirty = false"})


def eval_json(standin: Path, attr: str, apply: str | None = None):
    proc = nix_eval(standin, attr, apply)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


@pytest.fixture(scope="module")
def standin(tmp_path_factory) -> Path:
    return write_standin(tmp_path_factory.mktemp("nix") / "nixpkgs")


def test_packages_and_shells_exist_per_lane_and_instantiate(standin):
    drvs = eval_json(standin, f"packages.{SYSTEM}", "ps: builtins.mapAttrs (n: p: p.drvPath) ps")
    assert set(drvs) == set(LANES) | {"default", "dgr", "llama-cpp-src"}
    assert all(p.endswith(".drv") for p in drvs.values())
    names = eval_json(standin, f"packages.{SYSTEM}", "ps: builtins.mapAttrs (n: p: p.name) ps")
    release = upstream.load_pin().raw.get("release", "")
    assert names["cpu"] == f"dgr-worker-{release}" and names["default"] == names["cpu"]
    for lane in LANES:
        if lane != "cpu":
            assert names[lane] == f"dgr-worker-{lane}-{release}", "one package, suffixed per lane"
    shells = eval_json(standin, f"devShells.{SYSTEM}", "ss: builtins.mapAttrs (n: s: s.drvPath) ss")
    assert set(shells) == set(LANES) | {"default"}


def test_the_source_and_patches_are_the_pins(standin):
    pin = upstream.load_pin()
    got = eval_json(standin, f"packages.{SYSTEM}.llama-cpp-src.passthru")
    assert got["commit"] == pin.commit and got["tree_hash"] == pin.tree_hash
    assert got["patchNames"] == [Path(p.file).name for p in pin.patches]
    assert eval_json(standin, "lib.pin.commit") == pin.commit


def test_each_lane_turns_on_its_backend(standin):
    flags = eval_json(standin, f"packages.{SYSTEM}",
                      'ps: builtins.mapAttrs (n: p: p.cmakeFlags or []) ps')
    switch = {"cuda": "GGML_CUDA", "rocm": "GGML_HIP", "vulkan": "GGML_VULKAN", "metal": "GGML_METAL"}
    for lane, name in switch.items():
        assert f"-D{name}=ON" in flags[lane], lane
        assert f"-D{name}=OFF" in flags["cpu"], lane
    assert any(f.startswith("-DCMAKE_CUDA_ARCHITECTURES=") for f in flags["cuda"])
    broken = eval_json(standin, f"packages.{SYSTEM}", "ps: builtins.mapAttrs (n: p: p.meta.broken or false) ps")
    assert broken["metal"] is True and broken["cpu"] is False, "Metal is marked broken off macOS"


@pytest.mark.parametrize("shell", ["default", *LANES])
def test_each_shell_can_be_entered(standin, shell):
    # `nix develop .#<lane> -c ...`: builds the stand-in inputs (trivial), runs the shell hook.
    nix = shutil.which("nix")
    assert nix, "nix is not installed (Debian: apt-get install nix-bin; scripts/setup does)"
    proc = subprocess.run(
        [nix, "--extra-experimental-features", "nix-command flakes", "develop", "--offline",
         "--no-write-lock-file", "--override-input", "nixpkgs", f"path:{standin}", f".#{shell}",
         "-c", "bash", "-c", 'echo "lane=$DGR_LANE"'],
        cwd=REPO, capture_output=True, text=True, timeout=300,
        env={**os.environ, "NIX_CONFIG": "warn-dirty = false\nsandbox = false"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lane = "cpu" if shell == "default" else shell
    assert f"lane={lane}" in proc.stdout.splitlines()
    assert f"dgr {lane} shell" in proc.stdout


def test_a_missing_nixpkgs_attribute_fails_the_evaluation(tmp_path):
    # Negative control: without cudaPackages.cuda_nvcc the CUDA package cannot be instantiated.
    lacking = write_standin(tmp_path / "nixpkgs", cuda_packages=["cuda_cudart", "libcublas", "cuda_cccl"])
    proc = nix_eval(lacking, f"packages.{SYSTEM}.cuda.drvPath")
    assert proc.returncode != 0
    assert "cuda_nvcc" in proc.stderr
    assert nix_eval(lacking, f"packages.{SYSTEM}.cpu.drvPath").returncode == 0
