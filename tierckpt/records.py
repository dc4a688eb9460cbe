"""Typed outcome of one tier's save of one step: what a :class:`~tierckpt.handle.SaveHandle`
future resolves to and what the ledger's ``checkpoint`` records hold.

The ledger stays JSON lines (one object per record, ``kind`` = ``checkpoint``); this module
is its one writer-side type and its one tolerant reader (:meth:`CheckpointRecord.from_ledger`
ignores unknown keys and fills absent ones, so older and newer ledgers both read).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

#: version of the ``checkpoint`` record layout (``schema`` key of the ledger record)
CHECKPOINT_SCHEMA = 1


@dataclass(frozen=True)
class CheckpointRecord:
    """One tier's save of one step, agreed over the tier's ranks (the same on every rank).

    Attributes:
        tier: ``"local"`` or ``"persistent"``.
        step: training step saved.
        ok: every rank's part was written and committed (manifest + marker).
        error: first error message of any rank (``"OSError: [Errno 28] …"``), None when ok.
        blocking_s: slowest rank's blocking time δ of the ``save()`` call, seconds.
        wait_s: time this rank's ``save()`` waited for the tier's previous job, seconds.
        bytes: bytes written by the tier over all ranks (node leaders for local).
        background_s: slowest rank's background time of the job, seconds.
        skipped: the tier skipped this step (a hung node-local disk, ``local_wait_timeout_s``).
        stuck_nodes: nodes whose local save was still running when the step was skipped.
        replicas_failed: replication errors of a local step (None: every replica written).
        interference_s: slowdown of training steps charged to this job (rank 0's scheduler;
            None elsewhere).
    """

    tier: str
    step: int
    ok: bool
    error: str | None = None
    blocking_s: float = 0.0
    wait_s: float = 0.0
    bytes: int = 0
    background_s: float = 0.0
    skipped: bool = False
    stuck_nodes: list[int] = field(default_factory=list)
    replicas_failed: object = None
    interference_s: float | None = None

    @property
    def failed(self) -> bool:
        """The save did not commit for a reason other than a deliberate skip."""
        return not self.ok and not self.skipped

    def as_ledger(self) -> dict:
        """Fields of the ledger ``checkpoint`` record (``schema`` included; empty optionals
        left out so old readers see what they always saw)."""
        d = asdict(self)
        for k in ("skipped", "stuck_nodes", "replicas_failed"):
            if not d[k]:
                d.pop(k)
        d["schema"] = CHECKPOINT_SCHEMA
        return d

    @classmethod
    def from_ledger(cls, rec: dict) -> "CheckpointRecord":
        """Tolerant reader of a ledger ``checkpoint`` record (unknown keys ignored).

        Raises:
            KeyError: ``tier``, ``step`` or ``ok`` missing (not a checkpoint record).
        """
        names = {f.name for f in fields(cls)}
        kw = {k: v for k, v in rec.items() if k in names}
        kw["stuck_nodes"] = list(kw.get("stuck_nodes") or [])
        return cls(**{**kw, "tier": rec["tier"], "step": int(rec["step"]), "ok": bool(rec["ok"])})
