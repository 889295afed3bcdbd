"""What a model's weights weigh, per layer and per role (the first stage's input, the last stage's head,
the tables every stage holds): what the planner balances and a recipe's sizes report."""
from __future__ import annotations

from dataclasses import dataclass

import gguf

from dgr.gguf.model import INPUT, OUTPUT, SHARED, ModelInfo, tensor_nbytes


@dataclass
class Weights:
    """What the planner weighs: bytes per layer, the first stage's own (token embedding), the last stage's
    own (output norm and head; the embedding again when tied, as the head), and what every stage holds."""

    layer_bytes: list[int]
    input_bytes: int
    output_bytes: int
    shared_bytes: int
    excluded: list[str]  # MTP layers' tensors: no stage holds them

    def kwargs(self) -> dict[str, int]:
        return {"input_bytes": self.input_bytes, "output_bytes": self.output_bytes, "shared_bytes": self.shared_bytes}


def weights(info: ModelInfo, types: dict[str, gguf.GGMLQuantizationType] | None = None) -> Weights:
    """The model's weights per layer and role, each tensor in `types` (default: its own type)."""
    layer_bytes = [0] * info.n_layer
    role = {INPUT: 0, OUTPUT: 0, SHARED: 0}
    excluded: list[str] = []
    for t in info.header.tensors:
        owner = info.layer_of.get(t.name)  # None: unknown (a build refuses it; a scaffold leaves it out)
        nb = tensor_nbytes(t.shape, types.get(t.name, t.type) if types else t.type)
        if isinstance(owner, int):
            if owner >= info.n_layer:
                excluded.append(t.name)  # MTP: reserved, off for alpha
            else:
                layer_bytes[owner] += nb
        elif owner is not None:
            role[owner] += nb
            if owner == INPUT and info.tied_embeddings and t.name == "token_embd.weight":
                role[OUTPUT] += nb  # the tied head: the last stage carries the embedding as its output
    return Weights(layer_bytes, role[INPUT], role[OUTPUT], role[SHARED], excluded)
