"""The Debian package of a release's dgr-worker: `dgr release deb` (docs/deploy.md, "Debian package").

dgr-worker_<version>_<arch>.deb, from the CPU release archive (toolchains/bazel/release.py), installs
    /opt/dgr/bin/dgr-worker, /opt/dgr/lib/libdgr_engine.so   the release's, checked against its MANIFEST.json
    /opt/dgr/bin/dgr-worker-check-config                    the configuration check the unit runs first
    /opt/dgr/release.json, /opt/dgr/upstream.json           what the release says it is
    /lib/systemd/system/dgr-worker@.service                 one stage per instance; the sandbox and limits
                                                            of the rendered units (systemd.hardening)
    /etc/dgr/worker.conf                                    the conffile: flags every instance gets
    /usr/lib/sysusers.d/dgr-worker.conf                     the system user dgr-worker
    /usr/lib/tmpfiles.d/dgr-worker.conf                     /var/lib/dgr/store, /etc/dgr/tls (0750, its group)
    /usr/share/doc/dgr-worker/                              copyright, changelog.gz, README.Debian,
                                                            examples/worker-0.conf (an instance's file)
at /opt/dgr: the prefix `dgr deploy render --systemd` and the container image use (an add-on package's
place in the FHS; the lintian override says so). The files beside this module are the package's text;
@PREFIX@, @RESTART@ and @HARDENING@ are filled in here.

Depends: `dpkg-shlibdeps` over the worker and the engine (each library's package, at the version its
symbols need); where it is missing, the packages `dpkg-query -S` names for the loader's closure
(dgr.toolchain.image.release_libraries), unversioned. Same release and host, same bytes: every file's time
is SOURCE_DATE_EPOCH, else the checkout's last commit's (`epoch`), modes are set here, owners are root
(`dpkg-deb --root-owner-group`), and dpkg-deb sorts the members and takes SOURCE_DATE_EPOCH for the
archive's own times.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from dgr.app.deploy.systemd import DEFAULT_PREFIX, RESTART, hardening
from dgr.core.errors import ReleaseError
from dgr.core.paths import REPO_ROOT
from dgr.toolchain import image as oci, rootfs

PACKAGE = "dgr-worker"
HERE = Path(__file__).resolve().parent
MAINTAINER = "dgr authors <dgr@example.org>"
UNIT = f"lib/systemd/system/{PACKAGE}@.service"
CONFFILES = ("etc/dgr/worker.conf",)
DOC = f"usr/share/doc/{PACKAGE}"
DESCRIPTION = """\
dgr stage worker: one stage of a GGUF model over gRPC (CPU)
 dgr runs a language model as a route of stages on several hosts. This
 package serves stages of a bundle on this host: dgr-worker (C++, no Python)
 and its engine library (llama.cpp, CPU lane, built for x86-64-v3), as the
 systemd instances dgr-worker@INSTANCE, each configured by
 /etc/dgr/worker-INSTANCE.conf."""


def epoch() -> int:
    """The package's time: SOURCE_DATE_EPOCH; else the time of this checkout's last commit, the date of the
    source (the image can say 1970, but Debian's tools refuse a package of files that old: lintian's
    package-contains-ancient-file); else 0."""
    if "SOURCE_DATE_EPOCH" in os.environ:
        return oci.source_date_epoch()
    git = shutil.which("git")
    if git and (REPO_ROOT / ".git").exists():
        out = subprocess.run([git, "-C", str(REPO_ROOT), "log", "-1", "--format=%ct"], capture_output=True, text=True)
        if out.returncode == 0 and out.stdout.strip().isdigit():
            return int(out.stdout.strip())
    return 0


def _text(name: str) -> str:
    return (HERE / name).read_text()


def unit_text(prefix: str = DEFAULT_PREFIX) -> str:
    """dgr-worker@.service: the template beside this module with the rendered units' restart policy and
    hardening (a CPU host's: no devices; no bundle path or memory bound of its own)."""
    text = _text("dgr-worker@.service").replace("@PREFIX@", prefix)
    text = text.replace("@RESTART@", "\n".join(RESTART))
    return text.replace("@HARDENING@", "\n".join(hardening(read_only=None, lane="cpu", memory_max=None)))


def _files(release: oci.Release, prefix: str, mtime: int) -> dict[str, tuple[bytes, int]]:
    """Package path (no leading /) -> (bytes, mode)."""
    p = prefix.strip("/")
    up = json.loads(release.files["upstream.json"])
    date = time.strftime("%a, %d %b %Y %H:%M:%S +0000", time.gmtime(mtime))
    changelog = (f"{PACKAGE} ({release.version}) unstable; urgency=medium\n\n"
                 f"  * dgr {release.version}, {release.lane} lane: llama.cpp {up.get('commit', '?')[:12]} with "
                 f"{len(up.get('patches', []))} patches\n    (/{p}/upstream.json).\n\n"
                 f" -- {MAINTAINER}  {date}\n")
    return {
        f"{p}/bin/dgr-worker": (release.files["bin/dgr-worker"], 0o755),
        f"{p}/bin/dgr-worker-check-config": (_text("dgr-worker-check-config").replace("@PREFIX@", prefix).encode(), 0o755),
        f"{p}/lib/libdgr_engine.so": (release.files["lib/libdgr_engine.so"], 0o644),
        f"{p}/release.json": (release.files["release.json"], 0o644),
        f"{p}/upstream.json": (release.files["upstream.json"], 0o644),
        UNIT: (unit_text(prefix).encode(), 0o644),
        "etc/dgr/worker.conf": (_text("worker.conf").encode(), 0o644),
        f"usr/lib/sysusers.d/{PACKAGE}.conf": (_text("sysusers.conf").encode(), 0o644),
        f"usr/lib/tmpfiles.d/{PACKAGE}.conf": (_text("tmpfiles.conf").encode(), 0o644),
        f"{DOC}/copyright": (_text("copyright").encode(), 0o644),
        f"{DOC}/README.Debian": (_text("README.Debian").encode(), 0o644),
        f"{DOC}/examples/worker-0.conf": (_text("worker-0.conf").encode(), 0o644),
        f"{DOC}/changelog.gz": (_gzip(changelog.encode()), 0o644),
        f"usr/share/lintian/overrides/{PACKAGE}": (_text("lintian-overrides").encode(), 0o644),
    }


def _gzip(data: bytes) -> bytes:
    out = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=out, mtime=0, compresslevel=9) as gz:
        gz.write(data)
    return out.getvalue()


def depends(release: oci.Release, root: Path, elf: list[str], arch: str) -> str:
    """The Depends field: dpkg-shlibdeps over `elf` (paths in the package tree `root`), else the packages
    that own the loader's closure."""
    if shutil.which("dpkg-shlibdeps"):
        with tempfile.TemporaryDirectory() as src:
            (Path(src) / "debian").mkdir()
            (Path(src) / "debian/control").write_text(f"Source: {PACKAGE}\n\nPackage: {PACKAGE}\nArchitecture: {arch}\n")
            out = subprocess.run(["dpkg-shlibdeps", "-O", *(f"-e{root / e}" for e in elf)], cwd=src,
                                 capture_output=True, text=True, env={**os.environ, "LC_ALL": "C"})
        if out.returncode != 0:
            raise ReleaseError(f"dpkg-shlibdeps failed ({out.returncode}): {out.stderr.strip()}")
        for line in out.stdout.splitlines():
            if line.startswith("shlibs:Depends="):
                return line.split("=", 1)[1]
        raise ReleaseError(f"dpkg-shlibdeps printed no shlibs:Depends: {out.stdout.strip()} {out.stderr.strip()}")
    owners = rootfs.debian_packages(oci.release_libraries(release))
    if not owners:
        raise ReleaseError("neither dpkg-shlibdeps (Debian: apt-get install dpkg-dev) nor dpkg-query is here: "
                           "the package's Depends cannot be computed; build it on a Debian host")
    return ", ".join(sorted({pkg for pkg, _ in owners.values()}))


def _control(release: oci.Release, arch: str, files: dict[str, tuple[bytes, int]], deps: str) -> str:
    dirs = {str(Path(f).parent) for f in files}
    dirs = {"/".join(d.split("/")[:i]) for d in dirs for i in range(1, d.count("/") + 2)}
    size = sum(-(-len(data) // 1024) for data, _ in files.values()) + len(dirs)
    return (f"Package: {PACKAGE}\nVersion: {release.version}\nArchitecture: {arch}\nMaintainer: {MAINTAINER}\n"
            f"Installed-Size: {size}\nDepends: {deps}\nSection: net\nPriority: optional\n"
            f"Description: {DESCRIPTION}\n")


def build_deb(archive: str | Path, out: str | Path, *, prefix: str = DEFAULT_PREFIX) -> Path:
    """dgr-worker_<version>_<arch>.deb of release `archive`, written into `out`; returns its path."""
    try:
        release = oci.read_release(str(archive))
        if release.lane != "cpu":
            raise oci.ImageError(f"{release.name}: a {release.lane} release; the Debian package is the CPU lane's "
                                 f"(a {release.lane} one would depend on its driver's packages, which no host here has)")
        arch = oci.check_release(release)
        mtime = epoch()
    except oci.ImageError as err:
        raise ReleaseError(str(err)) from err
    if not shutil.which("dpkg-deb"):
        raise ReleaseError("dpkg-deb is not installed (Debian: it is part of dpkg): the package is built with it")
    files = _files(release, prefix, mtime)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    deb = out / f"{PACKAGE}_{release.version}_{arch}.deb"
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "pkg"
        for path, (data, mode) in files.items():
            (root / path).parent.mkdir(parents=True, exist_ok=True)
            (root / path).write_bytes(data)
            os.chmod(root / path, mode)
        p = prefix.strip("/")
        deps = depends(release, root, [f"{p}/bin/dgr-worker", f"{p}/lib/libdgr_engine.so"], arch)
        control = root / "DEBIAN"
        control.mkdir()
        (control / "control").write_text(_control(release, arch, files, deps))
        (control / "conffiles").write_text("".join(f"/{c}\n" for c in CONFFILES))
        (control / "md5sums").write_text("".join(f"{hashlib.md5(data).hexdigest()}  {path}\n"
                                                 for path, (data, _) in sorted(files.items())))
        for script in ("postinst", "postrm"):
            (control / script).write_text(_text(script))
            os.chmod(control / script, 0o755)
        for f in control.iterdir():
            if f.name not in ("postinst", "postrm"):
                os.chmod(f, 0o644)
        for d, subdirs, names in os.walk(root):
            os.chmod(d, 0o755)
            for n in names + subdirs:
                os.utime(os.path.join(d, n), (mtime, mtime), follow_symlinks=False)
        os.utime(root, (mtime, mtime))
        env = {**os.environ, "SOURCE_DATE_EPOCH": str(mtime), "LC_ALL": "C"}
        proc = subprocess.run(["dpkg-deb", "--root-owner-group", "-Zxz", "--build", str(root), str(deb)],
                              capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            raise ReleaseError(f"dpkg-deb --build failed ({proc.returncode}): {proc.stderr.strip()}")
    return deb
