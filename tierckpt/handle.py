"""What :meth:`tierckpt.engine.TieredCheckpointer.save` returns: the blocking time and one
future per tier, like DCP's ``async_save`` future and nvidia-resiliency-ext's async request.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FuturesTimeout

from tierckpt.records import CheckpointRecord


class SaveHandle:
    """The save of one step: blocking time δ and each tier's background outcome.

    Attributes:
        step: the step saved.
        blocking_s: seconds the ``save()`` call blocked the trainer (δ).
        futures: ``{tier: Future}`` of the tiers started at this step; each resolves to the
            tier's :class:`~tierckpt.records.CheckpointRecord` (never raises: a failure is a
            record with ``ok=False``).
        skipped: ``{tier: record}`` of tiers due at this step but not started: deferred
            (``record.deferred``: the tier's previous save, of ``record.running_step``, still
            ran; ``busy_tier_policy`` "defer") or skipped (a hung local disk).
    """

    def __init__(self, step: int, blocking_s: float, futures: dict[str, Future] | None = None,
                 skipped: dict[str, CheckpointRecord] | None = None):
        self.step = step
        self.blocking_s = blocking_s
        self.futures = dict(futures or {})
        self.skipped = dict(skipped or {})

    @property
    def tiers(self) -> tuple[str, ...]:
        """Tiers whose write started at this step."""
        return tuple(self.futures)

    def done(self) -> bool:
        """Every started tier has finished (committed or failed)."""
        return all(f.done() for f in self.futures.values())

    def wait(self, timeout: float | None = None) -> dict[str, CheckpointRecord]:
        """Block until every started tier finished; ``timeout`` in seconds (None: no limit).

        Returns:
            ``{tier: record}`` of started and skipped tiers.
        Raises:
            TimeoutError: a tier is still running after ``timeout`` seconds.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        out = dict(self.skipped)
        for t, f in self.futures.items():
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                out[t] = f.result(timeout=left)
            except FuturesTimeout:  # a distinct class before Python 3.11
                raise TimeoutError(f"tierckpt: the {t} save of step {self.step} is still running after {timeout}s") from None
        return out

    def outcome(self) -> dict[str, bool | None]:
        """Without blocking: ``{tier: True (committed) | False (failed or skipped) | None
        (still running)}``."""
        out: dict[str, bool | None] = {t: False for t in self.skipped}
        for t, f in self.futures.items():
            out[t] = f.result().ok if f.done() else None
        return out

    def failures(self) -> list[CheckpointRecord]:
        """Records of finished tiers that failed (skips excluded)."""
        return [f.result() for f in self.futures.values() if f.done() and f.result().failed]

    def __repr__(self) -> str:
        return f"SaveHandle(step={self.step}, blocking_s={self.blocking_s:.4f}, outcome={self.outcome()})"
