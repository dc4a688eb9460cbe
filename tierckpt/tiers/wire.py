"""The wire of a file transfer between two ranks (:mod:`tierckpt.tiers.transfer`): what a
stream is (:class:`Transfer`), its JSON header framing, the point-to-point request helper and
the per-process chunk buffers. Shared by the sending and the receiving side
(:mod:`tierckpt.tiers.receive`); fault injection patches :func:`work` here to reach both."""

from __future__ import annotations

import json
import mmap
import threading
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


_BUFFERS: dict = {}
_BUF_LOCK = threading.Lock()


def buffers(kind: str, chunk_bytes: int, count: int = 2) -> list[torch.Tensor]:
    """``count`` page-aligned ``chunk_bytes`` buffers per direction, allocated once per process
    and reused by every transfer (a rank runs at most one send stream and one receive stream
    at a time)."""
    with _BUF_LOCK:
        key = (kind, chunk_bytes)
        if key not in _BUFFERS:
            maps = [mmap.mmap(-1, chunk_bytes) for _ in range(count)]
            _BUFFERS[key] = (maps, [torch.frombuffer(m, dtype=torch.uint8) for m in maps])
        return _BUFFERS[key][1]


def work(w: dist.Work | None) -> dist.Work:
    """The request of an isend/irecv; torch types it Optional (None only for a rank outside
    the group, which a transfer never is)."""
    if w is None:
        raise RuntimeError("tierckpt transfer: point-to-point request on a rank outside its group")
    return w
