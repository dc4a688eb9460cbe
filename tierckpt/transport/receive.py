"""The receiving side of a file transfer (:mod:`tierckpt.transport.transfer`): chunks received,
hashed and written on a writer thread (:func:`recv_step`), or, for a restore, kept in memory
and used as they arrive (a streamed receive, :class:`Received`)."""

from __future__ import annotations

import logging
import os
import queue
import threading
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import xxhash

from tierckpt.cluster.collectives import FAILURES
from tierckpt.io import manifest
from tierckpt.io.storage import Store
from tierckpt.transport import wire
from tierckpt.transport.wire import Transfer

log = logging.getLogger(__name__)
_ALIGN = 4096
RECV_BUFFERS = 4  # chunk buffers of a receive to disk: two in flight, two hashed or being written


@dataclass
class Received:
    """What a receiver got for one :class:`Transfer`."""

    transfer: Transfer
    entries: list[manifest.FileEntry] = field(default_factory=list)
    manifest_bytes: bytes | None = None
    problems: list[str] = field(default_factory=list)
    nbytes: int = 0
    # {file path: its bytes (uint8)} when the receiver kept a copy in memory: the share's files
    # that arrived intact, plus the memory-only shared files (Transfer.shared_files)
    memory: dict[str, torch.Tensor] = field(default_factory=dict)
    # the writer of a kept receive: nothing is written to disk before finish()
    sink: _FileSink | None = field(default=None, repr=False)
    # a kept receive still arriving (recv_step(stream=True)): see wait_bytes() and complete()
    stream: _Stream | None = field(default=None, repr=False)

    @property
    def ok(self) -> bool:
        """Every file of the share arrived with matching size and checksum (and, once
        :meth:`finish` ran, was written)."""
        return not self.problems and self.manifest_bytes is not None

    def wait_bytes(self, path: str, end: int) -> None:
        """Block until the first ``end`` bytes of file ``path`` of a streamed receive are in
        :attr:`memory` (not yet verified: only :meth:`complete` knows). Raises what the
        transport raises (a peer gone). A no-op once complete or for a finished receive."""
        if self.stream is not None:
            self.stream.wait_bytes(path, end)

    def complete(self) -> None:
        """Wait for the rest of a streamed receive and check every file's checksum: a file
        that does not match is a problem and leaves :attr:`memory`, and :attr:`entries` lists
        the intact files. Never raises for a transport error (it is a problem). Idempotent."""
        stream, self.stream = self.stream, None
        if stream is not None:
            stream.complete(self)

    def finish(self) -> None:
        """Write and fsync the files of a kept receive (``recv_step(keep=...)`` returns before
        writing them; :meth:`complete` first); a failed write becomes a problem and its entry
        is dropped. Idempotent; a no-op for a receive that was not kept."""
        self.complete()
        sink, self.sink = self.sink, None
        if sink is None:
            return
        sink.close()
        failed = {sink.entries[i].path: why for i, why in sink.failed.items()}
        self.problems += [f"{self.transfer.dst_rel}/{p}: write failed: {why}" for p, why in failed.items()]
        self.entries = [e for e in self.entries if e.path not in failed]


def _aligned(size: int) -> torch.Tensor:
    """A uint8 tensor of ``size`` rounded up to :data:`_ALIGN` bytes, page-aligned, so O_DIRECT
    can write any chunk of it. From torch's allocator, not a fresh anonymous mapping: its first
    touch (by the receive) costs less (0.05 vs 0.08 s per 256 MiB here, measured in one
    process; bench/probe_memory.py measures fresh interpreters)."""
    cap = max(_ALIGN, -(-size // _ALIGN) * _ALIGN)
    raw = torch.empty(cap + _ALIGN, dtype=torch.uint8)
    start = -raw.data_ptr() % _ALIGN
    return raw[start: start + cap]


class _FileSink:
    """Writes received chunks to one transfer's files on its own thread (disk writes overlap
    the next receives); owns the file descriptors and the per-file write errors.

    ``entries``: the files of the stream in order; the first ``n_extra`` are memory-only
    (never written). ``keep``: chunks are received straight into one page-aligned buffer per
    file (``memory``) and written from there once :meth:`close` is called: a restore loads
    from memory first, and its disk writes do not compete with the transfer (on the sender's
    disk read, or for the CPU)."""

    def __init__(self, store: Store, dst_rel: str, entries: list[manifest.FileEntry], bufs: list,
                 keep: bool = False, n_extra: int = 0, chunk_bytes: int = _ALIGN):
        self.store, self.dst_rel, self.entries, self.bufs = store, dst_rel, entries, bufs
        self.n_extra = n_extra
        self.fds: dict[int, tuple[int, bool]] = {}
        self.failed: dict[int, str] = {}
        self.keep = keep
        # O_DIRECT writes from a file buffer need chunk offsets that are multiples of _ALIGN
        self.direct_ok = not keep or chunk_bytes % _ALIGN == 0
        self.full: dict[int, torch.Tensor] = {}
        self.memory: dict[int, torch.Tensor] = {}
        if keep:
            for i, e in enumerate(entries):
                self.full[i] = _aligned(e.size)
                self.memory[i] = self.full[i][: e.size]
        self.free: queue.Queue = queue.Queue()
        for b in range(len(bufs)):
            self.free.put(b)
        self.writes: queue.Queue = queue.Queue()
        for i, e in enumerate(entries):  # empty files have no chunks
            if e.size == 0 and i >= n_extra:
                self._open(i)
                self._finish(i)
        self.thread = threading.Thread(target=self._run, name="tierckpt-recv-write", daemon=True)
        if not keep:
            self.thread.start()

    def _open(self, i: int) -> None:
        rel = f"{self.dst_rel}/{self.entries[i].path}"
        try:
            # created with the local root's modes (local_permissions), parents included
            flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
            try:
                if not self.direct_ok:
                    raise OSError("chunk offsets not aligned for O_DIRECT")
                self.fds[i] = (self.store.create_fd(rel, flags | getattr(os, "O_DIRECT", 0)), hasattr(os, "O_DIRECT"))
            except OSError:  # tmpfs and some network filesystems refuse O_DIRECT
                self.fds[i] = (self.store.create_fd(rel, flags), False)
        except OSError as ex:
            self.failed[i] = f"{type(ex).__name__}: {ex}"

    def _finish(self, i: int) -> None:
        fd, direct = self.fds.pop(i, (None, False))
        if fd is None:
            return
        try:
            if direct:
                os.ftruncate(fd, self.entries[i].size)
            os.fsync(fd)
        except OSError as ex:
            self.failed.setdefault(i, f"{type(ex).__name__}: {ex}")
        finally:
            self._close(i, fd)

    def _close(self, i: int, fd: int) -> None:
        # close() can report a deferred write error (NFS: EIO, ENOSPC): the file failed, and
        # the writer thread must live on (the receive waits for its buffers)
        try:
            os.close(fd)
        except OSError as ex:
            self.failed.setdefault(i, f"close: {type(ex).__name__}: {ex}")

    def _write(self, i: int, b: int | None, off: int, n: int) -> None:
        if i not in self.fds and i not in self.failed:
            self._open(i)
        if i not in self.fds:
            return
        fd, direct = self.fds[i]
        whole = self.bufs[b].numpy().data if b is not None else self.full[i].numpy().data[off:]
        view = whole[: -(-n // _ALIGN) * _ALIGN] if direct else whole[:n]
        try:
            done = 0
            while done < len(view):
                done += os.write(fd, view[done:])
        except OSError as ex:
            self.failed[i] = f"{type(ex).__name__}: {ex}"
            self._close(i, self.fds.pop(i)[0])

    def target(self, i: int, off: int, n: int) -> tuple[int | None, torch.Tensor]:
        """(buffer index or None, tensor to receive chunk ``off:off+n`` of file ``i`` into)."""
        if self.keep:
            return None, self.memory[i][off: off + n]
        b = self.free.get()
        return b, self.bufs[b][:n]

    def _run(self) -> None:
        while True:
            item = self.writes.get()
            if item is None:
                return
            i, b, off, n, last = item
            try:
                self._write(i, b, off, n)
                if last:
                    self._finish(i)
            except Exception as ex:  # the file failed; the thread lives on, or the receive would hang
                self.failed.setdefault(i, f"{type(ex).__name__}: {ex}")
            finally:
                if b is not None:
                    self.free.put(b)

    def close(self) -> None:
        """Let the writer write what was queued (a kept receive's writes start here) and stop."""
        if self.thread.ident is None:
            self.thread.start()
        self.writes.put(None)
        self.thread.join()


def recv_step(store: Store, t: Transfer, group, chunk_bytes: int, keep: int = 0, stream: bool = False,
              pool: wire.BufferPool | None = None) -> Received:
    """Receive one :class:`Transfer` into ``t.dst_rel`` of ``store``, verifying as it goes.

    Two receives stay in flight while the previous chunk is hashed; a writer thread writes
    hashed chunks (:data:`RECV_BUFFERS` buffers of ``chunk_bytes`` in rotation, from ``pool``,
    which the caller releases; None: buffers of this call only), so disk and network overlap. Files are
    written with O_DIRECT from page-aligned buffers where the filesystem allows it (the
    buffered write path was the bottleneck: bench/RESULTS.md), the padded tail truncated
    away, then fsynced. Nothing is committed here (the node leader commits once every share
    of the step arrived intact). After a write error (ENOSPC, …) the stream is still drained
    so the sender never blocks.

    ``keep``: when the files sent (the share plus the transfer's memory-only shared files)
    total at most ``keep`` bytes, receive each straight into memory (:attr:`Received.memory`:
    those that arrived intact) and return as soon as the last byte arrived and was
    checksummed, before anything is written: :meth:`Received.finish` writes and fsyncs the
    files, and must be called before committing (a restore loads from memory first). 0: keep
    nothing. Where the allocator refuses those buffers (RuntimeError/MemoryError), the files
    are received to disk as with ``keep=0``, with a warning; any other local failure before the
    first receive is posted drains the stream (the sender finishes) and raises. ``stream``
    (with a kept receive): return right after posting every chunk's receive; the caller uses
    the bytes as they arrive (:meth:`Received.wait_bytes`) and must call
    :meth:`Received.complete` (or ``finish``) to learn whether they were intact. A kept
    receive uses no chunk buffers: its host memory is the files' bytes.
    """
    use = wire.BufferPool() if pool is None else pool
    try:
        return _recv(store, t, group, chunk_bytes, keep, stream, use)
    finally:
        if pool is None:
            use.release()  # a kept receive still streaming uses its own buffers


def _recv(store: Store, t: Transfer, group, chunk_bytes: int, keep: int, stream: bool,
          pool: wire.BufferPool) -> Received:
    """:func:`recv_step` with its buffer pool."""
    src = wire.group_rank(t.src_rank, group)
    res = Received(t)
    header = wire.recv_header(src, group)
    if "error" in header:
        res.problems.append(f"sender rank {t.src_rank}: {header['error']}")
        return res
    res.manifest_bytes = header["manifest"].encode()
    extra = [manifest.FileEntry(**d) for d in header.get("extra", [])]
    every = extra + [manifest.FileEntry(**d) for d in header["files"]]  # in stream order
    keep = keep > 0 and sum(e.size for e in every) <= keep  # memory-only files are drained otherwise
    chunks = [(i, off, min(chunk_bytes, e.size - off)) for i, e in enumerate(every)
              for off in range(0, e.size, chunk_bytes)]
    try:
        sink = None
        if keep:
            try:
                sink = _FileSink(store, t.dst_rel, every, [], True, len(extra), chunk_bytes)
            except (RuntimeError, MemoryError) as ex:  # the allocator refused the share's buffers
                # receive to disk instead: the stream must be drained either way, or the sender
                # waits for this rank until the group's timeout
                log.warning("tierckpt transfer %s: no memory to keep %d bytes (%s: %s); receiving to disk",
                            t.tag, sum(e.size for e in every), type(ex).__name__, str(ex))
                keep = False
        if sink is None:
            sink = _FileSink(store, t.dst_rel, every, pool.get("recv", chunk_bytes, RECV_BUFFERS), False, len(extra))
    except FAILURES:
        _drain(chunks, src, group)  # a local failure before any receive was posted
        raise
    if keep:
        res.sink, res.stream = sink, _Stream(every, len(extra), chunks, sink, src, group)
        res.memory = {e.path: sink.memory[i] for i, e in enumerate(every)}
        if not stream:
            res.complete()
        return res
    hashers = [xxhash.xxh3_64() for _ in every]
    try:
        res.nbytes = _receive_chunks(chunks, hashers, sink, len(extra), src, group)
    finally:
        sink.close()
    for i, e in enumerate(every):
        if i in sink.failed:
            res.problems.append(f"{t.dst_rel}/{e.path}: write failed: {sink.failed[i]}")
        elif e.size and hashers[i].hexdigest() != e.xxh3_64:
            res.problems.append(f"{t.dst_rel}/{e.path}: checksum mismatch on receipt")
        elif i >= len(extra):
            res.entries.append(e)
    return res


def _drain(chunks: list[tuple[int, int, int]], src: int, group) -> None:
    """Receive and discard ``chunks`` ((file index, offset, bytes)), so that their sender is not
    left waiting for this rank until the group's timeout; best effort (logged if it fails)."""
    if not chunks:
        return
    try:
        scratch = torch.empty(max(n for _, _, n in chunks), dtype=torch.uint8)
        for _, _, n in chunks:
            wire.work(dist.irecv(scratch[:n], src, group=group)).wait()
    except FAILURES as ex:
        log.error("tierckpt transfer: draining a failed receive from group rank %d failed: %s: %s",
                  src, type(ex).__name__, str(ex))


def _receive_chunks(chunks: list[tuple[int, int, int]], hashers: list, sink: _FileSink, n_extra: int,
                    src: int, group) -> int:
    """Receive ``chunks`` ((file index, offset, bytes) in stream order) with two receives in
    flight, hash each, queue it for the sink (the first ``n_extra`` files are memory-only:
    drained); returns the bytes received."""
    in_flight = 2
    works = {}
    nbytes = 0

    def post(k: int):
        i, off, n = chunks[k]
        b, view = sink.target(i, off, n)
        return b, view, wire.work(dist.irecv(view, src, group=group))

    for k in range(min(in_flight, len(chunks))):
        works[k] = post(k)
    for k, (i, off, n) in enumerate(chunks):
        b, view, w = works.pop(k)
        w.wait()
        hashers[i].update(view.numpy().data)
        nbytes += n
        if i >= n_extra:
            sink.writes.put((i, b, off, n, k + 1 == len(chunks) or chunks[k + 1][0] != i))
        elif b is not None:
            sink.free.put(b)
        if k + in_flight < len(chunks):
            works[k + in_flight] = post(k + in_flight)
    return nbytes


class _Stream:
    """A kept receive in progress: every chunk's ``irecv`` is posted at once, straight into its
    file's buffer (the memory is allocated for the whole share anyway), so the sender never
    waits for this rank and the caller may use each file's bytes as soon as they arrived
    (:meth:`wait_bytes`). Chunks are hashed, and queued for the sink's deferred writes, in
    stream order as they are waited for."""

    def __init__(self, every: list[manifest.FileEntry], n_extra: int, chunks: list[tuple[int, int, int]],
                 sink: _FileSink, src: int, group):
        self.every, self.n_extra, self.chunks, self.sink = every, n_extra, chunks, sink
        self.index = {e.path: i for i, e in enumerate(every)}
        self.hashers = [xxhash.xxh3_64() for _ in every]
        self.works: list = []
        self.done = 0  # chunks waited for and hashed
        self.nbytes = 0
        self.error: str | None = None
        try:
            for i, off, n in chunks:
                view = sink.memory[i][off: off + n]
                # first touch here, chunk by chunk while earlier chunks arrive: page faults
                # taken inside gloo's receive cost twice as much (0.16 vs 0.12 s per 256 MiB)
                view.zero_()
                self.works.append(wire.work(dist.irecv(view, src, group=group)))
        except FAILURES as ex:  # the rest is never posted: complete() reports it
            self.error = f"receive failed: {type(ex).__name__}: {ex}"

    def _advance(self) -> None:
        k = self.done
        i, off, n = self.chunks[k]
        self.works[k].wait()
        self.hashers[i].update(self.sink.memory[i][off: off + n].numpy().data)
        self.nbytes += n
        if i >= self.n_extra:
            last = k + 1 == len(self.chunks) or self.chunks[k + 1][0] != i
            self.sink.writes.put((i, None, off, n, last))
        self.done += 1

    def wait_bytes(self, path: str, end: int) -> None:
        """See :meth:`Received.wait_bytes`."""
        i = self.index[path]
        while self.done < len(self.works):
            fi, off, n = self.chunks[self.done]
            if fi > i or (fi == i and off >= end):
                return
            self._advance()
        if self.error is not None or self.done < len(self.chunks):
            raise RuntimeError(f"tierckpt transfer: {self.error or 'stream ended early'}")

    def complete(self, res: Received) -> None:
        """See :meth:`Received.complete`."""
        try:
            while self.done < len(self.works):
                self._advance()
        except FAILURES as ex:
            self.error = self.error or f"receive failed: {type(ex).__name__}: {ex}"
        res.nbytes = self.nbytes
        tag = res.transfer.dst_rel
        if self.error is not None or self.done < len(self.chunks):
            res.problems.append(f"{tag}: {self.error or 'stream ended early'}")
            res.memory = {}
            return
        for i, e in enumerate(self.every):
            if e.size and self.hashers[i].hexdigest() != e.xxh3_64:
                res.problems.append(f"{tag}/{e.path}: checksum mismatch on receipt")
                res.memory.pop(e.path, None)
            elif i >= self.n_extra:
                res.entries.append(e)
