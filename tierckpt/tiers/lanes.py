"""One lane per tier: the tier's worker thread and everything the engine knows about the jobs
queued on it.

A lane replaces what used to be parallel per-tier dicts: its :class:`DaemonWorker`, the
latest save (a never-raising Future of its :class:`~tierckpt.records.CheckpointRecord`, and
its step), the last job queued (a save, or a restore's replica rebuild: the worker is FIFO, so
waiting for it waits for everything queued), the save's submit/finish window (the scheduler's
interference measure), the phase the lane's job is in (named when a hung disk is voted on),
and the job that already outlived one full wait (polled afterwards, never waited for again).

Every job a lane still holds is listed by :meth:`Lane.held`, so the interpreter's exit
(:mod:`tierckpt.exit`) names each one that did not commit, not only the last one queued.
"""

from __future__ import annotations

import time
from concurrent.futures import CancelledError, Future
from concurrent.futures import TimeoutError as FuturesTimeout
from dataclasses import dataclass
from typing import Callable

from tierckpt.priority import BackgroundPriority
from tierckpt.records import CheckpointRecord, RedundancyRecord
from tierckpt.tiers.workers import DaemonWorker

__all__ = ["Lane", "LaneJob", "SAVE", "REBUILD", "finished", "record_of"]

SAVE = "save"
REBUILD = "replica rebuild"  # a restore's pulled-copy commit and/or replica rebuild (the local lane)


@dataclass(eq=False)
class LaneJob:
    """One job queued on a lane: ``kind`` (:data:`SAVE` or :data:`REBUILD`), the step a save
    writes (None for a rebuild), and its Future (a save's resolves to its record and never
    raises; a rebuild's to its ``RedundancyRecord`` or None)."""

    kind: str
    step: int | None
    future: Future

    def failure(self) -> str | None:
        """Why this finished job did not commit, or None: a save whose record failed, a rebuild
        whose agreed record carries an error (a transfer or the agreement failed). A rebuild that
        merely could not copy everything (no source to send) is not a failure of the job."""
        try:
            out = self.future.result(timeout=0)
        except BaseException as e:  # the worker died under it (a rebuild's Future may raise)
            return f"{type(e).__name__}: {e}"
        if isinstance(out, CheckpointRecord):
            return None if out.ok else (out.error or "failed")
        if isinstance(out, RedundancyRecord) and out.error:
            return out.error
        return None


class Lane:
    """The background lane of one tier (one per configured tier, created by
    :class:`~tierckpt.tiers.jobs.TierJobs`; its methods run on the trainer's thread except
    :attr:`phase` and :meth:`finished_now`, which the lane's own jobs set).

    Attributes:
        tier: ``"local"`` or ``"persistent"``.
        worker: the tier's :class:`~tierckpt.tiers.workers.DaemonWorker`.
        save: never-raising Future of the latest save's record, None before any.
        step: step of the latest save (None before any).
        tail: the last job queued (a save or a rebuild), None before any.
        window: monotonic (submitted, finished or None) seconds of the latest save, or None.
        phase: where the lane's running job is: ``"save"``, ``"replicate"``, ``"record"``,
            ``"retention"``, ``"redundancy"`` or ``"done"`` (the hung-disk vote names it).
        overdue: a job that outlived one full wait (only polled afterwards), or None.
    """

    def __init__(self, tier: str, priority: BackgroundPriority | None = None):
        self.tier = tier
        self.worker = DaemonWorker(f"tierckpt-{tier}", priority)
        self.save: Future | None = None
        self.step: int | None = None
        self.tail: Future | None = None
        self.window: tuple[float, float | None] | None = None
        self.phase = "done"
        self.overdue: Future | None = None
        self._jobs: list[LaneJob] = []

    def submit_save(self, step: int, fn: Callable, *args) -> Future:
        """Queue the save of ``step`` (``fn(*args)`` returns its record); the never-raising
        Future of that record (a worker that died under it gives a failed record)."""
        self.window = (time.monotonic(), None)
        fut = _never_raising(self.worker.submit(fn, *args), self.tier, step)
        self.save, self.step = fut, step
        self._queue(LaneJob(SAVE, step, fut))
        return fut

    def submit_rebuild(self, fn: Callable, *args) -> Future:
        """Queue a restore's rebuild job (``fn(*args)``) behind whatever the lane holds; its
        Future (raises only when the worker died under it)."""
        fut = self.worker.submit(fn, *args)
        self._queue(LaneJob(REBUILD, None, fut))
        return fut

    def _queue(self, job: LaneJob) -> None:
        self._jobs = [j for j in self._jobs if not j.future.done()] + [job]
        self.tail = job.future

    def held(self) -> list[LaneJob]:
        """Every job queued on the lane that has not finished, in queue order."""
        return [j for j in self._jobs if not j.future.done()]

    def finished_now(self) -> None:
        """The latest save's background work ended (its stats are being agreed): closes its
        :attr:`window`."""
        if self.window is not None:
            self.window = (self.window[0], time.monotonic())

    def busy_during(self, now: float, seconds: float) -> bool:
        """Whether the latest save's window overlapped the ``seconds`` before ``now``."""
        w = self.window
        return w is not None and w[0] < now and (w[1] is None or w[1] > now - seconds)

    def latest_record(self) -> CheckpointRecord | None:
        """Wait for the latest save; its record (None before any save)."""
        return record_of(self.save, self.tier, self.step) if self.save is not None else None

    def finished_record(self) -> CheckpointRecord | None:
        """The latest save's record if it finished, else None (does not wait)."""
        return record_of(self.save, self.tier, self.step) if self.save is not None and self.save.done() else None

    def running_step(self) -> int | None:
        """The step of the latest save while it is the last job queued (None otherwise: a
        rebuild queued after it, or no save yet)."""
        return self.step if self.tail is not None and self.tail is self.save else None

    def wait_tail(self, limit: float | None) -> bool:
        """Wait for everything queued, at most ``limit`` seconds (None: no limit; a job that
        already outlived one full wait is only polled); whether it all finished. A job still
        running then becomes :attr:`overdue`."""
        fut = self.tail
        if fut is None:
            return True
        done = finished(fut, 0.0 if (limit is not None and fut is self.overdue) else limit)
        if not done:
            self.overdue = fut
        return done

    def shutdown(self, wait: bool) -> None:
        """Stop the worker; ``wait=False`` leaves an abandoned job's daemon thread running."""
        self.worker.shutdown(wait=wait)


def finished(fut: Future, timeout: float | None) -> bool:
    """Whether ``fut`` finished within ``timeout`` seconds (None: no limit); a job that raised
    finished too."""
    try:
        fut.exception(timeout=timeout)
    except FuturesTimeout:
        return False
    except CancelledError:
        pass
    return True


def _never_raising(fut: Future, tier: str, step: int) -> Future:
    """A Future of ``fut``'s record that resolves to a failed record instead of raising (what
    a save handle's futures promise), whatever happened to the job's worker thread."""
    out: Future = Future()
    out.set_running_or_notify_cancel()
    fut.add_done_callback(lambda f: out.set_result(record_of(f, tier, step)))
    return out


def record_of(fut: Future, tier: str, step: int | None) -> CheckpointRecord:
    """A finished job's record. A save job turns every failure into a record, so an exception
    here means the job never ran (its worker thread died): a failed record too."""
    try:
        return fut.result()
    except BaseException as e:
        return CheckpointRecord(tier=tier, step=-1 if step is None else step, ok=False,
                                error=f"the job never ran: {type(e).__name__}: {e}")
