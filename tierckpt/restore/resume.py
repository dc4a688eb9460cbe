"""The engine's ``restore()`` as one sequence (:meth:`Resume.restore`): the pending staging copies,
the lanes drained (a node whose local job is stuck is restored without its local root, on second
groups), the :class:`~tierckpt.restore.Restorer`, the ``restore`` record, an armed rollback
(:mod:`tierckpt.history.rollback`), the restart's interval decision and the rebuild of the
restored step's replicas (:mod:`tierckpt.restore.redundancy`). Its end (``last_result``,
``restored_mono``) is the recovery timeline's ``restore_done`` (:mod:`tierckpt.recovery.timeline`)."""

from __future__ import annotations

import time
from concurrent.futures import Future
from typing import TYPE_CHECKING

from tierckpt.history.rollback import EXPLICIT, FALLBACK, LEFTOVER
from tierckpt.history.timeline import LEGACY_ORDER
from tierckpt.restore import redundancy
from tierckpt.restore.plan import KINDS, PERSISTENT
from tierckpt.restore.restorer import RestoreResult

if TYPE_CHECKING:
    from tierckpt.cluster.topology import Groups, SpareGroups
    from tierckpt.history.journal import RunJournal
    from tierckpt.history.rollback import RollbackTracker
    from tierckpt.history.timeline import Timeline
    from tierckpt.restore.restorer import Restorer
    from tierckpt.staging.pool import StagingPool
    from tierckpt.tiers.gate import SaveGate
    from tierckpt.tiers.jobs import TierJobs

__all__ = ["Resume"]


class Resume:
    """Runs one rank's part of a collective restore over the engine's parts (each documented on
    :class:`tierckpt.TieredCheckpointer`); ``last_redundancy``: the Future of the replica rebuild
    started by the last restore (None: none ran, or the last restore found nothing);
    ``last_result``: the last restore's :class:`~tierckpt.restore.RestoreResult` that loaded a
    step (None before), ended at ``restored_mono`` (``time.monotonic()``)."""

    def __init__(self, *, restorer: Restorer, jobs: TierJobs, gate: SaveGate, pool: StagingPool,
                 journal: RunJournal, timeline: Timeline, rollback: RollbackTracker, groups: Groups,
                 spare: SpareGroups, local: bool):
        self.restorer, self.jobs, self.gate, self.pool = restorer, jobs, gate, pool
        self.journal, self.timeline, self.rollback = journal, timeline, rollback
        self.groups, self.spare, self.local = groups, spare, local
        self._last_redundancy: Future | None = None
        self.last_result: RestoreResult | None = None
        self.restored_mono: float | None = None

    @property
    def last_redundancy(self) -> Future | None:
        """The Future of the replica rebuild after the last restore (None: none ran). Asking for
        it lets a rebuild held for the first training step start now (who reads it waits for it)."""
        self.jobs.release_rebuild()
        return self._last_redundancy

    def restore(self, state_dict: dict, step: int | None, rollback: bool,
                sources: tuple[str, ...] | None) -> RestoreResult | None:
        """:meth:`tierckpt.TieredCheckpointer.restore` (its documentation holds: arguments, result,
        ``NoCheckpointError``, ``TemplateMismatchError``).

        Raises:
            ValueError: ``rollback`` without ``step``, or an unknown (or no) source kind.
        """
        if rollback and step is None:
            raise ValueError("restore(rollback=True) needs the step rolled back to")
        kinds = KINDS if sources is None else tuple(sources)
        if not set(kinds) <= set(KINDS) or not kinds:
            raise ValueError(f"restore(sources={sources!r}): allowed source kinds are {list(KINDS)}")
        self.pool.wait_for_staging()  # the load writes into tensors a pending device→host copy reads
        stuck = self.jobs.drain_for_restore()
        groups = self.spare.get("restore") if stuck else self.groups
        # pulled copies are committed in the background, on the local lane of every rank; with
        # a local job stuck on some node that lane is blocked there: commit them now instead
        res = self.restorer.restore(state_dict, step, kinds=kinds, groups=groups, unavailable=frozenset(stuck),
                                    defer_commit=self.local and not stuck)
        if res is None:
            return None
        self.journal.restore(res)
        inv = self.restorer.last_inventory
        timeline = rollback or step is None
        # every save of this run from now on descends from the save restored (its manifests
        # record it: tierckpt/history/timeline.py), unless this was a read-only explicit step
        parent = (res.step, res.save_id, inv.orders.get(res.save_id, LEGACY_ORDER)) if timeline else None
        self.timeline.restored(parent, inv.abandoned())
        if timeline:
            # a training run from an older save starts a new timeline: by name, or because the
            # newest save could not be served (a fallback); saves passed over — and an abandoned
            # timeline's copies an earlier supersede left committed (leftovers) — are superseded
            # at this run's first commit (tierckpt/history/rollback.py)
            cause = EXPLICIT if rollback else LEFTOVER if inv.newest_save() == (res.step, res.save_id) else FALLBACK
            self.rollback.arm(res.step, inv, res.save_id, self.timeline.run, self.timeline.next_seq, cause)
        self.gate.restored(res.step, all(o.source.kind != PERSISTENT for o in res.sources.values()),
                           self.timeline.descent)
        if self.gate.schedule is not None:
            self.gate.schedule.after_restore(res.step, groups.local_world)
        self._last_redundancy = None
        self._last_redundancy = redundancy.rebuild(res, stuck, restorer=self.restorer, jobs=self.jobs,
                                                  journal=self.journal, spare=self.spare, local=self.local)
        self.last_result, self.restored_mono = res, time.monotonic()
        return res
