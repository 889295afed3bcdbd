"""The Python repository rules run: the checkout's own virtual environment (`.venv/bin/python3`, which
scripts/setup makes with dgr's dependencies, blake3 among them), else the first python3 on PATH.

Repository rules see the shell's environment, so a rule that took `python3` from PATH failed in a shell
without the venv activated (`No module named 'blake3'`). The checkout's interpreter is found from the
workspace itself, so `bazel build` works from any shell once scripts/setup has run.
"""

def checkout_python(ctx):
    """The path of the interpreter to run, or None."""
    venv = ctx.path(Label("//:pyproject.toml")).dirname.get_child(".venv").get_child("bin").get_child("python3")
    if venv.exists:
        return venv
    return ctx.which("python3")
