"""Backend lanes: one table and one macro per side, never a copy per backend.

A lane is a backend build of llama.cpp + the ShardEngine (dgr.core.constants.LANES). Every lane has the
same targets, made by the macros below from the `LANES` table:

  @llama_cpp//:ggml_<lane>            ggml's backend registry with the lane's backend linked in
  //worker:libdgr_engine_<lane>.so    the engine (C ABI) as a shared library
  //worker:engine_<lane>              the same as a cc_library (for cc_test and other C++ users)
  //:release_<lane>                   dgr-worker + engine + MANIFEST.json (blake3 of each file), a .tar
  //:image_<lane>                     the worker's OCI image made from the release (IMAGE_LANES only)
  //:tools_image_<lane>               the tools image dgr:<version> (bin/dgr on the host's CPython; IMAGE_LANES)

`--config=<lane>` (.bazelrc) points the unsuffixed aliases (//worker:engine, //:release) at one lane.
Lanes that need hardware this machine lacks are tagged `manual` (so `bazel test //...` skips them)
plus `requires-<hardware>`; lanes that cannot be built here at all say why when built.
"""

load("@rules_cc//cc:defs.bzl", "cc_binary", "cc_library")

# How the CPU lane's code may be vectorized. x86-64-v3 (AVX2, FMA, F16C, BMI2: Haswell and later) so
# that a release runs on any such machine, rather than -march=native, which would tie the release to
# the build machine and make it differ between builders.
CPU_ARCH_COPTS = select({
    "@bazel_tools//src/conditions:linux_x86_64": ["-march=x86-64-v3"],
    "//conditions:default": [],
})

# status: "built-here" (built and tested by `bazel test //...`), "compiles-here" (built here, runs
# only on hardware: manual + requires-*), "declared" (cannot be built here; `reason` says why).
LANES = {
    "cpu": struct(
        defines = ["GGML_USE_CPU"],
        backend = None,
        tags = [],
        status = "built-here",
        reason = "",
    ),
    "cuda": struct(
        defines = ["GGML_USE_CPU", "GGML_USE_CUDA"],
        backend = "ggml_cuda_backend",
        tags = ["manual", "requires-gpu", "requires-cuda"],
        status = "compiles-here",
        # Built here with the installed nvcc for one architecture (toolchains/cuda.bzl); runs only
        # on a CUDA host. A missing toolkit or cuBLAS fails the lane's targets with what to install.
        reason = "",
    ),
    "vulkan": struct(
        defines = ["GGML_USE_CPU", "GGML_USE_VULKAN"],
        backend = "ggml_vulkan_backend",
        # Built and tested here: Mesa's software device (lavapipe) runs it (toolchains/vulkan.bzl,
        # tests/BUILD.bazel); a real GPU is needed only for its speed.
        tags = [],
        status = "built-here",
        reason = "",
    ),
    "rocm": struct(
        defines = ["GGML_USE_CPU", "GGML_USE_HIP"],
        backend = None,
        tags = ["manual", "requires-gpu", "requires-rocm"],
        status = "declared",
        # Attempted here (docs/build.md, "ROCm lane"): Debian 12's hipcc / libamdhip64-dev 5.2.3 install,
        # but upstream's configure of ggml-hip stops at once (no hip-lang CMake package for
        # enable_language(HIP)), the pinned ggml-hip/CMakeLists.txt requires HIP >= 6.1, and Debian 12
        # packages neither rocBLAS nor hipBLAS, which ggml-hip links.
        reason = ("the ROCm lane is declared, not built: Debian 12's HIP (5.2.3) is older than the HIP " +
                  "6.1 that the pinned ggml-hip requires, lacks the hip-lang CMake package, and Debian " +
                  "packages no rocBLAS/hipBLAS; build it with the Nix package .#rocm or on a host with ROCm 6.1+"),
    ),
    "metal": struct(
        defines = ["GGML_USE_CPU", "GGML_USE_METAL"],
        backend = None,
        tags = ["manual", "requires-macos"],
        status = "declared",
        reason = ("the Metal lane is declared, not built: it needs macOS (Metal framework, Apple " +
                  "clang); build it with the Nix package .#metal on a Mac"),
    ),
}

def _declared_unavailable(name, lane, tags):
    """A target that fails with the lane's reason when built (only by name: it is manual)."""
    native.genrule(
        name = name,
        outs = [name + ".h"],
        cmd = "echo 'dgr: %s' >&2; exit 1" % LANES[lane].reason.replace("'", ""),
        tags = tags,
    )

def ggml_lane_libraries(cxx_copts, defines, linkopts):
    """In @llama_cpp's BUILD: `ggml_<lane>` for every lane (registry + CPU backend + the lane's)."""
    for lane, info in LANES.items():
        deps = [":ggml_base", ":ggml_cpu_backend"]
        srcs = ["ggml/src/ggml-backend-reg.cpp", "ggml/src/ggml-backend-dl.cpp"]
        if info.status == "declared":
            _declared_unavailable("ggml_%s_unavailable" % lane, lane, info.tags)
            srcs = srcs + [":ggml_%s_unavailable" % lane]
        elif info.backend:
            deps = deps + [":" + info.backend]
        cc_library(
            name = "ggml_" + lane,
            srcs = srcs,
            copts = cxx_copts,
            linkopts = linkopts,
            local_defines = defines + info.defines + ["GGML_BUILD"],
            deps = deps,
            tags = info.tags,
            alwayslink = True,
        )

# The engine's own C++ (worker/engine): hidden visibility, only the C ABI (DGR_API) is exported.
ENGINE_COPTS = [
    "-std=gnu++17",
    "-O3",
    "-fopenmp",
    "-fvisibility=hidden",
    "-fvisibility-inlines-hidden",
]

def dgr_engine_lanes(srcs, hdrs, defines = []):
    """In worker/engine: `engine_<lane>` (cc_library) and `libdgr_engine_<lane>.so` for every lane,
    and `engine` / `libdgr_engine.so` aliases that follow --config=<lane> (default: cpu)."""
    for lane, info in LANES.items():
        cc_library(
            name = "engine_" + lane,
            srcs = srcs,
            hdrs = hdrs,
            copts = ENGINE_COPTS,
            # dgr_engine_lane() reports it; the worker advertises it
            local_defines = defines + ["DGR_LANE=" + lane],
            includes = ["."],
            deps = [
                "@llama_cpp//:dgr_upstream",
                "@llama_cpp//:json_schema_to_grammar",
                "@llama_cpp//:llama",
                "@llama_cpp//:ggml_" + lane,
            ],
            tags = info.tags,
            visibility = ["//visibility:public"],
            alwayslink = True,
        )
        cc_binary(
            name = "libdgr_engine_%s.so" % lane,
            linkshared = True,
            linkopts = ["-fopenmp"],
            deps = [":engine_" + lane],
            tags = info.tags,
            visibility = ["//visibility:public"],
        )
    lane_alias("engine", ":engine_%s")
    lane_alias("libdgr_engine.so", ":libdgr_engine_%s.so")

def lane_config_settings():
    """In toolchains/: `lane_<lane>` config_settings that --config=<lane> (--define=dgr_lane=) selects."""
    for lane in LANES:
        native.config_setting(
            name = "lane_" + lane,
            define_values = {"dgr_lane": lane},
            visibility = ["//visibility:public"],
        )

def lane_select(pattern):
    choices = {"//toolchains:lane_" + lane: pattern % lane for lane in LANES if lane != "cpu"}
    choices["//conditions:default"] = pattern % "cpu"
    return choices

def lane_alias(name, pattern, visibility = ["//visibility:public"]):
    """`name`, an alias of `pattern % lane` for the lane --config=<lane> selects (cpu by default)."""
    native.alias(
        name = name,
        actual = select(lane_select(pattern)),
        visibility = visibility,
    )

def dgr_releases():
    """At the top level: `release_<lane>` for every lane (and `release`, which follows --config).

    Outputs release_<lane>.tar.gz and release_<lane>.MANIFEST.json (toolchains/bazel/release.py)."""
    for lane, info in LANES.items():
        engine = "//worker/engine:libdgr_engine_%s.so" % lane
        native.genrule(
            name = "release_" + lane,
            srcs = [
                engine,
                "//worker/server:dgr-worker",
                "@llama_cpp//:dgr_upstream.json",
                "@dgr_python_deps//:wheels",
                "//toolchains:python-runtime.lock.json",
                "//tools/dgr:dgr_files",
            ],
            outs = [
                "release_%s.tar.gz" % lane,
                "release_%s.MANIFEST.json" % lane,
            ],
            cmd = " ".join([
                "python3 $(location //toolchains/bazel:release.py)",
                "--lane " + lane,
                "--out $(location release_%s.tar.gz)" % lane,
                "--manifest $(location release_%s.MANIFEST.json)" % lane,
                "--engine $(location %s)" % engine,
                "--worker $(location //worker/server:dgr-worker)",
                "--upstream $(location @llama_cpp//:dgr_upstream.json)",
                "--lock $(location //toolchains:python-runtime.lock.json)",
                "--wheel $(locations @dgr_python_deps//:wheels)",
                "--python-root tools",
                "$(locations //tools/dgr:dgr_files)",
            ]),
            tools = ["//toolchains/bazel:release.py"],
            tags = info.tags,
            visibility = ["//visibility:public"],
        )
    lane_alias("release", ":release_%s", visibility = None)

# Lanes with a worker image. Why the others have none, and what theirs would need, is said once, by
# tools/dgr/toolchain/image.py (LANE_IMAGES), which their image_<lane> targets run (tests/builds/test_build_image.py
# holds the two lists equal).
IMAGE_LANES = ["cpu"]

def dgr_images():
    """At the top level: `image_<lane>` for every lane, from `release_<lane>` (docs/deploy.md, "Container image"),
    and `tools_image_<lane>` (dgr:<version>, tools_image.py) for the lanes with an image.

    Outputs image_<lane>.tar (an OCI image layout with Docker's manifest.json: `docker load -i`, `podman load -i`)
    and image_<lane>.MANIFEST.json (the image's digest and the release archive it was made from), written by
    tools/dgr/toolchain/image.py (with rootfs.py). The shared libraries come from the building host (`ld.so --list`), as the
    release's own binaries were linked against them. A lane without an image fails, saying why (manual)."""
    script = "//tools/dgr:toolchain/image.py"
    tools = [script, "//tools/dgr:toolchain/tools_image.py", "//tools/dgr:image_tool"]
    for lane, info in LANES.items():
        if lane not in IMAGE_LANES:
            native.genrule(
                name = "image_" + lane,
                outs = ["image_%s.tar" % lane],
                cmd = "python3 $(location %s) --refuse-lane %s" % (script, lane),
                tools = tools,
                tags = info.tags + ([] if "manual" in info.tags else ["manual"]),
            )
            continue
        native.genrule(
            name = "image_" + lane,
            srcs = [":release_%s.tar.gz" % lane],
            outs = ["image_%s.tar" % lane, "image_%s.MANIFEST.json" % lane],
            cmd = " ".join([
                "python3 $(location %s)" % script,
                "--release $(location :release_%s.tar.gz)" % lane,
                "--tar $(location image_%s.tar)" % lane,
                "--manifest $(location image_%s.MANIFEST.json)" % lane,
            ]),
            tools = tools,
            tags = info.tags,
            visibility = ["//visibility:public"],
        )
        # the tools image dgr:<version>: the whole release (bin/dgr its entrypoint) on the host's CPython
        native.genrule(
            name = "tools_image_" + lane,
            srcs = [":release_%s.tar.gz" % lane],
            outs = ["tools_image_%s.tar" % lane, "tools_image_%s.MANIFEST.json" % lane],
            cmd = " ".join([
                "python3 $(location //tools/dgr:toolchain/tools_image.py)",
                "--release $(location :release_%s.tar.gz)" % lane,
                "--tar $(location tools_image_%s.tar)" % lane,
                "--manifest $(location tools_image_%s.MANIFEST.json)" % lane,
            ]),
            tools = tools,
            tags = info.tags,
            visibility = ["//visibility:public"],
        )
