"""OpenAI's Responses API (`POST /v1/responses`) for text in and text out: the request, its input as chat
messages (rendered by the model's chat template, as /v1/chat/completions does), and the bodies and
server-sent events the official `openai` client parses.

A stream is the Responses API's event sequence, each event `event: TYPE` + `data: {...}` with a
`sequence_number` from 0: response.created, response.in_progress, response.output_item.added,
response.content_part.added, response.output_text.delta..., response.output_text.done,
response.content_part.done, response.output_item.done, then one of response.completed (the model
stopped), response.incomplete (max_output_tokens ran out: `incomplete_details.reason`; or the response
was cancelled: `status: cancelled`) or, after an `error` event, response.failed.

`text.format` `json_schema` / `json_object` constrains the output as chat's response_format does, and
`include: ["message.output_text.logprobs"]` (or `top_logprobs` > 0) reports every token's logprob on the
output_text part and on each delta.

Responses are not stored: `previous_response_id`, `conversation`, `store: true` and `background: true`
answer 400 naming the field, as do tools, reasoning, other `include` items and `truncation: auto`.
"""

from __future__ import annotations

import re
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from dgr.app.gateway.schemas.common import NAME_PATTERN, StrictRequest, content_logprobs, top_bound

Status = Literal["completed", "incomplete", "cancelled", "failed", "in_progress"]


class InputRefused(ValueError):
    """An input item or content part this gateway cannot take; `param` names it (`input[1].content[0]`)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


LOGPROBS_INCLUDE = "message.output_text.logprobs"


class TextFormat(BaseModel):
    """`text.format`: {"type": "text"}, {"type": "json_object"}, or {"type": "json_schema", "name", "schema",
    "description", "strict"} (the chat API's json_schema, flattened)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _fields(self):
        if self.type == "json_schema":
            if self.schema_ is None or not re.match(NAME_PATTERN, self.name or ""):
                raise ValueError("type json_schema needs `name` (letters, digits, _ and -, at most 64) and `schema`")
        elif self.name is not None or self.schema_ is not None:
            raise ValueError(f"`name` and `schema` go with type json_schema, not {self.type}")
        return self

    @property
    def json_schema(self) -> dict | None:
        return None if self.type == "text" else ({"type": "object"} if self.type == "json_object" else self.schema_)


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: TextFormat | None = None


class ResponsesRequest(StrictRequest):
    UNSUPPORTED = {
        "tools": ((None, []), "this gateway does not call tools on /v1/responses yet; omit it"),
        "tool_choice": ((None, "none", "auto"), "there are no tools on /v1/responses; omit it"),
        "previous_response_id": ((None,), "responses are not stored: send the conversation in `input`"),
        "conversation": ((None,), "responses are not stored: send the conversation in `input`"),
        "store": ((None, False), "responses are not stored (the answer says store: false); omit it"),
        "background": ((None, False), "responses run while their request is open; stream to follow one"),
        "reasoning": ((None, {}), "the model is not a reasoning model with an effort setting"),
        "truncation": ((None, "disabled"), "input is never truncated (a prompt over the context is a 400)"),
        "prompt": ((None,), "stored prompt templates are not supported: send `input`"),
    }

    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, ge=0.0, le=1.0)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    # dgr's extensions, as on chat: top_k, ignore_eos, and a seed for reproducible sampling
    top_k: int = Field(0, ge=0)
    ignore_eos: bool = False
    seed: int | None = None
    cache_prompt: bool = True       # as on chat: false = no prefix cache for this request
    # hints to OpenAI's own service: accepted, no effect on what the route computes
    user: str | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    parallel_tool_calls: bool | None = None
    max_tool_calls: int | None = None
    # UNSUPPORTED
    tools: list[Any] | None = None
    tool_choice: Any = None
    previous_response_id: str | None = None
    conversation: Any = None
    store: bool | None = None
    background: bool | None = None
    reasoning: Any = None
    truncation: str | None = None
    prompt: Any = None
    # structured output and logprobs
    text: TextConfig | None = None
    include: list[str] | None = None
    top_logprobs: int | None = Field(None, ge=0)

    @field_validator("top_logprobs")
    @classmethod
    def _top(cls, v):
        return top_bound(v)

    def refused(self) -> tuple[str, ...] | None:
        found = super().refused()
        if found:
            return found
        other = [x for x in self.include or [] if x != LOGPROBS_INCLUDE]
        if other:
            return "include", (f"Unsupported parameter: 'include': only {LOGPROBS_INCLUDE!r} is produced here, not "
                               f"{', '.join(map(repr, other))}")
        if self.ignore_eos and self.json_schema:
            return "ignore_eos", ("ignore_eos cannot go with a JSON text.format: the grammar ends the answer with "
                                  "the model's end-of-generation token")
        return None

    @property
    def json_schema(self) -> dict | None:
        """The schema `text.format` asks for (None: plain text)."""
        return self.text.format.json_schema if self.text and self.text.format else None

    @property
    def logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or []) or bool(self.top_logprobs)

    def messages(self) -> list[dict]:
        """The chat messages the input is: `instructions` as a system message first, a string input as
        one user message, input items as messages (developer -> system), their text parts joined."""
        out = [{"role": "system", "content": self.instructions}] if self.instructions else []
        if isinstance(self.input, str):
            return [*out, {"role": "user", "content": self.input}]
        if not self.input:
            raise InputRefused("input", "the input is empty: give a string or a list of messages")
        for i, item in enumerate(self.input):
            out.append(_message(item, f"input[{i}]"))
        return out


_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_TEXT_PARTS = ("input_text", "output_text", "text")


def _message(item: dict, where: str) -> dict:
    kind = item.get("type", "message")
    if kind != "message":
        raise InputRefused(f"{where}.type", f"input items of type {kind!r} are not supported: this gateway "
                                            "takes messages (role and content) with text")
    role = item.get("role")
    if role not in _ROLES:
        raise InputRefused(f"{where}.role", f"invalid role {role!r}: give one of {', '.join(_ROLES)}")
    content = item.get("content")
    if isinstance(content, str):
        return {"role": _ROLES[role], "content": content}
    if not isinstance(content, list):
        raise InputRefused(f"{where}.content", "content must be a string or a list of text parts")
    texts = []
    for j, part in enumerate(content):
        ptype = part.get("type") if isinstance(part, dict) else None
        if ptype not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise InputRefused(f"{where}.content[{j}]", f"content parts of type {ptype!r} are not supported: "
                                                        "this model takes text (input_text) only")
        texts.append(part["text"])
    return {"role": _ROLES[role], "content": "".join(texts)}


class ResponseShape:
    """The bodies and stream events of one response (one id, one creation time, one message)."""

    def __init__(self, model: str, req: ResponsesRequest):
        self.model, self.req = model, req
        self.id = f"resp_{uuid.uuid4().hex}"
        self.msg_id = f"msg_{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.seq = 0

    def message(self, text: str, status: str, toks=()) -> dict:
        return {"type": "message", "id": self.msg_id, "status": status, "role": "assistant",
                "content": [self.part(text, toks)] if status != "in_progress" else []}

    @staticmethod
    def part(text: str, toks=()) -> dict:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": content_logprobs(toks)}

    def body(self, status: Status, text: str | None = None, finish: str | None = None,
             tokens: tuple[int, ...] | None = None, error: dict | None = None, toks=()) -> dict:
        """The response object. `text`: the message so far (None: no output yet); `finish`: the route's
        finish reason ("length": incomplete for max_output_tokens); `tokens`: (input, output[, cached
        input]) for usage; `toks`: the text's tokens, for its logprobs (when asked)."""
        r = self.req
        item_status = "completed" if status == "completed" else "incomplete"
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "background": False, "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" and finish == "length"
            else None,
            "instructions": r.instructions, "max_output_tokens": r.max_output_tokens, "max_tool_calls": None,
            "model": self.model,
            "output": [] if text is None else [self.message(text, item_status, toks)],
            "parallel_tool_calls": r.parallel_tool_calls if r.parallel_tool_calls is not None else True,
            "previous_response_id": None, "reasoning": {"effort": None, "summary": None},
            "service_tier": "default", "store": False, "temperature": r.temperature,
            "text": {"format": self._format()}, "tool_choice": "auto", "tools": [],
            "top_logprobs": r.top_logprobs or 0,
            "top_p": r.top_p, "truncation": "disabled",
            "usage": None if tokens is None else usage(*tokens),
            "user": r.user, "metadata": r.metadata or {},
        }

    def _format(self) -> dict:
        f = self.req.text.format if self.req.text and self.req.text.format else None
        return f.model_dump(by_alias=True, exclude_none=True) if f else {"type": "text"}

    def event(self, type_: str, **fields) -> dict:
        ev = {"type": type_, "sequence_number": self.seq, **fields}
        self.seq += 1
        return ev

    # the stream, in order
    def opening(self) -> list[dict]:
        head = dict(output_index=0, item_id=self.msg_id, content_index=0)
        return [self.event("response.created", response=self.body("in_progress")),
                self.event("response.in_progress", response=self.body("in_progress")),
                self.event("response.output_item.added", output_index=0, item=self.message("", "in_progress")),
                self.event("response.content_part.added", **head, part=self.part(""))]

    def delta(self, text: str, toks=()) -> dict:
        return self.event("response.output_text.delta", output_index=0, item_id=self.msg_id, content_index=0,
                          delta=text, logprobs=content_logprobs(toks))

    def closing(self, text: str, status: Status, finish: str | None, tokens: tuple[int, ...], toks=()) -> list[dict]:
        head = dict(output_index=0, item_id=self.msg_id, content_index=0)
        item_status = "completed" if status == "completed" else "incomplete"
        terminal = "response.completed" if status == "completed" else "response.incomplete"
        return [self.event("response.output_text.done", **head, text=text, logprobs=content_logprobs(toks)),
                self.event("response.content_part.done", **head, part=self.part(text, toks)),
                self.event("response.output_item.done", output_index=0, item=self.message(text, item_status, toks)),
                self.event(terminal, response=self.body(status, text, finish, tokens, toks=toks))]

    def failure(self, err: dict, text: str, tokens: tuple[int, int]) -> list[dict]:
        """A route that failed mid-stream: an `error` event, then response.failed."""
        return [self.event("error", code=err.get("code"), message=err["message"], param=err.get("param")),
                self.event("response.failed", response=self.body(
                    "failed", text, None, tokens, error={"code": "server_error", "message": err["message"]}))]


def usage(input_tokens: int, output_tokens: int, cached_tokens: int = 0) -> dict:
    """`cached_tokens`: input positions every stage restored from its prefix cache instead of prefilling."""
    return {"input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": cached_tokens},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": input_tokens + output_tokens}


def status_of(finish: str | None, cancelled: bool) -> Status:
    if cancelled:
        return "cancelled"
    return "completed" if finish == "stop" else "incomplete"
