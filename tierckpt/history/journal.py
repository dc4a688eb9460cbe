"""What a run writes to its ledger: one method per event, each building the typed record
(:mod:`tierckpt.records`) and appending it through the run's :class:`~tierckpt.history.ledger.Ledger`
(global rank 0 writes; on other ranks the records are built and dropped).

The engine calls these at its named steps; what each event means (when a run is clean, which
steps a rollback supersedes) is decided there, the record's layout here.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
from typing import Iterable

import torch.distributed as dist

from tierckpt import clock
from tierckpt.cluster.collectives import first_by_rank, gather_reduced
from tierckpt.history.ledger import Ledger
from tierckpt.io.layout import LEDGER
from tierckpt.records import (
    CheckpointRecord,
    PreemptionRecord,
    RedundancyRecord,
    RestoreRecord,
    RollbackRecord,
    RunEndRecord,
    RunStartRecord,
    ScheduleRecord,
)

log = logging.getLogger(__name__)


class RunJournal:
    """The ledger records of one run (one process-group lifetime).

    Args:
        ledger: the run's ledger (its ``run_id`` and ``job`` stamp every record).

    Attributes:
        started: :func:`tierckpt.clock.now` of :meth:`run_start` (None before), the origin of
            ``run_end.exposure_s`` (a monotonic duration: a wall-clock step in the run does not
            move it).
    """

    def __init__(self, ledger: Ledger):
        self.ledger = ledger
        self.started: float | None = None

    def run_start(self, topo, tiers: Iterable[str], lineage: str | None) -> None:
        """Append ``run_start`` for ``topo`` (a :class:`tierckpt.cluster.topology.Topology`:
        world_size, nodes, ranks_per_node, jump, factor) and start the exposure clock."""
        self.started = clock.now()
        self.ledger.append(RunStartRecord(
            world_size=topo.world_size, nodes=topo.nodes, ranks_per_node=topo.ranks_per_node,
            restart_count=restart_count(), host=socket.gethostname(), tiers=list(tiers),
            process_start=process_start_time(), replication_jump=topo.jump,
            replication_factor=topo.factor, lineage=lineage))

    def checkpoint(self, tier: str, step: int, parts: list[tuple], *, wait_s: float, group,
                   interference_s: float | None = None, extra: dict | None = None) -> CheckpointRecord:
        """The agreed record of one tier's save, appended.

        Args:
            parts: every rank's ``(ok, error, bytes, background_s, blocking_s)`` (all-gathered
                over ``group``): ok is all ranks', error the first rank's, bytes summed,
                seconds the slowest rank's.
            wait_s: this rank's wait for the tier's previous job, seconds.
            group: the tier's world group: a persistent record is appended strictly and the
                outcome agreed over it (collective; see :meth:`_append_strict`).
            interference_s, extra: :class:`~tierckpt.records.CheckpointRecord` fields
                (``replicas_failed``).
        Returns:
            the record (``ok`` false on every rank when a persistent record could not be written).
        """
        rec = CheckpointRecord(
            tier=tier, step=step, ok=all(p[0] for p in parts),
            error=next((p[1] for p in parts if p[1]), None),
            blocking_s=max(p[4] for p in parts), wait_s=wait_s,
            bytes=sum(p[2] for p in parts), background_s=max(p[3] for p in parts), **(extra or {}),
            interference_s=interference_s,
        )
        if tier == "persistent":
            return self._append_strict(rec, group)
        self.ledger.append(rec)
        return rec

    def _append_strict(self, rec: CheckpointRecord, group) -> CheckpointRecord:
        """Append a persistent ``checkpoint`` record; a ledger that cannot be written fails
        the persistent save on every rank (collective over ``group``): the ledger is how
        restarts learn MTBF and how a user audits what is durable."""
        err = None
        try:
            self.ledger.append(rec, strict=True)
        except OSError as e:
            err = f"ledger {self.ledger.store.url_of(LEDGER)}: {type(e).__name__}: {e}"
        first = gather_reduced([(dist.get_rank(group), err)] if err else [], group, first_by_rank(1))
        err = first[0][1] if first else None
        if err is None:
            return rec
        log.error("tierckpt: persistent step %d: the ledger could not be written: %s", rec.step, err)
        return dataclasses.replace(rec, ok=False, error=(rec.error + "; " if rec.error else "") + err)

    def restore(self, res) -> None:
        """Append the ``restore`` record of ``res`` (a :class:`tierckpt.restore.RestoreResult`)."""
        self.ledger.append(RestoreRecord(
            step=res.step, seconds=res.seconds, attempts=res.attempts,
            persistent_bytes=res.persistent_bytes_read,
            bytes=sum(o.bytes for o in res.sources.values()),
            sources={str(n): {"source": o.source.kind, "holder": o.source.holder, "bytes": o.bytes,
                              "seconds": o.seconds} for n, o in res.sources.items()},
            failures=[{"node": f.node, "source": f.source.kind, "holder": f.source.holder,
                       "step": f.step, "error": f.error} for f in res.failures],
            resharded=res.resharded, missing=list(res.missing), save_id=getattr(res, "save_id", None),
            abandoned=list(getattr(res, "abandoned", None) or []),
        ))

    def schedule(self, decision, trigger: str, at_step: int | None) -> dict:
        """Append the ``schedule`` record of a :class:`tierckpt.sched.schedule.Decision`;
        returns the line (for the trainer's metric writers)."""
        return self.ledger.append(ScheduleRecord.of(decision, trigger, at_step))

    def rollback(self, rb, tier: str, step: int, *, superseded: Iterable[str], failed: Iterable[str] = (),
                 retry: bool = False) -> None:
        """Append the ``rollback`` record of ``rb`` (a :class:`tierckpt.history.rollback.PendingRollback`)
        run at the commit of ``tier`` step ``step``: ``superseded``, the copies every process
        reported superseded (since the previous record of a ``retry``), ``failed`` those it could
        not (``"<copy>: <error>"``)."""
        self.ledger.append(RollbackRecord(from_step=rb.from_step, to_step=rb.to_step,
                                          trigger={"tier": tier, "step": step}, superseded=list(superseded),
                                          cause=None if rb.cause == "rollback" else rb.cause,
                                          save_id=rb.keep, failed=list(failed), retry=retry))

    def preemption(self, step: int, signal: str, committed: dict[str, bool], seconds: float,
                   earlier_failures: list[str]) -> None:
        """Append the ``preemption`` record of a final save (seconds it took)."""
        self.ledger.append(PreemptionRecord(step=step, signal=signal, committed=committed, seconds=seconds,
                                            earlier_failures=earlier_failures))

    def redundancy(self, step: int, *, ok: bool, nodes: Iterable[int] = (), missing: Iterable[int] = (),
                   seconds: float = 0.0, nbytes: int = 0, error: str | None = None,
                   reason: str = "") -> RedundancyRecord:
        """Append (and return) the ``redundancy`` record of restored step ``step`` (see
        :class:`~tierckpt.records.RedundancyRecord`; ``nbytes``: its ``bytes``)."""
        rec = RedundancyRecord(step=step, ok=ok, nodes=sorted(nodes), missing=sorted(missing), seconds=seconds,
                               bytes=nbytes, error=error, reason=reason)
        self.ledger.append(rec)
        return rec

    def run_end(self, *, clean: bool, reason: str, durable_step: int | None, stuck_tiers: list[str],
                failures: Iterable[CheckpointRecord], strict: bool, exit: str = "",
                unfinished: Iterable[dict] = ()) -> None:
        """Append ``run_end``: exposure since :meth:`run_start`, ``failures`` as
        ``{"tier", "step", "error"}``; ``exit`` and ``unfinished`` as
        :class:`~tierckpt.records.RunEndRecord` describes them.

        Raises:
            OSError: ``strict`` and the append failed.
        """
        self.ledger.append(RunEndRecord(
            clean=clean, exposure_s=clock.now() - (self.started or clock.now()), reason=reason,
            durable_step=durable_step, stuck_tiers=list(stuck_tiers),
            failures=[{"tier": r.tier, "step": r.step, "error": r.error} for r in failures],
            exit=exit, unfinished=list(unfinished)), strict=strict)


def process_start_time() -> float | None:
    """UNIX time this process was created, on :mod:`tierckpt.clock` (Linux /proc; None
    elsewhere). Lets the scheduler's R include interpreter start, imports and model
    construction, not just the restore. ``starttime`` in ``/proc/self/stat`` counts clock ticks
    since boot on the boot-time clock (proc(5)), so the value moves with no wall-clock step
    (``/proc/stat``'s ``btime`` would: the kernel derives it from the wall clock)."""
    try:
        with open("/proc/self/stat") as f:
            # field 22 (starttime, clock ticks since boot) comes after the parenthesised comm
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        return clock.from_boottime(ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


def restart_count() -> int | None:
    """The launcher's restart count of this allocation (None when no launcher set one)."""
    # The launchers' own count first: it also counts in-allocation retries, which a fresh
    # torchrun (TORCHELASTIC_RESTART_COUNT=0) and Slurm (requeues only) do not see.
    for k in ("TIERCKPT_RESTART_COUNT", "SLURM_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT"):
        if k in os.environ:
            try:
                return int(os.environ[k])
            except ValueError:
                pass
    return None
