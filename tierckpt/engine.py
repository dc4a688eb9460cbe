"""The tiered checkpoint engine: what adapters and users call.

``save()`` stages the state into reusable host buffers and returns (its duration is the
blocking time δ); each due tier then runs in its own background worker thread:

- local: DCP save over the node group → checksums → manifest → marker; then replication to
  the clique peers; then stats to the ledger; then retention of the node's local root.
- persistent: DCP save over all ranks (through :class:`PersistentIO`, which adapters route
  through the framework's own DCP path) → manifest → marker; ledger; retention.

The next save of a tier first waits for that tier's previous one (the local tier at most
``local_wait_timeout_s``, then it skips that step on every rank). A local-tier failure
(disk full, dead disk) is logged as a warning and recorded in the ledger; training and the
persistent tier carry on. ``restore()`` runs in the foreground after all background work.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
import uuid
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FuturesTimeout
from typing import Iterable

import torch
import torch.distributed as dist

from tierckpt.config import TierConfig, validate_tiers
from tierckpt.dist.collectives import FAILURES, all_gather
from tierckpt.dist.topology import discover
from tierckpt.errors import ConfigError, TierFailedError
from tierckpt.handle import SaveHandle
from tierckpt.history import lineage
from tierckpt.history.journal import RunJournal
from tierckpt.history.ledger import Ledger
from tierckpt.io.staging import StagingPool, StagingSlot, resolve_stateful
from tierckpt.io.storage import Store
from tierckpt.preemption import Preempted, PreemptionWatch
from tierckpt.records import CheckpointRecord
from tierckpt.restore import PERSISTENT, Restorer, RestoreResult
from tierckpt.sched.cadence import Cadence
from tierckpt.tiers import retention
from tierckpt.tiers.local_tier import LocalTier
from tierckpt.tiers.persistent import PersistentIO, PersistentTier
from tierckpt.tiers.replication import replicate
from tierckpt.tiers.workers import DaemonWorker

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

    Raises:
        ConfigError: invalid option, impossible J/F for the node count, local root that
            cannot be written (names the option).
        RuntimeError: torch.distributed not initialised.
    """

    def __init__(self, config: TierConfig, *, node_id: int | None = None,
                 persistent_io: PersistentIO | None = None):
        self.cfg = config
        factor = self.cfg.replication_factor if "local" in self.cfg.tiers else 1
        self.topo, self.groups = discover(
            self.cfg.replication_jump, factor, node_id=node_id,
            ranks_per_node=self.cfg.simulated_ranks_per_node, timeout_s=self.cfg.collective_timeout_s,
            # a rank still waiting for its own stuck local save joins the vote up to
            # local_wait_timeout_s after its peers: the vote must not time out first
            control_timeout_s=max(self.cfg.collective_timeout_s, self.cfg.local_wait_timeout_s + 120.0),
        )
        topo = self.topo
        self.in_use = retention.InUse()
        self.local: LocalTier | None = None
        err = None
        if "local" in self.cfg.tiers:
            root = self.cfg.local_root_for(topo.node, topo.hostname)
            if topo.is_node_leader:
                try:  # torn steps of an earlier run (e.g. a full disk) must not keep the disk full
                    retention.purge_local(Store(root), 0, self.in_use)
                except OSError as e:
                    log.warning("tierckpt: could not clean torn steps under %s: %s", root, e)
            try:
                _probe_writable(root)
            except OSError as e:
                err = ConfigError("local_root", f"{root!r} (node {topo.node}) is not writable: {e}")
            self.local = LocalTier(Store(root), topo, self.groups.node)
        pstore = Store(self.cfg.persistent_root)
        lineage_id = None
        if topo.rank == 0 and err is None:
            try:
                pstore.makedirs("")
                lineage_id = lineage.ensure(pstore)  # (id, created, adopt)
            except OSError as e:
                err = ConfigError("persistent_root", f"{self.cfg.persistent_root!r} cannot be created: {e}")
            except ConfigError as e:
                err = e
        errors = [e for e in all_gather(None if err is None else (err.option, str(err)), self.groups.local_world) if e]
        if errors:
            raise err if err is not None else ConfigError(errors[0][0], f"failed on another rank: {errors[0][1]}")
        self.persistent = PersistentTier(pstore, persistent_io)
        run_id, (self.lineage, created, adopt) = all_gather(
            (uuid.uuid4().hex[:12], lineage_id) if topo.rank == 0 else None, self.groups.local_world)[0]
        self.persistent.lineage = self.lineage
        _check_shared(pstore, run_id, topo.rank, self.groups.local_world)
        if self.local is not None:
            self.local.lineage, self.local.adopt_unlabelled = self.lineage, adopt
            # Another experiment's steps are never offered (restore filters them) and are purged
            # so they do not fill the disk, but never in the start that created the lineage: a
            # persistent root that is new (or, by mistake, empty: an unmounted file system)
            # must not cost the real experiment its node-local steps.
            if topo.is_node_leader and not created:
                try:  # (local copies a rollback superseded go too: the persistent copy stays)
                    retention.purge_local(self.local.store, 0, self.in_use, lineage_id=self.lineage,
                                          adopt_unlabelled=adopt, drop_superseded=True)
                except OSError as e:
                    log.warning("tierckpt: could not purge node-local steps of other lineages under %s: %s",
                                self.local.store.url, e)
        self.ledger = Ledger(pstore, enabled=topo.rank == 0, run_id=run_id, job=self.cfg.resolved_job_id())
        self.journal = RunJournal(self.ledger)
        self.journal.run_start(topo, self.cfg.tiers, self.lineage)
        self.pool = StagingPool(self.cfg.staging_buffers)
        self._workers = {t: DaemonWorker(f"tierckpt-{t}") for t in self.cfg.tiers}
        self._pending: dict[str, Future | None] = {t: None for t in self.cfg.tiers}
        self._pending_step: dict[str, int] = {}
        self._local_overdue: Future | None = None  # a local job that outlived a full wait
        self._local_phase = "done"  # where this rank's local job is (named when it gets stuck)
        # monotonic (submitted, finished or None) of each tier's latest background job
        self._job_window: dict[str, tuple[float, float | None]] = {}
        self._lock = threading.Lock()
        self._rollback = None  # a PendingRollback until this run's first commit
        self._rollback_lock = threading.Lock()
        # called with the PendingRollback once it ran (background thread): adapters point a
        # framework's own "latest" record (Megatron's tracker file) away from superseded steps
        self.rollback_hooks: list = []
        self.history: list[dict] = []
        # failure policy (TierConfig.warn_only): failed records not yet raised to the trainer
        self._raised: set[tuple[str, int]] = set()
        self._saved_any = False
        self.persistent_committed: list[int] = []  # persistent steps committed by this run
        # a repeat within the grace period (+ a margin for the exit) is the same notice
        self.preemption = PreemptionWatch(self.cfg.preemption_signals,
                                          escalate_after_s=self.cfg.preemption_grace_s + 20.0)
        self._preempt_seen = False
        self.restorer = Restorer(topo, self.groups, self.local, self.persistent, self.in_use,
                                 self.cfg.transfer_chunk_bytes)
        self._closed = False
        # newest step every node committed to its local tier (all-gathered ok flags or a restore
        # served by the local tier); retention keeps it on every node beyond keep_latest_k
        self.local_anchor: int | None = None
        self.cadence: Cadence | None = None
        # every rank: each decision that changed (ledger ``schedule`` records), for the trainer's
        # metric writers, which may live on another rank than the scheduler (Megatron: the last)
        self.schedule_log: list[dict] = []
        self._pending_tau: dict[str, dict | None] = {}
        if self.cfg.intervals:
            self.cadence = Cadence(self.cfg.intervals, self.cfg.adaptive, rank=topo.rank,
                                   world_size=topo.world_size, options=self.cfg.schedule)
            self._share_schedule(self.groups.local_world, "start", refresh_ledger=True)
        log.info("tierckpt: rank %d node %d/%d (%s), peers %s, local root %s, persistent %s",
                 topo.rank, topo.node, topo.nodes, topo.source, topo.peers(),
                 self.local.store.url if self.local else None, pstore.url)

    # -- cadence -------------------------------------------------------------------------------
    def due(self, step: int) -> list[str]:
        """Tiers due at ``step`` under ``TierConfig.intervals`` (same answer on every rank).

        Raises:
            RuntimeError: no ``intervals`` configured.
        """
        if self.cadence is None:
            raise RuntimeError("TierConfig.intervals is not set: the caller decides when to save")
        return self.cadence.due(step)

    def observe_step(self, seconds: float) -> None:
        """Report one training step's wall time (seconds, without checkpoint stalls) to the
        adaptive scheduler. Cheap; call every step, right after the step ends. Tiers whose
        background work overlapped the step are charged its slowdown (:mod:`tierckpt.sched.schedule`)."""
        if self.cadence is not None:
            now = time.monotonic()
            busy = [t for t, (t0, t1) in list(self._job_window.items())
                    if t0 < now and (t1 is None or t1 > now - seconds)]
            self.cadence.observe_step(seconds, busy)

    def drain_schedule_log(self) -> list[dict]:
        """The interval decisions (ledger ``schedule`` records) made since the last call, on
        every rank, for the trainer's metric writers (:func:`tierckpt.sched.cadence.decision_metrics`)."""
        with self._lock:
            recs, self.schedule_log[:] = list(self.schedule_log), []
        return recs

    def _share_schedule(self, group, trigger: str, *, refresh_ledger: bool = False, step: int | None = None):
        """Rank 0 proposes tau per adaptive tier; everyone receives it (collective on ``group``).
        Returns the proposal; ``trigger`` labels the ledger ``schedule`` records."""
        prop, recs = None, []
        if self.topo.rank == 0:
            if refresh_ledger:
                try:
                    self.cadence.update_from_ledger(self.ledger.records(), self.ledger.run_id)
                except Exception as e:  # keep the previous estimate; never skip the all_gather below
                    log.warning("tierckpt schedule: could not use the ledger: %s", e)
            try:
                got = self.cadence.proposal()
            except Exception as e:  # keep the current intervals; never skip the all_gather below
                log.warning("tierckpt schedule: no new decision: %s", e)
                got = None
            if got is not None:
                prop, decisions = got
                for t, d in self.cadence.changed(decisions).items():
                    recs.append(self.journal.schedule(d, trigger, step))
                    log.info("tierckpt schedule (%s): %s every %s steps (tau %.1fs, delta %.3fs, M %.0fs, "
                             "R %.1fs, p %.2f; %s)", trigger, t, d.tau_steps, d.tau_s or float("nan"),
                             d.delta, d.M, d.R, d.p, d.reason)
        prop, recs = all_gather((prop, recs), group)[0]
        if recs:
            with self._lock:
                self.schedule_log.extend(recs)
        return prop

    # -- save ----------------------------------------------------------------------------------
    def save(self, step: int, state_dict: dict, tiers: Iterable[str] | None = None, *,
             raise_failures: bool = True) -> SaveHandle:
        """Stage ``state_dict`` and start writing it to ``tiers`` in the background.

        Collective: every rank calls it with the same ``step`` and ``tiers``. Returns once the
        host copy is complete, so the caller may modify parameters immediately; the bytes
        written are the values at the time of the call.

        Args:
            step: training step (>= 0).
            state_dict: DCP state dict (tensors, DTensors, picklable objects, top-level
                ``Stateful`` values).
            tiers: subset of the configured tiers (default: all configured).
            raise_failures: False keeps a failure of a previous save from raising here (it is
                raised later, at the next save or a clean close).
        Returns:
            :class:`~tierckpt.handle.SaveHandle`: ``blocking_s`` (δ, seconds) and one future per
            started tier resolving to its :class:`~tierckpt.records.CheckpointRecord`.
        Raises:
            ConfigError: unknown or unconfigured tier.
            TierFailedError: the previous save of a due tier failed and that tier is not in
                ``TierConfig.warn_only`` (same on every rank: the outcome is agreed). Nothing
                is staged then; committed steps are untouched.
        """
        if self._closed:
            raise RuntimeError("TieredCheckpointer is closed")
        tiers = self.cfg.tiers if tiers is None else validate_tiers(tiers)
        for t in tiers:
            if t not in self.cfg.tiers:
                raise ConfigError("tiers", f"tier {t!r} is not configured; configured: {', '.join(self.cfg.tiers)}")
        if not tiers:
            return SaveHandle(step, 0.0)
        t0 = time.perf_counter()
        skipped, t_skip, skip_recs = [], 0.0, {}
        for t in tiers:
            if t == "local":
                ready, t_skip, skip_rec = self._local_ready(step)
                if not ready:
                    skipped.append(t)
                    skip_recs[t] = skip_rec
                    continue
            rec = self._wait_tier(t)
            if raise_failures:
                self._raise_if_failed(rec)
            if self.cadence is not None:  # every rank reaches this at the same step
                self.cadence.apply(self._pending_tau.pop(t, None))
        # a skipped local tier's wait is the local tier's cost: keep it out of the other tiers' δ
        t_wait = time.perf_counter() - t0 - (t_skip if skipped else 0.0)
        if skipped:
            if self.cadence is not None:  # the next attempt is one interval later, not next step
                self.cadence.mark_saved(skipped, step)
            tiers = tuple(t for t in tiers if t not in skipped)
            if not tiers:
                return SaveHandle(step, time.perf_counter() - t0, skipped=skip_recs)
        slot = self.pool.acquire()
        try:
            staged = slot.stage(resolve_stateful(state_dict), users=len(tiers))
        except BaseException:
            slot.refs = 1
            slot.release()
            raise
        blocked = time.perf_counter() - t0
        delta = blocked - (t_skip if skipped else 0.0)
        if self.cadence is not None:
            self.cadence.mark_saved(tiers, step)
        self._saved_any = True
        futures = {}
        for t in tiers:
            job = self._local_job if t == "local" else self._persistent_job
            self._job_window[t] = (time.monotonic(), None)
            futures[t] = self._pending[t] = self._workers[t].submit(
                self._guard, job, t, staged, step, delta, t_wait, slot)
            self._pending_step[t] = step
        return SaveHandle(step, blocked, futures, skipped=skip_recs)

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
        ``preemption_grace_s``; a ``preemption`` ledger record says what is durable. Returns
        the :class:`~tierckpt.preemption.Preempted` for the adapter to raise."""
        t0 = time.monotonic()
        earlier = [f"{r.tier} step {r.step}: {r.error}" for r in self.unraised_failures()]
        # an earlier failed save must not cancel the final one: it is reported, not raised
        if handle is None or handle.step != step:
            handle = self.save(step, state_dict, raise_failures=False)
        else:  # tiers not saved at this step yet (e.g. only the local tier was due)
            missing = [t for t in self.cfg.tiers if t not in handle.futures and t not in handle.skipped]
            if missing:
                more = self.save(step, state_dict, tiers=missing, raise_failures=False)
                handle = SaveHandle(step, handle.blocking_s + more.blocking_s, {**handle.futures, **more.futures},
                                    {**handle.skipped, **more.skipped})
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
        out = []
        for t, fut in self._pending.items():
            if fut is not None and fut.done():
                rec = fut.result()
                if rec is not None and rec.failed and t not in self.cfg.warn_only and (t, rec.step) not in self._raised:
                    out.append(rec)
        return out

    def _local_ready(self, step: int) -> tuple[bool, float, CheckpointRecord | None]:
        """Whether the local tier saves at ``step``, and the seconds spent deciding.

        Ready when its previous save finished on every rank within ``local_wait_timeout_s``
        (collective over the control group once a local save exists; the same answer on every
        rank). A save that already outlived one full wait is only polled afterwards, so a disk
        that stays hung costs one wait, not one per interval. Not ready: a warning naming the
        nodes whose disk is stuck and a skipped ``checkpoint`` record in the ledger; a hung
        node-local disk must not stall training."""
        fut, limit = self._pending.get("local"), self.cfg.local_wait_timeout_s
        if fut is None or not limit:
            return True, 0.0, None  # _pending is set at the same step on every rank: no collective needed
        t0 = time.perf_counter()
        try:
            fut.result(timeout=0.0 if fut is self._local_overdue else limit)
            done = 1
        except FuturesTimeout:
            done = 0
        flag = torch.tensor([done], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.groups.control)
        if int(flag.item()) == 1:
            self._local_overdue = None
            return True, time.perf_counter() - t0, None
        if not done:
            self._local_overdue = fut
        # where each rank's job is: the stuck disk is on the nodes still writing or deleting;
        # their peers merely wait for them in a collective
        phases = [None] * self.topo.world_size
        dist.all_gather_object(phases, (self.topo.node, "done" if done else self._local_phase),
                               group=self.groups.control)
        stuck = sorted({n for n, ph in phases if ph in ("save", "retention")}) or \
            sorted({n for n, ph in phases if ph != "done"})
        waited = time.perf_counter() - t0
        prev = self._pending_step.get("local")
        error = (f"local save of step {prev} still running on node(s) {stuck} (local_wait_timeout_s = "
                 f"{limit:g}s); local tier skipped")
        log.warning("tierckpt: step %d: %s; training and the persistent tier continue", step, error)
        rec = CheckpointRecord(tier="local", step=step, ok=False, skipped=True, error=error, stuck_nodes=stuck,
                               blocking_s=waited, wait_s=waited)
        with self._lock:
            self.history.append(rec.as_ledger())
        self.ledger.append(rec)
        return False, waited, rec

    def _guard(self, job, tier, staged, step, *args) -> CheckpointRecord:
        """Run a tier job and return its record; nothing a background job hits may reach (and
        kill) the trainer thread: failures become records, raised by the failure policy."""
        try:
            return job(staged, step, *args)
        except BaseException as e:
            log.error("tierckpt: %s tier job failed unexpectedly: %s", tier, e, exc_info=True)
            return CheckpointRecord(tier=tier, step=step, ok=False, error=f"{type(e).__name__}: {e}")

    def _wait_tier(self, tier: str) -> CheckpointRecord | None:
        fut = self._pending.get(tier)
        return fut.result() if fut is not None else None  # _guard never raises

    def wait(self, tiers: Iterable[str] | None = None, *, step: int | None = None,
             bounded: bool = True, raise_failures: bool = False) -> dict[str, bool]:
        """Block until the background work of ``tiers`` (default: all) is finished.

        Args:
            step: wait only for jobs started at ``step`` (a tier skipped or not due then is
                not waited for).
            bounded: the local tier is waited for at most ``local_wait_timeout_s`` (it is
                best effort: a hung node-local disk must not hold back the trainer or the
                persistent tier's commit). False waits without limit: needed before the
                trainer thread runs collectives on the local tier's group (restore).
            raise_failures: raise the first failed save of a tier outside ``warn_only`` (once).
        Returns:
            ``{tier: finished}`` for the tiers waited for.
        Raises:
            TierFailedError: with ``raise_failures``, as described.
        """
        out = {}
        for t in (self.cfg.tiers if tiers is None else validate_tiers(tiers)):
            fut = self._pending.get(t)
            if fut is None or (step is not None and self._pending_step.get(t) != step):
                continue
            limit = self.cfg.local_wait_timeout_s if (t == "local" and bounded) else 0
            try:
                fut.result(timeout=(0.0 if fut is self._local_overdue else limit) if limit else None)
                out[t] = True
            except FuturesTimeout:
                self._local_overdue = fut
                out[t] = False
                log.warning("tierckpt: the local save of step %s is still running after %gs "
                            "(local_wait_timeout_s); not waiting for it", self._pending_step.get(t), limit)
        if raise_failures:
            for rec in self.unraised_failures():
                self._raise_if_failed(rec)
        return out

    def _record(self, tier, step, ok, error, delta, t_wait, nbytes, background_s, extra=None):
        """All-gather a job's stats over the tier's world group; rank 0 writes the ledger."""
        group = self.groups.local_world if tier == "local" else self.groups.persistent_world
        if tier in self._job_window:
            self._job_window[tier] = (self._job_window[tier][0], time.monotonic())
        parts = all_gather((ok, error, nbytes, background_s, delta), group)
        rec = self.journal.checkpoint(
            tier, step, parts, wait_s=t_wait, group=group, extra=extra,
            interference_s=self.cadence.take_interference(tier) if self.cadence is not None else None)
        with self._lock:
            self.history.append(rec.as_ledger())
            if tier == "local" and rec.ok and (self.local_anchor is None or step > self.local_anchor):
                self.local_anchor = step
            if tier == "persistent" and rec.ok:
                self.persistent_committed.append(step)
        if rec.ok and self._rollback is not None:
            self._finish_rollback(tier, step)
        if self.cadence is not None:
            if rec.ok:
                self.cadence.observe_checkpoint(tier, rec.blocking_s, rec.background_s, rec.interference_s)
            # M grows with failure-free exposure: re-read the ledger's evidence each time
            self._pending_tau[tier] = self._share_schedule(group, "checkpoint", refresh_ledger=True, step=step)
        return rec

    def _local_job(self, staged: dict, step: int, delta: float, t_wait: float, slot: StagingSlot) -> CheckpointRecord:
        t0 = time.perf_counter()
        key = f"local:local/step-{step}"
        self.in_use.hold(key)
        ok, error, nbytes = True, None, 0
        self._local_phase = "save"
        try:
            try:
                nbytes = self.local.save(staged, step)
            except FAILURES as e:  # degrade: the persistent tier and training go on
                ok, error = False, describe_failure(e, self.local.store)
                log.warning("tierckpt: local tier save of step %d failed on node %d; training continues, "
                            "the persistent tier still saves: %s", step, self.topo.node, error)
        finally:
            slot.release()
        rep, rec = None, None
        self._local_phase = "replicate"
        try:
            rep = replicate(self.local.store, self.topo, self.groups.local_world, self.groups.node,
                            step, ok, self.cfg.transfer_chunk_bytes)
        except FAILURES as e:
            log.warning("tierckpt: replication of step %d failed on node %d: %s", step, self.topo.node, e)
        self.in_use.drop(key)
        bg = time.perf_counter() - t0
        self._local_phase = "record"
        try:
            rec = self._record("local", step, ok, error, delta, t_wait,
                               nbytes if self.topo.is_node_leader else 0, bg,
                               extra={"replicas_failed": (rep.failed if rep else "replication error")} if (rep is None or rep.failed) else None)
        except Exception as e:
            log.warning("tierckpt: could not record local step %d: %s", step, e)
            rec = CheckpointRecord(tier="local", step=step, ok=False, error=f"stats exchange failed: {e}",
                                   blocking_s=delta, wait_s=t_wait, background_s=bg)
        self._local_phase = "retention"
        try:
            if self.topo.is_node_leader:
                anchor = self.local_anchor
                retention.purge_local(self.local.store, self.cfg.keep_latest_k["local"], self.in_use,
                                      protect=frozenset(() if anchor is None else (anchor,)),
                                      lineage_id=self.lineage, drop_foreign=False,
                                      adopt_unlabelled=self.local.adopt_unlabelled)
        except Exception as e:
            log.warning("tierckpt: local retention failed: %s", e)
        self._local_phase = "done"
        return rec

    def _persistent_job(self, staged: dict, step: int, delta: float, t_wait: float, slot: StagingSlot) -> CheckpointRecord:
        t0 = time.perf_counter()
        key = f"persistent:step-{step}"
        self.in_use.hold(key)
        ok, error, nbytes = True, None, 0
        try:
            nbytes = self.persistent.save(staged, step, self.groups.persistent_world)
        except FAILURES as e:
            ok, error = False, describe_failure(e, self.persistent.store)
            log.error("tierckpt: persistent save of step %d failed: %s", step, error)
        finally:
            slot.release()
            self.in_use.drop(key)
        try:
            rec = self._record("persistent", step, ok, error, delta, t_wait,
                               nbytes if self.topo.rank == 0 else 0, time.perf_counter() - t0)
        except Exception as e:
            # without agreed stats no rank may report this step as committed
            log.error("tierckpt: could not record persistent step %d: %s", step, e)
            rec = CheckpointRecord(tier="persistent", step=step, ok=False, error=f"stats exchange failed: {e}",
                                   blocking_s=delta, wait_s=t_wait, background_s=time.perf_counter() - t0)
        try:
            if self.topo.rank == 0:
                retention.purge_persistent(self.persistent.store, self.cfg.keep_latest_k["persistent"], self.in_use)
        except Exception as e:
            log.warning("tierckpt: persistent retention failed: %s", e)
        return rec

    # -- restore -------------------------------------------------------------------------------
    def restore(self, state_dict: dict, step: int | None = None, *,
                rollback: bool = False) -> RestoreResult | None:
        """Load ``state_dict`` in place from the newest step every node can be served from.

        Collective. Waits for background saves first. See :mod:`tierckpt.restore`.

        Args:
            step: restore exactly this step (from whichever tier holds it). Read-only: newer
                committed steps stay resume points.
            rollback: ``step`` starts a new timeline (a training run that names an older step):
                the newer committed steps this restore saw are superseded once this run
                commits its first step of any tier (:mod:`tierckpt.history.rollback`; ledger
                ``rollback`` record), never before.
        Returns:
            RestoreResult, or None if no committed checkpoint exists (fresh start).
        Raises:
            NoCheckpointError: checkpoints exist but none could be restored.
            ValueError: ``rollback`` without ``step``.
        """
        if rollback and step is None:
            raise ValueError("restore(rollback=True) needs the step rolled back to")
        self.wait(bounded=False)
        res = self.restorer.restore(state_dict, step)
        if res is not None:
            self.journal.restore(res)
            if rollback:
                self._arm_rollback(res.step)
            with self._lock:  # every node's copy of res.step sits on some node's local disk
                self.local_anchor = res.step if all(
                    o.source.kind != PERSISTENT for o in res.sources.values()) else None
        if self.cadence is not None and res is not None:
            self.cadence.reset(res.step)
            self.cadence.apply(self._share_schedule(self.groups.local_world, "restart",
                                                    refresh_ledger=True, step=res.step))
        return res

    def _arm_rollback(self, step: int) -> None:
        """Remember the steps newer than ``step`` the restore saw; :meth:`_finish_rollback`
        supersedes them at this run's first commit."""
        from tierckpt.history.rollback import PendingRollback

        rb = PendingRollback(step, self.restorer.last_inventory, time.time())
        if rb.empty:
            return
        with self._rollback_lock:
            self._rollback = rb
        log.warning("tierckpt: rollback to step %d armed: the newer steps up to %d stay resume points "
                    "until this run commits its first step, then they are superseded", step, rb.from_step)

    def _finish_rollback(self, tier: str, step: int) -> None:
        """Run the armed rollback once, at this run's first committed step (``tier``, ``step``).
        Holding the lock to the end keeps the other tier's thread (its retention) waiting until
        the abandoned steps no longer count as the newest."""
        with self._rollback_lock:
            rb = self._rollback
            if rb is None:
                return
            # this run's own committed steps and those being written: never superseded (a failed
            # save's number is not excluded: an old-timeline copy under it must still go, and
            # copies this run committed are protected by their marker's time anyway)
            with self._lock:
                mine = {t: {r["step"] for r in self.history if r.get("tier") == t and r.get("ok")}
                        for t in ("local", "persistent")}
            for t, s in list(self._pending_step.items()):
                mine[t].add(s)
            try:
                gone = rb.execute(node=self.topo.node,
                                  local_store=self.local.store if (self.local and self.topo.is_node_leader) else None,
                                  persistent_store=self.persistent.store if self.topo.rank == 0 else None,
                                  exclude=mine)
                if gone:
                    log.warning("tierckpt: rolled back from step %d to %d at this run's first commit (%s step %d); "
                                "superseded (marker renamed *.superseded): %s", rb.from_step, rb.to_step, tier, step,
                                ", ".join(gone))
                for hook in self.rollback_hooks:
                    hook(rb)
            except Exception as e:  # runs on a tier's background thread: warn, never raise
                log.warning("tierckpt: rollback to step %d: could not supersede newer steps: %s", rb.to_step, e)
            self.journal.rollback(rb, tier, step, mine)
            self._rollback = None

    def committed_steps(self) -> dict[str, list[int]]:
        """This rank's view: {"local": own node's steps, "persistent": steps} (not collective)."""
        return {
            "local": self.local.committed_steps() if self.local else [],
            "persistent": self.persistent.committed_steps(),
        }

    # -- shutdown ------------------------------------------------------------------------------
    def close(self, clean: bool = True, reason: str = "", *, raise_failures: bool = True) -> None:
        """Finish background work, record the run's end, release buffers and threads.

        ``clean=False`` records a failed run (the MTBF estimator counts it as a failure). A local
        save still running after ``local_wait_timeout_s`` is abandoned (left uncommitted, noted
        as ``stuck_tiers`` in the ledger's ``run_end``) instead of blocking the trainer's exit.
        The ``run_end`` record is ``clean`` only when ``clean`` was asked for, no save of a tier
        outside ``warn_only`` failed unraised, and — when the run saved anything and the
        persistent tier is configured — a persistent step committed in this run
        (``durable_step``).

        ``raise_failures=False`` (a preemption's exit) records failures in ``run_end`` only.

        Raises:
            TierFailedError: with ``clean=True``, after everything is closed, when a save of a
                tier outside ``warn_only`` failed and was not raised yet (the end of training
                must not look successful when its last checkpoint is not durable).
            OSError: with ``clean=True``, the ledger's ``run_end`` could not be written.
        """
        if self._closed:
            return
        self.preemption.close()
        if self._preempt_seen:  # the grace period is over: whatever still runs is abandoned
            finished = {t: f.done() for t, f in self._pending.items() if f is not None}
        else:
            finished = self.wait()  # the local tier at most local_wait_timeout_s
        stuck = [t for t, ok in finished.items() if not ok]
        if stuck:
            log.error("tierckpt: close: abandoning the %s save of step(s) %s, still running (local_wait_timeout_s "
                      "%gs, or a preemption's grace period); it stays uncommitted", "+".join(stuck),
                      [self._pending_step.get(t) for t in stuck], self.cfg.local_wait_timeout_s)
        for t, w in self._workers.items():
            w.shutdown(wait=t not in stuck)
        failed = self.unraised_failures()
        durable = max(self.persistent_committed) if self.persistent_committed else None
        not_durable = self._saved_any and "persistent" in self.cfg.tiers and durable is None
        if not_durable:
            log.error("tierckpt: this run saved checkpoints but committed no persistent step: its "
                      "progress lives only on node-local disks")
        ledger_error = None
        try:
            self.journal.run_end(clean=bool(clean) and not failed and not not_durable, reason=reason,
                                 durable_step=durable, stuck_tiers=stuck, failures=failed,
                                 strict="persistent" in self.cfg.tiers)
        except OSError as e:
            ledger_error = e
            log.error("tierckpt: could not write the ledger's run_end: %s", e)
        if not stuck:  # a stuck job may still read its staged buffers: leak them rather than free
            self.pool.close()
        self._closed = True
        if clean and raise_failures and failed:
            self._raise_if_failed(failed[0])
        if clean and raise_failures and ledger_error is not None:
            raise ledger_error  # global rank 0 only: the ledger's one writer

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self.close(clean=exc_type is None, reason=repr(exc) if exc else "")


def describe_failure(e: BaseException, store: Store) -> str:
    """One line naming a failed save's cause: DCP's per-rank failures unpacked, and a full
    file system named (torch's writers can turn ENOSPC into an unrelated-looking error)."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        # DCP keeps (exception, traceback frames) per rank: name the exception only
        errs = {r: x[0] if isinstance(x, tuple) and x and isinstance(x[0], BaseException) else x
                for r, x in failures.items()}
        msg = "; ".join(f"rank {r}: {type(x).__name__}: {x}" for r, x in sorted(errs.items()))
    else:
        msg = f"{type(e).__name__}: {e}"
    if store.local:
        try:
            du = shutil.disk_usage(store.path(""))
            if du.free < max(1 << 20, du.total // 100):
                msg += f" [{store.url}: file system full: {du.free} of {du.total} bytes free]"
        except OSError:
            pass
    return msg[:2000]


def _check_shared(store: Store, run_id: str, rank: int, group) -> None:
    """Rank 0 writes a probe into the persistent root; every rank must see it, or the
    "shared" storage is node-local and every persistent save would fail later (collective).

    Raises:
        ConfigError: ``persistent_root`` is not visible from some rank.
    """
    probe = f".tierckpt-probe-{run_id}"
    if rank == 0:
        try:
            store.write_atomic(probe, b"tierckpt shared-storage probe\n")
        except OSError as e:
            log.warning("tierckpt: could not write %s: %s", store.url_of(probe), e)
    all_gather(None, group)  # the probe exists before anyone looks
    try:
        seen = store.exists(probe)
    except OSError:
        seen = False
    blind = [r for r, ok in enumerate(all_gather(seen, group)) if not ok]
    if rank == 0:
        store.remove(probe)
    if blind:
        raise ConfigError("persistent_root", f"{store.url!r} is not shared storage: ranks {blind[:8]} cannot "
                          "see a file rank 0 wrote there; use a shared filesystem or an fsspec URL")


def _probe_writable(root: str) -> None:
    os.makedirs(root, exist_ok=True)
    probe = os.path.join(root, f".tierckpt-probe-{os.getpid()}")
    with open(probe, "wb") as f:
        f.write(b"x")
    os.remove(probe)
