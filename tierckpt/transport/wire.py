"""The wire of a file transfer between two ranks (:mod:`tierckpt.transport.transfer`): what a
stream is (:class:`Transfer`), its JSON header framing, the point-to-point request helper and
the chunk buffers of a batch of transfers (:class:`BufferPool`). Shared by the sending and the receiving side
(:mod:`tierckpt.transport.receive`); fault injection patches :func:`work` here to reach both."""

from __future__ import annotations

import json
import mmap
import threading
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist


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


def send_header(obj: dict, dst: int, group) -> None:
    """Send ``obj`` as JSON to group rank ``dst``: its length (one int64), then its UTF-8 bytes."""
    data = json.dumps(obj).encode()
    dist.send(torch.tensor([len(data)], dtype=torch.int64), dst, group=group)
    if data:
        dist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), dst, group=group)


_MAX_HEADER = 1 << 30  # a manifest header is kilobytes; more is a stream out of step


def recv_header(src: int, group) -> dict:
    """Receive what :func:`send_header` sent from group rank ``src``. Raises ValueError for a
    length outside 0..1 GiB (a stream out of step), what the transport raises otherwise."""
    n = torch.zeros(1, dtype=torch.int64)
    dist.recv(n, src, group=group)
    size = int(n.item())
    if not 0 <= size <= _MAX_HEADER:
        raise ValueError(f"transfer header of {size} bytes from group rank {src}: the stream is out of step")
    buf = torch.empty(size, dtype=torch.uint8)
    if buf.numel():
        dist.recv(buf, src, group=group)
    return json.loads(buf.numpy().tobytes())


def group_rank(rank: int, group) -> int:
    """The rank in ``group`` of global rank ``rank``."""
    return dist.get_group_rank(group, rank)


_live = [0]  # bytes of chunk buffers mapped now, over every pool of the process
_live_lock = threading.Lock()


def _unmapped(nbytes: int) -> None:
    with _live_lock:
        _live[0] -= nbytes


def live_buffer_bytes() -> int:
    """Bytes of transfer chunk buffers this process has mapped now (0 between transfers: a
    :class:`BufferPool` unmaps its buffers once released and no request uses them)."""
    with _live_lock:
        return _live[0]


class BufferPool:
    """The chunk buffers of one batch of transfers (a replication round's receives, a sending
    thread's streams, a restore's pulls): page-aligned anonymous mappings of ``chunk_bytes``,
    made on first use, reused by the batch's streams (one at a time per pool) and unmapped
    once :meth:`release` dropped them and no pending request holds them (the last reference
    unmaps: never closed under a request in flight). Between transfers a process holds none:
    replication costs its buffers' memory only while it runs (docs/design.md, "Host memory")."""

    def __init__(self) -> None:
        self._bufs: dict[tuple[str, int, int], list[torch.Tensor]] = {}
        self._lock = threading.Lock()

    def get(self, kind: str, chunk_bytes: int, count: int) -> list[torch.Tensor]:
        """``count`` uint8 buffers of ``chunk_bytes`` (> 0) for ``kind`` ("send" | "recv"), the
        same ones on every call with these arguments until :meth:`release`. A page is taken
        from the system when first written (RSS grows with the bytes a stream moves, up to
        ``count × chunk_bytes``). Raises OSError/MemoryError where the mapping is refused."""
        key = (kind, chunk_bytes, count)
        with self._lock:
            if key not in self._bufs:
                maps = [mmap.mmap(-1, chunk_bytes) for _ in range(count)]
                with _live_lock:
                    _live[0] += chunk_bytes * count
                for m in maps:
                    weakref.finalize(m, _unmapped, chunk_bytes)
                self._bufs[key] = [torch.frombuffer(m, dtype=torch.uint8) for m in maps]
            return self._bufs[key]

    def release(self) -> None:
        """Drop this pool's buffers (a later :meth:`get` maps new ones). Idempotent."""
        with self._lock:
            self._bufs.clear()


def work(w: dist.Work | None) -> dist.Work:
    """The request of an isend/irecv; torch types it Optional (None only for a rank outside
    the group, which a transfer never is)."""
    if w is None:
        raise RuntimeError("tierckpt transfer: point-to-point request on a rank outside its group")
    return w
