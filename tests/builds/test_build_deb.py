"""The Debian package dgr-worker_<version>_<arch>.deb (issue 37 item 2; docs/deploy.md "Debian package";
tools/dgr/app/deploy/debian/).

Fast: a package of a stand-in release (the checkout's worker and engine) built twice is the same bytes; its
files, modes, control fields, Depends (dpkg-shlibdeps), conffiles and md5sums; lintian says nothing (where
lintian is installed: skipped, saying so, where not); the unit template passes `systemd-analyze verify` and
carries the rendered units' restart policy and hardening; `dgr-worker-check-config` accepts a good instance
file and refuses each kind of bad one, naming the file and the setting.

Slow (the real release, root): the package installed with `dpkg --root` into a minimal root, the image's
first layer (the loader and the libraries, nothing of dgr; tests/builds/test_build_image.py) plus sh and id (what
the check script runs), whose dpkg database lists the packages those libraries came from, so that the
package's Depends are met for what they are; the user and folders made from its sysusers.d and tmpfiles.d
files with systemd's own tools (`--root`: what its postinst does on a real host); then, there being no
systemd here, the unit's ExecStartPre and ExecStart command lines taken from the installed unit, their
specifiers and variables expanded as systemd does from its EnvironmentFiles, and run by hand in a chroot of
that root as the unit's user: the check passes and the worker serves stage 1 of SmolLM2 between two ordinary
workers, generating what three ordinary workers do. Then `dpkg --verify` and a purge that leaves nothing.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from dgr.app.deploy import debian, systemd
from dgr.toolchain import image as oci
from dgr.toolchain import rootfs
from support.images import (Process, container_command, require_root, routes_around, same_generation,
                            synthetic_release)
from support.paths import REPO


def _dgr(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dgr", *args], capture_output=True, text=True, timeout=600,
                          env={**os.environ, **(env or {})})


def _field(deb: Path, name: str) -> str:
    return subprocess.run(["dpkg-deb", "--field", str(deb), name], capture_output=True, text=True,
                          check=True).stdout.strip()


@pytest.fixture(scope="module")
def stand_in_deb(tmp_path_factory, worker_bin, engine_lib) -> Path:
    tmp = tmp_path_factory.mktemp("deb")
    release = synthetic_release(tmp, Path(worker_bin), Path(engine_lib), version="0.0.1")
    out = _dgr("release", "deb", "--release", str(release), "--out", str(tmp / "one"))
    assert out.returncode == 0, out.stderr
    again = _dgr("release", "deb", "--release", str(release), "--out", str(tmp / "two"))
    assert again.returncode == 0, again.stderr
    deb = tmp / "one/dgr-worker_0.0.1_amd64.deb"
    assert deb.read_bytes() == (tmp / "two" / deb.name).read_bytes(), "two builds differ"
    return deb


def test_the_package_holds_the_worker_the_unit_and_its_setup(stand_in_deb, worker_bin, engine_lib, tmp_path):
    deb = stand_in_deb
    listing = subprocess.run(["dpkg-deb", "--contents", str(deb)], capture_output=True, text=True,
                             check=True).stdout.splitlines()
    entries = {ln.split()[-1].removeprefix("./"): ln.split() for ln in listing if not ln.endswith("./")}
    want = {"opt/dgr/bin/dgr-worker": "-rwxr-xr-x", "opt/dgr/bin/dgr-worker-check-config": "-rwxr-xr-x",
            "opt/dgr/lib/libdgr_engine.so": "-rw-r--r--", "lib/systemd/system/dgr-worker@.service": "-rw-r--r--",
            "etc/dgr/worker.conf": "-rw-r--r--", "usr/lib/sysusers.d/dgr-worker.conf": "-rw-r--r--",
            "usr/lib/tmpfiles.d/dgr-worker.conf": "-rw-r--r--", "usr/share/doc/dgr-worker/copyright": "-rw-r--r--",
            "usr/share/doc/dgr-worker/changelog.gz": "-rw-r--r--",
            "usr/share/doc/dgr-worker/examples/worker-0.conf": "-rw-r--r--"}
    for path, mode in want.items():
        assert path in entries, f"{path} is not in the package"
        assert entries[path][0] == mode and entries[path][1] == "root/root", entries[path]
    assert not [p for p in entries if "python" in p]
    assert _field(deb, "Package") == "dgr-worker" and _field(deb, "Architecture") == "amd64"
    depends = _field(deb, "Depends")
    for pkg in ("libc6 (>=", "libgrpc++1.51", "libprotobuf32", "libssl3", "libgomp1", "libstdc++6"):
        assert pkg in depends, depends
    control = tmp_path / "DEBIAN"
    subprocess.run(["dpkg-deb", "--control", str(deb), str(control)], check=True)
    assert (control / "conffiles").read_text() == "/etc/dgr/worker.conf\n"
    sums = dict(reversed(ln.split("  ", 1)) for ln in (control / "md5sums").read_text().splitlines())
    assert sums["opt/dgr/bin/dgr-worker"] == hashlib.md5(Path(worker_bin).read_bytes()).hexdigest()
    assert sums["opt/dgr/lib/libdgr_engine.so"] == hashlib.md5(Path(engine_lib).read_bytes()).hexdigest()
    for script in ("postinst", "postrm"):
        assert "DPKG_ROOT" in (control / script).read_text(), f"{script} must leave the host alone under dpkg --root"


def test_lintian_says_nothing(stand_in_deb):
    tool = shutil.which("lintian")
    if tool is None:
        pytest.skip("lintian is not installed (Debian: apt-get install lintian); the package was built but not linted")
    proc = subprocess.run([tool, "--fail-on", "error,warning", str(stand_in_deb)], capture_output=True, text=True,
                          timeout=600)
    said = [ln for ln in proc.stdout.splitlines() if re.match(r"^[EWI]: ", ln)]
    assert proc.returncode == 0 and not said, proc.stdout + proc.stderr


def test_the_unit_template_verifies_and_has_the_rendered_units_hardening(tmp_path, worker_bin):
    prefix = tmp_path / "prefix"
    (prefix / "bin").mkdir(parents=True)
    (prefix / "bin/dgr-worker").symlink_to(worker_bin)
    (prefix / "bin/dgr-worker-check-config").write_text("#!/bin/sh\n")
    (prefix / "bin/dgr-worker-check-config").chmod(0o755)
    unit = debian.unit_text(str(prefix))
    lines = unit.splitlines()
    for line in [*systemd.RESTART, *systemd.hardening(read_only=None, lane="cpu", memory_max=None),
                 "User=dgr-worker", "EnvironmentFile=/etc/dgr/worker-%i.conf", "StateDirectory=dgr/state/%i"]:
        assert line in lines, line
    assert "@" not in unit.replace("dgr-worker@", "")
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("systemd-analyze is not installed (Debian: apt-get install systemd); the unit was not verified")
    for name in ("dgr-worker@.service", "dgr-worker@1.service"):
        (tmp_path / name).write_text(unit)
        proc = subprocess.run([tool, "verify", str(tmp_path / name)], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0 and name not in proc.stdout + proc.stderr, proc.stdout + proc.stderr


# ---- dgr-worker-check-config

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def check(tmp_path, worker_bin, engine_lib):
    """Run the package's check script (its prefix: a folder whose bin/dgr-worker is the checkout's) on an
    instance file for stage 1 of a tiny real bundle; returns (exit status, output). In the instance text,
    @BUNDLE@ is the bundle, @PORT@ a free port, @TLS@ the flags of a member certificate, @TMP@ the folder."""
    from support.engine import make_bundle, synth_model
    from support.worker import make_ca, tls_flags

    prefix = tmp_path / "prefix"
    (prefix / "bin").mkdir(parents=True)
    (prefix / "bin/dgr-worker").symlink_to(worker_bin)
    script = tmp_path / "dgr-worker-check-config"
    script.write_text((debian.HERE / "dgr-worker-check-config").read_text().replace("@PREFIX@", str(prefix)))
    conf = tmp_path / "etc"
    conf.mkdir()
    (conf / "worker.conf").write_text((debian.HERE / "worker.conf").read_text())
    bundle = make_bundle(synth_model(tmp_path, "llama", layers=6), [(0, 2), (2, 4), (4, 6)], tmp_path / "srv").root
    tls = " ".join(map(str, tls_flags(make_ca(tmp_path / "pki", ["w1"])["w1"])))
    port = _free_port()

    def run(text: str, instance: str = "1") -> tuple[int, str]:
        for k, v in {"@BUNDLE@": str(bundle), "@PORT@": str(port), "@TLS@": tls, "@TMP@": str(tmp_path)}.items():
            text = text.replace(k, v)
        (conf / f"worker-{instance}.conf").write_text(text)
        proc = subprocess.run(["sh", str(script), instance], capture_output=True, text=True, timeout=120,
                              env={"PATH": os.environ["PATH"], "DGR_CONF_DIR": str(conf),
                                   "DGR_ENGINE_LIB": str(engine_lib)})
        return proc.returncode, proc.stdout + proc.stderr

    run.bundle = bundle
    return run


GOOD = "# stage 1\nDGR_BUNDLE=@BUNDLE@\nDGR_STAGE=1\nDGR_LISTEN=127.0.0.1:@PORT@\nDGR_ARGS=\"--threads 1 --n-ctx 256\"\n"


def test_check_config_accepts_a_good_instance(check):
    """dgr-worker --check-config itself checks the stage file and opens the stage; nothing is served."""
    rc, out = check(GOOD)
    assert rc == 0, out
    assert out.startswith("ok: dgr-worker@1: stage 1 [2, 4) of ") and "the stage file matches the manifest" in out, out
    assert "(plaintext)" in out and "0 file(s) named by flags readable" in out, out
    rc, out = check(GOOD.replace("127.0.0.1", "0.0.0.0") + "DGR_ARGS='--threads 1 @TLS@'\n")
    assert rc == 0 and "(mutual TLS)" in out and "3 file(s) named by flags readable" in out, out


@pytest.mark.parametrize("change, says", [
    (lambda t: t.replace("DGR_STAGE=1\n", ""), "DGR_STAGE is not set"),
    (lambda t: t.replace("DGR_STAGE=1", "DGR_STAGE=one"), "DGR_STAGE=one: a stage number"),
    (lambda t: t.replace(":@PORT@", ":0"), "a fixed port from 1 to 65535"),
    (lambda t: t.replace(":@PORT@", ""), "DGR_LISTEN=127.0.0.1: HOST:PORT"),
    (lambda t: t.replace("@BUNDLE@", "/home/me/bundle"), "ProtectHome hides it"),
    (lambda t: t.replace("@BUNDLE@", "@BUNDLE@-missing"), "no such folder"),
    (lambda t: t.replace("@BUNDLE@", "@TMP@"), "no manifest.json"),
    (lambda t: t + "DGR_THREADS=4\n", "DGR_THREADS is not a setting"),
    (lambda t: t + "DGR_ARGS=--tls-ca @TMP@/missing.pem\n", "--tls-ca @TMP@/missing.pem: not readable"),
    # dgr-worker's own checks, through --check-config
    (lambda t: t.replace("127.0.0.1", "0.0.0.0"), "dgr-worker refuses this configuration: refusing to listen on 0.0.0.0:"),
    (lambda t: t.replace("--threads 1", "--threads two"), "dgr-worker refuses this configuration: argument --threads"),
    (lambda t: t.replace("--threads 1", "--no-such-flag"), "unrecognized argument: --no-such-flag"),
    (lambda t: t.replace("DGR_STAGE=1", "DGR_STAGE=7"), "has 3 stages (0..2); there is no stage 7"),
    (lambda t: t + "DGR_ARGS='--tls-cert @TMP@/etc/worker.conf --tls-key @TMP@/etc/worker.conf'\n",
     "dgr-worker refuses this configuration: "),
])
def test_check_config_refuses_a_bad_instance_naming_it(check, tmp_path, change, says):
    rc, out = check(change(GOOD))
    assert rc == 1, out
    assert out.startswith("dgr-worker-check-config: ") and says.replace("@TMP@", str(tmp_path)) in out, out


def test_check_config_finds_a_stage_file_that_is_not_the_manifests(check):
    """A changed byte in the stage file: the worker would refuse to start, so the check refuses it first."""
    f = check.bundle / "stage-01-of-03.gguf"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))
    rc, out = check(GOOD)
    assert rc == 1 and "dgr-worker refuses this configuration: " in out and "stage-01-of-03.gguf" in out, out


def test_check_config_without_the_instance_file_says_what_to_copy(check, tmp_path):
    (tmp_path / "etc/worker-1.conf").unlink(missing_ok=True)
    proc = subprocess.run(["sh", str(tmp_path / "dgr-worker-check-config"), "7"], capture_output=True, text=True,
                          env={"PATH": os.environ["PATH"], "DGR_CONF_DIR": str(tmp_path / "etc")})
    assert proc.returncode == 1 and "worker-7.conf: cannot be read" in proc.stderr
    assert "examples/worker-0.conf" in proc.stderr


# ---- installed and started (the real release)

def _minimal_root(release: Path, root: Path) -> dict:
    """The image's first layer (loader, libraries, users, mount points), plus sh and id with their libraries,
    and a dpkg database that lists the Debian packages of those libraries; returns the image record."""
    img = oci.build(oci.read_release(str(release)))
    layout = root.parent / "layout"
    img.write_layout(str(layout))
    manifest = json.loads(img.blobs[img.digest])
    first = layout / "blobs/sha256" / manifest["layers"][0]["digest"][7:]
    root.mkdir()
    subprocess.run(["tar", "--numeric-owner", "-C", str(root), "-xzf", str(first)], check=True)
    assert not (root / "opt").exists(), "the first layer holds nothing of dgr"
    tools = rootfs.Tree()
    shell = os.path.realpath(shutil.which("sh"))
    for exe in (shell, shutil.which("id")):
        tools.host_path(exe)
        loader = rootfs.elf_interpreter(Path(exe).read_bytes())
        for lib in rootfs.library_closure([exe], loader):
            tools.host_path(lib)
    tools.put("usr/bin/sh", rootfs.Node("link", 0o777, target=os.path.basename(shell)))
    tools.put("bin", rootfs.Node("link", 0o777, target="usr/bin"))
    extra = root.parent / "tools.tar"
    extra.write_bytes(tools.layer(0))
    subprocess.run(["tar", "--numeric-owner", "-C", str(root), "-xf", str(extra)], check=True)
    dpkg = root / "var/lib/dpkg"
    for d in ("info", "updates", "triggers"):
        (dpkg / d).mkdir(parents=True, exist_ok=True)
    (dpkg / "available").touch()
    owned: dict[str, list[str]] = {}
    for lib, owner in img.record["libraries"].items():
        owned.setdefault(owner["package"], []).append(lib)
    stanzas = []
    for pkg, libs in sorted(owned.items()):
        stanza = subprocess.run(["dpkg-query", "-s", pkg], capture_output=True, text=True, check=True).stdout
        stanzas.append(stanza.rstrip("\n") + "\n")
        same = "\nMulti-Arch: same\n" in stanza
        (dpkg / "info" / (f"{pkg}:amd64.list" if same else f"{pkg}.list")).write_text("".join(f"{x}\n" for x in libs))
    (dpkg / "status").write_text("\n".join(stanzas))
    return img.record


def _systemd_words(line: str, env: dict[str, str], specifiers: dict[str, str]) -> list[str]:
    """An Exec line's argv as systemd makes it: specifiers, then ${VAR} as one word and $VAR as words
    (none where empty)."""
    for k, v in specifiers.items():
        line = line.replace(f"%{k}", v)
    out = []
    for word in shlex.split(line):
        m = re.fullmatch(r"\$([A-Za-z_][A-Za-z0-9_]*)", word)
        if m:
            out += env.get(m.group(1), "").split()
        else:
            out.append(re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}", lambda x: env.get(x.group(1), ""), word))
    return out


def _environment_file(path: Path) -> dict[str, str]:
    env = {}
    for line in path.read_text().splitlines():
        if line and not line.startswith(("#", ";")):
            k, _, v = line.partition("=")
            env[k] = v[1:-1] if len(v) > 1 and v[0] == v[-1] and v[0] in "'\"" else v
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.engine
def test_the_package_installs_into_a_minimal_root_and_its_unit_serves_a_stage_that_joins_a_route(
        release_cpu_tar, engine_lib, tmp_path):
    from dgr.app.demo import ensure_bundle

    require_root("installing the package into a root and running its unit there in a chroot")
    out = _dgr("release", "deb", "--release", str(release_cpu_tar), "--out", str(tmp_path / "deb"))
    assert out.returncode == 0, out.stderr
    print(out.stdout)
    (deb,) = (tmp_path / "deb").glob("dgr-worker_*_amd64.deb")
    root = tmp_path / "root"
    _minimal_root(release_cpu_tar, root)
    dpkg = ["dpkg", f"--root={root}", "--force-script-chrootless"]
    inst = subprocess.run([*dpkg, "-i", str(deb)], capture_output=True, text=True, timeout=300)
    assert inst.returncode == 0, inst.stdout + inst.stderr
    assert "dgr-worker (" in inst.stdout and "warning" not in inst.stderr, inst.stderr
    # what the postinst does on a real host (it leaves a --root install alone)
    for tool in (["systemd-sysusers", f"--root={root}", "dgr-worker.conf"],
                 ["systemd-tmpfiles", f"--root={root}", "--create", "dgr-worker.conf"]):
        made = subprocess.run(tool, capture_output=True, text=True, timeout=60)
        assert made.returncode == 0, made.stderr
    user = next(ln.split(":") for ln in (root / "etc/passwd").read_text().splitlines() if ln.startswith("dgr-worker:"))
    uid, gid = int(user[2]), int(user[3])
    assert 0 < uid < 1000, "a system user"
    tls = root / "etc/dgr/tls"
    assert (tls.stat().st_mode & 0o777, tls.stat().st_gid) == (0o750, gid)

    bundle = ensure_bundle(3, progress=False)[0].root
    inside = f"/var/lib/dgr/store/{bundle.name}"
    port = _free_port()
    (root / "etc/dgr/worker-1.conf").write_text(
        f"DGR_BUNDLE={inside}\nDGR_STAGE=1\nDGR_LISTEN=127.0.0.1:{port}\nDGR_ARGS=\"--threads 1 --n-ctx 512\"\n")
    unit = (root / "lib/systemd/system/dgr-worker@.service").read_text()
    service = dict(ln.split("=", 1) for ln in unit.split("[Service]")[1].split("[Install]")[0].splitlines()
                   if "=" in ln and not ln.startswith("#"))
    specifiers = {"i": "1", "S": "/var/lib"}
    env: dict[str, str] = {}
    for ln in unit.splitlines():
        if ln.startswith("EnvironmentFile="):
            env.update(_environment_file(root / ln.split("=", 1)[1].replace("%i", "1").lstrip("/")))
        elif ln.startswith("Environment="):
            k, v = ln.split("=", 1)[1].replace("%i", "1").replace("%S", "/var/lib").split("=", 1)
            env[k] = v
    state = root / ("var/lib/" + service["StateDirectory"].replace("%i", "1"))
    state.mkdir(parents=True)
    os.chown(state, uid, gid)
    config = {"config": {"User": f"{uid}:{gid}", "Env": ["PATH=/usr/sbin:/usr/bin:/sbin:/bin",
                                                         *(f"{k}={v}" for k, v in sorted(env.items()))]}}
    volumes = {inside: (bundle, True)}
    pre = _systemd_words(service["ExecStartPre"], env, specifiers)
    checked = subprocess.run(container_command(root, config, [], volumes=volumes, entrypoint=pre),
                             capture_output=True, text=True, timeout=120, env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"})
    assert checked.returncode == 0, checked.stdout + checked.stderr
    # dgr-worker --check-config ran in the root, as the unit's user: the stage file checked, the engine opened
    assert checked.stdout.startswith(f"ok: dgr-worker@1: stage 1 [10, 20) of {inside} (bundle "), checked.stdout
    assert f"would serve on 127.0.0.1:{port} (plaintext)" in checked.stdout, checked.stdout
    assert "the stage file matches the manifest" in checked.stdout, checked.stdout
    print("ExecStartPre:", shlex.join(pre), "->", checked.stdout.strip())

    start = _systemd_words(service["ExecStart"], env, specifiers)
    assert start == ["/opt/dgr/bin/dgr-worker", "serve", "--bundle", inside, "--stage", "1", "--listen",
                     f"127.0.0.1:{port}", "--threads", "1", "--n-ctx", "512"], start
    print("ExecStart:", shlex.join(start))
    worker = Process(container_command(root, config, [], volumes=volumes, entrypoint=start))

    def check(address: str) -> None:
        assert address == f"127.0.0.1:{port}"
        status = Path(f"/proc/{worker.proc.pid}/status").read_text()
        assert f"\nUid:\t{uid}\t{uid}\t{uid}\t{uid}\n" in status

    same_generation(*routes_around(bundle, engine_lib, worker, check))

    verify = subprocess.run(["dpkg", f"--root={root}", "--verify", "dgr-worker"], capture_output=True, text=True)
    assert verify.returncode == 0 and not verify.stdout, verify.stdout + verify.stderr
    purge = subprocess.run([*dpkg, "--purge", "dgr-worker"], capture_output=True, text=True, timeout=300)
    assert purge.returncode == 0, purge.stderr
    assert not (root / "opt/dgr").exists() and not (root / "etc/dgr/worker.conf").exists()
    assert not (root / "lib/systemd/system/dgr-worker@.service").exists()
