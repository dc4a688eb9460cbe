"""DCP storage-writer plumbing shared by the local and persistent tiers.

Two costs of a plain ``FileSystemWriter`` save are redundant once tierckpt checksums every file
(measured in bench/RESULTS.md, 1 GiB per rank on 2 cores):

- ``torch.save``'s zip CRC32 runs at ~1.5 GB/s on one core, about 0.7 s per GiB; the xxh3-64
  manifest already covers the same bytes. :func:`crc32_off` turns it off around our DCP saves
  (files still load with ``torch.load``/DCP as usual).
- re-reading every written file to checksum it costs ~0.25 s per GiB; :class:`HashingFileSystem`
  hashes the bytes as DCP writes them. For many small items the opposite holds: ``torch.save``
  writes a tensor in ~39 small pieces, each passing through the hashing proxy (~1 µs of Python
  per piece, ~40 µs per tensor), while re-reading a just-written file from the page cache costs
  ~0.25 ns per byte; a save whose items average under :data:`REREAD_BELOW` bytes is hashed by
  re-reading each file right after it is closed (:class:`HashingFileSystemWriter`).
"""

from __future__ import annotations

import contextlib
import os
import threading

import xxhash
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.planner import SavePlan, WriteItemType
from torch.serialization import get_crc32_options, set_crc32_options

from tierckpt.io import perms
from tierckpt.io.dcp_compat import FsspecReader
from tierckpt.io.perms import Modes


@contextlib.contextmanager
def crc32_off():
    """Disable torch.save's zip CRC32 for the DCP save the calling thread runs.

    torch keeps this option per thread (torch 2.13: a value set on one thread is not seen by
    another), so each tier thread turns it off for itself and restores its own previous value;
    a process-wide reference count would leave every thread but the first computing the CRC.
    Skipping it only affects zip-level integrity checks (the file loads normally; tierckpt's
    xxh3 manifest covers every byte).
    """
    saved = get_crc32_options()
    set_crc32_options(False)
    try:
        yield
    finally:
        set_crc32_options(saved)


class _HashingStream:
    """File proxy that feeds every written byte to XXH3-64. A seek invalidates the hash
    (DCP and torch.save write sequentially; the file is then re-read instead)."""

    def __init__(self, f):
        self._f = f
        self.hasher = xxhash.xxh3_64()
        self.nbytes = 0
        self.valid = True

    def write(self, b) -> int:
        n = self._f.write(b)
        # torch.save writes contiguous memoryviews: hashed whole unless the write was short
        if type(b) is memoryview and b.c_contiguous and n == b.nbytes:
            self.hasher.update(b)
        else:
            mv = memoryview(b).cast("B") if not isinstance(b, (bytes, bytearray)) else b
            n = len(mv) if n is None else n
            self.hasher.update(mv[:n])
        self.nbytes += n
        return n

    def seek(self, *args):
        self.valid = False
        return self._f.seek(*args)

    def __getattr__(self, name):
        return getattr(self._f, name)


class HashingFileSystem(FileSystem):
    """DCP ``FileSystem`` that records ``digests[path] = (size, xxh3-64 hex)`` of each file it
    writes (following renames, so ``.metadata.tmp`` → ``.metadata`` keeps its digest).

    Args:
        modes: exact bits of the files and directories it creates (a node-local root's
            ``local_permissions``): each file is created with them, never chmod-ed afterwards
            from a wider mode. None: the umask's bits (the persistent tier).
        top: highest directory that gets ``modes.dir`` when DCP creates it (the local root);
            its missing parents keep the default mode.
    """

    def __init__(self, modes: Modes | None = None, top: str | None = None):
        super().__init__()
        self.digests: dict[str, tuple[int, str]] = {}
        self._lock = threading.Lock()
        self.modes, self.top = modes, top
        self.reread = False  # hash each file by re-reading it once closed (set per save's plan)

    def mkdir(self, path) -> None:
        if self.modes is None:
            super().mkdir(path)
        else:
            perms.makedirs(str(path), self.modes.dir, self.top)

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        if "w" not in mode and "a" not in mode:
            with super().create_stream(path, mode) as s:
                yield s
            return
        opener = None if self.modes is None else perms.opener(self.modes.file)
        if self.reread and "a" not in mode:
            with open(path, mode, opener=opener) as f:
                yield f
            digest = _hash_file(str(path))
            with self._lock:
                self.digests[os.path.abspath(str(path))] = digest
            return
        with open(path, mode, opener=opener) as f:
            hs = _HashingStream(f)
            yield hs
        if hs.valid and "a" not in mode:
            with self._lock:
                self.digests[os.path.abspath(str(path))] = (hs.nbytes, hs.hasher.hexdigest())

    def rename(self, path, new_path) -> None:
        super().rename(path, new_path)
        with self._lock:
            d = self.digests.pop(os.path.abspath(str(path)), None)
            if d is not None:
                self.digests[os.path.abspath(str(new_path))] = d


def _hash_file(path: str) -> tuple[int, str]:
    """(size bytes, xxh3-64 hex) of a file, read in 1 MiB chunks."""
    h = xxhash.xxh3_64()
    n = 0
    buf = bytearray(1 << 20)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while k := f.readinto(buf):
            h.update(view[:k])
            n += k
    return n, h.hexdigest()


REREAD_BELOW = 128 * 1024
"""Mean bytes per planned item under which a save's files are hashed by re-reading them: the
break-even of ~40 µs of in-stream hashing per item against ~0.25 ns per byte re-read (see the
module docstring; 40 µs / 0.25 ns = 160 KB, rounded down)."""


def _mean_item_bytes(plan: SavePlan) -> float:
    """Mean tensor bytes per item of ``plan`` (objects count as empty: they are small)."""
    total = 0
    for it in plan.items:
        td = it.tensor_data
        if it.type != WriteItemType.BYTE_IO and td is not None:
            numel = 1
            for d in td.chunk.sizes:
                numel *= d
            total += numel * td.properties.dtype.itemsize
    return total / max(1, len(plan.items))


class HashingFileSystemWriter(FileSystemWriter):
    """``FileSystemWriter`` on a :class:`HashingFileSystem` that picks, per save, hashing in
    the stream or by re-reading each file (:data:`REREAD_BELOW`)."""

    def write_data(self, plan, planner):
        fs = self.fs
        if isinstance(fs, HashingFileSystem):
            fs.reread = _mean_item_bytes(plan) < REREAD_BELOW
        return super().write_data(plan, planner)


def hashing_writer(path: str, modes: Modes | None = None, top: str | None = None) -> FileSystemWriter:
    """``FileSystemWriter`` (fsync on) whose ``fs.digests`` holds the checksums it wrote; its
    files and directories get ``modes`` (see :class:`HashingFileSystem`)."""
    w = HashingFileSystemWriter(path, sync_files=True, overwrite=True)
    w.fs = HashingFileSystem(modes, top)
    return w


def digests_under(writer: FileSystemWriter, base: str) -> dict[str, tuple[int, str]]:
    """The writer's digests keyed by path relative to ``base`` ('/'-separated)."""
    fs = getattr(writer, "fs", None)
    if not isinstance(fs, HashingFileSystem):
        return {}
    base = os.path.abspath(base)
    return {os.path.relpath(p, base).replace(os.sep, "/"): d for p, d in fs.digests.items()
            if p.startswith(base + os.sep)}


class _Counting:
    """Mixin for DCP storage readers: ``bytes_read`` sums the byte ranges read."""

    bytes_read = 0

    def read_data(self, plan, planner):
        for item in plan.items:
            self.bytes_read += self.storage_data[item.storage_index].length
        return super().read_data(plan, planner)


class CountingFsspecReader(_Counting, FsspecReader):
    """DCP FsspecReader (object stores, ``s3://`` …) that counts ``bytes_read``."""


class CountingFileSystemReader(_Counting, FileSystemReader):
    """DCP FileSystemReader (POSIX paths) that counts ``bytes_read``."""
