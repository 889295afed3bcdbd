"""Up, degraded or down: a worker's, a route's and a run's condition, from health answers and `state.json`.

Pure functions (what was read in, conditions out), so `dgr status`, its exit status and the tests agree:

- a worker is `up` when it answers the gRPC health check SERVING; `degraded` when it does not but the
  supervisor still has it (its process runs but is starting, draining or stuck, or a restart of it is
  pending); `down` when nothing will bring it back (the supervisor gave up on it, or the run's
  supervisor is not running);
- a route is `up` when every local replica of every stage is up; `down` when some stage has no replica
  up and none on another host; `degraded` otherwise (every stage can still serve). `dgr status` runs on
  one host and probes only its workers: another host's replicas are `remote`, not counted either way;
- a run is `up` when its supervisor runs and every local worker is up; `down` when its supervisor is not
  running or one of its routes is down; `degraded` otherwise.
"""

from __future__ import annotations

UP, DEGRADED, DOWN = "up", "degraded", "down"
REMOTE = "remote"
# `dgr status`'s exit status for each condition of the run (3 was "not up" before degraded existed;
# 1 and 2 are Python's and dgr's errors).
EXIT = {UP: 0, DOWN: 3, DEGRADED: 4}


def given_up_why(rec: dict) -> str:
    e = rec.get("last_exit") or {}
    line = e.get("last_line") or "it wrote nothing to its log"
    n = rec.get("same_in_a_row", 0)
    return f"given up on after {n} crash{'' if n == 1 else 'es'} in a row the same way ({e.get('how', '?')}): {line}"


def worker(rec: dict, health: str, supervised: bool) -> tuple[str, str]:
    """(condition, why) of one local worker: `rec` is its record in state.json, `health` its answer."""
    if rec.get("gave_up"):
        return DOWN, given_up_why(rec)
    if not supervised:
        return DOWN, "the run's supervisor is not running"
    if health == "SERVING":
        return UP, "answers health SERVING"
    if not rec:
        return DEGRADED, f"health {health}: the supervisor has not started it yet"
    if rec.get("restart_pending"):
        e = rec.get("last_exit") or {}
        return DEGRADED, f"exited ({e.get('how', '?')}), restart pending: {e.get('last_line') or 'no log line'}"
    if rec.get("pid"):
        return DEGRADED, f"health {health}: its process (pid {rec['pid']}) runs but does not serve " \
                         "(starting, draining or stuck)"
    return DEGRADED, f"health {health}: its process has exited; the supervisor has not restarted it yet"


def route(text: str, local: dict[str, str]) -> dict:
    """The condition of route `text` ("a,b|c,d": stages by comma, replicas by bar), given the condition
    of each local worker by address; an address not in `local` is another host's."""
    stages, notes = [], []
    for i, stage in enumerate(text.split(",")):
        reps = [{"address": a, "state": local.get(a, REMOTE)} for a in stage.split("|")]
        here = [r for r in reps if r["state"] != REMOTE]
        n_up = sum(r["state"] == UP for r in here)
        if n_up == len(here):
            st = UP
        elif n_up == 0 and len(here) == len(reps):
            st = DOWN
            notes.append(f"stage {i} has no replica up")
        else:
            st = DEGRADED
            notes.append(f"stage {i} has {n_up} of {len(here)} local replica(s) up")
        stages.append({"stage": i, "state": st, "replicas": reps})
    states = {s["state"] for s in stages}
    state = DOWN if DOWN in states else DEGRADED if DEGRADED in states else UP
    return {"route": text, "state": state, "why": "; ".join(notes) or "every local replica is up",
            "stages": stages}


def run(supervised: bool, workers: list[str], routes: list[dict]) -> str:
    """The run's condition from its supervisor, its workers' conditions and its routes'."""
    if not supervised or any(r["state"] == DOWN for r in routes):
        return DOWN
    return UP if all(w == UP for w in workers) else DEGRADED
