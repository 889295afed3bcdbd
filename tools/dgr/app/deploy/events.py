"""What happened to a run's workers since the last look, one line per event, from successive `state.json`s.

`dgr up` prints these while it waits for SERVING (and afterwards with `--foreground`): each exit of a
worker with how it ended and the last line it wrote (usually why), the restart coming, and a give-up.
Crashes after the first that end the same way are told in short, without the log line again, so a
worker in a crash loop costs a line per crash, not a screenful.
"""

from __future__ import annotations


def exit_line(name: str, rec: dict, missed: int = 0) -> str:
    """One line for the latest exit of worker `name` (its record in state.json)."""
    e = rec.get("last_exit") or {}
    how, ran = e.get("how", "an exit"), e.get("ran_s", 0.0)
    line = e.get("last_line") or "(it wrote nothing to its log)"
    more = f" ({missed} more exit(s) since the last report)" if missed else ""
    same = rec.get("same_in_a_row", 1)
    if rec.get("gave_up"):
        return (f"{name} exited with {how} after {ran:.1f} s, {same} times in a row the same way{more}: "
                f"not restarting it; its last log line: {line}")
    wait = "restarting" if e.get("restart_in_s") is None else f"restarting in {e['restart_in_s']:.1f} s"
    if same > 1:
        return f"{name} exited again the same way ({how} after {ran:.1f} s, {same} in a row){more}; {wait}"
    return f"{name} exited with {how} after {ran:.1f} s{more}; {wait}; its last log line: {line}"


class Watcher:
    """Remembers how many times each worker had exited; `changes` says what is new since."""

    def __init__(self, state: dict | None = None):
        self.seen = {n: r.get("exits", 0) for n, r in ((state or {}).get("workers") or {}).items()}

    def changes(self, state: dict | None) -> list[str]:
        out = []
        for name, rec in ((state or {}).get("workers") or {}).items():
            n, before = rec.get("exits", 0), self.seen.get(name, 0)
            if n > before:
                self.seen[name] = n
                out.append(exit_line(name, rec, n - before - 1))
        return out

    def exited_since(self, state: dict | None, name: str) -> bool:
        """Whether worker `name` exited since the last `changes` (call it before them)."""
        return (((state or {}).get("workers") or {}).get(name) or {}).get("exits", 0) > self.seen.get(name, 0)
