"""The background half of a save: the tiers' lanes (one worker thread each) and the save job
each runs.

A local job writes the node's step (:mod:`tierckpt.tiers.local_tier`), replicates it
(:mod:`tierckpt.tiers.replication`), records the agreed outcome and applies retention. A
persistent job writes the global step (:mod:`tierckpt.tiers.persistent`), records, applies
retention. Nothing a job hits may reach the trainer's thread: every failure becomes a failed
:class:`~tierckpt.records.CheckpointRecord`, which the engine's failure policy raises or not.

Elsewhere: the vote that skips the local tier while its previous save hangs
(:mod:`tierckpt.tiers.hung`, :attr:`TierJobs.vote`), and the replica rebuild a restore queues
on the local lane (:mod:`tierckpt.restore.redundancy`).
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from concurrent.futures import Future
from typing import Callable, Iterable

from tierckpt.config import TierConfig
from tierckpt.cluster.collectives import FAILURES, gather_reduced
from tierckpt.cluster.topology import Groups, Topology
from tierckpt.history.journal import RunJournal
from tierckpt.history.timeline import SaveIdentity
from tierckpt.staging.pool import StagingSlot
from tierckpt.io import objstore
from tierckpt.io.storage import Store
from tierckpt.records import CheckpointRecord
from tierckpt.tiers import keep, retention
from tierckpt.tiers.hung import HungDiskVote
from tierckpt.tiers.local_tier import LocalTier
from tierckpt.tiers.persistent import PersistentTier
from tierckpt.tiers.replication import replicate
from tierckpt.tiers.lanes import Lane, finished

log = logging.getLogger(__name__)

OnRecord = Callable[[str, int, CheckpointRecord, object], None]
"""``on_record(tier, step, record, group)``: called on the tier's thread with every agreed record
(the engine's bookkeeping: history, local anchor, rollback, scheduler); may run collectives on
``group``, the tier's world group."""


class TierJobs:
    """The configured tiers' lanes (:class:`~tierckpt.tiers.lanes.Lane`) and the jobs they run
    (one instance per engine).

    Args:
        cfg, topo, groups: the engine's configuration, topology and process groups.
        local, persistent: the tiers (``local`` None when not configured).
        in_use: steps being written or read, which retention must not delete.
        journal: the run's ledger writer.
        on_record: see :data:`OnRecord`.
        local_anchor: returns the newest step every node holds locally (kept by retention).
        interference: ``interference(tier)``, seconds of training slowdown charged to the tier's
            latest job (the adaptive scheduler's measurement), or None.

    Attributes:
        lanes: ``{tier: Lane}``, one per configured tier.
        vote: the hung-disk vote over the local lane (:class:`~tierckpt.tiers.hung.HungDiskVote`).
        owner: the engine, set by it: a job running on a lane references these jobs, and so
            keeps its engine alive for the exit hook to finish (:mod:`tierckpt.exit`).
    """

    def __init__(self, cfg: TierConfig, topo: Topology, groups: Groups, local: LocalTier | None,
                 persistent: PersistentTier, in_use: retention.InUse, journal: RunJournal, *,
                 on_record: OnRecord, local_anchor: Callable[[], int | None],
                 interference: Callable[[str], float | None] | None = None):
        self.cfg, self.topo, self.groups = cfg, topo, groups
        self._interference = interference
        self.local, self.persistent, self.in_use, self.journal = local, persistent, in_use, journal
        self._on_record, self._local_anchor = on_record, local_anchor
        self.lanes: dict[str, Lane] = {t: Lane(t, cfg.background_priority) for t in cfg.tiers}
        self.vote = HungDiskVote(self.lanes, cfg, topo, groups, journal)
        self.owner: object = None
        # set: a restore's replica rebuild may run; cleared by the restore until the first
        # training step after it, a save or a wait (tierckpt/restore/redundancy.py)
        self.rebuild_hold = threading.Event()
        self.rebuild_hold.set()

    def hold_rebuild(self) -> None:
        """A restore's rebuild, queued next, waits for :meth:`release_rebuild` (bounded)."""
        self.rebuild_hold.clear()

    def release_rebuild(self) -> None:
        """Let a held rebuild run: the first step after the restore ended, or the trainer saves
        or waits (it must never wait for a held job)."""
        self.rebuild_hold.set()

    def _phase(self, phase: str) -> None:
        """Where this rank's local job is now (named by the hung-disk vote, :mod:`tierckpt.tiers.hung`)."""
        self.lanes["local"].phase = phase

    # -- trainer thread ------------------------------------------------------------------------
    def submit(self, tiers: Iterable[str], staged: dict, step: int, delta: float, t_wait: float,
               slot: StagingSlot, identity: SaveIdentity | None = None) -> dict[str, Future]:
        """Start each tier's job on ``staged`` (held in ``slot`` until every job released it);
        returns ``{tier: Future → CheckpointRecord}``. ``delta``/``t_wait``: blocking and wait
        seconds of this save, recorded with it; ``identity``: the save every tier's copy records
        (:mod:`tierckpt.history.timeline`)."""
        self.release_rebuild()
        futures = {}
        for t in tiers:
            job = self._local_job if t == "local" else self._persistent_job
            futures[t] = self.lanes[t].submit_save(step, self._guard, job, t, staged, step, delta, t_wait, slot,
                                                   identity)
        return futures

    def latest(self, tier: str) -> Future | None:
        """The last job queued on ``tier``'s lane (a save, or the replica rebuild after a
        restore), None before any; a new save of the tier would start after it."""
        return self.lanes[tier].tail

    def previous(self, tier: str) -> CheckpointRecord | None:
        """Wait for ``tier``'s latest save; its record (None if it never ran)."""
        return self.lanes[tier].latest_record()

    def wait(self, tiers: Iterable[str], step: int | None, bounded: bool) -> dict[str, bool]:
        """Wait for the latest job of each of ``tiers`` (only saves started at ``step`` when
        given); the local tier at most ``local_wait_timeout_s`` when ``bounded``. Returns
        ``{tier: finished}`` for the tiers waited for."""
        self.release_rebuild()
        out = {}
        for t in tiers:
            lane = self.lanes[t]
            fut = lane.save if step is not None else lane.tail
            if fut is None or (step is not None and lane.step != step):
                continue
            limit = self.cfg.local_wait_timeout_s if (t == "local" and bounded) else 0
            out[t] = finished(fut, (0.0 if fut is lane.overdue else limit) if limit else None)
            if not out[t]:
                lane.overdue = fut
                log.warning("tierckpt: the local save of step %s is still running after %gs "
                            "(local_wait_timeout_s); not waiting for it", lane.step, limit)
        return out

    def drain_for_restore(self) -> list[int]:
        """Wait for the lanes before a restore: the other tiers without limit (the in-cluster
        read uses the persistent tier's group), the local tier at most ``local_wait_timeout_s``
        (collective vote), and drop the local tier's plan cache. Returns the nodes whose local job
        still runs (the same on every rank)."""
        self.wait([t for t in self.cfg.tiers if t != "local"], None, bounded=False)
        if "local" not in self.cfg.tiers:
            return []
        stuck = self.vote.stuck_before_restore()
        if self.local is not None:  # the restored state may be rebuilt differently: plan in full
            self.local.drop_plan_cache()
        if stuck and self.topo.rank == 0:
            log.warning("tierckpt: restore: a local-tier job is still running on node(s) %s after "
                        "local_wait_timeout_s = %gs; restoring without their local roots", stuck,
                        self.cfg.local_wait_timeout_s)
        return stuck

    def finish(self, poll: bool) -> list[str]:
        """Wait for every lane (the local tier at most ``local_wait_timeout_s``; none with
        ``poll``: after a preemption's grace period or the exit's own wait) and stop the
        workers; returns the tiers abandoned (their jobs stay uncommitted)."""
        self.release_rebuild()
        if poll:
            finished = {t: lane.tail.done() for t, lane in self.lanes.items() if lane.tail is not None}
        else:
            finished = self.wait(self.cfg.tiers, None, bounded=True)
        stuck = [t for t, ok in finished.items() if not ok]
        if stuck:
            log.error("tierckpt: close: abandoning the %s save of step(s) %s, still running (local_wait_timeout_s "
                      "%gs, or a preemption's grace period); it stays uncommitted", "+".join(stuck),
                      [self.lanes[t].step for t in stuck], self.cfg.local_wait_timeout_s)
        self.shutdown(stuck)
        return stuck

    def finished(self) -> list[CheckpointRecord]:
        """Records of the latest save of each tier that has finished (this rank's view)."""
        return [r for lane in self.lanes.values() if (r := lane.finished_record()) is not None]

    def busy_during(self, seconds: float) -> list[str]:
        """Tiers whose job overlapped the last ``seconds`` (for the scheduler's interference)."""
        now = time.monotonic()
        return [t for t, lane in self.lanes.items() if lane.busy_during(now, seconds)]

    def shutdown(self, abandoned: Iterable[str]) -> None:
        """Stop the workers; ``abandoned`` tiers' threads are not joined (daemon threads)."""
        abandoned = set(abandoned)
        for t, lane in self.lanes.items():
            lane.shutdown(wait=t not in abandoned)

    # -- tier threads --------------------------------------------------------------------------
    def _guard(self, job, tier, staged, step, *args) -> CheckpointRecord:
        """Run a tier job and return its record; nothing a background job hits may reach (and
        kill) the trainer thread: failures become records, raised by the failure policy."""
        try:
            return job(staged, step, *args)
        except BaseException as e:
            log.error("tierckpt: %s tier job failed unexpectedly: %s", tier, e, exc_info=True)
            return CheckpointRecord(tier=tier, step=step, ok=False, error=f"{type(e).__name__}: {e}")

    def _record(self, tier, step, ok, error, delta, t_wait, nbytes, background_s, extra=None) -> CheckpointRecord:
        """All-gather a job's stats over the tier's world group (the same record on every rank);
        rank 0 writes the ledger; then the engine's bookkeeping."""
        group = self.groups.local_world if tier == "local" else self.groups.persistent_world
        self.lanes[tier].finished_now()
        parts = [gather_reduced((self.topo.rank, ok, error, nbytes, background_s, delta), group, merge_stats)[1:]]
        rec = self.journal.checkpoint(tier, step, parts, wait_s=t_wait, group=group, extra=extra,
                                      interference_s=self._interference(tier) if self._interference else None)
        self._on_record(tier, step, rec, group)
        return rec

    def _snapshot_check(self, slot: StagingSlot):
        """The overlapped copy's check for the tier's agreed phases (same on every rank: decided
        by the config, since one rank's state may stage blocking while another's overlaps)."""
        return slot.check_intact if self.cfg.cpu_staging == "overlapped" else None

    def _local_job(self, staged: dict, step: int, delta: float, t_wait: float, slot: StagingSlot,
                   identity: SaveIdentity | None = None) -> CheckpointRecord:
        assert self.local is not None  # submitted only when the local tier is configured
        t0 = time.perf_counter()
        key = f"local:local/step-{step}"
        self.in_use.hold(key)
        ok, error, nbytes = True, None, 0
        self._phase("save")
        try:
            try:
                slot.wait_copied()  # CUDA or overlapped staging: the copies may still be running
                nbytes = self.local.save(staged, step, before_commit=self._snapshot_check(slot), identity=identity)
            except FAILURES as e:  # degrade: the persistent tier and training go on
                ok, error = False, describe_failure(e, self.local.store)
                if self.topo.is_node_leader:  # the failure is agreed over the node: say it once per node
                    log.warning("tierckpt: local tier save of step %d failed on node %d; training continues, "
                                "the persistent tier still saves: %s", step, self.topo.node, error)
        finally:
            slot.release()
        self._phase("replicate")
        rep = None
        try:
            rep = replicate(self.local.store, self.topo, self.groups.local_world, self.groups.node,
                            step, ok, self.cfg.transfer_chunk_bytes)
        except FAILURES as e:
            log.warning("tierckpt: replication of step %d failed on node %d: %s", step, self.topo.node, e)
        self.in_use.drop(key)
        bg = time.perf_counter() - t0
        self._phase("record")
        extra = {"replicas_failed": rep.failed if rep else "replication error"} if (rep is None or rep.failed) else None
        try:
            rec = self._record("local", step, ok, error, delta, t_wait, nbytes if self.topo.is_node_leader else 0,
                               bg, extra=extra)
        except Exception as e:
            log.warning("tierckpt: could not record local step %d: %s", step, e)
            rec = CheckpointRecord(tier="local", step=step, ok=False, error=f"stats exchange failed: {e}",
                                   blocking_s=delta, wait_s=t_wait, background_s=bg)
        self._phase("retention")
        self._local_retention(identity)
        self._phase("done")
        return rec

    def _local_retention(self, identity: SaveIdentity | None = None) -> None:
        """keep_latest_k on the node's root (node leader), never the local anchor; the saves
        ``identity`` (this save's) knows abandoned, or proves abandoned, take no slot.

        It runs after a save that did not commit on every node too: the anchor keeps the job
        restorable, and a node whose saves keep failing must not make the other nodes' disks
        fill with every step they write."""
        assert self.local is not None
        try:
            if self.topo.is_node_leader:
                anchor = self._local_anchor()
                retention.purge_local(self.local.store, self.cfg.keep_latest_k["local"],
                                      self.in_use, protect=frozenset(() if anchor is None else (anchor,)),
                                      lineage_id=self.local.lineage, drop_foreign=False,
                                      adopt_unlabelled=self.local.adopt_unlabelled, record=True,
                                      **_abandoned_kw(identity))
        except Exception as e:
            log.warning("tierckpt: local retention failed: %s", e)

    def _persistent_retention(self, identity: SaveIdentity | None, committed: bool) -> None:
        """The persistent tier's rules (global rank 0; :mod:`tierckpt.tiers.keep`), after the
        save's agreed record: the step this run restored from is kept for the whole run, and a
        save that did not commit deletes no committed step."""
        if self.topo.rank != 0:
            return
        policy = keep.Policy.of(self.cfg, "persistent") if committed else keep.Policy()
        descent = identity.descent if identity is not None else None
        try:
            retention.purge_persistent(self.persistent.store, policy.latest_k, self.in_use, policy=policy,
                                       protect={} if descent is None else {descent.step: keep.RESTORED},
                                       record=True, **_abandoned_kw(identity))
        except Exception as e:
            log.warning("tierckpt: persistent retention failed: %s", e)

    def _persistent_job(self, staged: dict, step: int, delta: float, t_wait: float, slot: StagingSlot,
                        identity: SaveIdentity | None = None) -> CheckpointRecord:
        t0 = time.perf_counter()
        key = f"persistent:step-{step}"
        self.in_use.hold(key)
        ok, error, nbytes = True, None, 0
        try:
            slot.wait_copied()  # CUDA or overlapped staging: the copies may still be running
            nbytes = self.persistent.save(staged, step, self.groups.persistent_world,
                                          before_commit=self._snapshot_check(slot), identity=identity)
        except FAILURES as e:
            ok, error = False, describe_failure(e, self.persistent.store)
            if self.topo.rank == 0:  # agreed over all ranks: say it once
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
        self._persistent_retention(identity, rec.ok)
        return rec


def _abandoned_kw(identity: SaveIdentity | None) -> dict:
    """Retention's ``abandoned`` and ``proofs`` from a save's identity (its run's descent is live:
    this save is newer than every copy retention sees)."""
    if identity is None:
        return {}
    return {"abandoned": identity.abandoned, "proofs": () if identity.descent is None else (identity.descent,)}


def merge_stats(parts: list[tuple]) -> tuple:
    """A ``reduce`` for :func:`~tierckpt.cluster.collectives.gather_reduced` of save stats
    ``(rank, ok, error, bytes, background_s, blocking_s)``: ok of all, the error of the lowest
    rank that has one (its rank leads; else the lowest rank), bytes summed, seconds the
    slowest. Applied per node, then over the nodes, it gives what one flat gather gives, so
    the ledger's record is the same."""
    failed = [p for p in parts if p[2]]
    head = min(failed or parts, key=lambda p: p[0])
    return (head[0], all(p[1] for p in parts), head[2], sum(p[3] for p in parts),
            max(p[4] for p in parts), max(p[5] for p in parts))


def describe_failure(e: BaseException, store: Store) -> str:
    """One line (at most 2000 characters) naming a failed save's cause: DCP's per-rank failures
    unpacked, and a full file system named (torch's writers can turn ENOSPC into an
    unrelated-looking error), and on an object store a refused request named with the URL
    (:func:`tierckpt.io.objstore.explain`)."""
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
    else:
        msg = msg[:1800] + objstore.explain(e, store)
    return msg[:2000]
