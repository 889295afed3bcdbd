"""The templates shipped with dgr (cookiecutter folders) and what their variables mean.

`recipe/` is `dgr recipe new`'s. Its cookiecutter.json is the one list of the template's variables and
its `__prompts__` the one description of each: `dgr recipe new --help`, the interactive prompts and
docs/bundles.md show them (a test keeps the docs in step). This module reads JSON only, so the CLI can
list the variables in its help without importing the recipe machinery.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

RECIPE_TEMPLATE = Path(__file__).resolve().parent / "recipe"


def template_variables(template: Path = RECIPE_TEMPLATE) -> dict[str, tuple[Any, str]]:
    """Each variable a user may set: name -> (default, or the choices with the default first; what it is).
    Names starting with `_` are the template's own (dgr fills them), not the user's."""
    ctx = json.loads((template / "cookiecutter.json").read_text())
    about = ctx.get("__prompts__", {})
    return {k: (v, about.get(k, "")) for k, v in ctx.items() if not k.startswith("_")}


def template_help(template: Path = RECIPE_TEMPLATE) -> str:
    """The variables as `dgr recipe new --help` lists them, one per line."""
    lines = []
    for k, (default, about) in template_variables(template).items():
        shown = f"{default[0]}; one of {', '.join(default)}" if isinstance(default, list) else (default or "empty")
        lines += textwrap.wrap(f"{about} (default: {shown})", width=96, initial_indent=f"  {k:<20} ",
                               subsequent_indent=" " * 23)
    return "\n".join(lines)
