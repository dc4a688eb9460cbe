"""``busy_tier_policy = "defer"``: a tier due while its previous save still runs is not saved
now, so a slow write never stalls training.

:class:`BusyPoll` answers "has the tier's last job finished on every rank?" with one all-reduce
(MIN of one int32 done flag per tier asked) over the control group, the group the trainer's
thread alone uses (:class:`tierckpt.cluster.topology.Groups`). The answer is the same on every
rank, so every rank takes the same save-or-defer decision and the tier collectives stay in
step. A job agreed finished stays finished: later questions about it cost no collective, and
answers are kept for the rest of the step so repeated ``due()`` calls of one step agree.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from typing import Callable, Iterable, Mapping

import torch
import torch.distributed as dist

from tierckpt.records import CheckpointRecord
from tierckpt.tiers.lanes import Lane

log = logging.getLogger(__name__)


class BusyPoll:
    """The agreed "previous save finished" poll and the deferred-save record.

    Args:
        lanes: ``{tier: Lane}`` (:class:`~tierckpt.tiers.lanes.Lane`): each tier's last job
            queued (``tail``) and the step of its latest save while it runs (``running_step()``).
        group: the control group (every rank; used by the trainer's thread only).
        rank: global rank (rank 0 logs).
        ledger_append: appends a record to the ledger (global rank 0 writes).
        stuck_nodes: ``stuck_nodes()``, the nodes whose local job is still writing or deleting
            in their root (collective over the control group;
            :meth:`~tierckpt.tiers.hung.HungDiskVote.stuck_nodes`):
            a deferred local save names them, once per running job (a hung disk must be
            findable from the ledger).
    """

    def __init__(self, lanes: Mapping[str, Lane], group, rank: int, ledger_append: Callable[[CheckpointRecord], object],
                 stuck_nodes: Callable[[], list[int]] | None = None):
        self._lanes, self._group = lanes, group
        self._rank, self._append = rank, ledger_append
        self._stuck_nodes = stuck_nodes
        self._stuck: tuple[Future | None, list[int]] | None = None  # (local job, its stuck nodes)
        self._done: dict[str, Future] = {}  # tier -> its job agreed finished on every rank
        self._step: int | None = None  # the step of the answers in _answers
        self._answers: dict[str, tuple[Future, bool]] = {}


    def release(self) -> None:
        """Drop the control group (the engine closed and destroys its groups)."""
        self._group = None

    def finished(self, tiers: Iterable[str], step: int) -> dict[str, bool]:
        """``{tier: its last job finished on every rank}`` at ``step`` (True for a tier without
        a job). Collective over the control group unless every answer is known already: call
        on every rank with the same arguments, from the trainer's thread.

        Costs one all-reduce of 4 bytes per tier whose job was not yet agreed finished and was
        not asked about earlier in this step."""
        return self.begin(tiers, step)()

    def begin(self, tiers: Iterable[str], step: int) -> "Answer":
        """:meth:`finished` in two halves: post the all-reduce now (asynchronously) and return
        the :class:`Answer` that waits for it, so the caller can do its own work (the staging
        copy) while the agreement is in flight. Call the answer exactly once, before any other
        collective over the control group."""
        if step != self._step:
            self._step, self._answers = step, {}
        out, ask = {}, []
        for t in tiers:
            fut = self._lanes[t].tail
            if fut is None or self._done.get(t) is fut:
                out[t] = True
            elif t in self._answers and self._answers[t][0] is fut:
                out[t] = self._answers[t][1]
            else:
                ask.append((t, fut))
        if not ask:
            return Answer(self, out, [], None, None)
        flags = torch.tensor([int(f.done()) for _, f in ask], dtype=torch.int32)
        work = dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=self._group, async_op=True)
        return Answer(self, out, ask, flags, work)

    def deferred(self, tier: str, step: int, t0: float, policy_note: str) -> CheckpointRecord:
        """The agreed record of ``tier``'s save of ``step`` deferred (every rank builds the same
        one from agreed facts); appended to the ledger, one warning from global rank 0.
        ``t0``: ``time.perf_counter()`` when the decision started."""
        running = self._lanes[tier].running_step()
        what = f"its save of step {running}" if running is not None else "its previous job"
        stuck = None
        if tier == "local" and self._stuck_nodes is not None:
            fut = self._lanes[tier].tail
            if self._stuck is None or self._stuck[0] is not fut:  # every rank: same job, same answer
                self._stuck = (fut, self._stuck_nodes())
            stuck = self._stuck[1]
        where = f"on node(s) {stuck}" if stuck else "on some rank"
        error = f"{tier} save of step {step} deferred: {what} is still running {where} ({policy_note})"
        waited = time.perf_counter() - t0
        rec = CheckpointRecord(tier=tier, step=step, ok=False, skipped=True, deferred=True, running_step=running,
                               stuck_nodes=stuck or [], error=error, blocking_s=waited, wait_s=waited)
        if self._rank == 0:
            log.warning("tierckpt: %s; training continues", error)
        self._append(rec)
        return rec


class Answer:
    """The pending result of :meth:`BusyPoll.begin`: call it for ``{tier: its last job finished
    on every rank}``. :attr:`busy_here` is known at once: the tiers certain to be answered
    False, because their job still runs on this rank (the MIN over ranks is then 0) or was
    agreed unfinished earlier in this step."""

    def __init__(self, poll: BusyPoll, out: dict[str, bool], ask: list[tuple[str, Future]], flags, work):
        self._poll, self._out, self._ask, self._flags, self._work = poll, out, ask, flags, work
        self.busy_here = frozenset([t for t, ok in out.items() if not ok] +
                                   [t for (t, _), f in zip(ask, flags.tolist() if ask else []) if not f])

    def __call__(self) -> dict[str, bool]:
        if not self._ask:
            return self._out
        if self._work is not None:
            self._work.wait()
        for (t, fut), flag in zip(self._ask, self._flags.tolist()):
            self._out[t] = bool(flag)
            self._poll._answers[t] = (fut, self._out[t])
            if self._out[t]:
                self._poll._done[t] = fut
        return self._out
