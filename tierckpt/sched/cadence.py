"""When each tier saves, agreed by every rank (fixed step intervals or adaptive, issue 4).

Global rank 0 owns the :class:`~tierckpt.sched.schedule.Scheduler` (it observes step times, the
δ and background times gathered after each checkpoint, and the ledger's MTBF, restart and
fallback evidence) and proposes ``tau_steps`` per tier. Proposals travel on collectives the
engine runs anyway (the stats all-gather after a checkpoint, the restore all-gather) and are
applied only at points every rank reaches at the same training step — the next save of the
tier whose job carried them, or the end of a restore — so every rank's :meth:`due` answers the
same for every step (a disagreement would deadlock the next collective).

An adaptive tier starts with its configured interval (``initial``) until the scheduler knows
the step time; afterwards τ = sqrt(2δ(M+R)) − δ (Daly 2006) in steps, clamped (see
:mod:`tierckpt.sched.schedule`).
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

import logging
import threading

from tierckpt import clock
from tierckpt.config import ScheduleOptions
from tierckpt.sched.schedule import Decision, Scheduler

log = logging.getLogger(__name__)


class Cadence:
    """Per-tier save cadence.

    Args:
        intervals: ``{tier: steps}`` — the fixed interval, or for adaptive tiers the interval
            used until the first adaptive decision.
        adaptive: tiers whose interval the scheduler chooses.
        rank, world_size: this rank and the job size (ranks stand for GPUs in the MTBF prior).
        options: the scheduler's options (validated when the config was built, on every
            rank; None = the defaults).
    """

    def __init__(self, intervals: Mapping[str, int], adaptive: tuple[str, ...], *, rank: int,
                 world_size: int, options: ScheduleOptions | None = None):
        self.tiers = tuple(intervals)
        self.tau = {t: int(n) for t, n in intervals.items()}
        self.adaptive = tuple(t for t in adaptive if t in intervals)
        self.last: dict[str, int] = {}
        # tiers whose due save was deferred (busy_tier_policy "defer"): due again as soon as
        # their previous save finished on every rank, not one interval later
        self.deferred: set[str] = set()
        self._lock = threading.Lock()
        self.scheduler = None
        self._last_logged: dict[str, tuple] = {}
        if rank == 0:
            fixed = {t: n for t, n in self.tau.items() if t not in self.adaptive}
            self.scheduler = Scheduler(self.tiers, gpus=world_size, options=options, fixed_steps=fixed)

    # -- rank 0 --------------------------------------------------------------------------------
    def record_step(self, seconds: float, busy=()) -> None:
        """Training step wall time, seconds, without checkpoint stalls; ``busy``: tiers whose
        background work overlapped it (used on rank 0)."""
        if self.scheduler is not None and seconds > 0:
            with self._lock:
                self.scheduler.observe_step(seconds, busy)

    def interference_of(self, tier: str) -> float | None:
        """Rank 0: step slowdown charged to ``tier`` since its last save, seconds (then reset);
        None on other ranks."""
        if self.scheduler is None or tier not in self.scheduler.tiers:
            return None
        with self._lock:
            return self.scheduler.take_interference(tier)

    def record_checkpoint(self, tier: str, blocking_s: float, background_s: float,
                          interference_s: float | None = None) -> None:
        """Blocking, background and slowdown seconds of a finished save (rank 0)."""
        if self.scheduler is not None:
            with self._lock:
                self.scheduler.observe_checkpoint(tier, blocking_s, background_s,
                                                  0.0 if interference_s is None else interference_s)

    def refresh_from_ledger(self, records: list[dict], run_id: str) -> None:
        """Refresh M, R, p from the ledger (rank 0)."""
        if self.scheduler is not None:
            with self._lock:
                self.scheduler.update_from_ledger(records, current_run_id=run_id, now=clock.now())

    def proposal(self) -> tuple[dict[str, int], dict[str, Decision]] | None:
        """Rank 0: (``{tier: tau_steps}`` for adaptive tiers with a decision, decisions)."""
        if self.scheduler is None or not self.adaptive:
            return None
        with self._lock:
            decisions = {t: self.scheduler.interval(t) for t in self.adaptive}
        return {t: d.tau_steps for t, d in decisions.items() if d.tau_steps is not None}, decisions

    def changed(self, decisions: dict[str, Decision]) -> dict[str, Decision]:
        """Decisions whose steps or reason differ from the last ones logged (rank 0)."""
        out = {}
        with self._lock:  # both tier workers call this on rank 0
            for t, d in decisions.items():
                key = (d.tau_steps, d.reason)
                if self._last_logged.get(t) != key:
                    self._last_logged[t] = key
                    out[t] = d
        return out

    # -- every rank ----------------------------------------------------------------------------
    def apply(self, tau_steps: dict[str, int] | None) -> None:
        """Adopt rank 0's proposal (call at a point every rank reaches at the same step)."""
        if not isinstance(tau_steps, dict):
            return  # only a proposal dict is meaningful here
        for t, n in tau_steps.items():
            if t in self.adaptive and n and n >= 1:
                self.tau[t] = int(n)

    def due(self, step: int, ready: Iterable[str] = ()) -> list[str]:
        """Tiers due at ``step``. Fixed tiers: ``step % tau == 0`` (torchtitan's and Megatron's
        convention, so saves land on the same steps after a resume). Adaptive tiers:
        ``step − last save ≥ tau`` (a tier never saved counts from 0). A deferred tier
        (:meth:`mark_deferred`) is due exactly when it is in ``ready`` (its previous save
        finished on every rank), whatever its interval says."""
        ready = set(ready)
        return [t for t in self.tiers
                if (t in ready if t in self.deferred else
                    step - self.last.get(t, 0) >= self.tau[t] if t in self.adaptive else step % self.tau[t] == 0)]

    def mark_saved(self, tiers, step: int) -> None:
        """``tiers`` saved (or were skipped for good) at ``step``."""
        for t in tiers:
            if t in self.tau:
                self.last[t] = int(step)
                self.deferred.discard(t)

    def mark_deferred(self, tiers) -> None:
        """``tiers`` were due but deferred: each is due again once its previous save finished."""
        self.deferred.update(t for t in tiers if t in self.tau)

    def reset(self, step: int) -> None:
        """Count every interval from ``step`` (after a restore); nothing stays deferred."""
        for t in self.tiers:
            self.last[t] = int(step)
        self.deferred.clear()


def decision_metrics(records: list[dict]) -> dict[str, float]:
    """Scalar metrics of ledger ``schedule`` records for a trainer's metric writer.

    Keys ``tierckpt/<tier>/tau_steps`` (steps; 0 while unknown), ``…/tau_s``, ``…/delta_s``,
    ``…/mtbf_s``, ``…/restart_s`` (seconds) and ``…/p`` (fraction); for each tier the newest
    record wins. Records without a ``tier`` are skipped.
    """
    out: dict[str, Any] = {}
    for r in records:
        t = r.get("tier")
        if not t:
            continue
        out.update({f"tierckpt/{t}/tau_steps": r.get("tau_steps") or 0, f"tierckpt/{t}/tau_s": r.get("tau_s") or 0.0,
                    f"tierckpt/{t}/delta_s": r.get("delta"), f"tierckpt/{t}/mtbf_s": r.get("M"),
                    f"tierckpt/{t}/restart_s": r.get("R"), f"tierckpt/{t}/p": r.get("p")})
    return {k: float(v) for k, v in out.items() if isinstance(v, (int, float))}
