# Everything the flake exposes for one system: the llama.cpp source at the pin, the worker per lane
# (one parameterized package, overrides per backend), the dgr tool, and shells generated from them.
{
  nixpkgs,
  system,
  pin,
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
  dgr = pkgs.callPackage ./dgr.nix { inherit root pythonDeps; };
  worker = pkgs.callPackage ./package.nix { inherit pin root llamaSrc dgr; };

  lanes = {
    cpu = worker;
    cuda = pkgsCuda.callPackage ./package.nix {
      inherit pin root llamaSrc dgr;
      useCuda = true;
    };
    rocm = pkgsRocm.callPackage ./package.nix {
      inherit pin root llamaSrc dgr;
      useRocm = true;
    };
    vulkan = worker.override { useVulkan = true; };
    metal = worker.override { useMetalKit = true; };
  };

  # A shell per package: its build inputs, plus what working on dgr needs (tests, Bazel, caches).
  shellFor =
    name: pkg:
    pkgs.mkShell {
      name = "dgr-${name}";
      inputsFrom = [ pkg ];
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
in
{
  packages = lanes // {
    default = worker;
    inherit dgr;
    llama-cpp-src = llamaSrc;
  };
  devShells = builtins.mapAttrs shellFor lanes // {
    default = shellFor "cpu" worker;
  };
}
