"""What an operator runs, composed from the layers below: stages from bundles or fake specs, local routes
of worker processes, the demo, every benchmark of `dgr bench` (`bench`), certification and the gates
(`certify`, which may run a benchmark's measurement; `bench` never imports it), the OpenAI gateway
(`gateway`) and deployment (`deploy`). May import the toolchain, runtime, gguf and core."""
