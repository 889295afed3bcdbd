"""`dgr up` fails fast and says why, `dgr status` tells the truth, a signal to `dgr up` leaves nothing running.

Issue 24's first hour with a new model, part 3: with no engine library `dgr up` said nothing for 180 s
while every worker was restarted again and again; `dgr status` said "up" (exit 0) with every worker
unreachable; SIGTERM to a waiting `dgr up` left its supervisor running. Each test drives the real CLI
(`dgr up` as a subprocess, real workers of a tiny synthetic 3-stage llama on loopback, real signals) and
ends checking that no process of its run is left. Waits are bounded by generous deadlines (`BOUND_S`), far
below the ready timeout the files give (`READY_S`), never by how fast something should be.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from dgr.app.deploy import runstate
from dgr.app.deploy.spec import Supervise

from support.deploy import (REPO, FAILING_WORKER_LINE, compiled_library, dgr, failing_worker, lib_env,  # noqa: F401
                            not_a_library, tiny, tiny_deployment)

READY_S = 300        # the ready timeout in these files: a `dgr up` that waited it out would fail BOUND_S
BOUND_S = 120.0      # how long a test waits for something to happen before it fails


def _file(tmp_path: Path, tiny, supervise: str = "") -> str:
    """The tiny bundle in 3 stages on loopback, stage 1 twice (4 workers: s0-r0, s1-r0, s1-r1, s2-r0)."""
    return tiny_deployment(tmp_path, tiny, f"backoff = 0.2\nready_timeout = {READY_S}\n{supervise}", (1, 2, 1))


def _leaves_nothing(run: Path) -> None:
    """Assert no process of the run is left (and, should one be, kill it so the next test starts clean)."""
    left = runstate.run_processes(run)
    runstate.kill_all(run, 10.0)
    assert left == [], f"processes {left} of the run were left running"


class _Up:
    """`dgr up ARGS` started in the background, its output collected line by line as it comes."""

    def __init__(self, *args: str, env: dict):
        self.lines: dict[str, list[str]] = {"out": [], "err": []}
        # SIGINT as a terminal delivers it: a test runner started as a background job ignores SIGINT, and
        # its children would inherit that
        self.proc = subprocess.Popen([sys.executable, "-m", "dgr.cli.main", "up", *args], cwd=REPO, text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, **env},
                                     preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        self.readers = [threading.Thread(target=self._read, args=(f, k), daemon=True)
                        for f, k in ((self.proc.stdout, "out"), (self.proc.stderr, "err"))]
        for t in self.readers:
            t.start()

    def _read(self, f, key: str) -> None:
        for line in f:
            self.lines[key].append(line.rstrip("\n"))

    def wait_for(self, key: str, pattern: str) -> str:
        deadline = time.monotonic() + BOUND_S
        while True:
            hit = next((x for x in self.lines[key] if re.search(pattern, x)), None)
            if hit is not None:
                return hit
            ended = self.proc.poll() is not None and not any(t.is_alive() for t in self.readers)
            assert not ended, f"dgr up ended ({self.proc.returncode}) without {pattern!r}:\n{self.text()}"
            assert time.monotonic() < deadline, f"no {pattern!r} within {BOUND_S:.0f} s:\n{self.text()}"
            time.sleep(0.1)

    def stop(self) -> None:
        """On the way out of a test that failed midway: stop it as a user would (then for good)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(BOUND_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def finish(self) -> int:
        rc = self.proc.wait(BOUND_S)
        for t in self.readers:
            t.join(10)
        return rc

    def text(self) -> str:
        return "\n".join(self.lines["out"] + self.lines["err"])


def _status(f: str, run: Path, env: dict) -> tuple[int, dict, str]:
    """`dgr status` as JSON and as text: (exit status, the JSON, the text), the two exit statuses equal."""
    js = dgr("status", f, "--json", "--run-dir", str(run), env=env)
    text = dgr("status", f, "--run-dir", str(run), env=env)
    assert js.returncode == text.returncode, (js.stdout, text.stdout)
    return js.returncode, json.loads(js.stdout), text.stdout


def _pids(run: Path) -> dict[str, int]:
    return {n: r["pid"] for n, r in runstate.read_state(run)["workers"].items()}


# 1 and 2: `dgr up` fails fast, saying the workers' error


def test_up_with_a_missing_engine_library_fails_at_once_naming_it(tiny, tmp_path):
    f, run = _file(tmp_path, tiny), tmp_path / "run"
    missing = tmp_path / "no-such-engine.so"
    try:
        up = dgr("up", f, "--run-dir", str(run), env={"DGR_ENGINE_LIB": str(missing)}, timeout=BOUND_S)
    finally:
        _leaves_nothing(run)
    assert up.returncode == 2, up.stderr
    assert f"engine library {missing} does not exist" in up.stderr and "DGR_ENGINE_LIB" in up.stderr
    assert "dgr build-engine" in up.stderr, "it says what to do"
    assert not (run / "logs" / "supervisor.log").exists(), "nothing was started"


def _broken_library(kind: str, tmp_path: Path) -> tuple[Path, str]:
    """An engine library that does not load, and the loader's own message for it (dlopen's, or dlsym's for
    the C ABI's first symbol), asked of the loader here rather than written into the test."""
    import ctypes

    if kind == "not a shared library":
        path = Path(not_a_library(tmp_path)["DGR_ENGINE_LIB"])
    elif kind == "an undefined symbol":
        path = compiled_library(tmp_path, "undefined", "void dgr_not_anywhere(void);\n"
                                "int dgr_abi_version(void) { dgr_not_anywhere(); return 0; }\n")
    else:
        path = compiled_library(tmp_path, "not-dgrs", "int not_dgr(void) { return 0; }\n")
    try:
        getattr(ctypes.CDLL(str(path)), "dgr_abi_version")
    except (OSError, AttributeError) as err:
        return path, str(err)
    raise AssertionError(f"{path} loads")


def _up_with_own_library(tmp_path: Path, tiny, lib: Path):
    """`dgr up` as a user who points DGR_ENGINE_LIB at their own file: no DGR_WORKER_BIN, so dgr-worker is
    looked for beside it. (the finished `dgr up`, its run folder), nothing of the run left."""
    f, run = _file(tmp_path, tiny), tmp_path / "run"
    try:
        return dgr("up", f, "--run-dir", str(run), env={"DGR_ENGINE_LIB": str(lib), "DGR_WORKER_BIN": ""},
                   timeout=BOUND_S), run
    finally:
        _leaves_nothing(run)


@pytest.mark.parametrize("kind", ["not a shared library", "an undefined symbol", "no dgr_abi_version"])
def test_up_with_an_engine_library_that_does_not_load_fails_at_once_with_the_loaders_message(tiny, tmp_path, kind):
    lib, loader_says = _broken_library(kind, tmp_path)
    up, run = _up_with_own_library(tmp_path, tiny, lib)
    assert up.returncode == 2, up.stderr
    err = up.stderr.splitlines()[-1]
    assert err.startswith(f"dgr: error: the workers cannot start: engine library {lib} (DGR_ENGINE_LIB) does not "
                          "load: "), up.stderr
    assert loader_says in err, (loader_says, up.stderr)
    assert "dgr build-engine" in err and "nothing was started" in err, "it says what to do"
    assert "no dgr-worker" not in up.stderr and "exited" not in up.stderr, "no worker was started to fail"
    assert not (run / "logs" / "supervisor.log").exists(), "nothing was started"


def test_up_with_no_dgr_worker_beside_the_engine_library_fails_at_once_naming_it(tiny, lib_env, tmp_path):
    lonely = tmp_path / "lonely" / "libdgr_engine.so"
    lonely.parent.mkdir()
    shutil.copy2(lib_env["DGR_ENGINE_LIB"], lonely)
    up, run = _up_with_own_library(tmp_path, tiny, lonely)
    assert up.returncode == 2, up.stderr
    assert f"the workers cannot start: no dgr-worker beside the engine library {lonely}" in up.stderr, up.stderr
    assert "DGR_WORKER_BIN" in up.stderr and "nothing was started" in up.stderr
    assert not (run / "logs" / "supervisor.log").exists(), "nothing was started"


def test_a_worker_that_dies_the_same_way_at_every_start_is_given_up_on_and_up_fails_with_its_error(
        tiny, lib_env, tmp_path):
    f, run = _file(tmp_path, tiny), tmp_path / "run"
    try:
        up = dgr("up", f, "--run-dir", str(run), env=failing_worker(tmp_path, lib_env), timeout=BOUND_S)
    finally:
        _leaves_nothing(run)
    assert up.returncode == 2, up.stderr
    give_up = Supervise().give_up_after                     # the default (the file does not set it)
    err = up.stderr.splitlines()[-1]
    assert re.search(rf"^dgr: error: workers? [\w, -]+ will not start: it exited {give_up} times in a row the "
                     r"same way \(exit code 1, .*\) and the supervisor gave up on it; its last log line: "
                     + re.escape(FAILING_WORKER_LINE), err), err
    assert "The run is stopped: fix that, then `dgr up" in err
    # progress while it waited: each exit told once, with the worker's last log line the first time
    for name in ("s0-r0", "s1-r0", "s1-r1", "s2-r0"):
        told = [x for x in up.stderr.splitlines() if x.startswith(f"dgr up: {name} exited")]
        assert 1 <= len(told) <= give_up, told                      # one line per exit: at most give_up_after
        assert re.search(r"exited with exit code 1 after [\d.]+ s; restarting in 0\.2 s; its last log line: "
                         + re.escape(FAILING_WORKER_LINE), told[0]), told[0]
        assert all("exited again the same way (exit code 1" in x for x in told[1:-1]), told
    st = runstate.read_state(run)
    gave_up = [n for n, r in st["workers"].items() if r["gave_up"]]
    assert gave_up and all(st["workers"][n]["same_in_a_row"] == give_up for n in gave_up), st
    log = (run / "logs" / "supervisor.log").read_text()
    assert re.search(rf"{gave_up[0]}: exited with exit code 1 after [\d.]+ s, {give_up} times in a row the same "
                     r"way: not restarting it \(supervise.give_up_after = \d+; see .*\); its last log line: "
                     + re.escape(FAILING_WORKER_LINE), log), log


# 3: the ready timeout's default is told


def test_the_ready_timeouts_default_is_documented():
    default = Supervise().ready_timeout
    help_ = dgr("up", "--help").stdout
    assert "--ready-timeout SECONDS" in help_
    assert f"supervise.ready_timeout, {default:g} s" in " ".join(help_.split())
    doc = " ".join((REPO / "docs" / "deploy.md").read_text().split())
    assert f"`ready_timeout` (how long `dgr up` waits for SERVING, default {default:g} s" in doc
    assert "`give_up_after`" in doc and "--foreground" in doc


def test_ready_timeout_flag_overrides_the_files(tiny, lib_env, tmp_path):
    f, run = _file(tmp_path, tiny, "give_up_after = 0"), tmp_path / "run"     # never given up: waits out the bound
    try:
        up = dgr("up", f, "--run-dir", str(run), "--ready-timeout", "4", env=failing_worker(tmp_path, lib_env),
                 timeout=BOUND_S)
    finally:
        _leaves_nothing(run)
    assert up.returncode == 2
    assert "did not answer health SERVING within 4 s; the run is stopped (a worker that needs longer to load: " \
           "raise supervise.ready_timeout or pass --ready-timeout)" in up.stderr
    assert FAILING_WORKER_LINE in up.stderr, "each worker's log tail"
    bad = dgr("up", f, "--run-dir", str(run), "--ready-timeout", "0")
    assert bad.returncode == 2 and "'0' is not a number of seconds above 0" in bad.stderr


# 4: a signal to `dgr up` stops what it started


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_while_up_waits_stops_the_supervisor_and_the_workers(tiny, lib_env, tmp_path, sig):
    f, run = _file(tmp_path, tiny, "give_up_after = 0"), tmp_path / "run"      # workers crash, never given up
    up = _Up(f, "--run-dir", str(run), env=failing_worker(tmp_path, lib_env))
    try:
        deadline = time.monotonic() + BOUND_S           # it is waiting, its supervisor restarting workers
        while not any(r["last_exit"] for r in ((runstate.read_state(run) or {}).get("workers") or {}).values()):
            assert time.monotonic() < deadline and up.proc.poll() is None, up.text()
            time.sleep(0.1)
        assert runstate.ours(runstate.read_state(run)["supervisor_pid"], run)
        up.proc.send_signal(sig)
        rc = up.finish()
    finally:
        up.stop()
        _leaves_nothing(run)
    assert rc == 128 + sig, up.text()
    assert f"dgr up: {sig.name} before the workers served: the run is stopped, nothing of it is left" in up.text()
    assert runstate.read_state(run)["status"] == "down"


@pytest.mark.parametrize("how", ["SIGTERM", "SIGINT", "dgr down"])
def test_up_in_the_foreground_reports_restarts_and_stops_everything_when_told(tiny, lib_env, tmp_path, how):
    f, run = _file(tmp_path, tiny), tmp_path / "run"
    up = _Up(f, "--run-dir", str(run), "--foreground", "-q", env=lib_env)
    try:
        up.wait_for("out", r"^route: ")
        code, js, _ = _status(f, run, lib_env)
        assert code == 0 and js["state"] == "up"
        os.kill(_pids(run)["s1-r1"], signal.SIGKILL)
        up.wait_for("err", r"^dgr up: s1-r1 exited with signal 9 \(SIGKILL\) after [\d.]+ s; restarting in 0\.2 s")
        up.wait_for("err", r"^dgr up: s1-r1 SERVING again at 127\.0\.0\.1:\d+ \(restart 1\)")
        if how == "dgr down":
            down = dgr("down", f, "--run-dir", str(run), env=lib_env)
            assert down.returncode == 0, down.stderr
        else:
            up.proc.send_signal(getattr(signal, how))
        rc = up.finish()
    finally:
        up.stop()
        _leaves_nothing(run)
    assert rc == 0, up.text()
    said = "stopped by `dgr down`; nothing of the run is left" if how == "dgr down" else \
        f"{how}: stopped 5 process(es)"
    assert said in up.text()


# 5: `dgr status` says up, degraded or down, and its exit status says so too


def test_prefix_cache_mib_from_the_worker_section_reaches_the_workers_and_status_says_why_it_is_off(tiny, lib_env,
                                                                                                      tmp_path):
    """`[worker] prefix_cache_mib = 0`: every worker `dgr up` starts keeps no prefixes, and `dgr status` says why
    per worker (Describe's prefix_cache_off)."""
    f, run = _file(tmp_path, tiny), tmp_path / "run"
    Path(f).write_text(Path(f).read_text() + "\n[worker]\nprefix_cache_mib = 0\n")
    up = dgr("up", f, "--run-dir", str(run), env=lib_env, timeout=BOUND_S + 60)
    try:
        assert up.returncode == 0, up.stderr
        code, js, text = _status(f, run, lib_env)
        assert code == 0 and [w["load"]["prefix_cache_off"] for w in js["workers"]] == ["--prefix-cache-mib 0"] * 4
        assert text.count("; prefix cache off: --prefix-cache-mib 0") == 4, text
    finally:
        dgr("down", f, "--run-dir", str(run), env=lib_env, timeout=BOUND_S)
        _leaves_nothing(run)


def test_status_says_up_degraded_or_down_per_worker_per_route_and_in_its_exit_status(tiny, lib_env, tmp_path):
    f, run = _file(tmp_path, tiny, "give_up_after = 1"), tmp_path / "run"
    up = dgr("up", f, "--run-dir", str(run), env=lib_env, timeout=BOUND_S + 60)
    try:
        assert up.returncode == 0, up.stderr
        route = re.search(r"^route: (\S+)$", up.stdout, re.M).group(1)
        for name in ("s0-r0", "s1-r0", "s1-r1", "s2-r0"):       # progress: each worker as it serves
            assert re.search(rf"^dgr up: {name} SERVING at 127\.0\.0\.1:\d+ \([\d.]+ s\)$", up.stderr, re.M), up.stderr

        def states(js):
            return {w["name"]: w["state"] for w in js["workers"]}

        code, js, text = _status(f, run, lib_env)
        assert (code, js["state"], js["up"]) == (0, "up", True)
        assert set(states(js).values()) == {"up"} and js["routes"] == [route]
        assert [(r["route"], r["state"]) for r in js["route_states"]] == [(route, "up")]
        assert text.startswith("tiny: up (4 of 4 local worker(s) up)") and f"route (up): {route}" in text

        pids = _pids(run)
        os.kill(pids["s1-r1"], signal.SIGSTOP)      # alive, unanswering: a replica of stage 1 is still up
        code, js, text = _status(f, run, lib_env)
        assert (code, js["state"], js["up"]) == (4, "degraded", False), js
        assert states(js) == {"s0-r0": "up", "s1-r0": "up", "s1-r1": "degraded", "s2-r0": "up"}
        assert js["workers"][2]["health"] == "UNREACHABLE" and "runs but does not serve" in js["workers"][2]["why"]
        r = js["route_states"][0]
        assert r["state"] == "degraded" and r["why"] == "stage 1 has 1 of 2 local replica(s) up"
        assert [s["state"] for s in r["stages"]] == ["up", "degraded", "up"]
        assert js["routes"] == [route], "a degraded route still serves"
        assert text.startswith("tiny: degraded (3 of 4 local worker(s) up)")
        assert f"route (degraded: stage 1 has 1 of 2 local replica(s) up): {route}" in text

        os.kill(pids["s0-r0"], signal.SIGSTOP)      # stage 0 has no other replica: the route cannot serve
        code, js, text = _status(f, run, lib_env)
        assert (code, js["state"]) == (3, "down")
        assert js["route_states"][0]["state"] == "down" and js["routes"] == []
        assert "stage 0 has no replica up" in js["route_states"][0]["why"]

        for pid in pids.values():                   # the case: every worker unreachable
            os.kill(pid, signal.SIGSTOP)
        code, js, text = _status(f, run, lib_env)
        assert (code, js["state"]) == (3, "down") and set(states(js).values()) == {"degraded"}
        assert js["supervised"] and text.startswith("tiny: down (0 of 4 local worker(s) up)")

        for pid in pids.values():
            os.kill(pid, signal.SIGCONT)
        code, js, _ = _status(f, run, lib_env)
        assert (code, js["state"]) == (0, "up"), js

        # give_up_after = 1: a crash of s1-r1 is the last of it; the supervisor goes on with the others
        os.kill(pids["s1-r1"], signal.SIGKILL)
        deadline = time.monotonic() + BOUND_S
        while not runstate.read_state(run)["workers"]["s1-r1"]["gave_up"]:
            assert time.monotonic() < deadline, runstate.read_state(run)
            time.sleep(0.1)
        code, js, text = _status(f, run, lib_env)
        assert (code, js["state"]) == (4, "degraded")
        w = js["workers"][2]
        assert (w["name"], w["state"], w["gave_up"], w["pid"]) == ("s1-r1", "down", True, None)
        assert w["why"].startswith("given up on after 1 crash in a row the same way (signal 9 (SIGKILL)): ")
        assert "down" in text.splitlines()[3] and "given up on after 1 crash" in text.splitlines()[3]

        # every worker given up on: nothing is left to supervise, the supervisor records `failed` and exits
        for name in ("s0-r0", "s1-r0", "s2-r0"):
            os.kill(pids[name], signal.SIGKILL)
        sup = runstate.read_state(run)["supervisor_pid"]
        assert runstate.wait_gone([sup], run, BOUND_S) == [], "the supervisor went on with nothing to supervise"
        assert runstate.run_processes(run) == [], "left by a supervisor that gave up on every worker"
        st = runstate.read_state(run)
        assert st["status"] == "failed" and all(r["gave_up"] for r in st["workers"].values()), st
        assert "every worker was given up on: nothing is left to supervise" in \
            (run / "logs" / "supervisor.log").read_text()
        code, js, text = _status(f, run, lib_env)
        assert (code, js["state"], js["supervised"], js["routes"]) == (3, "down", False, [])
        assert all(w["state"] == "down" and w["why"].startswith("given up on after 1 crash in a row the same "
                                                                 "way (signal 9 (SIGKILL))") for w in js["workers"])
        assert text.startswith("tiny: down: not up") and "s0-r0   stage 0  given up on after 1 crash" in text
    finally:
        down = dgr("down", f, "--run-dir", str(run), env=lib_env)
        _leaves_nothing(run)
    assert down.returncode == 0, down.stderr
    code, js, text = _status(f, run, lib_env)
    assert (code, js["state"], js["up"], js["routes"]) == (3, "down", False, [])
    assert text.startswith("tiny: down: not up")


# 6: where `dgr status` and `dgr down` look without --run-dir


def test_status_and_down_act_on_the_run_folder_of_the_latest_up(tmp_path, monkeypatch):
    """`dgr up --run-dir D` records D in the default folder; `dgr status` and `dgr down` without --run-dir
    look there (docs/your-model.md's commands, run by tests/docs/test_your_model.py, rely on it)."""
    monkeypatch.setenv("DGR_WORKSPACE", str(tmp_path / "ws"))
    home = runstate.default_run_dir("tiny")
    assert runstate.find_run_dir("tiny") == home
    elsewhere = (tmp_path / "elsewhere").resolve()
    runstate.record_run_dir("tiny", elsewhere)
    assert runstate.find_run_dir("tiny") == home, "a recorded folder that holds no run (removed since) is not used"
    runstate.write_json(runstate.run_dir("tiny", elsewhere) / "run.json", {"name": "tiny"})     # as `dgr up` does
    assert runstate.find_run_dir("tiny") == elsewhere
    assert runstate.find_run_dir("tiny", tmp_path / "given") == (tmp_path / "given").resolve(), "--run-dir wins"
    assert runstate.find_run_dir("other") == runstate.default_run_dir("other"), "per deployment name"
    runstate.record_run_dir("tiny", home)          # a later `dgr up` without --run-dir: the default again
    assert runstate.find_run_dir("tiny") == home and not (home / runstate.ELSEWHERE).exists()
