"""Structured output on the gateway: `response_format` and `tools`/`tool_choice` become one JSON Schema
that the last stage's grammar sampler enforces (llama.cpp's json_schema_to_grammar inside dgr-worker, via
`RouteClient.generate(json_schema=...)`), tools are put into the prompt, and a tool call is parsed back out
of the text.

What each tool_choice does (docs/gateway.md "Tools"):
- "required": the answer must be `{"name": <a tool's name>, "arguments": <that tool's parameters>}` (anyOf
  over the tools, each name a const), parsed into `tool_calls`;
- a named tool: the same with that tool only;
- "auto": the model answers freely (constrained only by a JSON response_format, if any: then anyOf over the
  calls and that format); the answer is a tool call when its whole text is such a call object (a ```json
  fence around it is allowed), else it is content. A grammar alternative between free text and a call was
  not taken: a small model then starts calls it cannot finish well, and text that merely begins with "{"
  could not be told apart mid-stream;
- "none" (or no tools): the tools are not used at all.
One call per answer: `parallel_tool_calls` is accepted and a request gets at most one call.

Templates: a chat template that renders `tools` (it changes when tools are given: chat.uses_tools) gets
them, and the history's tool calls and results as OpenAI sends them (arguments as objects, as Hugging Face
templates expect). A template that does not (SmolLM2's ChatML) gets a system message that lists the tools
(name, description, JSON parameter schema) and says how to call one, and the history as text: an
assistant's calls as the same JSON objects, tool results as user messages.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from dgr.app.gateway.schemas.completions import ChatRequest, ResponseFormat, Tool
from dgr.runtime.wire.errors import StageError

# response_format {"type": "json_object"}: any JSON object
JSON_OBJECT_SCHEMA: dict = {"type": "object"}
# a tool without `parameters`: a call with no arguments
NO_PARAMETERS: dict = {"type": "object", "properties": {}}


def format_schema(fmt: ResponseFormat | None) -> dict | None:
    """The schema a response_format asks for (None: plain text)."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return JSON_OBJECT_SCHEMA
    return fmt.json_schema.schema_


def call_schema(tool: Tool) -> dict:
    """A call of `tool`: {"name": its name, "arguments": its parameters}, nothing else."""
    f = tool.function
    return {"type": "object",
            "properties": {"name": {"const": f.name}, "arguments": f.parameters or NO_PARAMETERS},
            "required": ["name", "arguments"], "additionalProperties": False}


def any_of(schemas: list[dict]) -> dict:
    return schemas[0] if len(schemas) == 1 else {"anyOf": schemas}


@dataclass(frozen=True)
class Plan:
    """What a chat request's structure asks of the route and of the answer."""

    mode: str                   # none | auto | required | named (ChatRequest.tool_mode)
    tools: tuple[Tool, ...]     # the tools in play (empty for "none")
    json_schema: str            # for RouteClient.generate ("" : unconstrained)
    param: str                  # the field a schema llama.cpp refuses is blamed on

    @property
    def names(self) -> list[str]:
        return [t.function.name for t in self.tools]


def plan(req: ChatRequest) -> Plan:
    mode = req.tool_mode
    tools: tuple[Tool, ...] = tuple(req.tools or ()) if mode != "none" else ()
    if mode == "named":
        tools = tuple(t for t in tools if t.function.name == req.tool_choice.function.name)
    fmt = format_schema(req.response_format)
    calls = [call_schema(t) for t in tools]
    if mode in ("required", "named"):
        schema, param = any_of(calls), "tools"
    elif fmt is not None:
        # auto with a JSON format: the answer is a call or the format's object
        schema, param = any_of([*calls, fmt]), "response_format"
    else:
        schema, param = None, ""
    return Plan(mode, tools, json.dumps(schema) if schema is not None else "", param)


# ---------------------------------------------------------------------------------------------- prompts
def tools_text(tools: tuple[Tool, ...], mode: str) -> str:
    """The system text that tells a model whose template ignores `tools` what it may call, and how."""
    lines = ["You can call the following functions. Each is given as a JSON object with its name, what it does, "
             "and the JSON Schema of its arguments (\"parameters\"):"]
    for t in tools:
        f = t.function
        lines.append(json.dumps({"name": f.name, "description": f.description or "",
                                 "parameters": f.parameters or NO_PARAMETERS}, ensure_ascii=False))
    how = ('To call a function, answer with only a JSON object {"name": <the function\'s name>, "arguments": '
           '<its arguments as a JSON object>} and nothing else.')
    if mode == "auto":
        how += " If no function is needed, answer in plain text."
    elif mode == "required":
        how += " You must call one of these functions now."
    else:
        how += f" You must call the function {tools[0].function.name} now."
    return "\n".join([*lines, "", how])


def _arguments(raw) -> object:
    """A call's arguments as an object: OpenAI sends a JSON string, templates expect the object."""
    if isinstance(raw, str):
        try:
            return json.loads(raw)
        except ValueError:
            return raw
    return raw


def for_template(messages: list[dict], *, native: bool) -> list[dict]:
    """The history as the template can take it. `native`: the template renders tools itself (calls get
    their arguments as objects); else calls become their JSON text and tool results user messages (one
    message for a run of results and a user message right after them, so that roles keep alternating)."""
    out: list[dict] = []
    for m in messages:
        calls = m.get("tool_calls") or []
        if native:
            if calls:
                m = {**m, "tool_calls": [_with_object_arguments(c) for c in calls]}
            out.append(m)
            continue
        if m["role"] == "tool":
            call_id = m.get("tool_call_id")
            name = m.get("name") or _called(messages, call_id) or "the function"
            text = f"Result of {name}" + (f" (call {call_id})" if call_id else "") + f":\n{m.get('content', '')}"
            if out and out[-1].get("_tool_results"):
                out[-1] = {**out[-1], "content": out[-1]["content"] + "\n\n" + text}
            else:
                out.append({"role": "user", "content": text, "_tool_results": True})
            continue
        if m["role"] == "user" and out and out[-1].get("_tool_results"):
            # a user message right after tool results: one message, so that roles keep alternating
            out[-1] = {**out[-1], "content": f"{out[-1]['content']}\n\n{m.get('content', '')}", "_tool_results": False}
            continue
        if calls:
            texts = [m.get("content") or ""] if m.get("content") else []
            for c in calls:
                f = c.get("function", {})
                texts.append(json.dumps({"name": f.get("name"), "arguments": _arguments(f.get("arguments"))},
                                        ensure_ascii=False))
            m = {k: v for k, v in m.items() if k != "tool_calls"}
            m["content"] = "\n".join(texts)
        out.append(m)
    return [{k: v for k, v in m.items() if k != "_tool_results"} for m in out]


def _with_object_arguments(call: dict) -> dict:
    f = call.get("function", {})
    return {**call, "function": {**f, "arguments": _arguments(f.get("arguments"))}}


def _called(messages: list[dict], call_id: str | None) -> str | None:
    """The name of the function that call `call_id` (from an earlier assistant message) called."""
    for m in messages:
        for c in m.get("tool_calls") or []:
            if c.get("id") == call_id:
                return c.get("function", {}).get("name")
    return None


def with_tools_text(messages: list[dict], text: str) -> list[dict]:
    """The tool list in the system message: appended to the first message when it is one, else a new first."""
    if messages and messages[0]["role"] == "system":
        first = messages[0]
        return [{**first, "content": f"{first.get('content') or ''}\n\n{text}".lstrip()}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


# ---------------------------------------------------------------------------------------------- answers
_FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.S)


def parse_call(text: str, names: list[str]) -> dict | None:
    """A tool call the text is ({"name", "arguments"} naming one of `names`, arguments an object), in
    OpenAI's shape, or None."""
    s = text.strip()
    m = _FENCE.match(s)
    if m:
        s = m.group(1)
    try:
        obj = json.loads(s)
    except ValueError:
        return None
    if not isinstance(obj, dict) or obj.get("name") not in names or set(obj) != {"name", "arguments"}:
        return None
    args = _arguments(obj["arguments"])
    if not isinstance(args, dict):
        return None
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}}


def could_be_call(text: str) -> bool:
    """Whether text that has begun could still be a whole call (so a stream holds it back)."""
    s = text.lstrip()
    return not s or s[0] in "{`"


def schema_refused(err: Exception, param: str) -> str | None:
    """The reason, when `err` is the last stage refusing the request's schema or grammar, else None."""
    if not param or not isinstance(err, StageError) or err.code != "ENGINE":
        return None
    msg = str(err)
    for key in ("json_schema: ", "grammar: "):
        if key in msg:
            return msg[msg.index(key) + len(key):]
    return None


class CallHold:
    """One streamed chat choice with tools in play: its text is held back while it may still be a tool call
    (all of it for "required" and a named tool; for "auto" until its first character that is not a space,
    "{" or "`"), then sent as one tool_calls delta or as content."""

    def __init__(self, p: Plan):
        self.names, self.auto = p.names, p.mode == "auto"
        self.holding = p.mode != "none"
        self.text, self.toks = "", []

    def feed(self, text: str, toks: list) -> tuple[str, list] | None:
        """What to send now as content (text, its tokens), or None while holding."""
        if not self.holding:
            return text, toks
        self.text += text
        self.toks.extend(toks)
        if self.auto and not could_be_call(self.text):
            self.holding = False
            out = self.text, self.toks
            self.text, self.toks = "", []
            return out
        return None

    def end(self) -> tuple[dict | None, str, list]:
        """At the end: (the call, or None; the held text still to send as content; the held tokens)."""
        if not self.holding:
            return None, "", []
        call = parse_call(self.text, self.names)
        return call, ("" if call else self.text), self.toks
