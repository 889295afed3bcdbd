"""The OpenAI-compatible gateway over a route of stage workers (`dgr serve`): FastAPI on uvicorn.

`create_app(RouteBackend(route))` is the ASGI app; `serve(...)` runs it (dgr.app.gateway.server).
The gateway is a client of the route (dgr.runtime.wire.client), never part of a worker. Its files, in the
order a request goes through them: docs/gateway.md, "The code".
"""
