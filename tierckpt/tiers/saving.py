"""The engine's ``save()`` as one sequence (:meth:`Saver.save`): the previous save's copies, the
gate's agreement (posted while the state is copied into a free slot), its decision, the staging
copy (δ ends here), the lane jobs. Also the trainer's staging waits, booked into the next save's
δ (:meth:`Saver.trainer_wait`). See docs/architecture.md, "Save flow", steps 1-6."""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING, Iterable

from tierckpt.gcpause import collector_paused
from tierckpt.handle import SaveHandle
from tierckpt.staging.pool import StagingPool, resolve_stateful

if TYPE_CHECKING:
    from tierckpt.history.timeline import Timeline
    from tierckpt.tiers.gate import SaveGate
    from tierckpt.tiers.jobs import TierJobs

__all__ = ["Saver"]


class Saver:
    """Runs one rank's part of a collective save over the engine's gate, jobs and staging pool.

    Args:
        gate: the :class:`~tierckpt.tiers.gate.SaveGate` (which tiers start; its ``lock`` guards
            the booked wait).
        jobs: the :class:`~tierckpt.tiers.jobs.TierJobs` the started tiers' jobs are queued on.
        pool: the :class:`~tierckpt.staging.pool.StagingPool` the state is copied into.
        timeline: this run's save identities (:mod:`tierckpt.history.timeline`).
    """

    def __init__(self, gate: SaveGate, jobs: TierJobs, pool: StagingPool, timeline: Timeline):
        self.gate, self.jobs, self.pool, self.timeline = gate, jobs, pool, timeline
        self.unbooked_wait_s = 0.0  # the trainer's staging waits since the last save, seconds

    def save(self, step: int, state_dict: dict, tiers: Iterable[str] | None, raise_failures: bool,
             wait_previous: bool) -> SaveHandle:
        """:meth:`tierckpt.TieredCheckpointer.save` (its documentation holds: arguments, the
        returned handle, ``ConfigError`` and ``TierFailedError``)."""
        gate, pool = self.gate, self.pool
        tiers = gate.check_tiers(tiers)
        if not tiers:
            return SaveHandle(step, 0.0)
        # no collector pass inside δ (tierckpt/gcpause.py); a planned exit may wait long: left as is
        with contextlib.nullcontext() if wait_previous else collector_paused():
            t0 = time.perf_counter()
            pool.wait_for_staging()  # the previous save's copies: part of this δ if still running
            with gate.lock:  # the trainer's waits for the previous save's copies stall training too
                carried, self.unbooked_wait_s = self.unbooked_wait_s, 0.0
            t0 -= carried
            state_dict = resolve_stateful(state_dict)  # once: the RAM-root check and staging read it
            defer, answer = gate.begin(tiers, step, wait_previous)  # the agreement travels while we copy
            t_copy = time.perf_counter()
            # not while every due tier is sure to be deferred (its job still runs here): a copy
            # each step of a long deferral would only be dropped
            early = None if answer.busy_here.issuperset(tiers) else pool.stage_early(state_dict)
            t_copy = time.perf_counter() - t_copy
            try:
                tiers, skipped, t_skip = gate.decide(step, tiers, state_dict, raise_failures, defer, answer)
            except BaseException:
                if early is not None:
                    pool.give_back(early[0])
                raise
            # a skipped local tier's wait is the local tier's cost: keep it out of the other tiers' δ
            t_wait = time.perf_counter() - t0 - t_skip - t_copy
            gate.skipped(skipped, step)
            if not tiers:
                if early is not None:  # every tier deferred or skipped: the copy is not needed
                    pool.give_back(early[0])
                return SaveHandle(step, time.perf_counter() - t0, skipped=skipped)
            if early is not None:
                early[0].refs = len(tiers)
            slot, staged = early if early is not None else pool.stage(state_dict, len(tiers))
            blocked = time.perf_counter() - t0
            gate.started(tiers, step)
            futures = self.jobs.submit(tiers, staged, step, blocked - t_skip, t_wait, slot,
                                       self.timeline.for_step(step))
            return SaveHandle(step, blocked, futures, skipped=skipped)

    def trainer_wait(self) -> float:
        """The trainer's wait for every staging copy (:meth:`tierckpt.TieredCheckpointer.wait_for_staging`):
        seconds waited, booked into the next save's δ (the adaptive scheduler sees the stall)."""
        waited = self.pool.wait_for_staging()
        with self.gate.lock:  # the hook may fire in another thread's optimizer
            self.unbooked_wait_s += waited
        return waited
