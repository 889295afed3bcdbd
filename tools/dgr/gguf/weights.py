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
    output_bytes: int      # with MTP included: the MTP block(s) and the embedding copy they read too
    shared_bytes: int
    excluded: list[str]    # MTP layers' tensors when MTP is left out: no stage holds them
    mtp_bytes: int = 0     # of output_bytes, what MTP adds to the last stage (0 when left out)

    def kwargs(self) -> dict[str, int]:
        return {"input_bytes": self.input_bytes, "output_bytes": self.output_bytes, "shared_bytes": self.shared_bytes}


TOKEN_EMBD = "token_embd.weight"


def mtp_tensors(info: ModelInfo) -> list[str]:
    """The tensors of the model's MTP blocks (the blocks after its n_layer trunk layers)."""
    return [t.name for t in info.header.tensors
            if isinstance(info.layer_of.get(t.name), int) and info.layer_of[t.name] >= info.n_layer]


def mtp_needs_embedding_copy(info: ModelInfo) -> bool:
    """Whether the last stage needs a copy of the token embedding to run the MTP block: the block reads the
    token at each position, and only the first stage holds `token_embd` unless the embedding is tied (the
    head) or the block brings its own (`nextn.embed_tokens`)."""
    own = any(name.endswith("nextn.embed_tokens.weight") for name in mtp_tensors(info))
    return not own and not info.tied_embeddings and any(t.name == TOKEN_EMBD for t in info.header.tensors)


def weights(info: ModelInfo, types: dict[str, gguf.GGMLQuantizationType] | None = None, *,
            include_mtp: bool = False) -> Weights:
    """The model's weights per layer and role, each tensor in `types` (default: its own type). With
    `include_mtp` the MTP blocks (and the embedding copy they need) are the last stage's own."""
    layer_bytes = [0] * info.n_layer
    role = {INPUT: 0, OUTPUT: 0, SHARED: 0}
    excluded: list[str] = []
    mtp = 0
    for t in info.header.tensors:
        owner = info.layer_of.get(t.name)  # None: unknown (a build refuses it; a scaffold leaves it out)
        nb = tensor_nbytes(t.shape, types.get(t.name, t.type) if types else t.type)
        if isinstance(owner, int):
            if owner < info.n_layer:
                layer_bytes[owner] += nb
            elif include_mtp:
                mtp += nb
            else:
                excluded.append(t.name)  # MTP left out (bundle.include_mtp off)
        elif owner is not None:
            role[owner] += nb
            if owner == INPUT and info.tied_embeddings and t.name == TOKEN_EMBD:
                role[OUTPUT] += nb  # the tied head: the last stage carries the embedding as its output
            if owner == INPUT and t.name == TOKEN_EMBD and include_mtp and mtp_needs_embedding_copy(info):
                mtp += nb  # the MTP block's copy of the embedding, on the last stage
    return Weights(layer_bytes, role[INPUT], role[OUTPUT] + mtp, role[SHARED], excluded, mtp)
