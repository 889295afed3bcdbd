"""The wheels a release carries for its Python (`@dgr_python_deps//:wheels`), checked against the lock.

One repository rule for both Bazel paths (WORKSPACE and MODULE.bazel's `use_repo_rule`). It reads the
lock `toolchains/python-runtime.lock.json` (written by `dgr release python-deps --lock`; nothing here
repeats it) and copies each wheel from the workspace's `wheels/` folder (`$DGR_WORKSPACE/wheels`,
default `<repo>/.dgr/wheels`, filled by `dgr release python-deps`, which scripts/setup runs), checking
its sha256 on the way. Offline: no URL but the local file is ever used.
"""

def _fail(msg):
    fail("\n[dgr] @dgr_python_deps: " + msg + "\n")

def _impl(ctx):
    root = ctx.path(Label("//:pyproject.toml")).dirname
    ws = ctx.os.environ.get("DGR_WORKSPACE", "")
    wheels = ctx.path(ws).get_child("wheels") if ws else root.get_child(".dgr").get_child("wheels")
    lock = json.decode(ctx.read(ctx.attr._lock))
    files = []
    for e in lock["wheels"]:
        src = wheels.get_child(e["file"])
        if not src.exists:
            _fail("%s is not in %s: run `dgr release python-deps` (scripts/setup does) to fetch the locked wheels" % (
                e["file"],
                wheels,
            ))
        res = ctx.download(url = "file://" + str(src), output = "wheels/" + e["file"], sha256 = e["sha256"], allow_fail = True)
        if not res.success:
            _fail("%s does not match its sha256 in toolchains/python-runtime.lock.json; delete it and run `dgr release python-deps`" % src)
        files.append("wheels/" + e["file"])
    ctx.file("BUILD.bazel", "\n".join([
        "# The locked wheels (toolchains/python-runtime.lock.json), in lock order.",
        "filegroup(",
        "    name = \"wheels\",",
        "    srcs = %s," % repr(files),
        "    visibility = [\"//visibility:public\"],",
        ")",
        "",
    ]))
    ctx.file("python_tag.txt", lock["python"] + "\n")

dgr_python_deps_repository = repository_rule(
    implementation = _impl,
    attrs = {"_lock": attr.label(default = Label("//toolchains:python-runtime.lock.json"))},
    environ = ["DGR_WORKSPACE"],
    local = False,
)
