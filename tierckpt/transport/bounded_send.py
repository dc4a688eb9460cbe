"""The sending side of a restore pull with bounded reads (``TierConfig.restore_read_timeout_s``).

A peer sending a replica reads its copy from its own disk; a read there that hangs (an NVMe
that stopped answering, a FIFO in place of a file) must not hang the receiver, the sender's
restore, or the group: the receiver has posted a receive for every chunk, so the stream must
always be completed. Here every read happens on helper threads (:mod:`tierckpt.io.bounded`):
the manifest and the opening of every file *before* the header (a stall there sends a header
with the error: the receiver's pull fails naming the timeout), then each chunk mapped and its
pages faulted in ahead of the network by a prefetch thread, so gloo's send thread never takes
a page fault on a hung disk. When the prefetch makes no progress for the bound, the rest of
the stream is sent as zeros (the receiver's checksum rejects it: the pull fails, agreed, like
a corrupt one) and the prefetch thread is left behind; it stops at its next step and sends
nothing. Same stream, same header, same chunking as :func:`tierckpt.transport.transfer.send_step`.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import threading

import torch
import torch.distributed as dist

from tierckpt.errors import ReadTimeout
from tierckpt.io import manifest
from tierckpt.io.bounded import Progress, run_bounded
from tierckpt.io.memory_read import map_readonly, touch_share
from tierckpt.io.storage import Store
from tierckpt.transport import wire
from tierckpt.transport.wire import SHARED_MAX, Transfer

log = logging.getLogger(__name__)
_AHEAD = 3  # chunks mapped and read ahead of the network


def _prepare(store: Store, t: Transfer, progress: Progress):
    """Manifest, share and one descriptor per file of exactly the manifest's size (else None)."""
    progress.tick(f"{t.src_rel}/{manifest.MANIFEST}")
    mbytes = store.read_bytes(f"{t.src_rel}/{manifest.MANIFEST}")
    doc = manifest.read_committed(store, t.src_rel)
    if doc is None:
        raise FileNotFoundError(f"{store.url_of(t.src_rel)} is not committed")
    idx, cnt = t.share
    every = manifest.entries_of(doc)
    entries = manifest.split_share(every, idx, cnt)
    extra = [e for e in every if t.shared_files and e not in entries and e.size <= SHARED_MAX
             and manifest.rank_of_file(e.path) is None]
    fds: list[int | None] = []
    try:
        for e in extra + entries:
            progress.tick(f"{t.src_rel}/{e.path}")
            fds.append(_open_exact(store.path(f"{t.src_rel}/{e.path}"), e.size))
    except BaseException:
        _close(fds)
        raise
    if not progress.claim():  # the sender gave up on this read meanwhile: nobody will close them
        _close(fds)
        raise ReadTimeout(f"{store.url_of(t.src_rel)}: read abandoned")
    return mbytes, entries, extra, fds


def _open_exact(path: str, size: int) -> int | None:
    if size <= 0:
        return None
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    with contextlib.suppress(OSError):
        if os.fstat(fd).st_size == size:
            os.posix_fadvise(fd, 0, size, os.POSIX_FADV_WILLNEED)  # the stream's reads reach the disk first
            return fd
    os.close(fd)
    return None


def _close(fds) -> None:
    for fd in fds:
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)


class _Prefetch:
    """Maps each chunk of the stream and faults its pages in, ``_AHEAD`` chunks ahead of the
    sender, on a daemon thread; :meth:`next` waits for the next chunk, bounded."""

    def __init__(self, entries: list[manifest.FileEntry], fds: list[int | None], chunk_bytes: int,
                 progress: Progress):
        self.progress = progress
        self.ready: collections.deque = collections.deque()
        self.room = threading.Semaphore(_AHEAD)
        self.thread = threading.Thread(target=self._run, args=(entries, fds, chunk_bytes), daemon=True,
                                       name="tierckpt-send-read")
        self.thread.start()

    def _run(self, entries, fds, chunk_bytes) -> None:
        try:
            for e, fd in zip(entries, fds):
                for off in range(0, e.size, chunk_bytes):
                    n = min(chunk_bytes, e.size - off)
                    while not self.room.acquire(timeout=1.0):
                        if self.progress.abandoned:
                            return
                    if self.progress.abandoned:
                        return
                    # the bound starts now: the time spent waiting for room was the receiver's pace
                    self.progress.tick(e.path)
                    data = None
                    if fd is not None:
                        with contextlib.suppress(OSError):
                            data = map_readonly(fd, off, n)
                            touch_share([manifest.FileEntry(e.path, n, "")], {e.path: data}, lambda *_: None)
                    self.ready.append(data)  # None: not readable, sent as zeros
                    self.progress.tick(e.path)
        finally:
            _close(fds)

    def next(self) -> torch.Tensor | None:
        """The next chunk's bytes (None: unreadable). Raises ``ReadTimeout`` (no progress)."""
        self.progress.wait_until(lambda: bool(self.ready))
        self.room.release()
        return self.ready.popleft()


def send_step_bounded(store: Store, t: Transfer, group, chunk_bytes: int, timeout_s: float) -> int:
    """:func:`~tierckpt.transport.transfer.send_step` with every read of the local copy bounded by
    ``timeout_s`` seconds without progress (see the module docstring). Returns bytes sent
    (zeros included); never leaves the receiver waiting for a chunk."""
    dst = wire.group_rank(t.dst_rank, group)
    try:
        mbytes, entries, extra, fds = run_bounded(lambda p: _prepare(store, t, p), timeout_s,
                                                  f"sending {store.url_of(t.src_rel)}", name="tierckpt-send-open")
    except (OSError, ValueError) as err:  # ReadTimeout is an OSError
        log.error("tierckpt transfer %s: %s: %s", t.tag, type(err).__name__, err)
        wire.send_header({"error": f"{type(err).__name__}: {err}"}, dst, group)
        return 0
    wire.send_header({"manifest": mbytes.decode(), "files": [e.__dict__ for e in entries],
                      "extra": [e.__dict__ for e in extra]}, dst, group)
    every = extra + entries  # first: a receiver loading while the stream arrives plans from .metadata
    progress = Progress(timeout_s, f"sending {store.url_of(t.src_rel)}")
    ahead = _Prefetch(every, fds, chunk_bytes, progress)
    pending: collections.deque = collections.deque()
    zeros: torch.Tensor | None = None
    sent = 0
    hung: ReadTimeout | None = None
    for e in every:
        for off in range(0, e.size, chunk_bytes):
            n = min(chunk_bytes, e.size - off)
            data = None
            if hung is None:
                try:
                    data = ahead.next()
                except ReadTimeout as ex:  # the rest goes as zeros: the receiver's checksum fails the pull
                    hung = ex
                    log.error("tierckpt transfer %s: %s; sending zeros for the rest of the stream", t.tag, ex)
            if data is None:
                zeros = zeros if zeros is not None else torch.zeros(chunk_bytes, dtype=torch.uint8)
                data = zeros[:n]
            if len(pending) >= 2:
                pending.popleft().wait()
            pending.append(wire.work(dist.isend(data, dst, group=group)))
            sent += n
    while pending:
        pending.popleft().wait()
    return sent
