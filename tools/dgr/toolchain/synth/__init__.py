"""Synthetic models: tiny random-weight GGUF files of any architecture the pin runs (the spec table of
`generic` and `families`, deepseek4's own writer), and their split-vs-whole parity. Importing the package
registers every architecture's writer."""
from dgr.toolchain.synth import deepseek4, generic  # noqa: F401 (deepseek4 registers its writer)
