"""What an operator runs, composed from the layers below: stages from bundles or fake specs, local routes
of worker processes, the demo, `dgr bench` and its parts, certification and the gates (`certify`), the
OpenAI gateway (`gateway`) and deployment (`deploy`). May import the toolchain, runtime, gguf and core."""
