"""Which of a deployment's hosts are this machine, and whether a port is free to listen on here."""

from __future__ import annotations

import functools
import ipaddress
import socket


@functools.lru_cache(maxsize=256)
def is_this_machine(address: str) -> bool:
    """True for loopback, this machine's names, and addresses this machine can bind (its own IPs)."""
    a = address.strip("[]")
    if a in ("localhost", socket.gethostname(), socket.getfqdn()):
        return True
    try:
        ip = ipaddress.ip_address(a)
    except ValueError:
        try:
            ip = ipaddress.ip_address(socket.getaddrinfo(a, None)[0][4][0])
        except (OSError, ValueError, IndexError):
            return False       # a name that does not resolve here is some other machine's
    if ip.is_loopback:
        return True
    # Binding succeeds only to an address of one of this machine's interfaces.
    fam = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
    with socket.socket(fam, socket.SOCK_STREAM) as s:
        try:
            s.bind((str(ip), 0))
            return True
        except OSError:
            return False


def port_free(host: str, port: int) -> bool:
    """Whether a listener could bind `host:port` now (a worker there would not fail to start)."""
    fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(fam, socket.SOCK_STREAM) as s:
        # as gRPC's servers do: connections of an earlier listener in TIME_WAIT do not block a new one,
        # a live listener does
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host.strip("[]"), port))
            return True
        except OSError:
            return False


def free_port(host: str) -> int:
    """A port free on `host` now (the kernel's pick), for workers whose file says port 0."""
    fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(fam, socket.SOCK_STREAM) as s:
        s.bind((host.strip("[]"), 0))
        return s.getsockname()[1]
