"""Append-only JSONL ledger of runs, checkpoints and restores, kept in the persistent tier.

One JSON object per line. Every record has ``kind``, ``time`` (UNIX seconds), ``run_id``
and ``job``. Kinds and their fields:

- ``run_start``: world_size, nodes, ranks_per_node, restart_count (the first set of
  TIERCKPT_RESTART_COUNT — launch/ —, SLURM_RESTART_COUNT, TORCHELASTIC_RESTART_COUNT), host,
  process_start (UNIX time rank 0's process was created; None where unknown), lineage (the
  persistent root's lineage id, :mod:`tierckpt.history.lineage`).
- ``run_end``: clean (bool), exposure_s (seconds since run_start), reason; stuck_tiers when
  close() gave up on a local save still running after ``local_wait_timeout_s``.
- ``checkpoint``: tier, step, blocking_s (max over ranks), background_s (max over ranks),
  bytes (sum over ranks), ok (bool), error, interference_s (rank 0's step slowdown while the
  background work ran, seconds; present with intervals configured). A local save skipped
  because the previous one outlived ``local_wait_timeout_s``: ok false, skipped true,
  stuck_nodes (nodes whose save was still writing or deleting), wait_s.
- ``restore``: step, sources (per node: tier and holder), bytes, seconds, attempts,
  persistent_bytes.
- ``schedule``: an interval decision of the adaptive scheduler (:mod:`tierckpt.sched.cadence`):
  trigger, at_step and the fields of :class:`tierckpt.sched.schedule.Decision`.

A run with ``run_start`` and no ``run_end`` (or ``clean: false``) ended in a failure. Only
global rank 0 writes. A torn last line (the writer died mid-append) is skipped on read and
terminated before the next append, so the ledger stays parseable across restarts.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import defaultdict

from tierckpt.io.layout import LEDGER
from tierckpt.io.storage import Store

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

    def append(self, kind: str, *, strict: bool = False, **fields) -> dict:
        """Append one record (only when enabled). Returns the record.

        Args:
            strict: raise I/O errors (the persistent tier's records and ``run_end``: the
                ledger is the record of what is durable). Otherwise they are logged.
        Raises:
            OSError: ``strict`` and the append failed.
        """
        rec = {"kind": kind, "time": time.time(), "run_id": self.run_id, "job": self.job, **fields}
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
        else:  # object stores cannot append: rewrite the object
            old = self.store.read_bytes(LEDGER) if self.store.exists(LEDGER) else b""
            if old and not old.endswith(b"\n"):
                old += b"\n"
            self.store.write_atomic(LEDGER, old + line.encode())

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
    def read(store: Store) -> list[dict]:
        """All parseable records, oldest first. Unparseable lines (a torn tail) are skipped."""
        if not store.exists(LEDGER):
            return []
        out = []
        for i, raw in enumerate(store.read_bytes(LEDGER).splitlines()):
            if not raw.strip():
                continue
            try:
                rec = json.loads(raw)
            except ValueError:
                log.warning("tierckpt ledger: skipping unparseable line %d", i + 1)
                continue
            if isinstance(rec, dict) and "kind" in rec:
                out.append(rec)
        return out


def _jsonable(o):
    if hasattr(o, "item"):
        return o.item()
    if isinstance(o, (set, tuple)):
        return list(o)
    return str(o)


def summarize(records: list[dict]) -> dict:
    """Summarise a ledger.

    Returns:
        dict with ``runs`` (list of per-run dicts: run_id, start, end, clean, exposure_s,
        checkpoints, restores), ``failures`` (runs that started and did not end cleanly,
        excluding a run still in progress only if it is the last one and ``in_progress`` is
        reported separately), ``checkpoints`` (per tier: count, ok, failed, mean blocking_s,
        mean background_s, bytes of the last), ``restores`` (list of restore records).
    """
    runs: dict[str, dict] = {}
    order: list[str] = []
    tiers: dict[str, dict] = defaultdict(lambda: {"count": 0, "ok": 0, "failed": 0, "blocking_s": [], "background_s": [], "last_bytes": 0, "last_step": None})
    restores = []
    for r in records:
        rid = r.get("run_id", "?")
        if rid not in runs:
            runs[rid] = {"run_id": rid, "start": None, "end": None, "clean": None, "exposure_s": None,
                         "checkpoints": 0, "restores": 0, "restart_count": None, "last_time": None}
            order.append(rid)
        run = runs[rid]
        run["last_time"] = r.get("time")
        k = r["kind"]
        if k == "run_start":
            run["start"] = r.get("time")
            run["restart_count"] = r.get("restart_count")
        elif k == "run_end":
            run["end"] = r.get("time")
            run["clean"] = bool(r.get("clean"))
            run["exposure_s"] = r.get("exposure_s")
        elif k == "checkpoint":
            run["checkpoints"] += 1
            t = tiers[r.get("tier", "?")]
            t["count"] += 1
            if r.get("ok", True):
                t["ok"] += 1
                t["blocking_s"].append(float(r.get("blocking_s", 0.0)))
                t["background_s"].append(float(r.get("background_s", 0.0)))
                t["last_bytes"] = int(r.get("bytes", 0))
                t["last_step"] = r.get("step")
            else:
                t["failed"] += 1
        elif k == "restore":
            run["restores"] += 1
            restores.append(r)
    run_list = [runs[i] for i in order]
    for run in run_list:
        if run["exposure_s"] is None and run["start"] is not None and run["last_time"] is not None:
            run["exposure_s"] = run["last_time"] - run["start"]
    failures = [r for r in run_list if r["start"] is not None and r["clean"] is not True]
    tier_summary = {}
    for name, t in tiers.items():
        tier_summary[name] = {
            "count": t["count"], "ok": t["ok"], "failed": t["failed"],
            "mean_blocking_s": sum(t["blocking_s"]) / len(t["blocking_s"]) if t["blocking_s"] else None,
            "mean_background_s": sum(t["background_s"]) / len(t["background_s"]) if t["background_s"] else None,
            "last_bytes": t["last_bytes"], "last_step": t["last_step"],
        }
    return {"runs": run_list, "failures": failures, "checkpoints": tier_summary, "restores": restores}
