"""Finding and watching a route's hops (a part of RouteClient): Describe every stage, failing over to
its next replica and waiting for hops that are not up yet; checking that a replica serves what the
stage's first one served; probing every hop when a reply is late."""

from __future__ import annotations

import queue
import time

import grpc

from dgr.core.log import get_logger
from dgr.runtime.wire import codec
from dgr.runtime.wire.errors import HopUnreachable, MixedNumerics, StageError, WrongStage
from dgr.runtime.wire.gen import stage_pb2 as pb
from dgr.runtime.wire.routes import no_answer, not_up, unreachable

log = get_logger("dgr.runtime.wire.client")

# Waiting for a hop that is not up yet (`connect_wait`): the pause between tries doubles from the first
# to the last; short enough that a worker back on its port is found within about two seconds.
CONNECT_PAUSE_S = (0.25, 2.0)


class Hops:
    """RouteClient's hop discovery and liveness. Uses the client's route, replicas, _ident, _hops, _stub,
    _forget, hop, tls, timeouts and chunk sizes."""

    def describe(self, timeout: float | None = None, missing_only: bool = False,
                 wait: float | None = None) -> list[pb.StageDescription]:
        """Describe every hop (`missing_only`: those not described yet) within `timeout` (default
        `hop_deadline`). At first, a stage whose replica does not answer moves to its next replica; none
        left: wait up to `wait` s (default `connect_wait`, counted from this call) for one to come up,
        then HopUnreachable naming the stage."""
        timeout = timeout or self.hop_deadline
        wait = self.connect_wait if wait is None else wait
        t0 = time.monotonic()
        old = (self._hops if missing_only else None) or [None] * len(self.route)
        out: list[pb.StageDescription | None] = []
        for i in range(len(self.route)):
            if old[i] is not None:
                out.append(old[i])
                continue
            first = self._ident[i] is None              # at start: fail over to the next replica at once
            cands = [self.route[i]] + ([a for a in self.replicas[i] if a != self.route[i]] if first else [])
            pause, noted = CONNECT_PAUSE_S[0], None
            while True:
                d, errors, down = self._describe_stage(i, cands, timeout)
                if d is not None:
                    break
                left = wait - (time.monotonic() - t0)
                if not (first and down and len(down) == len(errors)) or left <= 0:
                    self._hops = out + [None] + list(old[i + 1:])   # described again on next use
                    raise no_answer(self.hop(i), errors, down if first and wait > 0 else {}, wait)
                # every replica is down in a way that may pass: wait for one (a line when that changes)
                why = " or ".join(f"{a} ({r})" for a, r in down.items())
                if why != noted:
                    log.warning("waiting for stage %d at %s; up to %.0f s more ...", i, why, left)
                    noted = why
                time.sleep(min(pause, left))
                pause = min(2 * pause, CONNECT_PAUSE_S[1])
            if noted is not None:
                log.info("stage %d at %s answers after %.1f s", i, self.route[i], time.monotonic() - t0)
            out.append(d)
        self._hops = out
        # Every stage processes the same chunks (no hop re-splits a chunk to fit its message limit), so
        # prefill follows one schedule end to end and a baseline chunked alike is comparable bit for bit
        # (llama.cpp's kernels are not batch-size invariant).
        for d in out:
            if d.HasField("schema_out") and d.seam_bytes_per_token:
                self.chunk_tokens = min(self.chunk_tokens, codec.tokens_per_frame(
                    min(d.max_message_bytes, self.max_message_bytes), d.seam_bytes_per_token))
        return out

    def _describe_stage(self, i: int, cands: list[str], timeout: float):
        """Describe stage i at the first of `cands` that answers as stage i: (description or None, the
        errors of the others, {address: why} of those not up yet (`not_up`))."""
        errors: list[StageError] = []
        down: dict[str, str] = {}
        for address in cands:
            self.route[i] = address
            try:
                d = self._stub(address).Describe(pb.DescribeRequest(), timeout=timeout)
            except grpc.RpcError as err:
                errors.append(unreachable(self.hop(i), "cannot reach the worker", err, tls=self.tls is not None))
                if (why := not_up(err, timeout)) is not None:
                    down[address] = why
                    self._forget(address)
                continue
            if (bad := self._check_identity(i, d) or self._check_numerics(i, d)) is not None:
                errors.append(bad)
                continue
            return d, errors, down
        return None, errors, down

    def _check_identity(self, i: int, d: pb.StageDescription) -> StageError | None:
        """A replica must serve what stage i's first replica served (bundle, stage, range)."""
        idn = d.identity
        got = (idn.bundle_id, idn.stage_index, idn.layer_begin, idn.layer_end)
        if self._ident[i] is None:
            self._ident[i] = got
        elif got != self._ident[i]:
            b, s, lo, hi = self._ident[i]
            return WrongStage(f"this replica serves stage {got[1]} [{got[2]}, {got[3]}) of bundle {got[0]}, "
                              f"not stage {s} [{lo}, {hi}) of bundle {b}", hop=self.hop(i))
        return None

    def _check_numerics(self, i: int, d: pb.StageDescription, where: str = "") -> StageError | None:
        """Every stage and replica of a route must compute the same bits (docs/numerics.md): the first stage
        described sets the route's numerics, and a hop of others is refused (so recovery never moves a stage
        onto a replica of other numerics), unless the client allows mixed numerics: then it is logged once
        and `exact` says the route is not."""
        got = d.identity.numerics
        if self._numerics is None:
            self._numerics = (i, got)
            return None
        j, want = self._numerics
        if got == want:
            return None
        if self.allow_mixed_numerics:
            if (i, got) not in self._mixed_seen:
                self._mixed_seen.add((i, got))
                log.warning("%s computes %r, stage %d computes %r: mixed numerics allowed, so this route's results "
                            "are not exact (they match no whole-model run)", where or self.hop(i), got, j, want)
            return None
        return MixedNumerics(f"computes {got or 'unknown numerics'!r}, but stage {j} computes {want or 'unknown'!r}: "
                             "their results differ, so the route would reproduce no whole-model run. Serve every "
                             "stage from one build (docs/numerics.md), or allow it (--allow-mixed-numerics: every "
                             "result is then labelled not exact)", hop=where or self.hop(i))

    def check_replicas(self) -> list[str]:
        """Describe every replica of every stage, not only those in use (a gateway does this when it starts):
        a replica of other numerics is refused now, by name, rather than at a recovery (MixedNumerics, unless
        mixed numerics are allowed). A replica that does not answer is left for later (recovery describes it
        again); returns what was said of each, one line per replica that did not answer."""
        _ = self.hops                                   # the route's numerics are set by the stages in use
        skipped = []
        for i, reps in enumerate(self.replicas):
            for address in reps:
                if address == self.route[i]:
                    continue
                try:
                    d = self._stub(address).Describe(pb.DescribeRequest(), timeout=self.hop_deadline)
                except grpc.RpcError as err:
                    skipped.append(f"stage {i} replica {address}: {err.code().name} (checked when a recovery needs it)")
                    continue
                bad = self._check_numerics(i, d, where=f"stage {i} replica {address}")
                if bad is not None:
                    raise bad
        return skipped

    @property
    def numerics(self) -> list[str]:
        """Each stage's numerics on the current route (described on first use)."""
        return [d.identity.numerics for d in self.hops]

    @property
    def exact(self) -> bool:
        """Every stage of the current route computes the same bits (always so unless mixed numerics are allowed)."""
        return len(set(self.numerics)) == 1

    # ------------------------------------------------------------------ liveness
    def probe(self) -> HopUnreachable | None:
        """Ask every hop at once to describe itself within `hop_deadline`; the first that does not."""
        futs = [self._stub(a).Describe.future(pb.DescribeRequest(), timeout=self.hop_deadline) for a in self.route]
        dead = None
        for i, f in enumerate(futs):
            try:
                f.result()
            except grpc.RpcError as err:
                dead = dead or HopUnreachable(
                    f"does not answer within the hop deadline of {self.hop_deadline:g} s ({err.code().name}): "
                    "stopped, hung or cut off", hop=self.hop(i))
        return dead

    def _watch(self, get, what: str, cancel=None):
        """`get(t)` (raises queue.Empty after t s) under the liveness watch: probe the route every
        `hop_deadline` s without a reply; give up after `timeout` s of a route that answers probes."""
        t0 = time.monotonic()
        while True:
            try:
                return get(self.hop_deadline)
            except queue.Empty:
                pass
            dead = self.probe()
            if dead is None and time.monotonic() - t0 > self.timeout:
                dead = StageError(f"{what} within {self.timeout:.0f} s; every hop answers Describe: a worker "
                                  "may be stuck (see their logs)", hop="route " + ",".join(self.route))
            if dead is not None:
                if cancel is not None:
                    cancel()
                raise dead
