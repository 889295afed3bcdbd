"""Chat templates: render a model's own `tokenizer.chat_template` (Jinja) the way Hugging Face does.

The environment is `jinja2.sandbox.ImmutableSandboxedEnvironment` with `trim_blocks` and
`lstrip_blocks`, the `loopcontrols` extension and a pass-through `{% generation %}` block, the
`tojson` filter (`ensure_ascii=False`), and the globals `raise_exception` and `strftime_now`, as
`transformers` sets them. A template runs with `messages`, `add_generation_prompt`, `tools`,
`documents` and the special tokens (`bos_token`, `eos_token`, ...). A template that raises (e.g.
"roles must alternate") is the request's fault: `TemplateRefused`.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from dgr.core.errors import DgrError


class TemplateRefused(DgrError):
    """The chat template refused these messages (its `raise_exception`, or it failed on them)."""


class TemplateBroken(DgrError):
    """The chat template itself does not compile."""


class _Generation(Extension):
    """`{% generation %}...{% endgeneration %}` (marks assistant text for training masks): rendered as is."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_render", []), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=8)
def compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as err:
        raise TemplateBroken(f"the model's chat template does not compile (line {err.lineno}: {err.message})") from None


def render(source: str, messages: list[dict], *, add_generation_prompt: bool = True,
           special_tokens: dict[str, str] | None = None, tools: list | None = None,
           documents: list | None = None, **extra) -> str:
    """The prompt text `source` makes of `messages` (each a dict with at least role and content)."""
    template = compile_template(source)
    try:
        return template.render(messages=messages, add_generation_prompt=add_generation_prompt, tools=tools,
                               documents=documents, **(special_tokens or {}), **extra)
    except jinja2.exceptions.TemplateError as err:
        raise TemplateRefused(f"the chat template refused these messages: {err}") from None
    except (TypeError, ValueError, KeyError, IndexError, AttributeError) as err:
        raise TemplateRefused(f"the chat template failed on these messages: {type(err).__name__}: {err}") from None


_PROBE_TOOL = {"type": "function", "function": {"name": "dgr_probe_tool", "description": "probe",
                                                 "parameters": {"type": "object", "properties": {}}}}


@lru_cache(maxsize=8)
def uses_tools(source: str) -> bool:
    """Whether the template renders `tools` (its text for one user message changes when a tool is given).
    A template that does not (SmolLM2's, plain ChatML) gets the tools, the calls and their results as text
    from the gateway (dgr.app.gateway.structured)."""
    probe = [{"role": "user", "content": "hi"}]
    try:
        return render(source, probe, tools=[_PROBE_TOOL]) != render(source, probe)
    except (TemplateRefused, TemplateBroken):
        return False
