"""The tiered checkpoint engine: what adapters and users call. This module is the
orchestration of named steps; each step lives in its wing (docs/architecture.md):

- start (:mod:`tierckpt.startup`): topology and groups, the local root, the persistent root and
  its lineage, the shared-storage probe, purge of other experiments' node-local steps;
- ``save()``: a tier whose previous save still runs is deferred (``busy_tier_policy``
  "defer", agreed: :mod:`tierckpt.tiers.deferral`) or waited for (:mod:`tierckpt.tiers.jobs`,
  the local tier bounded by ``local_wait_timeout_s`` and skipped on every rank when it hangs;
  always at planned exits, ``wait_previous``), raise earlier failures by the ``warn_only`` policy, apply interval decisions (:mod:`tierckpt.sched.driver`),
  stage the state (:mod:`tierckpt.io.staging`; the blocking time δ ends here), submit the tier
  jobs and return a :class:`~tierckpt.handle.SaveHandle`;
- in the background (:mod:`tierckpt.tiers.jobs`): local tier → replication → agreed record →
  retention; persistent tier (through the adapter's :class:`PersistentIO` hooks) → agreed
  record → retention; after each record the engine's bookkeeping (:meth:`_after_record`);
- ``restore()``: drain the jobs (the local tier bounded by ``local_wait_timeout_s``, agreed: a
  stuck node's root is left out and the restore runs on a second set of groups),
  :class:`~tierckpt.restore.Restorer`, the ledger record, an armed rollback
  (:mod:`tierckpt.history.rollback`), the restart's interval decision, and the background
  rebuild of the restored step's replicas (:meth:`TieredCheckpointer._rebuild_redundancy`);
- ``close()``: finish the jobs, the ``run_end`` record, raise what was not raised.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
import weakref
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FuturesTimeout
from typing import Iterable

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_pre_hook

from tierckpt import exit as exit_hook
from tierckpt import startup
from tierckpt.config import TierConfig, validate_tiers
from tierckpt.dist.collectives import all_gather, broadcast_from_first
from tierckpt.dist.topology import Groups, discover, new_groups, release_groups
from tierckpt.errors import ConfigError, TierFailedError
from tierckpt.gcpause import collector_paused, paused
from tierckpt.handle import SaveHandle
from tierckpt.io import layout
from tierckpt.history.journal import RunJournal
from tierckpt.history.ledger import Ledger
from tierckpt.history.rollback import EXPLICIT, FALLBACK, RollbackTracker
from tierckpt.history.timeline import Timeline
from tierckpt.io.staging import StagingPool, resolve_stateful
from tierckpt.io.storage import Store
from tierckpt.loader_signals import defer_loader_deaths
from tierckpt.preemption import Preempted, PreemptionWatch, mark_preempted, warn_if_launcher_unprotected
from tierckpt.records import CheckpointRecord
from tierckpt.restore import PERSISTENT, Inventory, Restorer, RestoreResult
from tierckpt.restore.plan import KINDS, missing_replicas
from tierckpt.sched.cadence import Cadence
from tierckpt.sched.driver import ScheduleDriver
from tierckpt.tiers import ram, retention
from tierckpt.tiers.deferral import BusyPoll
from tierckpt.tiers.jobs import TierJobs, describe_failure
from tierckpt.tiers.persistent import PersistentIO, PersistentTier

__all__ = ["TieredCheckpointer", "describe_failure"]

log = logging.getLogger(__name__)


class TieredCheckpointer:
    """Multi-tier checkpointing for one job (create on every rank, collectively).

    Args:
        config: tiers, roots, J/F, retention (validated when it was built).
        node_id: explicit node id of this rank (simulation/tests); otherwise from the
            environment (see :mod:`tierckpt.dist.topology`).
        persistent_io: how persistent steps are written/read (default: plain DCP).

    ``lineage`` is the persistent root's lineage id (:mod:`tierckpt.history.lineage`), the same on every
    rank; node-local steps of any other lineage are deleted here and never restored.

    Attributes adapters may read (framework hooks such as torchtitan's seed checkpoint); the rest
    is internal:
        cfg: the :class:`~tierckpt.config.TierConfig`.
        topo: the :class:`~tierckpt.dist.topology.Topology` (rank, world_size, node, nodes,
            node_of_rank, local ranks).
        groups: the engine's gloo groups (``local_world``: every rank; ``node``: this node's).
        local: the node's :class:`~tierckpt.tiers.local_tier.LocalTier` (``store``), or None.
        persistent: the :class:`~tierckpt.tiers.persistent.PersistentTier` (``store``,
            ``load(state_dict, url, group)``, ``committed_steps()``).
        ledger: the run's :class:`~tierckpt.history.ledger.Ledger` (``append(record)`` of a
            typed record from :mod:`tierckpt.records`; global rank 0 writes).

    Raises:
        ConfigError: invalid option, impossible J/F for the node count, local root that
            cannot be written (names the option).
        RuntimeError: torch.distributed not initialised.
    """

    @paused  # the restart's critical path, as restore()
    def __init__(self, config: TierConfig, *, node_id: int | None = None,
                 persistent_io: PersistentIO | None = None):
        self.cfg = cfg = config
        factor = cfg.replication_factor if "local" in cfg.tiers else 1
        self.topo, self.groups = discover(
            cfg.replication_jump, factor, node_id=node_id,
            ranks_per_node=cfg.simulated_ranks_per_node, timeout_s=cfg.collective_timeout_s,
            # a rank still waiting for its own stuck local save joins the vote up to
            # local_wait_timeout_s after its peers: the vote must not time out first
            control_timeout_s=max(cfg.collective_timeout_s, cfg.local_wait_timeout_s + 120.0),
        )
        topo, world = self.topo, self.groups.local_world
        self.in_use = retention.InUse()
        self.local, err = startup.open_local_tier(cfg, topo, self.groups.node, self.in_use)
        pstore, lineage_info, perr = startup.open_persistent_root(cfg, topo.rank) if err is None else \
            (Store(startup.persistent_root(cfg)), None, None)
        startup.raise_if_any_failed(err or perr, world)
        run_id, (self.lineage, created, adopt) = broadcast_from_first(
            (uuid.uuid4().hex[:12], lineage_info) if topo.rank == 0 else None, world)
        self.persistent = PersistentTier(pstore, persistent_io, lineage=self.lineage)
        startup.check_shared(pstore, run_id, topo.rank, world)
        if self.local is not None:
            startup.purge_other_lineages(self.local, topo, self.in_use, self.lineage, adopt=adopt, created=created,
                                         timeout_s=cfg.read_timeout_s)
        # every copy a save writes records its identity; the generation orders this run's saves
        # after every copy it could see (never by wall clocks: tierckpt/history/timeline.py)
        self.timeline = Timeline(run_id, startup.agree_generation(self.local, self.persistent, topo, world, cfg.read_timeout_s))
        self.ledger = Ledger(pstore, enabled=topo.rank == 0, run_id=run_id, job=cfg.resolved_job_id())
        self.journal = RunJournal(self.ledger)
        self.journal.run_start(topo, cfg.tiers, self.lineage)
        self._init_state()
        exit_hook.register(self)  # a script that ends without close() still finishes its saves
        if topo.is_node_leader:  # once per node
            log.info("tierckpt: node %d/%d (%s), ranks %s, peers %s, local root %s, persistent %s",
                     topo.node, topo.nodes, topo.source, topo.local_ranks, topo.peers(),
                     self.local.store.url if self.local else None, pstore.url)

    def _init_state(self) -> None:
        """What the run keeps between saves: staging buffers, tier workers, the rollback
        tracker, the scheduler round trip, the preemption watch, the restorer."""
        cfg, topo = self.cfg, self.topo
        self._lock = threading.Lock()
        self.history: list[dict] = []  # this rank's agreed records, in order (ledger lines)
        # newest step every node committed to its local tier (all-gathered ok flags or a restore
        # served by the local tier); retention keeps it on every node beyond keep_latest_k
        self.local_anchor: int | None = None
        self.persistent_committed: list[int] = []  # persistent steps committed by this run
        self._raised: set[tuple[str, int]] = set()  # failed records already raised (warn_only policy)
        self._saved_any = False
        self._closed = False
        self.pool = StagingPool(cfg.staging_buffers, overlapped=cfg.cpu_staging == "overlapped")
        # overlapped staging: every torch.optim optimizer waits for the copies before it writes
        # the parameters and its states (tierckpt/io/overlap.py)
        self._optimizer_hook = None
        self._unbooked_wait_s = 0.0  # the trainer's waits for overlapped copies since the last save
        if cfg.cpu_staging == "overlapped":
            me = weakref.ref(self)  # an engine never closed must not live on in torch's hook table

            def before_step(_opt, _args, _kwargs) -> None:
                eng = me()
                if eng is not None and not eng._closed:
                    eng.wait_for_staging()

            self._optimizer_hook = register_optimizer_step_pre_hook(before_step)
            weakref.finalize(self, self._optimizer_hook.remove)  # also without close()
        # the RAM-root fit check runs once, at the first local save (tiers/ram.py); a root
        # found too small turns the local tier off for this run (the reason is kept here)
        self._ram_checked = False
        self._local_off: str | None = None
        self.rollback = RollbackTracker(
            self.journal, topo.node, self.local.store if (self.local and topo.is_node_leader) else None,
            self.persistent.store if topo.rank == 0 else None)
        self.cadence: Cadence | None = None
        self.schedule: ScheduleDriver | None = None
        if cfg.intervals:
            self.cadence = Cadence(cfg.intervals, cfg.adaptive, rank=topo.rank, world_size=topo.world_size,
                                   options=cfg.schedule)
            self.schedule = ScheduleDriver(self.cadence, topo.rank, self.ledger, self.journal)
            self.schedule.share(self.groups.local_world, "start", refresh_ledger=True)
        self.jobs = TierJobs(cfg, topo, self.groups, self.local, self.persistent, self.in_use, self.journal,
                             on_record=self._after_record, local_anchor=lambda: self.local_anchor,
                             interference=self.cadence.interference_of if self.cadence else None)
        jobs = self.jobs
        self.busy = BusyPoll(jobs.latest, lambda t: jobs.pending_step.get(t) if jobs.latest(t) is jobs.pending.get(t)
                             else None, self.groups.control, topo.rank, self.journal.ledger.append,
                             stuck_nodes=lambda: jobs.stuck_nodes(False))
        # a repeat within the grace period (+ a margin for the exit) is the same notice
        self.preemption = PreemptionWatch(cfg.preemption_signals, escalate_after_s=cfg.preemption_grace_s + 20.0,
                                          on_notice=defer_loader_deaths)
        warn_if_launcher_unprotected(cfg.preemption_signals)  # a launcher killed by a notice orphans the ranks
        self._preempt_seen = False
        self.restorer = Restorer(topo, self.groups, self.local, self.persistent, self.in_use,
                                 cfg.transfer_chunk_bytes, cfg.restore_memory_bytes, cfg.read_timeout_s)
        # second sets of groups, made on first need: {"restore": while a local job is stuck,
        # "redundancy": the background rebuild of replicas after a restore}
        self._extra_groups: dict[str, Groups] = {}
        self.last_redundancy: Future | None = None  # Future of the rebuild after the last restore (None: none ran)

    # -- cadence -------------------------------------------------------------------------------
    def due(self, step: int) -> list[str]:
        """Tiers due at ``step`` under ``TierConfig.intervals`` (same answer on every rank).

        A tier whose save was deferred (``busy_tier_policy`` "defer") is due at the first step
        where its previous save has finished on every rank, then follows its interval again
        (fixed tiers: the next multiple of the interval; adaptive tiers: τ after that save).
        While such a tier waits, this is collective over the control group (one all-reduce of
        4 bytes per waiting tier, once per step however often it is called): every rank calls
        it at the same steps, as it calls ``save()``.

        Raises:
            RuntimeError: no ``intervals`` configured.
        """
        if self.schedule is None:
            raise RuntimeError("TierConfig.intervals is not set: the caller decides when to save")
        waiting = sorted(self.schedule.deferred)
        ready = [t for t, ok in self.busy.finished(waiting, step).items() if ok] if waiting else []
        return self.schedule.due(step, ready)

    def observe_step(self, seconds: float) -> None:
        """Report one training step's wall time (seconds, without checkpoint stalls) to the
        adaptive scheduler. Cheap; call every step, right after the step ends. Tiers whose
        background work overlapped the step are charged its slowdown (:mod:`tierckpt.sched.schedule`)."""
        if self.cadence is not None:
            self.cadence.record_step(seconds, self.jobs.busy_during(seconds))

    def drain_schedule_log(self) -> list[dict]:
        """The interval decisions (ledger ``schedule`` records) made since the last call, on
        every rank, for the trainer's metric writers (:func:`tierckpt.sched.cadence.decision_metrics`)."""
        return self.schedule.drain() if self.schedule is not None else []

    # -- save ----------------------------------------------------------------------------------
    def save(self, step: int, state_dict: dict, tiers: Iterable[str] | None = None, *,
             raise_failures: bool = True, wait_previous: bool = False) -> SaveHandle:
        """Stage ``state_dict`` and start writing it to ``tiers`` in the background.

        Collective: every rank calls it with the same ``step`` and ``tiers``. The bytes
        written are the values at the time of the call. A state of CPU tensors is copied
        before this returns (``cpu_staging = "blocking"``, the default), so the caller may
        modify it immediately. A state holding CUDA tensors (with CUDA available) only has its
        device→host copies into pinned buffers enqueued on a side stream
        (:mod:`tierckpt.io.staging`), and with ``cpu_staging = "overlapped"`` a CPU state's
        large tensors are copied by a background thread (:mod:`tierckpt.io.overlap`): the
        caller may run forward and backward at once but must call :meth:`wait_for_staging`
        before it next modifies a saved tensor in place (the optimizer step; a
        ``torch.optim`` optimizer does it on its own when overlapped), as with DCP's
        ``async_with_pinned_mem``.

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
            :class:`~tierckpt.handle.SaveHandle`: ``blocking_s`` (δ, seconds; including the
            trainer's :meth:`wait_for_staging` time since the previous save) and one future per
            started tier resolving to its :class:`~tierckpt.records.CheckpointRecord`; in
            ``skipped`` the tiers deferred (``busy_tier_policy`` "defer": the previous save of
            the tier still runs on some rank; record ``deferred``, ``running_step``) or skipped
            (a hung local disk).
        Raises:
            ConfigError: unknown or unconfigured tier.
            TierFailedError: the previous save of a due tier failed and that tier is not in
                ``TierConfig.warn_only`` (same on every rank: the outcome is agreed). Nothing
                is staged then; committed steps are untouched.
        """
        tiers = self._check_tiers(tiers)
        if not tiers:
            return SaveHandle(step, 0.0)
        # no collector pass inside δ (tierckpt/gcpause.py); a planned exit may wait long: left as is
        with contextlib.nullcontext() if wait_previous else collector_paused():
            return self._save(step, state_dict, tiers, raise_failures, wait_previous)

    def _save(self, step: int, state_dict: dict, tiers: tuple[str, ...], raise_failures: bool,
              wait_previous: bool) -> SaveHandle:
        """:meth:`save` once the tiers are checked (non-empty)."""
        t0 = time.perf_counter()
        self.pool.wait_for_staging()  # the previous save's copies: part of this δ if still running
        # the trainer's waits for the previous save's copies stall training too: booked here
        with self._lock:
            carried, self._unbooked_wait_s = self._unbooked_wait_s, 0.0
        t0 -= carried
        state_dict = resolve_stateful(state_dict)  # once: the RAM-root check and staging read it
        defer = () if wait_previous else tuple(t for t in tiers if self.cfg.busy_policy(t) == "defer")
        answer = self.busy.begin(defer, step)  # the agreement travels while we copy
        t_copy = time.perf_counter()
        # not while every due tier is sure to be deferred (its job still runs here): a copy
        # each step of a long deferral would only be dropped
        early = None if answer.busy_here.issuperset(tiers) else self._early_stage(state_dict)
        t_copy = time.perf_counter() - t_copy
        try:
            tiers, skipped, t_skip = self._previous_saves(step, tiers, raise_failures, defer, answer)
            tiers = self._local_fits(step, state_dict, tiers, skipped)
        except BaseException:
            if early is not None:
                self._drop(early[0])
            raise
        # a skipped local tier's wait is the local tier's cost: keep it out of the other tiers' δ
        t_wait = time.perf_counter() - t0 - t_skip - t_copy
        if skipped and self.schedule is not None:
            deferred = [t for t, r in skipped.items() if r.deferred]
            self.schedule.defer(deferred)  # due again once the running save finished
            # a hung disk's skip: the next attempt is one interval later, not next step
            self.schedule.saved([t for t in skipped if t not in deferred], step)
        if not tiers:
            if early is not None:  # every tier deferred or skipped: the copy is not needed
                self._drop(early[0])
            return SaveHandle(step, time.perf_counter() - t0, skipped=skipped)
        if early is not None:
            slot, staged = early
            slot.refs = len(tiers)
        else:
            slot, staged = self._stage(state_dict, len(tiers))
        blocked = time.perf_counter() - t0
        if self.schedule is not None:
            self.schedule.saved(tiers, step)
        self._saved_any = True
        futures = self.jobs.submit(tiers, staged, step, blocked - t_skip, t_wait, slot, self.timeline.for_step(step))
        return SaveHandle(step, blocked, futures, skipped=skipped)

    def _check_tiers(self, tiers: Iterable[str] | None) -> tuple[str, ...]:
        """The requested tiers, each configured (``ConfigError`` naming ``tiers`` otherwise)."""
        if self._closed:
            raise RuntimeError("TieredCheckpointer is closed")
        tiers = self.cfg.tiers if tiers is None else validate_tiers(tiers)
        for t in tiers:
            if t not in self.cfg.tiers:
                raise ConfigError("tiers", f"tier {t!r} is not configured; configured: {', '.join(self.cfg.tiers)}")
        return tiers

    def _previous_saves(self, step: int, tiers: tuple[str, ...], raise_failures: bool, defer: tuple[str, ...],
                        answer) -> tuple[tuple[str, ...], dict[str, CheckpointRecord], float]:
        """Defer each tier of ``defer`` whose previous save still runs (``busy_tier_policy``
        "defer", agreed: ``answer()`` of :meth:`BusyPoll.begin`) or wait for it (the local tier
        bounded, agreed: it may be skipped), raise its failure by the ``warn_only`` policy,
        apply the interval decision made after it. Returns (tiers that save now, {deferred or
        skipped tier: record}, seconds spent on a skipped tier)."""
        go, skipped, t_skip, t0 = [], {}, 0.0, time.perf_counter()
        finished = answer()
        for t in tiers:
            rec: CheckpointRecord | None = None
            if not finished.get(t, True):
                rec = self.busy.deferred(t, step, t0, "busy_tier_policy = defer")
            elif t == "local" and t not in defer:
                ready, t_local, rec = self.jobs.local_ready(step)
                if not ready:
                    t_skip = t_local
            if rec is not None:  # deferred or skipped: nothing staged for this tier
                skipped[t] = rec
                with self._lock:
                    self.history.append(rec.as_ledger())
                continue
            rec = self.jobs.previous(t)
            if raise_failures:
                self._raise_if_failed(rec)
            if self.schedule is not None:  # every rank reaches this at the same step
                self.schedule.before_save(t)
            go.append(t)
        return tuple(go), skipped, t_skip

    def _local_fits(self, step: int, state_dict: dict, tiers: tuple[str, ...],
                    skipped: dict[str, CheckpointRecord]) -> tuple[str, ...]:
        """The tiers that save now, without the local tier when its RAM root is too small.

        At the first local save (the state size is known only now) every rank agrees, over the
        control group, whether each tmpfs/ramfs root can hold the local tier's expected
        footprint (:mod:`tierckpt.tiers.ram`). If some cannot, the local tier is off for the
        rest of the run on every rank (replication pairs nodes, so all nodes stop together),
        with one warning and a skipped ``checkpoint`` record per save in ``skipped``: filling
        host memory could get the trainer OOM-killed, which a skipped local step never does."""
        if "local" not in tiers:
            return tiers
        if self._local_off is None and not self._ram_checked:
            self._ram_checked = True
            assert self.local is not None  # "local" in tiers means the local tier is configured
            mine = ram.leader_report(self.local.store.path(""), self.topo.node, *ram.state_bytes(state_dict),
                                     self.topo.is_node_leader)
            keep, cfg = self.cfg.keep_latest_k["local"], self.cfg
            reports = all_gather(mine, self.groups.control)
            short = ram.too_small(reports, keep, cfg.replication_jump, cfg.replication_factor)
            if short:
                self._local_off = ram.describe(short, keep, cfg.replication_factor)
                if self.topo.rank == 0:
                    log.warning("tierckpt: step %d: %s", step, self._local_off)
            elif keep == 0 and self.topo.is_node_leader and next(r for r in reports if r.node == self.topo.node).ram:
                log.warning("tierckpt: local_root %s is a RAM root (tmpfs) and keep_latest_k.local = 0 keeps "
                            "every step: host memory use grows with every local save", self.local.store.url)
        if self._local_off is None:
            return tiers
        rec = CheckpointRecord(tier="local", step=step, ok=False, skipped=True, error=self._local_off)
        self.journal.ledger.append(rec)
        with self._lock:
            self.history.append(rec.as_ledger())
        skipped["local"] = rec
        return tuple(t for t in tiers if t != "local")

    def wait_for_staging(self) -> float:
        """Block until the staging copies of every save are complete (not collective).

        Needed for CUDA states and with ``cpu_staging = "overlapped"`` (see :meth:`save`): call
        it before modifying a saved tensor in place after ``save()`` returned (torchtitan:
        ``maybe_wait_for_staging()`` before ``optimizers.step()``; overlapped, every
        ``torch.optim`` optimizer's step calls it through a global step pre-hook). A blocking
        CPU stage was copied inside ``save()``: returns at once. Overlapped copies are checked
        here for in-place writes since ``save()`` (:mod:`tierckpt.io.overlap`): a copy that
        raced one fails its step's save.

        Returns:
            seconds waited (added to the next save's δ: the adaptive scheduler sees the stall).
        """
        waited = self.pool.wait_for_staging()
        with self._lock:  # the hook may fire in another thread's optimizer
            self._unbooked_wait_s += waited
        return waited

    def _early_stage(self, state_dict: dict):
        """(slot, staged) of a copy made before the tiers are decided, when a staging slot is free
        right now and the state is on the host (the copy is then complete on return, or queued
        with ``cpu_staging = "overlapped"``), else None.
        It overlaps the busy-tier agreement (one all-reduce, 0.5–8 ms measured under load on
        this machine's 2 cores) with the copy; a save whose every tier is then deferred
        discards it (:meth:`_drop`), a copy of the same cost as any save's."""
        if torch.cuda.is_available():  # a device state's copies are enqueued, not made: decide first
            return None
        slot = self.pool.try_acquire()
        if slot is None:
            return None
        try:
            return slot, slot.stage(state_dict, users=1)
        except BaseException:
            self._drop(slot)
            raise

    @staticmethod
    def _drop(slot) -> None:
        """Give an unused staging slot back."""
        slot.refs = 1
        slot.release()

    def _stage(self, state_dict: dict, users: int):
        """Copy the state (top-level ``Stateful`` values already resolved, once: a resolved
        value may itself look ``Stateful``) into a free staging slot (the blocking copy);
        returns (slot, staged)."""
        slot = self.pool.acquire()
        try:
            return slot, slot.stage(state_dict, users=users)
        except BaseException:
            slot.refs = 1
            slot.release()
            raise

    # -- preemption ----------------------------------------------------------------------------
    def preemption_requested(self) -> str | None:
        """Whether any rank received one of ``TierConfig.preemption_signals``: the signal's name
        (the same answer on every rank) or None. Collective over the control group when
        signals are watched (one 4-byte all-reduce); call once per step from the trainer's
        thread, every rank at the same step."""
        if not self.cfg.preemption_signals:
            return None
        got = self.preemption.received
        idx = self.cfg.preemption_signals.index(got) if got in self.cfg.preemption_signals else -1
        flag = torch.tensor([idx], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.groups.control)
        idx = int(flag.item())
        return None if idx < 0 else self.cfg.preemption_signals[idx]

    def save_for_preemption(self, step: int, state_dict: dict, signal_name: str,
                            handle: SaveHandle | None = None) -> Preempted:
        """The final save of a preemption notice (collective): every configured tier at
        ``step`` (or the tiers ``handle`` already started at ``step``), the local tier (with its
        replicas) waited for first, the persistent tier with what is left of
        ``preemption_grace_s``; a ``preemption`` ledger record says what is durable. A planned
        exit never defers: each tier first waits for its previous save (``wait_previous``), and
        a tier ``handle`` deferred is saved now. Returns the
        :class:`~tierckpt.preemption.Preempted` for the adapter to raise."""
        t0 = time.monotonic()
        earlier = [f"{r.tier} step {r.step}: {r.error}" for r in self.unraised_failures()]
        # an earlier failed save must not cancel the final one: it is reported, not raised
        if handle is None or handle.step != step:
            handle = self.save(step, state_dict, raise_failures=False, wait_previous=True)
        else:  # tiers not saved at this step yet (only the local tier was due, or a tier deferred)
            missing = [t for t in self.cfg.tiers if t not in handle.futures
                       and (t not in handle.skipped or handle.skipped[t].deferred)]
            if missing:
                more = self.save(step, state_dict, tiers=missing, raise_failures=False, wait_previous=True)
                kept = {t: r for t, r in handle.skipped.items() if t not in missing}
                handle = SaveHandle(step, handle.blocking_s + more.blocking_s, {**handle.futures, **more.futures},
                                    {**kept, **more.skipped})
        committed = {t: False for t in self.cfg.tiers}
        committed.update({t: r.ok for t, r in handle.skipped.items()})
        for t in sorted(handle.futures, key=lambda t: t != "local"):
            left = max(0.0, self.cfg.preemption_grace_s - (time.monotonic() - t0))
            try:
                committed[t] = handle.futures[t].result(timeout=left).ok
            except FuturesTimeout:
                log.error("tierckpt: preemption: the %s tier did not commit step %d within "
                          "preemption_grace_s = %gs", t, step, self.cfg.preemption_grace_s)
        self._preempt_seen = True
        self.journal.preemption(step, signal_name, committed, time.monotonic() - t0, earlier)
        mark_preempted(step, signal_name, committed)  # for a launcher mapping this exit to "requeue me"
        if self.topo.rank == 0:  # agreed: once per job
            log.warning("tierckpt: %s: step %d saved for the requeue (%s) in %.1fs", signal_name, step,
                        ", ".join(f"{t} {'committed' if ok else 'NOT committed'}" for t, ok in committed.items()),
                        time.monotonic() - t0)
        return Preempted(step, signal_name, committed)

    def _raise_if_failed(self, rec: CheckpointRecord | None) -> None:
        """Raise a failed save of a tier outside ``warn_only`` once (records are agreed over
        the tier's ranks, so every rank raises at the same call)."""
        if rec is None or not rec.failed or rec.tier in self.cfg.warn_only:
            return
        if (rec.tier, rec.step) in self._raised:
            return
        self._raised.add((rec.tier, rec.step))
        raise TierFailedError(rec.tier, rec.step, rec.error)

    def unraised_failures(self) -> list[CheckpointRecord]:
        """Failed, finished saves of tiers outside ``warn_only`` not yet raised (this rank's
        view of the latest job of each tier; not collective)."""
        return [r for r in self.jobs.finished() if r is not None and r.failed and r.tier not in self.cfg.warn_only
                and (r.tier, r.step) not in self._raised]

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
        self.pool.wait_for_staging()  # the trainer waits: its overlapped copies are sealed now
        out = self.jobs.wait(self.cfg.tiers if tiers is None else validate_tiers(tiers), step, bounded)
        if raise_failures:
            for rec in self.unraised_failures():
                self._raise_if_failed(rec)
        return out

    def _after_record(self, tier: str, step: int, rec: CheckpointRecord, group) -> None:
        """Bookkeeping of an agreed save record (the tier's thread; collective on ``group``
        when a scheduler runs): history, local anchor, durable steps, the armed rollback, the
        next interval decision."""
        with self._lock:
            self.history.append(rec.as_ledger())
            if tier == "local" and rec.ok and (self.local_anchor is None or step > self.local_anchor):
                self.local_anchor = step
            if tier == "persistent" and rec.ok:
                self.persistent_committed.append(step)
        if rec.ok and self.rollback.armed:
            self.rollback.finish(tier, step)
        if self.schedule is not None:
            self.schedule.after_record(tier, step, rec, group)

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
        if rollback and step is None:
            raise ValueError("restore(rollback=True) needs the step rolled back to")
        kinds = KINDS if sources is None else tuple(sources)
        if not set(kinds) <= set(KINDS) or not kinds:
            raise ValueError(f"restore(sources={sources!r}): allowed source kinds are {list(KINDS)}")
        self.pool.wait_for_staging()  # the load writes into tensors a pending device→host copy reads
        stuck = self._drain_for_restore()
        groups = self._second_groups("restore") if stuck else self.groups
        # pulled copies are committed in the background, on the local worker of every rank; with
        # a local job stuck on some node that worker is blocked there: commit them now instead
        res = self.restorer.restore(state_dict, step, kinds=kinds, groups=groups, unavailable=frozenset(stuck),
                                    defer_commit=self.local is not None and not stuck)
        if res is None:
            return None
        self.journal.restore(res)
        self.timeline.restored()
        if rollback or step is None:
            # a training run from an older save starts a new timeline: by name, or because the
            # newest save could not be served (a fallback); saves passed over are superseded at
            # this run's first commit (tierckpt/history/rollback.py)
            self.rollback.arm(res.step, self.restorer.last_inventory, res.save_id, self.timeline.run,
                              self.timeline.next_seq, EXPLICIT if rollback else FALLBACK)
        with self._lock:  # every node's copy of res.step sits on some node's local disk
            self.local_anchor = res.step if all(o.source.kind != PERSISTENT for o in res.sources.values()) else None
        if self.schedule is not None:
            self.schedule.after_restore(res.step, groups.local_world)
        self._rebuild_redundancy(res, stuck)
        return res

    def _drain_for_restore(self) -> list[int]:
        """Wait for the background jobs before a restore: the other tiers without limit (the
        in-cluster read uses the persistent tier's group), the local tier at most
        ``local_wait_timeout_s`` (collective vote). Returns the nodes whose local job still
        runs (the same on every rank)."""
        self.jobs.wait([t for t in self.cfg.tiers if t != "local"], None, bounded=False)
        if "local" not in self.cfg.tiers:
            return []
        stuck = self.jobs.stuck_before_restore()
        if stuck and self.topo.rank == 0:
            log.warning("tierckpt: restore: a local-tier job is still running on node(s) %s after "
                        "local_wait_timeout_s = %gs; restoring without their local roots", stuck,
                        self.cfg.local_wait_timeout_s)
        return stuck

    def _second_groups(self, use: str) -> Groups:
        """The second set of groups for ``use`` (created on first need: collective, every rank
        at the same point; see :func:`tierckpt.dist.topology.new_groups`)."""
        if use not in self._extra_groups:
            self._extra_groups[use] = new_groups(self.topo, self.cfg.collective_timeout_s, self.groups.control)
        return self._extra_groups[use]

    def _rebuild_redundancy(self, res: RestoreResult, stuck: list[int]) -> None:
        """Re-establish the replication factor of restored step ``res.step``: each node that
        holds its own state sends it to the clique peers holding no committed copy of it, on the
        local worker (never overlapping a local save) over groups no foreground collective uses.
        A node served from a peer's replica was loaded from memory: its pulled copy is written
        and committed first, in the same background job (before that, the node holds no copy
        of its own to send). Without a copy to send (a node served by the persistent tier, a
        stuck local job, a resharded restore: node-local copies in the saved layout, not this
        job's) the ``redundancy`` record names the nodes still missing copies, which the next
        local save makes. Nothing is written when nothing is missing."""
        self.last_redundancy = None
        if self.restorer.pending:
            groups = self._second_groups("redundancy")

            def commit_then_rebuild():
                self.restorer.commit_pending(groups)
                return self._redundancy(res, stuck, groups, inline=True)

            self.last_redundancy = self.jobs.submit_pull_commit(commit_then_rebuild)
            return
        self._redundancy(res, stuck, None, inline=False)

    def _redundancy(self, res: RestoreResult, stuck: list[int], groups: Groups | None, inline: bool):
        """Plan the copies missing after restoring ``res.step`` (the same on every rank) and make
        them: ``inline`` on the calling local-worker job over ``groups`` (returns the
        ``redundancy`` record or None), else as a new job (sets :attr:`last_redundancy`)."""
        topo = self.topo
        if self.local is None or topo.factor < 2:
            return None
        if res.resharded is not None:
            return self.journal.redundancy(res.step, ok=False, missing=range(topo.nodes), reason=(
                f"resharded restore: the node-local copies of step {res.step} are in the layout of the job that saved "
                f"it ({res.resharded['from']}); copies of this job's layout come back at the next local save"))
        pairs, missing = missing_replicas(self.restorer.last_inventory.view(res.step, res.save_id), res.step, topo.nodes, topo.jump, topo.factor,
                                          self.restorer.last_bad)
        if stuck:
            missing, pairs = sorted(set(missing) | {n for n, _ in pairs}), {}
        if missing and not pairs:
            return self.journal.redundancy(res.step, ok=False, missing=missing, reason=(
                f"a local-tier job is still running on node(s) {stuck}" if stuck else
                "these nodes hold no good copy of their own state to send"
            ) + "; their copies come back at the next local save")
        if not pairs:
            return None
        if inline:
            assert groups is not None
            return self.jobs.redundancy_job(res.step, pairs, missing, groups)
        self.last_redundancy = self.jobs.submit_redundancy(res.step, pairs, missing, self._second_groups("redundancy"))
        return None

    # -- queries for adapters -------------------------------------------------------------------
    @property
    def adaptive(self) -> bool:
        """Whether ``TierConfig.intervals`` is set, i.e. :meth:`due` decides when tiers save."""
        return self.schedule is not None

    def persistent_url(self, step: int | None = None) -> str:
        """URL (or path) of the persistent root, or of its ``step-<step>`` directory."""
        return self.persistent.store.url if step is None else self.persistent.store.url_of(
            layout.persistent_step(step))

    def persistent_steps(self) -> list[int]:
        """Committed persistent steps, ascending (this rank reads the shared root; not collective)."""
        return self.persistent.committed_steps()

    def inventory(self) -> Inventory:
        """What every node and the persistent tier hold committed (this job's lineage), as the
        restore plans it (:func:`tierckpt.restore.plan_restore`). Collective: every rank calls
        it (one all-gather of each node's listing)."""
        return self.restorer.inventory()

    def all_steps(self) -> list[int]:
        """Every step some tier of some node holds committed, ascending (collective, as
        :meth:`inventory`)."""
        return sorted(self.inventory().all_steps())

    def add_rollback_hook(self, fn) -> None:
        """Call ``fn(rollback)`` (a :class:`~tierckpt.history.rollback.PendingRollback`) once an
        armed rollback ran, on the tier thread of the first commit: adapters point a framework's
        own "latest" record (Megatron's tracker file) away from superseded steps."""
        self.rollback.hooks.append(fn)

    def committed_steps(self) -> dict[str, list[int]]:
        """This rank's view: {"local": own node's steps, "persistent": steps} (not collective)."""
        return {
            "local": self.local.committed_steps() if self.local else [],
            "persistent": self.persistent.committed_steps(),
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
        self.preemption.close()
        stuck = self._finish_jobs(poll=at_exit is not None)
        failed = self.unraised_failures()
        # the newest persistent step of this run that still exists (global rank 0 writes run_end)
        durable = (self.persistent.newest_still_committed(self.persistent_committed, self.cfg.read_timeout_s)
                   if self.topo.rank == 0 else
                   max(self.persistent_committed, default=None))
        not_durable = self._saved_any and "persistent" in self.cfg.tiers and durable is None
        if not_durable:
            if self.topo.rank == 0:
                log.error("tierckpt: this run saved checkpoints but committed no persistent step: its "
                          "progress lives only on node-local disks")
        ledger_error = None
        try:
            self.journal.run_end(clean=bool(clean) and not failed and not not_durable, reason=reason,
                                 durable_step=durable, stuck_tiers=stuck, failures=failed,
                                 strict="persistent" in self.cfg.tiers, **(at_exit or {}))
        except OSError as e:
            ledger_error = e
            log.error("tierckpt: could not write the ledger's run_end: %s", e)
        if self._optimizer_hook is not None:
            self._optimizer_hook.remove()
            self._optimizer_hook = None
        if not stuck:  # a stuck job may still read its staged buffers: leak them rather than free
            self.pool.close()
            # nothing uses the engine's groups any more: join their gloo threads now, not while
            # the interpreter finalises (see release_groups); a stuck job may still be in one
            release_groups(self.groups, *self._extra_groups.values())
            self.busy.release()
            if self.local is not None:
                self.local.group = None  # type: ignore[assignment]  # closed: its group is destroyed
        self._closed = True
        if clean and raise_failures and failed:
            self._raise_if_failed(failed[0])
        if clean and raise_failures and ledger_error is not None and "persistent" not in self.cfg.warn_only:
            # global rank 0 only (the ledger's one writer); the ledger lives in the persistent
            # root and records what is durable: a failure of the persistent tier, never a raw error
            raise TierFailedError("persistent", -1 if durable is None else durable,
                                  f"the ledger's run_end could not be written: {type(ledger_error).__name__}: "
                                  f"{ledger_error}")

    def _finish_jobs(self, poll: bool = False) -> list[str]:
        """Wait for the background jobs (the local tier at most ``local_wait_timeout_s``; none
        after a preemption's grace period or with ``poll``) and stop the workers; returns the
        tiers abandoned."""
        if self._preempt_seen or poll:  # the grace period (or the exit's wait) is over: what still runs is abandoned
            finished = {t: f.done() for t in self.cfg.tiers if (f := self.jobs.latest(t)) is not None}
        else:
            finished = self.wait()
        stuck = [t for t, ok in finished.items() if not ok]
        if stuck:
            log.error("tierckpt: close: abandoning the %s save of step(s) %s, still running (local_wait_timeout_s "
                      "%gs, or a preemption's grace period); it stays uncommitted", "+".join(stuck),
                      [self.jobs.pending_step.get(t) for t in stuck], self.cfg.local_wait_timeout_s)
        self.jobs.shutdown(stuck)
        return stuck

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self.close(clean=exc_type is None, reason=repr(exc) if exc else "")

