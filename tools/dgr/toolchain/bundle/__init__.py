"""Bundles: a recipe built into one GGUF per stage plus a canonical, hashed manifest.

One job per module:

- `manifest`: the manifest model, its canonical JSON (the bundle id is its blake3), `load_bundle`, `check_id`;
- `plan`: a recipe to stages (ranges, tensors, target types, each stage's contract), `make_plan`;
- `quantize`: target types from the recipe's rules (never for tensors llama.cpp never quantizes), whether
  the engine can run them, and conversions the `gguf` package can make;
- `writer`: the stage GGUF writer (header, tensor table, data, in that order only);
- `builder`: `build`, plan -> write stage files (hashing as they are written) -> seal manifest -> move into the store,
  and `find_or_build` (the recipe's bundle found in a store by its blake3, built there when it is not);
- `verify`: `verify_bundle`, resumable chunk-by-chunk verification;
- `store`: `provision`, a verified, resumable copy into a store, and `refuse_home` (where stores may live).

`load_bundle(path)` is the library entry point for workers: the validated manifest, the bundle id and
each stage's file path. The names below are imported on first use, so a worker that only loads
manifests does not import the builder (numpy quantization, source downloads).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "manifest": ("Bundle", "Manifest", "ManifestModel", "ManifestRecipe", "ManifestSource", "StageEntry",
                 "bundle_id", "canonical_json", "check_id", "load_bundle", "manifest_bytes", "stage_filename"),
    "plan": ("BuildPlan", "RuleUse", "StagePlan", "Weights", "make_plan", "weights"),
    "quantize": ("Choice", "can_dequantize", "can_quantize", "check_target", "choose", "convert",
                 "never_quantized", "target_type"),
    "writer": ("StageWriter", "pack_kv"),
    "builder": ("build", "find_or_build"),
    "verify": ("VerifyReport", "verify_bundle"),
    "store": ("ProvisionReport", "provision", "refuse_home"),
    "baseline": ("Baseline", "baseline_model"),
}
_WHERE = {name: mod for mod, names in _EXPORTS.items() for name in names}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    mod = _WHERE.get(name)
    if mod is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{mod}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
