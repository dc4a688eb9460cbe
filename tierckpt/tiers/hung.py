"""The hung-local-disk vote: whether the local tier's previous job finished on every rank within
``local_wait_timeout_s``, and which nodes are stuck when it did not.

A node-local disk that hangs must not stall training, the persistent tier or a restore. Before a
local save with ``busy_tier_policy = "wait"`` (:meth:`HungDiskVote.local_ready`) and before a
restore (:meth:`HungDiskVote.stuck_before_restore`) every rank waits for its local lane at most
``local_wait_timeout_s`` and the ranks agree over the control group; when some rank's job still
runs, the nodes named (:meth:`HungDiskVote.stuck_nodes`, from the phase each rank's local job
is in, :attr:`tierckpt.tiers.lanes.Lane.phase`) are the ones whose disk is stuck: the save
skips the local tier (a skipped ``checkpoint`` record), the restore leaves their roots alone.
A job that outlived one full wait is only polled afterwards, so a disk that stays hung costs
one wait, not one per interval.
"""

from __future__ import annotations

import logging
import time

import torch
import torch.distributed as dist

from tierckpt.cluster.collectives import all_gather
from tierckpt.cluster.topology import Groups, Topology
from tierckpt.config import TierConfig
from tierckpt.history.journal import RunJournal
from tierckpt.records import CheckpointRecord
from tierckpt.tiers.lanes import Lane

__all__ = ["HungDiskVote"]

log = logging.getLogger(__name__)


class HungDiskVote:
    """The vote over the local lane (one per engine; used only when the local tier is configured).

    Args:
        lanes: the engine's lanes (``lanes["local"]`` is voted on).
        cfg, topo, groups: the engine's configuration, topology and process groups (the vote
            runs over ``groups.control``, the trainer thread's group).
        journal: where the skipped record goes.
    """

    def __init__(self, lanes: dict[str, Lane], cfg: TierConfig, topo: Topology, groups: Groups,
                 journal: RunJournal):
        self._lanes, self.cfg, self.topo, self.groups, self.journal = lanes, cfg, topo, groups, journal

    @property
    def lane(self) -> Lane:
        return self._lanes["local"]

    def local_ready(self, step: int) -> tuple[bool, float, CheckpointRecord | None]:
        """Whether the local tier saves at ``step``, the seconds spent deciding, and the skipped
        record when it does not.

        Ready when its previous save finished on every rank within ``local_wait_timeout_s``
        (collective over the control group once a local save exists; the same answer on every
        rank). A save that already outlived one full wait is only polled afterwards. Not ready:
        a warning naming the nodes whose disk is stuck and a skipped ``checkpoint`` record in
        the ledger."""
        lane, limit = self.lane, self.cfg.local_wait_timeout_s
        if lane.tail is None or not limit:
            return True, 0.0, None  # jobs are queued at the same point on every rank: no collective needed
        t0 = time.perf_counter()
        done = int(lane.wait_tail(limit))
        flag = torch.tensor([done], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.groups.control)
        if int(flag.item()) == 1:
            lane.overdue = None
            return True, time.perf_counter() - t0, None
        rec = self._skipped_record(step, done, t0)
        return False, rec.wait_s or 0.0, rec

    def _skipped_record(self, step: int, done: int, t0: float) -> CheckpointRecord:
        """The agreed "local tier skipped" record (collective over the control group): the stuck
        disk is on the nodes still writing or deleting; their peers merely wait for them."""
        stuck = self.stuck_nodes(bool(done))
        waited = time.perf_counter() - t0
        error = (f"local save of step {self.lane.step} still running on node(s) {stuck} "
                 f"(local_wait_timeout_s = {self.cfg.local_wait_timeout_s:g}s); local tier skipped")
        if self.topo.rank == 0:  # agreed over every rank: say it once
            log.warning("tierckpt: step %d: %s; training and the persistent tier continue", step, error)
        rec = CheckpointRecord(tier="local", step=step, ok=False, skipped=True, error=error, stuck_nodes=stuck,
                               blocking_s=waited, wait_s=waited)
        self.journal.ledger.append(rec)
        return rec

    def stuck_nodes(self, done: bool) -> list[int]:
        """The nodes whose local job is stuck, from every rank's phase (collective over the
        control group): the ones writing or deleting in their root; when none is (a hang
        inside a transfer), every node still running. [] when every job finished."""
        phases = all_gather((self.topo.node, "done" if done else self.lane.phase), self.groups.control)
        return sorted({n for n, ph in phases if ph in ("save", "retention")}) or \
            sorted({n for n, ph in phases if ph != "done"})

    def stuck_before_restore(self) -> list[int]:
        """Wait at most ``local_wait_timeout_s`` for everything queued on the local lane
        before a restore; the nodes whose local job still runs then (agreed: collective over the
        control group once a local job exists; [] when all finished, or without a limit, after
        waiting for them). A job that already outlived a full wait is only polled."""
        lane, limit = self.lane, self.cfg.local_wait_timeout_s
        if lane.tail is None:
            return []
        if not limit:
            lane.wait_tail(None)
            return []
        return self.stuck_nodes(lane.wait_tail(limit))
