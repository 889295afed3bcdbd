"""The patch stack re-applied to a new llama.cpp commit: plainly, else three-way, else named hunk by hunk.

One git repository in the bump's scratch folder holds both sides, so that `git am -3` finds the blobs
every patch's `index` lines name:

    dgr-old-pristine   the pinned commit's verified tree
    dgr-old-patched    + every pinned patch (each must apply: the pin promises it)
    dgr-pristine       the new commit's verified tree (an orphan branch)
    HEAD               + each patch: `git apply --check` then `git am`; else `git am -3` (a three-way
                       merge; the patch is then regenerated with `git format-patch`); else the patch fails

A failed patch is taken apart hunk by hunk (`git apply --check`, then `git apply --3way`, on a one-hunk
patch) to name each hunk that does not apply, its file, its header and what upstream changed under it;
the hunks that do apply are committed, so the patches after it are tried on the best tree there is.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from dgr.core.errors import UpstreamError
from dgr.core.log import get_logger
from dgr.toolchain.pin import Pin
from dgr.toolchain.upstream.apply import GIT_ENV, init_pristine_repo
from dgr.toolchain.upstream.newsource import git

log = get_logger(__name__)

_AM = ("am", "-q", "--keep-cr", "--whitespace=nowarn")
GIT_DATE = GIT_ENV["GIT_AUTHOR_DATE"]
PARTIAL = " (PARTIAL: hunks did not apply)"  # marks the commit of a failed patch in the scratch repository
_HUNK = re.compile(r"@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@(.*)")


@dataclass
class HunkFailure:
    """One hunk of a patch that applies neither plainly nor three-way."""

    file: str  # the upstream path
    hunk: int  # 1-based, among the patch's hunks for this file
    hunks: int  # how many hunks the patch has for this file
    header: str  # "@@ -66,6 +68,9 @@ struct llama_hparams {"
    why: str  # what upstream changed under it, in one sentence

    def line(self) -> str:
        return f"hunk {self.hunk}/{self.hunks} of {self.file} ({self.header}): {self.why}"


@dataclass
class PatchOutcome:
    """How one patch of the stack went on the new commit."""

    file: str  # repository-relative, as the pin lists it
    how: str  # "clean" | "three-way" | "failed"
    failures: list[HunkFailure] = field(default_factory=list)
    three_way_hunks: int = 0  # of a failed patch: hunks that did merge three-way
    after: list[str] = field(default_factory=list)  # earlier failed patches that touched the same files
    commit: str = ""  # its commit in the scratch repository

    @property
    def name(self) -> str:
        return self.file.rsplit("/", 1)[1]

    def lines(self) -> list[str]:
        if self.how == "clean":
            return [f"{self.name}: applies"]
        if self.how == "three-way":
            return [f"{self.name}: applies three-way (context moved upstream); regenerated against the new commit"]
        head = f"{self.name}: DOES NOT APPLY: {len(self.failures)} hunk(s)"
        if self.after:
            head += f" (after {', '.join(self.after)} failed on the same file(s): may follow from that)"
        return [head] + [f"  {f.line()}" for f in self.failures]


@dataclass
class Section:
    """One file's part of a patch: its `diff --git` header lines and its hunks (each a list of lines)."""

    path: str
    header: list[str]
    hunks: list[list[str]]
    new_file: bool = False


def parse_patch(text: str) -> list[Section]:
    """The file sections of a git patch (the mail header and the trailing signature are dropped)."""
    sections: list[Section] = []
    cur: Section | None = None
    lines = text.splitlines(keepends=True)
    for line in lines:
        if line.startswith("diff --git a/"):
            a, _, b = line[len("diff --git a/"):].rstrip("\n").partition(" b/")
            cur = Section(path=b or a, header=[line], hunks=[])
            sections.append(cur)
        elif cur is None:
            continue
        elif line.startswith("@@"):
            cur.hunks.append([line])
        elif cur.hunks:
            if line.startswith((" ", "+", "-", "\\")) or line == "\n":
                cur.hunks[-1].append(line)
            else:  # "-- " signature, or the next mail
                cur = None
        else:
            cur.header.append(line)
            if line.startswith("new file mode"):
                cur.new_file = True
    return sections


def _one_hunk(sec: Section, hunk: list[str]) -> str:
    return "".join(sec.header) + "".join(hunk)


def _preimage(hunk: list[str]) -> list[str]:
    return [line[1:].rstrip("\n") for line in hunk[1:] if line[:1] in (" ", "-")]


def explain_hunk(tree: Path, sec: Section, hunk: list[str]) -> str:
    """What upstream changed under a hunk that does not apply, from the file as it now is."""
    target = tree / sec.path
    if not target.exists():
        return f"{sec.path} does not exist at the new commit (upstream added it later, or removed or renamed it)"
    have = set(target.read_text(errors="replace").splitlines())
    pre = _preimage(hunk)
    gone = [line for line in pre if line.strip() and line not in have]
    if gone:
        shown = "; ".join(f"`{g.strip()[:90]}`" for g in gone[:3])
        return f"{len(gone)} of the {len(pre)} lines it expects are not in the new file: {shown}"
    return (f"all {len(pre)} lines it expects are in the new file, but not together in this order "
            "(upstream inserted, moved or duplicated code among them)")


def _diagnose_and_apply_parts(work: Path, patch: Path) -> tuple[list[HunkFailure], int]:
    """Each hunk of a patch that failed as a whole: applied plainly, else three-way, else named. What applies
    is staged (the index follows the work tree, as `git apply --index` needs). Returns (failures, hunks
    merged three-way)."""
    failures, merged = [], 0
    with tempfile.TemporaryDirectory(prefix="dgr-hunk-") as tmp:
        one = Path(tmp) / "one.patch"
        for sec in parse_patch(patch.read_text(errors="replace")):
            units = sec.hunks or [[]]  # a section without hunks (a mode change, an empty file) is one unit
            target = work / sec.path
            for k, hunk in enumerate(units, 1):
                one.write_text(_one_hunk(sec, hunk))
                before = target.read_bytes() if target.is_file() else None
                if git(work, "apply", "--index", "--whitespace=nowarn", str(one), check=False).returncode == 0:
                    continue
                if sec.hunks and _apply_3way(work, one):
                    merged += 1
                    continue
                # a failed --3way leaves conflict markers and unmerged entries: put the file back as it was
                if before is None:
                    target.unlink(missing_ok=True)
                else:
                    target.write_bytes(before)
                git(work, "add", "-A", "--", sec.path, check=False)
                header = hunk[0].rstrip("\n") if hunk else "(no hunk)"
                failures.append(HunkFailure(sec.path, k, len(units), header, explain_hunk(work, sec, hunk)))
    return failures, merged


def _apply_3way(work: Path, patch: Path) -> bool:
    return git(work, "apply", "--3way", "--whitespace=nowarn", str(patch), check=False).returncode == 0


def _commit_as(work: Path, patch: Path, note: str) -> None:
    """Commit the staged tree with `patch`'s author, date and message (as `git am` would), so that
    `regenerate` exports it with the original header; `note` is added to the subject of a partial one."""
    text = patch.read_text(errors="replace")
    if not _is_mail(patch):
        git(work, "commit", "-q", "--no-verify", "--allow-empty", "-m", f"{patch.name}{note}")
        return
    with tempfile.TemporaryDirectory(prefix="dgr-mail-") as tmp:
        msg, body = Path(tmp) / "msg", Path(tmp) / "patch"
        info = git(work, "mailinfo", str(msg), str(body), input=text).stdout
        fields = dict(line.split(": ", 1) for line in info.splitlines() if ": " in line)
        message = fields.get("Subject", patch.name) + note + "\n\n" + msg.read_text()
        msg.write_text(message)
        author = f"{fields.get('Author', 'dgr')} <{fields.get('Email', 'dgr@localhost')}>"
        git(work, "commit", "-q", "--no-verify", "--allow-empty", "--author", author,
            "--date", fields.get("Date", GIT_DATE), "-F", str(msg))


def _build_old_side(work: Path, old_pin: Pin, old_pristine: Path) -> None:
    init_pristine_repo(old_pristine, work, f"llama.cpp {old_pin.commit} (pristine, the current pin)", "dgr-old-pristine")
    for p in old_pin.patches:
        if not _apply_plain(work, old_pin.root / p.file):
            raise UpstreamError(f"{p.file} does not apply to the current pin {old_pin.commit[:12]} itself; fix the "
                                "stack first (`dgr upstream patch --force` says more)")
    git(work, "tag", "dgr-old-patched")


def _apply_plain(work: Path, patch: Path) -> bool:
    if git(work, "apply", "--check", "--whitespace=nowarn", str(patch), check=False).returncode != 0:
        return False
    if _is_mail(patch):
        return git(work, *_AM, str(patch), check=False).returncode == 0
    git(work, "apply", "--index", "--whitespace=nowarn", str(patch))
    git(work, "commit", "-q", "--no-verify", "-m", patch.name)
    return True


def _is_mail(patch: Path) -> bool:
    return patch.read_text(errors="replace").startswith("From ")


def _new_side(work: Path, new_tree: Path, commit: str) -> None:
    git(work, "checkout", "-q", "--orphan", "dgr-new")
    git(work, "rm", "-rqf", "--cached", ".")
    for child in work.iterdir():
        if child.name != ".git":
            shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()
    shutil.copytree(new_tree, work, symlinks=True, dirs_exist_ok=True)
    git(work, "add", "-A")
    git(work, "commit", "-q", "--no-verify", "--allow-empty", "-m", f"llama.cpp {commit} (pristine, dgr bump)")
    git(work, "tag", "dgr-pristine")


def pinned_stack(pin: Pin) -> list[tuple[str, Path]]:
    """(repository-relative name, file) of each patch of `pin`, in order."""
    return [(p.file, pin.root / p.file) for p in pin.patches]


def restack(old_pin: Pin, old_pristine: Path, new_tree: Path, new_commit: str, work: Path,
            stack: list[tuple[str, Path]] | None = None) -> list[PatchOutcome]:
    """Apply a patch stack (default: `old_pin`'s own; else (name, file) pairs, e.g. a series regenerated for
    the new commit) to `new_tree` in a fresh git repository at `work` (see the module's doc)."""
    if work.exists():
        shutil.rmtree(work)
    work.parent.mkdir(parents=True, exist_ok=True)
    _build_old_side(work, old_pin, old_pristine)
    _new_side(work, new_tree, new_commit)
    outcomes: list[PatchOutcome] = []
    failed_files: dict[str, list[str]] = {}  # upstream file -> failed patches that touch it
    for file, path in stack if stack is not None else pinned_stack(old_pin):
        out = PatchOutcome(file=file, how="clean")
        if not _apply_plain(work, path):
            if _is_mail(path) and git(work, *_AM, "-3", str(path), check=False).returncode == 0:
                out.how = "three-way"
            else:
                if _is_mail(path):
                    git(work, "am", "--abort", check=False)
                git(work, "reset", "-q", "--hard", "HEAD")
                out.how = "failed"
                out.failures, out.three_way_hunks = _diagnose_and_apply_parts(work, path)
                if not out.failures:  # every hunk applied on its own (e.g. two hunks overlapping): a merge
                    out.how = "three-way"
                _commit_as(work, path, "" if not out.failures else PARTIAL)
        touched = {s.path for s in parse_patch(path.read_text(errors="replace"))}
        out.after = sorted({q for f in touched for q in failed_files.get(f, [])})
        if out.how == "failed":
            for f in touched:
                failed_files.setdefault(f, []).append(out.name.split("-", 1)[0])
        out.commit = git(work, "rev-parse", "HEAD").stdout.strip()
        log.info("patch %s: %s", out.name, out.how if out.how != "failed" else
                 f"FAILED ({len(out.failures)} hunk(s))")
        outcomes.append(out)
    return outcomes


def regenerate(work: Path, outcome: PatchOutcome, original: Path, dest: Path) -> Path:
    """Write `outcome`'s commit as a patch at `dest`: `git format-patch` as docs/upstream.md makes them, keeping
    the original's mail header and message (its DEP-3 fields); a plain diff stays a plain diff."""
    if _is_mail(original):
        text = git(work, "format-patch", "-1", "--zero-commit", "--no-signature", "--stdout", outcome.commit).stdout
    else:
        text = git(work, "diff", f"{outcome.commit}~1", outcome.commit).stdout
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, dest)
    return dest


def export_series(repo: Path, names: list[str], dest: Path) -> list[tuple[str, Path]]:
    """The series a maintainer fixed in a copy of the scratch repository (one commit per patch after the tag
    `dgr-pristine`, in the stack's order), written to `dest` under the stack's `names` (the layout of
    patches/llama.cpp/). Refuses a commit still marked PARTIAL, and a count that is not the stack's."""
    if git(repo, "rev-parse", "-q", "--verify", "dgr-pristine", check=False).returncode != 0:
        raise UpstreamError(f"{repo}: no tag dgr-pristine; give the scratch repository of a bump (or a clone of it)")
    commits = git(repo, "rev-list", "--reverse", "dgr-pristine..HEAD").stdout.split()
    if len(commits) != len(names):
        raise UpstreamError(f"{repo}: {len(commits)} commits after dgr-pristine, but the stack has {len(names)} "
                            "patches; keep one commit per patch, in order (amend, do not add or drop)")
    if dest.exists():
        shutil.rmtree(dest)
    out = []
    for name, commit in zip(names, commits):
        subject = git(repo, "log", "-1", "--format=%s", commit).stdout.strip()
        if subject.endswith(PARTIAL):
            raise UpstreamError(f"{repo}: commit {commit[:12]} ({Path(name).name}) is still marked PARTIAL: make the "
                                "change its failed hunks made, then `git commit --amend` without the mark")
        text = git(repo, "format-patch", "-1", "--zero-commit", "--no-signature", "--stdout", commit).stdout
        path = dest / name.split("/", 2)[2]  # patches/llama.cpp/<rest>
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        out.append((name, path))
    return out
