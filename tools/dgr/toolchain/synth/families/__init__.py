"""The architecture families dgr ports beyond the first ones: one module per group, each a SPECS table.

A group module (dense_a, moe_a, hybrid, ...) maps architecture names (as llama.cpp's llama-arch.cpp
spells them) to `dgr.toolchain.synth.spec.ArchSpec` rows; dgr.toolchain.synth.generic merges them with its core table. The opt-in on
the C++ side is worker/engine/dgr_ported_<group>.def (one DGR_PORTED line per architecture) and a patch
per group in patches/llama.cpp/.
"""

from __future__ import annotations

import importlib

from dgr.toolchain.synth.spec import ArchSpec

GROUPS = ("dense_a", "dense_b", "dense_c", "moe_a", "moe_b", "ssm", "linear")


def family_specs() -> dict[str, ArchSpec]:
    """Every group's SPECS, merged (a name defined twice is an error in dgr.toolchain.synth.generic)."""
    out: dict[str, ArchSpec] = {}
    for g in GROUPS:
        mod = importlib.import_module(f"dgr.toolchain.synth.families.{g}")
        for name, spec in mod.SPECS.items():
            if name in out:
                raise ValueError(f"architecture {name!r} is in two family groups")
            out[name] = spec
    return out
