"""The OpenAI wire shapes the gateway reads and writes: request models (pydantic) and response bodies.

Requests accept OpenAI's fields (unknown ones are ignored, as OpenAI-compatible servers do) plus two
common extensions: `top_k` and `ignore_eos`. Responses are plain dicts in the shapes the official
`openai` client parses: completions, chat completions, their stream chunks, usage and errors.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, ge=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    n: int = Field(1, ge=1, le=1)
    ignore_eos: bool = False
    user: str | None = None

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
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False


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
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    max_completion_tokens: int | None = Field(None, ge=1)     # OpenAI's newer name for max_tokens in chat

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

    def full(self, text: str, finish: FinishReason, prompt_tokens: int, completion_tokens: int) -> dict:
        if self.kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": finish}
            body = self._head("chat.completion")
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
            body = self._head("text_completion")
        return {**body, "choices": [choice], "usage": usage(prompt_tokens, completion_tokens)}

    def chunk(self, text: str | None, finish: FinishReason = None, *, role: bool = False) -> dict:
        if self.kind == "chat":
            delta: dict = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            return {**self._head("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        return {**self._head("text_completion"), "choices": [choice]}

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {**self._head(obj), "choices": [], "usage": usage(prompt_tokens, completion_tokens)}
