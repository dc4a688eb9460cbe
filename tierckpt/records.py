"""Typed ledger records: one frozen dataclass per ``kind`` of ``tierckpt-ledger.jsonl``, its
writer-side form (:meth:`LedgerRecord.as_ledger`) and one tolerant reader
(:func:`record_from_ledger`, :func:`parse_records`), in the manner of DCP's ``metadata.py``.

Line layout: one JSON object per line, ``{"kind", "time" (UNIX seconds), "run_id", "job",
<the record's fields>}``; :class:`tierckpt.history.ledger.Ledger` stamps the first four.

Kinds (class, fields in the order they are written):

- ``run_start`` (:class:`RunStartRecord`): world_size, nodes, ranks_per_node, restart_count,
  host, tiers, process_start, replication_jump, replication_factor, lineage.
- ``run_end`` (:class:`RunEndRecord`): clean, exposure_s, reason, durable_step; stuck_tiers,
  failures, exit and unfinished only when not empty.
- ``checkpoint`` (:class:`CheckpointRecord`, also what a
  :class:`~tierckpt.handle.SaveHandle` future resolves to): tier, step, ok, error, blocking_s,
  wait_s, bytes, background_s; skipped, stuck_nodes, replicas_failed only when set;
  interference_s; deferred, running_step only when set; schema.
- ``restore`` (:class:`RestoreRecord`): step, seconds, attempts, persistent_bytes, bytes,
  sources, failures; model_only only when true, checksummed only when known.
- ``schedule`` (:class:`ScheduleRecord`): trigger, at_step and the fields of
  :class:`tierckpt.sched.schedule.Decision`.
- ``rollback`` (:class:`RollbackRecord`): from_step, to_step, trigger, superseded, cause, save_id;
  failed and retry only when set.
- ``preemption`` (:class:`PreemptionRecord`): step, signal, committed, seconds,
  earlier_failures.
- ``redundancy`` (:class:`RedundancyRecord`): step, ok, nodes, missing, seconds, bytes, error;
  reason only when set.
- ``recovery`` (:class:`RecoveryRecord`): step, cause, attempt, restart_count, failed_nodes,
  warm, replaced, origin, phases, phases_s, total_s, nodes; notes only when not empty.

Schema versions: a line states its layout version in a ``schema`` key only for kinds whose
layout changed since the ledger began (``checkpoint``: version 1, lines without the key are
version 0, before ``interference_s``). The other kinds are at version 1 and write no key, so
their lines are what they always were; a kind that changes its layout raises ``SCHEMA`` and
starts writing the key.

Tolerance (:func:`record_from_ledger`): a field missing from a line, or of the wrong type or
range, takes its default (a required field: its read default, e.g. a checkpoint without
``ok`` counts as ok, as the readers before typed records did); keys the class does not know
are kept in ``extra`` and written back; a line of a newer schema is read the same way. A line
of an unknown kind, or of a known kind without a field it cannot do without (a checkpoint's
``tier``), is kept as a :class:`GenericRecord` (its time and run still count for MTBF
exposure). Lines that are not JSON (a torn last line) are skipped by
:meth:`tierckpt.history.ledger.Ledger.read`.
"""

from __future__ import annotations

import math
from dataclasses import KW_ONLY, MISSING, dataclass, field, fields
from typing import Callable, ClassVar, Iterable

#: version of the ``checkpoint`` record layout (``schema`` key of the ledger record)
CHECKPOINT_SCHEMA = 1

#: keys every line has, stamped by the ledger's writer, never part of a record's body
ENVELOPE = ("kind", "time", "run_id", "job")


# -- value readers: the value, or None when it is not of the field's type and range ------------
def _real(v) -> float | None:
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    return float(v) if ok else None


def _seconds(v) -> float | None:
    x = _real(v)
    return x if x is not None and x >= 0 else None


def _positive(v) -> float | None:
    x = _real(v)
    return x if x is not None and x > 0 else None


def _count(v) -> int | None:
    if isinstance(v, float) and math.isfinite(v) and v.is_integer():
        v = int(v)
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None


def _at_least_one(v) -> int | None:
    n = _count(v)
    return n if n is not None and n >= 1 else None


def _str(v) -> str | None:
    return v if isinstance(v, str) else None


def _bool(v) -> bool | None:
    return v if isinstance(v, bool) else None


def _list(v) -> list | None:
    return list(v) if isinstance(v, list) else None


def _dict(v) -> dict | None:
    return v if isinstance(v, dict) else None


def _dict_or_list(v) -> dict | list | None:
    return v if isinstance(v, (dict, list)) else None


def _text(v) -> str | None:
    """Identifiers (run_id, job): any scalar, as text."""
    return None if v is None or isinstance(v, (dict, list)) else str(v)


_ENVELOPE_READERS: dict[str, Callable] = {"time": _real, "run_id": _text, "job": _text}
_MISSING = object()


@dataclass(frozen=True)
class LedgerRecord:
    """Base of the ledger's records: the line envelope and the read/write rules.

    Class attributes:
        KIND: the ``kind`` key.
        SCHEMA: layout version this code writes.
        UNMARKED_SCHEMA: version of a line without a ``schema`` key; the key is written only
            when ``SCHEMA`` differs from it.

    Attributes (keyword-only, set by the reader; the writer stamps its own):
        time: UNIX seconds the line was written, None if absent or not a finite number.
        run_id: the run (one process-group lifetime) that wrote it.
        job: the job id (the same across restarts).
        schema: layout version of the line read (``SCHEMA`` for a record made here).
        extra: keys of the line this class does not know, kept and written back.
    """

    KIND: ClassVar[str] = ""
    SCHEMA: ClassVar[int] = 1
    UNMARKED_SCHEMA: ClassVar[int] = 1
    # value reader per field (fields without one are taken as they are)
    _READERS: ClassVar[dict[str, Callable]] = {}
    # value of a field without a default when a line lacks it (absent here: the line is unusable)
    _READ_DEFAULTS: ClassVar[dict[str, object]] = {}
    _OMIT_FALSY: ClassVar[tuple[str, ...]] = ()  # left out of the line when empty or false
    _OMIT_NONE: ClassVar[tuple[str, ...]] = ()  # left out of the line when None

    _: KW_ONLY
    time: float | None = None
    run_id: str | None = None
    job: str | None = None
    schema: int | None = None
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.schema is None:
            object.__setattr__(self, "schema", self.SCHEMA)

    @property
    def kind(self) -> str:
        """The record's ``kind`` key."""
        return self.KIND

    @classmethod
    def _body(cls) -> list:
        return [f for f in fields(cls) if not f.kw_only]

    def as_ledger(self) -> dict:
        """The line's fields after the envelope, in the order written: every field except
        those ``_OMIT_FALSY``/``_OMIT_NONE`` leave out, ``schema`` when the kind writes it,
        then ``extra``. Values are not converted (the ledger's JSON encoder does that)."""
        d = {}
        for f in self._body():
            v = getattr(self, f.name)
            if (f.name in self._OMIT_FALSY and not v) or (f.name in self._OMIT_NONE and v is None):
                continue
            d[f.name] = v
        if self.SCHEMA != self.UNMARKED_SCHEMA:
            d["schema"] = self.SCHEMA
        for k, v in self.extra.items():
            if k not in d and k not in ENVELOPE and k != "schema":
                d[k] = v
        return d

    def as_line(self) -> dict:
        """The whole line: envelope (``kind``, ``time``, ``run_id``, ``job``) and :meth:`as_ledger`."""
        return {"kind": self.kind, "time": self.time, "run_id": self.run_id, "job": self.job,
                **self.as_ledger()}

    @classmethod
    def from_ledger(cls, line: dict) -> "LedgerRecord":
        """Tolerant reader of one line (or of :meth:`as_ledger`'s output: the envelope is
        optional). See the module docstring for the rules.

        Raises:
            ValueError: the line is of another kind, or lacks a field this kind cannot do
                without (no read default).
        """
        if line.get("kind", cls.KIND) != cls.KIND:
            raise ValueError(f"a {line.get('kind')!r} line is not a {cls.KIND!r} record")
        kw, known = {}, set(ENVELOPE) | {"schema"}
        for f in cls._body():
            known.add(f.name)
            v = line.get(f.name, _MISSING)
            if v is not _MISSING:
                v = cls._READERS.get(f.name, lambda x: x)(v)
            if v is _MISSING or v is None:
                v = cls._READ_DEFAULTS.get(f.name, _MISSING)
                if v is _MISSING:
                    if f.default is MISSING and f.default_factory is MISSING:
                        raise ValueError(f"{cls.KIND!r} line without a usable {f.name!r}")
                    continue
            kw[f.name] = v
        return cls(**kw, **_envelope(line, cls.UNMARKED_SCHEMA),
                   extra={k: v for k, v in line.items() if k not in known})


def _envelope(line: dict, unmarked_schema: int) -> dict:
    out = {k: read(line.get(k)) for k, read in _ENVELOPE_READERS.items()}
    schema = _count(line.get("schema"))
    out["schema"] = unmarked_schema if schema is None else schema
    return out


@dataclass(frozen=True)
class GenericRecord(LedgerRecord):
    """A line of a kind this code does not know (or cannot use): its kind, envelope and, in
    ``extra``, every other key. Written back unchanged by :meth:`as_ledger`.

    Attributes:
        name: the line's ``kind``.
    """

    name: str = ""

    @property
    def kind(self) -> str:
        return self.name

    def as_ledger(self) -> dict:
        """The line's keys after the envelope, as read."""
        return {k: v for k, v in self.extra.items() if k not in ENVELOPE}

    @classmethod
    def from_ledger(cls, line: dict) -> "GenericRecord":
        """Keep any line whole (never raises)."""
        return cls(name=str(line.get("kind", "")), **_envelope(line, cls.UNMARKED_SCHEMA), extra=dict(line))


@dataclass(frozen=True)
class RunStartRecord(LedgerRecord):
    """``run_start``: a run (one process-group lifetime) began; global rank 0 writes it.

    Attributes:
        world_size: ranks of the job.
        nodes: nodes of the job.
        ranks_per_node: ranks per node.
        restart_count: the first set of TIERCKPT_RESTART_COUNT (launch/), SLURM_RESTART_COUNT,
            TORCHELASTIC_RESTART_COUNT; None when none is.
        host: host name of global rank 0.
        tiers: configured tiers.
        process_start: UNIX seconds rank 0's process was created (None where unknown).
        replication_jump: J, node distance of the first neighbour replica.
        replication_factor: F, copies of each local step including the node's own.
        lineage: the persistent root's lineage id (:mod:`tierckpt.history.lineage`).
    """

    KIND: ClassVar[str] = "run_start"
    _READERS = {"world_size": _at_least_one, "nodes": _at_least_one, "ranks_per_node": _at_least_one,
                "restart_count": _count, "host": _str, "tiers": _list, "process_start": _real,
                "replication_jump": _count, "replication_factor": _count, "lineage": _str}

    world_size: int | None = None
    nodes: int | None = None
    ranks_per_node: int | None = None
    restart_count: int | None = None
    host: str | None = None
    tiers: list[str] = field(default_factory=list)
    process_start: float | None = None
    replication_jump: int | None = None
    replication_factor: int | None = None
    lineage: str | None = None


@dataclass(frozen=True)
class RunEndRecord(LedgerRecord):
    """``run_end``: the run closed. A run with ``run_start`` and no clean ``run_end`` failed.

    Attributes:
        clean: closed cleanly (read default False: a line without it is not clean).
        exposure_s: seconds since the run's ``run_start``.
        reason: the trainer's reason (an exception's repr, a preemption's signal).
        durable_step: newest persistent step this run committed, None if none.
        stuck_tiers: tiers whose save was still running and abandoned at close.
        failures: ``[{"tier", "step", "error"}]`` failed saves never raised to the trainer.
        exit: how the run ended when not through ``close()``: ``"without close()"`` (the
            interpreter exited with the engine open: :mod:`tierckpt.exit`); empty otherwise.
        unfinished: ``[{"tier", "step", "job", "error"}]`` background jobs pending when such
            an exit began that did not commit: still running after ``TierConfig.exit_timeout_s``
            (given up on) or failed (e.g. a peer's process gone).
    """

    KIND: ClassVar[str] = "run_end"
    _READERS = {"clean": _bool, "exposure_s": _seconds, "reason": _str, "durable_step": _count,
                "stuck_tiers": _list, "failures": _list, "exit": _str, "unfinished": _list}
    _READ_DEFAULTS = {"clean": False}
    _OMIT_FALSY = ("stuck_tiers", "failures", "exit", "unfinished")

    clean: bool
    exposure_s: float | None = None
    reason: str = ""
    durable_step: int | None = None
    stuck_tiers: list[str] = field(default_factory=list)
    failures: list[dict] = field(default_factory=list)
    exit: str = ""
    unfinished: list[dict] = field(default_factory=list)


@dataclass(frozen=True)
class CheckpointRecord(LedgerRecord):
    """``checkpoint``: one tier's save of one step, agreed over the tier's ranks (the same on
    every rank); also what a :class:`~tierckpt.handle.SaveHandle` future resolves to.

    Attributes:
        tier: ``"local"`` or ``"persistent"``.
        step: training step saved (None only when read from a line without one).
        ok: every rank's part was written and committed (manifest + marker); read default True.
        error: first error message of any rank (``"OSError: [Errno 28] …"``), None when ok.
        blocking_s: slowest rank's blocking time δ of the ``save()`` call, seconds.
        wait_s: time this rank's ``save()`` waited for the tier's previous job, seconds.
        bytes: bytes written by the tier over all ranks (node leaders for local).
        background_s: slowest rank's background time of the job, seconds.
        skipped: the tier skipped this step (a hung node-local disk, ``local_wait_timeout_s``;
            or a deferral, below).
        stuck_nodes: nodes whose local save was still running when the step was skipped.
        replicas_failed: replication errors of a local step (None: every replica written).
        deferred: the tier was due while its previous save still ran on some rank and
            ``TierConfig.busy_tier_policy`` is ``"defer"``: nothing was staged or written for
            this step (``skipped`` is true too); the tier saves at a later step.
        running_step: step of the save that was still running when this one was deferred
            (None otherwise).
        interference_s: slowdown of training steps charged to this job (rank 0's scheduler;
            None elsewhere, and in schema-0 lines).
    """

    KIND: ClassVar[str] = "checkpoint"
    SCHEMA: ClassVar[int] = CHECKPOINT_SCHEMA
    UNMARKED_SCHEMA: ClassVar[int] = 0
    _READERS = {"tier": _str, "step": _count, "ok": _bool, "error": _str, "blocking_s": _seconds,
                "wait_s": _seconds, "bytes": _count, "background_s": _seconds, "skipped": _bool,
                "stuck_nodes": _list, "interference_s": _seconds, "deferred": _bool, "running_step": _count}
    _READ_DEFAULTS = {"step": None, "ok": True}
    _OMIT_FALSY = ("skipped", "stuck_nodes", "replicas_failed", "deferred")
    _OMIT_NONE = ("running_step",)

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
    deferred: bool = False
    running_step: int | None = None

    @property
    def failed(self) -> bool:
        """The save did not commit for a reason other than a deliberate skip."""
        return not self.ok and not self.skipped


@dataclass(frozen=True)
class RestoreRecord(LedgerRecord):
    """``restore``: the state was loaded (global rank 0 writes; adapters too, for a seed).

    Attributes:
        step: step restored (None only when read from a line without one).
        seconds: wall time of the whole restore.
        attempts: restore rounds (1 = no fallback needed).
        persistent_bytes: bytes read from the persistent tier by all ranks.
        bytes: bytes loaded over all nodes.
        sources: ``{node (str): {"source": own-local | peer-replica | in-cluster | persistent | seed,
            "holder": node or None, "bytes", "seconds"}}`` (older lines: ``"tier"`` for
            ``"source"``, a bare source name, or a list; see :meth:`source_kinds`).
        failures: ``[{"node", "source", "holder", "step", "error"}]`` sources that failed.
        model_only: only the model was loaded (a seed checkpoint); written only when true.
        checksummed: whether the files were verified (seed restores); written only when known.
        resharded: ``{"from": {"nodes", "world_size"}, "to": {...}}`` when the step was saved
            by a job of another shape; written only then.
        missing: chunks an in-cluster read found in no usable node-local copy, which is why it
            fell back (``"rank r: <key>: chunk offsets=… sizes=…: k of n elements in-cluster"``);
            written only when not empty.
        save_id: the save every node's state came from (:mod:`tierckpt.history.timeline`);
            written only when the copies record one.
        abandoned: ``[{"step", "save_id", "by"}]`` saves newer than the one restored, still
            committed, that a later save (``by``) proves abandoned: why the restore never tried
            them; written only when not empty.
    """

    KIND: ClassVar[str] = "restore"
    _READERS = {"step": _count, "seconds": _seconds, "attempts": _count, "persistent_bytes": _count,
                "bytes": _count, "sources": _dict_or_list, "failures": _list, "model_only": _bool,
                "checksummed": _bool, "resharded": _dict_or_list, "missing": _list, "save_id": _str,
                "abandoned": _list}
    _READ_DEFAULTS = {"step": None}
    _OMIT_FALSY = ("model_only", "resharded", "missing", "abandoned")
    _OMIT_NONE = ("checksummed", "save_id")

    step: int
    seconds: float | None = None
    attempts: int | None = None
    persistent_bytes: int | None = None
    bytes: int | None = None
    sources: dict | list | None = None
    failures: list[dict] = field(default_factory=list)
    model_only: bool = False
    checksummed: bool | None = None
    resharded: dict | list | None = None
    missing: list[str] = field(default_factory=list)
    save_id: str | None = None
    abandoned: list[dict] = field(default_factory=list)

    def source_kinds(self) -> list:
        """Each node's source kind, from the current and the older ``sources`` layouts
        (None for an entry that names none)."""
        if isinstance(self.sources, dict):
            vals = list(self.sources.values())
        else:
            vals = self.sources or []
        return [v.get("source", v.get("tier")) if isinstance(v, dict) else v for v in vals]


@dataclass(frozen=True)
class ScheduleRecord(LedgerRecord):
    """``schedule``: an interval decision of the adaptive scheduler (:mod:`tierckpt.sched.cadence`).

    Attributes:
        trigger: what asked for it: ``"start"``, ``"checkpoint"`` or ``"restart"``.
        at_step: training step of the decision (None at start).
        tier, delta, M, R, p, tau_s, tau_steps, reason, M_eff, C, step_s, tau_model_s,
            sources, delta_blocking: those of :class:`tierckpt.sched.schedule.Decision`
            (seconds; ``step_s`` > 0 or None).
    """

    KIND: ClassVar[str] = "schedule"
    _READERS = {"trigger": _str, "at_step": _count, "tier": _str, "delta": _real, "M": _real, "R": _real,
                "p": _real, "tau_s": _real, "tau_steps": _count, "reason": _str, "M_eff": _real, "C": _real,
                "step_s": _positive, "tau_model_s": _real, "sources": _dict, "delta_blocking": _real}

    trigger: str | None = None
    at_step: int | None = None
    tier: str | None = None
    delta: float | None = None
    M: float | None = None
    R: float | None = None
    p: float | None = None
    tau_s: float | None = None
    tau_steps: int | None = None
    reason: str | None = None
    M_eff: float | None = None
    C: float | None = None
    step_s: float | None = None
    tau_model_s: float | None = None
    sources: dict = field(default_factory=dict)
    delta_blocking: float | None = None

    @classmethod
    def of(cls, decision, trigger: str, at_step: int | None) -> "ScheduleRecord":
        """The record of a :class:`tierckpt.sched.schedule.Decision` (its ``as_record()``
        fields; keys this layout does not know go to ``extra``)."""
        d = decision.as_record()
        names = {f.name for f in cls._body()}
        return cls(trigger=trigger, at_step=at_step, **{k: v for k, v in d.items() if k in names},
                   extra={k: v for k, v in d.items() if k not in names})


@dataclass(frozen=True)
class RollbackRecord(LedgerRecord):
    """``rollback``: copies of saves a new timeline passed over were superseded at this run's
    first commit (:mod:`tierckpt.history.rollback`).

    Attributes:
        from_step: head of the abandoned timeline (the step of the newest save passed over).
        to_step: step rolled back to.
        trigger: ``{"tier", "step"}`` of the commit that ran it.
        superseded: the copies actually superseded (marker renamed) by every node, as they
            reported it (``persistent/<s>``, ``local node-<n>/<s>``, ``replica
            node-<src>@node-<holder>/<s>``); in a ``retry`` record, those superseded since the
            previous record. A copy this run had already replaced (it saved the same step number
            again) is not listed: it is no longer the abandoned save's.
        failed: copies whose supersede failed, each ``"<copy>: <error>"`` (written only when
            some did): retried at the next commits (a ``retry`` record names what then
            succeeded) and, when still committed, by the next start's restore (a ``rollback``
            with ``cause: "leftover"``).
        retry: true in a record of a later commit's retry of the same rollback.
        cause: ``"fallback"`` when a restore could not serve the newest save, ``"leftover"``
            when it served the newest save but found copies of an abandoned timeline still
            committed (an earlier rollback whose supersede did not complete: a node died, a rename
            failed, a root hung); not written (None) for a rollback by name.
        save_id: the save restored (:mod:`tierckpt.history.timeline`); None when it records none.
    """

    KIND: ClassVar[str] = "rollback"
    _READERS = {"from_step": _count, "to_step": _count, "trigger": _dict, "superseded": _list, "cause": _str,
                "save_id": _str, "failed": _list, "retry": _bool}
    _READ_DEFAULTS = {"from_step": None, "to_step": None, "cause": None, "save_id": None}
    _OMIT_NONE = ("save_id", "cause")
    _OMIT_FALSY = ("failed", "retry")

    from_step: int
    to_step: int
    trigger: dict = field(default_factory=dict)
    superseded: list[str] = field(default_factory=list)
    cause: str | None = None
    save_id: str | None = None
    failed: list[str] = field(default_factory=list)
    retry: bool = False


@dataclass(frozen=True)
class PreemptionRecord(LedgerRecord):
    """``preemption``: the final save of a preemption notice.

    Attributes:
        step: step saved for the requeue.
        signal: the signal's name (``"SIGTERM"``).
        committed: ``{tier: committed within preemption_grace_s}``.
        seconds: time the final save took.
        earlier_failures: ``"<tier> step <s>: <error>"`` of failed saves not raised before.
    """

    KIND: ClassVar[str] = "preemption"
    _READERS = {"step": _count, "signal": _str, "committed": _dict, "seconds": _seconds,
                "earlier_failures": _list}
    _READ_DEFAULTS = {"step": None, "signal": None}

    step: int
    signal: str
    committed: dict = field(default_factory=dict)
    seconds: float | None = None
    earlier_failures: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class RedundancyRecord(LedgerRecord):
    """``redundancy``: the replication factor of a restored step after the restore — every
    node's state held by the node and by each peer of its clique — and what was rebuilt to get
    there (in the background, right after the restore; global rank 0 writes).

    Attributes:
        step: the restored step.
        ok: every node's state of ``step`` has its F copies again (read default False).
        nodes: nodes whose state was copied to the clique peers that lacked it.
        missing: nodes whose state still lacks copies; they come back at the next local save
            (e.g. the node was served by the persistent tier, or the restore was resharded).
        seconds: time the rebuild took (0 when nothing could be copied).
        bytes: bytes received by all ranks.
        error: first failure of a copy, None when none failed.
        reason: why nothing was copied for the ``missing`` nodes; written only when set.
    """

    KIND: ClassVar[str] = "redundancy"
    _READERS = {"step": _count, "ok": _bool, "nodes": _list, "missing": _list, "seconds": _seconds,
                "bytes": _count, "error": _str, "reason": _str}
    _READ_DEFAULTS = {"step": None, "ok": False}
    _OMIT_FALSY = ("reason",)

    step: int
    ok: bool
    nodes: list[int] = field(default_factory=list)
    missing: list[int] = field(default_factory=list)
    seconds: float = 0.0
    bytes: int = 0
    error: str | None = None
    reason: str = ""


#: phases of a recovery, in the order they happen: the launcher's three, then the ranks' own
#: (:mod:`tierckpt.recovery.timeline` documents each one)
RECOVERY_PHASES = ("failure_noticed", "survivors_stopped", "launched", "processes_started", "imports_done",
                   "process_group_up", "model_built", "restore_done", "first_step_done")


@dataclass(frozen=True)
class RecoveryRecord(LedgerRecord):
    """``recovery``: the timeline of one restart, from the launcher noticing the failure to the
    first training step after the restore (:mod:`tierckpt.recovery.timeline`; global rank 0
    writes it once per run that restored, at that first step).

    Attributes:
        step: the restored step.
        cause: the launcher's cause (``"node-failure"``, ``"hang"``, ``"lost-node"``, ...);
            ``"restart"`` for a run that restored without a launcher failure (a requeue, a
            manual restart); ``"unknown"`` when ``TIERCKPT_RECOVERY`` was unreadable.
        attempt: the launcher's 0-based attempt index (None: not given).
        restart_count: the run's restart count (as ``run_start``; None when no launcher set one).
        failed_nodes: node ids of the failed attempt the launcher named.
        warm: the processes were forked from pre-imported workers (None: not said).
        replaced: ``{node id: what took it over}`` (e.g. ``"spare slot 3"``).
        origin: the phase ``phases_s`` counts from: ``"failure_noticed"``, else
            ``"processes_started"`` (the earliest rank's; a run without a launcher failure).
        phases: ``{phase: UNIX seconds or None}`` for every :data:`RECOVERY_PHASES` entry: the
            launcher's phases, then each rank-side phase's latest rank; unknown phases None.
            Clamped so that no phase precedes the one before it (see ``notes``).
        phases_s: ``{phase: seconds since origin or None}``, the same phases.
        total_s: ``first_step_done − failure_noticed``, seconds; None without a launcher
            failure (or when either phase is unknown).
        nodes: ``{node (str): {"source", "holder", "bytes", "seconds", "processes_started_s",
            "imports_done_s"}}``: the restore's source per node, its bytes and seconds, and the
            node's latest rank's process start and imports, seconds since origin.
        notes: what was clamped or unknown, and why (clock skew across hosts, a bad
            ``TIERCKPT_RECOVERY``); written only when not empty.
    """

    KIND: ClassVar[str] = "recovery"
    _READERS = {"step": _count, "cause": _str, "attempt": _count, "restart_count": _count, "failed_nodes": _list,
                "warm": _bool, "replaced": _dict, "origin": _str, "phases": _dict, "phases_s": _dict,
                "total_s": _seconds, "nodes": _dict, "notes": _list}
    _OMIT_FALSY = ("notes",)

    step: int | None = None
    cause: str = "unknown"
    attempt: int | None = None
    restart_count: int | None = None
    failed_nodes: list[int] = field(default_factory=list)
    warm: bool | None = None
    replaced: dict = field(default_factory=dict)
    origin: str = "failure_noticed"
    phases: dict = field(default_factory=dict)
    phases_s: dict = field(default_factory=dict)
    total_s: float | None = None
    nodes: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def phase_rows(self) -> list[tuple[str, float | None]]:
        """``(phase, seconds since origin or None)`` for every :data:`RECOVERY_PHASES` entry, in
        order, then any other phase the line names (a newer writer's); a value that is not a
        finite number reads as None."""
        names = list(RECOVERY_PHASES) + [p for p in self.phases_s if p not in RECOVERY_PHASES]
        return [(p, _real(self.phases_s.get(p))) for p in names]


#: record class of each known kind
KINDS: dict[str, type[LedgerRecord]] = {c.KIND: c for c in (
    RunStartRecord, RunEndRecord, CheckpointRecord, RestoreRecord, ScheduleRecord, RollbackRecord,
    PreemptionRecord, RedundancyRecord, RecoveryRecord)}


def record_from_ledger(line: dict) -> LedgerRecord:
    """The typed record of one ledger line (a :class:`GenericRecord` for an unknown kind or
    an unusable line). Never raises for a dict."""
    kind = line.get("kind")
    cls = KINDS.get(kind) if isinstance(kind, str) else None
    if cls is not None:
        try:
            return cls.from_ledger(line)
        except (ValueError, TypeError):
            pass
    return GenericRecord.from_ledger(line)


def parse_records(lines: Iterable[dict | LedgerRecord]) -> list[LedgerRecord]:
    """Typed records of ledger lines, oldest first: dicts (as
    :meth:`tierckpt.history.ledger.Ledger.read` returns them) are read by
    :func:`record_from_ledger`, records pass through, anything else (a dict without a
    ``kind``, a non-dict) is skipped."""
    out = []
    for line in lines:
        if isinstance(line, LedgerRecord):
            out.append(line)
        elif isinstance(line, dict) and isinstance(line.get("kind"), str):
            out.append(record_from_ledger(line))
    return out
