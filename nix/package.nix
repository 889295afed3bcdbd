# The dgr worker of one backend lane, both from worker/CMakeLists.txt: the ShardEngine
# (lib/libdgr_engine.so over the patched llama.cpp, include/dgr_engine.h) and bin/dgr-worker, the stage
# worker as one C++ program (worker/server: gRPC C++, protobuf, OpenSSL, the pinned BLAKE3 C sources) that
# serves a stage with no Python; it finds the engine at ../lib/libdgr_engine.so. One package; each backend
# is an override (useCuda, useRocm, useVulkan, useMetalKit), suffixed by its lane.
{
  stdenv,
  cmake,
  ninja,
  pkg-config,
  grpc,
  protobuf,
  openssl,
  pin,
  root,
  llamaSrc,
  blake3Src,
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
  # What worker/CMakeLists.txt reads: worker/ (with third_party/blake3.json, a configure dependency),
  # ../proto (dgr-worker's stubs are generated from proto/dgr/v1/stage.proto) and
  # ../toolchains/llama.cpp.pin.json (the pin dgr-worker advertises). Docs, Bazel and Nix files are
  # dropped so that editing them rebuilds nothing. CMake runs on worker/ (cmakeDir).
  src = builtins.path {
    path = root;
    name = "dgr-worker-src";
    filter =
      path: type:
      let
        rel = builtins.substring (builtins.stringLength (toString root) + 1) (-1) (toString path);
        under = dir: rel == dir || builtins.substring 0 (builtins.stringLength dir + 1) rel == "${dir}/";
      in
      (under "worker" || under "proto" || rel == "toolchains" || rel == "toolchains/llama.cpp.pin.json")
      && builtins.match ".*\\.(md|nix)" (baseNameOf path) == null
      && builtins.match "BUILD(\\.bazel)?" (baseNameOf path) == null;
  };
in
stdenv.mkDerivation {
  pname = "dgr-worker${suffix}";
  version = pin.release;
  inherit src;
  cmakeDir = "../worker";

  # protoc and grpc_cpp_plugin run at build time (protobuf, grpc); pkg-config finds
  # grpc++ protobuf libcrypto libssl. nlohmann/json is the pinned llama.cpp's vendored copy
  # (${DGR_LLAMA_SRC}/vendor), as with every CMake build.
  nativeBuildInputs =
    [
      cmake
      ninja
      pkg-config
      protobuf
      grpc
    ]
    ++ when useCuda [ cudaPackages.cuda_nvcc ]
    ++ when useVulkan [ shaderc ]
    ++ when useRocm [ rocmPackages.clr ];
  buildInputs =
    [
      grpc
      protobuf
      openssl
    ]
    ++ when useCuda [
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
      "-DDGR_BLAKE3_SRC=${blake3Src}"
      "-DDGR_LANE=${lane}"
      # Portable builds: the CPU backend for the lane's declared baseline (worker/CMakeLists.txt's default,
      # DGR_CPU_VARIANT=x86-64-v3), as Bazel and the checkout build it: the same numerics (docs/numerics.md).
      "-DDGR_CPU_VARIANT=x86-64-v3"
      # the pin as the engine's numerics name it; the series hash comes from llamaSrc (preConfigure)
      "-DDGR_UPSTREAM_COMMIT=${builtins.substring 0 12 pin.commit}"
      "-DDGR_UPSTREAM_PATCHES=${toString (builtins.length pin.patches)}"
      "-DGGML_CCACHE=OFF"
      "-DGGML_CUDA=${onOff useCuda}"
      "-DGGML_HIP=${onOff useRocm}"
      "-DGGML_VULKAN=${onOff useVulkan}"
      "-DGGML_METAL=${onOff useMetalKit}"
    ]
    ++ when useCuda [
      "-DCMAKE_CUDA_ARCHITECTURES=${builtins.concatStringsSep ";" cudaArchitectures}"
    ];

  preConfigure = ''
    cmakeFlagsArray+=("-DDGR_UPSTREAM_SERIES=$(cut -c1-12 ${llamaSrc}/dgr-patch-series)")
  '';

  # CMake leaves dgr-worker out (saying why) when it finds no gRPC C++: here that is an error.
  installPhase = ''
    runHook preInstall
    if [ ! -x dgr-worker ]; then
      echo "dgr-worker was not built: see CMake's 'dgr-worker is not built' above" >&2
      exit 1
    fi
    install -Dm755 libdgr_engine.so $out/lib/libdgr_engine.so
    install -Dm644 ../worker/engine/dgr_engine.h $out/include/dgr_engine.h
    install -Dm755 dgr-worker $out/bin/dgr-worker
    runHook postInstall
  '';

  # The installed program runs on its own (its libraries found, no Python): its BLAKE3 of the pinned
  # sources is the pin's.
  doInstallCheck = true;
  installCheckPhase = ''
    runHook preInstallCheck
    ${builtins.concatStringsSep "\n" (map (name: ''
      got=$($out/bin/dgr-worker --blake3 ${blake3Src}/${name} | cut -d' ' -f1)
      if [ "$got" != "${blake3Src.files.${name}}" ]; then
        echo "dgr-worker --blake3 ${name}: $got, the pin says ${blake3Src.files.${name}}" >&2
        exit 1
      fi
    '') (builtins.attrNames blake3Src.files))}
    runHook postInstallCheck
  '';

  passthru = {
    inherit lane llamaSrc blake3Src;
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
