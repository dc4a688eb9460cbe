"""Append-only JSONL ledger of runs, checkpoints and restores, kept in the persistent tier.

One JSON object per line: ``kind``, ``time`` (UNIX seconds), ``run_id``, ``job``, then the
fields of the record; the kinds, their fields and the schema rules are those of
:mod:`tierckpt.records` (one dataclass per kind). :meth:`Ledger.append` is the one writer,
:meth:`Ledger.read_records` the one typed reader.

A run with ``run_start`` and no ``run_end`` (or ``clean: false``) ended in a failure. Only
global rank 0 writes. A torn last line (the writer died mid-append) is skipped on read and
terminated before the next append, so the ledger stays parseable across restarts.

On a local path the ledger is one file, appended in place (``tierckpt-ledger.jsonl``). An object
store cannot append: rewriting the object at every append would cost O(ledger) bytes per record
and grow with the run. There each record is its own object,
``tierckpt-ledger.d/<seq>-<run_id>-<rand>.json`` (one PUT of the record's bytes; ``seq`` is one
more than the highest the writer found when it first appended, so names sort in append order,
and the random part keeps two writers from overwriting each other). The reader takes the file
first (a ledger written before this layout, or on a path), then the objects in ``seq`` order, with
the same tolerance: an object that does not parse is skipped with a warning.
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import threading
from collections import defaultdict
from typing import Iterable

from tierckpt import clock
from tierckpt.io.layout import LEDGER, LEDGER_DIR
from tierckpt.io.storage import Store
from tierckpt.records import (CheckpointRecord, LedgerRecord, RecoveryRecord, RestoreRecord, RunEndRecord, RunStartRecord,
                              parse_records)

log = logging.getLogger(__name__)


class Ledger:
    """Writer/reader of ``<persistent_root>/tierckpt-ledger.jsonl``.

    Args:
        store: the persistent tier's :class:`Store`.
        enabled: whether this process writes (global rank 0); others only read.
        run_id: identifies this run (one process-group lifetime) in every record.
        job: the job id (same across restarts of one job).
    """

    def __init__(self, store: Store, *, enabled: bool, run_id: str, job: str):
        self.store = store
        self.enabled = enabled
        self.run_id = run_id
        self.job = job
        self._lock = threading.Lock()
        # records() mirror: the file as read once, then this process's own appends (the only
        # writer of this job's ledger), so the scheduler need not re-read a growing file
        self._base: list[dict] | None = None
        self._appended: list[dict] = []
        self._seq: int | None = None  # object stores: the next record's sequence number

    def append(self, record: LedgerRecord, *, strict: bool = False) -> dict:
        """Append one record (only when enabled), stamped with this writer's time, run and job
        (the record's own envelope is ignored).

        Args:
            record: any :class:`~tierckpt.records.LedgerRecord`; its line is
                :meth:`~tierckpt.records.LedgerRecord.as_ledger` after the envelope.
            strict: raise I/O errors (the persistent tier's records and ``run_end``: the
                ledger is the record of what is durable). Otherwise they are logged.
        Returns:
            the line as a dict (``kind``, ``time``, ``run_id``, ``job``, fields), also when
            not enabled.
        Raises:
            TypeError: ``record`` is not a ledger record.
            OSError: ``strict`` and the append failed.
        """
        if not isinstance(record, LedgerRecord):
            raise TypeError(f"Ledger.append takes a tierckpt.records.LedgerRecord, got {type(record).__name__}")
        rec = {"kind": record.kind, "time": clock.now(), "run_id": self.run_id, "job": self.job,
               **record.as_ledger()}
        if not self.enabled:
            return rec
        line = json.dumps(rec, default=_jsonable) + "\n"
        with self._lock:
            if self._base is not None:  # records() in use: mirror, as a reader of the file would see it
                self._appended.append(json.loads(line))
            try:
                self._append_line(line)
            except OSError as e:
                if strict:
                    raise
                log.warning("tierckpt ledger: could not append to %s: %s", self.store.url_of(LEDGER), e)
        return rec

    def _append_line(self, line: str) -> None:
        if self.store.local:
            path = self.store.path(LEDGER)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "a+b") as f:
                f.seek(0, os.SEEK_END)
                if f.tell() > 0:
                    f.seek(-1, os.SEEK_END)
                    if f.read(1) != b"\n":  # previous writer died mid-line
                        f.write(b"\n")
                f.write(line.encode())
                f.flush()
                os.fsync(f.fileno())
        else:  # object stores cannot append: one object per record, O(record) bytes
            if self._seq is None:
                self._seq = 1 + max((seq for seq, _ in _record_names(self.store)), default=-1)
            name = f"{LEDGER_DIR}/{self._seq:012d}-{self.run_id}-{secrets.token_hex(4)}.json"
            self.store.write_atomic(name, line.encode())
            self._seq += 1

    def records(self) -> list[dict]:
        """Every record of the ledger, oldest first, as :meth:`read` would return them: the
        file is read on the first call only; later calls add this writer's own appends (the
        job's only writer is global rank 0, where this is used), including any whose write
        failed. Raises what :meth:`read` raises."""
        with self._lock:
            if self._base is None:
                self._base, self._appended = Ledger.read(self.store), []
            return self._base + self._appended

    @staticmethod
    def read_records(store: Store) -> list[LedgerRecord]:
        """Every record of the ledger, typed, oldest first (:func:`tierckpt.records.parse_records`
        of :meth:`read`: unknown kinds kept as :class:`~tierckpt.records.GenericRecord`).
        Raises what :meth:`read` raises."""
        return parse_records(Ledger.read(store))

    @staticmethod
    def exists(store: Store) -> bool:
        """Whether ``store`` holds a ledger (the file, or at least one record object)."""
        return store.exists(LEDGER) or bool(_record_names(store))

    @staticmethod
    def read(store: Store) -> list[dict]:
        """All parseable records as dicts, oldest first: the lines of the file, then the record
        objects in sequence order (module docstring). Unparseable lines (a torn tail) and
        objects, and JSON values without ``kind``, are skipped.

        Raises:
            OSError: the ledger exists but cannot be read.
        """
        out: list[dict] = []
        if store.exists(LEDGER):
            _parse_into(out, store.read_bytes(LEDGER).splitlines(), "line")
        names = [f"{LEDGER_DIR}/{name}" for _, name in _record_names(store)]
        if names:
            blobs = store.read_many(names)
            _parse_into(out, [blobs[n] for n in names if n in blobs], "record object")
        return out


_RECORD_RE = re.compile(r"^(\d+)-[^/]*\.json$")


def _record_names(store: Store) -> list[tuple[int, str]]:
    """``(seq, name)`` of the record objects under ``LEDGER_DIR``, in append order."""
    found = ((_RECORD_RE.match(n), n) for n in store.listdir(LEDGER_DIR))
    return sorted((int(m.group(1)), n) for m, n in found if m)


def _parse_into(out: list[dict], raws: list[bytes], what: str) -> None:
    for i, raw in enumerate(raws):
        if not raw.strip():
            continue
        try:
            rec = json.loads(raw)
        except ValueError:
            log.warning("tierckpt ledger: skipping unparseable %s %d", what, i + 1)
            continue
        if isinstance(rec, dict) and "kind" in rec:
            out.append(rec)


def _jsonable(o):
    if hasattr(o, "item"):
        return o.item()
    if isinstance(o, (set, tuple)):
        return list(o)
    return str(o)


def summarize(records: Iterable[dict | LedgerRecord]) -> dict:
    """Summarise a ledger.

    Args:
        records: lines as :meth:`Ledger.read` returns them, or typed records, oldest first.
    Returns:
        JSON-ready dict with ``runs`` (per run: run_id, start, end (UNIX s), clean,
        exposure_s, checkpoints, restores, restart_count, last_time), ``failures`` (runs that
        started and did not end cleanly, the one in progress included), ``checkpoints`` (per
        tier: count, ok, failed (skipped included), deferred (``busy_tier_policy``), mean_blocking_s, mean_background_s (seconds, None without a
        committed step), last_bytes, last_step of the newest committed step), ``restores``
        (the ``restore`` lines, :meth:`~tierckpt.records.LedgerRecord.as_line`), ``recoveries``
        (the ``recovery`` lines: each restart's phases, :class:`~tierckpt.records.RecoveryRecord`).
    """
    runs: dict[str, dict] = {}
    tiers: dict[str, dict] = defaultdict(lambda: {"count": 0, "ok": 0, "failed": 0, "deferred": 0, "blocking_s": [],
                                                  "background_s": [], "last_bytes": 0, "last_step": None})
    restores, recoveries = [], []
    for r in parse_records(records):
        rid = "?" if r.run_id is None else r.run_id
        run = runs.setdefault(rid, {"run_id": rid, "start": None, "end": None, "clean": None, "exposure_s": None,
                                    "checkpoints": 0, "restores": 0, "restart_count": None, "last_time": None})
        run["last_time"] = r.time
        if isinstance(r, RunStartRecord):
            run["start"], run["restart_count"] = r.time, r.restart_count
        elif isinstance(r, RunEndRecord):
            run["end"], run["clean"], run["exposure_s"] = r.time, r.clean, r.exposure_s
        elif isinstance(r, CheckpointRecord):
            run["checkpoints"] += 1
            _count_checkpoint(tiers[r.tier], r)
        elif isinstance(r, RestoreRecord):
            run["restores"] += 1
            restores.append(r.as_line())
        elif isinstance(r, RecoveryRecord):
            recoveries.append(r.as_line())
    run_list = list(runs.values())
    for run in run_list:
        if run["exposure_s"] is None and run["start"] is not None and run["last_time"] is not None:
            run["exposure_s"] = run["last_time"] - run["start"]
    failures = [r for r in run_list if r["start"] is not None and r["clean"] is not True]
    return {"runs": run_list, "failures": failures, "checkpoints": {name: _tier_summary(t) for name, t in tiers.items()},
            "restores": restores, "recoveries": recoveries}


def _count_checkpoint(t: dict, r: CheckpointRecord) -> None:
    t["count"] += 1
    if r.ok:
        t["ok"] += 1
        t["blocking_s"].append(r.blocking_s)
        t["background_s"].append(r.background_s)
        t["last_bytes"], t["last_step"] = r.bytes, r.step
    elif r.deferred:  # not made because the tier's previous save still ran: no failure
        t["deferred"] += 1
    else:
        t["failed"] += 1


def _tier_summary(t: dict) -> dict:
    def mean(xs):
        return sum(xs) / len(xs) if xs else None

    return {"count": t["count"], "ok": t["ok"], "failed": t["failed"], "deferred": t["deferred"],
            "mean_blocking_s": mean(t["blocking_s"]),
            "mean_background_s": mean(t["background_s"]), "last_bytes": t["last_bytes"], "last_step": t["last_step"]}
