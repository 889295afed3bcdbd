# Everything the flake exposes for one system: the llama.cpp source at the pin, the BLAKE3 C sources at
# theirs, the worker per lane (one parameterized package, overrides per backend: the engine and the C++
# dgr-worker), the dgr tool, and shells generated from them.
{
  nixpkgs,
  system,
  pin,
  blake3Pin,
  root,
}:
let
  pkgs = import nixpkgs { inherit system; };
  # CUDA and ROCm each get their own nixpkgs instance so that every dependency is built against the
  # same toolkit (and CUDA's unfree licence is accepted only there).
  pkgsCuda = import nixpkgs {
    inherit system;
    config = {
      allowUnfree = true;
      cudaSupport = true;
    };
  };
  pkgsRocm = import nixpkgs {
    inherit system;
    config.rocmSupport = true;
  };

  # dgr's Python dependencies (pyproject.toml [project.dependencies], by nixpkgs name).
  pythonDeps =
    ps: with ps; [
      gguf
      numpy
      pydantic
      blake3
      tomli-w
      cookiecutter
      requests
      tqdm
      grpcio
      grpcio-tools
      grpcio-health-checking
      protobuf
    ];

  llamaSrc = pkgs.callPackage ./llama-cpp-src.nix { inherit pin root; };
  blake3Src = pkgs.callPackage ./blake3-src.nix { inherit blake3Pin root; };
  dgr = pkgs.callPackage ./dgr.nix { inherit root pythonDeps; };
  # dgr-worker is a C++ program: the worker package needs nothing of the dgr tool.
  worker = pkgs.callPackage ./package.nix { inherit pin root llamaSrc blake3Src; };

  lanes = {
    cpu = worker;
    cuda = pkgsCuda.callPackage ./package.nix {
      inherit pin root llamaSrc blake3Src;
      useCuda = true;
    };
    rocm = pkgsRocm.callPackage ./package.nix {
      inherit pin root llamaSrc blake3Src;
      useRocm = true;
    };
    vulkan = worker.override { useVulkan = true; };
    metal = worker.override { useMetalKit = true; };
  };

  # A shell per package: its build inputs (CMake, gRPC C++, protobuf, OpenSSL, pkg-config, the lane's
  # toolkit), plus what working on dgr needs (tests, Bazel, caches). Bazel's dgr-worker takes
  # nlohmann/json from the include path (worker/server/BUILD.bazel), CMake's from the pinned llama.cpp.
  shellFor =
    name: pkg:
    pkgs.mkShell {
      name = "dgr-${name}";
      inputsFrom = [ pkg ];
      buildInputs = [ pkgs.nlohmann_json ];
      packages = [
        (pkgs.python3.withPackages (ps: pythonDeps ps ++ [ ps.pytest ]))
        pkgs.bazel_7
        pkgs.ccache
        pkgs.git
      ];
      shellHook = ''
        export DGR_LANE=${pkg.passthru.lane or "cpu"}
        echo "dgr ${name} shell: scripts/test, bazel test //... --config=${pkg.passthru.lane or "cpu"}"
      '';
    };
  # the worker's OCI image per Linux lane (nix/image.nix; metal has no container)
  images = builtins.listToAttrs (
    map (lane: {
      name = "image-${lane}";
      value = pkgs.callPackage ./image.nix {
        worker = lanes.${lane};
        inherit (dgr) version;
      };
    }) [ "cpu" "cuda" "rocm" "vulkan" ]
  );
in
{
  packages = lanes // images // {
    default = worker;
    inherit dgr;
    llama-cpp-src = llamaSrc;
    blake3-src = blake3Src;
  };
  devShells = builtins.mapAttrs shellFor lanes // {
    default = shellFor "cpu" worker;
  };
}
