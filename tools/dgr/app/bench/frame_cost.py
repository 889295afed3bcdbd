"""`dgr bench frames`: gRPC streaming against hand-framed TCP and TLS, per hop, side by side in one run.

Issue 21 allows a hand-framed decode path beside gRPC only as "a decision measured in one run (gRPC C++
streaming against the frames, per hop, with and without TLS)". This is that run (docs/wire.md, "gRPC or
hand-framed frames"). Each round measures, one after the other so all see the same machine load:

- `grpc_plain`, `grpc_tls`: two routes of fake-model `dgr-worker` processes (the real worker, every check and
  bound; the fake engine's forward is a fixed amount of work), plaintext and mutual TLS; a greedy generation on
  each, its per-hop overhead (ring time minus compute, per boundary: `dgr.runtime.wire.stats.hop_overhead_ms`).
- `frames_tcp`, `frames_tls`: `dgr-hop-probe` (worker/tools/hop_probe.cpp), the same number of processes in a
  ring passing a frame of the route's boundary size, each spinning for the route's measured compute per stage
  before sending on, over hand-framed TCP and over mutual TLS 1.3; the reader thread runs the "forward" (one
  wake-up per hop, as the retired native plane did). Its per hop is the median one-way time of a frame.
- `frames_tcp_handoff`, `frames_tls_handoff`: the same with the reader handing each frame to a second thread
  (two wake-ups per hop, as a worker with one engine thread for batching has).

The probe carries no sessions, checks or bounds: its figures are what a hand-framed path could reach at best
on this machine, not what one would measure once it had everything gRPC has.

Each round also takes the loopback floor (`dgr.app.bench.loopback_floor`, as `dgr bench` does): one bare 8-byte
TCP message between two processes after an idle gap as long as the gRPC route's median ring time, which is how long a
decode hop's receiver has slept. `layers_per_stage` sets how much each stage computes (the fake engine's work
grows with its layers; the boundary stays `4 * embd` bytes): 2 by default, about 14 for SmolLM2's timing on a
2-vCPU machine, where a stage computes 4-5 ms and its receiver sleeps about twice that.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from dgr.app.bench.loopback_floor import MESSAGES_PER_ROUND, one_way_ms
from dgr.app.certs import init, issue
from dgr.app.local import FakeRoute
from dgr.core.errors import DgrError
from dgr.core.log import get_logger
from dgr.runtime.wire.client import RouteClient
from dgr.runtime.wire.stats import breakdown, decode_events, hop_overhead_ms
from dgr.runtime.wire.tls import TlsConfig
from dgr.toolchain.enginebuild import ensure_tool

log = get_logger(__name__)

PROBE = "dgr-hop-probe"
KINDS = ("grpc_plain", "grpc_tls", "frames_tcp", "frames_tls", "frames_tcp_handoff", "frames_tls_handoff")


@dataclass
class FrameCost:
    stages: int
    rounds: int
    tokens: int
    spec: str
    boundary_bytes: int
    compute_us: int
    per_hop_ms: dict[str, float]                     # kind -> median over rounds
    per_round: dict[str, list[float]] = field(default_factory=dict)
    layers_per_stage: int = 2
    floor: dict[str, float] = field(default_factory=dict)   # gap_ms, one_way_ms, one_way_p90_ms (medians over rounds)

    def as_dict(self) -> dict:
        return asdict(self)

    def table(self) -> str:
        names = {"grpc_plain": "gRPC (dgr-worker), plaintext", "grpc_tls": "gRPC (dgr-worker), mutual TLS",
                 "frames_tcp": "frames, TCP, reader runs", "frames_tls": "frames, TLS, reader runs",
                 "frames_tcp_handoff": "frames, TCP, handed off", "frames_tls_handoff": "frames, TLS, handed off"}
        lines = [f"{'per hop, ms (median over rounds)':40}{'median':>9}   rounds"]
        for k in KINDS:
            lines.append(f"{names[k]:40}{self.per_hop_ms[k]:9.3f}   " + " ".join(f"{x:.3f}" for x in self.per_round[k]))
        if self.floor:
            lines.append(f"{'loopback floor (bare 8 bytes, no TLS)':40}{self.floor['one_way_ms']:9.3f}   "
                         f"after {self.floor['gap_ms']:.1f} ms idle (p90 {self.floor['one_way_p90_ms']:.3f})")
        lines.append(f"{self.stages} stages, {self.boundary_bytes} boundary bytes, {self.compute_us} us compute per "
                     f"stage ({self.layers_per_stage} fake layers), {self.rounds} rounds of {self.tokens} tokens "
                     f"(fake route: {self.spec})")
        return "\n".join(lines)


def run_probe(exe: Path, *, transport: str, stages: int, nbytes: int, compute_us: int, rounds: int,
              handoff: bool = False, certs: tuple[Path, Path, Path] | None = None) -> dict:
    """One `dgr-hop-probe` run; its JSON report."""
    cmd = [str(exe), "--transport", transport, "--stages", str(stages), "--bytes", str(nbytes), "--rounds", str(rounds),
           "--gap-us", "0", "--compute-us", str(compute_us)]
    if handoff:
        cmd.append("--handoff")
    if transport == "tls":
        assert certs is not None
        cmd += ["--cert", str(certs[0]), "--key", str(certs[1]), "--ca", str(certs[2])]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        raise DgrError(f"{PROBE} failed (exit {out.returncode}): {out.stderr.strip()[-2000:]}")
    return json.loads(out.stdout)


def measure(*, stages: int = 3, tokens: int = 64, rounds: int = 3, embd: int = 576, layers_per_stage: int = 2) -> FrameCost:
    """Every kind of KINDS, `rounds` times, alternating, and the loopback floor; see the module's text."""
    if stages < 2:
        raise DgrError("dgr bench frames needs at least 2 stages")
    if not 1 <= layers_per_stage <= 64:
        raise DgrError(f"dgr bench frames: --layers-per-stage is 1..64, got {layers_per_stage}")
    exe = ensure_tool(PROBE)
    n = layers_per_stage
    spec = f"layers={n * stages},embd={embd},cuts=" + ":".join(str(n * i) for i in range(1, stages))
    nbytes = 4 * embd                                # the f32 boundary of one decode position
    certs = Path(tempfile.mkdtemp(prefix="dgr-frames-bench-"))
    init(certs)
    for i in range(stages):
        issue(certs, f"stage{i}", ["127.0.0.1"])
    issue(certs, "client", ["127.0.0.1"])
    ca = certs / "ca.pem"

    def tls_args(i: int, _k: int) -> list[str]:
        return ["--tls-cert", str(certs / f"stage{i}.pem"), "--tls-key", str(certs / f"stage{i}.key"), "--tls-ca", str(ca)]

    per: dict[str, list[float]] = {k: [] for k in KINDS}
    compute: list[float] = []
    floors: list[dict] = []
    prompt = [1, 2, 3, 4, 5]
    with FakeRoute.of(spec) as plain, FakeRoute.of(spec, extra=tls_args) as secure, \
            RouteClient(plain.addresses, prefix_cache=False) as pc, \
            RouteClient(secure.addresses, tls=TlsConfig(certs / "client.pem", certs / "client.key", ca),
                        prefix_cache=False) as tc:
        for c in (pc, tc):
            c.run(prompt, max_new_tokens=8)          # warm both routes before measuring
        for r in range(rounds):
            for kind, c in (("grpc_plain", pc), ("grpc_tls", tc)):
                gen = c.run(prompt, max_new_tokens=tokens)
                per[kind].append(hop_overhead_ms(gen, stages))
                if kind == "grpc_plain":
                    compute.append(statistics.mean(row["compute"] for row in breakdown(gen) if row["stage"] >= 0))
                    ring_ms = statistics.median(e.ring_ns / 1e6 for e in decode_events(gen))
            compute_us = int(round(statistics.median(compute) * 1000))
            for kind, transport, handoff in (("frames_tcp", "tcp", False), ("frames_tls", "tls", False),
                                             ("frames_tcp_handoff", "tcp", True), ("frames_tls_handoff", "tls", True)):
                rep = run_probe(exe, transport=transport, stages=stages, nbytes=nbytes, compute_us=compute_us,
                                rounds=tokens, handoff=handoff,
                                certs=(certs / "stage0.pem", certs / "stage0.key", ca))
                per[kind].append(rep["one_way_ms"])
            floors.append(one_way_ms(ring_ms, MESSAGES_PER_ROUND))
            log.info("bench frames: round %d/%d: %s", r + 1, rounds,
                     ", ".join(f"{k} {v[-1]:.3f}" for k, v in per.items()) + f", floor {floors[-1]['one_way_ms']:.3f}")
    return FrameCost(stages=stages, rounds=rounds, tokens=tokens, spec=spec, boundary_bytes=nbytes,
                     compute_us=compute_us,
                     per_hop_ms={k: statistics.median(v) for k, v in per.items()}, per_round=per,
                     layers_per_stage=n,
                     floor={k: statistics.median(f[k] for f in floors) for k in ("gap_ms", "one_way_ms", "one_way_p90_ms")})
