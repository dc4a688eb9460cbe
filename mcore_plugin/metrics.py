"""Save and restore metrics of the tiers, for Megatron-LM's TensorBoard and W&B writers.

:class:`TierMetrics` collects what :class:`mcore_plugin.tiers.MegatronTiers` did; the
training-loop hook (:mod:`mcore_plugin.install`) calls :meth:`TierMetrics.drain` after each
iteration and :func:`write` hands the result to ``get_tensorboard_writer()`` /
``get_wandb_writer()`` (they exist on the last rank only; the records are agreed, so every
rank holds the same values). Draining never blocks: a tier's record is written once its
future resolved, at the iteration of the drain that saw it (W&B refuses steps older than its
current one; ``…/step`` names the step the record is about).

Names: the scalars both adapters log (:mod:`tierckpt.metrics`: ``tierckpt/save/blocking_s``,
``tierckpt/save/<tier>/...``, ``tierckpt/restore/...``), plus ``tierckpt/restore/sources`` (text:
each node's source).
"""

from __future__ import annotations

import logging
import threading

from tierckpt.integration import record_metrics, result_metrics

log = logging.getLogger(__name__)

class TierMetrics:
    """Saves and restores whose metrics are not written yet (thread-safe)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._new = []  # SaveHandles whose δ is not written yet
        self._open = []  # (SaveHandle, tiers whose record is not written yet)
        self._restores = []

    def saved(self, handle) -> None:
        """Record a :class:`tierckpt.SaveHandle` (δ now, each tier's record once resolved)."""
        with self._lock:
            self._new.append(handle)
            self._open.append((handle, set(handle.futures) | set(handle.skipped)))

    def restored(self, result) -> None:
        """Record a :class:`tierckpt.RestoreResult`."""
        with self._lock:
            self._restores.append(result)

    def drain(self) -> tuple[dict[str, float], dict[str, str]]:
        """Without blocking: ``(scalars, texts)`` ready since the last call (the newest value of
        each name wins when two saves resolved in between)."""
        scalars: dict[str, float] = {}
        texts: dict[str, str] = {}
        with self._lock:
            new, self._new = self._new, []
            restores, self._restores = self._restores, []
            still = []
            for handle, tiers in self._open:
                for rec in _resolved(handle, tiers):
                    scalars.update(record_metrics(rec))
                    tiers.discard(rec.tier)
                if tiers:
                    still.append((handle, tiers))
            self._open = still
        for handle in new:
            scalars["tierckpt/save/blocking_s"] = float(handle.blocking_s)
        for res in restores:
            s, t = restore_scalars(res)
            scalars.update(s)
            texts.update(t)
        return scalars, texts


def _resolved(handle, tiers: set[str]) -> list:
    out = [handle.skipped[t] for t in tiers if t in handle.skipped]
    return out + [handle.futures[t].result() for t in tiers if t in handle.futures and handle.futures[t].done()]


def restore_scalars(res) -> tuple[dict[str, float], dict[str, str]]:
    """``(scalars, texts)`` of one :class:`tierckpt.RestoreResult`: the shared restore scalars
    (:func:`tierckpt.integration.result_metrics`) and, as text, each node's source."""
    text = ", ".join(f"node {n}: {o.source.kind}" for n, o in sorted(res.sources.items()))
    return result_metrics(res), {"tierckpt/restore/sources": text}


def write(scalars: dict[str, float], texts: dict[str, str], iteration: int, tb=None, wb=None) -> None:
    """Hand metrics to a TensorBoard ``SummaryWriter`` (``add_scalar``/``add_text``) and a W&B
    run (one ``log(metrics, iteration)`` call), either of which may be None. Writes nothing
    when both dicts are empty."""
    if not scalars and not texts:
        return
    if tb is not None:
        for k, v in scalars.items():
            tb.add_scalar(k, v, iteration)
        for k, text in texts.items():
            tb.add_text(k, text, iteration)
    if wb is not None:
        wb.log({**scalars, **texts}, iteration)
