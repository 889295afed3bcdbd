"""dgr-worker (worker/server, the C++ stage worker; docs/worker.md), its phase 1 RPCs, against independent
references.

dgr-worker serves stages of a real bundle as a real process on loopback; the Python client talks to it. What it
answers is held against what it must be, not against another worker: Describe field by field, and its
descriptor JSON (address and uptime aside; valid for dgr.core.descriptor.Descriptor, the model of
docs/schemas/descriptor.schema.json), against the bundle (manifest.json and its blake3, the stage file's
header), the pin, the engine library's bytes and the same stage opened in-process through dgr.runtime.engine.Engine
(vocabulary, stop ids, memory); Tokenize/Detokenize against that engine; OpenSession/CloseSession and Frames
refusals against their typed errors, each message written out here (the contract). The binary is
$DGR_WORKER_BIN (Bazel), else dgr-worker beside the engine library; a missing binary fails with how to build it.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import blake3
import gguf
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from dgr.core import descriptor as dd
from dgr.core.constants import DEFAULT_MAX_SESSIONS, DEFAULT_N_CTX
from dgr.core.contract import WIRE_DTYPES
from dgr.core.descriptor import Descriptor
from dgr.gguf.model import read_header
from dgr.runtime.engine import Engine
from dgr.runtime.wire.codec import DEFAULT_MAX_MESSAGE_BYTES
from dgr.runtime.wire.gen import stage_pb2 as pb
from dgr.runtime.wire.limits import Limits
from dgr.toolchain.buildinfo import build_info
from dgr.toolchain.bundle import load_bundle

from support.engine import make_bundle
from support.worker import Proc, cpp, one_line_error

# Describe fields that name the process, not the stage: a member's certificate
PROCESS_FIELDS = {"member", "descriptor_json"}
# dgr-worker's defaults (`dgr worker serve`'s flags; docs/wire.md): what Describe and the descriptor advertise
# dgr-worker's own, held equal to the front end's (`dgr worker serve` passes these explicitly)
MAX_MESSAGE_BYTES = DEFAULT_MAX_MESSAGE_BYTES
MAX_QUEUED_STEPS, MAX_SESSION_STEPS, MAX_BATCH_TOKENS, SESSION_TTL_S = (
    Limits().max_queued_steps, Limits().max_session_steps, Limits().max_batch_tokens, Limits().session_ttl_s)


def fields(d: pb.StageDescription) -> dict:
    return {f.name: v for f, v in d.ListFields() if f.name not in PROCESS_FIELDS}


def descriptor(d: pb.StageDescription) -> dict:
    Descriptor.model_validate_json(d.descriptor_json)          # the model docs/schemas/descriptor.schema.json is
    j = json.loads(d.descriptor_json)
    j.pop("address")
    j["health"].pop("uptime_s")
    return j


# ---------------------------------------------------------------------------------------------- references
def reference_engine(bundle: Path, stage: int, *, n_ctx: int = DEFAULT_N_CTX,
                     max_sessions: int = DEFAULT_MAX_SESSIONS, n_threads: int = 0) -> Engine:
    """The stage file opened in this process as the worker opens it (the same n_ctx, sessions, threads)."""
    return Engine.open(load_bundle(bundle).stage_path(stage), n_ctx=n_ctx, max_sessions=max_sessions,
                       n_threads=n_threads)


def expected_description(bundle: Path, stage: int, engine: Engine, *, n_ctx: int = DEFAULT_N_CTX,
                         max_sessions: int = DEFAULT_MAX_SESSIONS) -> pb.StageDescription:
    """What a fresh dgr-worker serving `stage` of `bundle` (default flags but these) must describe: the
    bundle's manifest (its blake3 is the bundle id), the pin, the stage file's header (chat template, trained
    context), and `engine`'s own vocabulary facts."""
    b = load_bundle(bundle)
    m, entry = b.manifest, b.manifest.stages[stage]
    bid = blake3.blake3((Path(bundle) / "manifest.json").read_bytes()).hexdigest()
    assert bid == b.id
    info, wire = engine.describe(), m.boundary_dtype
    header = read_header(b.stage_path(stage))
    template = header.get(gguf.Keys.Tokenizer.CHAT_TEMPLATE)
    # a session holds n_ctx positions, never more than the model was trained for
    n_ctx = min(n_ctx, int(header.get(gguf.Keys.LLM.CONTEXT_LENGTH.format(arch=m.model.arch)) or n_ctx))
    assert n_ctx == info.n_ctx
    pin = build_info()
    d = pb.StageDescription(
        identity=pb.Identity(model=m.recipe.name, bundle_id=bid, stage_index=stage, stage_count=len(m.stages),
                             layer_begin=entry.layer_begin, layer_end=entry.layer_end, n_layer=m.model.n_layer,
                             upstream_commit=pin.commit, patch_series=pin.patch_series, lane=engine.lane,
                             arch=m.model.arch, numerics=engine.numerics),
        is_first=stage == 0, is_last=stage == len(m.stages) - 1, has_vocab=True, n_vocab=info.n_vocab,
        n_ctx=n_ctx, max_sessions=max_sessions, max_message_bytes=MAX_MESSAGE_BYTES, engine="llama.cpp",
        eos_token_ids=list(engine.vocab().stop_ids), session_ttl_s=SESSION_TTL_S, max_queued_steps=MAX_QUEUED_STEPS,
        chat_template=template if isinstance(template, str) else "", can_roll_back=info.can_truncate,
        batch_invariant=info.batch_invariant, matmul_kernels=info.matmul_kernels,
        # the prefix cache: on by default where the engine can keep a prefix (docs/worker.md "Prefix cache")
        prefix_cache_capacity_bytes=Limits().prefix_cache_mib << 20 if info.can_truncate and info.batch_invariant else 0)
    dtype = pb.Dtype.Value(wire.upper())
    if (s := entry.boundary_in) is not None:
        d.schema_in.CopyFrom(pb.BoundarySchema(n_streams=s.n_streams, n_embd=s.n_embd, dtype=dtype,
                                               token_ids=s.token_ids, bundle_id=bid, layer=entry.layer_begin))
    if (s := entry.boundary_out) is not None:    # the token-id sideband always travels with what a stage sends
        d.schema_out.CopyFrom(pb.BoundarySchema(n_streams=s.n_streams, n_embd=s.n_embd, dtype=dtype, token_ids=True,
                                                bundle_id=bid, layer=entry.layer_end))
        d.seam_bytes_per_token = WIRE_DTYPES[wire].nbytes(s.n_streams * s.n_embd)
    return d


def file_blake3(path: Path) -> str:
    return blake3.blake3(Path(path).resolve().read_bytes()).hexdigest()


def expected_descriptor(bundle: Path, stage: int, engine: Engine, engine_lib: Path, worker_bin: Path, **kw) -> dict:
    """The descriptor (address and uptime aside) of a fresh dgr-worker: the same references, the blake3 of
    the engine library and of the worker binary, `engine`'s memory report, nothing measured, no errors,
    plaintext, no certificates."""
    d = expected_description(bundle, stage, engine, **kw)
    i, mem, wire = d.identity, engine.memory(), load_bundle(bundle).manifest.boundary_dtype
    entry = load_bundle(bundle).manifest.stages[stage]
    idle = dd.StepTimes(steps=0, compute_ms_median=0.0, compute_ms_p90=0.0, queue_ms_median=0.0, queue_ms_p90=0.0)
    seam_in = None if entry.boundary_in is None else dd.Seam.of(
        entry.boundary_in.model_copy(update={"dtype": wire}), entry.layer_begin)
    seam_out = None if entry.boundary_out is None else dd.Seam.of(
        entry.boundary_out.model_copy(update={"dtype": wire, "token_ids": True}), entry.layer_end)
    j = json.loads(dd.Descriptor(
        address="-",
        identity=dd.CompatIdentity(
            model=i.model, bundle_id=i.bundle_id, stage_index=i.stage_index, stage_count=i.stage_count,
            layer_begin=i.layer_begin, layer_end=i.layer_end, n_layer=i.n_layer, upstream_commit=i.upstream_commit,
            patch_series=i.patch_series, lane=i.lane, arch=i.arch, engine="llama.cpp",
            engine_blake3=file_blake3(engine_lib), worker_blake3=file_blake3(worker_bin), wire_dtype=wire,
            numerics=i.numerics),
        capacity=dd.Capacity(
            max_sessions=d.max_sessions, n_ctx=d.n_ctx, max_queued_steps=MAX_QUEUED_STEPS,
            max_session_steps=MAX_SESSION_STEPS, max_batch_tokens=MAX_BATCH_TOKENS,
            max_message_bytes=MAX_MESSAGE_BYTES, session_ttl_s=SESSION_TTL_S,
            memory=dd.Memory(weights_bytes=mem.weights_bytes, kv_bytes=mem.kv_bytes, compute_bytes=mem.compute_bytes,
                             device_weights_bytes=mem.device_weights_bytes, device=mem.device),
            decode=idle, prefill=idle),
        load=dd.Load(open_sessions=0, queued_steps=0, cached_positions=0),
        seam=dd.SeamCost(seam_in=seam_in, seam_out=seam_out),
        health=dd.Health(serving=True, uptime_s=0.0, errors={}, reaped_sessions=0, overloaded=0, restarts=0),
        security=dd.Security(tls=False, mutual_tls=False, member=""),
        certificates=(), metrics="").model_dump_json())
    j.pop("address")
    j["health"].pop("uptime_s")
    return j


@pytest.fixture(scope="module")
def pair(tiny_pair, worker_bin):
    """Stage 0 and stage 1 of the tiny bundle, each served by dgr-worker (2 sessions each)."""
    procs = {}
    try:
        for stage in (0, 1):
            procs[stage] = cpp(worker_bin, tiny_pair, stage, "--max-sessions", "2")
        yield procs
    finally:
        for p in procs.values():
            p.stop()


@pytest.fixture(scope="module")
def engines(tiny_pair, engine_lib):
    """The tiny bundle's two stages opened in this process as the pair opens them."""
    es = {stage: reference_engine(tiny_pair, stage, max_sessions=2) for stage in (0, 1)}
    yield es
    for e in es.values():
        e.close()


def test_describe_is_the_bundle_the_pin_and_the_engine(pair, tiny_pair, engines, engine_lib, worker_bin):
    for stage in (0, 1):
        c = pair[stage]
        dc = c.stub.Describe(pb.DescribeRequest(), timeout=10)
        want = expected_description(tiny_pair, stage, engines[stage], max_sessions=2)
        assert fields(dc) == fields(want), f"stage {stage}"
        assert descriptor(dc) == expected_descriptor(tiny_pair, stage, engines[stage], engine_lib, worker_bin,
                                                   max_sessions=2), \
            f"stage {stage}"
        assert json.loads(dc.descriptor_json)["address"] == c.address
        assert dc.identity.bundle_id and dc.identity.patch_series and dc.eos_token_ids


def test_health_serving(pair):
    for p in pair.values():
        h = health_pb2_grpc.HealthStub(p.channel)
        for service in ("", "dgr.v1.Stage"):
            r = h.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert r.status == health_pb2.HealthCheckResponse.SERVING, (p.cmd[0], service)


TEXTS = ["hello world", "", "The quick brown fox, 42 times!", "ünïcödé ✓ 日本語", "  spaces\tand\nlines  "]


def check_tokenizer(proc: Proc, engine: Engine, texts: list[str], tail=lambda ids: ids[1:2]) -> None:
    """Tokenize/Detokenize answer what the stage's engine in this process does, text by text."""
    for text in texts:
        for special in (True, False):
            ids = list(proc.stub.Tokenize(pb.TokenizeRequest(text=text, add_special=special), timeout=10).token_ids)
            assert ids == engine.tokenize(text, special), (text, special)
            for cut in (ids, ids[:-1], tail(ids)):
                got = proc.stub.Detokenize(pb.DetokenizeRequest(token_ids=cut), timeout=10).text
                assert got == engine.detokenize(cut), (text, cut)


def test_tokenize_detokenize_are_the_engines(pair, engines):
    for stage in (0, 1):                         # every stage keeps the vocabulary
        check_tokenizer(pair[stage], engines[stage], TEXTS)
    assert any(engines[0].tokenize(t, False) for t in TEXTS)          # not an empty vocabulary


def test_an_id_outside_the_vocabulary_is_refused_in_the_engines_words(pair, engines):
    """Detokenize of an id the engine refuses: INVALID_ARGUMENT with the engine's own message (read under the
    engine's lock: engine_loop/vocabulary.h), on every stage; the worker goes on answering."""
    for stage in (0, 1):
        n_vocab = pair[stage].stub.Describe(pb.DescribeRequest(), timeout=10).n_vocab
        with pytest.raises(grpc.RpcError) as refused:
            pair[stage].stub.Detokenize(pb.DetokenizeRequest(token_ids=[1, n_vocab]), timeout=10)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert refused.value.details() == f"token id {n_vocab} is outside the vocabulary [0, {n_vocab})"
        check_tokenizer(pair[stage], engines[stage], TEXTS[:1])


def route(procs: list[Proc], descs: list[pb.StageDescription]) -> list[pb.Hop]:
    return [pb.Hop(address=p.address, bundle_id=d.identity.bundle_id, stage_index=d.identity.stage_index,
                   layer_begin=d.identity.layer_begin, layer_end=d.identity.layer_end) for p, d in zip(procs, descs)]


def open_reply(head: Proc, hops: list[pb.Hop], sid: str, epoch: int, **kw) -> pb.OpenSessionReply:
    return head.stub.OpenSession(pb.OpenSessionRequest(session_id=sid, epoch=epoch, route=hops, **kw), timeout=30)


def wire_error(code: int, stage: int, address: str, message: str, **kw) -> pb.WireError:
    """A typed error as a worker answers it: the hop that answers, named in the message too."""
    hop = f"stage {stage} ({address})"
    return pb.WireError(code=code, hop=hop, message=f"{hop}: {message}", **kw)


def test_open_close_and_their_typed_errors(pair, tiny_pair, engines):
    s0, s1 = pair[0], pair[1]
    a0, a1 = s0.address, s1.address
    descs = [s.stub.Describe(pb.DescribeRequest(), timeout=10) for s in (s0, s1)]
    bid = descs[0].identity.bundle_id
    good = route([s0, s1], descs)
    ok = open_reply(s0, good, "a", 1)
    assert not ok.HasField("error"), ok.error
    # the hops' descriptions, as each stood before it opened the session
    assert [fields(h) for h in ok.hops] == [fields(expected_description(tiny_pair, s, engines[s], max_sessions=2))
                                            for s in (0, 1)]
    assert s0.stub.Describe(pb.DescribeRequest()).open_sessions == 1
    assert s1.stub.Describe(pb.DescribeRequest()).open_sessions == 1
    assert open_reply(s0, good, "a", 1).error == wire_error(                           # already open
        pb.STALE_EPOCH, 0, a0, "session a is already at epoch 1; open a newer epoch")
    assert not open_reply(s0, good, "b", 1).HasField("error")                        # a second session fits
    e = open_reply(s0, good, "c", 1).error                                           # max_sessions 2
    assert 250_000 < e.retry_after_ms <= 300_000       # the oldest idle session's reaping (--session-ttl 300)
    assert e == wire_error(pb.OVERLOADED, 0, a0, "all 2 sessions are in use: retry later or use another route",
                           retry_after_ms=e.retry_after_ms)
    assert not open_reply(s0, good, "a", 2).HasField("error")                        # a newer epoch replaces the old
    assert open_reply(s0, good, "a", 1).error == wire_error(                           # older than the latest
        pb.STALE_EPOCH, 0, a0, "session a is already at epoch 2; open a newer epoch")
    wrong = route([s0, s1], descs)
    wrong[0].stage_index = 1
    assert open_reply(s0, wrong, "w", 1).error == wire_error(
        pb.WRONG_STAGE, 0, a0, f"the route expects stage 1 [0, 2) of bundle {bid} at {a0} but this worker serves "
                               f"stage 0 [0, 2) of bundle {bid}: fix the route or start the right worker")
    wrong = route([s0, s1], descs)
    wrong[0].layer_end = 3
    assert open_reply(s0, wrong, "r", 1).error == wire_error(
        pb.WRONG_RANGE, 0, a0, f"the route expects stage 0 [0, 3) of bundle {bid} but this worker serves "
                               f"stage 0 [0, 2) of bundle {bid}")
    assert open_reply(s0, good, "h", 1, hop_index=5).error == wire_error(
        pb.BAD_FRAME, 0, a0, "hop_index is outside the route")
    assert open_reply(s0, good[:1], "f", 1).error == wire_error(                      # stage 0 as the last hop
        pb.WRONG_STAGE, 0, a0, f"this worker serves stage 0 [0, 2) of bundle {bid} (first=True, last=False) but "
                               "is hop 0 of a 1-hop route: the route must cover every layer in order")
    bad_up = pb.StageDescription()
    bad_up.CopyFrom(descs[0])
    bad_up.schema_out.n_embd = 32
    n_embd, dtype = descs[1].schema_in.n_embd, load_bundle(tiny_pair).manifest.boundary_dtype
    assert open_reply(s1, good, "s", 1, hop_index=1, upstream=bad_up).error == wire_error(
        pb.SCHEMA_MISMATCH, 1, a1, f"stage 0 ({a0}) sends [n, 1, 32] {dtype} at layer 2 +token ids of bundle {bid} "
                                   f"but this stage takes [n, 1, {n_embd}] {dtype} at layer 2 of bundle {bid} "
                                   "(differs in n_embd): both hops must serve stages of the same bundle")
    bad_up.CopyFrom(descs[0])
    bad_up.schema_out.layer = 3
    assert open_reply(s1, good, "l", 1, hop_index=1, upstream=bad_up).error == wire_error(   # at the seam
        pb.WRONG_RANGE, 1, a1, f"stage 0 ({a0}) hands over at layer 3 but this stage begins at layer 2")
    assert s0.stub.CloseSession(pb.CloseSessionRequest(session_id="b", epoch=1, chain=True),
                                timeout=10) == pb.CloseSessionReply()
    with socket.socket() as sk:                                      # a port nobody serves
        sk.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{sk.getsockname()[1]}"
    gone = route([s0, s1], descs)
    gone[1].address = dead
    e = open_reply(s0, gone, "u", 1).error
    assert (e.code, e.hop) == (pb.HOP_UNREACHABLE, f"stage 1 ({dead})"), e
    assert re.fullmatch(rf"stage 1 \({dead}\) is unreachable: stage 0 \({a0}\) could not open the session there "
                        r"\(no dgr worker answered at that address\): is that worker running, and is its address in "
                        r"the route right\? \(this worker's log says why\)", e.message, re.S), e.message
    assert s0.stub.Describe(pb.DescribeRequest()).open_sessions == 1   # a (u was closed again)
    assert s0.stub.CloseSession(pb.CloseSessionRequest(session_id="a", epoch=2, chain=True),
                                timeout=10) == pb.CloseSessionReply()
    assert [s.stub.Describe(pb.DescribeRequest()).open_sessions for s in (s0, s1)] == [0, 0]
    # every typed error answered is counted, where it was answered
    assert [json.loads(s.stub.Describe(pb.DescribeRequest()).descriptor_json)["health"]["errors"] for s in (s0, s1)] \
        == [{"STALE_EPOCH": 2, "OVERLOADED": 1, "WRONG_STAGE": 2, "WRONG_RANGE": 1, "BAD_FRAME": 1,
             "HOP_UNREACHABLE": 1}, {"SCHEMA_MISMATCH": 1, "WRONG_RANGE": 1}]
    assert s0.stub.Describe(pb.DescribeRequest()).overloaded == 1


def test_frames_refusals_are_typed_errors(pair):
    """Frames is served (phase 2: tests/worker/test_worker_cpp_frames.py); a frame of no open session is refused, typed."""
    p = pair[0]
    frames = [pb.Frame(session_id="x", epoch=1),
              pb.Frame(session_id="x", epoch=1, step=pb.Step(positions=[0], token_ids=[1]))]
    want = wire_error(pb.UNKNOWN_SESSION, 0, p.address, "no open session x epoch 1: open it (OpenSession) first")
    got = [r.error for r in p.stub.Frames(iter(frames), timeout=10)]
    assert got == [want, want]


def test_bad_flags_and_inputs_are_one_clear_line(worker_bin, tiny_pair, tmp_path):
    w = str(worker_bin)
    rc, line = one_line_error([w, "--bundle", str(tiny_pair), "--stage", "0", "--no-such-flag"])
    assert rc == 2 and "unrecognized argument: --no-such-flag" in line
    rc, line = one_line_error([w, "--bundle", str(tiny_pair)])
    assert rc == 2 and "--stage" in line
    rc, line = one_line_error([w, "--bundle", str(tiny_pair), "--stage", "x"])
    assert rc == 2 and "invalid int value: 'x'" in line
    rc, line = one_line_error([w, "--bundle", str(tiny_pair), "--stage", "2"])
    assert rc == 1 and "has 2 stages (0..1); there is no stage 2" in line
    rc, line = one_line_error([w, "--bundle", str(tmp_path / "none"), "--stage", "0"])
    assert rc == 1 and "cannot read the bundle manifest" in line
    rc, line = one_line_error([w, "--bundle", str(tiny_pair), "--stage", "0", "--listen", "0.0.0.0:0"])
    assert rc == 1 and "refusing to listen on 0.0.0.0:0 without TLS" in line
    rc, line = one_line_error([w, "--bundle", str(tiny_pair), "--stage", "0", "--wire-dtype", "f8"])
    assert rc == 1 and "unknown wire dtype 'f8'" in line
    rc, line = one_line_error([w, "--bundle", str(tiny_pair), "--stage", "0", "--tls-cert", "x.pem"])
    assert rc == 1 and "give both --tls-cert and --tls-key" in line
    rc, line = one_line_error([w, "--bundle", str(tiny_pair), "--stage", "0", "--tls-ca", "ca.pem"])
    assert rc == 1 and "--tls-ca needs --tls-cert and --tls-key" in line
    rc, line = one_line_error([w, "--bundle", str(tiny_pair), "--stage", "0", "--tls-cert", str(tmp_path / "c.pem"),
                               "--tls-key", str(tmp_path / "k.pem")])
    assert rc == 1 and "c.pem: no such file (make one with `dgr certs init` / `dgr certs issue`)" in line
    rc, line = one_line_error([w, "--bundle", str(tiny_pair), "--stage", "0", "--listen", "0.0.0.0:0", "--insecure",
                               "--advertise", "0.0.0.0"])
    assert rc == 1 and "--advertise 0.0.0.0: give the HOST[:PORT]" in line
    rc, line = one_line_error([w, "--bundle", str(tiny_pair), "--stage", "0", "--send-timeout", "0"])
    assert rc == 1 and "--send-timeout must be more than 0" in line
    rc, line = one_line_error([w, "--bundle", str(tiny_pair), "--stage", "0", "--lane", "vulkan"])
    assert rc == 1 and "built for the cpu lane" in line
    with socket.socket() as sk:                  # a port in use
        sk.bind(("127.0.0.1", 0))
        sk.listen()
        rc, line = one_line_error([w, "--bundle", str(tiny_pair), "--stage", "0", "--listen",
                                   f"127.0.0.1:{sk.getsockname()[1]}"])
    assert rc == 1 and "cannot listen on" in line
    env = {**os.environ, "DGR_ENGINE_LIB": str(tmp_path / "libnone.so")}
    r = subprocess.run([w, "--bundle", str(tiny_pair), "--stage", "0"], capture_output=True, text=True, env=env,
                       timeout=60)
    assert r.returncode == 1 and "no engine library at" in r.stderr and r.stderr.count("\n") == 1


def test_sigterm_drains_and_exits(worker_bin, tiny_pair):
    c = cpp(worker_bin, tiny_pair, 0)
    c.p.send_signal(signal.SIGTERM)
    assert c.p.wait(timeout=30) == 0
    assert "drained and stopped" in c.output()


def test_dgr_worker_serve_runs_dgr_worker_with_its_flags(worker_bin, tiny_pair, tmp_path, monkeypatch):
    """`dgr worker serve --bundle` is the front end: it checks the bundle and becomes dgr-worker (the same
    process), every flag passed on; what it refuses it refuses before, in one line."""
    monkeypatch.setenv("DGR_WORKER_BIN", str(worker_bin))
    env = dict(os.environ)
    p = Proc([sys.executable, "-m", "dgr", "worker", "serve", "--bundle", str(tiny_pair), "--stage", "1",
              "--listen", "127.0.0.1:0", "--max-sessions", "3", "--session-ttl", "7.5"])
    try:
        assert Path(os.readlink(f"/proc/{p.p.pid}/exe")).resolve() == worker_bin.resolve()
        argv = Path(f"/proc/{p.p.pid}/cmdline").read_bytes().split(b"\0")
        assert [b"--max-sessions", b"3"] == argv[argv.index(b"--max-sessions"):][:2]
        assert [b"--session-ttl", b"7.5"] == argv[argv.index(b"--session-ttl"):][:2]
        d = p.stub.Describe(pb.DescribeRequest(), timeout=10)
        assert (d.identity.stage_index, d.max_sessions) == (1, 3)
    finally:
        p.stop()
    bad = subprocess.run([sys.executable, "-m", "dgr", "worker", "serve", "--bundle", str(tiny_pair), "--stage", "5"],
                         capture_output=True, text=True, env=env, timeout=60)
    assert bad.returncode != 0 and "there is no stage 5" in bad.stderr
    missing = {**env, "DGR_WORKER_BIN": str(tmp_path / "nothing")}
    bad = subprocess.run([sys.executable, "-m", "dgr", "worker", "serve", "--bundle", str(tiny_pair), "--stage", "0"],
                         capture_output=True, text=True, env=missing, timeout=60)
    assert bad.returncode != 0 and "not an executable file" in bad.stderr


def test_smollm2_stage0_is_its_bundle_and_engine_and_measured(smollm2_gguf, engine_lib, worker_bin, tmp_path):
    """A real model: SmolLM2's stage 0 (chat template, eog ids, its tokenizer) against the bundle, the pin and
    the stage opened in this process; dgr-worker's start-to-SERVING and RSS are printed (measured, not
    asserted: no speed thresholds here)."""
    bundle = make_bundle(smollm2_gguf, [(0, 15), (15, 30)], tmp_path / "store", name="smollm2").root
    c = cpp(worker_bin, bundle, 0, "--threads", "1")
    try:
        engine = reference_engine(bundle, 0, n_threads=1)
        try:
            dc = c.stub.Describe(pb.DescribeRequest(), timeout=30)
            assert fields(dc) == fields(expected_description(bundle, 0, engine))
            assert descriptor(dc) == expected_descriptor(bundle, 0, engine, engine_lib, worker_bin)
            assert "im_start" in dc.chat_template and len(dc.eos_token_ids) >= 1
            check_tokenizer(c, engine, TEXTS + ["<|im_start|>user\nHi!<|im_end|>\n"], tail=lambda ids: ids[-1:])
        finally:
            engine.close()
        print(f"\nSmolLM2 stage 0: dgr-worker start to serving {c.ready_s:.2f} s, RSS {c.rss_kib() / 1024:.0f} MiB")
    finally:
        c.stop()
