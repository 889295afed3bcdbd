"""The fake engine (the C library worker/fake, through dgr.runtime.engine's ctypes) is a faithful stand-in: split == whole
bit for bit, its output depends on history, its spec. Its refusals and the rest: tests/worker/test_fake_engine_cpp.py."""

from __future__ import annotations

import numpy as np
import pytest

from dgr.core.errors import EngineError
from dgr.runtime.engine_api import Step
from dgr.testing.fake_engine import FakeEngine, FakeModel

from support.engine import fake_split

SPEC = "layers=7,embd=8,streams=2,cuts=2:5,hash_layers=3,seed=3"


def test_split_equals_whole_bit_for_bit_for_any_chunking():
    model = FakeModel.from_spec(SPEC)
    ids = FakeEngine(model).tokenize("the fake model has memory")
    whole = FakeEngine(model)
    whole.open_session("s", 1)
    ref = whole.forward([Step("s", 1, np.arange(len(ids)), np.array(ids), want_logits="all")])[0].logits
    assert np.array_equal(fake_split(model, ids, [(0, len(ids))]), ref)
    assert np.array_equal(fake_split(model, ids, [(0, 3), (3, 4), (4, len(ids))]), ref)


def test_output_depends_on_history():
    model = FakeModel.from_spec(SPEC)
    e = FakeEngine(model)
    e.open_session("a", 1)
    e.open_session("b", 1)
    ra = e.forward([Step("a", 1, np.arange(2), np.array([5, 9]), want_logits="all")])[0]
    rb = e.forward([Step("b", 1, np.arange(2), np.array([6, 9]), want_logits="all")])[0]
    assert not np.array_equal(ra.logits[1], rb.logits[1])


def test_spec_roundtrip_and_bad_spec():
    m = FakeModel.from_spec(SPEC)
    assert FakeModel.from_spec(m.to_spec()) == m and m.ranges == [(0, 2), (2, 5), (5, 7)]
    assert FakeModel.from_spec(SPEC.replace("seed=3", "seed=4")).bundle_id != m.bundle_id
    with pytest.raises(EngineError, match="bad item"):
        FakeModel.from_spec("layers=4,colour=blue")
    with pytest.raises(EngineError, match="cuts"):
        FakeModel.from_spec("layers=4,cuts=4")
