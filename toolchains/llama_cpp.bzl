"""The pinned, verified, patched llama.cpp as a Bazel repository (`@llama_cpp`).

One repository rule for both Bazel paths: WORKSPACE (Bazel 4 offline) and MODULE.bazel (current
Bazel, through `use_repo_rule`). It reads the single pin file `toolchains/llama.cpp.pin.json` with
`json.decode` (nothing here repeats the pin), then:

1. takes the source from the verified upstream workspace that `dgr upstream fetch` fills
   (`$DGR_WORKSPACE/upstream/src-<commit>/`, default `<repo>/.dgr`), or else extracts an archive the
   pin names: from the workspace's download cache (`cache/downloads/<file>`) or from the pin's URL,
   checked against the pin's sha256 either way;
2. checks the tree hash by running `tools/dgr/toolchain/treehash.py --expect` (the one implementation, shared
   with dgr and Nix); with the pin's listing (`tree_listing`) it names the first changed file;
3. checks that `patches/llama.cpp/` holds exactly the pin's patch list, and each patch's blake3;
   a patch that changed by one byte fails here, named. A lane's own patches
   (`patches/llama.cpp/<lane>/`) come last; each touches only its lane's backend folder (dgr checks
   that), so applying them to this one shared tree leaves every other lane's sources unchanged;
4. applies the patches in the pin's order with `ctx.patch` (strip 1, `git format-patch` output);
5. writes what CMake would configure (version headers, the Vulkan lane's host tools and glslc
   features), unity sources for `src/models/*.cpp`, and
   the BUILD file (`toolchains/bazel/llama.cpp.BUILD.bazel`, backend lanes from `lanes.bzl`).

The result is cached by Bazel until the pin, a patch, this file, the BUILD template or
`DGR_WORKSPACE` changes (`bazel sync --only=llama_cpp` forces a refetch).
"""

load("//toolchains:checkout_python.bzl", "checkout_python")

# The model sources compiled together per translation unit. Upstream's CMake uses the same unity
# batch size for src/models (UNITY_BUILD_BATCH_SIZE 16): 156 files become 10 compiles, ~3 min not 7.
UNITY_BATCH = 16

def _fail(msg):
    fail("\n[dgr] @llama_cpp: " + msg + "\n")

def _run(ctx, args, what):
    res = ctx.execute(args, quiet = True, timeout = 900)
    if res.return_code != 0:
        _fail("%s failed (exit %d):\n%s%s" % (what, res.return_code, res.stdout, res.stderr))
    return res.stdout

def _workspace_dir(ctx, root):
    ws = ctx.os.environ.get("DGR_WORKSPACE", "")
    if ws:
        return ctx.path(ws)
    return root.get_child(".dgr")

def _cmake_version(text, prefix):
    """MAJOR.MINOR.PATCH from `set(<prefix>_VERSION_MAJOR 0)` lines of a CMakeLists.txt."""
    parts = []
    for part in ("MAJOR", "MINOR", "PATCH"):
        key = "set(%s_VERSION_%s " % (prefix, part)
        i = text.find(key)
        if i < 0:
            _fail("cannot find `%s` in a CMakeLists.txt; the BUILD template needs updating" % key)
        parts.append(text[i + len(key):text.find(")", i)].strip())
    return ".".join(parts)

def _fetch_source(ctx, pin, ws):
    """Puts the pristine tree at the repository root; returns (where it came from, listing or None)."""
    commit = pin["commit"]
    pristine = ws.get_child("upstream").get_child("src-" + commit)
    if pristine.exists:
        # A copy, never links: the patches below must not touch the verified workspace tree.
        _run(ctx, ["cp", "-R", str(pristine) + "/.", "."], "copying " + str(pristine))
        listing = ws.get_child("upstream").get_child("src-%s.listing" % commit)
        return str(pristine), (listing if listing.exists else None)
    tried = []
    for src in pin["sources"]:
        url = src.get("url", "")
        name = src.get("filename") or url.split("/")[-1]
        cached = ws.get_child("cache").get_child("downloads").get_child(name)
        if cached.exists:
            url = "file://" + str(cached)
        elif not url:
            tried.append("%s: not in %s (this kind has no URL; `dgr upstream fetch` gets it)" % (name, cached))
            continue
        res = ctx.download_and_extract(
            url = url,
            sha256 = src["sha256"],
            stripPrefix = src["strip_prefix"],
            allow_fail = True,
        )
        if res.success:
            return url, None
        tried.append("%s: download or sha256 check failed" % url)
    _fail("no source of llama.cpp %s could be had:\n  %s\nRun `dgr upstream fetch` (it fills %s)." % (
        commit,
        "\n  ".join(tried),
        pristine,
    ))

def _check_patches(ctx, pin, root, python):
    """The pin's patch list, checked against patches/llama.cpp/ (the common stack and each lane's own
    folder, patches/llama.cpp/<lane>/) and against each patch's blake3."""
    entries = pin.get("patches", [])
    patch_dir = root.get_child("patches").get_child("llama.cpp")
    on_disk = []
    if patch_dir.exists:
        for p in patch_dir.readdir():
            if p.basename.endswith(".patch"):
                on_disk.append(p.basename)
            elif p.basename != "BUILD.bazel" and not p.basename.startswith("."):
                on_disk += [p.basename + "/" + q.basename for q in p.readdir() if q.basename.endswith(".patch")]
    prefix = "patches/llama.cpp/"
    listed = [e["file"][len(prefix):] if e["file"].startswith(prefix) else e["file"] for e in entries]
    for name in sorted(on_disk):
        if name not in listed:
            _fail("patches/llama.cpp/%s is not in the pin's patch list (toolchains/llama.cpp.pin.json); " % name +
                  "add it with its blake3 (`dgr upstream pin-patches`, docs/upstream.md) or remove it")
    for name in listed:
        if name not in on_disk:
            _fail("the pin lists patches/llama.cpp/%s but there is no such file" % name)
    paths = [ctx.path(Label("//patches/llama.cpp:" + name)) for name in listed]
    if not paths:
        return []
    out = _run(ctx, [python, ctx.path(ctx.attr._blake3sum)] + [str(p) for p in paths], "blake3 of the patches")
    got = [line.split("  ")[0] for line in out.strip().split("\n")]
    for entry, path, digest in zip(entries, paths, got):
        if digest != entry["blake3"]:
            _fail(("patch %s changed: its blake3 is %s, the pin says %s. If the change is intended, " +
                   "regenerate the patch against the pin and update its hash in the pin (docs/upstream.md).") % (
                entry["file"],
                digest,
                entry["blake3"],
            ))
    return paths

def _unity_sources(ctx):
    models = sorted([p.basename for p in ctx.path("src/models").readdir() if p.basename.endswith(".cpp")])
    names = []
    for i in range(0, len(models), UNITY_BATCH):
        n = i // UNITY_BATCH
        name = "dgr_unity/models_%s%d.cpp" % ("0" if n < 10 else "", n)
        lines = ["// Generated by toolchains/llama_cpp.bzl: a unity batch of src/models (as upstream's CMake)."]
        lines += ['#include "models/%s"' % m for m in models[i:i + UNITY_BATCH]]
        ctx.file(name, "\n".join(lines) + "\n")
        names.append(name)
    return names

def _vulkan_config(ctx):
    """What the Vulkan lane needs from the host, found like ggml-vulkan's CMake configure step does:
    glslc, the Vulkan headers and loader, and the shader extensions this glslc supports (each of the
    pinned tree's vulkan-shaders/feature-tests/<name>.comp that compiles turns on
    GGML_VULKAN_<NAME>_GLSLC_SUPPORT, for the shader generator and the backend alike). `missing` says
    what to install; the lane's targets fail with it when built (other lanes are unaffected)."""
    sdk = ctx.os.environ.get("VULKAN_SDK", "")
    glslc = None
    if sdk and ctx.path(sdk + "/bin/glslc").exists:
        glslc = ctx.path(sdk + "/bin/glslc")
    if not glslc:
        glslc = ctx.which("glslc")
    include_dirs = ([sdk + "/include"] if sdk else []) + ["/usr/include", "/usr/local/include"]
    headers = [d for d in include_dirs if ctx.path(d + "/vulkan/vulkan.hpp").exists]
    lib_dirs = ([sdk + "/lib"] if sdk else []) + ["/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib"]
    loaders = [d for d in lib_dirs if ctx.path(d + "/libvulkan.so").exists or ctx.path(d + "/libvulkan.dylib").exists]
    missing = []
    if not glslc:
        missing.append("glslc (Debian: glslc)")
    if not headers:
        missing.append("the Vulkan headers, vulkan/vulkan.hpp (Debian: libvulkan-dev)")
    if not loaders:
        missing.append("the Vulkan loader libvulkan.so (Debian: libvulkan-dev)")
    features = []
    tests_dir = ctx.path("ggml/src/ggml-vulkan/vulkan-shaders/feature-tests")
    if glslc and tests_dir.exists:
        for test in sorted([p.basename for p in tests_dir.readdir() if p.basename.endswith(".comp")]):
            res = ctx.execute([glslc, "-o", "/dev/null", "-fshader-stage=compute", "--target-env=vulkan1.3", str(tests_dir.get_child(test))], quiet = True)
            if res.return_code == 0:
                features.append("GGML_VULKAN_%s_GLSLC_SUPPORT" % test[:-len(".comp")].upper())
    return {
        "glslc": str(glslc) if glslc else "",
        "include_dir": headers[0] if headers else "",
        "lib_dir": loaders[0] if loaders else "",
        "features": features,
        "missing": ", ".join(missing),
    }

def _llama_cpp_repository_impl(ctx):
    pin_path = ctx.path(ctx.attr.pin)
    pin = json.decode(ctx.read(pin_path))
    root = pin_path.dirname.dirname
    commit = pin["commit"]
    tree_hash = pin.get("tree_hash")
    if not tree_hash:
        _fail("%s has no tree_hash yet; `dgr upstream` fills it (docs/upstream.md)" % pin_path)
    python = checkout_python(ctx)
    if not python:
        _fail("python3 (with the blake3 package) is needed to check the tree hash; run scripts/setup")
    ws = _workspace_dir(ctx, root)

    origin, listing = _fetch_source(ctx, pin, ws)

    # The pin's committed listing (its blake3 is the tree hash) names the first differing file for
    # any source; the workspace's verified listing does when the pin has none.
    if pin.get("tree_listing"):
        rel = pin["tree_listing"]
        listing = ctx.path(Label("//%s:%s" % (rel.rpartition("/")[0], rel.rpartition("/")[2])))
    args = [python, ctx.path(ctx.attr._treehash), ".", "--expect", tree_hash]
    if listing:
        args += ["--expect-listing", str(listing)]
    res = ctx.execute(args, quiet = True)
    if res.return_code != 0:
        _fail("the llama.cpp source from %s does not match the pin's tree hash:\n%s" % (origin, res.stderr.strip()) +
              "\nFetch it again (`dgr upstream fetch`) or, if the pin changed on purpose, see docs/upstream.md.")

    patches = _check_patches(ctx, pin, root, python)
    # The engine's numerics name the pin and its patch series (worker/engine/dgr_engine_numerics.cpp,
    # dgr.core.hashing.series_hash): `dgr build-engine` passes the same three values to CMake.
    series = _run(ctx, [python, ctx.path(ctx.attr._blake3sum), "--series", str(pin_path)], "the patch series hash").strip()
    upstream_defines = [
        "DGR_UPSTREAM_COMMIT=" + commit[:12],
        "DGR_UPSTREAM_PATCHES=%d" % len(pin.get("patches", [])),
        "DGR_UPSTREAM_SERIES=" + series[:12],
    ]
    for entry, path in zip(pin.get("patches", []), patches):
        # ctx.patch errors name the patch file; the hint says how to regenerate it.
        ctx.patch(path, strip = 1)

    cmake_ggml = ctx.read("ggml/CMakeLists.txt")
    cmake_llama = ctx.read("CMakeLists.txt")
    ctx.file("ggml/src/ggml-version.h", '#pragma once\n#define GGML_VERSION "%s"\n#define GGML_COMMIT "%s"\n' % (
        _cmake_version(cmake_ggml, "GGML"),
        commit[:12],
    ))
    ctx.file("src/llama-version.h", '#pragma once\n#define LLAMA_VERSION "%s"\n#define LLAMA_COMMIT "%s"\n' % (
        _cmake_version(cmake_llama, "LLAMA"),
        commit[:12],
    ))
    unity = _unity_sources(ctx)

    # What was built, for release manifests: the pin's identity and the patch series as applied.
    ctx.file("dgr_upstream.json", json.encode_indent({
        "commit": commit,
        "release": pin.get("release", ""),
        "tree_hash": tree_hash,
        "patches": pin.get("patches", []),
    }, indent = "  ") + "\n")
    ctx.file("WORKSPACE", 'workspace(name = "%s")\n' % ctx.name)
    ctx.template("BUILD.bazel", ctx.attr._build_template, {
        "%{UNITY_MODELS}": repr(unity),
        # The patches call into worker/engine/dgr_hooks.cpp, compiled into llama beside them.
        "%{HOOK_DEPS}": repr(["@//worker/engine:dgr_hooks"] if pin.get("patches") else []),
        "%{VULKAN_CONFIG}": repr(_vulkan_config(ctx)),
        "%{DGR_UPSTREAM_DEFINES}": repr(upstream_defines),
    }, executable = False)

llama_cpp_repository = repository_rule(
    implementation = _llama_cpp_repository_impl,
    attrs = {
        "pin": attr.label(default = "//toolchains:llama.cpp.pin.json", allow_single_file = True),
        "_treehash": attr.label(default = "//tools/dgr:toolchain/treehash.py", allow_single_file = True),
        "_blake3sum": attr.label(default = "//toolchains/bazel:blake3sum.py", allow_single_file = True),
        "_build_template": attr.label(default = "//toolchains/bazel:llama.cpp.BUILD.bazel", allow_single_file = True),
    },
    environ = ["DGR_WORKSPACE", "VULKAN_SDK"],
    local = False,
    doc = "llama.cpp at the pinned commit, verified by tree hash, patched in the pin's order.",
)
