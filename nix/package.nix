# The dgr worker of one backend lane: the ShardEngine (worker/CMakeLists.txt over the patched
# llama.cpp) and a `dgr-worker` that runs the dgr tool with it. One package; each backend is an
# override (useCuda, useRocm, useVulkan, useMetalKit), suffixed by its lane.
{
  stdenv,
  cmake,
  ninja,
  writeShellScript,
  pin,
  root,
  llamaSrc,
  dgr,
  cudaPackages ? { },
  rocmPackages ? { },
  vulkan-headers ? null,
  vulkan-loader ? null,
  shaderc ? null,
  useCuda ? false,
  useRocm ? false,
  useVulkan ? false,
  useMetalKit ? false,
  # CUDA compute capabilities to build for (one is enough for a test build; list the fleet's).
  cudaArchitectures ? [ "89" ],
}:
let
  lane =
    if useCuda then
      "cuda"
    else if useRocm then
      "rocm"
    else if useVulkan then
      "vulkan"
    else if useMetalKit then
      "metal"
    else
      "cpu";
  suffix = if lane == "cpu" then "" else "-${lane}";
  onOff = b: if b then "ON" else "OFF";
  when = b: xs: if b then xs else [ ];
  # worker/ only; docs and Nix files are dropped so that editing them rebuilds nothing.
  src = builtins.path {
    path = root + "/worker";
    name = "dgr-worker-src";
    filter =
      path: type:
      builtins.match ".*\\.(md|nix)" (baseNameOf path) == null
      && builtins.match "BUILD(\\.bazel)?" (baseNameOf path) == null;
  };
in
stdenv.mkDerivation {
  pname = "dgr-worker${suffix}";
  version = pin.release;
  inherit src;

  nativeBuildInputs =
    [
      cmake
      ninja
    ]
    ++ when useCuda [ cudaPackages.cuda_nvcc ]
    ++ when useVulkan [ shaderc ]
    ++ when useRocm [ rocmPackages.clr ];
  buildInputs =
    when useCuda [
      cudaPackages.cuda_cudart
      cudaPackages.libcublas
      cudaPackages.cuda_cccl
    ]
    ++ when useVulkan [
      vulkan-headers
      vulkan-loader
    ]
    ++ when useRocm [
      rocmPackages.clr
      rocmPackages.hipblas
      rocmPackages.rocblas
    ];

  cmakeFlags =
    [
      "-DDGR_LLAMA_SRC=${llamaSrc}"
      # Portable builds: no -march=native in a package.
      "-DGGML_NATIVE=OFF"
      "-DGGML_CCACHE=OFF"
      "-DGGML_CUDA=${onOff useCuda}"
      "-DGGML_HIP=${onOff useRocm}"
      "-DGGML_VULKAN=${onOff useVulkan}"
      "-DGGML_METAL=${onOff useMetalKit}"
    ]
    ++ when useCuda [
      "-DCMAKE_CUDA_ARCHITECTURES=${builtins.concatStringsSep ";" cudaArchitectures}"
    ];

  installPhase = ''
    runHook preInstall
    install -Dm755 libdgr_engine.so $out/lib/libdgr_engine.so
    install -Dm644 ${root + "/worker/engine/dgr_engine.h"} $out/include/dgr_engine.h
    install -Dm755 ${writeShellScript "dgr-worker" ''
      export DGR_ENGINE_LIB="''${DGR_ENGINE_LIB:-@out@/lib/libdgr_engine.so}"
      exec ${dgr}/bin/dgr worker "$@"
    ''} $out/bin/dgr-worker
    substituteInPlace $out/bin/dgr-worker --replace-fail @out@ $out
    runHook postInstall
  '';

  passthru = {
    inherit lane llamaSrc dgr;
  };

  meta = {
    description = "dgr shard worker, ${lane} lane (pinned llama.cpp ${pin.release})";
    mainProgram = "dgr-worker";
    platforms =
      if useMetalKit then
        [ "aarch64-darwin" ]
      else if useCuda || useRocm then
        [
          "x86_64-linux"
          "aarch64-linux"
        ]
      else
        [
          "x86_64-linux"
          "aarch64-linux"
          "aarch64-darwin"
        ];
    # Metal needs Apple's frameworks: it can only be built on macOS.
    broken = useMetalKit && !stdenv.isDarwin;
  };
}
