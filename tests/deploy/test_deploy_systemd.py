"""`dgr deploy render FILE --systemd DIR`: one unit per worker, checked by `systemd-analyze verify`, and the
ExecStart of a unit really serves its stage (run here with a stand-in release prefix whose
bin/dgr-worker is this checkout's worker)."""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dgr.app.deploy.control import health

from support.deploy import dgr, tiny_bundle, tiny_fixed_ports_file, write


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_bundle(tmp_path_factory.mktemp("tiny"))


def _file(tmp_path, tiny, *, tls: Path | None = None, port0: bool = False) -> str:
    return tiny_fixed_ports_file(tmp_path, tiny, tls, port0=port0, store=tiny.root.parent, worker="session_ttl = 120",
                                 name="d.toml")


def _prefix(tmp_path):
    """A stand-in for an extracted release: bin/dgr-worker runs this checkout's worker."""
    p = tmp_path / "opt" / "dgr"
    write(p / "bin" / "dgr-worker", f'#!/bin/sh\nexec {sys.executable} -m dgr.cli.main worker "$@"\n').chmod(0o755)
    return p


def _verify(files) -> None:
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("systemd-analyze is not installed (Debian: apt-get install systemd); the units were rendered "
                    "but not verified")
    proc = subprocess.run([tool, "verify", *map(str, files)], capture_output=True, text=True, timeout=120)
    # verify exits 0 even for ignored lines; anything it says about our files is a defect
    said = [ln for ln in (proc.stdout + proc.stderr).splitlines() if any(f.name in ln for f in files)]
    assert proc.returncode == 0 and not said, proc.stdout + proc.stderr


def _exec_start(unit: str) -> list[str]:
    line = next(ln for ln in unit.splitlines() if ln.startswith("ExecStart="))
    return shlex.split(line.removeprefix("ExecStart="))


def test_units_per_worker_pass_systemd_analyze_verify(tiny, tmp_path):
    prefix = _prefix(tmp_path)
    proc = dgr("deploy", "render", _file(tmp_path, tiny), "--systemd", str(tmp_path / "units"), "--prefix", str(prefix))
    assert proc.returncode == 0, proc.stderr
    files = sorted((tmp_path / "units").iterdir())
    assert [f.name for f in files] == ["dgr-tiny-s0-r0.service", "dgr-tiny-s1-r0.service", "dgr-tiny-s1-r1.service",
                                       "dgr-tiny-s2-r0.service", "dgr-tiny.target"]
    unit = files[1].read_text()
    for want in ("Restart=on-failure", "DynamicUser=yes", "ProtectHome=yes", "ProtectSystem=strict",
                 "LimitNOFILE=65536", "TasksMax=512", f"MemoryMax={(1 << 30) // 4 + (1 << 30)}",
                 "WantedBy=dgr-tiny.target", "TimeoutStopSec=10", "StateDirectory=dgr-tiny-s1-r0"):
        assert want in unit.splitlines(), want
    argv = _exec_start(unit)
    assert argv[:2] == [f"{prefix}/bin/dgr-worker", "serve"]
    assert argv[argv.index("--bundle") + 1] == str(tiny.root) and argv[argv.index("--listen") + 1] == "127.0.0.1:7510"
    assert argv[argv.index("--stage") + 1] == "1" and argv[argv.index("--threads") + 1] == "1"
    assert argv[argv.index("--prefix-cache-mib") + 1] == "256"           # the worker's own default
    assert "Wants=dgr-tiny-s0-r0.service dgr-tiny-s1-r0.service" in files[-1].read_text()
    assert "/home" not in "".join(f.read_text() for f in files)
    _verify(files)


def test_tls_material_reaches_the_dynamic_user_as_credentials(tiny, tmp_path):
    from dgr.app import certs
    certs.init(tmp_path / "ca")
    for name in ("s0-r0", "s1-r0", "s1-r1", "s2-r0"):
        certs.issue(tmp_path / "ca", name, ["127.0.0.1"])
    f = _file(tmp_path, tiny, tls=tmp_path / "ca")
    proc = dgr("deploy", "render", f, "--systemd", str(tmp_path / "units"), "--prefix", str(_prefix(tmp_path)))
    assert proc.returncode == 0, proc.stderr
    unit = (tmp_path / "units" / "dgr-tiny-s2-r0.service").read_text()
    assert f"LoadCredential=tls.key:{tmp_path / 'ca' / 's2-r0.key'}" in unit.splitlines()
    argv = _exec_start(unit)
    assert argv[argv.index("--tls-key") + 1] == "%d/tls.key" and argv[argv.index("--tls-ca") + 1] == "%d/ca.pem"
    _verify(sorted((tmp_path / "units").iterdir()))


def test_the_prefix_cache_is_set_in_the_worker_section(tiny, tmp_path):
    def with_cache(mib: int) -> str:
        f = Path(_file(tmp_path, tiny))
        f.write_text(f.read_text().replace("session_ttl = 120\n", f"session_ttl = 120\nprefix_cache_mib = {mib}\n"))
        return str(f)

    proc = dgr("deploy", "render", with_cache(0), "--systemd", str(tmp_path / "units"), "--prefix",
               str(_prefix(tmp_path)))
    assert proc.returncode == 0, proc.stderr
    argv = _exec_start((tmp_path / "units" / "dgr-tiny-s0-r0.service").read_text())
    assert argv[argv.index("--prefix-cache-mib") + 1] == "0"
    proc = dgr("deploy", "render", with_cache(-1), "--systemd", str(tmp_path / "u2"))
    assert proc.returncode != 0 and "prefix_cache_mib" in proc.stderr


def test_a_free_port_picked_at_up_cannot_go_into_a_unit(tiny, tmp_path):
    proc = dgr("deploy", "render", _file(tmp_path, tiny, port0=True), "--systemd", str(tmp_path / "u"))
    assert proc.returncode != 0
    assert "worker s0-r0: a unit needs a fixed port; give stages[...].port for stage 0" in proc.stderr


def test_a_units_exec_start_serves_its_stage(tiny, tmp_path, engine_lib):
    # What systemd would run, run here: the unit's own command line (the stand-in prefix's worker).
    prefix = _prefix(tmp_path)
    assert dgr("deploy", "render", _file(tmp_path, tiny), "--systemd", str(tmp_path / "u"),
               "--prefix", str(prefix)).returncode == 0
    argv = _exec_start((tmp_path / "u" / "dgr-tiny-s2-r0.service").read_text())
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while health("127.0.0.1:7520", timeout=0.5) != "SERVING":
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
            time.sleep(0.2)
    finally:
        proc.terminate()
        out = proc.communicate(timeout=30)[0]
    assert proc.returncode == 0, out
    assert "stage 2 [4, 6) of bundle" in out and "serving on 127.0.0.1:7520" in out
