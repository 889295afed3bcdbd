"""Batching queued steps into engine calls: the step queue, the one engine thread, and its deferred jobs.

The engine thread takes at most one queued step from each session (round robin, up to
`max_batch_tokens`) into one `engine.forward`, checks each step's cache (first dropping the drafts a
speculative step left there that the last stage rejected, where the step says so), and hands each
result to the links (`_emit_boundary` / `_emit_last`, dgr.wire.links). A batch that fails is rerun step by step so
one session's fault never fails the others. Jobs deferred here (the origin's detokenizing) run on the
same thread after the forward, so the engine is only ever driven from one thread.
"""

from __future__ import annotations

import collections
import os
import signal
import threading
import time

import numpy as np

from dgr.engine_api import Step
from dgr.errors import CacheMiss, DgrError, SchemaMismatch
from dgr.log import get_logger
from dgr.wire.gen import stage_pb2 as pb
from dgr.wire.state import Session, StageState, Work

log = get_logger(__name__)


class Scheduler(StageState):
    """The step queue and the engine loop of a StageWorker. Results go on through `_emit_boundary` and
    `_emit_last`, which dgr.wire.links.Links provides (the worker composes both)."""

    def _init_scheduler(self) -> None:
        self.max_batch_tokens = self.limits.max_batch_tokens
        self.max_queued_steps = self.limits.max_queued_steps
        self.pending: dict[tuple[str, int], collections.deque] = {}
        self.n_pending = 0
        self.opened_total = 0                               # sessions ever opened here (a test's hold)
        self.batch_ms = 1.0                                 # moving average of one engine batch (retry hints)
        self.jobs: collections.deque = collections.deque()   # engine-thread work that may wait a forward
        self.wake = threading.Condition(self.lock)

    def _start_engine_thread(self) -> None:
        self.engine_thread = threading.Thread(target=self._engine_loop, daemon=True, name="engine")
        self.engine_thread.start()

    def _retry_after_ms(self) -> int:
        """When the queue will probably have room again: the queued batches at the recent batch time."""
        return int(min(5000, max(50, self.batch_ms * (1 + self.n_pending))))

    def _enqueue(self, work: Work, sess: Session, *, own: bool = False) -> None:
        """Queue a step; a full queue answers OVERLOADED with a retry hint. `own`: the origin's next decode
        step of an admitted session (at most one per session in flight), never refused."""
        key = (work.frame.session_id, work.frame.epoch)
        lim = self.limits
        with self.lock:
            dq = self.pending.get(key)
            why = None
            if not own and self.n_pending >= lim.max_queued_steps:
                why = f"{self.n_pending} steps are queued (--max-queued-steps {lim.max_queued_steps})"
            elif not own and dq is not None and len(dq) >= lim.max_session_steps:
                why = (f"session {key[0]} has {len(dq)} steps queued (--max-session-steps "
                       f"{lim.max_session_steps})")
            if why is not None:
                self.overloaded += 1
                self._reply_error(work.reply, work.frame, self._err(
                    pb.OVERLOADED, f"{why}: retry later", retry_after_ms=self._retry_after_ms()))
                return
            sess.last_used = time.monotonic()
            self.pending.setdefault(key, collections.deque()).append(work)
            self.n_pending += 1
            self.wake.notify()

    def _drop_pending(self, session_id: str, epoch: int) -> None:
        """Forget a closed session's queued steps (the caller holds `lock`)."""
        dropped = self.pending.pop((session_id, epoch), None)
        self.n_pending -= len(dropped or ())

    def _held(self) -> bool:
        """(lock held) A test's hold (`Limits.hold_batch`): steps of fewer sessions wait than it asks for;
        once that many sessions have been opened here, than are still open when fewer are (so the last
        rounds of a test's sessions, and later single sessions, run)."""
        hold = self.limits.hold_batch
        need = hold if self.opened_total < hold else min(hold, len(self.sessions))
        return hold > 0 and len(self.pending) < need

    def _take_batch(self) -> list[Work]:
        with self.lock:
            while not self.stopping and (not self.n_pending or self._held()) and not self.jobs:
                self.wake.wait(0.5)
            if self._held():
                return []
            batch, tokens = [], 0
            for key in list(self.pending):
                dq = self.pending[key]
                n = len(dq[0].frame.step.positions)
                if batch and (tokens + n > self.max_batch_tokens or len(batch) >= self.limits.max_batch_sessions):
                    continue
                batch.append(dq.popleft())
                tokens += n
                self.n_pending -= 1
                if not dq:
                    del self.pending[key]
                elif len(self.pending) > 1:             # round robin: served sessions go to the back
                    self.pending[key] = self.pending.pop(key)
            return batch

    def _engine_loop(self) -> None:
        while not self.stopping:
            batch = self._take_batch()
            if batch:
                try:
                    self._run_batch(batch)
                except Exception:
                    log.exception("engine batch failed")
                    for w in batch:
                        self._reply_error(w.reply, w.frame, self._err(pb.INTERNAL, "the worker failed on "
                                                                      "this step; see its log"))
                self._refresh_memory()
            self._run_jobs()

    def _refresh_memory(self, every_s: float = 1.0) -> None:
        """The engine's memory report for Describe, read here (the engine thread) at most every `every_s`:
        a Describe never waits for the engine."""
        now = time.monotonic()
        if now - self.memory_at < every_s:
            return
        self.memory_at = now
        try:
            with self.engine_lock:
                self.memory = self.engine.memory()
        except DgrError:
            log.debug("memory report failed", exc_info=True)

    def _defer(self, job) -> None:
        """Run `job` on the engine thread after the current forward (never ahead of queued steps' start)."""
        with self.lock:
            self.jobs.append(job)
            self.wake.notify()

    def _run_jobs(self) -> None:
        while True:
            with self.lock:
                if not self.jobs:
                    return
                job = self.jobs.popleft()
            try:
                job()
            except Exception:
                log.exception("deferred job failed")

    def _to_step(self, w: Work, sess: Session) -> Step:
        s = w.frame.step
        want = "none"
        if self.info.is_last and (s.sample or sess.logits == pb.LOGITS_ALL):
            # a speculative step is verified at every position: one row per draw
            want = "all" if sess.logits == pb.LOGITS_ALL or s.drafts else "last"
        ids = np.asarray(s.token_ids, dtype=np.int32) if len(s.token_ids) else None
        return Step(w.frame.session_id, w.frame.epoch, np.asarray(s.positions, dtype=np.int32),
                    token_ids=ids, boundary=w.x, want_logits=want)

    def _run_batch(self, batch: list[Work]) -> None:
        ready, steps = [], []
        with self.engine_lock:
            for w in batch:
                key = (w.frame.session_id, w.frame.epoch)
                sess = self.sessions.get(key)
                if sess is None:
                    continue                            # closed while queued
                try:
                    held = self.engine.n_cached(*key)
                except DgrError as err:
                    self._reply_error(w.reply, w.frame, self._err(pb.ENGINE, str(err)))
                    continue
                expect = w.frame.step.cache_expect
                if held > expect and self._may_roll_back(w.frame.step, sess):
                    try:                                # drop the drafts the last stage rejected
                        self.engine.truncate(*key, expect)
                    except DgrError as err:
                        self._reply_error(w.reply, w.frame, self._err(pb.ENGINE, str(err)))
                        continue
                    held = expect
                if held != expect:
                    self._reply_error(w.reply, w.frame, self._err(
                        pb.CACHE_MISS, f"session {key[0]} epoch {key[1]} holds {held} positions here but "
                                       f"the frame expects {w.frame.step.cache_expect}: re-prefill at a new "
                                       "epoch", held=held, expected=w.frame.step.cache_expect))
                    continue
                ready.append((w, sess))
                steps.append(self._to_step(w, sess))
            if not steps:
                return
            if self.limits.die_at:                      # tests: a kill -9 at an exact step
                self._die_if_asked(steps)
            t0 = time.monotonic_ns()
            results = self._forward(steps, ready)
            compute = time.monotonic_ns() - t0
        self.batch_ms = 0.8 * self.batch_ms + 0.2 * compute / 1e6
        now = time.monotonic()
        for (w, sess), res in zip(ready, results):
            sess.last_used = now
            if res is None:
                continue
            sess.held = res.n_cached
            s = w.frame.step
            sess.spec_floor = s.positions[0] + 1 if s.drafts else None   # where a rollback may start
            timing = pb.HopTiming(stage_index=self.identity.stage_index, queue_ns=t0 - w.t_recv,
                                  transit_ns=w.transit_ns,
                                  compute_ns=compute)
            kind = self.metrics.step(len(w.frame.step.positions), timing.queue_ns, compute)
            self.step_times[kind].append((compute, timing.queue_ns))
            if self.info.is_last:
                self._emit_last(w, sess, res, timing)
            else:
                self._emit_boundary(w, sess, res, timing)

    def _die_if_asked(self, steps: list[Step]) -> None:
        for s in steps:
            for p in s.positions.tolist():
                if (s.session_id, s.epoch, p) in self.limits.die_at:
                    log.warning("--test-die-at %s:%d:%d reached: SIGKILL", s.session_id, s.epoch, p)
                    os.kill(os.getpid(), signal.SIGKILL)

    @staticmethod
    def _may_roll_back(step: pb.Step, sess: Session) -> bool:
        """A step flagged `rollback` may drop cached positions from its cache_expect on, but never below the
        first draft of the session's last speculative step here: anything else stays a CACHE_MISS."""
        return step.rollback and sess.spec_floor is not None and step.cache_expect >= sess.spec_floor

    def _forward(self, steps, ready):
        """One batched forward; if it fails, find the step at fault so other sessions keep going."""
        try:
            return self.engine.forward(steps)
        except DgrError as err:
            if len(steps) == 1:
                self._fail_step(ready[0][0], err)
                return [None]
            before = [self.engine.n_cached(s.session_id, s.epoch) for s in steps]
            log.info("batch of %d failed (%s); running its steps one by one", len(steps), err)
        results = []
        for step, (w, _), held in zip(steps, ready, before):
            if self.engine.n_cached(step.session_id, step.epoch) != held:
                self._fail_step(w, DgrError("the engine failed inside a shared batch"))
                results.append(None)
                continue
            try:
                results.append(self.engine.forward([step])[0])
            except DgrError as err:
                self._fail_step(w, err)
                results.append(None)
        return results

    def _fail_step(self, w: Work, err: DgrError) -> None:
        if isinstance(err, CacheMiss):
            e = self._err(pb.CACHE_MISS, str(err), held=err.held, expected=err.expected)
        elif isinstance(err, SchemaMismatch):
            e = self._err(pb.SCHEMA_MISMATCH, str(err))
        else:
            e = self._err(pb.ENGINE, str(err))
        self._reply_error(w.reply, w.frame, e)

