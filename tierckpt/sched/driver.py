"""The engine's round trip with the interval scheduler: global rank 0 proposes τ per adaptive
tier from the ledger's evidence (:mod:`tierckpt.sched.schedule`), every rank receives the same
proposal, and it takes effect at the tier's next save, the same step on every rank
(:class:`~tierckpt.sched.cadence.Cadence`).
"""

from __future__ import annotations

import logging
import threading

from tierckpt.cluster.collectives import broadcast_from_first
from tierckpt.records import CheckpointRecord
from tierckpt.sched.cadence import Cadence

log = logging.getLogger(__name__)


class ScheduleDriver:
    """Shares and applies interval decisions (create on every rank).

    Args:
        cadence: the per-tier cadence (``TierConfig.intervals``, ``adaptive``).
        rank: global rank (rank 0 runs the scheduler).
        ledger: the run's :class:`~tierckpt.history.ledger.Ledger` (the MTBF/δ/R evidence).
        journal: the run's :class:`~tierckpt.history.journal.RunJournal` (``schedule`` records).
    """

    def __init__(self, cadence: Cadence, rank: int, ledger, journal):
        self.cadence, self.rank, self.ledger, self.journal = cadence, rank, ledger, journal
        self._lock = threading.Lock()
        # every rank: each decision that changed (ledger ``schedule`` records), for the trainer's
        # metric writers, which may live on another rank than the scheduler (Megatron: the last)
        # as (rank 0's sequence number, record): both tiers' threads share decisions, and a
        # rank receives them in whatever order its threads run; drain() returns rank 0's order
        self._log: list[tuple[int, dict]] = []
        self._seq = 0  # rank 0: next sequence number (under _propose_lock)
        self._propose_lock = threading.Lock()
        self._pending: dict[str, dict | None] = {}  # tier -> proposal made after its last save

    def due(self, step: int, ready=()) -> list[str]:
        """Tiers due at ``step`` (the same on every rank); ``ready``: deferred tiers whose
        previous save finished on every rank (see :meth:`Cadence.due`)."""
        return self.cadence.due(step, ready)

    @property
    def deferred(self) -> set[str]:
        """Tiers whose deferred save waits for their previous one (the same on every rank)."""
        return self.cadence.deferred

    def drain(self) -> list[dict]:
        """Decisions (ledger ``schedule`` lines) made since the last call, in the order rank 0
        made them (the same list on every rank once the same shares arrived)."""
        with self._lock:
            recs, self._log[:] = sorted(self._log, key=lambda x: x[0]), []
        return [r for _, r in recs]

    def share(self, group, trigger: str, *, refresh_ledger: bool = False, step: int | None = None):
        """Rank 0 proposes τ per adaptive tier; everyone receives it (collective on ``group``).
        Returns the proposal (``{tier: steps}`` or None); ``trigger`` labels the ``schedule``
        records."""
        prop, recs = self._propose(trigger, refresh_ledger, step) if self.rank == 0 else (None, [])
        prop, recs = broadcast_from_first((prop, recs), group)
        if recs:
            with self._lock:
                self._log.extend(recs)
        return prop

    def _propose(self, trigger: str, refresh_ledger: bool, step: int | None):
        """Rank 0's proposal and the records of the decisions that changed; never raises (the
        caller's broadcast must run on every rank)."""
        if refresh_ledger:
            try:
                self.cadence.refresh_from_ledger(self.ledger.records(), self.ledger.run_id)
            except Exception as e:  # keep the previous estimate
                log.warning("tierckpt schedule: could not use the ledger: %s", e)
        try:
            got = self.cadence.proposal()
        except Exception as e:  # keep the current intervals
            log.warning("tierckpt schedule: no new decision: %s", e)
            return None, []
        if got is None:
            return None, []
        prop, decisions = got
        recs = []
        with self._propose_lock:  # numbered in the order the decisions were taken
            for t, d in self.cadence.changed(decisions).items():
                recs.append((self._seq, self.journal.schedule(d, trigger, step)))
                self._seq += 1
                log.info("tierckpt schedule (%s): %s every %s steps (tau %.1fs, delta %.3fs, M %.0fs, "
                         "R %.1fs, p %.2f; %s)", trigger, t, d.tau_steps, d.tau_s or float("nan"),
                         d.delta, d.M, d.R, d.p, d.reason)
        return prop, recs

    def before_save(self, tier: str) -> None:
        """Apply the proposal made after ``tier``'s previous save (every rank, same step)."""
        self.cadence.apply(self._pending.pop(tier, None))

    def saved(self, tiers, step: int) -> None:
        """``tiers`` saved (or were skipped) at ``step``: their next save is one interval later."""
        self.cadence.mark_saved(tiers, step)

    def defer(self, tiers) -> None:
        """``tiers`` were due and deferred: due again once their previous save finished."""
        self.cadence.mark_deferred(tiers)

    def after_record(self, tier: str, step: int, rec: CheckpointRecord, group) -> None:
        """Feed a save's agreed record to the scheduler and share the next proposal (collective
        on ``group``, the tier's world group; runs on the tier's thread)."""
        if rec.ok:
            self.cadence.record_checkpoint(tier, rec.blocking_s, rec.background_s, rec.interference_s)
        # M grows with failure-free exposure: re-read the ledger's evidence each time
        self._pending[tier] = self.share(group, "checkpoint", refresh_ledger=True, step=step)

    def after_restore(self, step: int, group) -> None:
        """Restart the cadence at the restored ``step`` with a fresh decision (collective)."""
        self.cadence.reset(step)
        self.cadence.apply(self.share(group, "restart", refresh_ledger=True, step=step))
