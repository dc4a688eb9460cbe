"""Reads of a restore's sources bounded by a stall deadline (``TierConfig.restore_read_timeout_s``).

A ``read()``/``open()`` blocked in the kernel (a hung NFS server, an NVMe that stopped
answering, a FIFO in place of a file) cannot be interrupted from Python. So every read of a
source runs on a daemon helper thread that reports its progress (:class:`Progress`: a file
opened, a chunk read), and the restoring thread waits for it only while it makes progress:
after ``timeout_s`` seconds without any, the wait raises :class:`~tierckpt.errors.ReadTimeout`
(the source failed; the restore's usual agreement makes every rank treat it so) and the
helper is left behind, never joined. Whatever it returns later lands in a box nobody reads
and it writes nowhere else: a late completion cannot touch the state or a directory.

:class:`BoundedFileSystem` applies the same bound to DCP's own reads of a checkpoint
directory (a load that reads byte ranges from disk, e.g. a replicated value DCP wrote into
another rank's file, or a persistent step).
"""

from __future__ import annotations

import contextlib
import io
import os
import pathlib
import threading
import time
from typing import Callable, TypeVar

from torch.distributed.checkpoint.filesystem import FileSystem

from tierckpt.errors import ReadTimeout
from tierckpt.io import dcp_compat  # noqa: F401  (FileSystem's methods overridden here are checked first)

T = TypeVar("T")
_CHUNK = 8 << 20  # bytes a bounded read reads between two ticks


class Progress:
    """Progress of one read on a helper thread, and the stall-bounded wait for it.

    Args:
        timeout_s: seconds without progress after which :meth:`wait_until` gives up (> 0).
        what: what is read, for the error message (e.g. a step directory's URL).
    """

    def __init__(self, timeout_s: float, what: str):
        self.timeout_s, self.what = float(timeout_s), what
        self.where = ""  # what the helper is reading now (a file), for the message
        self.abandoned = False  # the waiter gave up: the helper must not use what it reads
        self._cv = threading.Condition()
        self._last = time.monotonic()
        self._claimed = False

    def tick(self, where: str | None = None) -> None:
        """The helper made progress (``where``: the file it reads now); wakes the waiter."""
        with self._cv:
            self._last = time.monotonic()
            if where is not None:
                self.where = where
            self._cv.notify_all()

    def claim(self) -> bool:
        """The helper's last step before it hands over what it holds (open files): True, and
        the waiter no longer times out (the hand-over follows at once), unless the waiter gave
        up already (False: the helper must release what it holds itself)."""
        with self._cv:
            if self.abandoned:
                return False
            self._claimed = True
            return True

    def wait_until(self, done: Callable[[], bool]) -> None:
        """Block until ``done()`` is true (it is evaluated under this object's lock after each
        :meth:`tick`, so the helper must tick after the change that makes it true).

        Raises:
            ReadTimeout: ``timeout_s`` seconds passed without a tick while ``done()`` was false,
                or an earlier wait gave up already (at once then); :attr:`abandoned` is set (the
                helper should stop at its next tick).
        """
        with self._cv:
            while not done():
                left = self._last + self.timeout_s - time.monotonic()
                if (left <= 0 and not self._claimed) or self.abandoned:  # given up once: every later wait fails at once
                    self.abandoned = True
                    raise ReadTimeout(
                        f"{self.what}: read timed out, no progress for {self.timeout_s:g} s"
                        + (f" (reading {self.where})" if self.where else "")
                        + " (restore_read_timeout_s): a hung read; the source counts as failed")
                self._cv.wait(left if left > 0 else 1.0)


def run_bounded(fn: Callable[[Progress], T], timeout_s: float, what: str, name: str = "tierckpt-read") -> T:
    """``fn(progress)`` on a daemon helper thread; returns its result, or raises what it raised.

    ``fn`` must call ``progress.tick()`` as it goes (at least once per file opened and per
    chunk read). Raises :class:`~tierckpt.errors.ReadTimeout` when it makes no progress for
    ``timeout_s`` seconds; the helper is then left behind (its result discarded).
    """
    progress = Progress(timeout_s, what)
    box: dict = {}

    def run() -> None:
        try:
            box["result"] = fn(progress)
        except BaseException as e:  # re-raised on the waiting thread
            box["error"] = e
        finally:
            box["done"] = True
            progress.tick()

    threading.Thread(target=run, name=name, daemon=True).start()
    progress.wait_until(lambda: "done" in box)
    if "error" in box:
        raise box["error"]
    return box["result"]


# ------------------------------------------------------------------ bounded file reads for DCP
class BoundedFile(io.RawIOBase):
    """A file opened for reading whose ``open`` and every ``readinto`` run on a helper thread,
    each bounded by ``timeout_s`` seconds (:func:`run_bounded`).

    DCP's ``FileSystemReader`` reads byte ranges through a stream: with this one, a range in a
    file that blocks (a hung NFS/NVMe read, a FIFO in place of the file) raises
    :class:`~tierckpt.errors.ReadTimeout` instead of blocking the load forever. A read that
    timed out is left behind: it reads into a buffer of its own, never into the caller's, so
    a late completion touches nothing; its file is not closed under it (the file object is
    dropped with the stream, the fd freed when the stuck read returns, or with the process).

    Args:
        path: the file (a path; opened with ``pathlib.Path.open``, unbuffered).
        timeout_s: seconds each open or read may make no progress (> 0).
    Raises:
        ReadTimeout: (constructor) the open did not return within ``timeout_s`` seconds.
        OSError: the open failed.
    """

    def __init__(self, path: str | os.PathLike, timeout_s: float):
        super().__init__()
        self.path, self.timeout_s = str(path), float(timeout_s)

        def do_open(progress: Progress):
            progress.tick(self.path)
            f = pathlib.Path(self.path).open("rb", buffering=0)  # a raw FileIO: no lock a stuck read holds
            if not progress.claim():  # the waiter gave up meanwhile: nobody will close it
                f.close()
            return f

        self._f = run_bounded(do_open, self.timeout_s, f"opening {self.path}", name="tierckpt-open")
        self._stuck = False

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        return self._f.seek(offset, whence)  # lseek: no I/O, never blocks on the device

    def tell(self) -> int:
        return self._f.tell()

    def readinto(self, b) -> int:
        view = memoryview(b).cast("B")
        if self._stuck:
            raise ReadTimeout(f"{self.path}: an earlier read of this file timed out")
        n = len(view)

        def do_read(progress: Progress) -> bytearray:
            progress.tick(self.path)
            out = bytearray()
            while len(out) < n and not progress.abandoned:  # a tick per chunk: a slow disk is not a hung one
                part = self._f.read(min(_CHUNK, n - len(out)))
                if not part:
                    break
                out += part
                progress.tick()
            return out

        try:
            data = run_bounded(do_read, self.timeout_s, f"reading {self.path}", name="tierckpt-read")
        except ReadTimeout:
            self._stuck = True
            raise
        view[:len(data)] = data
        return len(data)

    def close(self) -> None:
        if not self.closed and not self._stuck:
            self._f.close()
        super().close()


class BoundedFileSystem(FileSystem):
    """DCP's POSIX ``FileSystem`` whose read streams are :class:`BoundedFile` s (each open and
    read bounded by ``timeout_s`` seconds, ``TierConfig.restore_read_timeout_s``); writes and
    every other call are DCP's own. Set it as a ``FileSystemReader``'s ``fs``."""

    def __init__(self, timeout_s: float):
        super().__init__()
        self.timeout_s = float(timeout_s)

    @contextlib.contextmanager
    def create_stream(self, path, mode: str):
        if mode != "rb":
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with io.BufferedReader(BoundedFile(path, self.timeout_s), buffer_size=1 << 20) as stream:
            yield stream
