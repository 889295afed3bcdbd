"""Where a worker's engine and identity come from: a fake-model spec (tests) or a bundle stage."""

from __future__ import annotations

from pathlib import Path

from dgr.engine_api import ShardEngine
from dgr.errors import WireError
from dgr.fake_engine import FakeEngine, FakeModel
from dgr.wire.worker import StageIdentity


def fake_stage(spec: str, stage: int, wire_dtype: str = "f32") -> tuple[ShardEngine, StageIdentity]:
    """Stage `stage` of the fake model `spec` (see dgr.fake_engine); the bundle id hashes the spec."""
    model = FakeModel.from_spec(spec)
    engine = FakeEngine(model, stage)
    ident = StageIdentity(model=f"fake:{model.to_spec()}", bundle_id=model.bundle_id, stage_index=stage,
                          stage_count=len(model.ranges), lane="cpu", engine="fake", wire_dtype=wire_dtype,
                          eos_token_ids=tuple(engine.eos_token_ids()))
    return engine, ident
