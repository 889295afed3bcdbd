"""`dgr bench conversation`: what the prefix cache buys a chat, measured side by side in one run.

Two sets of worker processes serve the same bundle: one with the prefix cache (the default
`--prefix-cache-mib`), one without (`--prefix-cache-mib 0`), each behind its own gateway (`dgr serve`'s app,
in this process). A conversation of `turns` turns goes through both gateways turn by turn, alternating which
goes first, with the official `openai` client streaming each answer: time to first token per turn, and the
answers must be identical. The same conversation runs on loopback, then through emulated WAN links in front
of every stage (dgr.app.bench.wan_link, `rtt_ms` round trip per hop).

Then, on a third set whose cache holds only part of what `conversations` conversations leave, they run
interleaved (one turn of each in turn): the workers' own counters give the hit rate (sessions that restored
a prefix / sessions that looked) and the share of prompt tokens restored. The memory a cache holds per
1,000 tokens per stage comes from the same workers (bytes kept for one session of known length).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass, field

from dgr.app.bench.wan_link import WanLinks
from dgr.app.demo import ensure_bundle
from dgr.app.gateway.app import create_app
from dgr.app.gateway.chat import render
from dgr.app.gateway.route import RouteBackend
from dgr.app.gateway.server import GatewayServer
from dgr.app.local import LocalRoute, engine_library
from dgr.core.errors import WireError
from dgr.core.log import get_logger
from dgr.runtime.wire.client import RouteClient
from dgr.runtime.wire.gen import stage_pb2 as pb

log = get_logger(__name__)

SYSTEM = ("You are a patient tutor. Answer in one or two short sentences, plainly, and say so when you are not "
          "sure. Keep to the question and do not repeat it.")
QUESTIONS = [
    "What is a river delta?", "Why do rivers bend?", "What is an oxbow lake?", "How old is the Nile?",
    "Which river carries the most water?", "What is a watershed?", "Why is sea water salty?",
    "What makes a waterfall?", "How are canyons made?", "What is the longest river in Europe?",
    "What is a tributary?", "Where do rivers begin?",
]


@dataclass
class Turn:
    ttft_ms: dict[str, float]                 # arm ("cache", "none") -> time to first token
    answer: str
    same: bool


@dataclass
class Report:
    stages: int
    turns: int
    rtt_ms: float
    loopback: list[Turn] = field(default_factory=list)
    wan: list[Turn] = field(default_factory=list)
    bytes_per_1000_tokens: list[float] = field(default_factory=list)   # per stage
    hit_rate: dict = field(default_factory=dict)

    def ratio(self, net: str) -> float:
        last = getattr(self, net)[-1].ttft_ms
        return last["cache"] / last["none"] if last["none"] else 0.0

    def as_dict(self) -> dict:
        def turns(ts):
            return [{"turn": i + 1, "ttft_cache_ms": t.ttft_ms["cache"], "ttft_none_ms": t.ttft_ms["none"],
                     "same_text": t.same} for i, t in enumerate(ts)]
        return {"stages": self.stages, "turns": self.turns, "rtt_ms": self.rtt_ms,
                "loopback": turns(self.loopback), "wan": turns(self.wan),
                "last_turn_ttft_ratio_loopback": self.ratio("loopback"), "last_turn_ttft_ratio_wan": self.ratio("wan"),
                "same_text": all(t.same for t in self.loopback + self.wan),
                "cache_bytes_per_1000_tokens_per_stage": self.bytes_per_1000_tokens, "interleaved": self.hit_rate}

    def table(self) -> str:
        lines = [f"conversation: {self.turns} turns, {self.stages} stages, time to first token (ms) with and "
                 "without the prefix cache"]
        for net in ("loopback", "wan"):
            ts = getattr(self, net)
            if not ts:
                continue
            label = "loopback" if net == "loopback" else f"WAN {self.rtt_ms:g} ms RTT"
            lines.append(f"  {label}: " + "  ".join(f"{i + 1}:{t.ttft_ms['cache']:.0f}/{t.ttft_ms['none']:.0f}"
                                                   for i, t in enumerate(ts)))
            lines.append(f"    turn {len(ts)}: {self.ratio(net):.3f}x of the uncached time; same text every turn: "
                         f"{'yes' if all(t.same for t in ts) else 'NO'}")
        if self.bytes_per_1000_tokens:
            lines.append("  cache per 1,000 tokens per stage: " +
                         ", ".join(f"{b / 2**20:.2f} MiB" for b in self.bytes_per_1000_tokens))
        h = self.hit_rate
        if h:
            lines.append(f"  {h['conversations']} interleaved conversations, cache {h['cache_mib']} MiB per stage "
                         f"(about {h['fits_conversations']:.1f} of their histories): hit rate {h['hit_rate']:.2f}, "
                         f"prompt tokens restored {h['token_share']:.2f}")
        return "\n".join(lines)


def _route(bundle, stages: int, threads: int, *flags: str):
    return LocalRoute([["--bundle", str(bundle.root), "--stage", str(i), "--threads", str(threads),
                        "--n-ctx", "2048", *flags] for i in range(stages)],
                      env={"DGR_ENGINE_LIB": str(engine_library())}, timeout=300)


def _stream_ttft(client, model: str, messages: list[dict], max_tokens: int) -> tuple[float, str]:
    t0 = time.perf_counter()
    first, parts = 0.0, []
    for chunk in client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                                temperature=0, stream=True):
        if chunk.choices and chunk.choices[0].delta.content:
            if not first:
                first = time.perf_counter() - t0
            parts.append(chunk.choices[0].delta.content)
    return first * 1000, "".join(parts)


def _conversation(gws: dict, turns: int, max_tokens: int, label: str) -> list[Turn]:
    # lazy: openai costs 286 ms at start-up (python -X importtime, 2026-12-05); a test extra, not a dependency
    import openai

    clients = {k: openai.OpenAI(base_url=g.url + "/v1", api_key="unused", max_retries=0, timeout=600)
               for k, g in gws.items()}
    model = clients["cache"].models.list().data[0].id
    # each run's own system prompt from its first token on: one run never finds another's history
    messages = [{"role": "system", "content": f"[{label}] {SYSTEM}"}]
    out: list[Turn] = []
    for t in range(turns):
        messages.append({"role": "user", "content": QUESTIONS[t % len(QUESTIONS)]})
        order = ["cache", "none"] if t % 2 == 0 else ["none", "cache"]   # the same load for both, on average
        got = {k: _stream_ttft(clients[k], model, messages, max_tokens) for k in order}
        answer = got["cache"][1]
        out.append(Turn({k: got[k][0] for k in got}, answer, got["cache"][1] == got["none"][1]))
        log.info("conversation: turn %d: %.0f ms with the cache, %.0f ms without", t + 1, got["cache"][0],
                 got["none"][0])
        messages.append({"role": "assistant", "content": answer})
    return out


def _prefix_stats(addresses: list[str]) -> list:
    with RouteClient(addresses) as c:
        return [c._stub(a).Describe(pb.DescribeRequest(), timeout=10) for a in addresses]


def measure_conversation(*, stages: int = 4, turns: int = 10, rtt_ms: float = 20.0, max_tokens: int = 16,
                         conversations: int = 8, interleaved_turns: int = 4, threads: int = 1,
                         bundle=None) -> Report:
    if turns < 2 or turns > len(QUESTIONS):
        raise WireError(f"--turns {turns}: give 2 to {len(QUESTIONS)}")
    if bundle is None:
        bundle = ensure_bundle(stages, progress=False)[0]
    rep = Report(stages=stages, turns=turns, rtt_ms=rtt_ms)

    @contextlib.contextmanager
    def gateway(addresses):
        backend = RouteBackend([[a] for a in addresses], timeout=600)
        server = GatewayServer(create_app(backend), "127.0.0.1:0").start()
        try:
            yield server
        finally:
            server.stop()
            backend.close()

    with _route(bundle, stages, threads) as cached, _route(bundle, stages, threads, "--prefix-cache-mib", "0") as cold:
        for net in ("loopback", "wan"):
            with contextlib.ExitStack() as stack:
                addrs = {"cache": cached.addresses, "none": cold.addresses}
                if net == "wan":
                    addrs = {k: stack.enter_context(WanLinks(a, rtt_ms / 2)).addresses for k, a in addrs.items()}
                gws = {k: stack.enter_context(gateway(a)) for k, a in addrs.items()}
                log.info("conversation: %d turns on %s", turns, net if net == "loopback" else f"a {rtt_ms:g} ms WAN")
                setattr(rep, net, _conversation(gws, turns, max_tokens, net))

    # interleaved conversations on a cache that holds part of them
    with _route(bundle, stages, threads) as probe, RouteClient(probe.addresses) as c:
        ids = c.tokenize(SYSTEM + " " + " ".join(QUESTIONS))
        c.run(ids, max_new_tokens=1, stop_token_ids=[])           # keeps len(ids) positions on every stage
        rep.bytes_per_1000_tokens = [d.prefix_cache_bytes * 1000 / len(ids) for d in _prefix_stats(probe.addresses)]
    per_conv = (len(SYSTEM) // 4 + interleaved_turns * (12 + max_tokens) + 40) * max(rep.bytes_per_1000_tokens) / 1000
    cache_mib = max(1, int(per_conv * 3 / 2**20))                 # about three conversations' histories
    with _route(bundle, stages, threads, "--prefix-cache-mib", str(cache_mib)) as small, \
            RouteClient(small.addresses) as c:
        histories = [[{"role": "system", "content": SYSTEM}] for _ in range(conversations)]
        prompt_tokens = restored = 0

        template, stops = c.hops[-1].chat_template, set(c.hops[-1].eos_token_ids)
        for t in range(interleaved_turns):
            for k, h in enumerate(histories):
                h.append({"role": "user", "content": QUESTIONS[(t + k) % len(QUESTIONS)]})
                ids = c.tokenize(render(template, h), add_special=False)
                gen = c.run(ids, max_new_tokens=max_tokens)
                prompt_tokens += len(ids)
                restored += gen.cached_tokens
                answer = gen.token_ids[:-1] if gen.token_ids and gen.token_ids[-1] in stops else gen.token_ids
                h.append({"role": "assistant", "content": c.detokenize(answer)})
        d0 = _prefix_stats(small.addresses)[0]
        rep.hit_rate = {"conversations": conversations, "turns": interleaved_turns, "cache_mib": cache_mib,
                        "fits_conversations": cache_mib * 2**20 / per_conv if per_conv else 0.0,
                        "lookups": d0.prefix_cache_lookups, "hits": d0.prefix_cache_hits,
                        "hit_rate": d0.prefix_cache_hits / d0.prefix_cache_lookups if d0.prefix_cache_lookups else 0.0,
                        "token_share": restored / prompt_tokens if prompt_tokens else 0.0}
    return rep


def median(xs) -> float:
    return statistics.median(xs) if xs else 0.0
