"""The gateway's wire shapes, all in this package: `common` (the strict request base, errors, the model list,
logprobs), `completions` (/v1/completions and /v1/chat/completions: requests, bodies, stream chunks) and
`responses` (/v1/responses: the request, its input as chat messages, the response object and its events)."""
