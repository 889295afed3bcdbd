"""`dgr bench --wan-rtt-ms R`: a route of worker processes measured through emulated WAN links, against
the same route on loopback, in one run.

One set of worker processes serves several routes at once: direct (loopback), through forwarders with
no delay and no bandwidth limit (what the emulator itself costs), through forwarders with no delay at
`mbit` (only when `mbit` is given: relaying plus serialization) and through forwarders with the one-way
delay `rtt_ms / 2` (and `mbit`) on every hop (dgr.app.bench.wan_link). Every hop crosses a link: the route a
client opens carries the forwarders' addresses, and each worker reaches the next hop, and the last stage
the origin, through the addresses of that route. Decode rounds alternate between the routes so all see
the same machine load. The figures (all from this run):

- `tpot_ms`: time per output token through the WAN (median decode interval at the client; the mean is
  `tpot_mean_ms`).
- `ideal_ring_ms` = compute (the workers' own per-token timings in the WAN run, median) + S x one-way delay +
  S x per-hop overhead (ring time outside compute, per boundary, of the same route through 0 ms links
  at the same bandwidth: the emulator's and the wire's cost); `tpot_over_ideal` their ratio.
- `emulator_overhead_ms`: per hop, the 0 ms forwarders' overhead minus the direct route's.
- prefill of a long prompt through the WAN in the client's chunks: `prefill_ms` (first chunk sent to
  first token back), `prefill_compute_ms` (engine time summed over every stage, from the workers'
  metrics, in a run of the same prompt as one chunk: then each stage computes alone, which on a machine
  with fewer cores than stages is the uncontended time), `prefill_transfer_ms` (every link crossed once:
  its one-way delay plus the bytes it carried at `mbit`), `prefill_overlap` = prefill_ms / (compute +
  transfer): 1 when nothing overlaps, below 1 when stages work on different chunks while others are on
  the wire. `prefill_unchunked_ms` is that one-chunk run's own time: the serial baseline, measured.
"""

from __future__ import annotations

import contextlib
import re
import statistics
import time
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from dgr.app.bench.wan_link import Link, WanLinks, raw_overhead
from dgr.app.demo import ensure_bundle, long_prompt
from dgr.app.local import LocalRoute, engine_library
from dgr.core.errors import WireError
from dgr.core.log import get_logger
from dgr.runtime.wire.client import RouteClient
from dgr.runtime.wire.stats import decode_events
from dgr.toolchain.bundle import load_bundle

log = get_logger(__name__)

__all__ = ["Link", "WanLinks", "measure_wan", "raw_overhead", "table"]

PROMPT = "The capital of France is"
_METRICS = re.compile(r"metrics on (\S+)")


def timed_decode(client, prompt, tokens: int, stages: int) -> tuple[object, dict]:
    """Generate `tokens` greedily (no stop ids) and time every token's arrival here. Figures, in ms:
    `tpot_ms` the median decode interval at the client (medians: this machine is shared and noisy;
    `tpot_mean_ms` is the mean), `compute_ms` the median engine time per decode token summed over the
    stages (the workers' own timings), `per_hop_ms` their difference per boundary, `ring_ms` the median
    trip round the ring as the origin timed it."""
    arrivals = [time.perf_counter() for _ in client.generate(prompt, max_new_tokens=tokens, stop_token_ids=[])]
    gen = client.last
    evs = decode_events(gen)
    if len(arrivals) < 3 or not evs:
        raise WireError(f"only {len(arrivals)} tokens came back: too few to time decode; ask for more tokens")
    gaps = [(b - a) * 1e3 for a, b in zip(arrivals, arrivals[1:])]
    tpot, compute = statistics.median(gaps), statistics.median(e.compute_ns for e in evs) / 1e6
    return gen, {"tpot_ms": tpot, "tpot_mean_ms": statistics.fmean(gaps), "compute_ms": compute,
                 "per_hop_ms": (tpot - compute) / max(1, stages),
                 "ring_ms": statistics.median(e.ring_ns for e in evs) / 1e6}


def _scrape(url: str) -> dict[str, float]:
    """The two figures a prefill needs from one worker's /metrics: engine seconds and prefill steps."""
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    out = {"compute_s": 0.0, "prefill_steps": 0.0, "decode_steps": 0.0}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "dgr_worker_step_compute_seconds_sum":
                out["compute_s"] = s.value
            elif s.name == "dgr_worker_steps_total":
                out[f"{s.labels.get('kind')}_steps"] = s.value
    return out


def _metrics_urls(route) -> list[str]:
    urls = []
    for i, lines in enumerate(route.logs):
        m = next((m for line in lines if (m := _METRICS.search(line))), None)
        if m is None:
            raise WireError(f"stage {i} printed no metrics URL (started without --metrics-listen?)")
        urls.append(m.group(1))
    return urls


def _engine_lib() -> Path:
    return engine_library()


def _bundle(bundle, stages: int):
    if bundle is None:
        return ensure_bundle(stages)[0]
    b = load_bundle(bundle) if isinstance(bundle, (str, Path)) else bundle
    n = len(b.manifest.stages)
    if n != stages:
        raise WireError(f"bundle {b.root} has {n} stages, not {stages}: pass --stages {n} or another bundle")
    return b


def _prefill(client, ids: list[int], urls: list[str], links: WanLinks | None, mbit: float | None) -> dict:
    """One prefill (max_new_tokens=1) through `client`; its engine time from every stage's metrics, the
    bytes each link carried meanwhile."""
    before = [_scrape(u) for u in urls]
    bytes0 = links.bytes() if links else []
    gen = client.run(ids, max_new_tokens=1)
    chunks = -(-len(ids) // gen.chunk_tokens)
    deadline = time.monotonic() + 5
    while True:                                         # a stage counts its step just after it sends it on
        after = [_scrape(u) for u in urls]
        if all(a["prefill_steps"] - b["prefill_steps"] >= chunks for a, b in zip(after, before)) or \
                time.monotonic() > deadline:
            break
        time.sleep(0.02)
    compute = [(a["compute_s"] - b["compute_s"]) * 1e3 for a, b in zip(after, before)]
    out = {"prefill_ms": (gen.t_first - gen.t_start) * 1e3, "compute_per_stage_ms": compute,
           "prefill_compute_ms": sum(compute), "chunks": chunks, "chunk_tokens": gen.chunk_tokens,
           "token": gen.token_ids[0]}
    if links is not None:
        moved = [(d1 - d0, u1 - u0) for (d1, u1), (d0, u0) in zip(links.bytes(), bytes0)]
        ns_per_byte = 8e3 / mbit if mbit else 0.0
        # crossed once each: client -> stage 0, every seam, the last stage -> origin, origin -> client
        crossings = len(urls) + 2
        out["link_bytes"] = moved
        out["prefill_transfer_ms"] = crossings * links.one_way_ms + sum(d + u for d, u in moved) * ns_per_byte / 1e6
    return out


def measure_wan(*, stages: int = 4, bundle=None, rtt_ms: float = 20.0, mbit: float | None = None,
                threads: int = 1, tokens: int = 32, rounds: int = 3, prompt: str = PROMPT,
                prefill_tokens: int = 256, chunk_tokens: int = 64, prefill_rounds: int = 3) -> dict:
    """Decode and prefill of a `stages`-stage route through emulated links of `rtt_ms` round trip (and
    `mbit` each way) against the same workers on loopback, in one run: see the module docstring.
    `bundle`: a bundle (or its folder) of `stages` stages, default the SmolLM2 one; `threads`: compute
    threads per worker; `tokens` per decode run, `rounds` of each route (medians); `prefill_tokens` of
    the long prompt, sent in `chunk_tokens` chunks, `prefill_rounds` times (the fastest of each counts)."""
    if stages < 1 or tokens < 3 or rounds < 1 or prefill_rounds < 1:
        raise WireError("measure_wan needs stages >= 1, tokens >= 3, rounds >= 1 and prefill_rounds >= 1")
    one_way = rtt_ms / 2
    lib = _engine_lib()
    b = _bundle(bundle, stages)
    args = [["--bundle", str(b.root), "--stage", str(i), "--threads", str(threads),
             "--metrics-listen", "127.0.0.1:0"] for i in range(stages)]
    log.info("wan: %d workers of %s, links of %.1f ms one way%s", stages, b.root.name, one_way,
             f" at {mbit:g} Mbit/s" if mbit else "")
    t0 = time.monotonic()
    with contextlib.ExitStack() as stack:
        route = stack.enter_context(LocalRoute(args, env={"DGR_ENGINE_LIB": str(lib)}))
        urls = _metrics_urls(route)
        # "zero": 0 ms links without a bandwidth limit (what relaying itself costs); "link": 0 ms links at
        # `mbit` (relaying plus serialization: the per-hop cost the ideal ring adds); "wan": the delay too
        shapes = {"zero": (0.0, None), **({"link": (0.0, mbit)} if mbit else {}), "wan": (one_way, mbit)}
        links = {k: stack.enter_context(WanLinks(route.addresses, ow, bw)) for k, (ow, bw) in shapes.items()}
        cold = {"chunk_tokens": chunk_tokens, "prefix_cache": False}     # every prompt prefilled in full
        clients = {"direct": stack.enter_context(RouteClient(route.addresses, **cold))}
        clients.update({k: stack.enter_context(RouteClient(w.addresses, timeout=300, **cold))
                        for k, w in links.items()})
        wan, far, direct = links["wan"], clients["wan"], clients["direct"]
        for c in clients.values():
            c.run(prompt, max_new_tokens=4)             # connections up and caches warm before timing
        figs: dict[str, list[dict]] = {k: [] for k in clients}
        texts: dict[str, set[str]] = {k: set() for k in clients}
        decode_bytes = None
        for r in range(rounds):
            for kind, c in clients.items():
                before = wan.bytes()
                gen, fig = timed_decode(c, prompt, tokens, stages)
                if kind == "wan" and decode_bytes is None:
                    decode_bytes = [(d1 - d0, u1 - u0) for (d1, u1), (d0, u0) in zip(wan.bytes(), before)]
                figs[kind].append(fig)
                texts[kind].add(gen.text)
                log.info("wan: round %d/%d %s: %.2f ms per token (compute %.2f), %.3f ms per hop outside compute",
                         r + 1, rounds, kind, figs[kind][-1]["tpot_ms"], figs[kind][-1]["compute_ms"],
                         figs[kind][-1]["per_hop_ms"])
        long_ids = long_prompt(direct.tokenize, prefill_tokens)
        # the same prompt in one chunk: each stage waits for the whole prompt from the one before, so
        # nothing overlaps and each stage computes alone (the serial baseline, measured)
        whole = stack.enter_context(RouteClient(wan.addresses, timeout=300, chunk_tokens=len(long_ids),
                                                prefix_cache=False))
        pre: dict[str, list[dict]] = {"wan": [], "serial": [], "loop": []}
        for c in (far, whole, direct):
            c.run(long_ids, max_new_tokens=1)           # warm the long-prompt path once
        for r in range(prefill_rounds):
            pre["wan"].append(_prefill(far, long_ids, urls, wan, mbit))
            pre["serial"].append(_prefill(whole, long_ids, urls, wan, mbit))
            pre["loop"].append(_prefill(direct, long_ids, urls, None, None))
            log.info("wan: prefill round %d/%d, %d tokens: %.1f ms through the links in chunks of %d, "
                     "%.1f ms in one chunk, %.1f ms on loopback", r + 1, prefill_rounds, len(long_ids),
                     pre["wan"][-1]["prefill_ms"], pre["wan"][-1]["chunk_tokens"],
                     pre["serial"][-1]["prefill_ms"], pre["loop"][-1]["prefill_ms"])
        link_stats = wan.stats()
        late = wan.late_ms_median()
    raw = raw_overhead(one_way, n=100)
    med = {k: {f: statistics.median(x[f] for x in v) for f in v[0]} for k, v in figs.items()}
    hop_link = med["link" if mbit else "zero"]["per_hop_ms"]
    ideal = med["wan"]["compute_ms"] + stages * one_way + stages * hop_link
    # prefill: the fastest of the rounds of each (the least disturbed by the machine's other work)
    pw, ps, pl = (min(v, key=lambda x: x["prefill_ms"]) for v in (pre["wan"], pre["serial"], pre["loop"]))
    compute, transfer = ps["prefill_compute_ms"], pw["prefill_transfer_ms"]
    return {
        "stages": stages, "bundle": b.root.name, "rtt_ms": rtt_ms, "one_way_ms": one_way, "mbit": mbit,
        "threads": threads, "tokens": tokens, "rounds": rounds, "prefill_rounds": prefill_rounds,
        "tpot_ms": med["wan"]["tpot_ms"], "tpot_mean_ms": med["wan"]["tpot_mean_ms"],
        "compute_ms": med["wan"]["compute_ms"], "ring_ms": med["wan"]["ring_ms"],
        "ideal_ring_ms": ideal, "tpot_over_ideal": med["wan"]["tpot_ms"] / ideal,
        "per_hop_ms": med["direct"]["per_hop_ms"], "per_hop_link_ms": hop_link,
        "emulator_overhead_ms": med["zero"]["per_hop_ms"] - med["direct"]["per_hop_ms"], "delay_late_ms": late,
        "loopback_tpot_ms": med["direct"]["tpot_ms"], "zero_delay_tpot_ms": med["zero"]["tpot_ms"],
        "same_text": len(set().union(*texts.values())) == 1,
        "text": next(iter(texts["wan"])), "decode_link_bytes": decode_bytes,
        "prefill_tokens": len(long_ids), "prefill_chunk_tokens": pw["chunk_tokens"], "prefill_chunks": pw["chunks"],
        "prefill_ms": pw["prefill_ms"], "prefill_compute_ms": compute, "prefill_transfer_ms": transfer,
        "prefill_overlap": pw["prefill_ms"] / (compute + transfer),
        "prefill_compute_per_stage_ms": ps["compute_per_stage_ms"],
        "prefill_compute_contended_ms": pw["prefill_compute_ms"],
        "prefill_unchunked_ms": ps["prefill_ms"], "prefill_loopback_ms": pl["prefill_ms"],
        "prefill_link_bytes": pw["link_bytes"],
        "prefill_same_token": pw["token"] == pl["token"],
        "raw_tcp": raw, "links": link_stats, "seconds": time.monotonic() - t0,
    }


def table(r: dict) -> str:
    """A few lines a person reads: the decode ring against its ideal, the emulator's cost, the prefill."""
    bw = f", {r['mbit']:g} Mbit/s" if r["mbit"] else ""
    raw = r["raw_tcp"]
    serial = r["prefill_compute_ms"] + r["prefill_transfer_ms"]
    return "\n".join([
        f"WAN: {r['stages']} stages, {r['rtt_ms']:g} ms RTT ({r['one_way_ms']:g} ms one way per hop{bw}), "
        f"{r['tokens']} tokens x {r['rounds']} rounds; same text as loopback: {'yes' if r['same_text'] else 'NO'}",
        f"  per token (median): {r['tpot_ms']:.2f} ms through the links (mean {r['tpot_mean_ms']:.2f}; "
        f"loopback {r['loopback_tpot_ms']:.2f}, 0 ms links {r['zero_delay_tpot_ms']:.2f})",
        f"  ideal ring {r['ideal_ring_ms']:.2f} ms = compute {r['compute_ms']:.2f} + {r['stages']} x "
        f"{r['one_way_ms']:g} + {r['stages']} x {r['per_hop_link_ms']:.3f}: tpot / ideal {r['tpot_over_ideal']:.3f}",
        f"  per hop outside compute: {r['per_hop_ms']:.3f} ms direct, {r['per_hop_link_ms']:.3f} ms through 0 ms "
        f"links{bw} (emulator {r['emulator_overhead_ms']:+.3f} ms); bytes released {r['delay_late_ms']:.3f} ms "
        "after due (median)",
        f"  raw TCP round trip: {raw['direct_rtt_ms']:.3f} ms direct, {raw['zero_link_rtt_ms']:.3f} ms through a "
        f"0 ms link, {raw['delayed_link_rtt_excess_ms']:+.3f} ms beyond the delays through a {r['one_way_ms']:g} ms one",
        f"  prefill of {r['prefill_tokens']} tokens in {r['prefill_chunks']} chunks of {r['prefill_chunk_tokens']}: "
        f"{r['prefill_ms']:.1f} ms through the links (loopback {r['prefill_loopback_ms']:.1f}; one chunk through "
        f"the links {r['prefill_unchunked_ms']:.1f})",
        f"  compute {r['prefill_compute_ms']:.1f} + transfer {r['prefill_transfer_ms']:.1f} = {serial:.1f} ms serial: "
        f"overlap {r['prefill_overlap']:.3f} (engine time while stages share the cores: "
        f"{r['prefill_compute_contended_ms']:.1f} ms)",
    ])
