"""The OpenAI wire shapes the gateway reads and writes: request models (pydantic) and response bodies.

Requests accept OpenAI's fields plus two common extensions, `top_k` and `ignore_eos`. Nothing is silently
ignored: an OpenAI field dgr does not do yet is accepted only at its neutral value (a penalty of 0, no
logit bias, ...) and otherwise answers 400 `unsupported_parameter` naming it (`refused()`), and a field
OpenAI does not have answers 400 `unknown_parameter` naming it. Fields that are only hints to OpenAI's
own service (`user`, `metadata`, `service_tier`, ...) are accepted. Responses are plain dicts in the shapes
the official `openai` client parses: completions, chat completions, their stream chunks, usage and errors
(the Responses API's shapes are in dgr.gateway.responses).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from dgr.gateway.limits import MAX_CHOICES

# "not asked for": the values of an unsupported field that are accepted
_UNSET: tuple = (None,)
_OFF: tuple = (None, 0, False, "", [], {})


class StrictRequest(BaseModel):
    """A request body: unknown fields are refused (`extra_forbidden`, answered as `unknown_parameter`);
    `UNSUPPORTED` maps an OpenAI field dgr does not do to (the values accepted, why not)."""

    model_config = ConfigDict(extra="forbid")
    UNSUPPORTED: ClassVar[dict[str, tuple[tuple, str]]] = {}

    def refused(self) -> tuple[str, str] | None:
        """(param, message) of the first unsupported field the request asks for, else None."""
        for name, (accepted, why) in self.UNSUPPORTED.items():
            if getattr(self, name) not in accepted:
                return name, f"Unsupported parameter: '{name}': {why}"
        return None


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
    logprobs: Any = None                # being added to the route (issue 23): accepted, not yet computed


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
    # being added to the route (issue 23): accepted as they always were, not yet acted on here
    logprobs: Any = None
    top_logprobs: Any = None
    response_format: Any = None
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
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

    @model_validator(mode="after")
    def _max_completion_tokens(self):
        if self.max_tokens is None and self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return self


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def model_list(name: str, created: int, owner: str = "dgr") -> dict:
    return {"object": "list", "data": [{"id": name, "object": "model", "created": created, "owned_by": owner}]}


FinishReason = Literal["stop", "length"] | None


class Shapes:
    """Response bodies of one request (one id, one creation time, one model name)."""

    def __init__(self, kind: Literal["completion", "chat"], model: str, fingerprint: str):
        self.kind, self.model, self.fingerprint = kind, model, fingerprint
        self.id = new_id("chatcmpl" if kind == "chat" else "cmpl")
        self.created = int(time.time())

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": self.fingerprint}

    def full(self, choices: list[tuple[str, FinishReason]], prompt_tokens: int, completion_tokens: int) -> dict:
        """`choices`: (text, finish_reason) of each choice, in index order."""
        if self.kind == "chat":
            out = [{"index": i, "message": {"role": "assistant", "content": text}, "logprobs": None,
                    "finish_reason": finish} for i, (text, finish) in enumerate(choices)]
            body = self._head("chat.completion")
        else:
            out = [{"index": i, "text": text, "logprobs": None, "finish_reason": finish}
                   for i, (text, finish) in enumerate(choices)]
            body = self._head("text_completion")
        return {**body, "choices": out, "usage": usage(prompt_tokens, completion_tokens)}

    def chunk(self, text: str | None, finish: FinishReason = None, *, role: bool = False, index: int = 0) -> dict:
        if self.kind == "chat":
            delta: dict = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
            choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
            return {**self._head("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": index, "text": text or "", "logprobs": None, "finish_reason": finish}
        return {**self._head("text_completion"), "choices": [choice]}

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {**self._head(obj), "choices": [], "usage": usage(prompt_tokens, completion_tokens)}
