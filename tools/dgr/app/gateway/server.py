"""Run the gateway app on uvicorn: bind HOST:PORT (port 0 picks a free one), optionally HTTPS, in the
foreground (`dgr serve`) or in a background thread (tests, embedding)."""

from __future__ import annotations

import socket
import threading
import time

import uvicorn

from dgr.core.errors import WireError


def _bind(listen: str) -> socket.socket:
    host, _, port = listen.rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit():
        raise WireError(f"--listen {listen!r} is not HOST:PORT")
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.create_server((host, int(port)), family=family, reuse_port=False)
    except OSError as err:
        raise WireError(f"cannot listen on {listen}: {err.strerror or err}") from None
    sock.set_inheritable(True)
    return sock


class GatewayServer:
    """uvicorn serving `app` on `listen`; `address` is HOST:PORT as bound."""

    def __init__(self, app, listen: str = "127.0.0.1:0", *, ssl_certfile: str | None = None,
                 ssl_keyfile: str | None = None, log_level: str = "warning"):
        self.sock = _bind(listen)
        host, port = self.sock.getsockname()[:2]
        self.address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self.scheme = "https" if ssl_certfile else "http"
        self.config = uvicorn.Config(app, log_level=log_level, access_log=False, lifespan="off",
                                     ssl_certfile=ssl_certfile, ssl_keyfile=ssl_keyfile,
                                     timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(self.config)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.address}"

    def run(self) -> None:
        """Serve until interrupted (SIGINT/SIGTERM when run in the main thread)."""
        try:
            self.server.run(sockets=[self.sock])
        finally:
            self.sock.close()

    def start(self, timeout: float = 30.0) -> GatewayServer:
        """Serve from a daemon thread; returns once it accepts connections."""
        self._thread = threading.Thread(target=self.run, daemon=True, name="gateway-uvicorn")
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise WireError(f"the gateway did not start on {self.address}")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)

    def __enter__(self):
        return self.start() if self._thread is None else self

    def __exit__(self, *exc):
        self.stop()
