"""Point-to-point file transfer between ranks over a gloo group, in bounded chunks.

Used for neighbour replication (node n's committed local step → its clique peers) and for
restore pulls (a peer's replica → the node that lost its disk). A file never sits whole in
memory: each side holds two buffers of ``chunk_bytes`` and pipelines disk I/O with the
network (read/hash/write chunk k while chunk k+1 is in flight). The receiver checks every
file's size and xxh3-64 against the source manifest before anything is committed.

Ordering: each rank runs its sends (in a helper thread) and its receives (in the calling
thread) in increasing transfer index. A sender waiting on transfer i is waiting for a
receiver busy with a lower index, whose sender is busy with a lower index still, so the
wait-for chain always ends (no deadlock for any set of transfers).
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import mmap
import os
import queue
import threading
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import xxhash

from tierckpt.dist.collectives import FAILURES
from tierckpt.io import manifest
from tierckpt.io.memory_read import map_readonly
from tierckpt.io.storage import Store

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Transfer:
    """One (sender rank → receiver rank) stream of a step directory's files.

    Attributes:
        src_rank, dst_rank: global ranks (must be members of the group used).
        src_rel: step directory, relative to the sender's store.
        dst_rel: step directory, relative to the receiver's store.
        share: (index, count): the sender streams its share of the manifest's files
            (:func:`~tierckpt.io.manifest.split_share`: rank r's DCP files to rank r).
        tag: free-form label for logs (e.g. ``replica node-1 step-20``).
        shared_files: also stream, for the receiver's memory only (never written), every file
            of at most :data:`SHARED_MAX` bytes outside the share that no rank owns (DCP's
            ``.metadata``): a restore that loads a pull from memory needs it on every rank.
    """

    src_rank: int
    dst_rank: int
    src_rel: str
    dst_rel: str
    share: tuple[int, int] = (0, 1)
    tag: str = ""
    shared_files: bool = False


SHARED_MAX = 16 << 20  # bytes: a shared file larger than this stays with its share's rank only


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


def _send_header(obj: dict, dst: int, group) -> None:
    data = json.dumps(obj).encode()
    dist.send(torch.tensor([len(data)], dtype=torch.int64), dst, group=group)
    if data:
        dist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), dst, group=group)


_MAX_HEADER = 1 << 30  # a manifest header is kilobytes; more is a stream out of step


def _recv_header(src: int, group) -> dict:
    n = torch.zeros(1, dtype=torch.int64)
    dist.recv(n, src, group=group)
    size = int(n.item())
    if not 0 <= size <= _MAX_HEADER:
        raise ValueError(f"transfer header of {size} bytes from group rank {src}: the stream is out of step")
    buf = torch.empty(size, dtype=torch.uint8)
    if buf.numel():
        dist.recv(buf, src, group=group)
    return json.loads(buf.numpy().tobytes())


def _gsrc(rank: int, group) -> int:
    return dist.get_group_rank(group, rank)


def send_step(store: Store, t: Transfer, group, chunk_bytes: int) -> int:
    """Stream this rank's share of ``t.src_rel`` to ``t.dst_rank``. Returns bytes sent.

    A missing or unreadable source still produces a header (with ``error``) so the receiver
    never waits forever; a file that shrank is padded with zeros, which the receiver's
    checksum rejects.
    """
    dst = _gsrc(t.dst_rank, group)
    doc = None
    try:
        mbytes = store.read_bytes(f"{t.src_rel}/{manifest.MANIFEST}")
        doc = manifest.read_committed(store, t.src_rel)
        if doc is None:
            raise FileNotFoundError(f"{store.url_of(t.src_rel)} is not committed")
    except (OSError, ValueError) as e:
        _send_header({"error": f"{type(e).__name__}: {e}"}, dst, group)
        return 0
    idx, cnt = t.share
    every = manifest.entries_of(doc)
    entries = manifest.split_share(every, idx, cnt)
    extra = [e for e in every if t.shared_files and e not in entries and e.size <= SHARED_MAX
             and manifest.rank_of_file(e.path) is None]
    _send_header({"manifest": mbytes.decode(), "files": [e.__dict__ for e in entries],
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
            # k+1 ahead (map_readonly's hint) while chunk k is on the network.
            try:
                for off in range(0, entry.size, chunk_bytes):
                    data = map_readonly(fd, off, min(chunk_bytes, entry.size - off))
                    if len(pending) >= 2:
                        pending.popleft().wait()
                    pending.append(_work(dist.isend(data, dst, group=group)))
                    sent += data.numel()
            finally:
                os.close(fd)
            continue
        bufs = bufs or _buffers("send", chunk_bytes)
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
            pending.append(_work(dist.isend(bufs[k % 2][:n], dst, group=group)))
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


def _aligned(size: int) -> torch.Tensor:
    """A uint8 tensor of ``size`` rounded up to :data:`_ALIGN` bytes, page-aligned, so O_DIRECT
    can write any chunk of it. From torch's allocator, not a fresh anonymous mapping: its first
    touch (by the receive) costs half as much (0.025 vs 0.055 s per 256 MiB here)."""
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
                 keep: bool = False, n_extra: int = 0):
        self.store, self.dst_rel, self.entries, self.bufs = store, dst_rel, entries, bufs
        self.n_extra = n_extra
        self.fds: dict[int, tuple[int, bool]] = {}
        self.failed: dict[int, str] = {}
        self.keep = keep
        # O_DIRECT writes from a file buffer need chunk offsets that are multiples of _ALIGN
        self.direct_ok = not keep or bufs[0].numel() % _ALIGN == 0
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
        path = self.store.path(f"{self.dst_rel}/{self.entries[i].path}")
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
            try:
                if not self.direct_ok:
                    raise OSError("chunk offsets not aligned for O_DIRECT")
                self.fds[i] = (os.open(path, flags | getattr(os, "O_DIRECT", 0), 0o644), hasattr(os, "O_DIRECT"))
            except OSError:  # tmpfs and some network filesystems refuse O_DIRECT
                self.fds[i] = (os.open(path, flags, 0o644), False)
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
            os.close(fd)

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
            os.close(self.fds.pop(i)[0])

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
            self._write(i, b, off, n)
            if last:
                self._finish(i)
            if b is not None:
                self.free.put(b)

    def close(self) -> None:
        """Let the writer write what was queued (a kept receive's writes start here) and stop."""
        if self.thread.ident is None:
            self.thread.start()
        self.writes.put(None)
        self.thread.join()


def recv_step(store: Store, t: Transfer, group, chunk_bytes: int, keep: int = 0, stream: bool = False) -> Received:
    """Receive one :class:`Transfer` into ``t.dst_rel`` of ``store``, verifying as it goes.

    Two receives stay in flight while the previous chunk is hashed; a writer thread writes
    hashed chunks (four buffers in rotation), so disk and network overlap. Files are
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
    nothing. ``stream`` (with a kept receive): return right after posting every chunk's
    receive; the caller uses the bytes as they arrive (:meth:`Received.wait_bytes`) and must
    call :meth:`Received.complete` (or ``finish``) to learn whether they were intact.
    """
    src = _gsrc(t.src_rank, group)
    res = Received(t)
    header = _recv_header(src, group)
    if "error" in header:
        res.problems.append(f"sender rank {t.src_rank}: {header['error']}")
        return res
    res.manifest_bytes = header["manifest"].encode()
    extra = [manifest.FileEntry(**d) for d in header.get("extra", [])]
    every = extra + [manifest.FileEntry(**d) for d in header["files"]]  # in stream order
    keep = keep > 0 and sum(e.size for e in every) <= keep  # memory-only files are drained otherwise
    chunks = [(i, off, min(chunk_bytes, e.size - off)) for i, e in enumerate(every)
              for off in range(0, e.size, chunk_bytes)]
    bufs = _buffers("recv", chunk_bytes, count=4)
    sink = _FileSink(store, t.dst_rel, every, bufs, keep, len(extra))
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
        return b, view, _work(dist.irecv(view, src, group=group))

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
                self.works.append(_work(dist.irecv(view, src, group=group)))
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


_ALIGN = 4096
_BUFFERS: dict = {}
_BUF_LOCK = threading.Lock()


def _buffers(kind: str, chunk_bytes: int, count: int = 2) -> list[torch.Tensor]:
    """``count`` page-aligned ``chunk_bytes`` buffers per direction, allocated once per process
    and reused by every transfer (a rank runs at most one send stream and one receive stream
    at a time)."""
    with _BUF_LOCK:
        key = (kind, chunk_bytes)
        if key not in _BUFFERS:
            maps = [mmap.mmap(-1, chunk_bytes) for _ in range(count)]
            _BUFFERS[key] = (maps, [torch.frombuffer(m, dtype=torch.uint8) for m in maps])
        return _BUFFERS[key][1]


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
    th.join()  # the sender shares this process's buffers: never leave it running
    return out


def start_transfers(transfers: list[Transfer], rank: int, store: Store, group, chunk_bytes: int,
                    keep: int = 0, stream: bool = False) -> tuple[dict[int, Received], threading.Thread]:
    """:func:`run_transfers` that returns once this rank's receives are done (or posted, with
    ``stream``) while its sends may still run: (results, sender thread). The caller must join
    the thread before this rank's next transfer (they share the send buffers) and before a
    collective over ``group``; it may do other work meanwhile (a restore loads its own copy)."""
    sends = [t for t in transfers if t.src_rank == rank and t.dst_rank != rank]

    def sender():
        for t in sends:
            try:
                send_step(store, t, group, chunk_bytes)
            except BaseException as e:  # the receiver reports it: its stream ended short or wrong
                log.error("tierckpt transfer %s: send failed: %s: %s", t.tag, type(e).__name__, e)
                return

    th = threading.Thread(target=sender, name="tierckpt-send", daemon=True)
    th.start()
    out = {}
    try:
        for i, t in enumerate(transfers):
            if t.dst_rank != rank:
                continue
            if t.src_rank == rank:
                out[i] = Received(t, problems=[f"{t.tag}: a transfer from rank {rank} to itself (not sent)"])
                continue
            try:
                out[i] = recv_step(store, t, group, chunk_bytes, keep, stream)
            except FAILURES as e:
                log.error("tierckpt transfer %s: receive failed: %s: %s", t.tag, type(e).__name__, e)
                out[i] = Received(t, problems=[f"{t.tag}: receive failed: {type(e).__name__}: {e}"])
    except BaseException:
        th.join()
        raise
    return out, th


def _work(w: dist.Work | None) -> dist.Work:
    """The request of an isend/irecv; torch types it Optional (None only for a rank outside
    the group, which a transfer never is)."""
    if w is None:
        raise RuntimeError("tierckpt transfer: point-to-point request on a rank outside its group")
    return w
