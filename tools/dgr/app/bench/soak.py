"""`dgr bench soak`: concurrent sessions generating without pause over a local route; errors and RSS growth.

Starts one `dgr worker serve` process per stage on loopback (the SmolLM2 bundle `dgr demo` builds, on
the real engine; or the fake engine), then `sessions` client threads generate greedily, one generation
after another, until the time is up. It reports the errors by code, recoveries (re-prefills after a
hop's fault), tokens generated, whether every repeat of a prompt gave the same text, and the resident
memory (VmRSS from /proc; VmHWM is the peak) of every process at the start and the end.

`hostile` > 0 (docs/security.md): the route runs under mutual TLS with a CA made for the run, every honest
session thread is a member of its own, and `hostile` more members attack the route in a loop beside them
(dgr.app.bench.hostile: prefix-cache poisoning, slot hogging, a grammar bomb, scans, forged tokens, bare-connection
bursts), while a prober opens a new connection to every stage twice a second. Each honest prompt's tokens
are then compared with the same prompt's run before any attacker started (`mismatched`).
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from dgr.app import certs
from dgr.app.bench import hostile as attack
from dgr.app.demo import ensure_bundle
from dgr.app.local import LocalRoute, engine_library
from dgr.core.errors import DgrError
from dgr.core.log import get_logger
from dgr.runtime.wire.client import RouteClient
from dgr.runtime.wire.tls import TlsConfig

log = get_logger(__name__)

PROMPTS = ("The capital of France is", "Once upon a time, in a village by the sea,",
           "The three laws of thermodynamics are", "def fibonacci(n):", "A recipe for bread: first,",
           "The history of the printing press begins")


def fake_spec(stages: int) -> str:
    """A fake model of `stages` stages (two layers each; the first three route by token id)."""
    cuts = ":".join(str(2 * i) for i in range(1, stages))
    return f"layers={2 * stages},embd=64,{'cuts=' + cuts + ',' if cuts else ''}hash_layers=3,seed=11"


def proc_memory(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (the peak) of a process, in KiB, from /proc/PID/status."""
    out = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(rest.split()[0])
    except (OSError, ValueError, IndexError):
        pass
    return out


@dataclass
class ProcessMemory:
    name: str
    pid: int
    rss_start_kib: int
    rss_end_kib: int = 0
    hwm_end_kib: int = 0
    alive_at_end: bool = True

    @property
    def growth_kib(self) -> int:
        return self.rss_end_kib - self.rss_start_kib


@dataclass
class SoakReport:
    engine: str
    stages: int
    sessions: int
    minutes: float
    seconds: float = 0.0
    generations: int = 0
    tokens: int = 0
    recovered: int = 0                        # generations that re-prefilled after a hop's fault
    mismatched: int = 0                       # repeats of a prompt whose text differed from its first run
    errors: dict[str, int] = field(default_factory=dict)   # by code (a StageError's) or exception class
    error_samples: list[str] = field(default_factory=list)
    mismatch_samples: list[dict] = field(default_factory=list)  # prompt, first tokens, differing tokens
    processes: list[ProcessMemory] = field(default_factory=list)
    rss_samples: list[list[float]] = field(default_factory=list)  # [seconds, RSS KiB of each process...]
    hostile: int = 0                          # hostile members attacking beside the honest sessions
    attacks: dict[str, int] = field(default_factory=dict)   # "attack: what it got" -> times
    breaches: int = 0                         # attacks answered by anything but a refusal
    probes: int = 0                           # new connections that Describe answered, all stages
    probe_failures: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    def to_json(self) -> dict:
        d = asdict(self)
        d["tokens_per_s"] = round(self.tokens_per_s, 2)
        d["error_count"] = sum(self.errors.values())
        for p, pm in zip(d["processes"], self.processes):
            p["growth_kib"] = pm.growth_kib
        return d

    def table(self) -> str:
        lines = [f"soak: {self.sessions} sessions over {self.stages} stages ({self.engine} engine), "
                 f"{self.seconds / 60:.1f} min",
                 f"  generations {self.generations}, tokens {self.tokens} ({self.tokens_per_s:.1f} tok/s), "
                 f"recovered {self.recovered}, repeats that differed {self.mismatched}",
                 f"  errors: {sum(self.errors.values())}"
                 + (" (" + ", ".join(f"{k} {v}" for k, v in sorted(self.errors.items())) + ")" if self.errors else ""),
                 f"  {'process':<10} {'pid':>8} {'RSS start':>12} {'RSS end':>12} {'growth':>10} {'peak':>12}"]
        for p in self.processes:
            lines.append(f"  {p.name:<10} {p.pid:>8} {p.rss_start_kib / 1024:>9.1f} MiB {p.rss_end_kib / 1024:>9.1f} MiB "
                         f"{p.growth_kib / 1024:>+7.1f} MiB {p.hwm_end_kib / 1024:>9.1f} MiB"
                         + ("" if p.alive_at_end else "  (DIED)"))
        if self.hostile:
            lines.append(f"  hostile members {self.hostile}: {sum(self.attacks.values())} attacks, breaches "
                         f"{self.breaches}; listener probes {self.probes}, failed {self.probe_failures}")
            for k, v in sorted(self.attacks.items()):
                lines.append(f"    {v:>6}  {k}")
        for s in self.error_samples:
            lines.append(f"  e.g. {s}")
        return "\n".join(lines)


def _stage_args(stages: int, fake: bool, threads: int) -> tuple[list[list[str]], dict[str, str], str]:
    if fake:
        spec = fake_spec(stages)
        return [["--fake-engine", spec, "--stage", str(i)] for i in range(stages)], {}, "fake"

    lib = engine_library()
    bundle, _ = ensure_bundle(stages, progress=False)
    threads = threads or max(1, (os.cpu_count() or 1) // stages)
    args = [["--bundle", str(bundle.root), "--stage", str(i), "--threads", str(threads)] for i in range(stages)]
    return args, {"DGR_ENGINE_LIB": str(lib)}, "llama.cpp"


def _mesh(directory: Path, stages: int, sessions: int, hostile: int):
    """A CA for the run: a certificate per worker, per honest session thread and per hostile member."""
    certs.init(directory)
    ca = directory / certs.CA_CERT

    def member(name: str) -> TlsConfig:
        cert, key = certs.issue(directory, name, ["127.0.0.1"])
        return TlsConfig(cert, key, ca)

    return ([member(f"w{i}") for i in range(stages)], [member(f"honest-{k}") for k in range(sessions + 1)],
            [member(f"hostile-{k}") for k in range(hostile)])


def run_soak(minutes: float, *, stages: int = 3, sessions: int = 4, fake: bool = False, max_tokens: int = 48,
             threads: int = 0, hostile: int = 0) -> SoakReport:
    """Generate with `sessions` concurrent clients over a fresh local route for `minutes` (with `hostile`
    attacking members beside them, under mutual TLS)."""
    args, env, engine = _stage_args(stages, fake, threads)
    rep = SoakReport(engine=engine, stages=stages, sessions=sessions, minutes=minutes, hostile=hostile)
    lock = threading.Lock()
    first_text: dict[int, list[int]] = {}
    tmp = tempfile.TemporaryDirectory(prefix="dgr-soak-")
    workers_tls, honest_tls, hostile_tls = _mesh(Path(tmp.name), stages, sessions, hostile) if hostile else ([], [], [])
    for i, a in enumerate(args):
        if hostile:                                          # mutual TLS; each member bounded at stage 0
            t = workers_tls[i]
            a += ["--tls-cert", str(t.cert), "--tls-key", str(t.key), "--tls-ca", str(t.ca), "--max-sessions", "16"]
            a += ["--max-sessions-per-member", "2"] if i == 0 else []
    honest = (lambda k: honest_tls[k]) if hostile else (lambda k: None)
    with tmp, LocalRoute(args, env=env) as route:
        with RouteClient(route.addresses, tls=honest(sessions)) as c:   # warm up: every stage has run once
            c.run(PROMPTS[0], max_new_tokens=4)
            if hostile:                                      # each prompt's tokens before any attacker started
                for which, prompt in enumerate(PROMPTS):
                    first_text[which] = c.run(prompt, max_new_tokens=max_tokens, prefix_cache=False).token_ids
                victim_ids = c.tokenize(PROMPTS[0])
        names = [f"stage {i}" for i in range(stages)] + ["client"]
        pids = [p.pid for p in route.procs] + [os.getpid()]
        rep.processes = [ProcessMemory(n, pid, proc_memory(pid).get("VmRSS", 0)) for n, pid in zip(names, pids)]
        t0 = time.monotonic()
        deadline = t0 + minutes * 60

        members = [attack.Member(f"hostile-{k}", route.addresses, t, victim_ids) for k, t in enumerate(hostile_tls)]
        attackers, probes = attack.start(members, route.addresses, honest(sessions), deadline) if hostile else ([], None)

        def session(k: int) -> None:
            i = k
            with RouteClient(route.addresses, tls=honest(k)) as client:
                while time.monotonic() < deadline:
                    which = i % len(PROMPTS)
                    i += sessions
                    try:
                        gen = client.run(PROMPTS[which], max_new_tokens=max_tokens)
                    except DgrError as err:
                        code = getattr(err, "code", None) or type(err).__name__
                        with lock:
                            rep.errors[code] = rep.errors.get(code, 0) + 1
                            if len(rep.error_samples) < 5:
                                rep.error_samples.append(f"{code}: {err}"[:300])
                        time.sleep(0.2)
                        continue
                    with lock:
                        rep.generations += 1
                        rep.tokens += len(gen.token_ids)
                        rep.recovered += gen.epochs > 1
                        want = first_text.setdefault(which, gen.token_ids)
                        if gen.token_ids != want:
                            rep.mismatched += 1
                            if len(rep.mismatch_samples) < 5:
                                at = next((j for j, (a, b) in enumerate(zip(want, gen.token_ids)) if a != b),
                                          min(len(want), len(gen.token_ids)))
                                rep.mismatch_samples.append({"prompt": PROMPTS[which], "first": want,
                                                             "this": gen.token_ids, "differs_at": at})

        workers = [threading.Thread(target=session, args=(k,), name=f"soak-{k}", daemon=True)
                   for k in range(sessions)]
        for w in workers:
            w.start()
        every = max(1.0, min(30.0, minutes * 60 / 10))
        while any(w.is_alive() for w in workers):
            rep.rss_samples.append([round(time.monotonic() - t0, 1)] +
                                   [proc_memory(pm.pid).get("VmRSS", 0) for pm in rep.processes])
            for w in workers:
                w.join(timeout=every / len(workers))
        for t in attackers:
            t.join()
        rep.seconds = time.monotonic() - t0
        if hostile:
            for m in members:
                for k, v in m.outcomes.items():
                    rep.attacks[k] = rep.attacks.get(k, 0) + v
                m.close()
            rep.breaches = sum(v for k, v in rep.attacks.items() if "breach" in k)
            rep.probes, rep.probe_failures = probes["probes"], probes["probe_failures"]
        for pm, p in zip(rep.processes, list(route.procs) + [None]):
            mem = proc_memory(pm.pid)
            pm.rss_end_kib, pm.hwm_end_kib = mem.get("VmRSS", 0), mem.get("VmHWM", 0)
            pm.alive_at_end = p is None or p.poll() is None
            if not pm.alive_at_end:
                rep.errors["WORKER_DIED"] = rep.errors.get("WORKER_DIED", 0) + 1
    log.info("soak done: %d generations, %d tokens, %d errors", rep.generations, rep.tokens,
             sum(rep.errors.values()))
    return rep


def write_json(rep: SoakReport, path: str | Path) -> None:
    Path(path).write_text(json.dumps(rep.to_json(), indent=2, sort_keys=True) + "\n")


__all__ = ["SoakReport", "fake_spec", "proc_memory", "run_soak", "write_json"]
