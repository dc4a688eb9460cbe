"""After a restore: re-establish the replication factor of the restored step in the background.

Each node that holds its own state of the restored step sends it to the clique peers holding no
committed copy of it, on the local lane (never overlapping a local save) over groups no
foreground collective uses. A node served from a peer's replica was loaded from memory: its
pulled copy is written and committed first, in the same background job (before that, the node
holds no copy of its own to send). Without a copy to send (a node served by the persistent
tier, a stuck local job, a resharded restore: node-local copies in the saved layout, not this
job's) the ``redundancy`` record names the nodes still missing copies, which the next local
save makes. Nothing is written when nothing is missing.

The jobs (:func:`copy_missing`, the pulled copies' commit) run on the local lane of
:class:`~tierckpt.tiers.jobs.TierJobs` and set its phase, which the hung-disk vote names
(:mod:`tierckpt.tiers.hung`).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from typing import Callable

from tierckpt.cluster.collectives import FAILURES, first_by_rank, gather_reduced, union
from tierckpt.cluster.topology import Groups, SpareGroups
from tierckpt.history.journal import RunJournal
from tierckpt.records import RedundancyRecord
from tierckpt.restore.plan import missing_replicas
from tierckpt.restore.restorer import Restorer, RestoreResult
from tierckpt.tiers.jobs import TierJobs
from tierckpt.tiers.replication import replicate

__all__ = ["copy_missing", "merge_redundancy", "rebuild", "REBUILD_HOLD_S"]

log = logging.getLogger(__name__)

#: seconds a restore's rebuild waits for the first training step after the restore (or a save,
#: or a wait: :meth:`~tierckpt.tiers.jobs.TierJobs.release_rebuild`) before it starts: on a
#: machine whose cores the trainer uses, its copies and checksums would slow exactly that step,
#: the one a recovery is timed to (measured on the 2-core demo: +0.7 s of a 2.1 s first step)
REBUILD_HOLD_S = 10.0


def rebuild(res: RestoreResult, stuck: list[int], *, restorer: Restorer, jobs: TierJobs, journal: RunJournal,
            spare: SpareGroups, local: bool) -> Future | None:
    """Start the rebuild of restored step ``res.step``'s replicas (collective: every rank calls
    it right after the restore, with the same ``stuck`` nodes, whose local job still runs).

    The background job (the pulled copies' commit, then the copies a clique lacks) first waits
    for the trainer's first step after the restore, its next save or a wait — at most
    :data:`REBUILD_HOLD_S` — so that the first step runs at full speed.

    Args:
        restorer: the restorer that served ``res`` (its inventory, bad copies, pulled copies).
        jobs: the engine's lanes; the job runs on the local lane.
        spare: the engine's second groups (``"redundancy"`` is used).
        local: whether the local tier is configured.
    Returns:
        the Future of the background job (resolving to the ``redundancy`` record or None), or
        None when nothing runs in the background (the record, if any, is written already).
    """
    jobs.hold_rebuild()
    if restorer.pending:
        groups = spare.get("redundancy")

        def commit_then_rebuild():
            jobs.rebuild_hold.wait(REBUILD_HOLD_S)
            restorer.commit_pending(groups)
            return _plan(res, stuck, restorer, jobs, journal, spare, local, groups)

        return _submit_commit(jobs, commit_then_rebuild)
    out = _plan(res, stuck, restorer, jobs, journal, spare, local, None)
    return out if isinstance(out, Future) else None


def _plan(res: RestoreResult, stuck: list[int], restorer: Restorer, jobs: TierJobs, journal: RunJournal,
          spare: SpareGroups, local: bool, groups: Groups | None) -> RedundancyRecord | Future | None:
    """Plan the copies missing after restoring ``res.step`` (the same on every rank) and make
    them: inline on the calling local-lane job over ``groups`` (returns the ``redundancy``
    record or None), or (``groups`` None) as a new job on the local lane (returns its Future)."""
    topo = jobs.topo
    if not local or topo.factor < 2:
        return None
    if res.resharded is not None:
        return journal.redundancy(res.step, ok=False, missing=range(topo.nodes), reason=(
            f"resharded restore: the node-local copies of step {res.step} are in the layout of the job that saved "
            f"it ({res.resharded['from']}); copies of this job's layout come back at the next local save"))
    pairs, missing = missing_replicas(restorer.last_inventory.view(res.step, res.save_id), res.step, topo.nodes,
                                      topo.jump, topo.factor, restorer.last_bad)
    if stuck:
        missing, pairs = sorted(set(missing) | {n for n, _ in pairs}), {}
    if missing and not pairs:
        return journal.redundancy(res.step, ok=False, missing=missing, reason=(
            f"a local-tier job is still running on node(s) {stuck}" if stuck else
            "these nodes hold no good copy of their own state to send"
        ) + "; their copies come back at the next local save")
    if not pairs:
        return None
    if groups is not None:
        return copy_missing(jobs, res.step, pairs, missing, groups)
    return jobs.lanes["local"].submit_rebuild(_held_copy, jobs, res.step, pairs, missing, spare.get("redundancy"))


def _held_copy(jobs: TierJobs, *args) -> RedundancyRecord | None:
    """:func:`copy_missing` once the trainer ran its first step (at most :data:`REBUILD_HOLD_S`)."""
    jobs.rebuild_hold.wait(REBUILD_HOLD_S)
    return copy_missing(jobs, *args)


def _submit_commit(jobs: TierJobs, commit: Callable[[], RedundancyRecord | None]) -> Future:
    """Queue ``commit`` (the restorer's :meth:`~tierckpt.restore.restorer.Restorer.commit_pending`
    then the replica rebuild, over groups no foreground collective uses) on the local lane:
    the pulled copies are written, committed and swapped in while training resumes, before
    any later local save or retention touches the root. Resolves to what ``commit`` returns
    (the ``redundancy`` record, or None); a failure is logged and resolves to None, never
    raised (the state was loaded already; the copies come back at the next local save)."""
    lane = jobs.lanes["local"]

    def job() -> RedundancyRecord | None:
        lane.phase = "save"  # writes and renames in the root: a hung disk shows here
        try:
            return commit()
        except FAILURES as e:
            log.warning("tierckpt: committing the restore's pulled copies failed on node %d: %s: %s",
                        jobs.topo.node, type(e).__name__, e)
            return None
        finally:
            lane.phase = "done"

    return lane.submit_rebuild(job)


def copy_missing(jobs: TierJobs, step: int, pairs: dict[tuple[int, int], str], missing: list[int],
                 groups: Groups) -> RedundancyRecord:
    """The rebuild job on the local lane: copy ``pairs`` {(node, peer): node's directory of its
    state of ``step``} (the same on every rank) with
    :func:`~tierckpt.tiers.replication.replicate` over ``groups`` (which no foreground
    collective uses), agree on what committed and write the ``redundancy`` ledger record;
    ``missing``: nodes no copy can be made of now. Never raises."""
    assert jobs.local is not None  # submitted only when the local tier is configured
    lane, topo, t0 = jobs.lanes["local"], jobs.topo, time.perf_counter()
    lane.phase = "redundancy"
    src_rels = {n: rel for (n, _), rel in pairs.items()}
    keys = ["local:" + rel for n, rel in src_rels.items() if n == topo.node]
    for k in keys:  # retention must not delete a source while it is sent
        jobs.in_use.hold(k)
    committed: list[int] = []
    failed: dict[int, str] = {}
    nbytes = 0
    try:
        rep = replicate(jobs.local.store, topo, groups.local_world, groups.node, step, True,
                        jobs.cfg.transfer_chunk_bytes, pairs=set(pairs), src_rels=src_rels)
        committed, failed, nbytes = rep.committed, rep.failed, rep.bytes_received
    except FAILURES as e:  # reported in the record; every rank still reaches the agreement
        failed = {-1: f"{type(e).__name__}: {e}"}
    finally:
        for k in keys:
            jobs.in_use.drop(k)
    rec = _agree(jobs, step, pairs, missing, committed, failed, nbytes, groups, t0)
    lane.phase = "done"
    return rec


def _agree(jobs: TierJobs, step: int, pairs: dict[tuple[int, int], str], missing: list[int],
           committed: list[int], failed: dict[int, str], nbytes: int, groups: Groups,
           t0: float) -> RedundancyRecord:
    """The agreed ``redundancy`` record of a rebuild (collective over ``groups.local_world``)."""
    topo = jobs.topo
    try:
        # per node: the copies it committed; per rank: its first error and bytes received
        got, errors, total = gather_reduced(
            ({(src, topo.node) for src in committed},
             [(topo.rank, f"node {src}→node {topo.node}: {why}") for src, why in list(failed.items())[:1]],
             nbytes), groups.local_world, merge_redundancy)
        still = sorted(set(missing) | {n for n, p in pairs if (n, p) not in got})
        rebuilt = sorted({n for n, _ in pairs} - set(still))
        rec = jobs.journal.redundancy(step, ok=not still, nodes=rebuilt, missing=still,
                                      seconds=time.perf_counter() - t0, nbytes=total,
                                      error=errors[0][1] if errors else None)
    except FAILURES as e:
        log.warning("tierckpt: could not agree on the redundancy of step %d: %s", step, e)
        rec = RedundancyRecord(step=step, ok=False, missing=sorted({n for n, _ in pairs} | set(missing)),
                               error=f"agreement failed: {type(e).__name__}: {e}")
    if topo.rank == 0:
        log.info("tierckpt: redundancy of restored step %d: %s (copied node(s) %s in %.2fs)%s", step,
                 "back" if rec.ok else f"missing for node(s) {rec.missing}", rec.nodes, rec.seconds,
                 f": {rec.error}" if rec.error else "")
    return rec


def merge_redundancy(parts: list[tuple]) -> tuple:
    """``reduce`` of ``({(src, holder) committed}, [(rank, first error)], bytes)``: union, the
    lowest rank's error, sum (the same per node then over nodes as over all ranks at once)."""
    return union([p[0] for p in parts]), first_by_rank(1)([p[1] for p in parts]), sum(p[2] for p in parts)
