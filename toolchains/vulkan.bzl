"""The Vulkan lane's backend library, ggml-vulkan, as native Bazel rules (called in @llama_cpp's BUILD).

Upstream's CMake builds a host tool, `vulkan-shaders-gen`, which runs `glslc` over every compute
shader (many variants per shader) and embeds the SPIR-V in generated C++; the backend compiles those
with its own sources. Here the same steps are Bazel actions:

  :vulkan_shaders_gen               the host tool (cc_binary, built for the exec configuration)
  :vulkan_shaders_hpp               ggml-vulkan-shaders.hpp, declarations of every shader blob
  :vulkan_shader_<name>             <name>.comp.cpp, one action per shader (like upstream's CMake)
  :ggml_vulkan_backend              ggml-vulkan.cpp and friends + the generated sources, -lvulkan

What the host offers (glslc, headers, loader, glslc's extension support) is found when @llama_cpp is
set up (toolchains/llama_cpp.bzl, `_vulkan_config`); when something is missing, every target here
fails with what to install, and the other lanes build as before.
"""

load("@rules_cc//cc:defs.bzl", "cc_binary", "cc_library")

_SHADER_DIR = "ggml/src/ggml-vulkan/vulkan-shaders"
_GEN_DIR = "vulkan_gen"

def _missing(name, config):
    native.genrule(
        name = name,
        outs = [name + ".missing"],
        cmd = "echo 'dgr: the Vulkan lane needs %s; install them (scripts/setup does), then `bazel sync --only=llama_cpp`' >&2; exit 1" % config["missing"],
    )
    return ":" + name

def ggml_vulkan_backend(name, config, cxx_copts, defines, linkopts):
    """`name` (cc_library): ggml's Vulkan backend with its shaders compiled by the host's glslc."""
    features = config["features"]
    guard = []
    if config["missing"]:
        guard = [_missing(name + "_unavailable", config)]

    cc_binary(
        name = "vulkan_shaders_gen",
        srcs = [_SHADER_DIR + "/vulkan-shaders-gen.cpp"],
        copts = ["-std=gnu++17", "-O2", "-w"],
        local_defines = features,
        linkopts = ["-lpthread"],
    )

    shader_inputs = native.glob([
        _SHADER_DIR + "/*.comp",
        _SHADER_DIR + "/*.glsl",
        _SHADER_DIR + "/*.h",
    ])
    gen = "$(location :vulkan_shaders_gen)"

    # The header lists every shader; it is written only when no --source is given.
    native.genrule(
        name = "vulkan_shaders_hpp",
        srcs = guard,
        outs = [_GEN_DIR + "/ggml-vulkan-shaders.hpp"],
        cmd = "T=$$(mktemp -d) && %s --output-dir $$T/spv --target-hpp $@ >$$T/log 2>&1 || { cat $$T/log >&2; exit 1; }; rm -rf $$T" % gen,
        tools = [":vulkan_shaders_gen"],
    )

    # One action per shader, as upstream's CMake: SPIR-V goes to a scratch folder, the embedding C++
    # is the only output (the tool's dependency file stays in the scratch folder too).
    generated = []
    for comp in native.glob([_SHADER_DIR + "/*.comp"]):
        base = comp.split("/")[-1]
        out = "%s/%s.cpp" % (_GEN_DIR, base)
        native.genrule(
            name = "vulkan_shader_" + base[:-len(".comp")],
            srcs = shader_inputs + guard,
            outs = [out],
            cmd = " ".join([
                "T=$$(mktemp -d) &&",
                gen,
                "--glslc " + config["glslc"],
                "--source $(location %s)" % comp,
                "--output-dir $$T/spv",
                "--target-hpp $$T/ggml-vulkan-shaders.hpp",
                "--target-cpp $$T/%s.cpp" % base,
                ">$$T/log 2>&1 || { cat $$T/log >&2; exit 1; };",
                "cp $$T/%s.cpp $@ && rm -rf $$T" % base,
            ]),
            tools = [":vulkan_shaders_gen"],
        )
        generated.append(out)

    cc_library(
        name = "vulkan_shaders_header",
        hdrs = [_GEN_DIR + "/ggml-vulkan-shaders.hpp"],
        includes = [_GEN_DIR],
    )

    include_copts = ["-isystem", config["include_dir"]] if config["include_dir"] and config["include_dir"] != "/usr/include" else []
    cc_library(
        name = name,
        srcs = native.glob([
            "ggml/src/ggml-vulkan/*.cpp",
            "ggml/src/ggml-vulkan/*.h",
        ]) + generated,
        hdrs = ["ggml/include/ggml-vulkan.h"],
        copts = cxx_copts + include_copts + ["-fvisibility=hidden", "-fvisibility-inlines-hidden"],
        local_defines = defines + features + ["GGML_BACKEND_BUILD"],
        linkopts = linkopts + (["-L" + config["lib_dir"]] if config["lib_dir"] else []) + ["-lvulkan"],
        deps = [
            ":ggml_base",
            ":ggml_cpu_headers",
            ":ggml_src_headers",
            ":vulkan_shaders_header",
        ],
        alwayslink = True,
    )
