{
  # dgr as Nix packages and shells. Thin: the work is in nix/. docs/build.md.
  #   nix develop            CPU shell (compilers, CMake, Bazel, Python with dgr's dependencies)
  #   nix develop .#cuda     and .#rocm, .#vulkan, .#metal: the same plus the lane's toolkit
  #   nix build .#cpu        the worker of a lane (the engine and the C++ dgr-worker); .#dgr the tool
  # llama.cpp's source and patches come from toolchains/llama.cpp.pin.json and patches/llama.cpp/, the
  # BLAKE3 C sources from worker/third_party/blake3.json (read here, never copied): the same pins Bazel
  # and `dgr upstream` / `dgr build-engine` read.
  description = "dgr: distributed GGUF runtime (shard workers over a pinned, patched llama.cpp)";

  # Pinned nixpkgs (nixos-unstable, 2025-09-28). To update: change the rev, run `nix flake lock`.
  inputs.nixpkgs.url = "github:NixOS/nixpkgs/e9f00bd893984bc8ce46c895c3bf7cac95331127";

  outputs =
    { self, nixpkgs }:
    let
      systems = [
        "x86_64-linux"
        "aarch64-linux"
        "aarch64-darwin"
      ];
      forSystems = f: builtins.listToAttrs (map (system: { name = system; value = f system; }) systems);
      pin = builtins.fromJSON (builtins.readFile ./toolchains/llama.cpp.pin.json);
      blake3Pin = builtins.fromJSON (builtins.readFile ./worker/third_party/blake3.json);
      scopeFor = system: import ./nix/scope.nix { inherit nixpkgs system pin blake3Pin; root = ./.; };
    in
    {
      packages = forSystems (system: (scopeFor system).packages);
      devShells = forSystems (system: (scopeFor system).devShells);
      # The pins as Nix reads them (for checks and for `nix eval .#lib.pin.commit`).
      lib = { inherit pin blake3Pin; };
      # services.dgr.workers.<name> = { bundle, stage, listen, lane, ... }: systemd services (docs/deploy.md).
      nixosModules.default = import ./nix/nixos-module.nix { inherit self; };
    };
}
