"""What a request brings in, checked: its JSON body as the surface's request model, the model it names, its
prompt as token ids (a completion's prompt, or chat messages rendered by the model's chat template) and its
token budget within the context. Each refusal is a GatewayError naming the field (dgr.app.gateway.errors)."""

from __future__ import annotations

import json

from fastapi import Request
from pydantic import ValidationError

from dgr.app.gateway import chat
from dgr.app.gateway.errors import GatewayError
from dgr.app.gateway.route import ModelInfo, RouteBackend
from dgr.app.gateway.schemas.common import StrictRequest
from dgr.app.gateway.schemas.completions import CompletionRequest


def check_model(info: ModelInfo, name: str) -> None:
    if name not in (info.name, info.bundle_id):
        raise GatewayError(404, f"The model `{name}` does not exist: this gateway serves `{info.name}`",
                           param="model", code="model_not_found")


async def parse(request: Request, cls: type[StrictRequest], info: ModelInfo):
    """The request's body as `cls`, for a model this gateway serves, asking nothing it does not do."""
    raw = await request.body()
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as err:
        raise GatewayError(400, f"We could not parse the JSON body of your request ({err}). The body "
                                "must be a JSON object.", code="invalid_json") from None
    if not isinstance(data, dict):
        raise GatewayError(400, "The body of your request must be a JSON object.", code="invalid_json")
    try:
        req = cls.model_validate(data)
    except ValidationError as err:
        e = err.errors()[0]
        param = ".".join(str(x) for x in e["loc"]) or None
        if e["type"] == "extra_forbidden":
            raise GatewayError(400, f"Unknown parameter: '{param}'.", param=param,
                               code="unknown_parameter") from None
        code = "missing_required_parameter" if e["type"] == "missing" else "invalid_value"
        raise GatewayError(400, f"Invalid value for '{param}': {e['msg']}" if param else e["msg"],
                           param=param, code=code) from None
    check_model(info, req.model)
    refused = req.refused()
    if refused:
        code = refused[2] if len(refused) > 2 else "unsupported_parameter"
        raise GatewayError(400, refused[1], param=refused[0], code=code)
    return req


def budget(info: ModelInfo, max_tokens: int | None, n_prompt: int, param: str, default: int | None,
           max_param: str = "max_tokens") -> int:
    """The tokens a request may generate: its own `max_tokens`, else `default` (None: the rest of the context),
    never past the context; `param` names the prompt's field, `max_param` the budget's."""
    room = info.n_ctx - n_prompt
    if room <= 0:
        raise GatewayError(400, f"This model's maximum context length is {info.n_ctx} tokens; your prompt is "
                                f"{n_prompt} tokens. Shorten the prompt.", param=param,
                           code="context_length_exceeded")
    if max_tokens is None:
        return room if default is None else min(default, room)
    if n_prompt + max_tokens > info.n_ctx:
        raise GatewayError(400, f"This model's maximum context length is {info.n_ctx} tokens. However, you "
                                f"requested {n_prompt + max_tokens} tokens ({n_prompt} in the {param}, "
                                f"{max_tokens} in the completion). Reduce the length of the {param} or "
                                f"of the completion ({max_param}).", param=max_param,
                           code="context_length_exceeded")
    return max_tokens


def completion_ids(backend: RouteBackend, req: CompletionRequest) -> list[int]:
    """A completion's prompt as token ids (one prompt per request: a string or a list of ids)."""
    p = req.prompt
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]
    if isinstance(p, list) and p and not all(isinstance(t, int) for t in p):
        raise GatewayError(400, "one prompt per request: give a string or a list of token ids", param="prompt")
    ids = backend.tokenize(p, add_special=True) if isinstance(p, str) else list(p)
    if not ids:
        raise GatewayError(400, "the prompt is empty", param="prompt")
    return ids


def chat_ids(backend: RouteBackend, messages: list[dict], param: str, add_generation_prompt: bool = True,
             tools: list[dict] | None = None) -> list[int]:
    """The token ids of `messages` rendered by the model's chat template (`tools`: given to it as OpenAI
    sends them, for a template that renders them)."""
    info = backend.info
    if not info.chat_template:
        raise GatewayError(400, f"the model `{info.name}` has no chat template (tokenizer.chat_template): "
                                "use /v1/completions, or start `dgr serve` with --chat-template FILE",
                           param=param, code="chat_template_missing")
    try:
        text = chat.render(info.chat_template, messages, add_generation_prompt=add_generation_prompt,
                           special_tokens={"bos_token": info.bos_token, "eos_token": info.eos_token},
                           tools=tools)
    except (chat.TemplateRefused, ValueError) as err:
        raise GatewayError(400, str(err), param=param, code="invalid_messages") from None
    except chat.TemplateBroken as err:
        raise GatewayError(500, str(err), "server_error", code="chat_template_broken") from None
    # a template that writes the BOS itself: do not add a second one
    add_special = not (info.bos_token and text.startswith(info.bos_token))
    return backend.tokenize(text, add_special=add_special)
