"""The checks a pin bump runs on the engine it built in its scratch folder (`dgr upstream bump`).

Each reuses the command or function that owns it, pointed at the scratch engine:

  build         dgr.toolchain.enginebuild.ensure_engine over the scratch pin, workspace and worker copy
  families      `dgr parity --synth ARCHS --stages 2,3,4 --lib LIB` (dgr.toolchain.synth.parity), in a child process
                that is restarted after the architecture it died on, should llama.cpp abort on one
  v4-splits     the tiny DeepSeek V4 split after, inside and across its hash-routed layers
                (`python -m dgr.toolchain.upstream.bumpchecks v4-splits`, dgr.toolchain.parity), bit for bit
  gate          `dgr gate alpha --engine-lib LIB --out-dir SCRATCH/certificates` with the scratch dgr-worker
  certificates  the gate's certificates name the new pin; those made under the old one stop matching

A check fills its `Step` (status, summary, lines); `Context` carries what the steps share.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from dgr.core.certificate import check, load_certificate
from dgr.core.errors import DgrError
from dgr.core.hashing import file_blake3
from dgr.core.log import get_logger
from dgr.toolchain import enginebuild
from dgr.toolchain.parity import Schedule, run_baseline, split_compare
from dgr.toolchain.pin import Pin, patch_series
from dgr.toolchain.synth.deepseek4 import synth_deepseek4
from dgr.toolchain.synth.generic import known_archs
from dgr.toolchain.synth.parity import STAGE_COUNTS
from dgr.toolchain.upstream.vendored import load_vendored_pin

log = get_logger(__name__)

# The tiny V4 of tests/engine/test_engine_deepseek4.py: 6 main layers (+ MTP, left out), hash-routed layers 0-2,
# compression ratios 0, 4, 128 repeating; prompts of 150 and 133 tokens reach the 128x compressor.
V4_SPLITS = {
    "2-after-hash": [(0, 3), (3, 6)],
    "3-inside-hash": [(0, 1), (1, 2), (2, 6)],
    "4-across": [(0, 2), (2, 3), (3, 5), (5, 6)],
}


@dataclass
class Step:
    """One step of a bump, as its report shows it."""

    name: str
    status: str = "not run"  # passed | failed | skipped | not run
    seconds: float = 0.0
    summary: str = ""
    lines: list[str] = field(default_factory=list)

    def fail(self, summary: str) -> None:
        self.status, self.summary = "failed", summary

    def ok(self, summary: str) -> None:
        self.status, self.summary = "passed", summary


@dataclass
class Context:
    """What the checks of one bump share."""

    old_pin: Pin
    pin: Pin  # the scratch pin (the new commit, the stack as it would be pinned)
    root: Path  # the scratch repository root (the pin, patches/, worker/, proto/)
    ws: Path  # the scratch workspace (upstream/, build/)
    scratch: Path
    main_ws: Path  # the checkout's workspace (old certificates, the certify fixtures)
    jobs: int | None = None
    threads: int = 1
    families: list[str] | None = None  # None: every architecture `dgr synth --list` names
    lib: Path | None = None  # set by the build


Check = Callable[[Context, Step], None]


def _dgr(args: list[str], env: dict[str, str] | None = None, on_line: Callable[[str], None] | None = None,
         ) -> tuple[int, list[str]]:
    """Run `python -m dgr ARGS` in a child process; its lines go to `on_line` as they come."""
    cmd = [sys.executable, "-m", "dgr", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **(env or {})})
    assert proc.stdout
    lines = []
    for line in proc.stdout:
        line = line.rstrip("\n")
        lines.append(line)
        if on_line:
            on_line(line)
    return proc.wait(), lines


def _seed_vendored(ctx: Context) -> None:
    """The checkout's verified copy of the vendored C sources (BLAKE3) into the scratch workspace, so the build
    does not fetch them again (dgr.toolchain.upstream.vendored checks each file against the pin before using it)."""
    path = ctx.root / "worker" / "third_party" / "blake3.json"
    if not path.is_file():
        return
    key = load_vendored_pin(path).key
    src, dst = ctx.main_ws / "upstream", ctx.ws / "upstream"
    if (src / key).is_dir() and (src / f"{key}.json").is_file() and not (dst / key).exists():
        dst.mkdir(parents=True, exist_ok=True)
        shutil.copytree(src / key, dst / key)
        shutil.copy2(src / f"{key}.json", dst / f"{key}.json")


def _forget_other_source(bdir: Path, worker: Path) -> None:
    """CMake refuses a build folder configured from another source folder (a hand-made experiment in the
    scratch workspace): drop its cache so it configures again; Ninja keeps the objects it can."""
    cache = bdir / "CMakeCache.txt"
    if not cache.is_file():
        return
    home = next((line.split("=", 1)[1] for line in cache.read_text(errors="replace").splitlines()
                 if line.startswith("CMAKE_HOME_DIRECTORY:")), None)
    if home is not None and Path(home).resolve() != worker.resolve():
        log.info("%s was configured from %s: configuring it again from %s", bdir, home, worker)
        cache.unlink()
        shutil.rmtree(bdir / "CMakeFiles", ignore_errors=True)
        (bdir / "dgr-configure.json").unlink(missing_ok=True)


def check_build(ctx: Context, step: Step) -> None:
    _seed_vendored(ctx)
    _forget_other_source(ctx.ws / "build" / "cpu", ctx.root / "worker")
    lib = enginebuild.ensure_engine("cpu", pin=ctx.pin, ws=ctx.ws, worker_dir=ctx.root / "worker", jobs=ctx.jobs)
    ctx.lib = lib
    worker = lib.parent / enginebuild.WORKER_BINARY
    stamp = json.loads((lib.parent / "dgr-build.stamp.json").read_text())
    step.lines.append(f"engine {lib}")
    step.lines.append(f"dgr-worker {worker if worker.exists() else 'NOT BUILT (no gRPC C++ found)'}")
    if not worker.exists():
        step.fail(f"{lib} built, but no dgr-worker beside it: the gate needs it (see {lib.parent}/dgr-build.log)")
        return
    step.ok(f"libdgr_engine.so and dgr-worker over llama.cpp {ctx.pin.commit[:12]} "
            f"(build {stamp.get('build_seconds', '?')} s; {lib.parent}/dgr-build.log)")


def check_families(ctx: Context, step: Step) -> None:
    archs = ctx.families or known_archs()
    stages = ",".join(map(str, STAGE_COUNTS))
    seen: dict[str, list[str]] = {}  # arch -> its result lines
    bad: list[str] = []
    todo = list(archs)
    while todo:
        def on_line(line: str, todo=todo) -> None:
            arch = line.removeprefix("parity: ").split(":", 1)[0]
            if line.startswith("parity: ") and arch in todo:
                seen.setdefault(arch, []).append(line.removeprefix("parity: "))
                if "EXACT" not in line:
                    bad.append(line.removeprefix("parity: "))
                done = sum(len(v) for v in seen.values())
                log.info("families %d/%d: %s", done, len(archs) * len(STAGE_COUNTS), line.removeprefix("parity: "))

        rc, lines = _dgr(["parity", "--synth", ",".join(todo), "--stages", stages, "--lib", str(ctx.lib),
                          "--threads", str(ctx.threads)], on_line=on_line)
        unfinished = [a for a in todo if len(seen.get(a, [])) < len(STAGE_COUNTS)]
        if rc >= 0 or not unfinished:  # it ended by itself: 0 all exact, 1 some differ, 2 an error it names
            for a in unfinished:
                why = f"{a}: no result ({lines[-1] if lines else f'exit {rc}'})"
                bad.append(why)
                seen.setdefault(a, []).append(why)
            break
        # killed by a signal (llama.cpp aborted): name the architecture, go on after it
        dead = unfinished[0]
        why = f"{dead}: the parity process died (signal {-rc}) on this architecture: {lines[-1] if lines else ''}"
        bad.append(why)
        seen.setdefault(dead, []).append(why)
        log.warning("families: %s", why)
        todo = todo[todo.index(dead) + 1:]
    step.lines = [line for a in archs for line in seen.get(a, [])]
    n = sum(len(v) for v in seen.values())
    if bad:
        step.fail(f"{len(bad)} of {len(archs) * len(STAGE_COUNTS)} splits do not equal the whole model or did not "
                  f"run: {_by_arch(bad)}")
    else:
        step.ok(f"{n} splits of {len(archs)} architectures ({stages} stages) equal the whole model bit for bit")


def _by_arch(bad: list[str]) -> str:
    """`arch xN (why)` per architecture, from result lines `arch: N stages ...: ERROR: ...` or `...: DIFFERS (...)`."""
    groups: dict[str, list[str]] = {}
    for line in bad:
        arch, _, rest = line.partition(":")
        why = rest.rsplit("error loading model: ", 1)[-1] if "error loading model: " in rest else \
            rest.split(": ", 2)[-1] if "ERROR" in rest else rest.rsplit(": ", 1)[-1]
        groups.setdefault(arch, []).append(why.strip()[:90])
    return "; ".join(f"{a} x{len(w)} ({w[0]})" for a, w in groups.items())


def check_v4_splits(ctx: Context, step: Step) -> None:
    with tempfile.TemporaryDirectory(dir=ctx.scratch, prefix="v4-") as tmp:
        out = Path(tmp) / "v4.json"
        rc, lines = _dgr_module(["v4-splits", "--lib", str(ctx.lib), "--threads", str(ctx.threads),
                                 "--workdir", tmp, "--json", str(out)])
        results = json.loads(out.read_text()) if out.exists() else []
    step.lines = [r["line"] for r in results] or lines[-5:]
    if rc == 0 and results and all(r["exact"] for r in results):
        step.ok(f"{len(results)} splits of the tiny V4 ({', '.join(V4_SPLITS)}) equal the whole model bit for bit")
    else:
        step.fail("; ".join(r["line"] for r in results if not r["exact"]) or
                  f"did not run (exit {rc}): {lines[-1] if lines else ''}")


def _dgr_module(args: list[str]) -> tuple[int, list[str]]:
    proc = subprocess.run([sys.executable, "-m", "dgr.toolchain.upstream.bumpchecks", *args], capture_output=True, text=True)
    lines = (proc.stdout + proc.stderr).splitlines()
    return proc.returncode, lines


def check_gate(ctx: Context, step: Step) -> None:
    assert ctx.lib
    env = {"DGR_ENGINE_LIB": str(ctx.lib), "DGR_WORKER_BIN": str(ctx.lib.parent / enginebuild.WORKER_BINARY)}
    out = ctx.scratch / "certificates"
    def on_line(line: str) -> None:
        if line.startswith("dgr: gate"):  # its progress ("certifying X"); the table comes at the end
            log.info("%s", line.removeprefix("dgr: "))

    rc, lines = _dgr(["gate", "alpha", "--engine-lib", str(ctx.lib), "--out-dir", str(out)], env=env, on_line=on_line)
    start = next((i for i, line in enumerate(lines) if line.startswith("dgr gate ")), None)
    step.lines = lines[start:] if start is not None else lines[-15:]
    verdict = next((line for line in reversed(lines) if "rows pass" in line), None)
    if rc == 0:
        step.ok(verdict or "passed")
    else:
        failed = [line for line in step.lines if line.rstrip().endswith(" NO")]
        step.fail(f"{verdict or f'exit {rc}'}" + (f"; failed: {'; '.join(f.split('  ')[0] for f in failed[:4])}"
                                                   if failed else ""))


def check_certificates(ctx: Context, step: Step) -> None:
    """The new certificates name the new pin (dgr-worker embeds the scratch pin); old ones stop matching."""
    series = patch_series(ctx.pin)
    new_certificates = sorted((ctx.scratch / "certificates").glob("*.json"))
    wrong = []
    for path in new_certificates:
        idn = load_certificate(path).identity
        if (idn.upstream_commit, idn.patch_series) != (ctx.pin.commit, series):
            wrong.append(f"{path.name} names llama.cpp {idn.upstream_commit[:12]}, "
                         f"patch series {idn.patch_series[:12]}")
    old_dir = ctx.main_ws / "certificates"
    old = sorted(old_dir.rglob("*.json")) if old_dir.is_dir() else []
    engine = file_blake3(ctx.lib) if ctx.lib else ""
    stops = []
    for path in old:
        try:
            cert = load_certificate(path)
        except DgrError:
            continue
        mine = cert.identity
        if mine.upstream_commit != ctx.old_pin.commit:
            continue
        new_idn = mine.model_copy(update={"upstream_commit": ctx.pin.commit, "patch_series": series,
                                          "engine_blake3": engine or mine.engine_blake3, "contract_blake3": ""})
        why = check(cert, new_idn)
        stops.append(f"{path.relative_to(old_dir)}: {why or 'STILL MATCHES'}")
    step.lines = [f"new: {p.name} names llama.cpp {ctx.pin.commit[:12]}" for p in new_certificates] + \
                 [f"old: {s}" for s in stops]
    still = [s for s in stops if s.endswith("STILL MATCHES")]
    if wrong or (still and ctx.pin.commit != ctx.old_pin.commit):
        step.fail("; ".join(wrong + still))
        return
    if ctx.pin.commit == ctx.old_pin.commit:
        step.ok(f"{len(new_certificates)} new certificate(s); the commit is unchanged, so certificates made under the "
                "current pin keep matching where the engine is the same")
        return
    step.ok(f"{len(new_certificates)} new certificate(s) name llama.cpp {ctx.pin.commit[:12]}; "
            + (f"{len(stops)} made under {ctx.old_pin.commit[:12]} stop matching ({stops[0].split(': ', 1)[1]})"
               if stops else f"no certificate made under {ctx.old_pin.commit[:12]} is in {old_dir}; any would stop "
               "matching (a certificate names the upstream commit and patch series it was made with)"))


# --- V4 splits, run in a child process (an abort in llama.cpp ends only that process) ---------------------


def v4_splits(workdir: Path, lib: str | Path, n_threads: int = 1) -> list[dict]:
    """Each of V4_SPLITS on the tiny V4 against the whole model: two sessions sharing each batch, prompts past
    the 128-token compression, greedy steps; range overrides of the one file (dgr.toolchain.parity)."""
    model = synth_deepseek4(Path(workdir) / "v4.gguf", layers=6, hash_layers=3)
    rng = np.random.default_rng(5)
    sched = Schedule(prompts=[rng.integers(0, 256, size=n).tolist() for n in (150, 133)], steps=3, n_ubatch=64)
    base = run_baseline(model, sched, lib, n_threads)
    sched.forced = [g[: sched.steps] for g in base.generated]
    out = []
    for name, ranges in V4_SPLITS.items():
        t0 = time.perf_counter()
        c = split_compare(model, sched, base, ranges, lib=lib, n_threads=n_threads)
        cuts = " ".join(f"[{a},{b})" for a, b in ranges)
        verdict = "EXACT" if c.exact else f"DIFFERS (max |diff| {c.max_abs_diff:g}, first {c.diverging_text()})"
        out.append({"split": name, "ranges": ranges, "exact": bool(c.exact), "max_abs_diff": float(c.max_abs_diff),
                    "seconds": round(time.perf_counter() - t0, 1),
                    "line": f"deepseek4 {name}: {cuts}: {verdict}"})
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dgr.toolchain.upstream.bumpchecks")
    sub = p.add_subparsers(dest="what", required=True)
    v = sub.add_parser("v4-splits", help="the tiny V4's splits against the whole model")
    v.add_argument("--lib", required=True)
    v.add_argument("--threads", type=int, default=1)
    v.add_argument("--workdir", required=True)
    v.add_argument("--json", required=True)
    args = p.parse_args(argv)
    results = v4_splits(Path(args.workdir), args.lib, args.threads)
    Path(args.json).write_text(json.dumps(results, indent=2))
    for r in results:
        print(r["line"])
    return 0 if all(r["exact"] for r in results) else 1


def step_dict(step: Step) -> dict:
    return asdict(step)


if __name__ == "__main__":
    sys.exit(main())
