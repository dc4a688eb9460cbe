"""Scalars of the engine's outcomes for a trainer's metric writers (TensorBoard, W&B, torchtitan's
metric logger). Both adapters log these names, so one dashboard reads either framework:

- ``tierckpt/save/blocking_s``: δ of one ``save()``, seconds the trainer was blocked (the adapter
  logs it from :attr:`~tierckpt.handle.SaveHandle.blocking_s`);
- ``tierckpt/save/<tier>/{step, blocking_s, wait_s, background_s, bytes, committed, skipped,
  failed}`` (:func:`record_metrics`): one tier's agreed save of one step — seconds (slowest
  rank's δ and background time, this rank's wait), bytes over all ranks, 1.0 / 0.0 flags;
- ``tierckpt/restore/{step, seconds, attempts, bytes, persistent_bytes, failures}`` and
  ``tierckpt/restore/nodes/<kind>`` (:func:`restore_metrics`): one restore — wall seconds, bytes
  read by all ranks, sources that failed and were skipped, and how many nodes each source kind
  served (own-local, peer-replica and persistent always present, 0.0 when unused).

Interval decisions have their own names (:func:`tierckpt.sched.cadence.decision_metrics`).
"""

from __future__ import annotations

from tierckpt.records import CheckpointRecord
from tierckpt.restore import CLUSTER, OWN, PERSISTENT, REPLICA, RestoreResult

SOURCE_KINDS = (OWN, REPLICA, CLUSTER, PERSISTENT)
"""Restore source kinds always reported (0.0 when unused), so each series is continuous."""


def record_metrics(rec: CheckpointRecord) -> dict[str, float]:
    """Scalars of one tier's save of one step (names in the module docstring)."""
    p = f"tierckpt/save/{rec.tier}"
    return {f"{p}/step": float(rec.step), f"{p}/blocking_s": float(rec.blocking_s),
            f"{p}/wait_s": float(rec.wait_s), f"{p}/background_s": float(rec.background_s),
            f"{p}/bytes": float(rec.bytes), f"{p}/committed": float(rec.ok),
            f"{p}/skipped": float(rec.skipped), f"{p}/failed": float(rec.failed)}


def restore_metrics(step: int, seconds: float, sources: dict[int, str], *, nbytes: int, persistent_bytes: int,
                    attempts: int = 1, failures: int = 0) -> dict[str, float]:
    """Scalars of one restore of ``step``: ``seconds`` wall time, ``sources`` {node: source kind}
    (a kind outside :data:`SOURCE_KINDS`, e.g. a seed checkpoint's ``seed``, is reported too),
    ``nbytes`` / ``persistent_bytes`` read by all ranks, ``attempts``, ``failures`` (sources
    that failed and were skipped)."""
    out = {"tierckpt/restore/step": float(step), "tierckpt/restore/seconds": float(seconds),
           "tierckpt/restore/attempts": float(attempts), "tierckpt/restore/bytes": float(nbytes),
           "tierckpt/restore/persistent_bytes": float(persistent_bytes), "tierckpt/restore/failures": float(failures)}
    for kind in SOURCE_KINDS:
        out[f"tierckpt/restore/nodes/{kind}"] = 0.0
    for kind in sources.values():
        key = f"tierckpt/restore/nodes/{kind}"
        out[key] = out.get(key, 0.0) + 1.0
    return out


def result_metrics(res: RestoreResult) -> dict[str, float]:
    """:func:`restore_metrics` of the engine's :class:`~tierckpt.restore.RestoreResult`."""
    return restore_metrics(res.step, res.seconds, {n: o.source.kind for n, o in res.sources.items()},
                           nbytes=sum(o.bytes for o in res.sources.values()),
                           persistent_bytes=res.persistent_bytes_read, attempts=res.attempts,
                           failures=len(res.failures))
