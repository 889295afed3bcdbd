"""dgr-worker on a wildcard address across hosts (issue 21 phase 3, docs/worker.md "Wildcard listen"): workers
listening on 0.0.0.0 in one network namespace are reached from another at the address they advertise,
never 0.0.0.0, and a route through them generates what the same stages give on loopback.

The "hosts" are network namespaces joined by veth pairs to a bridge in a namespace of its own (nothing is
added to this machine's own network): A (stages 0 and 2), B (stage 1) and C (the client), on a private /24.
Each namespace has its own /etc/hosts (`ip netns exec` mounts /etc/netns/NS/hosts over /etc/hosts) naming
every host, and each worker runs in a UTS namespace of its own with its host's name, as on separate
machines. Two ways a wildcard worker names itself, each tested: its host name (no --advertise: it must
resolve, on the peers, to an address that reaches it), and `--advertise ADDRESS`.

Needs root (CAP_SYS_ADMIN, CAP_NET_ADMIN) and `ip`; skipped, with the error, where a namespace cannot be
made. The fake engine (milliseconds per stage); everything waits on deadlines, never on sleeps.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from dgr.app.local import FakeRoute
from dgr.runtime.wire.client import RouteClient

from support.worker import READY

SPEC = "layers=6,embd=16,cuts=2:4,seed=1"
PROMPT = "The capital of France is"
MAX_NEW = 12
SUBNET = "10.231.7"
DEADLINE = 20.0                                   # any one step (a worker's start, a client run)

# stage -> host it runs on
PLACEMENT = {0: "a", 1: "b", 2: "a"}
HOSTS = {"a": 2, "b": 3, "c": 4}                  # host -> last octet of its address


def _clean_env() -> dict[str, str]:
    """The test's environment, no proxies (gRPC would send every call to one), dgr importable."""
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    return env


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10)


def _must(*args: str) -> None:
    r = _ip(*args)
    if r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: exit {r.returncode}: {r.stderr.strip()}")


class Net:
    """The namespaces: `sw` (the bridge) and one per host; `ns[host]`, `addr[host]`, `name[host]`."""

    def __init__(self):
        tag = f"{os.getpid() % 100000}{secrets.token_hex(2)}"
        self.tag = tag
        self.sw = f"dgr{tag}sw"
        self.ns = {h: f"dgr{tag}{h}" for h in HOSTS}
        self.addr = {h: f"{SUBNET}.{o}" for h, o in HOSTS.items()}
        self.name = {h: f"dgr-{tag}-{h}" for h in HOSTS}       # each host's name (UTS) and its /etc/hosts entry
        self.made: list[str] = []
        self.etc: list[Path] = []
        self.etc_root_made = False

    def up(self) -> None:
        if shutil.which("ip") is None:
            pytest.skip("no `ip` (iproute2) on PATH: network namespaces cannot be made")
        r = _ip("netns", "add", self.sw)
        if r.returncode != 0:
            pytest.skip(f"cannot make a network namespace (ip netns add): {r.stderr.strip() or r.returncode}")
        self.made.append(self.sw)
        _must("-n", self.sw, "link", "add", "br0", "type", "bridge")
        _must("-n", self.sw, "link", "set", "br0", "up")
        _must("-n", self.sw, "link", "set", "lo", "up")
        hosts_text = "127.0.0.1 localhost\n" + "".join(f"{self.addr[h]} {self.name[h]}\n" for h in HOSTS)
        etc_root = Path("/etc/netns")
        self.etc_root_made = not etc_root.exists()
        for h, ns in self.ns.items():
            _must("netns", "add", ns)
            self.made.append(ns)
            # the veth pair is made inside the switch namespace: no name ever appears in this machine's own
            _must("-n", self.sw, "link", "add", f"v{h}", "type", "veth", "peer", "name", "eth0", "netns", ns)
            _must("-n", self.sw, "link", "set", f"v{h}", "master", "br0")
            _must("-n", self.sw, "link", "set", f"v{h}", "up")
            _must("-n", ns, "addr", "add", f"{self.addr[h]}/24", "dev", "eth0")
            _must("-n", ns, "link", "set", "eth0", "up")
            _must("-n", ns, "link", "set", "lo", "up")
            d = etc_root / ns
            d.mkdir(parents=True, exist_ok=True)
            self.etc.append(d)
            (d / "hosts").write_text(hosts_text)

    def down(self) -> list[str]:
        errors = []
        for ns in reversed(self.made):
            r = _ip("netns", "del", ns)
            if r.returncode != 0:
                errors.append(f"ip netns del {ns}: {r.stderr.strip()}")
        for d in self.etc:
            shutil.rmtree(d, ignore_errors=True)
        if self.etc_root_made:
            try:
                Path("/etc/netns").rmdir()
            except OSError:
                pass
        return errors


@pytest.fixture(scope="module")
def net():
    n = Net()
    try:
        n.up()
        yield n
    finally:
        errors = n.down()
        left = [ns for ns in n.made if Path(f"/run/netns/{ns}").exists() or Path(f"/var/run/netns/{ns}").exists()]
        assert not errors and not left, (errors, left)


@pytest.fixture(scope="module")
def reference():
    """The same three stages on loopback, in this namespace."""
    with FakeRoute.of(SPEC) as route, RouteClient(route.addresses) as c:
        g = c.run(PROMPT, max_new_tokens=MAX_NEW, stop_token_ids=[])
    assert len(g.token_ids) == MAX_NEW
    return g.token_ids, g.text


class Worker:
    """One `dgr-worker --fake-engine SPEC --stage N --listen 0.0.0.0:0 --insecure` in host `host`'s network
    namespace, in a UTS namespace of its own named as that host."""

    def __init__(self, net: Net, stage: int, host: str, extra: list[str]):
        from dgr.app.workerbin import worker_binary
        from dgr.testing import fake_engine

        self.stage, self.host, self.log, self.address = stage, host, [], ""
        self._ready = threading.Event()
        env = {**_clean_env(), fake_engine.LIB_ENV: str(fake_engine.library_path().resolve())}
        cmd = ["ip", "netns", "exec", net.ns[host], "unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"',
               net.name[host], str(worker_binary().resolve()), "--listen", "0.0.0.0:0", "--insecure",
               "--fake-engine", SPEC, "--stage", str(stage), *extra]
        # ip netns exec, unshare and sh each exec the next: this pid is the worker's
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.log.append(line)
            m = READY.search(line)
            if m and not self.address:
                self.address = m.group(1)
                self._ready.set()
        self._ready.set()                              # exited: wake the waiter

    def wait_ready(self, deadline: float) -> str:
        self._ready.wait(max(0.0, deadline - time.monotonic()))
        if not self.address:
            raise AssertionError(f"stage {self.stage} on host {self.host} did not serve "
                                 f"(exit {self.proc.poll()}):\n" + "".join(self.log[-20:]))
        return self.address

    def stop(self) -> str:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return "".join(self.log)


# Run in a host's namespace: Describe each address of `describe` (from there), then, given a route, generate.
_PROBE = r"""
import json, sys
import grpc
from dgr.runtime.wire.gen import stage_pb2 as pb, stage_pb2_grpc as pb_grpc
from dgr.runtime.wire.client import RouteClient
job = json.loads(sys.argv[1])
out = {"described": []}
for a in job["describe"]:
    with grpc.insecure_channel(a) as ch:
        d = pb_grpc.StageStub(ch).Describe(pb.DescribeRequest(), timeout=job["timeout"])
    out["described"].append({"dialed": a, "address": json.loads(d.descriptor_json)["address"],
                             "stage": d.identity.stage_index})
if job.get("route"):
    with RouteClient(job["route"], timeout=job["timeout"], hop_deadline=job["timeout"]) as c:
        g = c.run(job["prompt"], max_new_tokens=job["max_new"], stop_token_ids=[])
    out["generated"] = {"token_ids": list(g.token_ids), "text": g.text}
print("RESULT " + json.dumps(out), flush=True)
"""


def _probe(net: Net, host: str, job: dict) -> subprocess.Popen:
    job = {"timeout": DEADLINE, **job}
    return subprocess.Popen([*("ip", "netns", "exec", net.ns[host]), sys.executable, "-c", _PROBE, json.dumps(job)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_clean_env())


def _result(host: str, p: subprocess.Popen) -> dict:
    try:
        out, err = p.communicate(timeout=DEADLINE + 10)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
        raise AssertionError(f"the probe in host {host} did not finish:\n{out}\n{err}")
    lines = [x for x in out.splitlines() if x.startswith("RESULT ")]
    assert p.returncode == 0 and lines, f"the probe in host {host} failed ({p.returncode}):\n{out}\n{err}"
    return json.loads(lines[-1][len("RESULT "):])


@pytest.mark.parametrize("naming", ["host name", "--advertise"])
def test_wildcard_workers_in_one_namespace_are_reached_from_another(net, reference, naming):
    want_ids, want_text = reference
    workers: list[Worker] = []
    try:
        for stage, host in PLACEMENT.items():
            extra = ["--advertise", net.addr[host]] if naming == "--advertise" else []
            workers.append(Worker(net, stage, host, extra))
        deadline = time.monotonic() + DEADLINE
        route = [w.wait_ready(deadline) for w in workers]
        for w, a in zip(workers, route):
            host, _, port = a.rpartition(":")
            want_host = net.addr[w.host] if naming == "--advertise" else net.name[w.host]
            assert host == want_host and "0.0.0.0" not in a and port.isdigit() and int(port) > 0, (naming, a)
        # each worker described from the other host (A's from B, B's from A), all of them and the route from C
        other = {"a": "b", "b": "a"}
        jobs = {h: {"describe": [a for w, a in zip(workers, route) if other[w.host] == h]} for h in ("a", "b")}
        jobs["c"] = {"describe": route, "route": route, "prompt": PROMPT, "max_new": MAX_NEW}
        probes = {h: _probe(net, h, job) for h, job in jobs.items()}
        results = {h: _result(h, p) for h, p in probes.items()}
        for h, res in results.items():
            assert len(res["described"]) == len(jobs[h]["describe"]), (h, res)
            for d in res["described"]:
                # the descriptor names the worker as it was dialled: the advertised address, never 0.0.0.0
                assert d["address"] == d["dialed"] and "0.0.0.0" not in d["address"], (h, d)
                assert route[d["stage"]] == d["address"], (h, d, route)
        gen = results["c"]["generated"]
        assert gen["token_ids"] == want_ids and gen["text"] == want_text, (gen, reference)
    finally:
        logs = [w.stop() for w in workers]
    for w, log in zip(workers, logs):
        assert w.proc.returncode == 0, f"stage {w.stage} exited {w.proc.returncode}:\n{log[-3000:]}"
