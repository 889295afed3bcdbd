"""TLS on a route of real worker processes (certificates from `dgr certs` in tmp): the text equals a
plaintext route's, and with mutual TLS a client without a certificate, or with one from another CA, is
refused with a clear error on the client side."""

from __future__ import annotations

import subprocess
import sys

import pytest

from dgr.runtime.wire.client import RouteClient
from dgr.runtime.wire.errors import HopUnreachable
from dgr.runtime.wire.tls import TlsConfig

from support.route import PROMPT, SAMPLED, fake_route, make_ca, reference, tls_args


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    root = tmp_path_factory.mktemp("pki")
    ops = make_ca(root, "ops", ["w0", "w1", "w2", "client"])
    other = make_ca(root, "other", ["client"])
    return {"ops": ops, "ops_ca": root / "ops" / "ca.pem", "other": other, "other_ca": root / "other" / "ca.pem"}


@pytest.fixture(scope="module")
def mtls_route(pki):
    with fake_route(extra=lambda stage, _rep: tls_args(*pki["ops"][f"w{stage}"], pki["ops_ca"])) as r:
        yield r


def test_tls_route_generates_the_same_text_as_plaintext(pki, mtls_route):
    with fake_route() as plain:
        want = [reference(plain, max_new_tokens=40), reference(plain, max_new_tokens=40, **SAMPLED),
                reference(plain, max_new_tokens=40, stop_token_ids=None)]     # as `dgr generate`: stops at EOS
    tls = TlsConfig(*pki["ops"]["client"], pki["ops_ca"])
    with RouteClient(mtls_route.addresses, tls=tls) as c:
        got = [c.run(PROMPT, max_new_tokens=40, stop_token_ids=[]),
               c.run(PROMPT, max_new_tokens=40, stop_token_ids=[], **SAMPLED)]
        assert all(d.tls and d.mutual_tls for d in c.describe())
    assert [g.text for g in got] == [w.text for w in want[:2]]
    assert [g.token_ids for g in got] == [w.token_ids for w in want[:2]]
    cert, key = pki["ops"]["client"]
    out = subprocess.run([sys.executable, "-m", "dgr", "generate", "--route", mtls_route.route, "--max-tokens", "40",
                          *tls_args(cert, key, pki["ops_ca"]), PROMPT], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout == want[2].text + "\n"


@pytest.mark.parametrize("who", ["plaintext", "another CA"])
def test_mtls_refuses_a_client_without_a_certificate_or_from_another_ca(pki, mtls_route, who):
    tls = None if who == "plaintext" else TlsConfig(*pki["other"]["client"], pki["ops_ca"])
    with RouteClient(mtls_route.addresses, tls=tls) as c:
        with pytest.raises(HopUnreachable) as err:
            c.run(PROMPT, max_new_tokens=4)
    msg = str(err.value)
    print(f"\n{who}: {msg}")
    assert f"stage 0 ({mtls_route.addresses[0]})" in msg and "TLS refused" in msg, msg
    if who == "plaintext":
        assert "--tls-cert" in msg
    else:
        assert "CA the worker trusts" in msg


def test_cli_without_certificate_is_refused_clearly(mtls_route):
    out = subprocess.run([sys.executable, "-m", "dgr", "generate", "--route", mtls_route.route, PROMPT],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "TLS refused" in out.stderr and "Traceback" not in out.stderr, out.stderr
