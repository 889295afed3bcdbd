"""`dgr up` / `dgr status` / `dgr down` of deploy/local-3stage.toml: real SmolLM2 workers, supervised.

The committed file as a user runs it (its own run folder in tmp): up to SERVING (measured), a route
that generates, kill -9 of a worker restarted by the supervisor and the route generating the same text
again (measured and printed, not judged: the wait for the restart only gives up after a generous
deadline), status as JSON, and `dgr down` leaving no process and no port.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from dgr.app.deploy import runstate
from dgr.app.deploy.control import health
from dgr.app.deploy.local import port_free

from support.deploy import dgr, private_engine

pytestmark = [pytest.mark.slow]

FILE = "deploy/local-3stage.toml"
ROUTE = "127.0.0.1:7100,127.0.0.1:7110|127.0.0.1:7111,127.0.0.1:7120"
PROMPT = "The capital of France is"
BOUND_S = 120.0   # how long a wait (for a restart) goes on before it fails: a deadline, not a speed requirement


@pytest.fixture(scope="module")
def env(engine_lib, smollm2_gguf, tmp_path_factory):
    return private_engine(engine_lib, tmp_path_factory.mktemp("engine"))


def _generate(env) -> str:
    proc = dgr("generate", "--route", ROUTE, "--max-tokens", "16", PROMPT, env=env, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def _status(env, run) -> dict:
    proc = dgr("status", FILE, "--json", "--run-dir", str(run), env=env)
    return json.loads(proc.stdout)


def test_up_generates_restarts_a_killed_worker_and_down_leaves_nothing(env, tmp_path):
    run = tmp_path / "run"
    for port in (7100, 7110, 7111, 7120):
        if not port_free("127.0.0.1", port):
            pytest.fail(f"port {port} is in use here: is deploy/local-3stage.toml up elsewhere? (`dgr down {FILE}`)")
    t0 = time.monotonic()
    up = dgr("up", FILE, "--run-dir", str(run), "-q", env=env)
    t_up = time.monotonic() - t0
    assert up.returncode == 0, up.stderr[-3000:]
    try:
        assert f"route: {ROUTE}" in up.stdout
        text = _generate(env)
        assert "Paris" in text

        st = _status(env, run)
        assert st["up"] and st["state"] == "up" and st["routes"] == [ROUTE]
        assert [(r["route"], r["state"]) for r in st["route_states"]] == [(ROUTE, "up")]
        assert [(w["name"], w["stage"], w["address"], w["health"], w["restarts"]) for w in st["workers"]] == [
            ("s0-r0", 0, "127.0.0.1:7100", "SERVING", 0), ("s1-r0", 1, "127.0.0.1:7110", "SERVING", 0),
            ("s1-r1", 1, "127.0.0.1:7111", "SERVING", 0), ("s2-r0", 2, "127.0.0.1:7120", "SERVING", 0)]
        assert all(runstate.ours(w["pid"], run) for w in st["workers"])
        assert all((run / "logs" / f"{w['name']}.log").is_file() for w in st["workers"])

        # kill -9 of stage 0 (no replica): the supervisor restarts it in place; the route generates again
        pid0 = st["workers"][0]["pid"]
        t_kill = time.monotonic()
        os.kill(pid0, signal.SIGKILL)
        while health("127.0.0.1:7100", timeout=0.5) != "SERVING":
            assert time.monotonic() - t_kill < BOUND_S, "stage 0 was not restarted in time"
            time.sleep(0.1)
        t_serving = time.monotonic() - t_kill
        assert _generate(env) == text
        t_route = time.monotonic() - t_kill

        # kill -9 of a middle replica: the route goes on through the other one at once
        st = _status(env, run)
        pid1 = st["workers"][1]["pid"]
        t_kill1 = time.monotonic()
        os.kill(pid1, signal.SIGKILL)
        assert _generate(env) == text
        t_replica = time.monotonic() - t_kill1
        deadline = time.monotonic() + BOUND_S
        while True:
            st = _status(env, run)
            if all(w["health"] == "SERVING" for w in st["workers"]) and st["workers"][1]["restarts"] == 1:
                break
            # meanwhile the route serves through the other replica: degraded, never down
            assert st["state"] in ("up", "degraded") and st["routes"] == [ROUTE], st
            assert time.monotonic() < deadline, st
            time.sleep(0.2)
        w0, w1 = st["workers"][0], st["workers"][1]
        assert w0["restarts"] == 1 and w0["pid"] != pid0 and w0["last_exit"]["how"] == "signal 9 (SIGKILL)"
        assert w1["restarts"] == 1 and w1["pid"] != pid1
        assert "s0-r0: exited with signal 9 (SIGKILL)" in (run / "logs" / "supervisor.log").read_text()

        again = dgr("up", FILE, "--run-dir", str(run), env=env)
        assert again.returncode != 0 and "is already up" in again.stderr
    finally:
        t1 = time.monotonic()
        down = dgr("down", FILE, "--run-dir", str(run), env=env)
        t_down = time.monotonic() - t1
    assert down.returncode == 0, down.stderr
    assert runstate.run_processes(run) == []
    assert all(port_free("127.0.0.1", p) for p in (7100, 7110, 7111, 7120))
    st = _status(env, run)
    assert st["up"] is False and st["state"] == "down" and st["routes"] == []
    print(f"\ndgr up to SERVING (4 workers, bundle verified in the store): {t_up:.1f} s")
    print(f"kill -9 of stage 0 -> SERVING again: {t_serving:.1f} s; -> the route generated again: {t_route:.1f} s")
    print(f"kill -9 of a stage-1 replica -> the route generated (through the other replica): {t_replica:.1f} s")
    print(f"dgr down: {t_down:.1f} s, no process left")


def test_down_of_a_deployment_that_is_not_up_is_harmless(env, tmp_path):
    proc = dgr("down", FILE, "--run-dir", str(tmp_path / "run"), env=env)
    assert proc.returncode == 0 and "stopped 0 process(es)" in proc.stdout
    st = dgr("status", FILE, "--run-dir", str(tmp_path / "run"), env=env)
    assert st.returncode == 3 and "not up" in st.stdout
