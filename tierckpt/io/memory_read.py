"""Loading a DCP checkpoint whose files are in memory: the restore's fast path.

A restore has the files it loads in memory twice over: a pull receives a peer's replica into
memory (checksummed on receipt, :mod:`tierckpt.transport.transfer`), and a node restoring its own
copy reads and checksums its share in one pass (:func:`read_verified`) while the pulls run.
:class:`MemoryReader` then loads from those bytes. DCP's ``FileSystemReader`` would
``torch.load`` each tensor record from a stream (parse the zip, copy the bytes into a new
storage, then copy into the target); here each tensor of a file held in memory is decoded
with torch's own ``torch.save`` reader over a storage that *is* the file's bytes, so the
only copy is into the target tensor, also for a record whose data is not aligned for its dtype
(its place in the file decides: :func:`copy_record`). The file format is DCP's own (``FileSystemWriter``,
torch.save records); nothing about it changes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import mmap
import os
import threading
import warnings
from dataclasses import dataclass
from typing import Callable

import torch
import xxhash
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.planner import LoadItemType

from tierckpt.errors import ReadTimeout
from tierckpt.io import manifest
from tierckpt.io.bounded import BoundedFile, Progress
from tierckpt.io.dcp_compat import narrow_tensor_by_index
from tierckpt.io.dcp_io import CountingFileSystemReader
from tierckpt.io.storage import Store

log = logging.getLogger(__name__)
_READ_CHUNK = 8 << 20


class NotInMemoryError(FileNotFoundError):
    """A strict :class:`MemoryFirstFileSystem` was asked for a file it does not hold."""


class TensorStream(io.RawIOBase):
    """A read-only, seekable stream over a uint8 tensor's bytes (no copy)."""

    def __init__(self, buf: torch.Tensor):
        self._mv = memoryview(buf.numpy().data).cast("B") if buf.numel() else memoryview(b"")
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        n = max(0, min(len(b), len(self._mv) - self._pos))
        memoryview(b).cast("B")[:n] = self._mv[self._pos: self._pos + n]
        self._pos += n
        return n

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._mv)}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos


class MemoryFirstFileSystem(FileSystem):
    """DCP ``FileSystem`` that reads the files of ``root`` found in ``files`` ({path relative to
    ``root``: uint8 tensor of the file's bytes}) from memory and every other file from disk,
    or, with ``strict``, raises :class:`NotInMemoryError` for them (a pull's files are not
    written yet: the disk copy must not be read). ``wait(name, end)`` is called before the
    first ``end`` bytes of a file in memory are used (a pull still arriving). ``timeout_s``:
    each open and read of a file from disk is bounded (:class:`~tierckpt.io.bounded.BoundedFile`,
    :class:`~tierckpt.errors.ReadTimeout` after that many seconds without progress); None:
    DCP's unbounded reads."""

    def __init__(self, root: str, files: dict[str, torch.Tensor], strict: bool = False,
                 wait: Callable[[str, int], None] | None = None, timeout_s: float | None = None):
        super().__init__()
        self.root, self.files, self.strict, self.wait = os.path.abspath(root), files, strict, wait
        self.timeout_s = timeout_s

    def rel(self, path) -> str:
        """``path`` relative to the root, '/'-separated (the key of :attr:`files`)."""
        return os.path.relpath(os.path.abspath(str(path)), self.root).replace(os.sep, "/")

    @contextlib.contextmanager
    def create_stream(self, path, mode: str):
        rel = self.rel(path)
        if mode == "rb" and rel in self.files:
            if self.wait is not None:
                self.wait(rel, self.files[rel].numel())
            with io.BufferedReader(TensorStream(self.files[rel]), buffer_size=1 << 20) as stream:
                yield stream
            return
        if self.strict:
            raise NotInMemoryError(f"{path}: not among the files held in memory ({sorted(self.files)})")
        if mode == "rb" and self.timeout_s is not None:  # e.g. a replicated value in another rank's file
            with io.BufferedReader(BoundedFile(path, self.timeout_s), buffer_size=1 << 20) as bounded:
                yield bounded
            return
        with super().create_stream(path, mode) as stream:
            yield stream


_fast_ok = True


@dataclass(frozen=True)
class _Template:
    """What a full decode learnt about one kind of record: the bytes before its data (zip
    headers, the pickled dtype/shape/stride, byte order) and the tensor those bytes describe."""

    prefix: bytes
    nbytes: int
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int


_TEMPLATES: dict[int, list[_Template]] = {}  # record length → templates seen
_TEMPLATE_CAP = 512


def decode_record(buf: torch.Tensor) -> torch.Tensor:
    """The tensor of one ``torch.save`` record held in ``buf`` (uint8, CPU), sharing ``buf``'s
    memory (no copy of the data) when its data is aligned for its dtype, else over an aligned
    copy of it (:func:`_realigned`): any kernel may read the result.

    Uses torch's reader (``torch.serialization._load`` over the record's bytes as its
    ``overall_storage``, what ``torch.load(mmap=True)`` does for a file) with the weights-only
    unpickler. A checkpoint's records repeat (every tensor of one dtype and shape has the same
    bytes before its data): a record whose every byte before the data equals one already
    decoded is the same tensor layout, built from the cached template without parsing (~10×
    faster per record). Should torch's private entry point change in another release, this
    falls back to ``torch.load`` (a copy), once logged. Raises what ``torch.load`` raises for a
    bad record.
    """
    return _realigned(decode_in_place(buf))


def decode_in_place(buf: torch.Tensor) -> torch.Tensor:
    """:func:`decode_record` without the realignment: a plain tensor (dense, strided) over
    ``buf``'s bytes may start at an address that is not a multiple of its element size. Such
    a tensor must only be read as bytes or through :func:`copy_record` (torch's kernels assume
    dtype alignment); any other tensor returned is aligned."""
    global _fast_ok
    n = buf.numel()
    mv = buf.numpy().data
    for tpl in _TEMPLATES.get(n, ()):
        p = len(tpl.prefix)
        if mv[:p] == tpl.prefix:
            off = buf.storage_offset() + p
            st = buf.untyped_storage()[off: off + tpl.nbytes]
            return torch.empty(0, dtype=tpl.dtype).set_(st, tpl.storage_offset, tpl.size, tpl.stride)
    if _fast_ok:
        try:
            from torch import _weights_only_unpickler

            zf = torch._C.PyTorchFileReader(TensorStream(buf))  # type: ignore[call-overload]  # any seekable stream
            st = buf.untyped_storage()
            off = buf.storage_offset()
            t = torch.serialization._load(zf, "cpu", _weights_only_unpickler,
                                          overall_storage=st[off: off + n])
            _learn(buf, t)
            if _plain(t) or not _misaligned(t):
                return t
            # no plain storage to realign (a quantized tensor): torch.load's own copy is aligned
        except (AttributeError, TypeError) as e:
            _fast_ok = False
            log.warning("tierckpt: zero-copy decode unavailable in torch %s (%s: %s); loading with torch.load",
                        torch.__version__, type(e).__name__, e)
    return torch.load(io.BufferedReader(TensorStream(buf)), map_location="cpu", weights_only=True)


def copy_record(target: torch.Tensor, src: torch.Tensor) -> None:
    """``target.copy_(src)`` for ``src`` as :func:`decode_in_place` returns it (or a view of
    it), whatever its alignment. A misaligned ``src`` of ``target``'s dtype, both contiguous
    (a DCP record loaded whole, the usual case), is copied as bytes: one copy, as for an
    aligned record (any device: a byte copy needs no alignment). Otherwise (a slice of a
    record, another dtype or layout) it is first realigned (:func:`_realigned`: one more
    copy of the record, transient). Raises what ``copy_`` raises (shapes that differ)."""
    if not _misaligned(src):
        target.copy_(src)
    elif target.dtype == src.dtype and target.is_contiguous() and src.is_contiguous() \
            and target.shape == src.shape:
        if src.numel():
            target.reshape(-1).view(torch.uint8).copy_(src.reshape(-1).view(torch.uint8))
    else:
        target.copy_(_realigned(src))


def _plain(t) -> bool:
    """``t`` is a dense, strided, unquantized tensor (its storage can be copied as bytes)."""
    return type(t) is torch.Tensor and not t.is_quantized and t.layout == torch.strided


def _misaligned(t) -> bool:
    """The data of tensor ``t`` starts at an address that is not a multiple of its element
    size (which is its dtype's alignment: 16 bytes for complex128, 1 for bool and float8)."""
    if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
        return False
    st = t.untyped_storage()
    return st.nbytes() > 0 and st.data_ptr() % t.element_size() != 0


def _realigned(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when its storage is aligned for its dtype, else the same tensor (dtype,
    shape, strides, storage offset) over an aligned copy of its storage's bytes.

    A DCP file packs ``torch.save`` records back to back: a record's data is 64-byte aligned
    within the record, so whatever precedes the record in the file (an int8 tensor of 3
    elements) decides its alignment in memory. torch's kernels assume dtype alignment: a
    complex128 tensor at an address not divisible by 16 kills the process with SIGSEGV in
    ``copy_`` (torch 2.x, x86-64, measured), and a misaligned access is undefined behaviour for
    any dtype. The copy costs one record's bytes, transiently, and only for misaligned records."""
    if not _misaligned(t):
        return t
    st = t.untyped_storage()
    fresh = torch.empty(st.nbytes(), dtype=torch.uint8)  # torch's CPU allocator: 64-byte aligned
    fresh.copy_(torch.empty(0, dtype=torch.uint8).set_(st))
    return torch.empty(0, dtype=t.dtype).set_(fresh.untyped_storage(), t.storage_offset(), t.size(), t.stride())


def _learn(buf: torch.Tensor, t: torch.Tensor) -> None:
    """Cache ``t``'s layout as a template for records like ``buf`` when its storage is a plain
    slice of ``buf`` (a dense tensor of a supported dtype decoded in place)."""
    if not _plain(t) or not buf.numel():
        return
    st = t.untyped_storage()
    data_off = st.data_ptr() - buf.data_ptr()
    if st.nbytes() == 0 or not 0 <= data_off <= buf.numel() - st.nbytes():
        return
    if sum(len(v) for v in _TEMPLATES.values()) >= _TEMPLATE_CAP or len(_TEMPLATES.get(buf.numel(), ())) >= 8:
        return
    _TEMPLATES.setdefault(buf.numel(), []).append(_Template(
        prefix=bytes(buf.numpy().data[:data_off]), nbytes=st.nbytes(), dtype=t.dtype, size=tuple(t.shape),
        stride=tuple(t.stride()), storage_offset=int(t.storage_offset())))


class MemoryReader(CountingFileSystemReader):
    """DCP ``FileSystemReader`` for a checkpoint directory some of whose files are in memory
    (``memory``: {file name relative to ``path``: uint8 tensor}). Tensor records of those files
    are decoded in place (:func:`decode_record`) and copied once, into the target; every other
    read goes through DCP's own code over :class:`MemoryFirstFileSystem` (``strict``: files
    not in memory raise :class:`NotInMemoryError`; ``wait``, ``timeout_s``: as there)."""

    def __init__(self, path: str, memory: dict[str, torch.Tensor], strict: bool = False,
                 wait: Callable[[str, int], None] | None = None, timeout_s: float | None = None):
        super().__init__(path)
        self.fs = MemoryFirstFileSystem(path, memory, strict, wait, timeout_s)
        self.memory, self.wait = memory, wait

    def read_data(self, plan, planner):
        fs = self.fs
        assert isinstance(fs, MemoryFirstFileSystem)
        rest = []
        for req in plan.items:
            md = self.storage_data[req.storage_index]
            rel = fs.rel(fs.concat_path(self.path, md.relative_path))
            buf = self.memory.get(rel)
            if buf is None or md.transform_descriptors:
                rest.append(req)
                continue
            if self.wait is not None:
                self.wait(rel, md.offset + md.length)
            self.bytes_read += md.length
            data = buf[md.offset: md.offset + md.length]
            if req.type == LoadItemType.BYTE_IO:
                planner.load_bytes(req, io.BytesIO(data.numpy().tobytes()))
                continue
            tensor = narrow_tensor_by_index(decode_in_place(data), req.storage_offsets, req.lengths)
            target = planner.resolve_tensor(req).detach()
            if target.size() != tensor.size():
                raise AssertionError(f"req {req.storage_index} mismatch sizes {target.size()} vs {tensor.size()}")
            copy_record(target, tensor)
            planner.commit_tensor(req, target)
        return super().read_data(dataclasses.replace(plan, items=rest), planner)


def map_readonly(fd: int, off: int, n: int) -> torch.Tensor:
    """Bytes ``off:off+n`` (n > 0) of the open file ``fd`` as a uint8 tensor: a shared, read-only
    mapping of the page cache (no copy; ``off`` a multiple of the page size), or a read into
    memory where the mapping is refused. The tensor keeps its mapping alive.

    The range is first handed to the kernel's readahead (``POSIX_FADV_WILLNEED``, returns at
    once), so whoever touches the pages (gloo's send thread, the hash) finds them read or in
    flight: as fast as ``MAP_POPULATE`` on a cold file and 2.5× faster than 8 MiB reads,
    without holding the GIL for the whole read as a populating ``mmap`` call does (measured
    on 256 MiB: 0.09 s either way; the GIL held 0.08 s vs ≤ 4 ms)."""
    with contextlib.suppress(OSError, AttributeError):
        os.posix_fadvise(fd, off, n, os.POSIX_FADV_WILLNEED)
    try:
        m = mmap.mmap(fd, n, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ, offset=off)
    except (OSError, ValueError):
        data = bytearray(n)
        got = os.preadv(fd, [data], off)
        if got < n:  # shrank meanwhile: zeros, which any checksum rejects
            data[got:] = bytes(n - got)
        return torch.frombuffer(data, dtype=torch.uint8)
    with warnings.catch_warnings():  # a read-only buffer: only ever read
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(m, dtype=torch.uint8)


def map_share(store: Store, step_rel: str, entries: list[manifest.FileEntry],
              tick: Callable[[str], None] | None = None) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Map ``entries`` of a committed step of a local ``store`` into memory (:func:`map_readonly`:
    the kernel starts reading them at once; nothing is checksummed here). ``tick(path)``: called
    before each file is opened (a bounded read's progress, :mod:`tierckpt.io.bounded`).

    Returns:
        ({file path: uint8 tensor of its bytes} of the files present with the manifest's size,
        {file path: problem as :func:`~tierckpt.io.manifest.verify_files` words it} for the others).
    """
    out: dict[str, torch.Tensor] = {}
    problems: dict[str, str] = {}
    for e in entries:
        rel = f"{step_rel}/{e.path}"
        if tick is not None:
            tick(rel)
        try:
            fd = os.open(store.path(rel), os.O_RDONLY)
        except OSError as ex:
            problems[e.path] = f"{rel}: missing ({ex.__class__.__name__})"
            continue
        try:
            size = os.fstat(fd).st_size
            if size != e.size:
                problems[e.path] = f"{rel}: size {size} != manifest {e.size}"
                continue
            out[e.path] = map_readonly(fd, 0, size) if size else torch.empty(0, dtype=torch.uint8)
        except OSError as ex:
            problems[e.path] = f"{rel}: unreadable ({ex.__class__.__name__}: {ex})"
        finally:
            os.close(fd)
    return out, problems


def touch_share(entries: list[manifest.FileEntry], mapped: dict[str, torch.Tensor],
                done: Callable[[str, int], None]) -> None:
    """Fault in every page of the files of ``mapped`` (one byte read per page, smallest file
    first: DCP's ``.metadata`` is read before the data), calling ``done(path, end)`` once bytes
    ``:end`` of ``path`` are in memory. A page that does not come (a hung disk) blocks here, on
    the thread that calls this, not on a thread that decodes from the mapping."""
    for e in sorted(entries, key=lambda e: e.size):
        buf = mapped.get(e.path)
        if buf is None:
            continue
        arr = buf.numpy()
        for a in range(0, e.size, _READ_CHUNK):
            b = min(e.size, a + _READ_CHUNK)
            int(arr[a:b:mmap.PAGESIZE].sum())  # one load per page: the page fault is the read
            done(e.path, b)
        if not e.size:
            done(e.path, 0)


def check_share(step_rel: str, entries: list[manifest.FileEntry], mapped: dict[str, torch.Tensor],
                tick: Callable[[], None] | None = None) -> dict[str, str]:
    """Checksum the files of ``mapped`` (as :func:`map_share` returns them) against ``entries``;
    returns {file path: problem} for each file whose xxh3-64 differs (it leaves ``mapped``).
    ``tick``: called after each chunk hashed (a bounded read's progress)."""
    problems: dict[str, str] = {}
    for e in entries:
        buf = mapped.get(e.path)
        if buf is None:
            continue
        h = xxhash.xxh3_64()
        view = buf.numpy().data
        for a in range(0, e.size, _READ_CHUNK):
            h.update(view[a: a + _READ_CHUNK])
            if tick is not None:
                tick()
        if h.hexdigest() != e.xxh3_64:
            problems[e.path] = f"{step_rel}/{e.path}: {manifest.HASH_NAME} {h.hexdigest()} != manifest {e.xxh3_64}"
            del mapped[e.path]
    return problems


def read_verified(store: Store, step_rel: str, entries: list[manifest.FileEntry],
                  on_mapped: Callable[[dict[str, torch.Tensor]], None] | None = None,
                  progress: Progress | None = None, on_touched: Callable[[str, int], None] | None = None
                  ) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Map ``entries`` of a committed step of a local ``store`` into memory and checksum them:
    a verification and the load's read in one pass (the load then decodes from the mapping).
    ``on_mapped``: called with a copy of {file path: mapping} once mapped, before the checksums.
    ``progress`` (a bounded read, :mod:`tierckpt.io.bounded`): ticked per file opened, per
    chunk read and per chunk hashed, the pages faulted in (:func:`touch_share`, reported to
    ``on_touched(path, end)``) before the checksums; the read stops with
    :class:`~tierckpt.errors.ReadTimeout` once its waiter gave up (:attr:`Progress.abandoned`).

    Returns:
        ({file path: uint8 tensor of its bytes} of the intact files, problems as
        :func:`~tierckpt.io.manifest.verify_files` words them ([] = every file intact)).
    """
    def tick(where: str | None = None) -> None:
        if progress is not None:
            if progress.abandoned:  # nobody waits for this read any more: stop reading
                raise ReadTimeout(f"{step_rel}: read abandoned")
            progress.tick(where)

    def touched(path: str, end: int) -> None:
        if on_touched is not None:
            on_touched(path, end)
        tick(f"{step_rel}/{path}")

    out, problems = map_share(store, step_rel, entries, tick if progress is not None else None)
    if on_mapped is not None:
        on_mapped(dict(out))
    if progress is not None:
        touch_share(entries, out, touched)
    problems.update(check_share(step_rel, entries, out, tick if progress is not None else None))
    return out, [problems[e.path] for e in entries if e.path in problems]


class OwnRead:
    """This rank's share of a committed step read on a helper thread, so a restore reads its
    own copy while the pulls of other nodes run: the files are mapped first (:meth:`mapped`:
    the kernel reads them from then on), then checksummed (:meth:`result` joins). The load may
    decode from the mappings while the checksums run: a restore then loads and verifies in
    one pass over the disk and must not use the state unless :meth:`result` finds no problem.

    With ``timeout_s`` (``TierConfig.restore_read_timeout_s``) the read is bounded: the helper
    faults every page in before hashing it, and the load waits (:meth:`wait`, the
    :class:`MemoryReader`'s ``wait``) until the pages it decodes were read, so a hung disk
    blocks only the helper; every wait of this object raises
    :class:`~tierckpt.errors.ReadTimeout` after ``timeout_s`` seconds without progress (a
    file that blocks on open, a read that never returns), and the helper is then left behind
    (never joined; its late result is discarded, it writes nowhere). Without, a page not yet
    read blocks the load until the disk delivers it.

    A share larger than ``limit`` bytes is not read here (:attr:`started` False): the caller
    verifies and loads from disk as before."""

    def __init__(self, store: Store, step_rel: str, index: int, count: int, limit: int,
                 timeout_s: float | None = None):
        self.started = False
        self._out: tuple[dict[str, torch.Tensor], list[str]] = ({}, [])
        self._mapped: dict[str, torch.Tensor] = {}
        self._touched: dict[str, int] = {}
        self._published = self._done = False
        doc = manifest.read_committed(store, step_rel) if store.local else None
        if doc is None:
            return
        entries = manifest.entries_of(doc)
        share = manifest.split_share(entries, index, count)
        # every rank's DCP load reads .metadata: each maps (and verifies) it too, so no rank's
        # load reads it from a disk that may hang (the share of one rank only otherwise)
        share += [e for e in entries if e.path == ".metadata" and e not in share]
        if sum(e.size for e in share) > limit:
            return
        self.started = True
        self._error: BaseException | None = None
        self._progress = Progress(timeout_s, f"reading {store.url_of(step_rel)}") if timeout_s else None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(store, step_rel, share), daemon=True,
                                        name="tierckpt-own-read")
        self._thread.start()

    def _run(self, store: Store, step_rel: str, share: list[manifest.FileEntry]) -> None:
        try:
            out = read_verified(store, step_rel, share, on_mapped=self._publish, progress=self._progress,
                                on_touched=self._touch)
            self._out = out
        except BaseException as e:  # re-raised in result(), on the restoring thread
            self._error = e
        finally:
            self._done = True
            self._ready.set()
            if self._progress is not None:
                self._progress.tick()

    def _publish(self, mapped: dict[str, torch.Tensor]) -> None:
        self._mapped = mapped
        self._published = True
        self._ready.set()
        if self._progress is not None:
            self._progress.tick()

    def _touch(self, path: str, end: int) -> None:
        self._touched[path] = end

    def _wait(self, done: Callable[[], bool]) -> None:
        if self._progress is not None:
            self._progress.wait_until(done)
        elif not done():
            self._thread.join()

    def mapped(self) -> dict[str, torch.Tensor]:
        """{file path: uint8 tensor} of the share's files present with their manifest size,
        as soon as they are mapped (their checksums may still run: see :meth:`result`);
        {} if not started or the mapping failed. Raises ``ReadTimeout`` (bounded read)."""
        if self.started:
            if self._progress is not None:
                self._progress.wait_until(lambda: self._published or self._done)
            else:
                self._ready.wait()
        return self._mapped

    def wait(self, path: str, end: int) -> None:
        """Block until bytes ``:end`` of ``path`` (a file of :meth:`mapped`) were read by the
        helper (a no-op without a bound). Raises ``ReadTimeout`` (bounded read)."""
        if self.started and self._progress is not None:
            self._progress.wait_until(lambda: self._done or self._touched.get(path, -1) >= end)

    def result(self) -> tuple[dict[str, torch.Tensor], list[str]]:
        """(memory, problems) of the share (see :func:`read_verified`); ({}, []) if not started.
        Raises what the read raised, or ``ReadTimeout`` (bounded read)."""
        if self.started:
            self._wait(lambda: self._done)
            if self._error is not None:
                raise self._error
        return self._out

    def join(self) -> None:
        """Wait for the reader thread to end; never raises (:meth:`result` reports its error,
        once the restore has agreed on it, this is only the cleanup). A bounded read that
        makes no progress is left behind instead (see the class docstring)."""
        if self.started:
            with contextlib.suppress(ReadTimeout):
                self._wait(lambda: self._done)
