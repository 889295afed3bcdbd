"""The gateway's HTTP surfaces, one `APIRouter` per module: `models` (/v1/models), `completions`
(/v1/completions, /v1/chat/completions), `responses` (/v1/responses and its cancel) and `ops` (/health,
/metrics). Each handler takes what it needs through the dependency dgr.app.gateway.state.gateway_state."""
