"""Architectures whose synthetic models need a writer of their own (not a row of the spec table): each
registers itself here when its module is imported (the package imports them all), so the table writer
never names them."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class OwnWriter:
    arch: str
    write: Callable[..., object]               # (path, *, layers, embd, seed, ...) -> the file written
    layer_kinds: Callable[[int], list[str]]    # layers -> each layer's kind


OWN_WRITERS: dict[str, OwnWriter] = {}


def register_writer(arch: str, *, write: Callable[..., object], layer_kinds: Callable[[int], list[str]]) -> None:
    if arch in OWN_WRITERS:
        raise ValueError(f"dgr synth: a writer for {arch!r} is registered twice")
    OWN_WRITERS[arch] = OwnWriter(arch, write, layer_kinds)
