"""The worker's OCI image (issue 37 item 1; docs/deploy.md "Container image"; tools/dgr/toolchain/image.py).

Fast: an image of a stand-in release (the checkout's worker and engine, MANIFEST.json as release.py writes
it) built twice is the same bytes; its layers are sorted, timeless, owned by root, without pax headers; it
holds the worker, the engine and the libraries the loader names for them, users and mount points, and no
shell and no Python; the CUDA and Vulkan lanes are refused by name, saying what they need; image.py runs on
the bare standard library (as Bazel runs it); its paths are the ones the Kubernetes and systemd renders use.

Slow (the real release: $DGR_RELEASE_TAR, else `bazel build //:release_cpu`): `dgr release image` twice and
image.py as the Bazel target runs it give one image, whose digest image_cpu.MANIFEST.json records; then CI's
path, since CI has no container daemon: the layers unpacked into an empty folder and the entrypoint run in a
chroot of it (tests/support/images.py: its own /proc and /dev, the bundle mounted read-only where the
Kubernetes render mounts the store, uid 65532, the image's Env only), serving stage 1 of SmolLM2 between two
ordinary workers: the route generates what a route of ordinary workers does, token for token and logit for
logit, and the worker answers grpc.health.v1. Where podman and runc are installed, the same through
`podman load` and `podman run` (skipped, saying so, where they are not: CI does not install them).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
import requests
import yaml

from dgr.app.local import LocalRoute
from dgr.runtime.wire.client import RouteClient
from dgr.toolchain import image as oci
from dgr.toolchain import rootfs
from dgr.toolchain.bundle import provision
from support.deploy import dgr, tiny, tiny_fixed_ports_file  # noqa: F401 (module fixtures)
from support.images import (Process, container_command, health, image_config, require_root, routes_around,
                            same_generation, synthetic_release, unpack)
from support.kubelet import Pod
from support.paths import REPO

SCRIPT = REPO / "tools/dgr/toolchain/image.py"
TOOLS_SCRIPT = REPO / "tools/dgr/toolchain/tools_image.py"


def _build_script(release: Path, out: Path, *extra_env: tuple[str, str]) -> subprocess.CompletedProcess:
    """image.py as `//:image_<lane>` runs it: the system's python3, no dgr on the path, Bazel's fixed PATH."""
    out.mkdir(parents=True, exist_ok=True)
    env = {"PATH": "/bin:/usr/bin:/usr/local/bin", **dict(extra_env)}
    return subprocess.run([shutil.which("python3") or sys.executable, "-S", "-I", str(SCRIPT), "--release", str(release),
                           "--tar", str(out / "image.tar"), "--layout", str(out / "layout"),
                           "--manifest", str(out / "image.MANIFEST.json")],
                          capture_output=True, text=True, env=env, cwd=out, timeout=600)


def _tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _layers(layout: Path) -> list[tarfile.TarFile]:
    manifest, _ = image_config(layout)
    return [tarfile.open(layout / "blobs/sha256" / layer["digest"][7:], "r:gz") for layer in manifest["layers"]]


@pytest.fixture(scope="module")
def stand_in(tmp_path_factory, worker_bin, engine_lib) -> tuple[Path, Path]:
    """A stand-in release and its image, built by image.py as Bazel runs it."""
    tmp = tmp_path_factory.mktemp("image")
    release = synthetic_release(tmp, Path(worker_bin), Path(engine_lib))
    out = _build_script(release, tmp / "one")
    assert out.returncode == 0, out.stderr
    return release, tmp / "one"


def test_two_builds_of_one_release_are_the_same_bytes(stand_in, tmp_path):
    release, one = stand_in
    out = _build_script(release, tmp_path / "two")
    assert out.returncode == 0, out.stderr
    a, b = _tree(one), _tree(tmp_path / "two")
    assert sorted(a) == sorted(b)
    assert [p for p in a if a[p] != b[p]] == []
    record = json.loads(a["image.MANIFEST.json"])
    index = json.loads(a["layout/index.json"])
    assert index["manifests"][0]["digest"] == record["digest"]
    # each blob is its digest's, and the tar is the layout
    for path, data in a.items():
        if path.startswith("layout/blobs/sha256/"):
            assert hashlib.sha256(data).hexdigest() == path.rsplit("/", 1)[1]
    with tarfile.open(one / "image.tar") as tar:
        assert sorted(m.name for m in tar.getmembers() if m.isfile()) == sorted(p[7:] for p in a if p.startswith("layout/"))
    # SOURCE_DATE_EPOCH moves the times, and only them
    later = _build_script(release, tmp_path / "epoch", ("SOURCE_DATE_EPOCH", "1700000000"))
    assert later.returncode == 0, later.stderr
    _, config = image_config(tmp_path / "epoch/layout")
    assert config["created"] == "2023-11-14T22:13:20Z"
    assert {m.mtime for t in _layers(tmp_path / "epoch/layout") for m in t.getmembers()} == {1700000000}


def test_the_layers_are_deterministic_tars_of_the_worker_its_engine_and_their_libraries(stand_in, worker_bin, engine_lib):
    _, one = stand_in
    layout = one / "layout"
    system, dgr = _layers(layout)
    for t in (system, dgr):
        members = t.getmembers()
        names = [m.name for m in members]
        assert names == sorted(names), "entries sorted"
        assert {m.mtime for m in members} == {0}
        assert {m.uname for m in members} == {""} and {m.gname for m in members} == {""}
        assert all(not m.pax_headers for m in members), "no pax headers (times or names)"
        assert {(m.uid, m.gid) for m in members if m.name != "var/lib/dgr/state"} == {(0, 0)}
    s = {m.name.rstrip("/"): m for m in system.getmembers()}
    d = {m.name.rstrip("/"): m for m in dgr.getmembers()}
    assert (s["var/lib/dgr/state"].uid, s["var/lib/dgr/state"].mode) == (65532, 0o750)
    assert s["tmp"].mode == 0o1777 and s["etc/dgr/tls"].isdir() and s["var/lib/dgr/store"].isdir()
    assert "dgr:x:65532:65532:" in system.extractfile(s["etc/passwd"]).read().decode()
    assert d["opt/dgr/bin/dgr-worker"].mode == 0o755 and d["opt/dgr/lib/libdgr_engine.so"].isfile()
    # every library the host's loader names for the worker and the engine is there, at its path
    loader = rootfs.elf_interpreter(Path(worker_bin).read_bytes())
    needed = rootfs.library_closure([str(worker_bin), str(engine_lib)], loader)
    assert len(needed) > 20
    for lib in needed:
        real = os.path.realpath(lib).lstrip("/")
        assert real in s and s[real].isfile(), f"{lib} ({real}) is not in the image"
    assert any(n.endswith("libgomp.so.1") for n in s) and any("libgrpc++" in n for n in s)
    # no shell, no Python, nothing else to run
    everything = list(s) + list(d)
    assert not [n for n in everything if "python" in n.lower()]
    assert not [n for n in everything if n.rsplit("/", 1)[-1] in ("sh", "bash", "dash", "busybox", "env")]
    executables = {n for n, m in {**s, **d}.items() if m.isfile() and m.mode & 0o111 and ".so" not in n}
    assert executables == {"opt/dgr/bin/dgr-worker"}, executables


def test_the_image_config_names_the_entrypoint_user_and_health(stand_in):
    _, one = stand_in
    manifest, config = image_config(one / "layout")
    c = config["config"]
    assert c["Entrypoint"] == ["/opt/dgr/bin/dgr-worker"] and c["User"] == "65532:65532"
    assert "DGR_ENGINE_LIB=/opt/dgr/lib/libdgr_engine.so" in c["Env"]
    assert "grpc.health.v1" in c["Labels"]["dgr.health"]
    assert config["architecture"] == "amd64" and config["os"] == "linux"
    assert len(config["rootfs"]["diff_ids"]) == len(manifest["layers"]) == 2
    docker = json.loads((one / "layout/manifest.json").read_text())
    assert docker[0]["RepoTags"] == ["dgr-worker:0.0.0"]
    assert docker[0]["Config"] == "blobs/sha256/" + manifest["config"]["digest"][7:]


def test_the_paths_are_those_the_deploy_renders_use():
    from dgr.app.deploy import kubernetes, systemd

    assert oci.PREFIX == systemd.DEFAULT_PREFIX == kubernetes.Options.default().prefix
    assert (oci.USER, oci.STORE, oci.STATE, oci.TLS, oci.PORT) == (
        kubernetes.USER, kubernetes.STORE_MOUNT, kubernetes.STATE_MOUNT, kubernetes.TLS_MOUNT, kubernetes.DEFAULT_PORT)
    assert kubernetes.Options.default().image.startswith(oci.REPOSITORY + ":")


def test_lanes_without_an_image_are_refused_by_name_with_what_they_need(tmp_path, worker_bin, engine_lib, capsys):
    from dgr.cli.main import main
    from dgr.core.constants import LANES

    bzl = (REPO / "toolchains/lanes.bzl").read_text()
    declared = json.loads(re.search(r"^IMAGE_LANES = (\[.*\])$", bzl, re.M).group(1))
    assert declared == [lane for lane, why in oci.LANE_IMAGES.items() if not why] == ["cpu"]
    assert set(oci.LANE_IMAGES) == set(LANES)
    for lane, title, needs in (("cuda", "CUDA", "libcuda.so.1"), ("vulkan", "Vulkan", "ICD")):
        # what the lane's Bazel target runs
        out = subprocess.run([sys.executable, "-S", "-I", str(SCRIPT), "--refuse-lane", lane], capture_output=True,
                             text=True)
        assert out.returncode == 1 and f"the {title} lane's image is declared, not built" in out.stderr
        assert needs in out.stderr
        # a release of the lane
        (tmp_path / lane).mkdir()
        release = synthetic_release(tmp_path / lane, Path(worker_bin), Path(engine_lib), lane=lane)
        assert main(["release", "image", "--release", str(release), "--out", str(tmp_path / f"out-{lane}")]) == 2
        err = capsys.readouterr().err
        assert f"the {title} lane's image is declared, not built" in err and needs in err
        assert not (tmp_path / f"out-{lane}").exists()


def _bazel_genrules() -> dict[str, dict]:
    """The genrules `dgr_images()` of toolchains/lanes.bzl declares, by name: the .bzl file run as the Python it
    is written in, with Bazel's `native`, `struct` and `select` stood in for (no Bazel run here)."""
    import types

    rules: dict[str, dict] = {}
    native = types.SimpleNamespace(genrule=lambda **kw: rules.__setitem__(kw["name"], kw))
    text = "\n".join(ln for ln in (REPO / "toolchains/lanes.bzl").read_text().splitlines() if not ln.startswith("load("))
    scope = {"native": native, "struct": types.SimpleNamespace, "select": dict}
    exec(compile(text, "lanes.bzl", "exec"), scope)
    scope["dgr_images"]()
    return rules


def test_the_bazel_targets_run_image_py_over_the_release(stand_in, tmp_path):
    """//:image_cpu's command, its $(location)s filled in as Bazel would, makes what image.py makes; the
    declared lanes' targets are manual and refuse, saying why."""
    import shlex

    rules = _bazel_genrules()
    assert sorted(rules) == sorted([*(f"image_{lane}" for lane in oci.LANE_IMAGES), "tools_image_cpu"])
    cpu = rules["image_cpu"]
    # the tools image: the same command with --tools (run by the tools_image fixture below, on the real release)
    tools = rules.pop("tools_image_cpu")
    assert tools["srcs"] == cpu["srcs"] and tools["outs"] == ["tools_image_cpu.tar", "tools_image_cpu.MANIFEST.json"]
    assert tools["cmd"] == cpu["cmd"].replace("image.py)", "tools_image.py)").replace("image_cpu.", "tools_image_cpu.")
    assert cpu["srcs"] == [":release_cpu.tar.gz"] and cpu["outs"] == ["image_cpu.tar", "image_cpu.MANIFEST.json"]
    assert "manual" not in cpu["tags"]
    release, one = stand_in
    where = {"//tools/dgr:toolchain/image.py": str(SCRIPT), ":release_cpu.tar.gz": str(release),
             "image_cpu.tar": str(tmp_path / "image_cpu.tar"), "image_cpu.MANIFEST.json": str(tmp_path / "m.json")}
    cmd = re.sub(r"\$\(location ([^)]+)\)", lambda m: shlex.quote(where[m.group(1)]), cpu["cmd"])
    proc = subprocess.run(cmd, shell=True, capture_output=True, text=True, env={"PATH": "/bin:/usr/bin:/usr/local/bin"})
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "image_cpu.tar").read_bytes() == (one / "image.tar").read_bytes()
    assert (tmp_path / "m.json").read_bytes() == (one / "image.MANIFEST.json").read_bytes()
    for lane in ("cuda", "vulkan", "rocm", "metal"):
        rule = rules[f"image_{lane}"]
        assert "manual" in rule["tags"] and "srcs" not in rule
        cmd = rule["cmd"].replace("$(location //tools/dgr:toolchain/image.py)", str(SCRIPT))
        proc = subprocess.run(cmd, shell=True, capture_output=True, text=True, env={"PATH": "/bin:/usr/bin"})
        assert proc.returncode == 1 and oci.LANE_IMAGES[lane][:40] in proc.stderr, proc.stderr


def test_a_damaged_release_is_refused(tmp_path, worker_bin, engine_lib, capsys):
    from dgr.cli.main import main

    release = synthetic_release(tmp_path, Path(worker_bin), Path(engine_lib))
    with tarfile.open(release) as tar:
        files = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}
    engine = bytearray(files["dgr-cpu/lib/libdgr_engine.so"])
    engine[len(engine) // 2] ^= 0xFF
    files["dgr-cpu/lib/libdgr_engine.so"] = bytes(engine)
    damaged = tmp_path / "damaged.tar.gz"
    with tarfile.open(damaged, "w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    assert main(["release", "image", "--release", str(damaged), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "lib/libdgr_engine.so does not match the release's MANIFEST.json" in err


# ---- the real release

@pytest.fixture(scope="module")
def release_image(release_cpu_tar, tmp_path_factory) -> tuple[Path, dict]:
    """`dgr release image` of the CPU release, twice, and image.py as Bazel runs it: one image."""
    tmp = tmp_path_factory.mktemp("release-image")
    outs = []
    for name in ("a", "b"):
        proc = subprocess.run([sys.executable, "-m", "dgr", "release", "image", "--release", str(release_cpu_tar),
                               "--out", str(tmp / name)], capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr
        print(proc.stdout)
        outs.append(tmp / name)
    a, b = _tree(outs[0]), _tree(outs[1])
    assert sorted(a) == sorted(b) and [p for p in a if a[p] != b[p]] == [], "two builds differ"
    bazel_way = _build_script(release_cpu_tar, tmp / "script")
    assert bazel_way.returncode == 0, bazel_way.stderr
    assert (tmp / "script/image.tar").read_bytes() == (outs[0] / "image_cpu.tar").read_bytes()
    assert (tmp / "script/image.MANIFEST.json").read_bytes() == (outs[0] / "image_cpu.MANIFEST.json").read_bytes()
    record = json.loads((outs[0] / "image_cpu.MANIFEST.json").read_text())
    print(f"image {record['ref']} {record['digest']}: {record['size'] / 1e6:.1f} MB compressed")
    return outs[0], record


@pytest.mark.slow
def test_the_release_image_is_reproducible_and_its_manifest_names_the_release(release_image, release_cpu_tar):
    out, record = release_image
    manifest = json.loads(tarfile.open(release_cpu_tar).extractfile("dgr-cpu/MANIFEST.json").read())
    assert record["release"]["sha256"] == hashlib.sha256(release_cpu_tar.read_bytes()).hexdigest()
    assert record["release"]["upstream"] == manifest["upstream"]
    assert record["files"]["/opt/dgr/bin/dgr-worker"] == manifest["files"]["bin/dgr-worker"]
    assert record["files"]["/opt/dgr/lib/libdgr_engine.so"] == manifest["files"]["lib/libdgr_engine.so"]
    assert record["digest"] == json.loads((out / "image_cpu/index.json").read_text())["manifests"][0]["digest"]
    assert record["ref"] == f"dgr-worker:{manifest['version']}"
    assert all(v["package"] for v in record["libraries"].values()), "every library's Debian package is named"


@pytest.mark.slow
@pytest.mark.engine
def test_the_image_serves_a_stage_in_a_chroot_of_its_layers_that_joins_a_route(release_image, engine_lib, tmp_path):
    """CI's path (no container daemon there): the layers in an empty folder, the entrypoint in a chroot of it."""
    from dgr.app.demo import ensure_bundle

    require_root("running the image in a chroot of its layers")
    out, _ = release_image
    root = tmp_path / "rootfs"
    config = unpack(out / "image_cpu", root)
    assert not (root / "bin").exists() and not (root / "usr/bin").exists(), "nothing to run but dgr-worker"
    bundle = ensure_bundle(3, progress=False)[0].root
    inside = f"{oci.STORE}/{bundle.name}"
    argv = container_command(root, config, ["serve", "--bundle", inside, "--stage", "1", "--listen", "127.0.0.1:0",
                                            "--threads", "1", "--n-ctx", "512"], volumes={inside: (bundle, True)})
    worker = Process(argv)

    def check(address: str) -> None:
        assert health(address) == "SERVING"
        status = Path(f"/proc/{worker.proc.pid}/status").read_text()
        assert "\nUid:\t65532\t65532\t65532\t65532\n" in status and "\nGid:\t65532\t" in status
        assert os.readlink(f"/proc/{worker.proc.pid}/root") == str(root), "it runs in the chroot of the image"
        assert f"{oci.PREFIX}/lib/libdgr_engine.so" in Path(f"/proc/{worker.proc.pid}/maps").read_text()

    same_generation(*routes_around(bundle, engine_lib, worker, check))


@pytest.mark.slow
@pytest.mark.engine
def test_the_image_serves_a_stage_under_podman_that_joins_a_route(release_image, engine_lib):
    """Where a container runtime is installed (podman with runc; CI has none: the chroot test is CI's)."""
    from dgr.app.demo import ensure_bundle

    if not (shutil.which("podman") and shutil.which("runc")):
        pytest.skip("podman and runc are not installed (Debian: apt-get install podman runc); CI runs the image "
                    "in a chroot instead (test_the_image_serves_a_stage_in_a_chroot_of_its_layers_that_joins_a_route)")
    require_root("podman (rootful)")
    out, record = release_image
    loaded = subprocess.run(["podman", "load", "-i", str(out / "image_cpu.tar")], capture_output=True, text=True,
                            timeout=300)
    assert loaded.returncode == 0, loaded.stderr
    ref = f"localhost/{record['ref']}"
    bundle = ensure_bundle(3, progress=False)[0].root
    inside = f"{oci.STORE}/{bundle.name}"
    # runc, not crun (crun refuses this VM's hybrid cgroups); limits below the host's (this VM refuses a runtime's
    # setrlimit at or above them, and podman's defaults are above)
    argv = ["podman", "run", "--rm", "--runtime", "runc", "--network", "host", "--ulimit", "nofile=4096:4096",
            "--ulimit", "nproc=4096:4096", "--read-only", "-v", f"{bundle}:{inside}:ro", ref,
            "serve", "--bundle", inside, "--stage", "1", "--listen", "127.0.0.1:0", "--threads", "1", "--n-ctx", "512"]
    worker = Process(argv)

    def check(address: str) -> None:
        assert health(address) == "SERVING"

    try:
        same_generation(*routes_around(bundle, engine_lib, worker, check))
    finally:
        subprocess.run(["podman", "rmi", "-f", ref], capture_output=True, timeout=120)


# ---- the tools image (dgr:<version>): bin/dgr of the release on its own Python

@pytest.fixture(scope="module")
def tools_image(release_cpu_tar, tmp_path_factory) -> tuple[Path, dict]:
    """`dgr release image --tools` of the CPU release, twice, and tools_image.py as Bazel runs it: one image."""
    tmp = tmp_path_factory.mktemp("tools-image")
    outs = []
    for name in ("a", "b"):
        proc = subprocess.run([sys.executable, "-m", "dgr", "release", "image", "--tools", "--release",
                               str(release_cpu_tar), "--out", str(tmp / name)], capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stderr
        print(proc.stdout)
        outs.append(tmp / name)
    a, b = _tree(outs[0]), _tree(outs[1])
    assert sorted(a) == sorted(b) and [p for p in a if a[p] != b[p]] == [], "two builds differ"
    script = subprocess.run([shutil.which("python3") or sys.executable, "-S", "-I", str(TOOLS_SCRIPT), "--release",
                             str(release_cpu_tar), "--tar", str(tmp / "script.tar")], capture_output=True, text=True,
                            env={"PATH": "/bin:/usr/bin:/usr/local/bin"}, timeout=900)
    assert script.returncode == 0, script.stderr
    assert (tmp / "script.tar").read_bytes() == (outs[0] / "tools_cpu.tar").read_bytes()
    return outs[0], json.loads((outs[0] / "tools_cpu.MANIFEST.json").read_text())


@pytest.mark.slow
def test_the_tools_image_is_the_whole_release_on_its_python_reproducibly(tools_image, release_cpu_tar):
    from dgr.app.deploy import kubernetes

    out, record = tools_image
    manifest = json.loads(tarfile.open(release_cpu_tar).extractfile("dgr-cpu/MANIFEST.json").read())
    assert record["ref"] == f"dgr:{manifest['version']}" == kubernetes.Options.default().tools_image
    assert record["release"]["sha256"] == hashlib.sha256(release_cpu_tar.read_bytes()).hexdigest()
    assert record["python"]["executable"] == "/usr/bin/python3.11" and record["python"]["tag"] == "cp311"
    assert record["python"]["package"].startswith("python3.11-minimal/")
    _, config = image_config(out / "tools_cpu")
    c = config["config"]
    assert c["Entrypoint"] == ["/opt/dgr/bin/dgr"] and c["User"] == "65532:65532"
    assert "PYTHON=/usr/bin/python3.11" in c["Env"]
    deps, dgr = (tarfile.open(out / "tools_cpu/blobs/sha256" / layer["digest"][7:], "r:gz")
                 for layer in record["layers"][1:])
    # every file of the release, at the prefix, each in the layer its kind belongs to
    files = {m.name[len("opt/dgr/"):]: m for t in (deps, dgr) for m in t.getmembers() if m.isfile()}
    assert sorted(files) == sorted([*manifest["files"], "MANIFEST.json"])
    assert files["bin/dgr"].mode == files["bin/dgr-worker"].mode == 0o755
    assert all(n.startswith("opt/dgr/python/") and not n.startswith("opt/dgr/python/dgr/")
               for n in deps.getnames() if deps.getmember(n).isfile())
    system = tarfile.open(out / "tools_cpu/blobs/sha256" / record["layers"][0]["digest"][7:], "r:gz").getnames()
    # the standard library without its tests, GUI and installers; no pip, no package manager
    assert "usr/lib/python3.11/json/decoder.py" in system and "usr/lib/python3.11/lib-dynload" in system
    assert not [n for n in system if n.startswith(("usr/lib/python3.11/test/", "usr/lib/python3.11/tkinter/",
                                                   "usr/lib/python3.11/ensurepip/"))]
    assert not [n for n in system if n.rsplit("/", 1)[-1] in ("pip", "pip3", "apt", "apt-get", "dpkg", "bash")]


@pytest.mark.slow
@pytest.mark.engine
def test_the_rendered_pods_run_from_the_images_and_serve_the_normal_routes_text(release_image, tools_image, tiny,
                                                                                engine_lib, tmp_path):
    """The Kubernetes render's pods as a runtime runs them from the two images (each in a chroot of its layers):
    the init container `dgr bundle verify` and the gateway from dgr:<version>, the workers from
    dgr-worker:<version>, with the render's command, arguments, environment and mounts; the gateway answers
    what the same route started the normal way generates."""
    require_root("running the images in chroots of their layers")
    roots = {}
    for (out, record), layout in ((release_image, "image_cpu"), (tools_image, "tools_cpu")):
        root = tmp_path / layout
        roots[record["ref"]] = (root, unpack(out / layout, root))
    render = dgr("deploy", "render", tiny_fixed_ports_file(tmp_path, tiny), "--kubernetes", str(tmp_path / "k8s"))
    assert render.returncode == 0, render.stderr
    objs = [yaml.safe_load(p.read_text()) for p in sorted((tmp_path / "k8s").glob("*.yaml"))]
    assert {c["image"] for o in objs if o["kind"] in ("StatefulSet", "Deployment")
            for c in o["spec"]["template"]["spec"].get("initContainers", []) + o["spec"]["template"]["spec"]["containers"]
            } == set(roots), "the render names the images made from the release (its defaults)"
    claim = tmp_path / "claim"
    assert provision(tiny.root, claim).complete
    pods, procs = {}, []
    for sts in (o for o in objs if o["kind"] == "StatefulSet"):
        for k in range(sts["spec"]["replicas"]):
            pod = Pod(f"{sts['metadata']['name']}-{k}", sts["spec"]["template"]["spec"], tmp_path / "pods" / f"{k}"
                      / sts["metadata"]["name"], {"tiny-store": claim}, {}, images=roots)
            pods[f"{pod.name}.{sts['spec']['serviceName']}:{next(iter(pod.ports))}"] = pod
    local = {name: f"127.0.0.1:{next(iter(p.ports.values()))}" for name, p in pods.items()}
    try:
        for p in pods.values():
            init = p.popen("verify-bundle", oci.PREFIX, {})
            assert init.wait(300) == 0, p.log("verify-bundle").read_text()
            assert "ok: bundle" in p.log("verify-bundle").read_text()
            procs.append(p.popen("worker", oci.PREFIX, {}))
        [gw_obj] = [o for o in objs if o["kind"] == "Deployment"]
        gw = Pod("tiny-gateway-0", gw_obj["spec"]["template"]["spec"], tmp_path / "pods" / "gateway", {}, {}, images=roots)
        procs.append(gw.popen("gateway", oci.PREFIX, {}, resolve=local))
        url = f"http://127.0.0.1:{gw.ports[8000]}"
        deadline = time.monotonic() + 300
        while True:                                     # the gateway describes the route once every stage serves
            try:
                up = requests.get(f"{url}/health", timeout=2)
                if up.ok:
                    break
            except requests.ConnectionError:
                pass
            assert procs[-1].poll() is None and time.monotonic() < deadline, gw.log("gateway").read_text()[-3000:]
            time.sleep(0.5)
        for p, proc in zip(pods.values(), procs):
            assert os.readlink(f"/proc/{proc.pid}/root") == str(roots[p.container("worker")["image"]][0])
            assert "\nUid:\t65532\t" in Path(f"/proc/{proc.pid}/status").read_text()
        r = requests.post(f"{url}/v1/completions", timeout=300,
                          json={"model": up.json()["model"], "prompt": "Once upon a time", "max_tokens": 16,
                                "temperature": 0})
        assert r.status_code == 200, r.text + gw.log("gateway").read_text()[-3000:]
        got = r.json()["choices"][0]["text"]
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    stage_args = [["--bundle", str(tiny.root), "--stage", str(i), "--threads", "1", "--n-ctx", "512"] for i in range(3)]
    with LocalRoute(stage_args, replicas=[1, 2, 1], env={"DGR_ENGINE_LIB": str(engine_lib)}) as r, \
            RouteClient(r.route) as c:
        want = c.run("Once upon a time", max_new_tokens=16)
    assert got == want.text and got

