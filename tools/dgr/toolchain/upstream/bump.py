"""A pin bump as a procedure (`dgr upstream bump SOURCE`, docs/upstream.md 'Bumping the pin').

Everything happens in a scratch folder; the checkout's pin, tree listing and patches change only at the
end, with `write=True`, when every step passed and none was skipped:

    <workspace>/upstream-bump/<label>/      label: the sdist's version, or tree-<commit12>
        sdist/        the sdist's git records and changelog (how its commit is verified)
        restack/      a git repository: the old pin + its patches, the new commit + the patches
                      (dgr.toolchain.upstream.restack)
        repo/         a scratch repository root: toolchains/llama.cpp.pin.json (the pin as it would be
                      written), toolchains/llama.cpp.tree.txt, patches/llama.cpp/ (regenerated where a patch
                      needed a three-way merge), worker/ and proto/ (copies: dgr-worker embeds ../toolchains'
                      pin, so the scratch build advertises the new one)
        ws/           its workspace: cache/downloads, upstream/src-<commit>/ (verified), upstream/llama.cpp/
                      (patched by dgr.toolchain.upstream.apply, as after the bump), build/cpu/ (its own CMake folder:
                      the checkout's engine in <workspace>/build/cpu is never touched; ccache serves objects)
        certificates/ the gate's certificates
        report.json   every step: status, seconds, summary, lines

Steps: source (dgr.toolchain.upstream.newsource), patches (dgr.toolchain.upstream.restack), then the checks of
dgr.toolchain.upstream.bumpchecks: build, families, v4-splits, gate, certificates; then, with `write`, the pin.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Sequence

from dgr.core.errors import DgrError, UpstreamError
from dgr.core.hashing import file_blake3
from dgr.core.locks import locked
from dgr.core.log import get_logger
from dgr.core.paths import workspace
from dgr.toolchain.pin import PATCH_DIR_REL, Pin, load_pin, parse_pin
from dgr.toolchain.synth.generic import known_archs
from dgr.toolchain.upstream import bumpchecks
from dgr.toolchain.upstream.bumpchecks import Check, Context, Step
from dgr.toolchain.upstream.layout import layout
from dgr.toolchain.upstream.newsource import (UNKNOWN_SHA256, NewSource, listing_text, placeholder_source, resolve,
                                              source_label)
from dgr.toolchain.upstream.patchlist import check_patch_list, patch_files_in_dir
from dgr.toolchain.upstream.pristine import fetch, verify
from dgr.toolchain.upstream.restack import PatchOutcome, export_series, pinned_stack, regenerate, restack

log = get_logger(__name__)

TREE_LISTING = "toolchains/llama.cpp.tree.txt"
# What the engine build needs of the repository beside the pin and the patches (worker/CMakeLists.txt reads
# ../proto and ../toolchains/llama.cpp.pin.json).
BUILD_DIRS = ("worker", "proto")


@dataclass
class Options:
    write: bool = False
    sha256: str | None = None  # the sdist's expected sha256
    commit: str | None = None  # a plain folder's commit
    release: str | None = None  # the new commit's release tag (bNNNN)
    archive_sha256: str | None = None  # pin the GitHub archive of the commit too, at this sha256
    families: list[str] | None = None  # a subset of the 108 architectures (a quick rehearsal)
    skip_gate: bool = False
    patches_only: bool = False  # stop after the patch step
    patches: Path | None = None  # a patch series for the new commit (patches/llama.cpp/'s layout) to use instead
    jobs: int | None = None
    threads: int = 1
    scratch: Path | None = None

    def skipped(self) -> list[str]:
        """The parts of the full run these options leave out (a pin is written only after the full run)."""
        out = []
        if self.patches_only:
            out.append("--patches-only")
        if self.families is not None:
            out.append("--families")
        if self.skip_gate:
            out.append("--skip-gate")
        return out


@dataclass
class BumpResult:
    source: str
    scratch: Path
    new: NewSource | None = None
    steps: list[Step] = field(default_factory=list)
    patches: list[PatchOutcome] = field(default_factory=list)
    written: list[str] = field(default_factory=list)
    refusal: str | None = None  # why nothing was written, when `write` was asked for

    @property
    def passed(self) -> bool:
        """Every step passed or was skipped on request (a run with skips never writes: Options.skipped)."""
        return bool(self.steps) and all(s.status in ("passed", "skipped") for s in self.steps)

    def step(self, name: str) -> Step:
        return next(s for s in self.steps if s.name == name)

    def to_json(self) -> str:
        new = None if self.new is None else {
            "commit": self.new.commit, "date": self.new.date, "subject": self.new.subject,
            "describe": self.new.describe,
            "tree_hash": self.new.tree_hash, "files": self.new.files, "sources": self.new.sources}
        return json.dumps({"source": self.source, "scratch": str(self.scratch), "new": new, "passed": self.passed,
                           "steps": [asdict(s) for s in self.steps],
                           "patches": [asdict(p) for p in self.patches], "written": self.written,
                           "refusal": self.refusal}, indent=2) + "\n"


STEPS = ("source", "patches", "build", "families", "v4-splits", "gate", "certificates")


def default_checks(opts: Options) -> list[tuple[str, Check]]:
    """The checks after the patch step, in order (a skipped one is listed with None)."""
    return [("build", bumpchecks.check_build), ("families", bumpchecks.check_families),
            ("v4-splits", bumpchecks.check_v4_splits),
            ("gate", None if opts.skip_gate else bumpchecks.check_gate),  # type: ignore[list-item]
            ("certificates", bumpchecks.check_certificates)]


def scratch_dir(label: str, ws: Path | None = None) -> Path:
    return (Path(ws) if ws else workspace()) / "upstream-bump" / label


def bump(source: str, opts: Options | None = None, *, pin: Pin | None = None, ws: Path | None = None,
         checks: Sequence[tuple[str, Check | None]] | None = None) -> BumpResult:
    """Run the bump procedure for SOURCE (see the module's doc); returns its report. `checks` replaces the
    checks after the patch step (tests); `ws` is the checkout's workspace (default: dgr.core.paths.workspace())."""
    opts = opts or Options()
    pin = pin or load_pin()
    if opts.write and opts.skipped():
        raise UpstreamError(f"--write needs the full run; drop {', '.join(opts.skipped())} (a pin is written only "
                            "after every check has run and passed)")
    if opts.families is not None:
        _check_families(opts.families)
    check_list = list(checks if checks is not None else default_checks(opts))
    pin_bytes = pin.path.read_bytes()
    main_ws = Path(ws) if ws else workspace()
    scratch = opts.scratch or scratch_dir(source_label(source, opts.commit), main_ws)
    res = BumpResult(source=source, scratch=scratch)
    steps = {name: Step(name) for name in STEPS[:2]}
    res.steps = list(steps.values())
    scratch.mkdir(parents=True, exist_ok=True)
    with locked(scratch.parent / f".{scratch.name}.lock"):
        stack = _stack(pin, opts.patches, scratch)
        # 1. the source, verified, into the scratch workspace
        with _timed(steps["source"]):
            new = res.new = resolve(source, pin, scratch / "ws", sha256=opts.sha256, commit=opts.commit,
                                    archive_sha256=opts.archive_sha256, ws=main_ws)
            steps["source"].lines = list(new.checks)
            same = " (the current pin's commit: a no-op bump)" if new.commit == pin.commit else ""
            steps["source"].ok(f"llama.cpp {new.commit}{' ' + new.date if new.date else ''}{same}: {new.files} "
                               f"files, tree hash {new.tree_hash[:16]}")
        if steps["source"].status != "passed":
            steps["patches"].summary = "the source was refused"
            res.steps += [Step(n, summary="the source was refused") for n, _ in check_list]
            return _finish(res, opts, pin, pin_bytes)

        # 2. the patch stack, three-way where it can, every failing hunk named
        with _timed(steps["patches"]):
            fetch(pin, main_ws)
            verify(pin, main_ws)
            res.patches = restack(pin, layout(pin, main_ws).pristine, new.tree, new.commit, scratch / "restack", stack)
            _summarize_patches(steps["patches"], res.patches)
        if steps["patches"].status != "passed" or opts.patches_only:
            if opts.patches_only and steps["patches"].status == "passed":
                res.steps += [Step(n, status="skipped", summary="--patches-only") for n, _ in check_list]
            else:
                res.steps += [Step(n, summary="the patch stack does not apply") for n, _ in check_list]
            return _finish(res, opts, pin, pin_bytes)

        # 3. the scratch repository: the pin as it would be written, the stack, worker/ and proto/
        spin = _stage_repo(pin, new, res.patches, dict(stack), scratch, opts)
        check_patch_list(spin)
        ctx = Context(old_pin=pin, pin=spin, root=scratch / "repo", ws=scratch / "ws", scratch=scratch,
                      main_ws=main_ws, jobs=opts.jobs, threads=opts.threads, families=opts.families)

        # 4. the checks; after a failed build nothing else can run
        for name, check in check_list:
            step = Step(name)
            res.steps.append(step)
            if check is None:
                step.status, step.summary = "skipped", f"--skip-{name}"
                continue
            if any(s.name == "build" and s.status != "passed" for s in res.steps[:-1]):
                step.summary = "no engine: the build failed"
                continue
            log.info("bump: %s ...", name)
            with _timed(step):
                check(ctx, step)
            log.info("bump: %s: %s (%.0f s) %s", name, step.status.upper(), step.seconds, step.summary)
        return _finish(res, opts, pin, pin_bytes, spin)


class _timed:
    """Time a step; a DgrError inside it fails the step with the error's message (nothing else is caught)."""

    def __init__(self, step: Step):
        self.step = step

    def __enter__(self) -> Step:
        self.t0 = time.monotonic()
        return self.step

    def __exit__(self, kind, err, tb) -> bool:
        self.step.seconds = round(time.monotonic() - self.t0, 1)
        if err is not None and isinstance(err, DgrError):
            self.step.fail(str(err))
            return True
        if err is None and self.step.status == "not run":
            self.step.status = "passed"
        return False


def _check_families(families: list[str]) -> None:
    unknown = [a for a in families if a not in known_archs()]
    if unknown:
        raise UpstreamError(f"--families: unknown architecture(s) {', '.join(unknown)}; `dgr synth --list` names "
                            f"{len(known_archs())}")


def _summarize_patches(step: Step, outcomes: list[PatchOutcome]) -> None:
    for o in outcomes:
        step.lines += o.lines()
    failed = [o for o in outcomes if o.how == "failed"]
    merged = [o for o in outcomes if o.how == "three-way"]
    if failed:
        n = sum(len(o.failures) for o in failed)
        step.fail(f"{len(failed)} of {len(outcomes)} patches do not apply ({n} hunks): "
                  f"{', '.join(_number(o.file) for o in failed)}; "
                  "regenerate them (docs/upstream.md, 'When a patch does not apply')")
    else:
        regenerated = f"; {len(merged)} only three-way, regenerated: {', '.join(o.name for o in merged)}"
        step.ok(f"all {len(outcomes)} patches apply" + (regenerated if merged else ""))


def _number(file: str) -> str:
    """0012 for patches/llama.cpp/0012-topic.patch, vulkan/0001 for a lane's own patch."""
    rel = file.removeprefix(PATCH_DIR_REL + "/")
    return rel.split("-", 1)[0]


def _stack(pin: Pin, patches: Path | None, scratch: Path) -> list[tuple[str, Path]]:
    """The stack to apply: the pinned one; a series folder; or the series a maintainer fixed in a git
    repository (a clone of the scratch `restack/`), exported into `scratch/series/` first."""
    if patches is None:
        return pinned_stack(pin)
    patches = Path(patches).resolve()
    if (patches / ".git").exists():
        return export_series(patches, [f for f, _ in pinned_stack(pin)], scratch / "series")
    return series_in(patches)


def series_in(folder: Path) -> list[tuple[str, Path]]:
    """(repository-relative name, file) of each patch of a series laid out like patches/llama.cpp/ (the common
    stack NNNN-topic.patch by name, then each lane's folder), in apply order."""
    folder = Path(folder).resolve()
    if not folder.is_dir():
        raise UpstreamError(f"--patches {folder}: not a folder")
    # patch_files_in_dir reads only `patch_dir` of the pin it is given: the folder stands in for it
    files = patch_files_in_dir(SimpleNamespace(patch_dir=folder))  # type: ignore[arg-type]
    if not files:
        raise UpstreamError(f"--patches {folder}: no NNNN-topic.patch files in it")
    return [(f, folder / f.removeprefix(PATCH_DIR_REL + "/")) for f in files]


def _stage_repo(pin: Pin, new: NewSource, outcomes: list[PatchOutcome], files: dict[str, Path], scratch: Path,
                opts: Options) -> Pin:
    """The scratch repository root (see the module's doc); returns its pin."""
    root = scratch / "repo"
    if root.exists():
        shutil.rmtree(root)
    (root / "toolchains").mkdir(parents=True)
    for o in outcomes:
        dest = root / o.file
        if o.how == "three-way":
            regenerate(scratch / "restack", o, files[o.file], dest)
        else:
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(files[o.file], dest)
    for d in BUILD_DIRS:
        if (pin.root / d).is_dir():
            shutil.copytree(pin.root / d, root / d, symlinks=True,
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "bazel-*"))
    (root / TREE_LISTING).write_text(listing_text(new))
    path = root / "toolchains" / pin.path.name
    path.write_text(new_pin_text(pin, new, root, [o.file for o in outcomes], opts, scratch=True))
    return parse_pin(path.read_text(), path)


def new_pin_text(pin: Pin, new: NewSource, root: Path, patches: list[str], opts: Options, *,
                 scratch: bool = False) -> str:
    """The pin file as the bump writes it: the file as it is (its notes, key order), with the commit, release,
    date, sources, tree hash, listing and patch hashes of the new tree and the stack under `root`."""
    raw = json.loads(pin.path.read_text())
    release = opts.release or (pin.release if new.commit == pin.commit else None)
    sources = list(new.sources)
    if new.commit == pin.commit:  # the pin's other sources hold the same commit: keep them
        sources += [src for src in raw["sources"] if not any(_same_source(src, n) for n in sources)]
    sources = sources or ([placeholder_source(new.commit)] if scratch else [])
    raw.update({
        "release": release or ("unknown: pass --release" if scratch else ""),
        "commit": new.commit,
        "date": new.date if new.date else raw.get("date") if new.commit == pin.commit else None,
        "sources": sources,
        "tree_hash": new.tree_hash,
        "tree_listing": TREE_LISTING,
        "patches": [{"file": f, "blake3": file_blake3(root / f)} for f in patches],
    })
    if raw["date"] is None:
        raw.pop("date")
    return json.dumps(raw, indent=2) + "\n"


def _same_source(a: dict, b: dict) -> bool:
    if a.get("kind") != b.get("kind"):
        return False
    if a.get("kind") == "pypi-sdist":
        return (a.get("package"), a.get("version")) == (b.get("package"), b.get("version"))
    return a.get("url") == b.get("url")


def _finish(res: BumpResult, opts: Options, pin: Pin, pin_bytes: bytes, spin: Pin | None = None) -> BumpResult:
    if opts.write:
        step = Step("write")
        res.steps.append(step)
        with _timed(step):
            why = _why_not_write(res, opts, pin, pin_bytes, spin)
            if why:
                res.refusal = why
                step.fail(f"not written: {why}")
            else:
                assert spin is not None and res.new is not None
                res.written = write_pin(pin, spin, res.new, opts)
                step.ok(f"wrote {', '.join(res.written)}")
    if res.scratch.is_dir():
        (res.scratch / "report.json").write_text(res.to_json())
    return res


def _why_not_write(res: BumpResult, opts: Options, pin: Pin, pin_bytes: bytes, spin: Pin | None) -> str | None:
    bad = [s for s in res.steps if s.name != "write" and s.status != "passed"]
    if bad:
        return "; ".join(f"{s.name} {s.status}" + (f" ({s.summary})" if s.summary else "") for s in bad)[:2000]
    if spin is None or res.new is None:
        return "the bump did not get as far as a new pin"
    if res.new.unpinnable and res.new.commit != pin.commit:
        return res.new.unpinnable
    if any(s.get("sha256") == UNKNOWN_SHA256 for s in res.new.sources):
        return "a source has no sha256"
    if not (opts.release or res.new.commit == pin.commit):
        return (f"name llama.cpp {res.new.commit[:12]}'s release tag with --release bNNNN (llama.cpp tags each "
                "commit of master b<build number>; `git describe --tags` in a llama.cpp clone says which)")
    if pin.path.read_bytes() != pin_bytes:
        return f"{pin.path} changed while the bump ran; run it again"
    return None


def write_pin(pin: Pin, spin: Pin, new: NewSource, opts: Options) -> list[str]:
    """Write the new stack's changed patches, the tree listing, then the pin (last: until it is replaced the
    checkout still names the old, consistent state). Returns the repository-relative paths written."""
    written = []
    for p in spin.patches:
        src, dest = spin.root / p.file, pin.root / p.file
        if not dest.exists() or dest.read_bytes() != src.read_bytes():
            _replace(dest, src.read_bytes())
            written.append(p.file)
    keep = {p.file for p in spin.patches}
    for p in pin.patches:  # a patch the new series no longer has
        if p.file not in keep and (pin.root / p.file).exists():
            (pin.root / p.file).unlink()
            written.append(f"{p.file} (removed)")
    listing = pin.root / TREE_LISTING
    text = listing_text(new).encode()
    if not listing.exists() or listing.read_bytes() != text:
        _replace(listing, text)
        written.append(TREE_LISTING)
    body = new_pin_text(pin, new, spin.root, [p.file for p in spin.patches], opts).encode()
    if pin.path.read_bytes() != body:
        _replace(pin.path, body)
        written.append(str(pin.path.relative_to(pin.root)))
    load_pin(pin.path)  # what was written reads back
    if new.archive is not None:  # the checkout's next `dgr upstream fetch` finds it verified in its cache
        cache = layout(pin).downloads / new.archive.name
        if not cache.exists():
            cache.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(new.archive, cache)
    return written


def _replace(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def report_text(res: BumpResult) -> str:
    """The report `dgr upstream bump` prints: each step with its time, summary and lines."""
    out = [f"dgr upstream bump {res.source}" + (f" -> llama.cpp {res.new.commit}" if res.new else ""),
           f"scratch: {res.scratch}"]
    for s in res.steps:
        secs = f"{s.seconds:.0f} s" if s.seconds else "-"
        out.append(f"{s.name:<13} {s.status.upper():<8} {secs:>7}  {s.summary}")
        out += [f"    {line}" for line in s.lines if s.name in ("source", "gate") or s.status == "failed"
                or (s.name == "patches" and not line.endswith(": applies"))]
    skipped = [st.name for st in res.steps if st.status == "skipped"]
    verdict = ("PASSED" if res.passed else "FAILED") + (f" (skipped: {', '.join(skipped)})" if skipped else "")
    wrote = any(st.name == "write" and st.status == "passed" for st in res.steps)
    if wrote and not res.written:
        out.append(f"{verdict}: the checkout's pin, listing and patches already say this; nothing to change")
    elif res.written:
        out.append(f"{verdict}: the pin now names llama.cpp {res.new.commit if res.new else '?'}; next: "
                   "`dgr upstream patch --force && dgr build-engine`, commit the pin, the listing and the patches, "
                   "and re-run `dgr gate alpha` (certificates made under the old pin no longer match)")
    elif res.refusal:
        out.append(f"{verdict}: nothing written ({res.refusal})")
    else:
        out.append(f"{verdict}: nothing written (a rehearsal; --write writes the pin when every step passes)")
    out.append(f"report: {res.scratch / 'report.json'}")
    return "\n".join(out)


__all__ = ["BumpResult", "Options", "STEPS", "bump", "default_checks", "new_pin_text", "report_text", "series_in",
           "write_pin"]
