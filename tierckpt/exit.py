"""Leaving without ``close()``: what the interpreter's exit does with an engine still open.

A script that saves and then returns from ``main()``, raises, or calls ``sys.exit()`` without
:meth:`~tierckpt.engine.TieredCheckpointer.close` (the context-manager form closes) still has
that save running on the engine's tier workers. Those are daemon threads (a stuck node-local
disk must never keep a process alive), so nothing waits for them: the save stayed
uncommitted in every tier, the ledger got no ``run_end`` (the MTBF estimate counted a
failure), and the process died of SIGABRT ("terminate called without an active exception").
The abort is a worker thread, not a gloo thread: a tier job returning from a torch call that
had released the GIL (a gloo collective of the replication or of the agreed record) after
the interpreter began finalising is ended by ``pthread_exit`` (CPython 3.11
``PyThread_exit_thread`` in ``take_gil``), whose forced unwind crosses pybind11's
``noexcept`` GIL guard: ``std::terminate``.

So an ``atexit`` handler (run after the non-daemon threads were joined and before
finalisation, while the tier workers still run) finishes each engine that was created in
this process and never closed, in order of creation:

1. wait for every job each tier's lane still holds (a save, a replica rebuild after a restore:
   each one, not only the last queued; :meth:`tierckpt.tiers.lanes.Lane.held`), all tiers
   together at most ``TierConfig.exit_timeout_s`` (the local tier too: unlike ``close()``,
   not only ``local_wait_timeout_s``, since a peer's local job replicates with this one and
   would fail if it were abandoned merely slow); the jobs' own collectives are bounded by
   ``collective_timeout_s`` and fail at once when a peer's process is gone, so a rank that
   exits on an exception while its peers still train does not hold anyone up. The handler
   itself runs no collective: a peer may still be training, and a collective here would
   pair with one of its own;
2. :meth:`~tierckpt.engine.TieredCheckpointer.close` without waiting again: the ``run_end``
   record (global rank 0, the ledger's writer) with ``exit = "without close()"``, ``reason``
   naming an uncaught exception, and ``unfinished`` naming each job pending at the exit that
   did not commit — given up on, or failed (a peer gone) — also in a warning; the workers
   whose jobs finished are joined, so no tierckpt thread is inside a torch call while the
   interpreter finalises. ``clean`` (what the MTBF estimate counts) is
   true when no exception was uncaught, ``sys.exit`` was not given an error status, every
   job finished and the usual rules of ``close()`` hold (no unraised failure, a durable
   persistent step): a process that finished its saves and exited 0 is not a failure; one
   that raised or exited with an error status is.

Nothing here changes the exit status: 0 for a return, 1 for an uncaught exception, the code
of ``sys.exit``. CPython hands the exit status to no ``atexit`` handler, and ``SystemExit``
never reaches ``sys.excepthook``, so :func:`register` also wraps ``sys.exit`` to note the
status of the main thread's last call: ``sys.exit(n)`` with ``n`` neither 0 nor None (a
string too: Python exits 1 then) is an exit with an error status, still with its pending saves
finished, but ``clean`` false and ``reason`` naming the status (the MTBF estimate counts it
as a failure). Not seen: ``raise SystemExit(n)`` written out (it bypasses ``sys.exit``), and
a ``sys.exit(n)`` whose ``SystemExit`` the script caught and then returned normally (the
status noted is that call's).

A job given up on keeps running on its daemon thread and dies with the process; its step
stays uncommitted (never torn: the commit marker is written last). The trainer's process
group may have been destroyed already (``dist.destroy_process_group()`` before the exit):
the engine's groups go with it, so the running jobs fail (a failed record, ``clean`` false)
instead of committing; close the engine before destroying the process group.

Engines are held by weak reference: a closed or collected engine is never kept alive. A
process forked after an engine was created does not finish its parent's engines.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time
import weakref
from typing import Any

from tierckpt.tiers.lanes import finished

__all__ = ["register", "finish", "exit_status", "EXIT_WITHOUT_CLOSE"]

log = logging.getLogger(__name__)

#: the ``run_end`` record's ``exit`` value for a run whose interpreter exited with the engine open
EXIT_WITHOUT_CLOSE = "without close()"

_lock = threading.Lock()
_engines: list[weakref.ref] = []  # engines of this process, in order of creation
_pid: int | None = None  # the process that registered them (a forked child has others' engines)
_installed = False
_uncaught: BaseException | None = None  # seen by the chained sys.excepthook
_exit_calls: list[object] = []  # the status of the main thread's last sys.exit() call (seen by the wrapper)


def register(engine: Any) -> None:
    """Finish ``engine`` (a :class:`~tierckpt.engine.TieredCheckpointer`; not imported here:
    the engine imports this module) at interpreter exit unless it was closed (not collective;
    call once per engine, from its constructor). Installs the ``atexit`` handler and a chained
    ``sys.excepthook`` (to tell an uncaught exception from a return) on first use. An engine
    the trainer dropped is not kept alive (weak reference): once collected it has no save left
    to finish, and no ``run_end`` is written for it. Also wraps ``sys.exit`` (see
    :func:`exit_status`)."""
    global _installed, _pid
    with _lock:
        if _pid != os.getpid():  # first use, or a forked child: its parent's engines are not its own
            _engines.clear()
            _exit_calls.clear()
            _pid = os.getpid()
        _engines[:] = [r for r in _engines if r() is not None]
        _engines.append(weakref.ref(engine))
        if not _installed:
            _installed = True
            atexit.register(_at_exit)
            previous = sys.excepthook

            def excepthook(exc_type, exc, tb):
                global _uncaught
                _uncaught = exc
                previous(exc_type, exc, tb)

            sys.excepthook = excepthook
            sys.exit = _noting_exit(sys.exit)


def _noting_exit(previous: Any) -> Any:
    """``sys.exit`` that first notes ``status`` (main thread only: elsewhere it ends a thread,
    not the process), then calls ``previous`` (which raises ``SystemExit``)."""

    def exit(status: object = None, /) -> None:  # noqa: A001 - it replaces sys.exit
        if threading.current_thread() is threading.main_thread():
            _exit_calls[:] = [status]
        previous(status)

    exit.__doc__ = getattr(previous, "__doc__", None)
    exit._tierckpt_previous = previous  # type: ignore[attr-defined]
    return exit


def exit_status() -> object:
    """The status the main thread last passed to ``sys.exit`` in this process (None: no call,
    or ``sys.exit()``/``sys.exit(None)``: status 0)."""
    return _exit_calls[-1] if _exit_calls and _pid == os.getpid() else None


def error_status(status: object) -> bool:
    """Whether ``sys.exit(status)`` exits with a status other than 0 (None and 0 are 0; any
    other object, a message string included, is an error status)."""
    return status is not None and status != 0


def uncaught_exception() -> BaseException | None:
    """The exception that is ending the process, if any: what reached ``sys.excepthook`` (ours,
    or CPython's ``sys.last_value`` when a later hook replaced ours). None for a return or
    ``sys.exit``."""
    return _uncaught if _uncaught is not None else getattr(sys, "last_value", None)


def _at_exit() -> None:
    with _lock:
        engines = [r() for r in _engines] if _pid == os.getpid() else []
        _engines.clear()
    exc, status = uncaught_exception(), exit_status()
    for eng in engines:
        if eng is None or eng._closed:
            continue
        try:
            finish(eng, exc, status)
        except BaseException as e:  # never mask the script's own exit status
            log.error("tierckpt: exit without close(): finishing the engine failed: %s: %s", type(e).__name__, e,
                      exc_info=True)


def finish(engine: Any, exc: BaseException | None = None, status: object = None) -> list[dict]:
    """Finish ``engine`` (a :class:`~tierckpt.engine.TieredCheckpointer`) as the interpreter's
    exit does (see the module docstring): wait for its queued jobs at most ``exit_timeout_s``
    (seconds, all tiers together), then close
    it with the ``run_end`` record of an exit without ``close()``; ``exc``: the exception
    ending the process (None: a return or ``sys.exit``); ``status``: what ``sys.exit`` was
    given (:func:`exit_status`; an error status makes the run not clean). Not collective.

    Returns:
        the jobs pending at the exit that did not commit (still running after
        ``exit_timeout_s``, or failed), ``[{"tier", "step", "job", "error"}]`` (``job``:
        ``"save"`` or ``"replica rebuild"``, whose ``step`` is None), as in ``run_end.unfinished``.
    Raises:
        nothing of its own; an unexpected error of ``close()`` propagates (the ``atexit``
        handler logs it).
    """
    cfg, rank = engine.cfg, engine.topo.rank
    t0 = time.monotonic()
    deadline = t0 + cfg.exit_timeout_s
    # every job a lane still holds, not only the last one queued: a save behind a rebuild (or a
    # rebuild behind a save) that failed or hangs must be named too
    held = [(lane.tier, job) for lane in engine.jobs.lanes.values() for job in lane.held()]
    if held and rank == 0:
        log.warning("tierckpt: the interpreter is exiting without close(): finishing the %s job(s) still running "
                    "(at most exit_timeout_s = %gs)", "+".join(dict.fromkeys(t for t, _ in held)), cfg.exit_timeout_s)
    unfinished = []
    for tier, job in held:
        # not local_wait_timeout_s for the local tier (as close() does): a peer's local job
        # replicates with this rank's, so giving up on a merely slow one here would fail theirs
        error = None
        if not finished(job.future, max(0.0, deadline - time.monotonic())):
            error = f"still running after exit_timeout_s = {cfg.exit_timeout_s:g}s"
        else:
            error = job.failure()
        if error is not None:
            unfinished.append({"tier": tier, "step": job.step, "job": job.kind, "error": error[:500]})
    if unfinished:
        log.warning("tierckpt: exit without close(): left uncommitted: %s", "; ".join(
            f"{u['tier']} {u['job']}" + (f" of step {u['step']}" if u["step"] is not None else "") + f" ({u['error']})"
            for u in unfinished))
    reason = "interpreter exit without close()"
    if exc is not None:
        reason += f": {type(exc).__name__}: {exc}"
    elif error_status(status):
        reason += f": sys.exit({status!r})"
    clean = exc is None and not error_status(status) and not unfinished
    _close_bounded(engine, max(deadline - time.monotonic(), _CLOSE_FLOOR_S), clean=clean,
                   reason=reason[:2000], raise_failures=False,
                   at_exit={"exit": EXIT_WITHOUT_CLOSE, "unfinished": unfinished})
    if rank == 0:
        log.info("tierckpt: exit without close(): %s in %.1fs", "every job finished" if not unfinished
                 else f"{len(unfinished)} job(s) left unfinished", time.monotonic() - t0)
    return unfinished


#: seconds the close of an exit without close() gets when waiting for the jobs used up
#: exit_timeout_s (a healthy close takes far less: the jobs are done or abandoned by then)
_CLOSE_FLOOR_S = 5.0


def _close_bounded(engine: Any, timeout_s: float, **close_kw: Any) -> bool:
    """``engine.close(**close_kw)`` on a daemon helper thread, waited for at most ``timeout_s``
    seconds: the close reads and writes the persistent root (it confirms ``durable_step``,
    appends ``run_end``), and a root that stops answering (a hung shared file system) must
    not keep the process from exiting with its own status. Returns whether the close
    finished; an error it raised propagates. A close given up on stays on its thread and dies
    with the process (an error log says so; the ledger then has no ``run_end`` of this run,
    which counts as a failure)."""
    box: dict = {}
    engine.preemption.close()  # its signal handlers go back on this, the main thread (close() repeats it: a no-op)

    def run() -> None:
        try:
            engine.close(**close_kw)
        except BaseException as e:  # re-raised on the exiting thread
            box["error"] = e

    t = threading.Thread(target=run, name="tierckpt-exit-close", daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        log.error("tierckpt: exit without close(): closing the engine did not finish within %.1fs (the persistent "
                  "root does not answer?): exiting without the ledger's run_end", timeout_s)
        return False
    if "error" in box:
        raise box["error"]
    return True

