"""The flake parses and evaluates against a stand-in nixpkgs, and has the attributes users type.

nixpkgs cannot be fetched here, so the test writes a minimal stand-in flake (every attribute dgr's
Nix files use, as trivial derivations) and evaluates the real flake.nix against it with
`--override-input nixpkgs path:<stand-in>`: the packages and shells per lane exist, derivations
instantiate, the llama.cpp source and patch series are the pin's, the BLAKE3 C sources are
worker/third_party/blake3.json's, each lane's switches are set, and each lane's package builds the C++
dgr-worker (gRPC C++, protobuf, OpenSSL, -DDGR_BLAKE3_SRC) and installs it as bin/dgr-worker, with
nothing of the Python dgr. A stand-in that lacks an attribute the flake needs makes the evaluation
fail (negative control).
Only the real nixpkgs build is out of reach here (docs/build.md).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from dgr.core.constants import LANES
from dgr.toolchain import upstream

from support.paths import REPO

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
    # what it was asked for, kept for the tests (nixpkgs' fetches pname-version.tar.gz by its hash)
    fetchPypi = args: drv "${args.pname}-${args.version}.tar.gz" {
      inherit (args) pname version;
      sha256 = args.sha256 or args.hash;
    };
    python3 = (tool "python3") // {
      withPackages = f: builtins.seq (forceNames (f python3Packages)) (tool "python3-env");
    };
    cudaPackages = builtins.listToAttrs (map (n: { name = n; value = tool n; }) [
      @CUDA_PACKAGES@
    ]);
    rocmPackages = { clr = tool "clr"; hipblas = tool "hipblas"; rocblas = tool "rocblas"; };
    runCommand = name: env: script: drv name { };
    # what the image was asked for, kept for the tests (nixpkgs' builds the layers from the contents' closure)
    dockerTools.buildLayeredImage = args: builtins.seq (forceNames args.contents) (drv "${args.name}.tar.gz" {
      imageName = args.name;
      imageTag = args.tag;
      imageConfig = args.config;
      contentNames = map (d: d.name) args.contents;
    });
  } // builtins.listToAttrs (map (n: { name = n; value = tool n; }) [
    @TOOLS@
  ]);
in
pkgs
"""

PYTHON_PACKAGES = ["gguf", "numpy", "pydantic", "blake3", "tomli-w", "cookiecutter", "requests", "tqdm",
                   "grpcio", "grpcio-tools", "grpcio-health-checking", "protobuf", "pytest", "setuptools"]
CUDA_PACKAGES = ["cuda_nvcc", "cuda_cudart", "libcublas", "cuda_cccl"]
# dgr-worker's (gRPC C++, protobuf with protoc, OpenSSL, pkg-config) and the shells' (nlohmann_json) among them
TOOLS = ["cmake", "ninja", "pkg-config", "grpc", "protobuf", "openssl", "nlohmann_json", "shaderc",
         "vulkan-headers", "vulkan-loader", "bazel_7", "ccache", "git"]


def write_standin(dest: Path, cuda_packages=CUDA_PACKAGES, tools=TOOLS) -> Path:
    dest.mkdir(parents=True)
    quote = lambda names: " ".join(f'"{n}"' for n in names)  # noqa: E731
    (dest / "flake.nix").write_text(STANDIN_FLAKE)
    (dest / "default.nix").write_text(
        STANDIN_DEFAULT.replace("@PYTHON_PACKAGES@", quote(PYTHON_PACKAGES))
        .replace("@CUDA_PACKAGES@", quote(cuda_packages))
        .replace("@TOOLS@", quote(tools))
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
    images = {f"image-{lane}" for lane in LANES if lane != "metal"}
    assert set(drvs) == set(LANES) | images | {"default", "dgr", "llama-cpp-src", "blake3-src"}
    assert all(p.endswith(".drv") for p in drvs.values())
    names = eval_json(standin, f"packages.{SYSTEM}", "ps: builtins.mapAttrs (n: p: p.name) ps")
    release = upstream.load_pin().raw.get("release", "")
    assert names["cpu"] == f"dgr-worker-{release}" and names["default"] == names["cpu"]
    for lane in LANES:
        if lane != "cpu":
            assert names[lane] == f"dgr-worker-{lane}-{release}", "one package, suffixed per lane"
    shells = eval_json(standin, f"devShells.{SYSTEM}", "ss: builtins.mapAttrs (n: s: s.drvPath) ss")
    assert set(shells) == set(LANES) | {"default"}
    # each shell takes its package's inputs (gRPC C++, protobuf, OpenSSL, pkg-config ...), plus nlohmann_json
    # for Bazel's dgr-worker
    inputs = eval_json(standin, f"devShells.{SYSTEM}", "ss: builtins.mapAttrs (n: s: { "
                       "from = map (p: p.drvPath) s.inputsFrom; build = map (d: d.name) s.buildInputs; }) ss")
    for shell, got in inputs.items():
        assert got["from"] == [drvs["cpu" if shell == "default" else shell]], shell
        assert "nlohmann_json" in got["build"], shell


def test_each_linux_lane_has_an_image_of_its_worker(standin):
    """nix/image.nix: dockerTools' layered image of the lane's package, configured as `dgr release image`
    configures its own (tools/dgr/toolchain/image.py): user 65532, dgr-worker as the entrypoint, the engine by
    name, the state folder, nothing of Python."""
    from dgr.toolchain import image as oci

    got = eval_json(standin, f"packages.{SYSTEM}", "ps: builtins.mapAttrs (n: p: { inherit (p) imageName imageTag "
                    "imageConfig contentNames; worker = ps.${builtins.substring 6 (-1) n}.outPath; }) "
                    "(builtins.removeAttrs ps (builtins.filter (n: builtins.substring 0 6 n != \"image-\") "
                    "(builtins.attrNames ps)))")
    assert set(got) == {f"image-{lane}" for lane in LANES if lane != "metal"}
    version = eval_json(standin, f"packages.{SYSTEM}.dgr.version")
    for name, img in got.items():
        lane = name[len("image-"):]
        c = img["imageConfig"]
        assert img["imageName"] == "dgr-worker" and img["imageTag"] == f"{version}-{lane}", img
        assert c["User"] == f"{oci.USER}:{oci.USER}" and c["WorkingDir"] == oci.STATE, c
        assert c["Entrypoint"] == [f"{img['worker']}/bin/dgr-worker"], c
        assert c["Env"] == [f"DGR_ENGINE_LIB={img['worker']}/lib/libdgr_engine.so"], c
        assert c["ExposedPorts"] == {f"{oci.PORT}/tcp": {}} and c["Labels"]["dgr.lane"] == lane, c
        assert "--probe" in c["Labels"]["dgr.health"]
        assert not any("python" in n for n in img["contentNames"]), img["contentNames"]


def test_the_source_and_patches_are_the_pins(standin):
    pin = upstream.load_pin()
    got = eval_json(standin, f"packages.{SYSTEM}.llama-cpp-src.passthru")
    assert got["commit"] == pin.commit and got["tree_hash"] == pin.tree_hash
    assert got["patchNames"] == [Path(p.file).name for p in pin.patches]
    assert eval_json(standin, "lib.pin.commit") == pin.commit
    sdist = next(s for s in pin.raw["sources"] if s["kind"] == "pypi-sdist")
    src = eval_json(standin, f"packages.{SYSTEM}.llama-cpp-src",
                    "p: { inherit (p.src) pname version sha256; inherit (p) sourceRoot; }")
    assert f"{src['pname']}-{src['version']}.tar.gz" == sdist["filename"] and src["sha256"] == sdist["sha256"]
    assert src["sourceRoot"] == sdist["strip_prefix"]


BLAKE3_PIN = json.loads((REPO / "worker" / "third_party" / "blake3.json").read_text())
PIN = json.loads((REPO / "toolchains" / "llama.cpp.pin.json").read_text())


def test_the_blake3_sources_are_the_pins(standin):
    sdist = next(s for s in BLAKE3_PIN["sources"] if s["kind"] == "pypi-sdist")
    got = eval_json(standin, f"packages.{SYSTEM}.blake3-src",
                    "p: { inherit (p.src) pname version sha256; inherit (p) sourceRoot installPhase; "
                    "inherit (p.passthru) files; }")
    assert f"{got['pname']}-{got['version']}.tar.gz" == sdist["filename"] == "blake3-1.0.11.tar.gz"
    assert got["sha256"] == sdist["sha256"], "the sdist is fetched by the pin's sha256"
    assert got["sourceRoot"] == sdist["strip_prefix"] == "blake3-1.0.11/c_impl/vendor"
    assert got["files"] == BLAKE3_PIN["files"]
    for name, digest in BLAKE3_PIN["files"].items():   # each pinned file checked, then kept
        assert f'"{digest}"' in got["installPhase"] and f"install -Dm644 {name} $out/{name}" in got["installPhase"]
    assert eval_json(standin, "lib.blake3Pin.version") == BLAKE3_PIN["version"]


def test_each_lane_builds_the_cpp_dgr_worker(standin):
    # The old package installed a shell script running the Python `dgr worker` as bin/dgr-worker; the
    # front end now execs bin/dgr-worker and refuses a launcher script, so the package builds the program.
    blake3_src = eval_json(standin, f"packages.{SYSTEM}.blake3-src.outPath")
    got = eval_json(standin, f"packages.{SYSTEM}", """ps: builtins.mapAttrs (n: p: {
        build = map (d: d.name) p.buildInputs;
        native = map (d: d.name) p.nativeBuildInputs;
        inherit (p) cmakeFlags cmakeDir installPhase installCheckPhase doInstallCheck preConfigure;
        passthru = builtins.attrNames p.passthru;
        blake3Src = p.passthru.blake3Src.outPath;
        # every input the derivation is made of, as text: the dgr tool must not be among them
        inputs = builtins.toJSON (builtins.removeAttrs p [ "override" "meta" ]);
        proto = builtins.pathExists (p.src + "/proto/dgr/v1/stage.proto");
        pinJson = builtins.pathExists (p.src + "/toolchains/llama.cpp.pin.json");
        blake3Json = builtins.pathExists (p.src + "/worker/third_party/blake3.json");
        cmakeLists = builtins.pathExists (p.src + "/worker/CMakeLists.txt");
        server = builtins.pathExists (p.src + "/worker/server/main.cpp");
        tools = builtins.pathExists (p.src + "/tools");
      }) (removeAttrs ps [ "dgr" "llama-cpp-src" "blake3-src" "image-cpu" "image-cuda" "image-rocm" "image-vulkan" ])""")
    dgr_out = eval_json(standin, f"packages.{SYSTEM}.dgr.outPath")
    for lane in LANES:
        p = got[lane]
        assert {"grpc", "protobuf", "openssl"} <= set(p["build"]), lane
        assert {"cmake", "ninja", "pkg-config", "protobuf", "grpc"} <= set(p["native"]), "protoc, grpc_cpp_plugin"
        assert f"-DDGR_BLAKE3_SRC={blake3_src}" in p["cmakeFlags"] and p["blake3Src"] == blake3_src, lane
        assert f"-DDGR_LANE={lane}" in p["cmakeFlags"], "the engine reports the lane the module passes (--lane)"
        # the numerics (docs/numerics.md): the lane's declared CPU baseline, and the pin as Bazel and CMake name it
        assert "-DDGR_CPU_VARIANT=x86-64-v3" in p["cmakeFlags"] and "-DGGML_NATIVE=ON" not in p["cmakeFlags"]
        assert f"-DDGR_UPSTREAM_COMMIT={PIN['commit'][:12]}" in p["cmakeFlags"], lane
        assert f"-DDGR_UPSTREAM_PATCHES={len(PIN['patches'])}" in p["cmakeFlags"], lane
        assert "/dgr-patch-series)" in p["preConfigure"] and "-DDGR_UPSTREAM_SERIES=" in p["preConfigure"]
        # CMake runs on worker/ with ../proto and ../toolchains beside it (worker/CMakeLists.txt)
        assert p["cmakeDir"] == "../worker"
        assert p["proto"] and p["pinJson"] and p["blake3Json"] and p["cmakeLists"] and p["server"], lane
        assert not p["tools"], "the Python tool is not the worker's source"
        install = p["installPhase"]
        assert "install -Dm755 dgr-worker $out/bin/dgr-worker" in install
        assert "install -Dm755 libdgr_engine.so $out/lib/libdgr_engine.so" in install
        assert "$out/include/dgr_engine.h" in install
        assert "dgr worker" not in install and "/bin/dgr " not in install and "DGR_ENGINE_LIB" not in install
        assert "dgr" not in p["passthru"] and dgr_out not in p["inputs"], "nothing of the Python dgr"
        assert p["doInstallCheck"] is True and "$out/bin/dgr-worker --blake3" in p["installCheckPhase"]
        for name, digest in BLAKE3_PIN["files"].items():
            assert f"{blake3_src}/{name}" in p["installCheckPhase"] and digest in p["installCheckPhase"]


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


@pytest.mark.parametrize("missing", ["grpc", "protobuf", "openssl", "pkg-config"])
def test_a_stand_in_without_dgr_workers_inputs_fails(tmp_path, missing):
    # Negative control: dgr-worker's build inputs are the package's, on every lane.
    lacking = write_standin(tmp_path / "nixpkgs", tools=[t for t in TOOLS if t != missing])
    proc = nix_eval(lacking, f"packages.{SYSTEM}.cpu.drvPath")
    assert proc.returncode != 0
    assert missing in proc.stderr, proc.stderr[-2000:]
