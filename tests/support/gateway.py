"""Helpers for the gateway tests: a gateway in this process (uvicorn in a thread on 127.0.0.1:0) or as a
`dgr serve` process, the official `openai` client pointed at it, SmolLM2 routes of worker processes, and
polling every stage's open sessions."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

import openai
import pytest

from dgr.app.gateway import chat
from dgr.app.gateway.app import create_app
from dgr.app.gateway.route import RouteBackend
from dgr.app.gateway.server import GatewayServer
from dgr.app.local import LocalRoute
from dgr.runtime.wire.client import RouteClient


@dataclass
class Gateway:
    backend: RouteBackend
    server: GatewayServer

    @property
    def url(self) -> str:
        return self.server.url

    def client(self, **kw) -> openai.OpenAI:
        """The official client, no retries (a test sees the first answer)."""
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=120, **kw)


@contextmanager
def gateway(route, app_kw: dict | None = None, **kw):
    """`dgr serve`'s app over `route` (text or replicas), served from a thread of this process
    (`create_app(backend, **app_kw)`; `kw` go to the RouteBackend)."""
    backend = RouteBackend(route, **kw)
    server = GatewayServer(create_app(backend, **(app_kw or {})), "127.0.0.1:0")
    server.start()
    try:
        yield Gateway(backend, server)
    finally:
        server.stop()
        backend.close()


@contextmanager
def serve_process(route: str, *args: str, timeout: float = 60.0):
    """`dgr serve --route ROUTE --listen 127.0.0.1:0 ARGS...` as a process; yields (process, base URL)."""
    p = subprocess.Popen([sys.executable, "-m", "dgr", "serve", "--route", route, "--listen", "127.0.0.1:0", *args],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out: list[str] = []
    try:
        deadline = time.monotonic() + timeout
        url = None
        while url is None:
            line = p.stdout.readline()
            if not line or time.monotonic() > deadline:
                raise AssertionError(f"dgr serve did not start ({p.poll()}):\n" + "".join(out))
            out.append(line)
            m = re.search(r" on (https?://\S+) ", line)
            url = m.group(1) if m else None
        threading.Thread(target=lambda: [out.append(x) for x in p.stdout], daemon=True).start()
        p.output = out
        yield p, url
    finally:
        p.terminate()
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def smollm2_route(engine_lib, stages: int = 3, n_ctx: int = 512) -> LocalRoute:
    """The embedded SmolLM2 split `stages` ways (the demo's bundle), one worker process per stage."""
    from dgr.app.demo import ensure_bundle

    bundle = ensure_bundle(stages, progress=False)[0]
    return LocalRoute([["--bundle", str(bundle.root), "--stage", str(i), "--threads", "1", "--n-ctx", str(n_ctx)]
                       for i in range(stages)], env={"DGR_ENGINE_LIB": str(engine_lib)}, timeout=300)


def open_sessions(addresses: list[str]) -> list[int]:
    with RouteClient(addresses) as c:
        return [d.open_sessions for d in c.describe()]


def wait_no_sessions(addresses: list[str], timeout: float = 15.0) -> list[int]:
    """Poll every stage's Describe until none holds a session (or `timeout`); the last counts seen."""
    deadline = time.monotonic() + timeout
    while True:
        counts = open_sessions(addresses)
        if not any(counts) or time.monotonic() > deadline:
            return counts
        time.sleep(0.1)


def metric(text: str, name: str, **labels) -> float:
    """The value of one sample in Prometheus text (0 when absent)."""
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        if key == (f"{name}{{{want}}}" if want else name):
            return float(value)
    return 0.0


# Module fixtures of the gateway tests: a gateway and a route client over the module's own `route` fixture
# (import them into a test module beside its `route`).
@pytest.fixture(scope="module")
def gw(route):
    with gateway(route.route) as g:
        yield g


@pytest.fixture(scope="module")
def rc(route):
    with RouteClient(route.addresses) as c:
        yield c


def rendered(gw, messages) -> str:
    """The prompt text the gateway renders for `messages` (the model's chat template, its eos token)."""
    info = gw.backend.info
    return chat.render(info.chat_template, messages, special_tokens={"eos_token": info.eos_token})
