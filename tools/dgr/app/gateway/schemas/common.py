"""What every surface of the gateway shares on the wire: the strict request base (unknown fields and
unsupported values refused, naming the field), OpenAI's error body, the model list, and token
log-probabilities as chat and the Responses API report them.

The surfaces' own models: dgr.app.gateway.schemas.completions (/v1/completions, /v1/chat/completions) and
dgr.app.gateway.schemas.responses (/v1/responses).
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import BaseModel, ConfigDict

from dgr.runtime.wire.limits import MAX_TOP_LOGPROBS

# `name` as OpenAI restricts it: a tool name is also what the model writes back in a call
NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"


class StrictRequest(BaseModel):
    """A request body: unknown fields are refused (`extra_forbidden`, answered as `unknown_parameter`);
    `UNSUPPORTED` maps an OpenAI field dgr does not do to (the values accepted, why not)."""

    model_config = ConfigDict(extra="forbid")
    UNSUPPORTED: ClassVar[dict[str, tuple[tuple, str]]] = {}

    def refused(self) -> tuple[str, ...] | None:
        """(param, message) of the first unsupported field the request asks for, else None; a subclass that
        also refuses combinations may add the error code: (param, message, code)."""
        for name, (accepted, why) in self.UNSUPPORTED.items():
            if getattr(self, name) not in accepted:
                return name, f"Unsupported parameter: '{name}': {why}"
        return None


def top_bound(v: int | None) -> int | None:
    """A request's count of most likely tokens per position, within the route's bound."""
    if v is not None and v > MAX_TOP_LOGPROBS:
        raise ValueError(f"at most {MAX_TOP_LOGPROBS} most likely tokens per position (the route's bound), got {v}")
    return v


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def model_list(name: str, created: int, owner: str = "dgr") -> dict:
    return {"object": "list", "data": [{"id": name, "object": "model", "created": created, "owned_by": owner}]}


# ---------------------------------------------------------------------------------------------- logprobs
# A token as the gateway reports it (dgr.app.gateway.route.Tok): `.text` (its own text, detokenized alone),
# `.logprob`, `.top` ((text, logprob) of the most likely tokens, most likely first), `.offset` (where its
# text starts in the choice's printed text).

def token_entry(text: str, logprob: float) -> dict:
    """{token, logprob, bytes}: `bytes` are the UTF-8 of the token's own text."""
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def content_logprobs(toks) -> list[dict]:
    """Chat's `logprobs.content` (and the Responses API's `logprobs`): one entry per token."""
    return [{**token_entry(t.text, t.logprob), "top_logprobs": [token_entry(x, lp) for x, lp in t.top]}
            for t in toks]
