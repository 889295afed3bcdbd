"""The Python repository rules run: the checkout's own virtual environment (`.venv/bin/python3`, which
scripts/setup makes with dgr's dependencies, blake3 among them), else the first python3 on the shell's PATH.

A rule that took `python3` from PATH alone failed in a shell without the venv activated (`No module named
'blake3'`); the checkout's interpreter is found from the workspace itself (this file's own folder), so
`bazel build` works from any shell once scripts/setup has run. (Build actions get a fixed PATH,
`--incompatible_strict_action_env` in .bazelrc; repository rules still see the shell's, for the fallback.)
"""

def checkout_python(ctx):
    """The path of the interpreter to run, or None."""
    root = ctx.path(Label("//toolchains:checkout_python.bzl")).dirname.dirname
    venv = root.get_child(".venv").get_child("bin").get_child("python3")
    if venv.exists:
        return venv
    return ctx.which("python3")
