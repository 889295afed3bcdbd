"""The wire contract: committed stubs match the proto; boundary codecs; sampling."""

from __future__ import annotations

import numpy as np
import pytest

from dgr.core.errors import WireError
from dgr.runtime.wire import codec
from dgr.runtime.wire.gen import stage_pb2 as pb
from dgr.toolchain import protogen


def test_committed_stubs_match_the_proto():
    assert protogen.drift() == [], "stubs drifted from proto/dgr/v1: run `dgr wire protoc` and commit"


def test_stub_drift_is_detected(tmp_path):
    protogen.write(tmp_path)
    assert protogen.drift(tmp_path) == []
    (tmp_path / "stage_pb2.py").write_text((tmp_path / "stage_pb2.py").read_text() + "# edited\n")
    assert protogen.drift(tmp_path) == ["stage_pb2.py"]


def test_frame_carries_the_contract_fields():
    fields = set(pb.Frame.DESCRIPTOR.fields_by_name) | set(pb.Step.DESCRIPTOR.fields_by_name)
    assert {"session_id", "epoch", "positions", "token_ids", "boundary", "schema", "cache_expect"} <= fields
    assert [pb.ErrorCode.Name(c) for c in (pb.CACHE_MISS, pb.SCHEMA_MISMATCH, pb.WRONG_STAGE, pb.WRONG_RANGE,
                                           pb.OVERLOADED)]


@pytest.mark.parametrize("dtype,tol", [("f32", 0.0), ("f16", 1e-3), ("bf16", 8e-3)])
def test_boundary_roundtrip(dtype, tol):
    x = np.random.default_rng(0).standard_normal((5, 4, 32)).astype(np.float32)
    b = codec.encode(x, codec.dtype_code(dtype))
    assert list(b.shape) == [5, 4, 32] and len(b.data) == x.size * codec.DTYPE_BYTES[b.dtype]
    y = codec.decode(pb.Boundary.FromString(b.SerializeToString()))
    assert y.dtype == np.float32 and y.shape == x.shape
    assert np.max(np.abs(y - x) / np.maximum(np.abs(x), 1e-2)) <= tol
    if dtype == "f32":
        assert np.array_equal(x, y)


def test_bf16_rounds_to_nearest_even():
    # 1 + 2^-8 is halfway between two bf16 values: ties go to the even one (1.0); just above rounds up.
    x = np.array([1 + 2**-8, 1 + 2**-8 + 2**-16, -3.0], np.float32).reshape(3, 1, 1)
    y = codec.decode(codec.encode(x, pb.BF16)).reshape(-1)
    assert y.tolist() == [1.0, 1 + 2**-7, -3.0]


def test_decode_refuses_wrong_sizes():
    b = codec.encode(np.zeros((2, 1, 4), np.float32), pb.F32)
    b.shape[:] = [3, 1, 4]
    with pytest.raises(ValueError, match="needs 48 bytes, got 32"):
        codec.decode(b)


def test_tokens_per_frame_respects_the_limit():
    assert codec.tokens_per_frame(1 << 20, 4 * 4096 * 4) == ((1 << 20) - codec.FRAME_OVERHEAD) // (65536 + 10)
    with pytest.raises(WireError, match="raise --max-message-bytes"):
        codec.tokens_per_frame(64 * 1024, 4 * 4096 * 4)


def test_sampling_greedy_topk_topp_and_seed():
    """The one sampler (the engine library's dgr_sample, which dgr-worker's last stage draws with; the fake
    engine library carries the same file)."""
    from functools import partial

    from dgr.runtime.engine import sample as engine_sample
    from dgr.testing.fake_engine import library_path

    sample = partial(engine_sample, lib=library_path())
    logits = np.array([0.0, 3.0, 2.9, -1.0, 1.0])
    assert sample(logits) == 1
    draws = [sample(logits, temperature=1.0, seed=7, position=p) for p in range(200)]
    assert draws == [sample(logits, temperature=1.0, seed=7, position=p) for p in range(200)]
    assert len(set(draws)) > 2
    assert set(sample(logits, temperature=5.0, top_k=2, seed=1, position=p) for p in range(200)) == {1, 2}
    # top_p 0.5 keeps only the smallest head whose mass reaches 0.5: here token 1 alone at low temperature.
    assert set(sample(logits, temperature=0.1, top_p=0.5, seed=1, position=p) for p in range(50)) == {1}
