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
