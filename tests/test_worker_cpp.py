"""dgr-worker (worker/server, the C++ stage worker; docs/worker.md), its phase 1 RPCs, against the Python worker.

Both serve the same stage of the same bundle as real processes on loopback; the Python client talks to
both. Describe must agree field by field (the fields naming the process aside), the descriptor JSON too
(address and uptime aside); health, Tokenize/Detokenize, OpenSession/CloseSession and their typed errors
must agree. The binary is $DGR_WORKER_BIN (Bazel), else dgr-worker beside the engine library; a missing
binary fails with how to build it.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from dgr.descriptor import Descriptor
from dgr.paths import env_path
from dgr.wire.gen import stage_pb2 as pb
from dgr.wire.gen import stage_pb2_grpc as pb_grpc
from support.engine import make_bundle, synth_model

READY = re.compile(r"serving on (\S+)")
# Describe fields that name the process, not the stage: a member's certificate, a native plane
PROCESS_FIELDS = {"member", "native_address", "native_steps", "native_forwards", "descriptor_json"}


@pytest.fixture(scope="module")
def worker_bin(engine_lib) -> Path:
    env = os.environ.get("DGR_WORKER_BIN")
    path = env_path(env).resolve() if env else Path(engine_lib).parent / "dgr-worker"   # Bazel: a runfiles path
    assert path.is_file() and os.access(path, os.X_OK), (
        f"no dgr-worker at {path}: build it with `dgr build-engine --lane cpu` (CMake puts it beside "
        f"libdgr_engine.so; it needs `apt-get install libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev "
        f"protobuf-compiler`), or `bazel build //worker/server:dgr-worker` and set DGR_WORKER_BIN")
    return path


class Proc:
    """A worker process (C++ or Python) serving one stage; its address once it says so."""

    def __init__(self, cmd: list[str]):
        self.cmd = cmd
        self.t0 = time.monotonic()
        self.p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.log: list[str] = []
        self.address = ""
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = self.p.stdout.readline()
            if not line:
                raise AssertionError(f"{cmd[0]} exited ({self.p.wait()}) before serving:\n{''.join(self.log)}")
            self.log.append(line)
            if m := READY.search(line):
                self.address = m.group(1)
                break
        assert self.address, f"{cmd} did not serve within 120 s:\n{''.join(self.log)}"
        self.ready_s = time.monotonic() - self.t0
        self.channel = grpc.insecure_channel(self.address)
        self.stub = pb_grpc.StageStub(self.channel)

    def rss_kib(self) -> int:
        for line in Path(f"/proc/{self.p.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        return 0

    def stop(self) -> str:
        self.channel.close()
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)
            try:
                self.p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()
        return "".join(self.log) + (self.p.stdout.read() or "")


def cpp(worker_bin: Path, bundle: Path, stage: int, *extra: str) -> Proc:
    return Proc([str(worker_bin), "--bundle", str(bundle), "--stage", str(stage), "--listen", "127.0.0.1:0", *extra])


def py(bundle: Path, stage: int, *extra: str) -> Proc:
    """The Python worker (`--python-worker`: `dgr worker serve --bundle` itself runs dgr-worker)."""
    return Proc([sys.executable, "-m", "dgr", "worker", "serve", "--python-worker", "--bundle", str(bundle),
                 "--stage", str(stage), "--listen", "127.0.0.1:0", *extra])


def fields(d: pb.StageDescription) -> dict:
    return {f.name: v for f, v in d.ListFields() if f.name not in PROCESS_FIELDS}


def descriptor(d: pb.StageDescription) -> dict:
    Descriptor.model_validate_json(d.descriptor_json)          # the model docs/schemas/descriptor.schema.json is
    j = json.loads(d.descriptor_json)
    j.pop("address")
    j["health"].pop("uptime_s")
    return j


def normalized(msg, *procs: Proc) -> str:
    """A message or reply as text with each worker's own address replaced (they differ by port only)."""
    text = str(msg)
    for i, p in enumerate(procs):
        text = text.replace(p.address, f"<worker {i}>")
    return text


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, engine_lib):
    d = tmp_path_factory.mktemp("cpp-worker")
    return make_bundle(synth_model(d, "llama", layers=4), [(0, 2), (2, 4)], d / "store").root


@pytest.fixture(scope="module")
def pair(tiny, worker_bin):
    """Stage 0 and stage 1 of the tiny bundle, each served by dgr-worker and by `dgr worker serve`."""
    procs = {}
    try:
        for kind, start in (("cpp", lambda s: cpp(worker_bin, tiny, s, "--max-sessions", "2")),
                            ("py", lambda s: py(tiny, s, "--max-sessions", "2"))):
            for stage in (0, 1):
                procs[kind, stage] = start(stage)
        yield procs
    finally:
        for p in procs.values():
            p.stop()


def test_describe_equals_the_python_worker(pair):
    for stage in (0, 1):
        c, p = pair["cpp", stage], pair["py", stage]
        dc = c.stub.Describe(pb.DescribeRequest(), timeout=10)
        dp = p.stub.Describe(pb.DescribeRequest(), timeout=10)
        assert fields(dc) == fields(dp), f"stage {stage}"
        assert descriptor(dc) == descriptor(dp), f"stage {stage}"
        assert json.loads(dc.descriptor_json)["address"] == c.address
        assert dc.identity.bundle_id and dc.identity.patch_series and json.loads(dc.descriptor_json)[
            "identity"]["engine_blake3"]


def test_health_serving(pair):
    for p in pair.values():
        h = health_pb2_grpc.HealthStub(p.channel)
        for service in ("", "dgr.v1.Stage"):
            r = h.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert r.status == health_pb2.HealthCheckResponse.SERVING, (p.cmd[0], service)


TEXTS = ["hello world", "", "The quick brown fox, 42 times!", "ünïcödé ✓ 日本語", "  spaces\tand\nlines  "]


def test_tokenize_detokenize_equal(pair):
    for stage in (0, 1):                         # every stage keeps the vocabulary
        c, p = pair["cpp", stage], pair["py", stage]
        for text in TEXTS:
            for special in (True, False):
                req = pb.TokenizeRequest(text=text, add_special=special)
                ids = c.stub.Tokenize(req, timeout=10).token_ids
                assert ids == p.stub.Tokenize(req, timeout=10).token_ids, (text, special)
                for cut in (list(ids), list(ids)[:-1], list(ids)[1:2]):
                    back = pb.DetokenizeRequest(token_ids=cut)
                    assert c.stub.Detokenize(back, timeout=10).text == p.stub.Detokenize(back, timeout=10).text


def route(procs: list[Proc], descs: list[pb.StageDescription]) -> list[pb.Hop]:
    return [pb.Hop(address=p.address, bundle_id=d.identity.bundle_id, stage_index=d.identity.stage_index,
                   layer_begin=d.identity.layer_begin, layer_end=d.identity.layer_end) for p, d in zip(procs, descs)]


def open_reply(head: Proc, hops: list[pb.Hop], sid: str, epoch: int, **kw) -> pb.OpenSessionReply:
    return head.stub.OpenSession(pb.OpenSessionRequest(session_id=sid, epoch=epoch, route=hops, **kw), timeout=30)


def test_open_close_and_their_errors_equal(pair):
    results = {}
    for kind in ("cpp", "py"):
        s0, s1 = pair[kind, 0], pair[kind, 1]
        descs = [s.stub.Describe(pb.DescribeRequest(), timeout=10) for s in (s0, s1)]
        good = route([s0, s1], descs)
        out = []
        ok = open_reply(s0, good, "a", 1)
        assert not ok.HasField("error"), ok.error
        out.append([fields(h) for h in ok.hops])
        assert s0.stub.Describe(pb.DescribeRequest()).open_sessions == 1
        assert s1.stub.Describe(pb.DescribeRequest()).open_sessions == 1
        out.append(open_reply(s0, good, "a", 1).error)                    # STALE_EPOCH: already open
        out.append(open_reply(s0, good, "b", 1).error.code)              # a second session fits
        e = open_reply(s0, good, "c", 1).error                            # OVERLOADED: max_sessions 2
        assert 250_000 < e.retry_after_ms <= 300_000       # the oldest idle session's reaping (--session-ttl 300)
        e.retry_after_ms = 1                                # (a clock reading: not compared)
        out.append(e)
        out.append(open_reply(s0, good, "a", 2).error)                    # a newer epoch replaces the old
        out.append(open_reply(s0, good, "a", 1).error)                    # STALE_EPOCH: older than the latest
        wrong = [pb.Hop(**{**{f.name: v for f, v in h.ListFields()}}) for h in good]
        wrong[0].stage_index = 1
        out.append(open_reply(s0, wrong, "w", 1).error)                   # WRONG_STAGE
        wrong = route([s0, s1], descs)
        wrong[0].layer_end = 3
        out.append(open_reply(s0, wrong, "r", 1).error)                   # WRONG_RANGE
        out.append(open_reply(s0, good, "h", 1, hop_index=5).error)       # BAD_FRAME: outside the route
        out.append(open_reply(s0, good[:1], "f", 1).error)                # WRONG_STAGE: stage 0 as the last hop
        bad_up = pb.StageDescription()
        bad_up.CopyFrom(descs[0])
        bad_up.schema_out.n_embd = 32
        out.append(open_reply(s1, good, "s", 1, hop_index=1, upstream=bad_up).error)   # SCHEMA_MISMATCH
        bad_up.CopyFrom(descs[0])
        bad_up.schema_out.layer = 3
        out.append(open_reply(s1, good, "l", 1, hop_index=1, upstream=bad_up).error)   # WRONG_RANGE at the seam
        out.append(s0.stub.CloseSession(pb.CloseSessionRequest(session_id="b", epoch=1, chain=True), timeout=10))
        with socket.socket() as sk:                                      # a port nobody serves
            sk.bind(("127.0.0.1", 0))
            dead = f"127.0.0.1:{sk.getsockname()[1]}"
        gone = route([s0, s1], descs)
        gone[1].address = dead
        e = open_reply(s0, gone, "u", 1).error                            # HOP_UNREACHABLE
        out.append(normalized(e, s0, s1).replace(dead, "<dead>"))
        assert s0.stub.Describe(pb.DescribeRequest()).open_sessions == 1   # a (u was closed again)
        out.append(s0.stub.CloseSession(pb.CloseSessionRequest(session_id="a", epoch=2, chain=True), timeout=10))
        out.append([s.stub.Describe(pb.DescribeRequest()).open_sessions for s in (s0, s1)])
        out.append(json.loads(s0.stub.Describe(pb.DescribeRequest()).descriptor_json)["health"]["errors"])
        results[kind] = [normalized(x, s0, s1) for x in out]
    for k, (a, b) in enumerate(zip(results["cpp"], results["py"])):
        assert a == b, f"step {k}:\ndgr-worker: {a}\npython:     {b}"
    assert "STALE_EPOCH" in results["cpp"][1] and "OVERLOADED" in results["cpp"][3]
    assert "SCHEMA_MISMATCH" in results["cpp"][10] and "HOP_UNREACHABLE" in results["cpp"][13]
    assert results["cpp"][-2] == "[0, 0]"


def test_frames_refusals_equal_the_python_worker(pair):
    """Frames is served (phase 2: tests/test_worker_cpp_frames.py); its typed refusals match the Python worker's."""
    frames = [pb.Frame(session_id="x", epoch=1),
              pb.Frame(session_id="x", epoch=1, step=pb.Step(positions=[0], token_ids=[1]))]
    results = {}
    for kind in ("cpp", "py"):
        p = pair[kind, 0]
        results[kind] = [(r.error.code, normalized(r.error.message, p))
                         for r in p.stub.Frames(iter(frames), timeout=10)]
    assert results["cpp"] == results["py"]
    assert [c for c, _ in results["cpp"]] == [pb.UNKNOWN_SESSION, pb.UNKNOWN_SESSION]


def one_line_error(cmd: list[str]) -> tuple[int, str]:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1, r.stderr
    return r.returncode, lines[0]


def test_bad_flags_and_inputs_are_one_clear_line(worker_bin, tiny, tmp_path):
    w = str(worker_bin)
    rc, line = one_line_error([w, "--bundle", str(tiny), "--stage", "0", "--no-such-flag"])
    assert rc == 2 and "unrecognized argument: --no-such-flag" in line
    rc, line = one_line_error([w, "--bundle", str(tiny)])
    assert rc == 2 and "--stage" in line
    rc, line = one_line_error([w, "--bundle", str(tiny), "--stage", "x"])
    assert rc == 2 and "invalid int value: 'x'" in line
    rc, line = one_line_error([w, "--bundle", str(tiny), "--stage", "2"])
    assert rc == 1 and "has 2 stages (0..1); there is no stage 2" in line
    rc, line = one_line_error([w, "--bundle", str(tmp_path / "none"), "--stage", "0"])
    assert rc == 1 and "cannot read the bundle manifest" in line
    rc, line = one_line_error([w, "--bundle", str(tiny), "--stage", "0", "--listen", "0.0.0.0:0"])
    assert rc == 1 and "refusing to listen on 0.0.0.0:0 without TLS" in line
    rc, line = one_line_error([w, "--bundle", str(tiny), "--stage", "0", "--wire-dtype", "f8"])
    assert rc == 1 and "unknown wire dtype 'f8'" in line
    rc, line = one_line_error([w, "--bundle", str(tiny), "--stage", "0", "--tls-cert", "x.pem"])
    assert rc == 1 and "give both --tls-cert and --tls-key" in line
    rc, line = one_line_error([w, "--bundle", str(tiny), "--stage", "0", "--tls-ca", "ca.pem"])
    assert rc == 1 and "--tls-ca needs --tls-cert and --tls-key" in line
    rc, line = one_line_error([w, "--bundle", str(tiny), "--stage", "0", "--tls-cert", str(tmp_path / "c.pem"),
                               "--tls-key", str(tmp_path / "k.pem")])
    assert rc == 1 and "c.pem: no such file (make one with `dgr certs init` / `dgr certs issue`)" in line
    rc, line = one_line_error([w, "--bundle", str(tiny), "--stage", "0", "--listen", "0.0.0.0:0", "--insecure", "--advertise", "0.0.0.0"])
    assert rc == 1 and "--advertise 0.0.0.0: give the HOST[:PORT]" in line
    rc, line = one_line_error([w, "--bundle", str(tiny), "--stage", "0", "--send-timeout", "0"])
    assert rc == 1 and "--send-timeout must be more than 0" in line
    rc, line = one_line_error([w, "--bundle", str(tiny), "--stage", "0", "--lane", "vulkan"])
    assert rc == 1 and "built for the cpu lane" in line
    with socket.socket() as sk:                  # a port in use
        sk.bind(("127.0.0.1", 0))
        sk.listen()
        rc, line = one_line_error([w, "--bundle", str(tiny), "--stage", "0", "--listen",
                                   f"127.0.0.1:{sk.getsockname()[1]}"])
    assert rc == 1 and "cannot listen on" in line
    env = {**os.environ, "DGR_ENGINE_LIB": str(tmp_path / "libnone.so")}
    r = subprocess.run([w, "--bundle", str(tiny), "--stage", "0"], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 1 and "no engine library at" in r.stderr and r.stderr.count("\n") == 1


def test_sigterm_drains_and_exits(worker_bin, tiny):
    c = cpp(worker_bin, tiny, 0)
    c.p.send_signal(signal.SIGTERM)
    assert c.p.wait(timeout=30) == 0
    assert "drained and stopped" in c.p.stdout.read()


def test_dgr_worker_serve_runs_dgr_worker_with_its_flags(worker_bin, tiny, tmp_path, monkeypatch):
    """`dgr worker serve --bundle` is the front end: it checks the bundle and becomes dgr-worker (the same
    process), every flag passed on; what it refuses it refuses before, in one line."""
    monkeypatch.setenv("DGR_WORKER_BIN", str(worker_bin))
    env = dict(os.environ)
    p = Proc([sys.executable, "-m", "dgr", "worker", "serve", "--bundle", str(tiny), "--stage", "1",
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
    bad = subprocess.run([sys.executable, "-m", "dgr", "worker", "serve", "--bundle", str(tiny), "--stage", "5"],
                         capture_output=True, text=True, env=env, timeout=60)
    assert bad.returncode != 0 and "there is no stage 5" in bad.stderr
    missing = {**env, "DGR_WORKER_BIN": str(tmp_path / "nothing")}
    bad = subprocess.run([sys.executable, "-m", "dgr", "worker", "serve", "--bundle", str(tiny), "--stage", "0"],
                         capture_output=True, text=True, env=missing, timeout=60)
    assert bad.returncode != 0 and "not an executable file" in bad.stderr


def test_smollm2_stage0_equal_and_measured(smollm2_gguf, engine_lib, worker_bin, tmp_path):
    """A real model: SmolLM2's stage 0 (chat template, eog ids, its tokenizer) served by both; start-to-
    SERVING and RSS of both are printed (measured, not asserted: no speed thresholds here)."""
    bundle = make_bundle(smollm2_gguf, [(0, 15), (15, 30)], tmp_path / "store", name="smollm2").root
    c = cpp(worker_bin, bundle, 0, "--threads", "1")
    try:
        p = py(bundle, 0, "--threads", "1")
        try:
            dc, dp = (x.stub.Describe(pb.DescribeRequest(), timeout=30) for x in (c, p))
            assert fields(dc) == fields(dp)
            assert descriptor(dc) == descriptor(dp)
            assert "im_start" in dc.chat_template and len(dc.eos_token_ids) >= 1
            for text in TEXTS + ["<|im_start|>user\nHi!<|im_end|>\n"]:
                for special in (True, False):
                    req = pb.TokenizeRequest(text=text, add_special=special)
                    ids = c.stub.Tokenize(req, timeout=10).token_ids
                    assert ids == p.stub.Tokenize(req, timeout=10).token_ids
                    for cut in (list(ids), list(ids)[:-1], list(ids)[-1:]):
                        back = pb.DetokenizeRequest(token_ids=cut)
                        assert c.stub.Detokenize(back).text == p.stub.Detokenize(back).text
            print(f"\nSmolLM2 stage 0: start to serving dgr-worker {c.ready_s:.2f} s, python {p.ready_s:.2f} s; "
                  f"RSS dgr-worker {c.rss_kib() / 1024:.0f} MiB, python {p.rss_kib() / 1024:.0f} MiB")
        finally:
            p.stop()
    finally:
        c.stop()
