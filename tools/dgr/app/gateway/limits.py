"""The gateway's bounds on a request, in a module of their own so that `dgr serve --help` can show them
without importing the HTTP stack (docs/gateway.md)."""

DEFAULT_COMPLETION_TOKENS = 16           # OpenAI's default max_tokens for /v1/completions
# A chat request without max_tokens stops after this many tokens (`dgr serve --max-tokens-default`; 0: at
# the end of the context): enough for any ordinary answer, while a model that never says it is done
# holds the route for a bounded time.
DEFAULT_CHAT_MAX_TOKENS = 2048
# How often a running request's connection is checked for a client that went away (closed, timed out,
# reset): the check runs on a timer of its own, whatever the tokens do.
DISCONNECT_POLL_S = 0.25
# `n`: at most this many choices per request. Each choice is its own generation (a session on every stage
# of the route, run concurrently), so n multiplies what one request holds; OpenAI's own bound is 128.
MAX_CHOICES = 4
# `POST /v1/responses/{id}/cancel` waits this long for the response's generation to stop and its session
# to close on every stage (one decode step and one CloseSession along the route, normally) before it answers.
CANCEL_WAIT_S = 30.0
# The Retry-After (seconds) of a 503 `hop_unreachable`: a stage that died is restarted in place after about this
# long (the systemd units' RestartSec=2, dgr.app.deploy.systemd; `dgr up`'s first backoff is shorter).
HOP_RETRY_AFTER_S = 2
