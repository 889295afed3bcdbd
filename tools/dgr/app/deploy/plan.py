"""A deployment resolved: every worker (stage, replica, host, address, bundle folder), every problem, the routes.

Problems are collected, not raised one at a time, so an operator fixes a file in one pass: an unknown
host, a range that overlaps another or is not one of the bundle's stages, a stage that runs nowhere, a
bundle that cannot be found, a host over its capacity, absent certificates, plaintext off loopback, a
port used twice. What `dgr up` itself does (build or provision the bundle into a store) is listed as
`todo`, not as a problem.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from dgr.app.deploy.local import is_this_machine
from dgr.app.deploy.resolve import BundleInfo, fill_from_model, resolve_bundle
from dgr.app.deploy.spec import DeployError, Host, LoadedDeployment, load_deployment
from dgr.core.errors import DgrError
from dgr.runtime.wire.tls import CA_CERT, is_loopback
from dgr.toolchain.bundle.store import refuse_home
from dgr.toolchain.planner import WorkerSpec, plan as place

# Beside its weights and prefix cache a worker holds its KV cache and the engine's compute buffers: what a
# unit's MemoryMax and a pod's memory request leave for them.
MEMORY_HEADROOM = 1 << 30


@dataclass(frozen=True)
class WorkerPlan:
    name: str
    stage: int
    layers: tuple[int, int]
    host: Host
    port: int                  # 0: picked at `dgr up`
    store: Path
    local: bool

    @property
    def bind(self) -> str:
        return self.host.listen or self.host.address

    def address(self, port: int | None = None) -> str:
        p = self.port if port is None else port
        h = self.host.address
        return f"[{h}]:{p}" if ":" in h else f"{h}:{p}"


@dataclass
class Plan:
    loaded: LoadedDeployment
    bundle: BundleInfo
    workers: list[WorkerPlan] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    todo: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.loaded.deployment.name

    def stage_count(self) -> int:
        return max((w.stage for w in self.workers), default=-1) + 1

    def route(self, ports: dict[str, int] | None = None) -> str:
        """The route as `dgr generate --route` takes it: stages in order, replicas joined by '|'; ports
        from `ports` (a running deployment's) where the file leaves them to `dgr up`."""
        ports = ports or {}

        def addr(w: WorkerPlan) -> str:
            p = ports.get(w.name) or w.port
            return w.address(p) if p else f"{w.host.address}:<port at up>"

        hops = ["|".join(addr(w) for w in self.workers if w.stage == i) for i in range(self.stage_count())]
        return ",".join(hops)

    def memory_estimate(self, w: WorkerPlan) -> int:
        """The bytes worker `w` needs: its stage's weights (the manifest's, or the planner's from the model;
        0 when neither is known yet), its prefix cache and MEMORY_HEADROOM."""
        weights = self.bundle.weights
        held = weights[w.stage] if weights and w.stage < len(weights) else 0
        return held + (self.loaded.deployment.worker.prefix_cache_mib << 20) + MEMORY_HEADROOM

    def check(self) -> None:
        """Raise one DeployError listing every problem (what `dgr up` and `dgr deploy render` refuse)."""
        if self.problems:
            lines = "\n".join(f"  - {p}" for p in self.problems)
            raise DeployError(f"{self.loaded.path}: {len(self.problems)} problem(s):\n{lines}")


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def make_plan(path_or_loaded: str | Path | LoadedDeployment) -> Plan:
    ld = path_or_loaded if isinstance(path_or_loaded, LoadedDeployment) else load_deployment(path_or_loaded)
    d = ld.deployment
    stores = [ld.resolve(h.store) for h in d.hosts]
    local_stores = [s for h, s in zip(d.hosts, stores) if is_this_machine(h.address)]
    info = resolve_bundle(ld, local_stores)
    plan = Plan(ld, info)
    if info.problem:
        plan.problems.append(info.problem)
    for h, s in zip(d.hosts, stores):
        try:
            refuse_home(s, f"hosts[{h.name}].store")
        except DgrError as e:
            plan.problems.append(str(e))
    needs_weights = any(h.capacity.memory is not None for h in d.hosts) or d.stages is None
    if info.problem is None and (not info.ranges or (needs_weights and info.weights is None)):
        try:
            layer_inputs = fill_from_model(info)
        except DgrError as e:
            plan.problems.append(f"bundle.recipe: cannot plan its stages from the model: {e}")
            layer_inputs = None
    else:
        layer_inputs = None
    specs = _explicit(plan) if d.stages is not None else _planned(plan, layer_inputs)
    for i, host_names, replicas, port, layers in specs:
        k = 0
        for hn in host_names:
            h = ld.host(hn)
            for _ in range(replicas):
                plan.workers.append(WorkerPlan(
                    name=f"s{i}-r{k}", stage=i, layers=layers,
                    host=h, port=port + k if port else 0, store=ld.resolve(h.store),
                    local=is_this_machine(h.address)))
                k += 1
    _check_hosts(plan)
    _check_numerics(plan)
    _check_security(plan)
    _todo(plan)
    return plan


def _explicit(plan: Plan) -> list[tuple]:
    """Match each `[[stages]]` entry to a stage of the bundle; problems for unknown hosts and ranges."""
    ld, info = plan.loaded, plan.bundle
    known = [h.name for h in ld.deployment.hosts]
    out, taken = [], []
    for j, st in enumerate(ld.deployment.stages or []):
        b, e = st.layers
        where = f"stages[{j}] = [{b}, {e})"
        bad = [n for n in st.host_names if n not in known]
        for n in bad:
            plan.problems.append(f"{where}: host {n!r} is not one of the file's hosts ({', '.join(known)}); "
                                 f"add a [[hosts]] entry named {n!r} or fix the name")
        if b < 0 or e <= b:
            plan.problems.append(f"{where}: an empty or negative range; a range is [begin, end) with begin < end")
            continue
        over = [(k, tb, te) for k, tb, te in taken if b < te and tb < e]
        for k, tb, te in over:
            plan.problems.append(f"{where} overlaps stages[{k}] = [{tb}, {te}): every layer runs in exactly one "
                                 "stage (replicas of a stage go in its `replicas` or `hosts`, not a second entry)")
        taken.append((j, b, e))
        if over:
            continue
        if info.ranges and (b, e) not in info.ranges:
            have = " ".join(f"[{x}, {y})" for x, y in info.ranges)
            plan.problems.append(f"{where} is not a stage of {info.label} (its stages: {have}); "
                                 "use the bundle's ranges, or build a bundle with these ranges")
            continue
        if not bad:
            # without the bundle's stages (it was not found), the file's own order stands in, so that
            # capacity and ports are still checked
            i = info.ranges.index((b, e)) if info.ranges else sum(1 for _, tb, _ in taken if tb < b)
            out.append((i, st.host_names, st.replicas, st.port, (b, e)))
    if info.ranges and not plan.problems:
        placed = {x[0] for x in out}
        for i, (b, e) in enumerate(info.ranges):
            if i not in placed:
                plan.problems.append(f"stage {i} [{b}, {e}) of {info.label} runs nowhere: add a [[stages]] "
                                     f"entry with layers = [{b}, {e}]")
    return sorted(out)


def _planned(plan: Plan, inputs) -> list[tuple]:
    """No `[[stages]]`: the planner places the layers on the hosts (in listed order) by their memory;
    the result must be the bundle's own stages."""
    d, info = plan.loaded.deployment, plan.bundle
    if inputs is None:
        if info.problem is None:
            plan.problems.append("stages: none listed, and the planner needs the recipe's model "
                                 "(bundle.recipe); list [[stages]] for a bundle given by id")
        return []
    lacking = [h.name for h in d.hosts if h.capacity.memory is None]
    if lacking:
        plan.problems.append(f"stages: none listed, so the planner places them by memory, but host(s) "
                             f"{', '.join(lacking)} have no capacity.memory; give it, or list [[stages]]")
        return []
    layer, inp, outp, shared = inputs
    try:
        got = place(layer, [WorkerSpec(h.name, int(h.capacity.memory), h.capacity.speed) for h in d.hosts],
                    input_bytes=inp, output_bytes=outp, shared_bytes=shared)
    except DgrError as e:
        plan.problems.append(f"stages: the planner cannot place {info.label} on these hosts: "
                             f"{str(e).removeprefix('placement.workers: ')}")
        return []
    if list(got.ranges) != list(info.ranges):
        plan.problems.append(
            f"stages: the planner places layers as {list(got.ranges)} on hosts "
            f"{', '.join(h.name for h in d.hosts)}, but {info.label} has stages {info.ranges}; list "
            "[[stages]] explicitly, or build the bundle from a recipe that plans on these hosts")
        return []
    return [(i, [h.name], d.replicas, 0, r) for i, (h, r) in enumerate(zip(d.hosts, got.ranges))]


def _check_hosts(plan: Plan) -> None:
    """Capacity (weights and worker count) and ports used twice, per host."""
    info = plan.bundle
    for h in plan.loaded.deployment.hosts:
        ws = [w for w in plan.workers if w.host.name == h.name]
        c = h.capacity
        if c.workers is not None and len(ws) > c.workers:
            plan.problems.append(f"host {h.name}: over capacity: {len(ws)} workers placed on it, its "
                                 f"capacity.workers is {c.workers}; move or drop replicas, or raise it")
        if c.memory is not None and info.weights is not None:
            need = sum(info.weights[w.stage] for w in ws if w.stage < len(info.weights))
            if need > c.memory:
                plan.problems.append(f"host {h.name}: over capacity: its {len(ws)} workers hold {_gib(need)} of "
                                     f"weights ({need} bytes), its capacity.memory is {_gib(int(c.memory))}; move "
                                     "stages or replicas to another host, or raise capacity.memory")
        ports = [w.port for w in ws if w.port]
        for p in sorted({p for p in ports if ports.count(p) > 1}):
            names = [w.name for w in ws if w.port == p]
            plan.problems.append(f"host {h.name}: port {p} is given to {', '.join(names)}; give each stage "
                                 "its own port range (replica k listens on port + k)")


def _check_numerics(plan: Plan) -> None:
    """Every worker of the route computes alike (docs/numerics.md): one lane and one CPU variant, unless the file
    allows a mix (then every result of the route says it is not exact)."""
    if plan.loaded.deployment.allow_mixed_numerics:
        return
    kinds: dict[str, list[str]] = {}
    for w in plan.workers:
        kinds.setdefault(f"{w.host.lane}/{w.host.cpu_variant}", []).append(f"{w.name} on {w.host.name}")
    if len(kinds) > 1:
        plan.problems.append(
            "the workers would compute different numerics: " + "; ".join(f"{k}: {', '.join(v)}" for k, v in kinds.items())
            + ": their results differ, so the route would reproduce no whole-model run (clients refuse it). Give every "
            "host one lane and cpu_variant, or set allow_mixed_numerics = true (results are then labelled not exact)")


def _check_security(plan: Plan) -> None:
    d = plan.loaded.deployment
    if d.tls is None:
        if not d.worker.insecure:
            for h in {w.host.name: w.host for w in plan.workers}.values():
                if not is_loopback(h.listen or h.address):
                    plan.problems.append(f"host {h.name}: workers would listen on {h.listen or h.address} in "
                                         "plaintext; add [tls] (a `dgr certs init` folder) or set "
                                         "worker.insecure = true for a trusted network")
        return
    tdir = plan.loaded.resolve(d.tls.dir)
    if not (tdir / CA_CERT).is_file():
        plan.problems.append(f"tls.dir {tdir}: certificates absent: no {CA_CERT}; make the CA with "
                             f"`dgr certs init {tdir}`")
    for w in plan.workers:
        for ext in ("pem", "key"):
            if not (tdir / f"{w.name}.{ext}").is_file():
                plan.problems.append(f"worker {w.name}: certificates absent: no {tdir / f'{w.name}.{ext}'}; "
                                     f"issue it with `dgr certs issue {tdir} {w.name} --host {w.host.address}`")
                break


def _todo(plan: Plan) -> None:
    info = plan.bundle
    if info.problem:
        return
    seen = set()
    for w in plan.workers:
        if w.store in seen:
            continue
        seen.add(w.store)
        if w.store in info.copies:
            continue
        how = "build it from the recipe" if info.source is None and info.recipe_path else f"copy it from {info.source}"
        if w.local:
            plan.todo.append(f"host {w.host.name}: {info.label} is not provisioned in {w.store}: `dgr up` will "
                             f"{how}, verifying")
        else:
            plan.todo.append(f"host {w.host.name}: not this machine; provision the bundle into {w.store} there "
                             "(`dgr up` on that host, or `dgr bundle provision BUNDLE --to STORE`)")
