"""A local certificate authority for a mesh operator: `dgr certs init DIR` makes the CA, `dgr certs
issue DIR NAME --host H...` a key and certificate that workers and clients present (mutual TLS).

Files in DIR: `ca.pem` (give it to every peer as --tls-ca), `ca.key` (keep it private: it signs
members), and per member `NAME.pem` + `NAME.key`. Keys are EC P-256; certificates carry the hosts as
subject alternative names (DNS names, or IP addresses) and serve as both server and client certificate.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import re
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from dgr.core.errors import DgrError
from dgr.runtime.wire.tls import CA_CERT

CA_KEY = "ca.key"
VALID_DAYS = 825
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


class CertError(DgrError):
    """A certificate could not be made or read: names the file and what to do."""


def _write_private(path: Path, data: bytes) -> None:
    """Write a key readable by its owner only, never leaving a half-written file under its name."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _write_public(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _key():
    return ec.generate_private_key(ec.SECP256R1())


def _pem_key(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def init(directory: str | Path, *, name: str = "dgr mesh CA", force: bool = False) -> Path:
    """Make a CA in `directory` (refuses to replace one unless `force`); returns the CA certificate."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    if (d / CA_KEY).exists() and not force:
        raise CertError(f"{d / CA_KEY} exists: this folder already holds a CA (its members would stop being "
                        "trusted if it were replaced); use another folder, or --force to replace it")
    key = _key()
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(_now() - dt.timedelta(minutes=5))
            .not_valid_after(_now() + dt.timedelta(days=VALID_DAYS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, encipher_only=False,
                                         decipher_only=False), critical=True)
            .sign(key, hashes.SHA256()))
    _write_private(d / CA_KEY, _pem_key(key))
    _write_public(d / CA_CERT, cert.public_bytes(serialization.Encoding.PEM))
    return d / CA_CERT


def _san(host: str):
    try:
        return x509.IPAddress(ipaddress.ip_address(host.strip("[]")))
    except ValueError:
        return x509.DNSName(host)


def issue(directory: str | Path, name: str, hosts: list[str]) -> tuple[Path, Path]:
    """A key and certificate for member `name`, valid for `hosts`, signed by the CA in `directory`."""
    d = Path(directory)
    if not _NAME.match(name) or name in ("ca",):
        raise CertError(f"member name {name!r}: use letters, digits, '.', '_' or '-' (not 'ca')")
    if not hosts:
        raise CertError("give at least one --host (the address peers use to reach this member, e.g. 127.0.0.1)")
    try:
        ca_key = serialization.load_pem_private_key((d / CA_KEY).read_bytes(), password=None)
        ca_cert = x509.load_pem_x509_certificate((d / CA_CERT).read_bytes())
    except FileNotFoundError:
        raise CertError(f"{d} holds no CA ({CA_CERT} + {CA_KEY}); make one with `dgr certs init {d}`") from None
    except ValueError as err:
        raise CertError(f"{d}: the CA files are not readable PEM ({err})") from None
    key = _key()
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(ca_cert.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(_now() - dt.timedelta(minutes=5))
            .not_valid_after(_now() + dt.timedelta(days=VALID_DAYS))
            .add_extension(x509.SubjectAlternativeName([_san(h) for h in hosts]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                  ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    _write_private(d / f"{name}.key", _pem_key(key))
    _write_public(d / f"{name}.pem", cert.public_bytes(serialization.Encoding.PEM))
    return d / f"{name}.pem", d / f"{name}.key"
