"""The background worker of a tier: one daemon thread running jobs in submission order.

Why not ``concurrent.futures.ThreadPoolExecutor``: its threads are joined when the
interpreter exits, so a local-tier job stuck on a hung node-local disk would keep a finished
trainer from exiting even after :meth:`tierckpt.engine.TieredCheckpointer.close` gave up on
it. Jobs here still return a standard :class:`concurrent.futures.Future`.
"""

from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import Future

from tierckpt.priority import BackgroundPriority, lower_current_thread

log = logging.getLogger(__name__)


class DaemonWorker:
    """A single daemon thread executing submitted callables one at a time, FIFO.

    Args:
        name: the thread's name (shows in stack dumps: ``tierckpt-local``).
        priority: the CPU and I/O priority the thread lowers itself to before its first job
            (:mod:`tierckpt.priority`); threads a job starts inherit it. None: unchanged.
    """

    def __init__(self, name: str, priority: BackgroundPriority | None = None):
        self.name = name
        self.priority = priority
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._dead = False  # set (under the lock) by a dying thread, before it drains the queue
        self._thread = self._start()

    def _start(self) -> threading.Thread:
        th = threading.Thread(target=self._run, name=self.name, daemon=True)
        th.start()
        return th

    def submit(self, fn, *args) -> Future:
        """Queue ``fn(*args)``; the Future holds its result or exception. A worker whose thread
        died (a bug outside any job) is replaced first, so later jobs still run."""
        fut: Future = Future()
        with self._lock:
            if self._dead or not self._thread.is_alive():
                log.error("tierckpt: the %s worker thread had died; starting a new one", self.name)
                self._dead = False
                self._thread = self._start()
            self._q.put((fut, fn, args))
        return fut

    def _run(self) -> None:
        fut = None
        lower_current_thread(self.priority)
        try:
            while True:
                item = self._q.get()
                if item is None:
                    return
                fut, fn, args = item
                item = None
                if not fut.set_running_or_notify_cancel():
                    fut = None
                    continue
                self._execute(fut, fn, args)
                fut = fn = args = None
        except BaseException as e:  # the thread dies: nobody may wait forever on its jobs
            self._orphan(fut, e)
            raise

    @staticmethod
    def _execute(fut: Future, fn, args) -> None:
        result, error = None, None
        try:
            result = fn(*args)
        except BaseException as e:  # the Future carries it to whoever waits
            error = e
        # free the job's objects (staged tensors, gloo work) here, before the waiter goes on
        # and perhaps exits: a daemon thread must not run destructors during finalisation
        fn = args = None
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)

    def _orphan(self, current: Future | None, cause: BaseException) -> None:
        """Fail the job in hand and every queued one with the cause of the thread's death."""
        err = RuntimeError(f"the {self.name} worker thread died: {type(cause).__name__}: {cause}")
        log.error("tierckpt: %s", err)
        pending = [current] if current is not None else []
        with self._lock:
            self._dead = True
            while True:
                try:
                    item = self._q.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    self._q.put(None)  # a shutdown request stays for the replacement thread
                    break
                pending.append(item[0])
        for f in pending:
            if not f.done():
                f.set_exception(err)

    def shutdown(self, wait: bool = True) -> None:
        """Stop after the queued jobs; ``wait`` joins the thread (False: leave a stuck job
        behind, the daemon thread does not hold up interpreter exit)."""
        self._q.put(None)
        if wait:
            self._thread.join()
