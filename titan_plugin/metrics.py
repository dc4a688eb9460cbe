"""Exact per-step losses for torchtitan runs, as a JSON-lines file.

torchtitan prints ``step: N  loss: 7.12345 …`` with 5 decimals, on every rank, and writes
losses nowhere else unless TensorBoard/W&B is on. Comparing runs bitwise needs the exact value,
so :class:`JsonlMetricsProcessor` (a drop-in ``MetricsProcessor`` with its own ``Config``)
also appends one JSON object per logged step to ``<dump_folder>/<jsonl_file>`` on the metrics
rank (rank 0 without pipeline parallelism)::

    {"step": 7, "loss": 7.409562110900879, "loss_hex": "0x1.da3a...p+2",
     "max_loss": ..., "grad_norm": ..., "lr": ..., "ntokens_seen": ..., "pid": ..., "time": ...}

``loss`` is ``repr(float)`` (round-trips exactly); ``loss_hex`` is ``float.hex()``. The file is
opened in append mode and flushed per line, so a restarted job keeps appending to the same
file: steps re-run after a resume appear twice; the last line for a step wins
(:func:`read_losses`). ``jsonl_file = ""`` turns the file off.

:class:`TierMetrics` sends tierckpt's own numbers to torchtitan's metric logger (TensorBoard,
W&B; a no-op off the metrics rank), all under ``tierckpt/``, seconds and bytes as plain numbers:

- every save, at its step: ``tierckpt/save/blocking_s`` (δ, this rank's blocking time);
- every tier's outcome, at the first step that finds its background job finished (training
  never waits for it): ``tierckpt/save/<tier>/...`` of its :class:`~tierckpt.CheckpointRecord`
  (:func:`tierckpt.integration.record_metrics`; a tier skipped at a step is logged at that step);
- every restore, at the restored step: ``tierckpt/restore/...`` of the
  :class:`~tierckpt.RestoreResult` (:func:`tierckpt.integration.restore_metrics`; the seed load's nodes
  count as ``seed``);
- interval decisions of adaptive tiers: ``tierckpt/<tier>/{tau_steps, tau_s, delta_s, mtbf_s,
  restart_s, p}`` (:func:`tierckpt.integration.decision_metrics`).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
from torchtitan.components.metrics import MetricsProcessor, _get_metrics_rank

from tierckpt import RestoreResult, SaveHandle
from tierckpt.integration import decision_metrics, record_metrics, result_metrics

__all__ = ["JsonlMetricsProcessor", "TierMetrics", "read_losses", "read_records"]

log = logging.getLogger(__name__)


class JsonlMetricsProcessor(MetricsProcessor):
    @dataclass(kw_only=True, slots=True)
    class Config(MetricsProcessor.Config):
        jsonl_file: str = "metrics/losses.jsonl"
        """Per-step metrics file, relative to dump_folder (absolute paths kept); "" = off."""

        jsonl_all_ranks: bool = False
        """Write one file per rank (suffix .rank<N>) instead of only on the metrics rank."""

    def __init__(self, config: Config, **kwargs: Any):
        super().__init__(config, **kwargs)
        self._jsonl = None
        if not config.jsonl_file:
            return
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        metrics_rank = _get_metrics_rank(
            parallel_dims=kwargs["parallel_dims"],
            pp_schedule=kwargs.get("pp_schedule", "1F1B"),
        )
        if not config.jsonl_all_ranks and rank != metrics_rank:
            return
        path = os.path.join(kwargs.get("dump_folder", "./outputs"), config.jsonl_file)
        if config.jsonl_all_ranks:
            path = f"{path}.rank{rank}"
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.jsonl_path = path
        self._jsonl = open(path, "a", encoding="utf-8")

    def log(
        self,
        step: int,
        global_avg_loss: float,
        global_max_loss: float,
        grad_norm: float,
        extra_metrics: dict[str, Any] | None = None,
    ):
        if self._jsonl is not None:
            extra = extra_metrics or {}
            lr = next((v for k, v in extra.items() if k.startswith("lr")), None)
            rec = {
                "step": int(step),
                "loss": float(global_avg_loss),
                "loss_hex": float(global_avg_loss).hex(),
                "max_loss": float(global_max_loss),
                "grad_norm": float(grad_norm),
                "lr": None if lr is None else float(lr),
                "ntokens_seen": int(extra.get("n_tokens_seen", 0)),
                "pid": os.getpid(),
                "time": time.time(),
            }
            self._jsonl.write(json.dumps(rec) + "\n")
            self._jsonl.flush()
        super().log(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics)

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        super().close()


def read_records(path: str | os.PathLike) -> list[dict]:
    """All records in file order (a torn last line from a killed writer is skipped)."""
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out


def read_losses(path: str | os.PathLike) -> dict[int, float]:
    """step -> exact loss; for a step logged more than once (re-run after a resume) the last
    record wins."""
    return {r["step"]: float.fromhex(r["loss_hex"]) for r in read_records(path)}


class TierMetrics:
    """tierckpt's save, restore and interval numbers for torchtitan's metric logger (names in
    the module docstring), read from the engine's :class:`~tierckpt.SaveHandle`,
    :class:`~tierckpt.CheckpointRecord` and :class:`~tierckpt.RestoreResult`.

    Never blocks on a background tier: :meth:`saved` keeps the handle's futures and each
    :meth:`poll` (once per step) logs the records of those that finished. A logger error is
    logged as a warning once and never reaches training.

    Args:
        get_logger: returns the logger (``log(metrics: dict[str, float], step: int)``) or None
            while there is none; called at each log, as the trainer builds it late.
    """

    def __init__(self, get_logger: Callable[[], Any]):
        self._get_logger = get_logger
        self._pending: list[Future] = []  # tier futures not logged yet, oldest first
        self._warned = False

    def emit(self, metrics: dict[str, float], step: int) -> None:
        """Send ``metrics`` at ``step`` (nothing when empty or without a logger)."""
        if not metrics:
            return
        try:
            logger = self._get_logger()
            if logger is not None:
                logger.log(metrics, step)
        except Exception as e:  # metrics must never stop training
            if not self._warned:
                log.warning("tierckpt: could not log metrics: %s", e)
                self._warned = True

    def saved(self, handle: SaveHandle, step: int) -> None:
        """A ``save()`` returned at ``step``: log δ and the tiers it skipped now, queue the rest."""
        self.emit({"tierckpt/save/blocking_s": float(handle.blocking_s)}, step)
        for rec in handle.skipped.values():
            self.emit(record_metrics(rec), step)
        self._pending.extend(handle.futures.values())

    def poll(self, step: int) -> None:
        """Log, at ``step``, the records of queued tiers whose background job has finished."""
        done = [f for f in self._pending if f.done()]
        if not done:
            return
        # one pass: a future finishing between two done() checks must not be dropped
        self._pending = [f for f in self._pending if f not in done]
        for f in done:  # one call per record: two records of one tier must not share a dict
            if not f.cancelled() and f.exception() is None:  # (a tier's future resolves to a record)
                self.emit(record_metrics(f.result()), step)

    def restored(self, res: RestoreResult) -> None:
        """Log a restore at its restored step."""
        self.emit(result_metrics(res), res.step)

    def schedule(self, records: list[dict], step: int) -> None:
        """Log new interval decisions (ledger ``schedule`` records) at ``step``."""
        if records:
            self.emit(decision_metrics(records), step)
