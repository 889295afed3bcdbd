"""Helpers shared by the recovery and TLS route tests: fake-engine routes of worker processes with
replicas, a generation with a fault injected at a chosen decode step, and a local CA for TLS routes."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

from dgr.app.local import FakeRoute, LocalRoute
from dgr.runtime.wire.client import RouteClient

SPEC = "layers=6,embd=16,cuts=2:4,hash_layers=3,seed=8"
PROMPT = "Once upon a time, the ring"
MAX_NEW = 160                          # long enough that a fault at step <= 40 lands mid-generation
SAMPLED = dict(temperature=0.9, top_k=40, top_p=0.95, seed=11)


def fake_route(replicas: int | list[int] = 1, spec: str = SPEC, extra=None, env=None) -> LocalRoute:
    """One `dgr-worker --fake-engine` process per stage and replica."""
    return FakeRoute.of(spec, replicas=replicas, extra=extra, env=env)


def run_with_fault(client: RouteClient, fault, at_token: int, prompt=PROMPT, **kw):
    """Generate; when the `at_token`-th token arrives call `fault()` (the ring keeps going meanwhile).
    Returns (generation, monotonic time the fault was injected)."""
    kw.setdefault("max_new_tokens", MAX_NEW)
    kw.setdefault("stop_token_ids", [])
    t_fault = 0.0
    for n, _ in enumerate(client.generate(prompt, **kw), 1):
        if n == at_token:
            t_fault = time.monotonic()
            fault()
    return client.last, t_fault


def die_at(session: str, prompt_len: int, at_token: int, epoch: int = 1) -> list[str]:
    """Worker arguments: the worker kills itself (SIGKILL) right after the `at_token`-th generated token of
    `session` (its first epoch), about to compute the next one, at position prompt_len + at_token - 1.
    The fault lands mid-generation by construction: the ring cannot finish without that step."""
    return ["--test-die-at", f"{session}:{epoch}:{prompt_len + at_token - 1}"]


def stop_at(session: str, prompt_len: int, at_token: int, epoch: int = 1) -> list[str]:
    """Worker arguments: as `die_at`, but the worker stops itself (SIGSTOP) there: a hung worker, mid-generation
    by construction (SIGCONT lets it go on)."""
    return ["--test-stop-at", f"{session}:{epoch}:{prompt_len + at_token - 1}"]


@contextmanager
def restarted_when_dead(route: LocalRoute, stage: int, replica: int = 0, timeout: float = 60.0) -> Iterator[Future]:
    """Restart one worker in place (`route.restart`) as soon as it exits, e.g. by its own `--test-die-at`:
    the restart follows the death itself, not what a client happened to see. Yields a Future whose
    result() waits until the worker serves again and gives the exit status it died with (a TimeoutError
    when it did not exit within `timeout` s). Leaving the block stops the watch: nothing restarts after it."""
    proc = route.workers[stage][replica].proc
    leaving = threading.Event()

    def watch() -> int | None:
        end = time.monotonic() + timeout
        while not leaving.is_set():
            try:
                rc = proc.wait(0.05)
            except subprocess.TimeoutExpired:
                if time.monotonic() > end:
                    raise TimeoutError(f"stage {stage} replica {replica} did not exit within {timeout:g} s") from None
                continue
            route.restart(stage, replica)
            return rc
        return None

    with ThreadPoolExecutor(1, thread_name_prefix="restart-when-dead") as pool:
        fut = pool.submit(watch)
        try:
            yield fut
        finally:
            leaving.set()                               # the pool's exit joins the watch


def fake_prompt_len(prompt: str = PROMPT) -> int:
    """Tokens of `prompt` for the fake engine (BOS, then one token per byte)."""
    return 1 + len(prompt.encode("utf-8"))


def reference(route: LocalRoute, prompt=PROMPT, **kw):
    """The uninterrupted run of the same generation on the same route (a fresh client)."""
    kw.setdefault("max_new_tokens", MAX_NEW)
    kw.setdefault("stop_token_ids", [])
    with RouteClient(route.replicas) as c:
        return c.run(prompt, **kw)


def make_ca(root: Path, name: str, members: list[str]) -> dict[str, tuple[Path, Path]]:
    """`dgr certs init` a CA in root/name and `dgr certs issue` each member for 127.0.0.1; returns
    member -> (cert, key); the CA is root/name/ca.pem."""
    d = root / name
    subprocess.run([sys.executable, "-m", "dgr", "certs", "init", str(d), "--name", f"{name} CA"],
                   check=True, capture_output=True, timeout=60)
    out = {}
    for m in members:
        subprocess.run([sys.executable, "-m", "dgr", "certs", "issue", str(d), m, "--host", "127.0.0.1"],
                       check=True, capture_output=True, timeout=60)
        out[m] = (d / f"{m}.pem", d / f"{m}.key")
    return out


def tls_args(cert: Path, key: Path, ca: Path | None = None) -> list[str]:
    return ["--tls-cert", str(cert), "--tls-key", str(key), *(["--tls-ca", str(ca)] if ca else [])]
