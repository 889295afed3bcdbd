"""The supervisor: free ports picked at `dgr up` and kept across restarts, restarts with a growing backoff
until a worker that crashes the same way every time is given up on, a deployment that never serves
refused at the ready timeout with its workers' logs, and nothing left behind either way.

A tiny synthetic llama (3 stages) on the real engine: workers start in about a second.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time

import pytest

from dgr.app.deploy import runstate
from dgr.app.deploy.control import health

from support.deploy import FAILING_WORKER_LINE, dgr, failing_worker, lib_env, tiny, tiny_deployment  # noqa: F401


def test_free_ports_are_kept_across_a_restart_and_the_bundle_is_provisioned(tiny, lib_env, tmp_path):
    f, run = tiny_deployment(tmp_path, tiny, "backoff = 0.2"), tmp_path / "run"
    up = dgr("up", f, "--run-dir", str(run), "-q", env=lib_env)
    assert up.returncode == 0, up.stderr[-3000:]
    try:
        assert (tmp_path / "store" / f"t-{tiny.id[:12]}" / "manifest.json").is_file(), "provisioned into the store"
        route = re.search(r"^route: (\S+)$", up.stdout, re.M).group(1)
        addrs = route.split(",")
        assert len(addrs) == 3 and all(re.fullmatch(r"127\.0\.0\.1:\d+", a) for a in addrs)
        gen = dgr("generate", "--route", route, "--max-tokens", "6", "Hello", env=lib_env)
        assert gen.returncode == 0, gen.stderr[-2000:]
        st = json.loads(dgr("status", f, "--json", "--run-dir", str(run), env=lib_env).stdout)
        os.kill(st["workers"][2]["pid"], signal.SIGKILL)
        deadline = time.monotonic() + 60
        while True:
            st = json.loads(dgr("status", f, "--json", "--run-dir", str(run), env=lib_env).stdout)
            w = st["workers"][2]
            if w["restarts"] == 1 and w["health"] == "SERVING":
                break
            assert time.monotonic() < deadline, st
            time.sleep(0.2)
        assert w["address"] == addrs[2] and st["routes"] == [route], "restarted in place: the same port"
        assert dgr("generate", "--route", route, "--max-tokens", "6", "Hello", env=lib_env).stdout == gen.stdout
    finally:
        assert dgr("down", f, "--run-dir", str(run), env=lib_env).returncode == 0
    assert runstate.run_processes(run) == []
    assert all(health(a, timeout=0.5) == "UNREACHABLE" for a in addrs)


def test_a_worker_that_keeps_crashing_is_retried_with_backoff_then_given_up_on_and_up_fails_with_its_log(
        tiny, lib_env, tmp_path):
    f, run = tiny_deployment(tmp_path, tiny, "backoff = 0.2\nmax_backoff = 0.5\ngive_up_after = 4"), tmp_path / "run"
    # a dgr-worker that fails at every start: every worker dies at every start, the same way
    bad = failing_worker(tmp_path, lib_env)
    up = dgr("up", f, "--run-dir", str(run), env=bad)      # fails at the first give-up (never hangs:
    assert up.returncode != 0                               # support.deploy.dgr's own timeout bounds it)
    assert "will not start: it exited 4 times in a row the same way" in up.stderr, up.stderr
    assert FAILING_WORKER_LINE in up.stderr, "the worker's own log says why"
    assert runstate.run_processes(run) == [], "nothing left behind"
    log = (run / "logs" / "supervisor.log").read_text()
    for name in ("s0-r0", "s1-r0", "s2-r0"):
        delays = [float(x) for x in re.findall(rf"{name}: exited with exit code 1 after [\d.]+ s; restarting in "
                                               r"([\d.]+) s", log)]
        assert delays == [0.2, 0.4, 0.5][:len(delays)], (name, delays)   # doubling, capped at max_backoff
    gave_up = re.findall(r"(s\d-r0): exited with exit code 1 after [\d.]+ s, 4 times in a row the same way: "
                         r"not restarting it", log)
    assert gave_up, log
    assert len(re.findall(rf"{gave_up[0]}: exited with exit code 1", log)) == 4, "three restarts, then no more"
    st = runstate.read_state(run)
    assert st["status"] in ("down", "failed") and st["workers"][gave_up[0]]["restarts"] == 3


def test_a_deployment_that_never_serves_is_stopped_at_the_ready_timeout_with_its_logs(tiny, lib_env, tmp_path):
    f, run = tiny_deployment(tmp_path, tiny, "backoff = 0.2\nready_timeout = 5\ngive_up_after = 0"), tmp_path / "run"
    bad = failing_worker(tmp_path, lib_env)
    up = dgr("up", f, "--run-dir", str(run), env=bad)
    assert up.returncode != 0
    assert "did not answer health SERVING within 5 s; the run is stopped" in up.stderr
    assert FAILING_WORKER_LINE in up.stderr, "each worker's log tail"
    assert runstate.run_processes(run) == [], "nothing left behind"
    assert runstate.read_state(run)["status"] == "down"


def test_down_finds_the_workers_of_a_supervisor_killed_by_hand(tiny, lib_env, tmp_path):
    f, run = tiny_deployment(tmp_path, tiny), tmp_path / "run"
    assert dgr("up", f, "--run-dir", str(run), "-q", env=lib_env).returncode == 0
    st = runstate.read_state(run)
    workers = [w["pid"] for w in st["workers"].values()]
    os.kill(st["supervisor_pid"], signal.SIGKILL)      # the workers are orphans now, still serving
    assert runstate.wait_gone([st["supervisor_pid"]], run, 10) == []
    assert all(runstate.ours(p, run) for p in workers)
    status = dgr("status", f, "--run-dir", str(run), env=lib_env)
    assert status.returncode == 3 and "not up" in status.stdout
    assert "its supervisor is gone but process(es)" in status.stdout and "unsupervised" in status.stdout
    down = dgr("down", f, "--run-dir", str(run), env=lib_env)
    assert down.returncode == 0 and "stopped 3 process(es)" in down.stdout, down.stdout + down.stderr
    assert runstate.run_processes(run) == []
    # and a fresh `up` of the same run folder works again afterwards
    assert dgr("up", f, "--run-dir", str(run), "-q", env=lib_env).returncode == 0
    assert dgr("down", f, "--run-dir", str(run), env=lib_env).returncode == 0
    assert runstate.run_processes(run) == []
