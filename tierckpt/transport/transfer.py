"""Point-to-point file transfer between ranks over a gloo group, in bounded chunks.

Used for neighbour replication (node n's committed local step → its clique peers) and for
restore pulls (a peer's replica → the node that lost its disk). A file never sits whole in
memory: the receiver holds four buffers of ``chunk_bytes`` (a sender reading a local disk sends
from page-cache mappings, one chunk at a time; from any other store through two buffers) and
pipelines disk I/O with the network (read/hash/write chunk k while chunk k+1 is in flight). The
buffers live as long as one batch of transfers (:class:`~tierckpt.transport.wire.BufferPool`):
a process holds none between replications. The receiver checks every
file's size and xxh3-64 against the source manifest before anything is committed.

Ordering: each rank runs its sends (in a helper thread) and its receives (in the calling
thread) in increasing transfer index. A sender waiting on transfer i is waiting for a
receiver busy with a lower index, whose sender is busy with a lower index still, so the
wait-for chain always ends (no deadlock for any set of transfers).

This module is the sending side and the driver; the receiving side is
:mod:`tierckpt.transport.receive`, the stream's framing :mod:`tierckpt.transport.wire`.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import threading

import torch.distributed as dist

from tierckpt.cluster.collectives import FAILURES
from tierckpt.io import manifest
from tierckpt.io.memory_read import map_readonly
from tierckpt.io.storage import Store
from tierckpt.transport import wire
from tierckpt.transport.bounded_send import send_step_bounded
from tierckpt.transport.receive import Received, recv_step
from tierckpt.transport.wire import SHARED_MAX, Transfer

__all__ = ["SHARED_MAX", "Received", "Transfer", "recv_step", "run_transfers", "send_step", "start_transfers"]

log = logging.getLogger(__name__)


def send_step(store: Store, t: Transfer, group, chunk_bytes: int, read_timeout_s: float | None = None,
              pool: wire.BufferPool | None = None) -> int:
    """Stream this rank's share of ``t.src_rel`` to ``t.dst_rank``. Returns bytes sent.

    A missing or unreadable source still produces a header (with ``error``) so the receiver
    never waits forever; a file that shrank is padded with zeros, which the receiver's
    checksum rejects. ``read_timeout_s`` (a restore's pull, local store): every read of the
    copy is bounded, a hung one fails the transfer instead of stalling the stream
    (:func:`~tierckpt.transport.bounded_send.send_step_bounded`). ``pool``: where the two send
    buffers of a non-local store come from (the caller releases it); None: buffers of this call only.
    """
    if read_timeout_s is not None and store.local:
        return send_step_bounded(store, t, group, chunk_bytes, read_timeout_s)
    use = wire.BufferPool() if pool is None else pool
    try:
        return _send(store, t, group, chunk_bytes, use)
    finally:
        if pool is None:
            use.release()


def _send(store: Store, t: Transfer, group, chunk_bytes: int, pool: wire.BufferPool) -> int:
    """:func:`send_step` with its buffer pool."""
    dst = wire.group_rank(t.dst_rank, group)
    doc = None
    try:
        mbytes = store.read_bytes(f"{t.src_rel}/{manifest.MANIFEST}")
        doc = manifest.read_committed(store, t.src_rel)
        if doc is None:
            raise FileNotFoundError(f"{store.url_of(t.src_rel)} is not committed")
    except (OSError, ValueError) as e:
        wire.send_header({"error": f"{type(e).__name__}: {e}"}, dst, group)
        return 0
    idx, cnt = t.share
    every = manifest.entries_of(doc)
    entries = manifest.split_share(every, idx, cnt)
    extra = [e for e in every if t.shared_files and e not in entries and e.size <= SHARED_MAX
             and manifest.rank_of_file(e.path) is None]
    wire.send_header({"manifest": mbytes.decode(), "files": [e.__dict__ for e in entries],
                      "extra": [e.__dict__ for e in extra]}, dst, group)
    entries = extra + entries  # first: a receiver loading while the stream arrives plans from .metadata
    _read_ahead(store, t.src_rel, entries)
    sent = 0
    bufs = None
    pending: collections.deque = collections.deque()
    k = 0
    for entry in entries:
        path = f"{t.src_rel}/{entry.path}"
        fd = _open_exact(store, path, entry.size)
        if fd is not None:
            # Send straight from the page cache, one mapping per chunk: the kernel reads chunk
            # k+1 ahead (map_readonly's hint) while chunk k is on the network. The hint repeats
            # _read_ahead's on purpose: a share larger than the free page cache loses its early
            # pages before they are sent, and the second hint reads them back in time.
            try:
                for off in range(0, entry.size, chunk_bytes):
                    data = map_readonly(fd, off, min(chunk_bytes, entry.size - off))
                    if len(pending) >= 2:
                        pending.popleft().wait()
                    pending.append(wire.work(dist.isend(data, dst, group=group)))
                    sent += data.numel()
            finally:
                os.close(fd)
            continue
        bufs = bufs or pool.get("send", chunk_bytes, 2)
        try:
            f = store.open(path, "rb")
        except OSError:
            f = None
        remaining = entry.size
        while remaining:
            n = min(chunk_bytes, remaining)
            if len(pending) >= 2:
                pending.popleft().wait()
            view = bufs[k % 2].numpy().data[:n]
            got = 0
            if f is not None:
                try:
                    got = f.readinto(view) or 0  # type: ignore[attr-defined]  # files open buffered
                except OSError:
                    got = 0
            if got < n:
                view[got:n] = bytes(n - got)
            pending.append(wire.work(dist.isend(bufs[k % 2][:n], dst, group=group)))
            remaining -= n
            sent += n
            k += 1
        if f is not None:
            f.close()
    while pending:
        pending.popleft().wait()
    return sent


def _read_ahead(store: Store, rel: str, entries: list[manifest.FileEntry]) -> None:
    """Queue the kernel's read of every file about to be sent (``POSIX_FADV_WILLNEED``, returns
    at once): the stream's reads reach the disk before those of work started after this (a
    restore's read of the node's own copy), and stay ahead of the network."""
    if not store.local:
        return
    for e in entries:
        with contextlib.suppress(OSError, AttributeError):  # a hint: a missing file fails later, reported
            fd = os.open(store.path(f"{rel}/{e.path}"), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, e.size, os.POSIX_FADV_WILLNEED)
            finally:
                os.close(fd)


def _open_exact(store: Store, rel: str, size: int) -> int | None:
    """A read-only descriptor of a local file of exactly ``size`` > 0 bytes, else None (the
    buffered path then pads a file that shrank, which the receiver's checksum rejects)."""
    if not store.local or size <= 0:
        return None
    try:
        fd = os.open(store.path(rel), os.O_RDONLY)
    except OSError:
        return None
    with contextlib.suppress(OSError):
        if os.fstat(fd).st_size == size:
            return fd
    os.close(fd)
    return None


def run_transfers(transfers: list[Transfer], rank: int, store: Store, group,
                  chunk_bytes: int, keep: int = 0, stream: bool = False) -> dict[int, Received]:
    """Execute this rank's part of ``transfers`` (every rank passes the same list).

    Never raises for a transfer problem, so every rank reaches the collective that agrees on
    the outcome: a receive that fails (a gloo error such as "Pair is not connected", a peer
    gone, a stream out of step) is a :class:`Received` with the error in ``problems``; a
    failed send is logged, and its receiver sees a short or bad stream. A transfer from a
    rank to itself is refused on both sides before any byte moves (``problems`` says so).
    ``keep``: receivers keep up to that many bytes per transfer in memory and return before
    their disk writes end (see :func:`recv_step`): call :meth:`Received.finish` on every result.
    ``stream``: kept receives return once posted (see :func:`recv_step`).

    Returns:
        {transfer index: Received} for the transfers this rank received.
    """
    out, th = start_transfers(transfers, rank, store, group, chunk_bytes, keep, stream)
    th.join()  # never leave the sender running into the caller's next collective
    return out


def start_transfers(transfers: list[Transfer], rank: int, store: Store, group, chunk_bytes: int,
                    keep: int = 0, stream: bool = False, read_timeout_s: float | None = None
                    ) -> tuple[dict[int, Received], threading.Thread]:
    """:func:`run_transfers` that returns once this rank's receives are done (or posted, with
    ``stream``) while its sends may still run: (results, sender thread). The caller must join
    the thread before this rank's next transfer (two streams to one peer must not interleave)
    and before a collective over ``group``; it may do other work meanwhile (a restore
    loads its own copy). The sends' and the receives' chunk buffers are released when each
    side is done (:class:`~tierckpt.transport.wire.BufferPool`). ``read_timeout_s``: bound the
    sends' reads (see :func:`send_step`)."""
    sends = [t for t in transfers if t.src_rank == rank and t.dst_rank != rank]

    def sender():
        pool = wire.BufferPool()
        try:
            for t in sends:
                try:
                    send_step(store, t, group, chunk_bytes, read_timeout_s, pool=pool)
                except BaseException as e:  # the receiver reports it: its stream ended short or wrong
                    log.error("tierckpt transfer %s: send failed: %s: %s", t.tag, type(e).__name__, e)
                    return
        finally:
            pool.release()

    th = threading.Thread(target=sender, name="tierckpt-send", daemon=True)
    th.start()
    out = {}
    pool = wire.BufferPool()
    try:
        for i, t in enumerate(transfers):
            if t.dst_rank != rank:
                continue
            if t.src_rank == rank:
                out[i] = Received(t, problems=[f"{t.tag}: a transfer from rank {rank} to itself (not sent)"])
                continue
            try:
                out[i] = recv_step(store, t, group, chunk_bytes, keep, stream, pool=pool)
            except FAILURES as e:
                log.error("tierckpt transfer %s: receive failed: %s: %s", t.tag, type(e).__name__, e)
                out[i] = Received(t, problems=[f"{t.tag}: receive failed: {type(e).__name__}: {e}"])
    except BaseException:
        th.join()
        raise
    finally:
        pool.release()  # a kept receive still streaming uses its own buffers, not the pool's
    return out, th
