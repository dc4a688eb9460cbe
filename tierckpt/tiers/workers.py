"""The background worker of a tier: one daemon thread running jobs in submission order.

Why not ``concurrent.futures.ThreadPoolExecutor``: its threads are joined when the
interpreter exits, so a local-tier job stuck on a hung node-local disk would keep a finished
trainer from exiting even after :meth:`tierckpt.engine.TieredCheckpointer.close` gave up on
it. Jobs here still return a standard :class:`concurrent.futures.Future`.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future


class DaemonWorker:
    """A single daemon thread executing submitted callables one at a time, FIFO.

    Args:
        name: the thread's name (shows in stack dumps: ``tierckpt-local``).
    """

    def __init__(self, name: str):
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn, *args) -> Future:
        """Queue ``fn(*args)``; the Future holds its result or exception."""
        fut: Future = Future()
        self._q.put((fut, fn, args))
        return fut

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            fut, fn, args = item
            item = None
            if not fut.set_running_or_notify_cancel():
                continue
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
            fut = result = error = None

    def shutdown(self, wait: bool = True) -> None:
        """Stop after the queued jobs; ``wait`` joins the thread (False: leave a stuck job
        behind, the daemon thread does not hold up interpreter exit)."""
        self._q.put(None)
        if wait:
            self._thread.join()
