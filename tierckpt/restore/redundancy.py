"""After a restore: re-establish the replication factor of the restored step in the background.

Each node that holds its own state of the restored step sends it to the clique peers holding no
committed copy of it, on the local lane (never overlapping a local save) over groups no
foreground collective uses. A node served from a peer's replica was loaded from memory: its
pulled copy is written and committed first, in the same background job (before that, the node
holds no copy of its own to send). Without a copy to send (a node served by the persistent
tier, a stuck local job, a resharded restore: node-local copies in the saved layout, not this
job's) the ``redundancy`` record names the nodes still missing copies, which the next local
save makes. Nothing is written when nothing is missing.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import TYPE_CHECKING

from tierckpt.cluster.topology import Groups, SpareGroups
from tierckpt.history.journal import RunJournal
from tierckpt.records import RedundancyRecord
from tierckpt.restore.plan import missing_replicas
from tierckpt.restore.restorer import Restorer, RestoreResult

if TYPE_CHECKING:  # the jobs run on the tiers' lanes; imported for types only
    from tierckpt.tiers.jobs import TierJobs

__all__ = ["rebuild"]


def rebuild(res: RestoreResult, stuck: list[int], *, restorer: Restorer, jobs: TierJobs, journal: RunJournal,
            spare: SpareGroups, local: bool) -> Future | None:
    """Start the rebuild of restored step ``res.step``'s replicas (collective: every rank calls
    it right after the restore, with the same ``stuck`` nodes, whose local job still runs).

    Args:
        restorer: the restorer that served ``res`` (its inventory, bad copies, pulled copies).
        jobs: the engine's lanes; the job runs on the local lane.
        spare: the engine's second groups (``"redundancy"`` is used).
        local: whether the local tier is configured.
    Returns:
        the Future of the background job (resolving to the ``redundancy`` record or None), or
        None when nothing runs in the background (the record, if any, is written already).
    """
    if restorer.pending:
        groups = spare.get("redundancy")

        def commit_then_rebuild():
            restorer.commit_pending(groups)
            return _plan(res, stuck, restorer, jobs, journal, spare, local, groups)

        return jobs.submit_pull_commit(commit_then_rebuild)
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
        return jobs.redundancy_job(res.step, pairs, missing, groups)
    return jobs.submit_redundancy(res.step, pairs, missing, spare.get("redundancy"))
