"""Hostile members for `dgr bench soak --hostile N` (docs/security.md): each holds a certificate of the
route's CA and attacks the route in a loop while honest members generate beside it.

The attacks are those `tests/worker/test_worker_hostile.py` proves one by one, repeated: a close that names the
block hashes of an honest prompt over the attacker's own text (prefix-cache poisoning), sessions held up to
the per-member bound, a grammar nested 20,000 deep, next hops at ports nobody serves and at a `unix:`
socket, forged tokens into stage 0 for ids it guesses, and a burst of bare TCP connections. What each attack
got back is counted by outcome; an outcome that is not a refusal is a `breach` (none is expected).
"""

from __future__ import annotations

import itertools
import queue
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence

import grpc

from dgr.runtime.wire import tls as wtls
from dgr.runtime.wire.gen import stage_pb2 as pb, stage_pb2_grpc as pb_grpc
from dgr.runtime.wire.prefix import PREFIX_BLOCK_TOKENS, block_hashes

DEEP_GRAMMAR = "root ::= " + "(" * 20000 + '"a"' + ")" * 20000
ATTACKS = ("poison", "hog", "grammar", "scan", "forge", "flood")


class Member:
    """One hostile member: its channels to every stage, its own namespace of session ids."""

    def __init__(self, name: str, addresses: Sequence[str], tls: wtls.TlsConfig, victim_ids: Sequence[int]):
        self.name, self.addresses, self.tls = name, list(addresses), tls
        self.channels = [wtls.channel(a, tls) for a in self.addresses]
        self.stubs = [pb_grpc.StageStub(c) for c in self.channels]
        self.descs = [s.Describe(pb.DescribeRequest(), timeout=30) for s in self.stubs]
        self.victim_ids = list(victim_ids)
        self.ids = itertools.count()
        self.outcomes: Counter[str] = Counter()

    def hops(self) -> list[pb.Hop]:
        return [pb.Hop(address=a, bundle_id=d.identity.bundle_id, stage_index=d.identity.stage_index,
                       layer_begin=d.identity.layer_begin, layer_end=d.identity.layer_end)
                for a, d in zip(self.addresses, self.descs)]

    def close(self) -> None:
        for c in self.channels:
            c.close()

    def _sid(self, kind: str) -> str:
        return f"{self.name}-{kind}-{next(self.ids)}"

    def _open(self, sid: str, hops=None, **kw) -> pb.OpenSessionReply:
        return self.stubs[0].OpenSession(pb.OpenSessionRequest(session_id=sid, epoch=1, route=hops or self.hops(), **kw),
                                         timeout=30)

    def _closed(self, sid: str, **kw) -> None:
        self.stubs[0].CloseSession(pb.CloseSessionRequest(session_id=sid, epoch=1, chain=True, **kw), timeout=30)

    def _note(self, attack: str, outcome: str) -> None:
        self.outcomes[f"{attack}: {outcome}"] += 1

    # --- the attacks ---------------------------------------------------------------------------------

    def poison(self) -> None:
        """Run its own text, then close naming the block hashes of an honest prompt."""
        sid = self._sid("poison")
        if self._open(sid).HasField("error"):
            return self._note("poison", "refused at open")
        mine = [(7 * k + 3) % 50 + 1 for k in range(max(len(self.victim_ids), 2 * PREFIX_BLOCK_TOKENS + 1))]
        q: queue.Queue = queue.Queue()
        call = self.stubs[0].Frames(iter(q.get, None))
        q.put(pb.Frame(session_id=sid, epoch=1, step=pb.Step(positions=range(len(mine)), token_ids=mine,
                                                             cache_expect=0, sample=True)))
        try:
            first = next(call)
            outcome = "ran its own text" if first.HasField("token") else "step refused"
        except (grpc.RpcError, StopIteration):
            outcome = "stream failed"
        q.put(None)
        call.cancel()
        self._closed(sid, prefix_blocks=block_hashes(self.victim_ids), prefix_block_tokens=PREFIX_BLOCK_TOKENS)
        self._note("poison", outcome + ", closed naming the victim's blocks")

    def hog(self) -> None:
        """Open sessions until refused, then close them."""
        held = []
        for _ in range(64):
            sid = self._sid("hog")
            r = self._open(sid)
            if r.HasField("error"):
                self._note("hog", f"refused after {len(held)} ({pb.ErrorCode.Name(r.error.code)})")
                break
            held.append(sid)
        else:
            self._note("hog", "breach: 64 sessions held")
        for sid in held:
            self._closed(sid)

    def grammar(self) -> None:
        r = self._open(self._sid("grammar"), sampling=pb.Sampling(grammar=DEEP_GRAMMAR))
        self._note("grammar", pb.ErrorCode.Name(r.error.code) if r.HasField("error") else "breach: accepted")

    def scan(self) -> None:
        hops = self.hops()
        with socket.socket() as sk:                   # a port nobody serves
            sk.bind(("127.0.0.1", 0))
            dead = f"127.0.0.1:{sk.getsockname()[1]}"
        for address in (dead, "unix:/run/dgr-hostile.sock"):
            hops[1].address = address
            r = self._open(self._sid("scan"), hops=hops)
            self._note("scan", pb.ErrorCode.Name(r.error.code) if r.HasField("error") else "breach: opened")

    def forge(self) -> None:
        q: queue.Queue = queue.Queue()
        call = self.stubs[0].Frames(iter(q.get, None))
        guesses = [f"client-{k}/s" for k in range(4)] + [f"soak-{k}" for k in range(4)]
        for g in guesses:
            q.put(pb.Frame(session_id=g, epoch=1, token=pb.Token(token_id=1, position=1)))
        try:
            for _ in guesses:
                f = next(call)
                self._note("forge", pb.ErrorCode.Name(f.error.code) if f.HasField("error") else "breach: taken")
        except (grpc.RpcError, StopIteration):
            self._note("forge", "stream failed")
        q.put(None)
        call.cancel()

    def flood(self) -> None:
        host, port = self.addresses[1].rsplit(":", 1)
        socks = []
        try:
            for _ in range(50):
                socks.append(socket.create_connection((host, int(port)), timeout=10))
            self._note("flood", "50 bare connections held, then closed")
        except OSError as err:
            self._note("flood", f"connect failed ({type(err).__name__})")
        finally:
            for s in socks:
                s.close()

    def run(self, deadline: float, stop: Callable[[], bool] = lambda: False) -> None:
        for attack in itertools.cycle(ATTACKS):
            if time.monotonic() >= deadline or stop():
                return
            try:
                getattr(self, attack)()
            except grpc.RpcError as err:
                self._note(attack, f"rpc {err.code().name}")


def probe_listeners(addresses: Sequence[str], tls: wtls.TlsConfig, deadline: float, out: Counter,
                    every: float = 0.5) -> None:
    """A new connection to every stage, Describe over it, every `every` s until `deadline`: counts
    `probes` and `probe_failures` (a listener that stopped accepting, or a worker too busy to answer)."""
    while time.monotonic() < deadline:
        for a in addresses:
            ch = wtls.channel(a, tls)
            try:
                pb_grpc.StageStub(ch).Describe(pb.DescribeRequest(), timeout=10)
                out["probes"] += 1
            except grpc.RpcError:
                out["probe_failures"] += 1
            finally:
                ch.close()
        time.sleep(every)


def start(members: Sequence[Member], addresses: Sequence[str], prober_tls: wtls.TlsConfig,
          deadline: float) -> tuple[list[threading.Thread], Counter]:
    probes: Counter = Counter()
    threads = [threading.Thread(target=m.run, args=(deadline,), name=f"hostile-{m.name}", daemon=True) for m in members]
    threads.append(threading.Thread(target=probe_listeners, args=(addresses, prober_tls, deadline, probes),
                                    name="listener-probe", daemon=True))
    for t in threads:
        t.start()
    return threads, probes


__all__ = ["ATTACKS", "Member", "probe_listeners", "start"]
