"""TLS and mutual TLS for every dgr channel (client to stage, stage to stage, last stage to origin).

One `TlsConfig` (PEM files: this side's certificate and key, and optionally the operator's CA) serves
both ends. With a CA, a server demands a client certificate signed by it (mTLS) and a client checks the
server's certificate against it; without one, a client trusts the system roots. `None` means plaintext.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from pathlib import Path

import grpc

from dgr.core.errors import WireError

# The CA's certificate in a folder of `dgr certs init` (dgr.app.certs writes it; a deployment's plan looks for it)
CA_CERT = "ca.pem"


@dataclass(frozen=True)
class TlsConfig:
    cert: Path
    key: Path
    ca: Path | None = None          # with a CA: peers must present a certificate it signed

    def __post_init__(self) -> None:
        for f in ("cert", "key", "ca"):
            v = getattr(self, f)
            if v is not None and not isinstance(v, Path):
                object.__setattr__(self, f, Path(v))

    @classmethod
    def from_args(cls, cert: str | None, key: str | None, ca: str | None) -> "TlsConfig | None":
        """From `--tls-cert/--tls-key/--tls-ca` (all optional: none given means plaintext)."""
        if not cert and not key:
            if ca:
                raise WireError("--tls-ca needs --tls-cert and --tls-key (this side's own certificate)")
            return None
        if not (cert and key):
            raise WireError("give both --tls-cert and --tls-key (make them with `dgr certs issue`)")
        cfg = cls(Path(cert), Path(key), Path(ca) if ca else None)
        for what, p in (("--tls-cert", cfg.cert), ("--tls-key", cfg.key), ("--tls-ca", cfg.ca)):
            if p is not None and not p.is_file():
                raise WireError(f"{what} {p}: no such file (make one with `dgr certs init` / `dgr certs issue`)")
        return cfg

    @property
    def mutual(self) -> bool:
        return self.ca is not None

    def _read(self) -> tuple[bytes, bytes, bytes | None]:
        try:
            return self.cert.read_bytes(), self.key.read_bytes(), self.ca.read_bytes() if self.ca else None
        except OSError as err:
            raise WireError(f"cannot read TLS material: {err}") from None

    def server_credentials(self) -> grpc.ServerCredentials:
        cert, key, ca = self._read()
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=ca is not None)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        cert, key, ca = self._read()
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


def is_loopback(host: str) -> bool:
    """Whether a listen host stays on this machine (names and literal addresses)."""
    h = host.strip("[]")
    if h in ("localhost", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False


def check_listen(listen: str, tls: TlsConfig | None, insecure: bool) -> None:
    """Refuse a plaintext listener that other machines can reach unless `--insecure` says so."""
    host = listen.rpartition(":")[0]
    if tls is None and not insecure and not is_loopback(host):
        raise WireError(f"refusing to listen on {listen} without TLS: anyone who reaches it could read and forge "
                        "boundaries. Give --tls-cert/--tls-key (and --tls-ca for mutual TLS; `dgr certs` makes "
                        "them), or --insecure to accept plaintext on a network you trust")


def add_port(server: grpc.Server, listen: str, tls: TlsConfig | None) -> int:
    """Bind `listen` on `server` (TLS when configured); the bound port, 0 when binding failed."""
    try:
        if tls is None:
            return server.add_insecure_port(listen)
        return server.add_secure_port(listen, tls.server_credentials())
    except RuntimeError:
        return 0


def channel(address: str, tls: TlsConfig | None, options: list[tuple[str, object]] | None = None) -> grpc.Channel:
    """A channel to `address`: plaintext, or TLS checked against the configured CA. Every channel has its
    own connection (a local subchannel pool): by default gRPC shares one connection among all channels of
    a process with the same target and arguments, so a new channel to a worker restarted in place would
    inherit the old one's "connection refused" and its reconnect backoff, and fail at once."""
    opts = list(options or [])
    if not any(k == "grpc.use_local_subchannel_pool" for k, _ in opts):
        opts.append(("grpc.use_local_subchannel_pool", 1))
    if tls is None:
        return grpc.insecure_channel(address, options=opts)
    return grpc.secure_channel(address, tls.channel_credentials(), options=opts)


def peer_identity(context: grpc.ServicerContext) -> str | None:
    """Who is on the other end of an RPC: the member name (common name) of its verified client
    certificate, or None without mTLS. Members on one host share their address names, not this."""
    try:
        auth = context.auth_context()
    except Exception:  # noqa: BLE001  (a context without an auth context: plaintext)
        return None
    names = auth.get("x509_common_name") or []
    if not names:
        return None
    return ",".join(sorted(n.decode(errors="replace") if isinstance(n, bytes) else str(n) for n in names))
