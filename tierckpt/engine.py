"""The tiered checkpoint engine: what adapters and users call. It orchestrates named steps,
each in its wing (docs/architecture.md): the start (:mod:`tierckpt.startup`); ``save()``
(:class:`~tierckpt.tiers.saving.Saver`): the one scheduling object
(:class:`~tierckpt.tiers.gate.SaveGate`) decides which tiers start, the state is staged
(:mod:`tierckpt.staging.pool`; δ ends here) and each tier's job is queued on its lane
(:mod:`tierckpt.tiers.lanes`, :mod:`tierckpt.tiers.jobs`: local tier → replication → agreed
record → retention; persistent tier → agreed record → retention); ``restore()``
(:class:`~tierckpt.restore.resume.Resume`): drain the lanes, :class:`~tierckpt.restore.Restorer`,
the record, an armed rollback, the restart's interval decision, the replica rebuild
(:mod:`tierckpt.restore.redundancy`); ``observe_step()``: the scheduler's sample, the
restart's ``recovery`` record (:mod:`tierckpt.recovery.timeline`); ``save_for_preemption()``
(:func:`tierckpt.preemption.final_save`); ``close()``: finish the lanes, ``run_end``, raise.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from typing import Iterable

from tierckpt import exit as exit_hook
from tierckpt import preemption as preempt
from tierckpt import startup
from tierckpt.config import TierConfig, validate_tiers
from tierckpt.cluster.topology import Groups, SpareGroups, Topology, release_groups
from tierckpt.gcpause import paused
from tierckpt.handle import SaveHandle
from tierckpt.history.ledger import Ledger
from tierckpt.history.rollback import RollbackTracker
from tierckpt.history.timeline import Timeline
from tierckpt.io import layout
from tierckpt.staging.overlap import wait_before_optimizer_steps
from tierckpt.staging.pool import StagingPool
from tierckpt.loader_signals import defer_loader_deaths
from tierckpt.preemption import Preempted, PreemptionWatch, warn_if_launcher_unprotected
from tierckpt.readonly import ReadOnly
from tierckpt.records import CheckpointRecord
from tierckpt.recovery.timeline import RecoveryTimeline
from tierckpt.restore import Inventory, Restorer, RestoreResult
from tierckpt.restore.resume import Resume
from tierckpt.tiers.gate import SaveGate, build_gate
from tierckpt.tiers.jobs import TierJobs, describe_failure
from tierckpt.tiers.local_tier import LocalTier
from tierckpt.tiers.persistent import PersistentIO, PersistentTier
from tierckpt.tiers.saving import Saver

__all__ = ["TieredCheckpointer", "describe_failure"]

log = logging.getLogger(__name__)


class TieredCheckpointer:
    """Multi-tier checkpointing for one job (create on every rank, collectively).

    Args:
        config: tiers, roots, J/F, retention (validated when it was built).
        node_id: explicit node id of this rank (simulation/tests); otherwise from the
            environment (see :mod:`tierckpt.cluster.topology`).
        persistent_io: how persistent steps are written/read (default: plain DCP).

    Read-only attributes (adapters' framework hooks, tools); the rest is internal:
        lineage: the persistent root's lineage id (:mod:`tierckpt.history.lineage`), the same on
            every rank; node-local steps of any other lineage are deleted here, never restored.
        cfg: the :class:`~tierckpt.config.TierConfig`.
        topo: the :class:`~tierckpt.cluster.topology.Topology` (rank, world_size, node, nodes,
            node_of_rank, local ranks).
        groups: the engine's gloo groups (``local_world``: every rank; ``node``: this node's).
        local: the node's :class:`~tierckpt.tiers.local_tier.LocalTier` (``store``), or None.
        persistent: the :class:`~tierckpt.tiers.persistent.PersistentTier` (``store``,
            ``load(state_dict, url, group)``, ``committed_steps()``).
        ledger: the run's :class:`~tierckpt.history.ledger.Ledger` (``append(record)`` of a
            typed record from :mod:`tierckpt.records`; global rank 0 writes).
        timeline, preemption, pool, restorer: this run's save identities, the
            :class:`~tierckpt.preemption.PreemptionWatch`, the staging pool, the restorer.
        jobs: the :class:`~tierckpt.tiers.jobs.TierJobs` (``lanes``: one per tier).
        gate: the :class:`~tierckpt.tiers.gate.SaveGate` (``local_anchor``, ``schedule``).
        history: this rank's agreed :class:`~tierckpt.records.CheckpointRecord` s (saves,
            deferred and skipped tiers), in order; a new list on each read (ledger lines:
            ``[r.as_ledger() for r in e.history]``).
        last_redundancy: Future of the replica rebuild after the last restore (None: none ran).

    Raises:
        ConfigError: invalid option, impossible J/F for the node count, local root that
            cannot be written (names the option).
        RuntimeError: torch.distributed not initialised.
    """

    cfg: ReadOnly[TierConfig] = ReadOnly("_cfg")
    topo: ReadOnly[Topology] = ReadOnly("_topo")
    groups: ReadOnly[Groups] = ReadOnly("_groups")
    local: ReadOnly[LocalTier | None] = ReadOnly("_local")
    persistent: ReadOnly[PersistentTier] = ReadOnly("_persistent")
    ledger: ReadOnly[Ledger] = ReadOnly("_ledger")
    lineage: ReadOnly[str] = ReadOnly("_lineage")
    timeline: ReadOnly[Timeline] = ReadOnly("_timeline")
    preemption: ReadOnly[PreemptionWatch] = ReadOnly("_preemption")
    pool: ReadOnly[StagingPool] = ReadOnly("_pool")
    restorer: ReadOnly[Restorer] = ReadOnly("_restorer")
    jobs: ReadOnly[TierJobs] = ReadOnly("_jobs")
    gate: ReadOnly[SaveGate] = ReadOnly("_gate")
    last_redundancy: ReadOnly[Future | None] = ReadOnly("_resume.last_redundancy")
    history: ReadOnly[list[CheckpointRecord]] = ReadOnly("_gate.history", copy=list)

    @paused  # the restart's critical path, as restore()
    def __init__(self, config: TierConfig, *, node_id: int | None = None,
                 persistent_io: PersistentIO | None = None):
        self._cfg = cfg = config
        run = startup.open_run(cfg, node_id, persistent_io)  # collective: roots, lineage, ledger, run_start
        topo, groups = run.topo, run.groups
        self._topo, self._groups, self._local, self._persistent = topo, groups, run.local, run.persistent
        self._lineage, self._timeline, self._ledger, self._journal = run.lineage, run.timeline, run.ledger, run.journal
        self._closed, self._preempt_seen = False, False
        self._pool = StagingPool(cfg.staging_buffers, overlapped=cfg.cpu_staging == "overlapped")
        self._optimizer_hook = wait_before_optimizer_steps(self) if cfg.cpu_staging == "overlapped" else None
        self._rollback = RollbackTracker(
            self._journal, topo.node, self._local.store if (self._local and topo.is_node_leader) else None,
            self._persistent.store if topo.rank == 0 else None, cfg.tiers, cfg.read_timeout_s)
        self._gate, self._jobs = build_gate(cfg, topo, groups, self._local, self._persistent, run.in_use,
                                            self._journal, self._rollback)
        self._jobs.owner = self  # a running job keeps the engine alive until the exit hook finished it
        self._saver = Saver(self._gate, self._jobs, self._pool, self._timeline)
        # a repeat within the grace period (+ a margin for the exit) is the same notice
        self._preemption = PreemptionWatch(cfg.preemption_signals, escalate_after_s=cfg.preemption_grace_s + 20.0,
                                           on_notice=defer_loader_deaths)
        warn_if_launcher_unprotected(cfg.preemption_signals, cfg.preemption_grace_s)  # orphaned or SIGKILLed ranks
        self._restorer = Restorer(topo, groups, self._local, self._persistent, run.in_use,
                                  cfg.transfer_chunk_bytes, cfg.restore_memory_bytes, cfg.read_timeout_s)
        self._spare = SpareGroups(topo, cfg.collective_timeout_s, groups.control)  # second groups, on first need
        self._resume = Resume(restorer=self._restorer, jobs=self._jobs, gate=self._gate, pool=self._pool,
                              journal=self._journal, timeline=self._timeline, rollback=self._rollback,
                              groups=groups, spare=self._spare, local=self._local is not None)
        self._recovery = RecoveryTimeline(topo, groups, self._ledger)  # the restart's phases, once
        exit_hook.register(self)  # a script that ends without close() still finishes its saves
        if topo.is_node_leader:  # once per node
            log.info("tierckpt: node %d/%d (%s), ranks %s, peers %s, local root %s, persistent %s",
                     topo.node, topo.nodes, topo.source, topo.local_ranks, topo.peers(),
                     self._local.store.url if self._local else None, self._persistent.store.url)

    # -- cadence -------------------------------------------------------------------------------
    def due(self, step: int) -> list[str]:
        """Tiers due at ``step`` under ``TierConfig.intervals`` (same answer on every rank).

        A tier whose save was deferred (``busy_tier_policy`` "defer") is due at the first step
        its previous save finished on every rank, then follows its interval. While it waits,
        this is collective (a 4-byte all-reduce per waiting tier and step), like ``save()``.

        Raises:
            RuntimeError: no ``intervals`` configured.
        """
        return self._gate.due(step)

    def observe_step(self, seconds: float) -> None:
        """A step's wall time (s, no checkpoint stalls; 0: unknown), every rank after every step (collective once
        after a restore): the scheduler's sample (:mod:`tierckpt.sched.schedule`), the ``recovery`` record."""
        self._recovery.step_done(self._resume)
        if self._gate.schedule is not None:
            self._gate.schedule.cadence.record_step(seconds, self._jobs.busy_during(seconds))

    def drain_schedule_log(self) -> list[dict]:
        """The interval decisions (ledger ``schedule`` records) made since the last call, on
        every rank, for the trainer's metric writers (:func:`tierckpt.sched.cadence.decision_metrics`)."""
        return self._gate.schedule.drain() if self._gate.schedule is not None else []

    # -- save ----------------------------------------------------------------------------------
    def save(self, step: int, state_dict: dict, tiers: Iterable[str] | None = None, *,
             raise_failures: bool = True, wait_previous: bool = False) -> SaveHandle:
        """Stage ``state_dict`` and start writing it to ``tiers`` in the background.

        Collective: every rank calls it with the same ``step`` and ``tiers``. The bytes written
        are the values at the time of the call. A CPU state is copied before this returns
        (``cpu_staging = "blocking"``, the default). CUDA tensors only have their device→host
        copies enqueued (:mod:`tierckpt.staging.pool`), and with ``cpu_staging = "overlapped"``
        large CPU tensors are copied by a background thread (:mod:`tierckpt.staging.overlap`): call
        :meth:`wait_for_staging` before modifying a saved tensor in place (a ``torch.optim``
        optimizer does it on its own when overlapped), as with DCP's ``async_with_pinned_mem``.

        Args:
            step: training step (>= 0).
            state_dict: DCP state dict (tensors, DTensors, picklable objects, top-level
                ``Stateful`` values).
            tiers: subset of the configured tiers (default: all configured).
            raise_failures: False keeps a failure of a previous save from raising here (it is
                raised later, at the next save or a clean close).
            wait_previous: a planned exit (the run's last save): every tier waits for its
                previous save as with ``busy_tier_policy = "wait"`` and is never deferred.
        Returns:
            :class:`~tierckpt.handle.SaveHandle`: ``blocking_s`` (δ, seconds, with the trainer's
            :meth:`wait_for_staging` time since the previous save), one future per started tier
            (→ :class:`~tierckpt.records.CheckpointRecord`), and in ``skipped`` the tiers
            deferred (record ``deferred``, ``running_step``) or skipped (a hung local disk, a
            too small RAM root).
        Raises:
            ConfigError: unknown or unconfigured tier.
            TierFailedError: the previous save of a due tier failed outside ``warn_only``
                (agreed: on every rank). Nothing is staged; committed steps are untouched.
            RuntimeError: the engine is closed.
        """
        if self._closed:
            raise RuntimeError("TieredCheckpointer is closed")
        return self._saver.save(step, state_dict, tiers, raise_failures, wait_previous)

    def wait_for_staging(self) -> float:
        """Block until the staging copies of every save are complete (not collective).

        Needed for CUDA states and with ``cpu_staging = "overlapped"`` (see :meth:`save`): call
        it before modifying a saved tensor in place after ``save()`` returned (torchtitan:
        ``maybe_wait_for_staging()`` before ``optimizers.step()``; overlapped, every
        ``torch.optim`` optimizer's step calls it through a global step pre-hook). A blocking
        CPU stage was copied inside ``save()``: returns at once. Overlapped copies are checked
        here for in-place writes since ``save()`` (:mod:`tierckpt.staging.overlap`): a copy that
        raced one fails its step's save.

        Returns:
            seconds waited (added to the next save's δ: the adaptive scheduler sees the stall).
        """
        return self._saver.trainer_wait()

    # -- preemption ----------------------------------------------------------------------------
    def preemption_requested(self) -> str | None:
        """Whether any rank received one of ``TierConfig.preemption_signals``: the signal's name
        (the same answer on every rank) or None. Collective over the control group when
        signals are watched (one 4-byte all-reduce); call once per step from the trainer's
        thread, every rank at the same step."""
        return preempt.requested(self._cfg.preemption_signals, self._preemption, self._groups.control)

    def save_for_preemption(self, step: int, state_dict: dict, signal_name: str,
                            handle: SaveHandle | None = None) -> Preempted:
        """The final save of a preemption notice (collective): every configured tier at
        ``step`` (or the tiers ``handle`` already started at ``step``), the local tier (with its
        replicas) waited for first, the persistent tier with what is left of
        ``preemption_grace_s``; a ``preemption`` ledger record says what is durable. A planned
        exit never defers: each tier first waits for its previous save (``wait_previous``), and
        a tier ``handle`` deferred is saved now. Returns the
        :class:`~tierckpt.preemption.Preempted` for the adapter to raise."""
        self._preempt_seen = True  # close(): what still runs after the grace period is abandoned
        return preempt.final_save(self, self._journal, step, state_dict, signal_name, handle)

    def unraised_failures(self) -> list[CheckpointRecord]:
        """Failed, finished saves of tiers outside ``warn_only`` not yet raised (this rank's
        view of the latest save of each tier; not collective)."""
        return self._gate.unraised_failures()

    def wait(self, tiers: Iterable[str] | None = None, *, step: int | None = None,
             bounded: bool = True, raise_failures: bool = False) -> dict[str, bool]:
        """Block until the background work of ``tiers`` (default: all) is finished.

        Args:
            step: wait only for jobs started at ``step`` (a tier skipped or not due then is
                not waited for).
            bounded: the local tier is waited for at most ``local_wait_timeout_s`` (it is
                best effort: a hung node-local disk must not hold back the trainer or the
                persistent tier's commit). False waits without limit, for a trainer that
                must run collectives on the local tier's groups afterwards. Also waits for the
                rebuild of replicas after a restore, unless ``step`` is given.
            raise_failures: raise the first failed save of a tier outside ``warn_only`` (once).
        Returns:
            ``{tier: finished}`` for the tiers waited for.
        Raises:
            TierFailedError: with ``raise_failures``, as described.
        """
        self._pool.wait_for_staging()  # the trainer waits: its overlapped copies are sealed now
        out = self._jobs.wait(self._cfg.tiers if tiers is None else validate_tiers(tiers), step, bounded)
        if raise_failures:
            for rec in self._gate.unraised_failures():
                self._gate.raise_if_failed(rec)
        return out

    # -- restore -------------------------------------------------------------------------------
    @paused  # no collector pass inside the restart's critical path (tierckpt/gcpause.py)
    def restore(self, state_dict: dict, step: int | None = None, *,
                rollback: bool = False, sources: tuple[str, ...] | None = None) -> RestoreResult | None:
        """Load ``state_dict`` in place from the newest step every node can be served from.

        Collective. Waits for background saves first: the local tier at most
        ``local_wait_timeout_s`` (agreed over every rank, as a save's wait); a node whose local
        job is still running then is restored without its local root (neither read nor
        written: its copies are not trusted while a write into that root hangs), on a second
        set of groups, and logged. See :mod:`tierckpt.restore`.

        Afterwards the restored step's replicas are rebuilt in the background (clique peers
        that lack a committed copy of a node's state get it from the node), and a
        ``redundancy`` ledger record says when the replication factor is back or why it is
        not (a resharded restore: only the next local save makes copies of the new layout).

        Args:
            step: restore exactly this step (from whichever tier holds it). Read-only: newer
                committed steps stay resume points. Without ``step``, a restore that loads
                an older save than the newest one committed (a fallback: the newest could not be
                served from the allowed ``sources``) starts a new timeline: the saves it passed
                over are superseded once this run commits its first step
                (:mod:`tierckpt.history.rollback`, a ``rollback`` record with ``cause: "fallback"``).
            rollback: ``step`` starts a new timeline (a training run that names an older step):
                the newer committed steps this restore saw are superseded once this run
                commits its first step of any tier (:mod:`tierckpt.history.rollback`; ledger
                ``rollback`` record), never before.
            sources: restore only from these source kinds (``own-local``, ``peer-replica``,
                ``in-cluster``, ``persistent``; None: any), e.g. ``("persistent",)`` when an
                adapter knows the node-local format cannot load under the current layout. The
                inventory stays complete, so a rollback still sees every newer copy.
        Returns:
            RestoreResult, or None if no committed checkpoint exists (fresh start).
        Raises:
            NoCheckpointError: checkpoints exist but none could be restored. ``state_dict``
                may then hold values of a source that failed its checks (pulled and own copies
                are loaded while their checksums run, and count only once they match): do not
                train from it (both adapters let the error end the job).
            TemplateMismatchError: ``state_dict`` does not fit the step (a key, dtype or global
                shape), found before any source is read; on every rank.
            ValueError: ``rollback`` without ``step``, or an unknown source kind.
        """
        return self._resume.restore(state_dict, step, rollback, sources)

    # -- queries for adapters -------------------------------------------------------------------
    @property
    def adaptive(self) -> bool:
        """Whether ``TierConfig.intervals`` is set, i.e. :meth:`due` decides when tiers save."""
        return self._gate.schedule is not None

    def persistent_url(self, step: int | None = None) -> str:
        """URL (or path) of the persistent root, or of its ``step-<step>`` directory."""
        return self._persistent.store.url if step is None else self._persistent.store.url_of(
            layout.persistent_step(step))

    def persistent_steps(self) -> list[int]:
        """Committed persistent steps, ascending (this rank reads the shared root; not collective)."""
        return self._persistent.committed_steps()

    def inventory(self) -> Inventory:
        """What every node and the persistent tier hold committed (this job's lineage), as the
        restore plans it (:func:`tierckpt.restore.plan_restore`). Collective: every rank calls
        it (one all-gather of each node's listing)."""
        return self._restorer.inventory()

    def add_rollback_hook(self, fn) -> None:
        """Call ``fn(rollback)`` (a :class:`~tierckpt.history.rollback.PendingRollback`) once an
        armed rollback ran, on the tier thread of the first commit: adapters point a framework's
        own "latest" record (Megatron's tracker file) away from superseded steps."""
        self._rollback.hooks.append(fn)

    def committed_steps(self) -> dict[str, list[int]]:
        """This rank's view: {"local": own node's steps, "persistent": steps} (not collective)."""
        return {
            "local": self._local.committed_steps() if self._local else [],
            "persistent": self._persistent.committed_steps(),
        }

    # -- shutdown ------------------------------------------------------------------------------
    def close(self, clean: bool = True, reason: str = "", *, raise_failures: bool = True,
              at_exit: dict | None = None) -> None:
        """Finish background work, record the run's end, release buffers and threads.

        ``clean=False`` records a failed run (the MTBF estimator counts it as a failure). A local
        save still running after ``local_wait_timeout_s`` is abandoned (left uncommitted, noted
        as ``stuck_tiers`` in the ledger's ``run_end``) instead of blocking the trainer's exit.
        The ``run_end`` record is ``clean`` only when ``clean`` was asked for, no save of a tier
        outside ``warn_only`` failed unraised, and — when the run saved anything and the
        persistent tier is configured — a persistent step committed in this run
        (``durable_step``).

        ``raise_failures=False`` (a preemption's exit) records failures in ``run_end`` only.
        ``at_exit`` (:mod:`tierckpt.exit`, the interpreter exiting without ``close()``): the jobs
        were waited for already; those still running are abandoned, and these ``run_end`` keys
        (``exit``, ``unfinished``) are added.

        Raises:
            TierFailedError: with ``clean=True``, after everything is closed, when a save of a
                tier outside ``warn_only`` failed and was not raised yet (the end of training
                must not look successful when its last checkpoint is not durable).
                Also (global rank 0, tier ``persistent``) when the ledger's ``run_end`` could not
                be written and ``persistent`` is not in ``warn_only``.
        """
        if self._closed:
            return
        self._preemption.close()
        poll = self._preempt_seen or at_exit is not None  # the grace period (or the exit's wait) is over
        if not poll:
            self._pool.wait_for_staging()
        stuck = self._jobs.finish(poll)
        failed, durable, ledger_error = self._gate.end_run(self._journal, self._persistent, self._topo.rank,
                                                           clean, reason, stuck, at_exit)
        if self._optimizer_hook is not None:
            self._optimizer_hook.remove()
            self._optimizer_hook = None
        if not stuck:  # a stuck job may still read its staged buffers: leak them rather than free
            self._pool.close()
            # nothing uses the engine's groups any more: join their gloo threads now, not while
            # the interpreter finalises (see release_groups); a stuck job may still be in one
            release_groups(self._groups, *self._spare.release())
            self._gate.release()
            if self._local is not None:
                self._local.group = None  # type: ignore[assignment]  # closed: its group is destroyed
        self._closed = True
        if clean and raise_failures:
            self._gate.raise_at_end(failed, durable, ledger_error)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self.close(clean=exc_type is None, reason=repr(exc) if exc else "")
