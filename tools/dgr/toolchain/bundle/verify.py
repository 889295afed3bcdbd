"""`verify_bundle`: check every chunk of a bundle's stage files against its manifest, resumably.

It names the first bad file and chunk.

Progress is recorded in the workspace after each chunk, so an interrupted run resumes where it
stopped; a file whose size or mtime changed since is checked again from its start.

Tests: $DGR_TEST_VERIFY_STOP_AFTER=N makes the verifying process stop itself (SIGSTOP) right after the N-th
chunk it read is recorded, so a test can kill it at an exact point rather than at whatever point it reached.
"""

from __future__ import annotations

import json
import os
import signal
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from dgr.core.errors import BundleError
from dgr.core.hashing import bytes_blake3
from dgr.core.paths import workspace
from dgr.toolchain.bundle.manifest import Bundle, load_bundle


@dataclass
class VerifyReport:
    bundle_id: str
    chunks_total: int
    chunks_read: int = 0
    chunks_skipped: int = 0  # verified by an earlier, interrupted run
    complete: bool = False


def _state_path(b: Bundle, kind: str) -> Path:
    key = bytes_blake3(f"{kind}\0{b.root.resolve()}\0{b.id}".encode())[:20]
    d = workspace() / "state" / kind
    d.mkdir(parents=True, exist_ok=True)
    return d / f"{key}.json"


def _save_state(path: Path, state: dict) -> None:
    # A per-process temp name: several verifiers of one bundle (workers starting together) may save at once.
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(state, sort_keys=True))
    os.replace(tmp, path)


def _load_state(path: Path, resume: bool) -> dict:
    if not (resume and path.exists()):
        return {}
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def verify_bundle(path: str | Path, *, resume: bool = True, max_chunks: int | None = None,
                  progress: bool = False, stages: list[int] | None = None) -> VerifyReport:
    """Check every chunk of every stage file (of `stages` alone when given: a worker that serves one stage
    reads only its own); raise BundleError naming the first bad file and chunk.

    Progress is recorded after each chunk, so an interrupted run resumes where it stopped; a file whose
    size or mtime changed since is checked again from its start. `max_chunks` stops early (a budget).
    """
    b = load_bundle(path)
    m = b.manifest
    if stages is not None:
        unknown = sorted(set(stages) - {s.index for s in m.stages})
        if unknown:
            raise BundleError(f"{b.root}: no stage {', '.join(map(str, unknown))}: the bundle's stages are "
                              f"0-{len(m.stages) - 1}")
    todo = [s for s in m.stages if stages is None or s.index in stages]
    chunk = m.chunk_size
    spath = _state_path(b, "verify")
    state = _load_state(spath, resume)
    rep = VerifyReport(bundle_id=b.id, chunks_total=sum(len(s.chunks) for s in todo))
    stop_after = int(os.environ.get("DGR_TEST_VERIFY_STOP_AFTER") or 0)
    bar = tqdm(total=rep.chunks_total, unit="chunk", desc="verify", disable=not progress)
    try:
        for s in todo:
            p = b.root / s.file
            if not p.is_file():
                raise BundleError(f"{p}: stage {s.index} file is missing; re-provision the bundle")
            st = p.stat()
            if st.st_size != s.size:
                first_bad = min(st.st_size, s.size) // chunk
                raise BundleError(f"{p}: size {st.st_size} bytes, manifest says {s.size}: the file is "
                                  f"{'truncated' if st.st_size < s.size else 'too long'}; first bad chunk "
                                  f"{first_bad} (bytes {first_bad * chunk}-); re-provision the bundle")
            rec = state.get(s.file)
            start = 0
            if rec and rec.get("size") == st.st_size and rec.get("mtime_ns") == st.st_mtime_ns:
                start = int(rec.get("chunks_ok", 0))
            rep.chunks_skipped += start
            bar.update(start)
            with open(p, "rb") as f:
                f.seek(start * chunk)
                for k in range(start, len(s.chunks)):
                    if max_chunks is not None and rep.chunks_read >= max_chunks:
                        return rep
                    data = f.read(chunk)
                    rep.chunks_read += 1
                    if bytes_blake3(data) != s.chunks[k]:
                        raise BundleError(f"{p}: chunk {k} (bytes {k * chunk}-{k * chunk + len(data) - 1}) does "
                                          f"not match the manifest: the file is corrupt; re-provision the bundle")
                    state[s.file] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "chunks_ok": k + 1}
                    _save_state(spath, state)
                    bar.update(1)
                    if stop_after and rep.chunks_read == stop_after:
                        os.kill(os.getpid(), signal.SIGSTOP)    # tests: frozen at an exact chunk, to be killed
    finally:
        bar.close()
    rep.complete = True
    # a finished check starts afresh next time (the progress of stages it did not check is kept)
    for s in todo:
        state.pop(s.file, None)
    if state:
        _save_state(spath, state)
    else:
        spath.unlink(missing_ok=True)
    return rep
