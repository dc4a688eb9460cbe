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
- ``torch.save`` of a small tensor costs ~100 µs, mostly fixed (a pickler class built per call,
  eight zip records), and DCP calls it once per tensor. With the zip CRC32 off its bytes depend
  only on the tensor's dtype, shape and strides and on its data:
  :class:`HashingFileSystemWriter` writes a plain contiguous CPU tensor as the bytes of a
  ``torch.save`` of a same-layout tensor (one per layout, made once and checked: only the
  data record differs) with the tensor's bytes in place of the data record's
  (:class:`TensorBlobs`); the file is what ``torch.save`` writes, read back by DCP's reader
  and ``torch.load`` as before.
"""

from __future__ import annotations

import contextlib
import io
import os
import threading

import xxhash
import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, FileSystem, SerializationFormat
from torch.distributed.checkpoint.planner import SavePlan, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future
from torch.serialization import get_crc32_options, set_crc32_options

from tierckpt.io import perms
from tierckpt.io.dcp_compat import FsspecReader, _StorageInfo
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


def _storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """A uint8 tensor over all of ``t``'s storage (what ``torch.save`` writes as its data)."""
    return torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())


TEMPLATE_MAX_BYTES = 1 << 20
"""Largest tensor written from a template: above it ``torch.save``'s fixed ~100 µs is under
0.1 µs per KiB, and a template costs two tensors of the size."""


class TensorBlobs:
    """``torch.save`` bytes of plain tensors from one template per layout (see the module
    docstring); thread-safe, a cache of templates keyed by (dtype, shape, strides, torch's
    storage alignment)."""

    def __init__(self) -> None:
        self._templates: dict[tuple, tuple[bytes, bytes] | None] = {}
        self._lock = threading.Lock()

    @staticmethod
    def _plain(t: torch.Tensor) -> bool:
        return (type(t) is torch.Tensor and t.layout == torch.strided and t.device.type == "cpu"
                and not t.requires_grad and not t.is_quantized and not t.is_conj() and not t.is_neg()
                and not any(getattr(t, "names", None) or ()) and not t.__dict__ and t.storage_offset() == 0 and t.is_contiguous()
                and 0 < t.nbytes <= TEMPLATE_MAX_BYTES and t.untyped_storage().nbytes() == t.nbytes)

    def parts(self, t: torch.Tensor) -> tuple[bytes, memoryview, bytes] | None:
        """``(head, data, tail)`` whose concatenation is ``torch.save(t)``; None when ``t`` is not
        a plain contiguous CPU tensor, the CRC32 is on in this thread, or the layout's
        template failed its check (then ``torch.save`` it)."""
        if get_crc32_options() or not self._plain(t):
            return None
        from torch.serialization import _get_storage_alignment

        key = (t.dtype, tuple(t.shape), t.stride(), _get_storage_alignment())
        with self._lock:
            if key not in self._templates:
                self._templates[key] = self._template(t)
            tpl = self._templates[key]
        if tpl is None:
            return None
        return tpl[0], memoryview(_storage_bytes(t).numpy()), tpl[1]  # type: ignore[arg-type]

    @staticmethod
    def _template(t: torch.Tensor) -> tuple[bytes, bytes] | None:
        """The bytes of a ``torch.save`` of ``t``'s layout before and after its data record,
        checked against a second save whose every data byte differs; None when anything else
        differs between them."""
        nb = t.nbytes
        lo = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype)
        hi = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype)
        _storage_bytes(lo).fill_(0)
        _storage_bytes(hi).fill_(0xFF)
        a, b = io.BytesIO(), io.BytesIO()
        torch.save(lo, a)
        torch.save(hi, b)
        x, y = a.getvalue(), b.getvalue()
        off = next((i for i in range(min(len(x), len(y))) if x[i] != y[i]), -1)
        if (len(x) != len(y) or off < 0 or x[off:off + nb] != bytes(nb) or y[off:off + nb] != b"\xff" * nb
                or x[:off] != y[:off] or x[off + nb:] != y[off + nb:]):
            return None
        return x[:off], x[off + nb:]


_BLOBS = TensorBlobs()


class HashingFileSystemWriter(FileSystemWriter):
    """``FileSystemWriter`` on a :class:`HashingFileSystem` that picks, per save, hashing in
    the stream or by re-reading each file (:data:`REREAD_BELOW`), and writes plain tensors
    from templates (:class:`TensorBlobs`) in DCP's layout (one file per rank: objects, then
    tensors). Any other configuration (threads, stream extensions, safetensors) is DCP's own
    write."""

    def write_data(self, plan, planner):
        fs = self.fs
        if isinstance(fs, HashingFileSystem):
            fs.reread = _mean_item_bytes(plan) < REREAD_BELOW
        if (not self.single_file_per_rank or self.thread_count != 1 or self.transforms.extensions
                or self.serialization_format != SerializationFormat.TORCH_SAVE or get_crc32_options()):
            return super().write_data(plan, planner)
        name = f"{plan.storage_data.prefix}0{DEFAULT_SUFFIX}"
        results = []
        with fs.create_stream(fs.concat_path(self.path, name), "wb") as stream:
            def put(item, write) -> None:
                offset = stream.tell()
                write()
                length = stream.tell() - offset
                results.append(WriteResult(index=item.index, size_in_bytes=length,
                                           storage_data=_StorageInfo(name, offset, length)))

            for item in plan.items:
                if item.type == WriteItemType.BYTE_IO:
                    put(item, lambda item=item: stream.write(planner.resolve_data(item).getbuffer()))
            for item in plan.items:
                if item.type != WriteItemType.BYTE_IO:
                    t = planner.resolve_data(item).detach().cpu()
                    if t.untyped_storage().size() != t.nbytes:  # a view: DCP saves a minimal copy
                        t = t.clone()
                    put(item, lambda item=item, t=t: self._write_tensor(stream, item, t))
            if self.sync_files:
                stream.flush()
                os.fsync(stream.fileno())
        fut: Future = Future()
        fut.set_result(results)
        return fut

    def _write_tensor(self, stream, item, t: torch.Tensor) -> None:
        parts = _BLOBS.parts(t)
        if parts is None:  # DCP's own path for this item
            out, _ = self.transforms.transform_save_stream(item, stream)
            torch.save(t, out)
            out.close()
            return
        for p in parts:
            stream.write(p)


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
