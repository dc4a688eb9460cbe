"""Preemption signals and DataLoader worker processes.

A launcher that forwards a notice to a whole process group or tree (torchrun sends SIGTERM
to each rank's process group, Slurm signals every process of a step) reaches a rank's
DataLoader workers as well. torch's workers die on SIGTERM (their handler re-raises it unless
the rank itself sent it) and on SIGUSR1 (default action), and torch's SIGCHLD handler then
raises ``DataLoader worker (pid …) is killed by signal`` in the rank's main thread at whatever
bytecode it is running — before the step ends, so the preemption save never happens.

Three layers, each useful on its own:

- :func:`protect_loader_workers` makes a loader's workers ignore the watched signals (a
  ``worker_init_fn`` wrapper; with the ``fork`` start method the signals are also blocked
  across the fork, so no notice lands in the window before that function runs), except the
  loader's own SIGTERM that stops a worker. The rank alone decides when to stop; its workers
  end with it (torch's worker watchdog sees the parent gone within 5 s).
- :func:`defer_loader_deaths` (run by :class:`~tierckpt.preemption.PreemptionWatch` when a
  notice arrives): from then on a worker's death is not raised asynchronously (it could be
  raised half-way through ``optimizer.step()``); the step finishes and the end-of-step check
  saves. A loader used again after its workers died still raises, synchronously, in ``next()``.
- :func:`preempted_by` tells a trainer whose step raised a loader-worker death whether a
  watched signal explains it: then the model and optimizer still hold the last finished step
  (the error comes from fetching a batch) and the trainer takes the preemption save there.
- :func:`agree_loader_death` makes that save an agreed one. The save is collective, so it is
  right only when every rank's fetch failed the same way at the same step. With unprotected
  loader workers that is the usual case (the notice reaches every rank's workers while the
  ranks wait for data), but not a certainty: one rank's workers may die while another rank
  already fetched its batch and is inside a training collective waiting for this one. Saving
  then would pair the save's collectives with nothing (or with the wrong ones) and hang. So
  the ranks vote through the process group's key-value store (never a collective, which could
  pair with one a rank is already in): each rank posts whether its fetch failed on the notice
  and at which step; a rank that failed otherwise posts "no" and leaves at once. A rank that
  wants to save waits for every vote at most ``collective_timeout_s`` seconds and saves only
  when every rank failed on the notice at the same step; otherwise it gives the save up with a
  warning (the step stays what the last periodic save made durable). The engine API's trainer
  and torchtitan's (``TieredCheckpointManager.save_on_loader_death``) both call it.
"""

from __future__ import annotations

import datetime
import json
import logging
import multiprocessing
import multiprocessing.context
import os
import re
import signal
import threading
from typing import Any, Callable

from tierckpt.preemption import DEFAULT_SIGNALS, signal_numbers

log = logging.getLogger(__name__)

# torch's messages for a dead worker: the SIGCHLD check ("DataLoader worker (pid 12) is killed
# by signal: Terminated.") and the fetch's liveness check ("DataLoader worker (pid(s) 12, 13)
# exited unexpectedly")
_DEATH = re.compile(r"DataLoader worker \(pid(?:\(s\))? [\d, ]+\) (?:is killed by signal|exited unexpectedly)")


class IgnoreSignalsInWorker:
    """A ``worker_init_fn`` that shields the worker from ``nums``, then calls ``inner``.
    Picklable (spawn, forkserver) when ``inner`` is.

    The signals are blocked in the worker and taken by a daemon thread (``sigwaitinfo``),
    which drops them — except a SIGTERM from the worker's parent, the loader itself stopping
    the worker (``Process.terminate()``, also at interpreter exit), which ends the worker at
    once as torch's own worker handler does. Ignoring them outright (``SIG_IGN``) would make
    that ``terminate()`` a no-op and the rank's exit wait for the worker forever.

    Args:
        nums: signal numbers.
        inner: the loader's own ``worker_init_fn`` or None.
    """

    def __init__(self, nums: tuple[int, ...], inner: Callable[[int], Any] | None = None):
        self.nums, self.inner = tuple(nums), inner

    def __call__(self, worker_id: int) -> None:
        # blocked before the thread starts: it inherits the mask, and so does any thread the
        # dataset starts later; a notice pending since the fork is taken by the thread
        signal.pthread_sigmask(signal.SIG_BLOCK, self.nums)
        threading.Thread(target=_absorb_signals, args=(self.nums, os.getppid()), daemon=True,
                         name="tierckpt-loader-worker-signals").start()
        if self.inner is not None:
            self.inner(worker_id)


def _absorb_signals(nums: tuple[int, ...], parent: int) -> None:
    """A loader worker's signal thread (see :class:`IgnoreSignalsInWorker`)."""
    while True:
        info = signal.sigwaitinfo(nums)
        if info.si_signo == signal.SIGTERM and info.si_pid == parent:
            os._exit(0)  # the loader stops this worker (torch's worker handler exits 0 here too)


class _GuardedForkProcess(multiprocessing.context.ForkProcess):
    """A fork-context Process whose child starts with the watched signals blocked (then taken
    by the thread :class:`IgnoreSignalsInWorker` starts): a notice between the fork and the
    ``worker_init_fn`` stays pending instead of killing the new worker."""

    _tierckpt_nums: tuple[int, ...] = ()

    def start(self) -> None:
        old = signal.pthread_sigmask(signal.SIG_BLOCK, self._tierckpt_nums)
        try:
            super().start()
        finally:
            # the parent's own notice, if one came meanwhile, is delivered now
            signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _guarded_fork_context(nums: tuple[int, ...]) -> multiprocessing.context.BaseContext:
    """A fresh fork context (never the shared singleton) whose Process blocks ``nums`` across the fork."""
    ctx = multiprocessing.context.ForkContext()
    proc = type("GuardedForkProcess", (_GuardedForkProcess,), {"_tierckpt_nums": tuple(nums)})
    ctx.Process = proc  # type: ignore[misc]
    return ctx


def protect_loader_workers(loader, signals=DEFAULT_SIGNALS):
    """Make the worker processes ``loader`` starts from now on ignore ``signals`` (the
    engine's ``TierConfig.preemption_signals``), so a notice sent to the rank's process group
    or tree does not kill them. Call before iterating (workers already running keep their
    handlers); idempotent; a loader without workers (``num_workers = 0``) is left as is. Full
    protection needs the ``fork`` start method (the Linux default before Python 3.14); with
    ``spawn``/``forkserver`` it is partial (a warning says so).

    Args:
        loader: a ``torch.utils.data.DataLoader`` (or torchdata's ``StatefulDataLoader``,
            torchtitan's ``ParallelAwareDataloader``).
        signals: signal names.
    Returns:
        ``loader``.
    Raises:
        ConfigError: an unknown signal name (option ``preemption_signals``).
    """
    nums = signal_numbers(signals)
    if not nums or not getattr(loader, "num_workers", 0) or not hasattr(loader, "worker_init_fn"):
        return loader  # no worker processes, or not a torch DataLoader
    init = loader.worker_init_fn
    if isinstance(init, IgnoreSignalsInWorker):
        init = init.inner
    loader.worker_init_fn = IgnoreSignalsInWorker(nums, init)
    ctx = loader.multiprocessing_context
    if ctx is None:
        ctx = multiprocessing.get_context()
    if ctx.get_start_method() == "fork":
        loader.multiprocessing_context = _guarded_fork_context(nums)
    else:
        # a worker forked from a forkserver or spawned runs threads before its worker_init_fn,
        # which the signals can still reach (torch's handler then kills it)
        log.warning("tierckpt: the DataLoader's workers start with %r: the watched signals are blocked in "
                    "their main thread only and may still kill them; use multiprocessing_context='fork' "
                    "(the default on Linux before Python 3.14) for full protection", ctx.get_start_method())
    return loader


def is_loader_worker_death(exc: BaseException | None) -> bool:
    """Whether ``exc`` (or an exception it was raised from) is torch's error for a DataLoader
    worker that died (killed by a signal, or gone when a batch was fetched)."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, RuntimeError) and _DEATH.search(str(exc)):
            return True
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return False


def preempted_by(exc: BaseException | None, watch) -> str | None:
    """The watched signal that explains ``exc``: its name when ``exc`` is a loader-worker
    death (:func:`is_loader_worker_death`) and ``watch`` (a
    :class:`~tierckpt.preemption.PreemptionWatch`, ``TieredCheckpointer.preemption``) recorded
    a notice in this process, else None. Not collective.

    Not enough on its own to start the (collective) preemption save: another rank's fetch may
    have succeeded. A trainer catching the error of ``next(batches)`` calls
    :func:`agree_loader_death` instead (which asks this), and only when that returns a signal
    ``save_for_preemption(last finished step, state, signal)``, then exits with
    ``PREEMPTED_EXIT``.
    """
    if watch is None or watch.received is None or not is_loader_worker_death(exc):
        return None
    return watch.received


#: the key prefix of the votes in the process group's store (one per run and rank)
VOTE_PREFIX = "tierckpt/loader-death"


def agree_loader_death(engine: Any, exc: BaseException, step: int, store: Any = None) -> str | None:
    """Whether to take the preemption save of step ``step`` (the last finished one) after
    ``exc`` ended the training loop (see the module docstring): the notice's signal name when
    every rank's fetch failed on the notice (:func:`preempted_by`) at ``step``, else None
    (``exc`` is another error on this rank or some other rank, the ranks disagree on the step,
    or not every rank voted within ``engine.cfg.collective_timeout_s`` seconds: a rank inside a
    training collective). Call it on every rank that leaves the loop on an exception (an
    exception other than a loader death too: the vote says "no" at once); it runs no
    collective, so a disagreeing rank is never paired with a save. Then, on a signal,
    ``engine.save_for_preemption(step, state, signal)`` on every rank; on None, re-raise
    ``exc``. Called once per run.

    Args:
        engine: the :class:`~tierckpt.engine.TieredCheckpointer` (its read-only ``preemption``,
            ``topo``, ``timeline`` and ``cfg``).
        exc: the exception the training loop raised on this rank.
        step: the step the save would name (the failed step - 1); below 1 nothing is saved.
        store: the key-value store to vote through (default: the default process group's).
    """
    sig = preempted_by(exc, engine.preemption)
    mine = {"step": step, "signal": sig} if sig is not None and step >= 1 else None
    topo = engine.topo
    if topo.world_size == 1:
        return sig if mine is not None else None
    keys = [f"{VOTE_PREFIX}/{engine.timeline.run}/{r}" for r in range(topo.world_size)]
    try:
        if store is None:
            import torch.distributed as dist

            store = dist.distributed_c10d._get_default_store()
        store.set(keys[topo.rank], json.dumps(mine))
    except Exception as e:  # noqa: BLE001 - a store gone with a peer: no agreement, no save
        if mine is not None:
            log.warning("tierckpt: %s: cannot agree on the save after the DataLoader's death (%s: %s); not saving",
                        sig, type(e).__name__, e)
        return None
    if mine is None:  # failed otherwise: the vote says so, and this rank does not wait
        return None
    timeout = engine.cfg.collective_timeout_s
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout))
        votes = [json.loads(store.get(k)) for k in keys]
    except Exception as e:  # noqa: BLE001 - a timeout (a rank inside a collective) or a store gone
        log.warning("tierckpt: %s: the DataLoader's workers died on the notice, but not every rank voted to save "
                    "within collective_timeout_s = %gs (a rank inside a collective?): %s: %s; not saving, the "
                    "last committed step stays the resume point", sig, timeout, type(e).__name__, e)
        return None
    others = [r for r, v in enumerate(votes) if v is None or v.get("step") != step]
    if others:
        log.warning("tierckpt: %s: the DataLoader's workers died on the notice at step %d, but ranks %s failed "
                    "otherwise or at another step; not saving, the last committed step stays the resume point",
                    sig, step + 1, others[:16])
        return None
    return sig


_deferred_lock = threading.Lock()


def defer_loader_deaths() -> bool:
    """After a notice: wrap the SIGCHLD handler torch's DataLoader installed so that a
    worker's death is logged instead of raised at an arbitrary point of the step (main thread
    only; a no-op without such a handler or when already done). Returns whether it wrapped."""
    if threading.current_thread() is not threading.main_thread():
        return False
    with _deferred_lock:
        prev = signal.getsignal(signal.SIGCHLD)
        if not callable(prev) or getattr(prev, "_tierckpt_deferred", False):
            return False
        if getattr(prev, "__module__", "") != "torch.utils.data._utils.signal_handling":
            return False  # not torch's loader check: someone else's handler, left alone

        def deferred(signum, frame) -> None:
            try:
                prev(signum, frame)
            except RuntimeError as e:
                if not is_loader_worker_death(e):
                    raise
                log.warning("tierckpt: %s after a preemption notice: not raised here; the step "
                            "goes on to its preemption save", e)

        deferred._tierckpt_deferred = True  # type: ignore[attr-defined]
        signal.signal(signal.SIGCHLD, deferred)
        return True
