"""Deployments: a TOML file of hosts and stages, planned, brought up and supervised here, or rendered as units
or Kubernetes objects.

One job per module:

- `spec`: the deployment file (a frozen strict pydantic model) and its loader;
- `resolve`: what the file's bundle is (a recipe or a bundle id) and where it already sits;
- `plan`: the file resolved into workers (what runs where), every problem found, the routes;
- `local`: which of the file's hosts are this machine;
- `provision`: the bundle put into each local host's store, verified;
- `runstate`: the run folder of a deployment (spec, state, lock, logs) and its processes;
- `supervisor`: the detached process that starts the local workers, restarts crashed ones, gives up on
  one that keeps crashing the same way;
- `events`: what happened to the workers since the last look, one line each (`dgr up`'s progress);
- `condition`: up, degraded or down, of a worker, a route and a run (`dgr status` and its exit status);
- `argv`: a worker's command line, the same for `dgr up`, the units and the pods;
- `control`: `dgr up`, `dgr down`, `dgr status`;
- `systemd`: `dgr deploy render --systemd`, one unit per worker;
- `kubernetes`: `dgr deploy render --kubernetes`, StatefulSets, Services, budgets, the claim and the gateway.
- `debian`: `dgr release deb`, the Debian package of a release's worker (the unit template dgr-worker@.service,
  its user and folders, the configuration check); its text files beside it.

dgr.app.deploy sits beside dgr.app: it composes the toolchain (bundles, recipes, the planner) and the
wire's client side (health, Describe); the runtime never imports it.
"""

# `[supervise] ready_timeout`'s default, here rather than in `spec` so that `dgr up --help` can name it
# without importing pydantic.
READY_TIMEOUT_S = 180.0
# How long `dgr status` waits for each worker's health and load answers: a live worker on a busy host
# answers within it, a stopped one is refused at once, a hung one costs this much.
STATUS_TIMEOUT_S = 5.0
