"""What builds: the llama.cpp pin (`pin`, `treehash`, `buildinfo`) and its fetch/patch/bump (`upstream`),
engine builds (`enginebuild`), releases (`release`, `pydeps`) and the worker's container image made from one
(`image`, `rootfs`), recipes, the planner and bundles (`recipe`, `planner`, `source`, `bundle`, `templates`,
`modelreport`), synthetic models (`synth`), split-vs-whole parity (`parity`) and the committed proto stubs
(`protogen`). May import runtime, gguf and core; never the app or the CLI."""
