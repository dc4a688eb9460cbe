"""Which tiers a save starts, and what the run remembers of each agreed record: the engine's one
scheduling object.

:class:`SaveGate` decides, on the trainer's thread, for each tier due at a step: deferred while
its previous save still runs (``busy_tier_policy`` "defer", agreed: :mod:`tierckpt.tiers.deferral`),
skipped while a hung local disk outlives ``local_wait_timeout_s``
(:meth:`tierckpt.tiers.hung.HungDiskVote.local_ready`)
or while the RAM root is too small (:class:`tierckpt.tiers.ram.RamGuard`), else waited for,
its previous failure raised by the ``warn_only`` policy, and the interval decision made after
it applied (:mod:`tierckpt.sched.driver`). On the tiers' threads it keeps the bookkeeping of
every agreed record (:meth:`SaveGate.after_record`): history, the local anchor, the
persistent steps committed by this run, the armed rollback, the next interval decision.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from typing import Iterable

from tierckpt.config import TierConfig, validate_tiers
from tierckpt.cluster.topology import Groups, Topology
from tierckpt.errors import ConfigError, TierFailedError
from tierckpt.history.journal import RunJournal
from tierckpt.history.rollback import RollbackTracker
from tierckpt.history.timeline import Descent, of_manifest
from tierckpt.records import CheckpointRecord
from tierckpt.sched.cadence import Cadence
from tierckpt.sched.driver import ScheduleDriver
from tierckpt.tiers import retention
from tierckpt.tiers.deferral import Answer, BusyPoll
from tierckpt.tiers.jobs import TierJobs
from tierckpt.tiers.local_tier import LocalTier
from tierckpt.tiers.persistent import PersistentTier
from tierckpt.tiers.ram import RamGuard

__all__ = ["SaveGate", "build_gate"]

log = logging.getLogger(__name__)


class SaveGate:
    """The save decisions and the record bookkeeping of one engine (see the module docstring).

    Args:
        cfg: the configuration; rollback: the run's rollback tracker.
        schedule: the interval driver (``TierConfig.intervals``), or None.
        ram_guard: the RAM-root guard of the local tier, or None without a local tier.

    Attributes:
        history: this rank's agreed :class:`~tierckpt.records.CheckpointRecord` s, in order
            (saves, deferred and skipped tiers).
        local_anchor: the step of the newest save (in save order: this run's last) every node
            committed to its local tier (all-gathered ok flags, or a restore served by the local
            tier); retention keeps it on every node beyond ``keep_latest_k``. None: none known.
        persistent_committed: persistent steps committed by this run, in order (save order).
        descent: what this run's saves descend from since its last restore (its
            :class:`~tierckpt.history.timeline.Descent`, None: nothing): a save of this run it
            proves abandoned (an in-run rollback) is never ``durable_step``.
        schedule: as given.
        saved_any: whether a save started a tier job in this run.
    """

    def __init__(self, cfg: TierConfig, rollback: RollbackTracker, schedule: ScheduleDriver | None,
                 ram_guard: RamGuard | None):
        self.cfg, self.rollback, self.schedule, self._ram = cfg, rollback, schedule, ram_guard
        self.lock = threading.Lock()
        self.history: list[CheckpointRecord] = []
        self.local_anchor: int | None = None
        self.persistent_committed: list[int] = []
        self.descent: Descent | None = None
        self.saved_any = False
        self._raised: set[tuple[str, int]] = set()  # failed records already raised (warn_only policy)
        self._jobs: TierJobs | None = None
        self._busy: BusyPoll | None = None

    def attach(self, jobs: TierJobs, busy: BusyPoll) -> None:
        """The lanes this gate decides for and their busy poll (made after the gate: the jobs
        call :meth:`after_record`)."""
        self._jobs, self._busy = jobs, busy

    @property
    def jobs(self) -> TierJobs:
        assert self._jobs is not None, "SaveGate.attach() not called"
        return self._jobs

    @property
    def busy(self) -> BusyPoll:
        assert self._busy is not None, "SaveGate.attach() not called"
        return self._busy

    def release(self) -> None:
        """Drop every reference to the engine's groups (the engine closed and destroys them)."""
        if self._busy is not None:
            self._busy.release()
        if self._ram is not None:
            self._ram.release()

    # -- trainer thread ------------------------------------------------------------------------
    def check_tiers(self, tiers: Iterable[str] | None) -> tuple[str, ...]:
        """The requested tiers (None: every configured one).

        Raises:
            ConfigError: ``tiers`` names an unknown or unconfigured tier (option ``tiers``).
        """
        tiers = self.cfg.tiers if tiers is None else validate_tiers(tiers)
        for t in tiers:
            if t not in self.cfg.tiers:
                raise ConfigError("tiers", f"tier {t!r} is not configured; configured: {', '.join(self.cfg.tiers)}")
        return tiers

    def due(self, step: int) -> list[str]:
        """Tiers due at ``step`` (see :meth:`tierckpt.engine.TieredCheckpointer.due`).

        Raises:
            RuntimeError: no ``intervals`` configured.
        """
        if self.schedule is None:
            raise RuntimeError("TierConfig.intervals is not set: the caller decides when to save")
        waiting = sorted(self.schedule.deferred)
        ready = [t for t, ok in self.busy.finished(waiting, step).items() if ok] if waiting else []
        return self.schedule.due(step, ready)

    def begin(self, tiers: tuple[str, ...], step: int, wait_previous: bool) -> tuple[tuple[str, ...], Answer]:
        """Post the agreed "previous save finished" poll of the tiers that may be deferred
        (none at a planned exit); returns (those tiers, the answer to call in :meth:`decide`)."""
        defer = () if wait_previous else tuple(t for t in tiers if self.cfg.busy_policy(t) == "defer")
        return defer, self.busy.begin(defer, step)

    def decide(self, step: int, tiers: tuple[str, ...], state_dict: dict, raise_failures: bool,
               defer: tuple[str, ...], answer: Answer) -> tuple[tuple[str, ...], dict[str, CheckpointRecord], float]:
        """Defer each tier of ``defer`` whose previous save still runs (agreed: ``answer()``) or
        wait for it (the local tier bounded, agreed: it may be skipped), raise its failure by
        the ``warn_only`` policy, apply the interval decision made after it; then the RAM-root
        guard. Returns (tiers that save now, {deferred or skipped tier: record}, seconds spent
        on a skipped tier).

        Raises:
            TierFailedError: a due tier's previous save failed outside ``warn_only``.
        """
        go, skipped, t_skip, t0 = [], {}, 0.0, time.perf_counter()
        finished = answer()
        for t in tiers:
            rec: CheckpointRecord | None = None
            if not finished.get(t, True):
                rec = self.busy.deferred(t, step, t0, "busy_tier_policy = defer")
            elif t == "local" and t not in defer:
                ready, t_local, rec = self.jobs.vote.local_ready(step)
                if not ready:
                    t_skip = t_local
            if rec is not None:  # deferred or skipped: nothing staged for this tier
                skipped[t] = rec
                self._remember(rec)
                continue
            rec = self.jobs.previous(t)
            if raise_failures:
                self.raise_if_failed(rec)
            if self.schedule is not None:  # every rank reaches this at the same step
                self.schedule.before_save(t)
            go.append(t)
        if "local" in go and self._ram is not None and (rec := self._ram.admit(step, state_dict)) is not None:
            self.jobs.journal.ledger.append(rec)
            self._remember(rec)
            skipped["local"] = rec
            go.remove("local")
        return tuple(go), skipped, t_skip

    def skipped(self, skipped: dict[str, CheckpointRecord], step: int) -> None:
        """Tell the interval driver about deferred tiers (due again once the running save
        finished) and skipped ones (a hung disk: next attempt one interval later)."""
        if skipped and self.schedule is not None:
            deferred = [t for t, r in skipped.items() if r.deferred]
            self.schedule.defer(deferred)
            self.schedule.saved([t for t in skipped if t not in deferred], step)

    def started(self, tiers: tuple[str, ...], step: int) -> None:
        """Jobs of ``tiers`` start at ``step``."""
        if self.schedule is not None:
            self.schedule.saved(tiers, step)
        self.saved_any = True

    def raise_if_failed(self, rec: CheckpointRecord | None) -> None:
        """Raise a failed save of a tier outside ``warn_only`` once (records are agreed over
        the tier's ranks, so every rank raises at the same call).

        Raises:
            TierFailedError: as described.
        """
        if rec is None or not rec.failed or rec.tier in self.cfg.warn_only:
            return
        if (rec.tier, rec.step) in self._raised:
            return
        self._raised.add((rec.tier, rec.step))
        raise TierFailedError(rec.tier, rec.step, rec.error)

    def unraised_failures(self) -> list[CheckpointRecord]:
        """Failed, finished saves of tiers outside ``warn_only`` not yet raised (this rank's
        view of the latest save of each tier; not collective)."""
        return [r for r in self.jobs.finished() if r.failed and r.tier not in self.cfg.warn_only
                and (r.tier, r.step) not in self._raised]

    def durable_step(self, persistent: PersistentTier, rank: int) -> int | None:
        """The persistent step of this run's newest save (save order: its last commit, whatever
        the step numbers — a later restore may have rolled back) that still exists (global rank 0
        checks the shared root: it writes ``run_end``; other ranks take the last committed)."""
        if rank == 0:
            d = self.descent
            return persistent.newest_still_committed(
                self.persistent_committed, self.cfg.read_timeout_s,
                alive=None if d is None else (lambda doc: not d.covers(*of_manifest(doc))))
        return self.persistent_committed[-1] if self.persistent_committed else None

    def end_run(self, journal: RunJournal, persistent: PersistentTier, rank: int, clean: bool, reason: str,
                stuck: list[str], at_exit: dict | None) -> tuple[list[CheckpointRecord], int | None, OSError | None]:
        """Write the ``run_end`` record (global rank 0; see
        :meth:`tierckpt.engine.TieredCheckpointer.close`): ``clean`` only when asked for, no
        unraised failure outside ``warn_only`` and, when the run saved and the persistent tier is
        configured, a durable persistent step. Returns (unraised failures, durable step, the
        error writing the ledger or None)."""
        failed = self.unraised_failures()
        durable = self.durable_step(persistent, rank)
        not_durable = self.saved_any and "persistent" in self.cfg.tiers and durable is None
        if not_durable and rank == 0:
            log.error("tierckpt: this run saved checkpoints but committed no persistent step: its "
                      "progress lives only on node-local disks")
        try:
            journal.run_end(clean=bool(clean) and not failed and not not_durable, reason=reason,
                            durable_step=durable, stuck_tiers=stuck, failures=failed,
                            strict="persistent" in self.cfg.tiers, **(at_exit or {}))
        except OSError as e:
            log.error("tierckpt: could not write the ledger's run_end: %s", e)
            return failed, durable, e
        return failed, durable, None

    def raise_at_end(self, failed: list[CheckpointRecord], durable: int | None, ledger_error: OSError | None) -> None:
        """A clean close's raise: the first unraised failure, else a ``run_end`` the ledger could
        not take (global rank 0 only, the ledger's one writer; the ledger lives in the persistent
        root and records what is durable: a failure of the persistent tier, never a raw error).

        Raises:
            TierFailedError: as described (unless the tier is in ``warn_only``).
        """
        if failed:
            self.raise_if_failed(failed[0])
        if ledger_error is not None and "persistent" not in self.cfg.warn_only:
            raise TierFailedError("persistent", -1 if durable is None else durable,
                                  f"the ledger's run_end could not be written: {type(ledger_error).__name__}: "
                                  f"{ledger_error}")

    def restored(self, step: int, all_local: bool, descent: Descent | None = None) -> None:
        """A restore served ``step``: the local anchor when every node was served node-locally;
        ``descent``: what this run's saves descend from from now on (:attr:`descent`)."""
        with self.lock:  # every node's copy of the step sits on some node's local disk
            self.local_anchor = step if all_local else None
            self.descent = descent

    def _remember(self, rec: CheckpointRecord) -> None:
        with self.lock:
            self.history.append(rec)

    # -- tier threads --------------------------------------------------------------------------
    def anchor(self) -> int | None:
        """The local anchor (read by the local lane's retention)."""
        return self.local_anchor

    def after_record(self, tier: str, step: int, rec: CheckpointRecord, group) -> None:
        """Bookkeeping of an agreed save record (the tier's thread; collective on ``group``
        when a scheduler runs): history, local anchor, durable steps, the armed rollback, the
        next interval decision."""
        with self.lock:
            self.history.append(rec)
            if tier == "local" and rec.ok:  # the lane is FIFO: its last committed save is the newest
                self.local_anchor = step
            if tier == "persistent" and rec.ok:
                self.persistent_committed.append(step)
        if rec.ok and self.rollback.wants(tier):  # the same record on every rank: may exchange over group
            self.rollback.finish(tier, step, group)
        if self.schedule is not None:
            self.schedule.after_record(tier, step, rec, group)


def build_gate(cfg: TierConfig, topo: Topology, groups: Groups, local: LocalTier | None, persistent: PersistentTier,
               in_use: retention.InUse, journal: RunJournal, rollback: RollbackTracker) -> tuple[SaveGate, TierJobs]:
    """The engine's gate and lanes: the interval driver (``TierConfig.intervals``; its start
    decision is shared over every rank: collective), the RAM-root guard, one lane per tier and
    the busy poll over them."""
    schedule = None
    if cfg.intervals:
        schedule = ScheduleDriver(Cadence(cfg.intervals, cfg.adaptive, rank=topo.rank, world_size=topo.world_size,
                                          options=cfg.schedule), topo.rank, journal.ledger, journal)
        schedule.share(groups.local_world, "start", refresh_ledger=True)
    # the RAM-root fit check runs once, at the first local save (tiers/ram.py)
    guard = RamGuard(local.store, cfg.keep_latest_k["local"], cfg.replication_jump, cfg.replication_factor, topo,
                     groups.control) if local is not None else None
    gate = SaveGate(cfg, rollback, schedule, guard)
    jobs = TierJobs(cfg, topo, groups, local, persistent, in_use, journal, on_record=gate.after_record,
                    local_anchor=gate.anchor, interference=schedule.cadence.interference_of if schedule else None)
    gate.attach(jobs, BusyPoll(jobs.lanes, groups.control, topo.rank, journal.ledger.append,
                               stuck_nodes=functools.partial(jobs.vote.stuck_nodes, False)))
    return gate, jobs
