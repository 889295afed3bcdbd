"""dgr: a distributed GGUF runtime and its build-and-deploy toolchain."""

__version__ = "0.1.0"
