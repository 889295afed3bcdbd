"""The deployment file: TOML in, a frozen strict model out; an error names the file and the field.

A deployment says which bundle runs (a recipe to build, or a bundle id to provision), on which hosts
(name, address, store, lane, capacity), which of the bundle's stages run where and how many replicas
each has (explicit `[[stages]]`, or none: the planner places the bundle's stages on the hosts by their
memory), the worker flags every worker gets (threads, session TTL and limits) and the TLS material.
Relative paths in the file are relative to the file's folder; `{workspace}/...` is under dgr's
workspace. docs/deploy.md has a full example.

Cross-references (a stage naming an unknown host, overlapping ranges, capacity) are not checked here
but by `dgr.app.deploy.plan`, which lists every problem at once.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator

from dgr.app.deploy import READY_TIMEOUT_S
from dgr.core.constants import CPU_VARIANTS, DEFAULT_MAX_SESSIONS, DEFAULT_N_CTX, LANES
from dgr.core.contract import STRICT
from dgr.core.errors import DgrError, first_field_error
from dgr.core.paths import workspace
from dgr.runtime.wire.limits import Limits
from dgr.toolchain.recipe import Size

_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,47}$")
_HEX = re.compile(r"^[0-9a-f]{12,64}$")
WORKSPACE_TOKEN = "{workspace}"
_NAME_HELP = "1-48 of a-z 0-9 _ - starting with a letter or digit (it names units, logs and certificates)"


class DeployError(DgrError):
    """A deployment file is invalid, or its plan has problems, or bringing it up or down failed."""


def _name(v: str) -> str:
    if not _NAME.match(v):
        raise ValueError(f"{v!r} is not a name: {_NAME_HELP}")
    return v


class BundleRef(BaseModel):
    """The bundle: `recipe` (built by `dgr up` into a store, deterministic) or `id` (a built bundle,
    provisioned from `source`, a bundle folder or a store holding it)."""

    model_config = STRICT
    recipe: str | None = None
    id: str | None = None
    source: str | None = None

    @field_validator("id")
    @classmethod
    def _id(cls, v: str | None) -> str | None:
        if v is not None and not _HEX.match(v):
            raise ValueError(f"{v!r} is not a bundle id: give its blake3 in hex (64 digits, or at least the "
                             "first 12 that `dgr recipe build` prints in the folder name)")
        return v

    @model_validator(mode="after")
    def _one(self) -> "BundleRef":
        if (self.recipe is None) == (self.id is None):
            raise ValueError("give exactly one of bundle.recipe (a recipe to build) or bundle.id (a built bundle)")
        if self.source is not None and self.id is None:
            raise ValueError("bundle.source goes with bundle.id (where to provision the built bundle from)")
        return self


class Capacity(BaseModel):
    model_config = STRICT
    memory: Size | None = Field(default=None, description="bytes of weights this host may hold, e.g. '8GiB'")
    workers: int | None = Field(default=None, ge=1, description="worker processes this host may run")
    speed: float = Field(default=1.0, gt=0, description="relative speed, for the planner (as in recipes)")

    @field_validator("speed", mode="before")
    @classmethod
    def _speed(cls, v: Any) -> float:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ValueError(f"speed is a positive number (relative), got {v!r}")
        return float(v)


class Host(BaseModel):
    model_config = STRICT
    name: str
    address: str = Field(description="how the other hosts and clients reach this one (IP or DNS name)")
    listen: str | None = Field(default=None, description="the address workers bind (default: address)")
    store: str = Field(description="the store folder bundles are provisioned into (a data drive, never /home)")
    lane: str = "cpu"
    cpu_variant: str = Field(default=CPU_VARIANTS[0], description="the instruction set its engine's CPU backend is "
                             "built for (docs/numerics.md): the lane's baseline, or native (its own CPU)")
    capacity: Capacity = Capacity()

    @field_validator("name")
    @classmethod
    def _n(cls, v: str) -> str:
        return _name(v)

    @field_validator("lane", "cpu_variant")
    @classmethod
    def _one_of(cls, v: str, info) -> str:
        allowed = LANES if info.field_name == "lane" else CPU_VARIANTS
        if v not in allowed:
            raise ValueError(f"{info.field_name} {v!r} is not one of {list(allowed)}")
        return v

    @field_validator("address", "listen")
    @classmethod
    def _addr(cls, v: str | None) -> str | None:
        if v is not None and (not v.strip() or v.count(":") == 1):
            raise ValueError(f"{v!r}: give a host name or IP address without a port (ports are per stage)")
        return v


class StageSpec(BaseModel):
    model_config = STRICT
    layers: list[int] = Field(description="the stage's half-open layer range [begin, end): one of the bundle's")
    host: str | None = None
    hosts: list[str] | None = Field(default=None, description="one set of replicas per host, in preference order")
    replicas: int = Field(default=1, ge=1, description="workers of this stage per listed host")
    port: int = Field(default=0, ge=0, le=65535, description="first port; replica k listens on port + k "
                      "(0: a free port picked at `dgr up` and kept across restarts)")

    @field_validator("layers")
    @classmethod
    def _pair(cls, v: list[int]) -> list[int]:
        if len(v) != 2:
            raise ValueError(f"layers is one [begin, end) pair, e.g. [0, 10]; got {v}")
        return v

    @model_validator(mode="after")
    def _where(self) -> "StageSpec":
        if (self.host is None) == (self.hosts is None):
            raise ValueError("give exactly one of host (a host name) or hosts (a list of host names)")
        if self.hosts is not None and not self.hosts:
            raise ValueError("hosts is empty; name at least one host")
        return self

    @property
    def host_names(self) -> list[str]:
        return [self.host] if self.host is not None else list(self.hosts or [])


class WorkerOptions(BaseModel):
    """Flags every worker gets (`dgr worker serve`); one compute thread suits a small shared machine."""

    model_config = STRICT
    threads: int = Field(default=1, ge=0, description="engine compute threads (0: the engine's default)")
    session_ttl: float = Field(default=300.0, ge=0)
    max_sessions: int = Field(default=DEFAULT_MAX_SESSIONS, ge=1)
    n_ctx: int = Field(default=DEFAULT_N_CTX, ge=16)
    max_queued_steps: int = Field(default=512, ge=1)
    max_session_steps: int = Field(default=128, ge=1)
    drain_timeout: float = Field(default=5.0, gt=0)
    prefix_cache_mib: int = Field(default=Limits().prefix_cache_mib, ge=0,
                                  description="each worker's prefix cache (docs/worker.md \"Prefix cache\"); 0: off")
    insecure: bool = Field(default=False, description="allow plaintext on non-loopback addresses")

    @field_validator("session_ttl", "drain_timeout", mode="before")
    @classmethod
    def _num(cls, v: Any) -> float:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ValueError(f"a number of seconds, got {v!r}")
        return float(v)


class Tls(BaseModel):
    """`dir`: a `dgr certs init DIR` folder; each worker presents `DIR/<worker>.pem` + `.key`
    (`dgr certs issue DIR <worker> --host <its address>`), and peers must come from `DIR/ca.pem`."""

    model_config = STRICT
    dir: str
    mutual: bool = True


class Supervise(BaseModel):
    model_config = STRICT
    backoff: float = Field(default=0.5, gt=0, description="first wait before restarting a crashed worker (s)")
    max_backoff: float = Field(default=30.0, gt=0, description="the longest wait; it doubles per quick crash")
    stable_after: float = Field(default=30.0, gt=0, description="a worker up this long starts the backoff over")
    ready_timeout: float = Field(default=READY_TIMEOUT_S, gt=0, description="`dgr up` waits this long for SERVING "
                                 "(`dgr up --ready-timeout` overrides it)")
    # A worker that dies the same way at every start (a missing engine library, a bad flag, no memory)
    # will not start on the next try either: restarting it forever only hides the error. The default is
    # systemd's StartLimitBurst; with the default backoff the 5 tries span about 8 s.
    give_up_after: int = Field(default=5, ge=0, description="crashes in a row the same way (the same exit and "
                               "last log line, each within stable_after of its start) after which a worker is "
                               "no longer restarted; 0: never give up")

    @field_validator("backoff", "max_backoff", "stable_after", "ready_timeout", mode="before")
    @classmethod
    def _num(cls, v: Any) -> float:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ValueError(f"a number of seconds, got {v!r}")
        return float(v)


WORKLOADS = ("statefulset", "leaderworkerset")


class Kubernetes(BaseModel):
    """How `dgr deploy render --kubernetes` groups the workers (docs/deploy.md, Kubernetes)."""

    model_config = STRICT
    workload: str = Field(default="statefulset", description="statefulset: one StatefulSet per stage and host; "
                          "leaderworkerset: one LeaderWorkerSet whose every group is a whole pipeline")

    @field_validator("workload")
    @classmethod
    def _w(cls, v: str) -> str:
        if v not in WORKLOADS:
            raise ValueError(f"workload {v!r} is not one of {list(WORKLOADS)}")
        return v


class Deployment(BaseModel):
    model_config = STRICT
    name: str
    bundle: BundleRef
    hosts: list[Host] = Field(min_length=1)
    stages: list[StageSpec] | None = Field(default=None, description="none: planned from the hosts' memory")
    replicas: int = Field(default=1, ge=1, description="replicas per stage when the stages are planned")
    worker: WorkerOptions = WorkerOptions()
    tls: Tls | None = None
    supervise: Supervise = Supervise()
    kubernetes: Kubernetes = Kubernetes()
    allow_mixed_numerics: bool = Field(default=False, description="let stages on hosts of other lanes or CPU "
                                       "variants share a route (docs/numerics.md): results then match no "
                                       "whole-model run")

    @field_validator("name")
    @classmethod
    def _n(cls, v: str) -> str:
        return _name(v)

    @model_validator(mode="after")
    def _unique(self) -> "Deployment":
        names = [h.name for h in self.hosts]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"host names must be unique: {', '.join(dup)} listed more than once")
        if self.stages is not None and not self.stages:
            raise ValueError("stages is empty: list the stages, or leave [[stages]] out to plan them")
        return self


@dataclass(frozen=True)
class LoadedDeployment:
    """A deployment with where it came from (relative paths in it are relative to `path.parent`)."""

    deployment: Deployment
    path: Path

    def resolve(self, p: str) -> Path:
        """A path of the file: `{workspace}/...` is under dgr's workspace (`.dgr/` or $DGR_WORKSPACE, so a
        local deployment's store follows the workspace wherever it is); other relative paths are
        relative to the file's folder."""
        if p == WORKSPACE_TOKEN or p.startswith(WORKSPACE_TOKEN + "/"):
            return (workspace() / p[len(WORKSPACE_TOKEN):].lstrip("/")).resolve()
        q = Path(p)
        return q if q.is_absolute() else (self.path.parent / q).resolve()

    def host(self, name: str) -> Host | None:
        return next((h for h in self.deployment.hosts if h.name == name), None)


def parse_deployment(text: str, path: str | Path = "<deployment>") -> Deployment:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise DeployError(f"{path}: not valid TOML: {e}") from e
    try:
        return Deployment.model_validate(data)
    except ValidationError as e:
        raise DeployError(f"{path}: invalid deployment file: {first_field_error(e)} (docs/deploy.md)") from e


def load_deployment(path: str | Path) -> LoadedDeployment:
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise DeployError(f"{p}: cannot read the deployment file ({e.strerror})") from e
    return LoadedDeployment(parse_deployment(text, p), p.resolve())
