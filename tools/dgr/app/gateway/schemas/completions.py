"""The wire shapes of /v1/completions and /v1/chat/completions: request models (pydantic) and response bodies.

Requests accept OpenAI's fields plus two common extensions, `top_k` and `ignore_eos`. Nothing is silently
ignored: an OpenAI field dgr does not do yet is accepted only at its neutral value (a penalty of 0, no
logit bias, ...) and otherwise answers 400 `unsupported_parameter` naming it (`refused()`), and a field
OpenAI does not have answers 400 `unknown_parameter` naming it. Fields that are only hints to OpenAI's
own service (`user`, `metadata`, `service_tier`, ...) are accepted. Responses are plain dicts in the shapes
the official `openai` client parses: completions, chat completions, their stream chunks, usage and errors
(the Responses API's are in dgr.app.gateway.schemas.responses, what both share in .common). `logprobs`/`top_logprobs`, `response_format`
and `tools`/`tool_choice` are validated here; what they do is in dgr.app.gateway.structured and docs/gateway.md.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from dgr.app.gateway.limits import MAX_CHOICES
from dgr.app.gateway.schemas.common import NAME_PATTERN, StrictRequest, content_logprobs, top_bound
from dgr.runtime.wire.drafts import MAX_DRAFT_K

# "not asked for": the values of an unsupported field that are accepted
_UNSET: tuple = (None,)
_OFF: tuple = (None, 0, False, "", [], {})

_PENALTY = "dgr's route samples with temperature, top_p and top_k only (no repetition penalties); give 0 or omit it"
_COMMON_UNSUPPORTED = {
    "frequency_penalty": (_OFF, _PENALTY),
    "presence_penalty": (_OFF, _PENALTY),
    "logit_bias": (_OFF, "dgr's route does not bias logits; omit it"),
}


class _Request(StrictRequest):
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, ge=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    n: int = Field(1, ge=1)
    ignore_eos: bool = False
    # dgr's extension: speculative decoding (the same tokens, fewer trips round the ring): "ngram" (prompt
    # lookup), "mtp" (the model's MTP block, a bundle with include_mtp) or "none"; default: `dgr serve --speculate`
    speculate: Literal["none", "ngram", "mtp"] | None = None
    draft_k: int | None = Field(None, ge=1, le=MAX_DRAFT_K)
    # dgr's extension, llama-server's name: false = the stages neither restore this prompt's prefix from their
    # prefix caches nor keep it (the answer is the same either way: the cache is exact, docs/worker.md)
    cache_prompt: bool = True
    # hints to OpenAI's own service: accepted, no effect on what the route computes
    user: str | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    # OpenAI fields dgr does not do (UNSUPPORTED)
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, Any] | None = None

    @field_validator("n")
    @classmethod
    def _n(cls, v):
        if v > MAX_CHOICES:
            raise ValueError(f"at most {MAX_CHOICES} choices per request (each choice is its own generation "
                             f"along the route), got {v}")
        return v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences")
        return [s for s in stops if s]

    @property
    def stops(self) -> list[str]:
        return list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class CompletionRequest(_Request):
    UNSUPPORTED = {
        **_COMMON_UNSUPPORTED,
        "echo": ((None, False), "the prompt is not echoed back; omit it"),
        "suffix": ((None, ""), "dgr does not insert text between a prompt and a suffix; omit it"),
        "best_of": ((None, 1), "dgr does not rank candidates server-side; use n for several choices"),
    }

    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None
    # the log-probabilities of this many most likely tokens at each position, and the chosen token's
    logprobs: int | None = Field(None, ge=0)

    @field_validator("logprobs")
    @classmethod
    def _logprobs(cls, v):
        return top_bound(v)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class JsonSchemaFormat(_Strict):
    """response_format.json_schema: the schema the answer must follow (`strict` is accepted; every schema is
    enforced by the grammar, as far as llama.cpp's json_schema_to_grammar goes)."""

    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type json_schema needs `json_schema`: {\"name\": ..., \"schema\": {...}}")
        if self.type != "json_schema" and self.json_schema is not None:
            raise ValueError(f"`json_schema` goes with type json_schema, not {self.type}")
        return self


class FunctionDef(_Strict):
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class _Named(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: _Named


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None

    def for_template(self) -> dict:
        """The message as a template sees it: content as text (text parts joined), other fields as given."""
        d = self.model_dump(exclude_none=True)
        c = self.content
        if isinstance(c, list):
            texts = []
            for part in c:
                if part.get("type") != "text":
                    raise ValueError(f"content part of type {part.get('type')!r}: this model takes text only")
                texts.append(str(part.get("text", "")))
            d["content"] = "".join(texts)
        elif c is None:
            d["content"] = ""
        return d


class ChatRequest(_Request):
    UNSUPPORTED = {
        **_COMMON_UNSUPPORTED,
        "functions": (_OFF, "the legacy functions API is not supported"),
        "function_call": (_OFF, "the legacy functions API is not supported"),
        "audio": (_UNSET, "this gateway serves text only"),
        "modalities": ((None, ["text"]), "this gateway serves text only: give [\"text\"] or omit it"),
        "prediction": (_UNSET, "predicted outputs are not supported"),
        "web_search_options": (_UNSET, "dgr does not search the web"),
        "reasoning_effort": (_UNSET, "the model is not a reasoning model with an effort setting"),
        "verbosity": (_UNSET, "the model has no verbosity setting"),
        "store": ((None, False), "this gateway stores nothing"),
    }

    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    max_completion_tokens: int | None = Field(None, ge=1)     # OpenAI's newer name for max_tokens in chat
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0)
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Any = None                     # "none" | "auto" | "required" | NamedToolChoice (_tool_choice)
    parallel_tool_calls: bool | None = None     # accepted: an answer holds at most one call (docs/gateway.md)
    # UNSUPPORTED
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: list[str] | None = None
    prediction: Any = None
    web_search_options: Any = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    store: bool | None = None

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs(cls, v):
        return top_bound(v)

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, v):
        if v is None or v in ("none", "auto", "required"):
            return v
        if isinstance(v, dict):
            try:
                return NamedToolChoice.model_validate(v)
            except ValidationError as err:
                e = err.errors()[0]
                raise ValueError(f"{'.'.join(str(x) for x in e['loc'])}: {e['msg']}") from None
        raise ValueError('give "none", "auto", "required" or {"type": "function", "function": {"name": ...}}')

    @field_validator("tools")
    @classmethod
    def _tools(cls, v):
        names = [t.function.name for t in v or []]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"tool names must be unique: {', '.join(twice)} given more than once")
        return v

    @model_validator(mode="after")
    def _max_completion_tokens(self):
        if self.max_tokens is None and self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return self

    def refused(self) -> tuple[str, ...] | None:
        """The unsupported fields, then combinations that cannot be honoured, as (param, message)."""
        found = super().refused()
        if found:
            return found
        if self.top_logprobs and not self.logprobs:
            return ("top_logprobs", "Invalid value for 'top_logprobs': 'logprobs' must be true when "
                                    "'top_logprobs' is used.", "invalid_value")
        if self.tool_choice not in (None, "none") and not self.tools:
            return ("tool_choice", "Invalid value for 'tool_choice': 'tool_choice' is only allowed when 'tools' "
                                   "are given.", "invalid_value")
        if isinstance(self.tool_choice, NamedToolChoice):
            name = self.tool_choice.function.name
            if name not in [t.function.name for t in self.tools or []]:
                return ("tool_choice", f"Invalid value for 'tool_choice': there is no tool named '{name}' in "
                                       "'tools'.", "invalid_value")
        if self.ignore_eos and self.structured:
            return "ignore_eos", ("ignore_eos cannot go with response_format or tools: the grammar ends the answer "
                                  "with the model's end-of-generation token")
        return None

    @property
    def tool_mode(self) -> str:
        """none | auto | required | named: what tool_choice asks (OpenAI's default: auto when tools are given)."""
        if not self.tools or self.tool_choice == "none":
            return "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or "auto"

    @property
    def structured(self) -> bool:
        """The output is constrained or parsed: a JSON response format, or tools in play."""
        return self.tool_mode != "none" or (self.response_format is not None and self.response_format.type != "text")


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """`cached_tokens`: prompt positions every stage restored from its prefix cache instead of prefilling."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


FinishReason = Literal["stop", "length", "tool_calls"] | None


def completion_logprobs(toks, base: int) -> dict:
    """Legacy completions' logprobs. `top_logprobs[i]`: the most likely tokens' texts and the chosen one's
    (up to logprobs + 1, as OpenAI; two ids with one text keep the likelier); `text_offset`: where each
    token starts in prompt + completion (`base`: the prompt's length)."""
    tops = []
    for t in toks:
        top: dict[str, float] = {}
        for x, lp in t.top:
            top.setdefault(x, lp)
        top.setdefault(t.text, t.logprob)
        tops.append(top)
    return {"tokens": [t.text for t in toks], "token_logprobs": [t.logprob for t in toks], "top_logprobs": tops,
            "text_offset": [base + t.offset for t in toks]}


@dataclass
class Answer:
    """One choice as answered: its text (None for a tool call), why it ended, its tokens' logprobs (None: not
    asked) and its tool calls (OpenAI's `tool_calls`, or None)."""

    text: str | None
    finish: FinishReason
    toks: list | None = None
    tool_calls: list[dict] | None = None


class Shapes:
    """Response bodies of one request (one id, one creation time, one model name). `text_base`: for
    completions' `text_offset`, the length of the prompt's text."""

    def __init__(self, kind: Literal["completion", "chat"], model: str, fingerprint: str, text_base: int = 0):
        self.kind, self.model, self.fingerprint, self.text_base = kind, model, fingerprint, text_base
        self.id = new_id("chatcmpl" if kind == "chat" else "cmpl")
        self.created = int(time.time())

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": self.fingerprint}

    def _logprobs(self, toks) -> dict | None:
        if toks is None:
            return None
        if self.kind == "chat":
            return {"content": content_logprobs(toks), "refusal": None}
        return completion_logprobs(toks, self.text_base)

    def full(self, answers: list[Answer], prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
        """`answers`: every choice, in index order."""
        if self.kind == "chat":
            out = []
            for i, a in enumerate(answers):
                msg: dict = {"role": "assistant", "content": a.text}
                if a.tool_calls:
                    msg["tool_calls"] = a.tool_calls
                out.append({"index": i, "message": msg, "logprobs": self._logprobs(a.toks), "finish_reason": a.finish})
            body = self._head("chat.completion")
        else:
            out = [{"index": i, "text": a.text, "logprobs": self._logprobs(a.toks), "finish_reason": a.finish}
                   for i, a in enumerate(answers)]
            body = self._head("text_completion")
        return {**body, "choices": out, "usage": usage(prompt_tokens, completion_tokens, cached_tokens)}

    def chunk(self, text: str | None, finish: FinishReason = None, *, role: bool | str = False, index: int = 0,
              toks: list | None = None, tool_calls: list[dict] | None = None) -> dict:
        """A stream chunk: a piece of text (and its tokens' logprobs when asked), the role (`role="call"`:
        the choice will be a tool call), a choice's tool calls (each whole, in one delta), or a finish_reason."""
        if self.kind == "chat":
            if role:
                # content null when the answer will be a tool call (as OpenAI's), "" when it may be text
                delta: dict = {"role": "assistant", "content": None if role == "call" else ""}
            elif tool_calls:
                delta = {"tool_calls": [{"index": k, **c} for k, c in enumerate(tool_calls)]}
            else:
                delta = {} if text is None else {"content": text}
            choice = {"index": index, "delta": delta, "logprobs": self._logprobs(toks), "finish_reason": finish}
            return {**self._head("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": index, "text": text or "", "logprobs": self._logprobs(toks), "finish_reason": finish}
        return {**self._head("text_completion"), "choices": [choice]}

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {**self._head(obj), "choices": [], "usage": usage(prompt_tokens, completion_tokens, cached_tokens)}
