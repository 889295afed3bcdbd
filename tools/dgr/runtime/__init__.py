"""What runs a route: the engine binding (`engine`, its C ABI `engine_abi`, the interface `engine_api`)
and the wire (`wire`: the committed proto stubs, the boundary codec, TLS, the route client). Never imports
the toolchain, the app or the CLI (.importlinter); the stage workers themselves are dgr-worker (C++,
worker/server)."""
