"""`dgr bench tls`: what mutual TLS costs per hop, measured side by side with plaintext in one run.

Two routes of the same bundle run at once on loopback, one plaintext and one with mutual TLS (a CA and
member certificates made for the run); generations alternate between them round by round, so both see
the same machine load. The figure is the per-hop overhead (ring time minus compute, per boundary,
median over decode tokens) of each, and their difference.
"""

from __future__ import annotations

import statistics
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from dgr.app.certs import init, issue
from dgr.app.demo import ensure_bundle
from dgr.app.local import LocalRoute, engine_library
from dgr.core.log import get_logger
from dgr.runtime.wire.client import RouteClient
from dgr.runtime.wire.stats import hop_overhead_ms
from dgr.runtime.wire.tls import TlsConfig

log = get_logger(__name__)

PROMPT = "The capital of France is"


@dataclass
class TlsCost:
    stages: int
    rounds: int
    tokens: int
    plaintext_per_hop_ms: float
    tls_per_hop_ms: float
    tls_cost_per_hop_ms: float
    plaintext_decode_tok_s: float
    tls_decode_tok_s: float
    same_text: bool

    def as_dict(self) -> dict:
        return asdict(self)

    def table(self) -> str:
        return "\n".join([
            f"{'':22}{'plaintext':>12}{'mutual TLS':>12}",
            f"{'per-hop overhead ms':22}{self.plaintext_per_hop_ms:12.3f}{self.tls_per_hop_ms:12.3f}",
            f"{'decode tok/s':22}{self.plaintext_decode_tok_s:12.1f}{self.tls_decode_tok_s:12.1f}",
            f"TLS costs {self.tls_cost_per_hop_ms:+.3f} ms per hop ({self.stages} stages, {self.rounds} rounds of "
            f"{self.tokens} tokens each, alternating); same text: {'yes' if self.same_text else 'NO'}",
        ])


def measure(*, stages: int = 3, tokens: int = 48, rounds: int = 3, threads: int = 1, bundle=None) -> TlsCost:
    """`bundle` (a dgr.toolchain.bundle.Bundle, or None: the embedded SmolLM2 of `stages`) served twice, plaintext and
    mutual TLS, generations alternating."""
    lib = engine_library()
    if bundle is None:
        bundle, _ = ensure_bundle(stages)
    stages = len(bundle.manifest.stages)
    certs = Path(tempfile.mkdtemp(prefix="dgr-tls-bench-"))
    init(certs)
    for i in range(stages):
        issue(certs, f"stage{i}", ["127.0.0.1"])
    issue(certs, "client", ["127.0.0.1"])
    ca = str(certs / "ca.pem")

    def tls_args(i: int, _k: int) -> list[str]:
        return ["--tls-cert", str(certs / f"stage{i}.pem"), "--tls-key", str(certs / f"stage{i}.key"), "--tls-ca", ca]

    args = [["--bundle", str(bundle.root), "--stage", str(i), "--threads", str(threads)] for i in range(stages)]
    env = {"DGR_ENGINE_LIB": str(lib)}
    client_tls = TlsConfig(certs / "client.pem", certs / "client.key", Path(ca))
    hops: dict[str, list[float]] = {"plain": [], "tls": []}
    rates: dict[str, list[float]] = {"plain": [], "tls": []}
    texts: dict[str, set[str]] = {"plain": set(), "tls": set()}
    with LocalRoute(args, env=env) as plain, LocalRoute(args, env=env, extra=tls_args) as secure, \
            RouteClient(plain.addresses, prefix_cache=False) as pc, \
                RouteClient(secure.addresses, tls=client_tls, prefix_cache=False) as tc:
        for kind, c in (("plain", pc), ("tls", tc)):
            c.run(PROMPT, max_new_tokens=4)                     # warm both before measuring
        for r in range(rounds):
            for kind, c in (("plain", pc), ("tls", tc)):
                gen = c.run(PROMPT, max_new_tokens=tokens)
                hops[kind].append(hop_overhead_ms(gen, stages))
                rates[kind].append(gen.decode_tokens_per_s)
                texts[kind].add(gen.text)
                log.info("bench tls: round %d/%d %s: %.3f ms per hop, %.1f tok/s", r + 1, rounds, kind,
                         hops[kind][-1], rates[kind][-1])
    med = {k: statistics.median(v) for k, v in hops.items()}
    rate = {k: statistics.median(v) for k, v in rates.items()}
    return TlsCost(stages=stages, rounds=rounds, tokens=tokens, plaintext_per_hop_ms=med["plain"],
                   tls_per_hop_ms=med["tls"], tls_cost_per_hop_ms=med["tls"] - med["plain"],
                   plaintext_decode_tok_s=rate["plain"], tls_decode_tok_s=rate["tls"],
                   same_text=len(texts["plain"] | texts["tls"]) == 1)
