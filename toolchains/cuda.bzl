"""The CUDA lane: toolkit discovery (`@cuda_toolkit`), an nvcc rule, and ggml-cuda as a cc_library.

1. `cuda_toolkit_repository` (WORKSPACE and MODULE.bazel: `@cuda_toolkit`) finds nvcc
   ($CUDA_PATH/bin, /usr/local/cuda/bin, then PATH), cudart beside it, and cuBLAS / cuBLASLt: in
   $CUBLAS_ROOT when set (only there), else in the toolkit, else in the Python wheel
   (`nvidia/cu<major>/` of the `nvidia-cublas` package; scripts/setup-cuda installs it). It always
   succeeds: when something is missing it writes a stub whose `nvcc` and `cuda_runtime` fail, only
   when a CUDA target is built, with what to install. `toolkit.json` in the repository says what was
   found (`bazel info output_base`/external/cuda_toolkit/toolkit.json).
2. `cuda_objects` compiles each `.cu` with nvcc (one action per file) into PIC objects for one GPU
   architecture: `--define=cuda_arch=<sm>` (default `CUDA_ARCH_DEFAULT`), e.g. 89 or 120a.
3. `ggml_cuda_backend` (called once at the end of @llama_cpp's BUILD) defines the backend library the
   `cuda` lane links (lanes.bzl: `LANES["cuda"].backend`), with the flags and defines of upstream's
   ggml/src/ggml-cuda/CMakeLists.txt (Release, default options) plus GGML_CUDA_NO_VMM (no libcuda
   is linked: the driver is loaded through cudart at run time), and a small probe (one upstream .cu
   and a shared library linked against cudart and cuBLAS) that tests can afford to build.

When the pin moves, compare with the pinned ggml/src/ggml-cuda/CMakeLists.txt and the
`ggml_cuda_fattn_vec_instances` function of ggml/cmake/common.cmake (new sources are picked up by
the globs; new defines and flags are not).
"""

load("//toolchains:checkout_python.bzl", "checkout_python")
load("@rules_cc//cc:defs.bzl", "cc_binary", "cc_library")

# Hopper (H100/H200): the GPUs a CUDA host of this project has. One architecture, to keep the build
# affordable; real deployments choose theirs with --define=cuda_arch=<sm> (80, 86, 89, 120a, ...).
CUDA_ARCH_DEFAULT = "90"

# ---------------------------------------------------------------------------------------------------
# 1. @cuda_toolkit

_SETUP_HINT = ("install cuBLAS with scripts/setup-cuda (the `nvidia-cublas` Python wheel that " +
               "matches the toolkit's major version), or set CUBLAS_ROOT to a folder with " +
               "include/cublas_v2.h and lib/libcublas.so.<major>")

_FIND_WHEEL = """
import sys
major = sys.argv[1]
try:
    import nvidia
except ImportError:
    sys.exit(0)
import os
for base in list(nvidia.__path__):
    for sub in ("cu" + major, "cublas"):
        root = os.path.join(base, sub)
        if os.path.isfile(os.path.join(root, "include", "cublas_v2.h")):
            print(root)
"""

def _realpath(ctx, path):
    res = ctx.execute(["readlink", "-f", str(path)], quiet = True)
    return res.stdout.strip() if res.return_code == 0 and res.stdout.strip() else str(path)

def _find_nvcc(ctx):
    candidates = []
    cuda_path = ctx.os.environ.get("CUDA_PATH", "")
    if cuda_path:
        candidates.append(cuda_path + "/bin/nvcc")
    candidates.append("/usr/local/cuda/bin/nvcc")
    on_path = ctx.which("nvcc")
    if on_path:
        candidates.append(str(on_path))
    for c in candidates:
        if ctx.path(c).exists:
            return _realpath(ctx, c), candidates
    return None, candidates

def _nvcc_version(ctx, nvcc):
    """(release, e.g. "13.0", and nvcc's full version text), or (None, "")."""
    res = ctx.execute([nvcc, "--version"], quiet = True)
    i = res.stdout.find("release ")
    if res.return_code != 0 or i < 0:
        return None, ""
    return res.stdout[i + len("release "):].split(",")[0].strip(), res.stdout.strip()

def _find_lib(ctx, dirs, stem, major):
    """The first `<stem>.so.<major>` (else `<stem>.so`) in dirs, as (folder, file name)."""
    for d in dirs:
        for name in ("%s.so.%s" % (stem, major), stem + ".so"):
            if ctx.path(d + "/" + name).exists:
                return d, name
    return None, None

def _lib_dirs(root):
    return [root + "/lib64", root + "/lib", root + "/targets/x86_64-linux/lib", root + "/targets/sbsa-linux/lib"]

def _find_cublas(ctx, cuda_root, major):
    """(include folder, lib folder, [cublas, cublasLt file names], where, what was tried)."""
    tried = []
    roots = []
    env_root = ctx.os.environ.get("CUBLAS_ROOT", "")
    if env_root:
        roots.append(("CUBLAS_ROOT", env_root))
    else:
        roots.append(("the CUDA toolkit", cuda_root))
        python = checkout_python(ctx)
        if python:
            res = ctx.execute([python, "-c", _FIND_WHEEL, major], quiet = True)
            for line in res.stdout.strip().split("\n"):
                if line.strip():
                    roots.append(("the Python wheel", _realpath(ctx, line.strip())))
        else:
            tried.append("python3 (to look for the nvidia-cublas wheel): not on PATH")
    for where, root in roots:
        include = None
        for inc in (root + "/include", root + "/targets/x86_64-linux/include"):
            if ctx.path(inc + "/cublas_v2.h").exists:
                include = inc
                break
        libdir, cublas = _find_lib(ctx, _lib_dirs(root), "libcublas", major)
        lt_dir, cublas_lt = _find_lib(ctx, _lib_dirs(root), "libcublasLt", major)
        if include and cublas and cublas_lt and lt_dir == libdir:
            return include, libdir, [cublas, cublas_lt], where, tried
        tried.append("%s (%s): %s" % (where, root, ", ".join([
            what
            for what, ok in (
                ("no include/cublas_v2.h", include),
                ("no lib/libcublas.so.%s" % major, cublas),
                ("no lib/libcublasLt.so.%s" % major, cublas_lt),
            )
            if not ok
        ]) or "libcublas and libcublasLt in different folders"))
    return None, None, None, None, tried

_STUB_BUILD = """# Generated by //toolchains:cuda.bzl: the CUDA toolkit is not usable here (toolkit.json says why).
package(default_visibility = ["//visibility:public"])

exports_files(["nvcc", "toolkit.json"])

filegroup(name = "cublas_headers", srcs = [])

genrule(
    name = "missing",
    outs = ["missing.h"],
    cmd = "$(location :nvcc) --dgr-missing; exit 1",
    tools = [":nvcc"],
)

cc_library(name = "cuda_runtime", srcs = [":missing"])
"""

_FOUND_BUILD = """# Generated by //toolchains:cuda.bzl from the CUDA toolkit found here (toolkit.json).
package(default_visibility = ["//visibility:public"])

exports_files(["nvcc", "toolkit.json"])

# cuBLAS's headers (a symlink to the folder found); nvcc finds the toolkit's own headers itself.
filegroup(name = "cublas_headers", srcs = glob(["cublas/include/*.h"]))

# cudart (shared) and cuBLAS/cuBLASLt, linked by soname: the library needs libcudart.so.%{MAJOR},
# libcublas.so.%{MAJOR} and libcublasLt.so.%{MAJOR} from the loader's path at run time (no rpath).
cc_library(
    name = "cuda_runtime",
    linkopts = %{LINKOPTS},
)
"""

def _cuda_toolkit_repository_impl(ctx):
    nvcc, tried_nvcc = _find_nvcc(ctx)
    info = {"nvcc": nvcc, "missing": ""}
    problem = ""
    if not nvcc:
        problem = ("no nvcc (tried %s): install the CUDA toolkit, or set CUDA_PATH to its folder" %
                   ", ".join(tried_nvcc))
    else:
        cuda_root = nvcc.rpartition("/bin/")[0]
        version, version_text = _nvcc_version(ctx, nvcc)
        major = version.split(".")[0] if version else ""
        cudart_dir, cudart = _find_lib(ctx, _lib_dirs(cuda_root), "libcudart", major)
        info.update({"cuda_root": cuda_root, "version": version or ""})
        if not version:
            problem = "%s --version did not say its release" % nvcc
        elif not cudart:
            problem = "the CUDA toolkit at %s has no libcudart.so.%s (its lib64/)" % (cuda_root, major)
        else:
            include, libdir, libs, where, tried = _find_cublas(ctx, cuda_root, major)
            info["cudart"] = cudart_dir + "/" + cudart
            if not include:
                problem = "no cuBLAS for CUDA %s (looked in %s): %s" % (version, "; ".join(tried), _SETUP_HINT)
            else:
                info.update({
                    "cublas_from": where,
                    "cublas_include": include,
                    "cublas_libs": [libdir + "/" + lib for lib in libs],
                })
                ctx.symlink(include, "cublas/include")
                linkopts = [
                    "-L" + cudart_dir,
                    "-l:" + cudart,
                    "-L" + libdir,
                    "-Wl,-rpath-link," + libdir,
                ] + ["-l:" + lib for lib in libs] + ["-lrt", "-ldl", "-lpthread"]
                ctx.file("BUILD.bazel", _FOUND_BUILD.replace("%{MAJOR}", major).replace(
                    "%{LINKOPTS}",
                    repr(linkopts),
                ))
    if problem:
        info["missing"] = problem
        message = "dgr: the CUDA lane cannot be built here: " + problem + \
                  ". Then `bazel sync --only=cuda_toolkit` (or restart Bazel) to look again."
        ctx.file("nvcc", "#!/bin/sh\necho %s >&2\nexit 1\n" % _shell_quote(message), executable = True)
        ctx.file("BUILD.bazel", _STUB_BUILD)
    else:
        # The wrapper is an input of every nvcc action: its text (nvcc's path and full version) keys
        # the (disk) cache, so another toolkit at the same path does not reuse objects.
        ctx.file("nvcc", "#!/bin/sh\n%s\nexec %s \"$@\"\n" % (
            "\n".join(["# " + line for line in version_text.split("\n")]),
            _shell_quote(nvcc),
        ), executable = True)
    ctx.file("WORKSPACE", 'workspace(name = "%s")\n' % ctx.name)
    ctx.file("toolkit.json", json.encode_indent(info, indent = "  ") + "\n")

def _shell_quote(s):
    return "'" + s.replace("'", "'\\''") + "'"

cuda_toolkit_repository = repository_rule(
    implementation = _cuda_toolkit_repository_impl,
    environ = ["CUDA_PATH", "CUBLAS_ROOT", "PATH"],
    # Looked up on the machine at every fetch (cheap): a toolkit or wheel installed later is found.
    local = True,
    doc = "The local CUDA toolkit (nvcc, cudart) and cuBLAS, or a stub that says what is missing.",
)

# ---------------------------------------------------------------------------------------------------
# 2. nvcc: one action per .cu, PIC objects for one architecture

def _cuda_objects_impl(ctx):
    arch = ctx.var.get("cuda_arch", CUDA_ARCH_DEFAULT)
    inputs = depset(ctx.files.hdrs + ctx.files._cublas_headers)
    cublas_include = ctx.attr._cublas_headers.label.workspace_root + "/cublas/include"
    pkg = ctx.label.workspace_root
    objs = []
    for src in ctx.files.srcs:
        rel = src.short_path.replace("../", "", 1)
        if rel.startswith(ctx.label.workspace_name + "/"):
            rel = rel[len(ctx.label.workspace_name) + 1:]
        out = ctx.actions.declare_file("_objs/%s/%s.pic.o" % (ctx.label.name, rel[:-len(".cu")]))
        args = ctx.actions.args()
        args.add_all(["-c", src.path, "-o", out.path])
        args.add_all(["-gencode", "arch=compute_%s,code=sm_%s" % (arch, arch)])
        args.add_all(ctx.attr.copts)
        args.add_all(["-Xcompiler", "-fPIC"])
        args.add_all(ctx.attr.defines, format_each = "-D%s")
        for inc in ctx.attr.includes:
            args.add("-I" + (pkg + "/" + inc if pkg else inc))
        args.add("-isystem", cublas_include)
        ctx.actions.run(
            executable = ctx.executable._nvcc,
            arguments = [args],
            inputs = depset([src], transitive = [inputs]),
            outputs = [out],
            mnemonic = "NvccCompile",
            progress_message = "nvcc (sm_%s) %s" % (arch, rel),
            use_default_shell_env = True,
        )
        objs.append(out)
    return [DefaultInfo(files = depset(objs))]

cuda_objects = rule(
    implementation = _cuda_objects_impl,
    attrs = {
        "srcs": attr.label_list(allow_files = [".cu"]),
        "hdrs": attr.label_list(allow_files = True),
        "includes": attr.string_list(doc = "include folders, relative to the repository root"),
        "defines": attr.string_list(),
        "copts": attr.string_list(),
        "_nvcc": attr.label(
            default = Label("@cuda_toolkit//:nvcc"),
            allow_single_file = True,
            executable = True,
            cfg = "exec",
        ),
        "_cublas_headers": attr.label(default = Label("@cuda_toolkit//:cublas_headers")),
    },
    doc = "Compiles each .cu with nvcc into a PIC object (`.pic.o`) that a cc_library takes as srcs.",
)

# ---------------------------------------------------------------------------------------------------
# 3. ggml-cuda (in @llama_cpp's BUILD)

# nvcc flags of upstream's Release build: -O3 -DNDEBUG (CMake Release), C++17 (CMAKE_CUDA_STANDARD),
# CUDA_FLAGS (-use_fast_math -extended-lambda, -compress-mode=size from CUDA 12.8, the default
# GGML_CUDA_COMPRESSION_MODE), -Wno-pedantic for the host compiler; -w: upstream's warnings are upstream's.
NVCC_COPTS = [
    "-O3",
    "-std=c++17",
    "-use_fast_math",
    "-extended-lambda",
    "-compress-mode=size",
    "-Xcompiler",
    "-Wno-pedantic",
    "-w",
]

# FlashAttention K-V type pairs compiled for the vector kernel: upstream's default GGML_CUDA_FA_QUANTS.
FA_TYPES = ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "bf16", "f16"]

FA_QUANTS = ["q4_0-q4_0", "q8_0-q8_0", "f16-f16", "bf16-bf16"]

def _fa_combinations():
    combos = ["f16-f16"]
    for c in FA_QUANTS:
        if c not in combos:
            combos.append(c)
    return combos

def _cuda_defines(defines):
    combos = _fa_combinations()
    fa = ['GGML_CUDA_FA_QUANTS="%s"' % ",".join(FA_QUANTS)]
    for v in FA_TYPES:
        for k in FA_TYPES:
            fa.append("GGML_CUDA_FA_%s_%s=%d" % (k.upper(), v.upper(), 1 if "%s-%s" % (k, v) in combos else 0))
    return defines + [
        "NDEBUG",
        "GGML_BACKEND_BUILD",
        "GGML_CUDA_USE_GRAPHS",  # GGML_CUDA_GRAPHS: ON by default in a llama.cpp build
        "GGML_CUDA_NO_VMM",
    ] + fa

def ggml_cuda_backend(name, defines, tags = ["manual", "requires-gpu", "requires-cuda"]):
    """`<name>`: ggml-cuda (all of upstream's CMake sources for CUDA) as an alwayslink cc_library.

    Also `<name>_probe_objects` (one small upstream .cu through the same rule and flags) and
    `<name>_probe.so` (it linked against cudart and cuBLAS): what a test can build in about a minute."""
    cuda = "ggml/src/ggml-cuda/"
    srcs = native.glob([cuda + "*.cu"]) + native.glob([
        cuda + "template-instances/fattn-tile*.cu",
        cuda + "template-instances/fattn-mma*.cu",
        cuda + "template-instances/mmq*.cu",
        cuda + "template-instances/mmf*.cu",
    ]) + [cuda + "template-instances/fattn-vec-instance-%s.cu" % c for c in _fa_combinations()]
    hdrs = native.glob([
        "ggml/include/*.h",
        "ggml/src/*.h",
        cuda + "**/*.cuh",
        cuda + "vendors/*.h",
    ])
    common = dict(
        hdrs = hdrs,
        includes = ["ggml/include", "ggml/src"],
        defines = _cuda_defines(defines),
        copts = NVCC_COPTS,
        tags = tags,
    )
    cuda_objects(name = name + "_objects", srcs = srcs, **common)
    cc_library(
        name = name,
        srcs = [":" + name + "_objects"],
        deps = [":ggml_base", Label("@cuda_toolkit//:cuda_runtime")],
        tags = tags,
        alwayslink = True,
    )
    cuda_objects(name = name + "_probe_objects", srcs = [cuda + "arange.cu"], **common)
    cc_library(
        name = name + "_probe_lib",
        srcs = [":" + name + "_probe_objects"],
        deps = [Label("@cuda_toolkit//:cuda_runtime")],
        tags = tags,
        alwayslink = True,
    )
    cc_binary(
        name = name + "_probe.so",
        linkshared = True,
        deps = [":" + name + "_probe_lib"],
        tags = tags,
    )
