"""Helpers for the deployment tests: a tiny real bundle, deployment files written from parts, the CLI."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from support.engine import make_bundle, synth_model
from support.paths import REPO

TINY_RANGES = [(0, 2), (2, 4), (4, 6)]


def tiny_bundle(root: Path):
    """A 6-layer synthetic llama in 3 stages (built in well under a second): the loaded Bundle."""
    src = synth_model(root, "llama", layers=6, embd=64)
    return make_bundle(src, TINY_RANGES, root / "build")


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def dgr(*args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """`dgr ARGS` as a user runs it (a fresh process of this checkout's Python)."""
    return subprocess.run([sys.executable, "-m", "dgr.cli.main", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def tiny_deployment(tmp_path: Path, tiny, supervise: str = "", replicas: tuple[int, ...] = (1, 1, 1)) -> str:
    """A deployment file of the tiny bundle in 3 stages on loopback (free ports), `replicas[i]` workers of
    stage i, with `supervise` as its [supervise] section's lines."""
    stages = "".join(f'[[stages]]\nlayers = [{b}, {e}]\nhost = "a"\nreplicas = {n}\n\n'
                     for (b, e), n in zip(TINY_RANGES, replicas))
    return str(write(tmp_path / "tiny.toml", f"""name = "tiny"
[bundle]
id = "{tiny.id[:12]}"
source = "{tiny.root}"

[[hosts]]
name = "a"
address = "127.0.0.1"
store = "{tmp_path / 'store'}"

{stages}[supervise]
{supervise}
"""))


def not_a_library(tmp_path: Path) -> dict:
    """DGR_ENGINE_LIB at a file that exists but does not load (dlopen: "file too short"), and no DGR_WORKER_BIN
    (as a user who points DGR_ENGINE_LIB at a file of their own: dgr-worker is looked for beside it)."""
    return {"DGR_ENGINE_LIB": str(write(tmp_path / "not-an-engine.so", "not an ELF file\n")), "DGR_WORKER_BIN": ""}


def compiled_library(tmp_path: Path, name: str, source: str) -> Path:
    """A shared library built from C `source` by the system's C compiler (the test skips without one)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler (cc) to build a stand-in library")
    src = write(tmp_path / f"{name}.c", source)
    out = tmp_path / f"{name}.so"
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(out), str(src)], check=True, capture_output=True)
    return out


# A stand-in for dgr-worker that fails at every start, the same way: what the supervisor's restarts and
# give-ups are tested with (a library that does not load no longer gets that far: `dgr up` checks it first).
FAILING_WORKER_LINE = "stand-in dgr-worker: error: fails at every start (tests/support/deploy.py)"


def failing_worker(tmp_path: Path, lib_env: dict) -> dict:
    """The environment of `lib_env` (a real engine library) with DGR_WORKER_BIN at a program that writes
    FAILING_WORKER_LINE and exits 1: every worker dies at every start, the same way."""
    script = write(tmp_path / "failing-worker", f"#!/bin/sh\necho '{FAILING_WORKER_LINE}' >&2\nexit 1\n")
    script.chmod(0o755)
    return {**lib_env, "DGR_WORKER_BIN": str(script)}


def errors(proc: subprocess.CompletedProcess) -> list[str]:
    return [line.removeprefix("dgr: error: ") for line in proc.stderr.splitlines() if line.startswith("dgr: error: ")]


# Fixtures the deployment tests share (a test module takes them with `from support.deploy import tiny, lib_env`).
def tiny_fixed_ports_file(tmp_path: Path, tiny, tls_dir: Path | None = None, workload: str | None = None, *,
                          port0: bool = False, store: Path | None = None, worker: str = "n_ctx = 512",
                          name: str = "tiny.toml") -> str:
    """A deployment file of the tiny bundle for the renders (systemd, Kubernetes): 3 stages on fixed ports
    (`port0`: picked at `dgr up`), stage 1 with two replicas (every stage where `workload` is a
    LeaderWorkerSet, whose groups are whole pipelines), one thread and `worker`'s lines, under [tls] with
    `tls_dir`, [kubernetes] workload where given."""
    lws = workload == "leaderworkerset"
    stages = "".join(f'[[stages]]\nlayers = [{b}, {e}]\nhost = "a"\nport = {0 if port0 else 7500 + 10 * i}\n'
                     + ("replicas = 2\n" if i == 1 or lws else "") + "\n"
                     for i, (b, e) in enumerate([(0, 2), (2, 4), (4, 6)]))
    capacity = 'capacity = { memory = "1GiB" }\n' if store else ""
    return str(write(tmp_path / name, f"""name = "tiny"
[bundle]
id = "{tiny.id}"
source = "{tiny.root}"

[[hosts]]
name = "a"
address = "127.0.0.1"
store = "{store or tmp_path / 'unused-store'}"
{capacity}
{stages}
[worker]
threads = 1
{worker}
""" + (f'\n[tls]\ndir = "{tls_dir}"\n' if tls_dir else "")
                     + (f'\n[kubernetes]\nworkload = "{workload}"\n' if workload else "")))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_bundle(tmp_path_factory.mktemp("tiny"))


def private_engine(engine_lib: Path, folder: Path) -> dict[str, str]:
    """Copies of the engine library and dgr-worker in `folder` (another build in the shared workspace may
    rewrite the originals mid-test), as the environment that makes a dgr use them."""
    from dgr.app.workerbin import worker_binary

    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy2(engine_lib, folder / "libdgr_engine.so")
    shutil.copy2(worker_binary(), folder / "dgr-worker")
    return {"DGR_ENGINE_LIB": str(folder / "libdgr_engine.so"), "DGR_WORKER_BIN": str(folder / "dgr-worker")}


@pytest.fixture(scope="module")
def lib_env(engine_lib, tmp_path_factory):
    return private_engine(engine_lib, tmp_path_factory.mktemp("engine"))
