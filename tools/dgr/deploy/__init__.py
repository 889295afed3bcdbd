"""Deployments: a TOML file of hosts and stages, planned, brought up and supervised here, or rendered as units.

One job per module:

- `spec`: the deployment file (a frozen strict pydantic model) and its loader;
- `resolve`: what the file's bundle is (a recipe or a bundle id) and where it already sits;
- `plan`: the file resolved into workers (what runs where), every problem found, the routes;
- `local`: which of the file's hosts are this machine;
- `provision`: the bundle put into each local host's store, verified;
- `runstate`: the run folder of a deployment (spec, state, lock, logs) and its processes;
- `supervisor`: the detached process that starts the local workers and restarts crashed ones;
- `control`: `dgr up`, `dgr down`, `dgr status`;
- `systemd`: `dgr deploy render --systemd`, one unit per worker.

dgr.deploy sits beside dgr.app: it composes the toolchain (bundles, recipes, the planner) and the
wire's client side (health, Describe); the runtime never imports it.
"""
