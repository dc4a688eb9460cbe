"""The recovery timeline: every restart's phases, from the launcher noticing a failure to the
first training step after the restore, in one ``recovery`` ledger record
(:class:`tierckpt.records.RecoveryRecord`).

Contract with the launchers
---------------------------
A launcher (``launch/local.py``; the Slurm scripts and warm node agents alike) sets two
environment variables for the processes of an attempt; every time is UNIX seconds
(:func:`tierckpt.clock.now` of the launcher's host: the wall clock read once, then the host's
monotonic clock, shared with the ranks the launcher starts):

- ``TIERCKPT_PROCESS_STARTED``: when the launcher created this rank's process (fork or exec).
  Unset, or not a finite positive number (a warning naming the variable): the process's
  creation time from ``/proc/self/stat`` is used. ``launch/local.py`` leaves it unset: its
  ranks are created by torchrun, so ``/proc`` has the true time.
- ``TIERCKPT_RECOVERY``: set only for an attempt that follows a failed one, a JSON object::

      {"attempt": 1,                  # 0-based attempt index in the launcher
       "cause": "node-failure",       # or "hang", "lost-node", ...
       "failed_nodes": [1],           # node ids of the failed attempt
       "failure_noticed": 1.7e9,      # the launcher saw the failure
       "survivors_stopped": 1.7e9,    # every process of the failed attempt gone
       "launched": 1.7e9,             # the new attempt's processes were asked to start
       "warm": false,                 # processes forked from pre-imported workers
       "replaced": {"1": "spare slot 3"}}   # optional: what took over a node id

  Not JSON, or not an object: a warning naming the variable, the cause ``"unknown"`` and the
  launcher's phases unknown. A field of the wrong type (a time that is not a finite positive
  number, an attempt that is not an integer ≥ 0, ...): a warning naming the variable and the
  field, that field unknown. Nothing here raises.

Rank-side phases
----------------
Each is stamped once per process (the first stamp wins; a forked child starts with none),
on the process's monotonic clock mapped to UNIX seconds, so the durations inside one process
do not move with the wall clock:

- ``processes_started``: ``TIERCKPT_PROCESS_STARTED``, else ``/proc/self/stat``;
- ``imports_done``: the trainer's imports finished (torchtitan: ``titan_plugin.train.run``
  before ``config.build()``; Megatron-LM: the plugin's ``pretrain`` hook, after the script's
  imports) — :func:`mark_phase`;
- ``process_group_up``: ``torch.distributed.init_process_group`` returned
  (:func:`install_process_group_hook`, installed by both adapters' entry points before any
  process group exists; a direct engine user calls it, or :func:`mark_phase`);
- ``model_built``: model, optimizer and data loader exist (torchtitan: the checkpoint
  manager's ``__init__``; Megatron: the start of the plugin's load) — :func:`mark_phase`;
- ``restore_done``: the engine's ``restore()`` ended (:class:`tierckpt.restore.resume.Resume`);
- ``first_step_done``: the first ``observe_step`` after that restore (both adapters call it
  after every training step, on every rank, at the same steps).

The last two belong to the engine's run (:class:`RecoveryTimeline`), the others to the process.

The record
----------
At the first ``observe_step`` after a restore that loaded a step, every rank's stamps are
gathered over the engine's control group (one :func:`~tierckpt.cluster.collectives.gather_reduced`
of a small summary: O(N) between node leaders with a tree, one ``all_gather`` without) and
global rank 0 appends a ``recovery`` record: the launcher's phases (``failure_noticed`` the
earliest rank's, ``survivors_stopped`` and ``launched`` the latest's), each rank-side phase of
the latest rank, ``phases_s`` as seconds since ``failure_noticed`` (since the earliest
``processes_started`` when no ``TIERCKPT_RECOVERY`` was set: cause ``"restart"``, a requeue or
a manual restart), ``total_s`` = first_step_done − failure_noticed, the restore's source and
bytes per node with the node's process start and imports. Clocks of different hosts disagree:
a phase earlier than the one before it is clamped to it, and one more than
:data:`MAX_PLAUSIBLE_S` from the origin is left unknown; ``notes`` says which and by how much,
instead of a negative duration in the record.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Mapping

from tierckpt import clock
from tierckpt.cluster.collectives import gather_reduced
from tierckpt.recovery import beacon
from tierckpt.history.journal import process_start_time, restart_count
from tierckpt.records import RECOVERY_PHASES, RecoveryRecord

if TYPE_CHECKING:
    from tierckpt.cluster.topology import Topology
    from tierckpt.history.ledger import Ledger
    from tierckpt.restore.restorer import RestoreResult

__all__ = ["LAUNCHER_PHASES", "MAX_PLAUSIBLE_S", "PHASES", "PROCESS_STARTED_ENV", "RANK_PHASES", "RECOVERY_ENV",
           "LauncherRecovery", "RecoveryTimeline", "build_record", "install_process_group_hook",
           "launcher_recovery", "mark_phase", "merge_summaries", "phase_stamps", "process_started",
           "rank_summary"]

log = logging.getLogger(__name__)

PROCESS_STARTED_ENV = "TIERCKPT_PROCESS_STARTED"
RECOVERY_ENV = "TIERCKPT_RECOVERY"
PHASES = RECOVERY_PHASES
LAUNCHER_PHASES = PHASES[:3]
RANK_PHASES = PHASES[3:]
_PROCESS_PHASES = ("imports_done", "process_group_up", "model_built")  # what mark_phase stamps
_RUN_PHASES = ("restore_done", "first_step_done")  # the engine's run stamps these itself

MAX_PLAUSIBLE_S = 86400.0
"""A phase more than this many seconds from the record's origin (either way) is left unknown:
a stale ``TIERCKPT_RECOVERY`` or a host clock far off, not a recovery."""

SKEW_NOTE_S = 1e-3
"""A phase clamped by more than this (seconds) is named in the record's ``notes``."""

MAX_NOTES = 20


# -- process-wide stamps -----------------------------------------------------------------------
_stamps: dict[str, float] = {}


def _after_fork() -> None:
    """A forked child (a warm worker's attempt) is a new process: its own stamps."""
    _stamps.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)


def wall_of(monotonic_s: float) -> float:
    """UNIX seconds (:func:`tierckpt.clock.now`'s clock, shared by the launcher and the ranks of
    a host) of a ``time.monotonic()`` reading of this process: differences between stamps are
    monotonic durations."""
    return clock.wall_of(monotonic_s)


def mark_phase(phase: str, at: float | None = None) -> float:
    """Stamp ``phase`` for this process once; a later call keeps the first stamp.

    Args:
        phase: ``"imports_done"``, ``"process_group_up"`` or ``"model_built"`` (the process's
            phases; ``processes_started`` comes from the launcher or ``/proc``, the restore's
            and the first step's from the engine).
        at: UNIX seconds (default: now, on the monotonic clock mapped to UNIX seconds).
    Returns:
        the phase's stamp, UNIX seconds (the first one).
    Raises:
        ValueError: ``phase`` is not one of those three.
    """
    if phase not in _PROCESS_PHASES:
        raise ValueError(f"mark_phase: unknown phase {phase!r}; allowed: {', '.join(_PROCESS_PHASES)}")
    return _stamps.setdefault(phase, wall_of(time.monotonic()) if at is None else float(at))


def _finite_positive(v) -> float | None:
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0
    return float(v) if ok else None


def process_started(environ: Mapping[str, str] | None = None) -> tuple[float | None, list[str]]:
    """When this process was created: ``TIERCKPT_PROCESS_STARTED``, else ``/proc/self/stat``.

    Args:
        environ: the environment (default ``os.environ``).
    Returns:
        (UNIX seconds or None where neither is known, notes: a bad variable is named there and
        logged as a warning).
    """
    env = os.environ if environ is None else environ
    raw = env.get(PROCESS_STARTED_ENV)
    notes: list[str] = []
    if raw is not None and raw.strip():
        try:
            t = _finite_positive(float(raw))
        except ValueError:
            t = None
        if t is not None:
            return t, notes
        notes.append(f"{PROCESS_STARTED_ENV}={raw!r} is not UNIX seconds: the process's creation time is used")
        log.warning("tierckpt: %s", notes[-1])
    return process_start_time(), notes


def phase_stamps(environ: Mapping[str, str] | None = None) -> tuple[dict[str, float], list[str]]:
    """This process's stamps: ``processes_started`` (:func:`process_started`) and the phases
    :func:`mark_phase` stamped; (``{phase: UNIX s}``, notes)."""
    t, notes = process_started(environ)
    out = dict(_stamps)
    if t is not None:
        out["processes_started"] = t
    return out, notes


def install_process_group_hook() -> bool:
    """Wrap ``torch.distributed.init_process_group`` (once per process) so that its return
    stamps ``process_group_up``; works for any framework that calls it through the module
    (torchtitan, Megatron-LM). Call it before the trainer creates its process group.

    Returns:
        True when this call installed the wrapper, False when it was installed already.
    """
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    orig = dist.init_process_group
    if getattr(orig, "_tierckpt_stamps", False):
        return False

    @functools.wraps(orig)
    def init_process_group(*args, **kwargs):
        out = orig(*args, **kwargs)
        mark_phase("process_group_up")
        return out

    init_process_group._tierckpt_stamps = True  # type: ignore[attr-defined]
    dist.init_process_group = init_process_group
    if c10d.init_process_group is orig:
        c10d.init_process_group = init_process_group
    return True


# -- the launcher's part -----------------------------------------------------------------------
@dataclass(frozen=True)
class LauncherRecovery:
    """``TIERCKPT_RECOVERY`` as read (:func:`launcher_recovery`); None fields are unknown.

    Attributes:
        attempt: 0-based attempt index in the launcher.
        cause: why the previous attempt ended (``"unknown"`` when unreadable).
        failed_nodes: node ids of the failed attempt.
        failure_noticed, survivors_stopped, launched: UNIX seconds (module docstring).
        warm: processes forked from pre-imported workers.
        replaced: ``{node id: what took it over}``.
        notes: what could not be read, naming the variable (each also logged as a warning).
    """

    attempt: int | None = None
    cause: str = "unknown"
    failed_nodes: tuple[int, ...] = ()
    failure_noticed: float | None = None
    survivors_stopped: float | None = None
    launched: float | None = None
    warm: bool | None = None
    replaced: dict = field(default_factory=dict)
    notes: tuple[str, ...] = ()


def _bad(notes: list[str], key: str, value, want: str) -> None:
    notes.append(f"{RECOVERY_ENV}: {key}={value!r} is not {want}: unknown")


def _nonneg_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def launcher_recovery(environ: Mapping[str, str] | None = None) -> LauncherRecovery | None:
    """The launcher's account of the failure this attempt recovers from (``TIERCKPT_RECOVERY``).

    Args:
        environ: the environment (default ``os.environ``).
    Returns:
        None when the variable is unset or empty (no failure: a first attempt, a requeue);
        otherwise the fields that could be read, the rest unknown with a note each (and a
        warning naming the variable). Never raises.
    """
    env = os.environ if environ is None else environ
    raw = env.get(RECOVERY_ENV)
    if raw is None or not raw.strip():
        return None
    notes: list[str] = []
    try:
        doc = json.loads(raw)
    except ValueError as e:
        doc, why = None, f"not JSON ({e})"
    else:
        why = f"not a JSON object ({type(doc).__name__})"
    if not isinstance(doc, dict):
        notes.append(f"{RECOVERY_ENV} is {why}: the cause and the launcher's phases are unknown")
        log.warning("tierckpt: %s", notes[-1])
        return LauncherRecovery(notes=tuple(notes))
    kw: dict = {}
    if "attempt" in doc:
        if _nonneg_int(doc["attempt"]):
            kw["attempt"] = doc["attempt"]
        else:
            _bad(notes, "attempt", doc["attempt"], "an integer >= 0")
    cause = doc.get("cause")
    if isinstance(cause, str) and cause.strip():
        kw["cause"] = cause.strip()
    else:
        _bad(notes, "cause", cause, "a non-empty string")
    nodes = doc.get("failed_nodes", [])
    if isinstance(nodes, list) and all(_nonneg_int(n) for n in nodes):
        kw["failed_nodes"] = tuple(nodes)
    else:
        _bad(notes, "failed_nodes", nodes, "a list of node ids")
    for key in LAUNCHER_PHASES:
        t = _finite_positive(doc.get(key))
        if t is not None:
            kw[key] = t
        else:
            _bad(notes, key, doc.get(key), "UNIX seconds")
    if "warm" in doc:
        if isinstance(doc["warm"], bool):
            kw["warm"] = doc["warm"]
        else:
            _bad(notes, "warm", doc["warm"], "true or false")
    replaced = doc.get("replaced", {})
    if isinstance(replaced, dict) and all(isinstance(v, str) for v in replaced.values()):
        kw["replaced"] = {str(k): v for k, v in replaced.items()}
    else:
        _bad(notes, "replaced", replaced, "an object of strings")
    for n in notes:
        log.warning("tierckpt: %s", n)
    return LauncherRecovery(**kw, notes=tuple(notes))


# -- gathering the ranks' stamps -----------------------------------------------------------------
def rank_summary(rank: int, node: int, stamps: Mapping[str, float], launcher: LauncherRecovery | None,
                 notes: list[str] | tuple[str, ...] = ()) -> dict:
    """One rank's part of the gather (a small dict; :func:`merge_summaries` combines them).

    Args:
        rank: global rank.
        node: its node id.
        stamps: ``{phase: UNIX s}`` of its rank-side phases (:data:`RANK_PHASES`).
        launcher: its ``TIERCKPT_RECOVERY`` (None: unset).
        notes: its notes (a bad variable).
    """
    info = None
    if launcher is not None:
        info = [rank, {"attempt": launcher.attempt, "cause": launcher.cause,
                       "failed_nodes": list(launcher.failed_nodes), "warm": launcher.warm,
                       "replaced": dict(launcher.replaced)}]
    times = {} if launcher is None else {k: getattr(launcher, k) for k in LAUNCHER_PHASES
                                         if getattr(launcher, k) is not None}
    return {"phases": {p: float(t) for p, t in stamps.items() if p in RANK_PHASES},
            "first_start": stamps.get("processes_started"),
            "launcher": times,
            "info": info,
            "nodes": {node: {k: stamps[k] for k in ("processes_started", "imports_done") if k in stamps}},
            "notes": sorted(set(notes) | set(launcher.notes if launcher is not None else ()))[:MAX_NOTES],
            "recovering": launcher is not None}


def _fold(values, fn):
    vals = [v for v in values if v is not None]
    return fn(vals) if vals else None


def merge_summaries(parts: list[dict]) -> dict:
    """A ``reduce`` for :func:`~tierckpt.cluster.collectives.gather_reduced` over
    :func:`rank_summary` dicts (and its own outputs): rank-side phases and each node's stamps
    the latest, ``first_start`` the earliest, ``failure_noticed`` the earliest and the other
    launcher phases the latest, the launcher's fields of the lowest rank that has them, notes
    united (the first :data:`MAX_NOTES`, sorted)."""
    phases: dict[str, float] = {}
    nodes: dict = {}
    launcher: dict[str, float] = {}
    for part in parts:
        for p, t in part["phases"].items():
            phases[p] = max(phases.get(p, t), t)
        for n, d in part["nodes"].items():
            mine = nodes.setdefault(n, {})
            for k, t in d.items():
                mine[k] = max(mine.get(k, t), t)
        for k, t in part["launcher"].items():
            launcher[k] = (min if k == "failure_noticed" else max)(launcher.get(k, t), t)
    infos = [p["info"] for p in parts if p["info"] is not None]
    return {"phases": phases,
            "first_start": _fold((p["first_start"] for p in parts), min),
            "launcher": launcher,
            "info": min(infos, key=lambda i: i[0]) if infos else None,
            "nodes": nodes,
            "notes": sorted(set().union(*(p["notes"] for p in parts)))[:MAX_NOTES],
            "recovering": any(p["recovering"] for p in parts)}


# -- the record ----------------------------------------------------------------------------------
def _ordered(raw: dict[str, float | None], origin: float, notes: list[str]) -> dict[str, float | None]:
    """``raw`` phases (UNIX s) in :data:`PHASES` order, each clamped to the one before it and
    left unknown beyond :data:`MAX_PLAUSIBLE_S` from ``origin``; what changed goes to ``notes``."""
    out: dict[str, float | None] = {}
    prev, prev_name = origin, None
    for p in PHASES:
        t = raw.get(p)
        if t is not None and abs(t - origin) > MAX_PLAUSIBLE_S:
            notes.append(f"{p} is {t - origin:+.0f} s from the origin: implausible, left unknown")
            t = None
        if t is not None and t < prev:
            if prev - t > SKEW_NOTE_S:
                notes.append(f"{p} was {prev - t:.3f} s before {prev_name} (clock skew across hosts, or processes "
                             f"kept from before the failure): clamped to it")
            t = prev
        out[p] = t
        if t is not None:
            prev, prev_name = t, p
    return out


def _r(x: float | None, nd: int = 3) -> float | None:
    return None if x is None else round(x, nd)


def _node_rows(merged: dict, sources: Mapping[int, object], origin: float, floor_s: float,
               notes: list[str]) -> dict[str, dict]:
    """Per node: the restore's source (``sources``: node → NodeOutcome-like) and the node's
    stamps as seconds since ``origin``, clamped to ``floor_s`` and to each other."""
    rows: dict[str, dict] = {}
    for n in sorted(set(sources) | set(merged["nodes"])):
        o = sources.get(n)
        src = getattr(o, "source", None)
        row: dict = {"source": getattr(src, "kind", None), "holder": getattr(src, "holder", None),
                     "bytes": getattr(o, "bytes", None), "seconds": _r(getattr(o, "seconds", None))}
        lo = floor_s
        for k in ("processes_started", "imports_done"):
            t = merged["nodes"].get(n, {}).get(k)
            s = None if t is None else t - origin
            if s is not None and abs(s) > MAX_PLAUSIBLE_S:
                s = None
            if s is not None and s < lo:
                if lo - s > SKEW_NOTE_S:
                    notes.append(f"node {n}: {k} was {lo - s:.3f} s early (clock skew?): clamped")
                s = lo
            row[f"{k}_s"] = _r(s)
            lo = s if s is not None else lo
        rows[str(n)] = row
    return rows


def build_record(merged: dict, result: RestoreResult | None, restart: int | None = None) -> RecoveryRecord:
    """The ``recovery`` record of a merged gather (:func:`merge_summaries`) and the restore's
    result (its ``step`` and per-node ``sources``; None: only the phases).

    Args:
        merged: the gather's result.
        result: the :class:`~tierckpt.restore.RestoreResult` the phases end with.
        restart: the run's restart count (``run_start``'s).
    Returns:
        the record (see :class:`tierckpt.records.RecoveryRecord`); never raises for a
        well-formed ``merged``.
    """
    info = merged["info"][1] if merged["info"] is not None else {}
    notes: list[str] = list(merged["notes"])
    raw: dict[str, float | None] = {k: merged["launcher"].get(k) for k in LAUNCHER_PHASES}
    raw.update({k: merged["phases"].get(k) for k in RANK_PHASES})
    if raw["failure_noticed"] is not None:
        origin_name, origin = "failure_noticed", raw["failure_noticed"]
    else:
        origin_name = "processes_started"
        origin = merged["first_start"] if merged["first_start"] is not None else \
            _fold((raw[p] for p in RANK_PHASES), min)
    if origin is None:  # nothing known at all
        return RecoveryRecord(step=getattr(result, "step", None), cause=info.get("cause", "restart"),
                              restart_count=restart, phases={p: None for p in PHASES},
                              phases_s={p: None for p in PHASES}, notes=notes + ["no phase is known"])
    phases = _ordered(raw, origin, notes)
    phases_s = {p: None if t is None else _r(t - origin) for p, t in phases.items()}
    total = None
    if origin_name == "failure_noticed" and phases["first_step_done"] is not None:
        total = phases_s["first_step_done"]
    floor = phases_s.get("launched") or 0.0
    nodes = _node_rows(merged, getattr(result, "sources", None) or {}, origin, floor, notes)
    return RecoveryRecord(
        step=getattr(result, "step", None),
        cause=info.get("cause", "unknown") if merged["recovering"] else "restart",
        attempt=info.get("attempt"), restart_count=restart, failed_nodes=list(info.get("failed_nodes", [])),
        warm=info.get("warm"), replaced=dict(info.get("replaced", {})), origin=origin_name,
        phases={p: _r(t, 6) for p, t in phases.items()}, phases_s=phases_s, total_s=total, nodes=nodes,
        notes=list(dict.fromkeys(notes))[:MAX_NOTES])


# -- the engine's part ---------------------------------------------------------------------------
class RecoveryTimeline:
    """One engine run's recovery record: :meth:`step_done` at every ``observe_step``.

    Args:
        topo: the run's topology (rank, node).
        groups: the engine's groups; their ``control`` group (every rank; the trainer's thread
            only) is read at the gather, never kept: ``close()`` destroys it and its gloo threads
            join only once no reference is left (:func:`tierckpt.cluster.topology.release_groups`).
            None: no gather (tests).
        ledger: the run's ledger (global rank 0 writes).

    Attributes:
        record: the :class:`~tierckpt.records.RecoveryRecord` once written (on every rank;
            None before, and in a run that did not restore).
        steps: training steps ended in this run (reported to a node agent's beacon,
            :func:`tierckpt.recovery.beacon.report_progress`, for its stall detection).
    """

    def __init__(self, topo: Topology, groups, ledger: Ledger):
        self.topo, self.groups, self.ledger = topo, groups, ledger
        self.record: RecoveryRecord | None = None
        self.steps = 0
        self._done = False

    def step_done(self, resume) -> RecoveryRecord | None:
        """A training step ended. The first call after a restore that loaded a step
        (``resume.last_result``, ended at ``resume.restored_mono``, a ``time.monotonic()``
        reading) is collective over the control group — every rank calls it at the same
        steps — and writes the record; every other call returns at once.

        Returns:
            the record when this call wrote it, else None. A failure to gather or write is a
            warning, never raised (the trainer's own collectives report a lost peer).
        """
        self.steps += 1
        beacon.report_progress(self.steps)  # a node agent's stall detection counts steps too
        jobs = getattr(resume, "jobs", None)
        if jobs is not None:
            jobs.release_rebuild()  # the first step is done: the restore's replica rebuild may run
        res = getattr(resume, "last_result", None)
        if self._done or res is None:
            return None
        self._done = True
        first_step = wall_of(time.monotonic())
        try:
            stamps, notes = phase_stamps()
            stamps["restore_done"] = wall_of(resume.restored_mono)
            stamps["first_step_done"] = first_step
            mine = rank_summary(self.topo.rank, self.topo.node, stamps, launcher_recovery(), notes)
            merged = gather_reduced(mine, None if self.groups is None else self.groups.control, merge_summaries)
            rec = build_record(merged, res, restart_count())
            self.ledger.append(rec)
        except Exception as e:  # noqa: BLE001 - a measurement must not end training
            log.warning("tierckpt: the recovery record was not written: %s: %s", type(e).__name__, e)
            return None
        self.record = rec
        if self.topo.rank == 0:
            log.info("tierckpt: recovery (%s) of step %s: %s", rec.cause, rec.step, ", ".join(
                f"{p} {s:.2f} s" for p, s in rec.phase_rows() if s is not None))
        return rec
