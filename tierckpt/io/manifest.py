"""Manifests, commit markers and checksum verification.

Commit protocol of one step directory (docs/design.md, the commit protocol):
data files written and fsynced → ``tierckpt.manifest.json`` (relative path, size and
xxh3-64 of every file) written atomically → ``tierckpt.committed`` written by atomic rename
→ directory fsynced. A step directory without a valid marker does not exist for restore or
retention. The marker records the xxh3-64 of the manifest bytes, so a manifest swapped or
torn after the commit is detected too.

Checksums: xxHash XXH3 64-bit (https://xxhash.com), via the ``xxhash`` package.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from typing import Callable

import xxhash

from tierckpt import clock
from tierckpt.errors import VerificationError
from tierckpt.io.layout import COMMIT_FILES, INPROGRESS, MANIFEST, MARKER
from tierckpt.io.storage import Store

HASH_NAME = "xxh3_64"
FORMAT = "tierckpt-manifest"
VERSION = 1
_READ_CHUNK = 8 << 20


@dataclass(frozen=True)
class FileEntry:
    """One file of a step: ``path`` relative to the step dir, ``size`` in bytes, xxh3-64 hex."""

    path: str
    size: int
    xxh3_64: str


def hash_stream(f, buf: bytearray | None = None) -> tuple[int, str]:
    """Stream ``f`` through XXH3-64; return (bytes read, hex digest)."""
    h = xxhash.xxh3_64()
    buf = buf or bytearray(_READ_CHUNK)
    view = memoryview(buf)
    n_total = 0
    readinto = getattr(f, "readinto", None)
    while True:
        if readinto is not None:
            n = readinto(view)
            if not n:
                break
            h.update(view[:n])
        else:
            chunk = f.read(len(buf))
            if not chunk:
                break
            n = len(chunk)
            h.update(chunk)
        n_total += n
    return n_total, h.hexdigest()


def hash_file(store: Store, rel: str, tick: Callable[[], None] | None = None) -> FileEntry:
    """Checksum one file of ``store``; ``rel`` is kept as the entry's path. ``tick``: called
    after each chunk read (a bounded read's progress, :mod:`tierckpt.io.bounded`)."""
    with store.open(rel, "rb") as f:
        size, digest = hash_stream(f if tick is None else _Ticking(f, tick))
    return FileEntry(rel, size, digest)


class _Ticking:
    """A binary file whose every ``readinto`` calls ``tick`` afterwards."""

    def __init__(self, f, tick: Callable[[], None]):
        self.f, self.tick = f, tick

    def readinto(self, b) -> int:
        n = self.f.readinto(b)
        self.tick()
        return n


def data_files(store: Store, step_rel: str) -> list[str]:
    """Files of a step directory other than the commit files and leftovers ``*.tmp``."""
    return [
        p
        for p in store.walk_files(step_rel)
        if p not in COMMIT_FILES and p != INPROGRESS and not p.endswith(".tmp")
    ]


def manifest_bytes(entries: list[FileEntry], **meta) -> bytes:
    """Serialise a manifest: ``meta`` (tier, step, node, …) plus the sorted file entries."""
    doc = {
        "format": FORMAT,
        "version": VERSION,
        "hash": HASH_NAME,
        **meta,
        "total_bytes": sum(e.size for e in entries),
        "files": [
            {"path": e.path, "size": e.size, HASH_NAME: e.xxh3_64}
            for e in sorted(entries, key=lambda e: e.path)
        ],
    }
    return json.dumps(doc, indent=1, sort_keys=False).encode()


def commit(store: Store, step_rel: str, entries: list[FileEntry], **meta) -> dict:
    """Make ``step_rel`` a committed step (see the module docstring for the order).

    The caller has already fsynced the data files. The manifest records ``committed_s``, the
    commit's time in UNIX seconds on the monotonic clock (:func:`tierckpt.clock.now`; the
    retention's time windows, :mod:`tierckpt.tiers.keep`), unless ``meta`` gives one. Returns
    the manifest as a dict.
    """
    meta.setdefault("committed_s", clock.now())
    mbytes = manifest_bytes(entries, **meta)
    commit_bytes(store, step_rel, mbytes)
    return json.loads(mbytes)


def commit_bytes(store: Store, step_rel: str, mbytes: bytes) -> None:
    """Commit ``step_rel`` with an existing manifest's exact bytes (replicas and pulled copies
    keep the source's manifest, so one marker check covers every copy)."""
    meta = json.loads(mbytes)
    # the marker's directory fsync below makes this rename durable too; a power loss that
    # keeps the marker and loses the manifest reads as uncommitted (read_committed)
    store.write_atomic(f"{step_rel}/{MANIFEST}", mbytes, sync_dir=False)
    marker = {
        "format": "tierckpt-marker",
        "version": VERSION,
        "manifest_" + HASH_NAME: xxhash.xxh3_64_hexdigest(mbytes),
        "committed_at": time.time(),
        **{k: v for k, v in meta.items() if k in ("tier", "step", "node")},
    }
    store.write_atomic(f"{step_rel}/{MARKER}", json.dumps(marker).encode())


def uncommit(store: Store, step_rel: str) -> None:
    """Remove the marker first, so a step being deleted is never seen half-deleted."""
    store.remove(f"{step_rel}/{MARKER}")


def supersede(store: Store, step_rel: str, strict: bool = False) -> bool:
    """Take a committed step out of the timeline after a rollback to an older step: the marker
    is renamed ``tierckpt.committed.superseded`` (data kept; rename it back to revive it, once
    no committed later save proves it abandoned: :mod:`tierckpt.history.timeline`).
    Returns whether a marker was there.

    Raises:
        OSError: ``strict`` and the rename failed for another reason than a missing marker
            (without ``strict`` every failure is False)."""
    try:
        store.rename(f"{step_rel}/{MARKER}", f"{step_rel}/{MARKER}.superseded")
        return True
    except FileNotFoundError:
        return False
    except OSError:
        if strict:
            raise
        return False


def superseded(store: Store, step_rel: str) -> bool:
    """Whether a rollback superseded ``step_rel`` (its marker renamed by :func:`supersede`)."""
    try:
        return store.exists(f"{step_rel}/{MARKER}.superseded")
    except OSError:
        return False


def read_committed(store: Store, step_rel: str) -> dict | None:
    """The manifest of ``step_rel`` if it is committed (marker present and matching), else None."""
    try:
        marker = json.loads(store.read_bytes(f"{step_rel}/{MARKER}"))
        mbytes = store.read_bytes(f"{step_rel}/{MANIFEST}")
    except (FileNotFoundError, NotADirectoryError, ValueError, OSError):
        return None
    if not isinstance(marker, dict) or marker.get("manifest_" + HASH_NAME) != xxhash.xxh3_64_hexdigest(mbytes):
        return None
    try:
        doc = json.loads(mbytes)
    except ValueError:
        return None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or doc.get("hash") != HASH_NAME:
        return None
    return doc


def entries_of(manifest: dict) -> list[FileEntry]:
    """The file entries of a manifest dict."""
    return [FileEntry(f["path"], int(f["size"]), f[HASH_NAME]) for f in manifest["files"]]


_RANK_FILE = re.compile(r"^__(\d+)_\d+\.distcp$")


def rank_of_file(path: str) -> int | None:
    """The writing rank of a DCP data file (``__<rank>_<n>.distcp``, FileSystemWriter's naming),
    else None (``.metadata`` and any other file)."""
    m = _RANK_FILE.match(path.rsplit("/", 1)[-1])
    return int(m.group(1)) if m else None


def split_share(entries: list[FileEntry], index: int, count: int) -> list[FileEntry]:
    """Rank ``index``'s share of ``entries`` among ``count`` ranks (every entry in exactly one share).

    Rank-affine: a DCP data file written by rank r < ``count`` of the node group goes to rank r,
    which is the rank that loads it back under the same layout, so a share that is read,
    checksummed or received into memory is the share that rank's load needs. Every other file
    goes round-robin in manifest order.

    Raises:
        ValueError: ``index`` not in ``[0, count)``.
    """
    if not 0 <= index < count:
        raise ValueError(f"share index {index} not in [0, {count})")
    out, k = [], 0
    for e in entries:
        r = rank_of_file(e.path)
        if r is not None and r < count:
            if r == index:
                out.append(e)
            continue
        if k % count == index:
            out.append(e)
        k += 1
    return out


def verify_files(store: Store, step_rel: str, entries: list[FileEntry],
                 tick: Callable[[str], None] | None = None) -> list[str]:
    """Re-check size and checksum of ``entries``; return one message per problem ([] = intact).
    ``tick(path)``: called before each file and after each chunk read (a bounded read's
    progress, :class:`tierckpt.io.bounded.Progress`)."""
    problems = []
    for e in entries:
        rel = f"{step_rel}/{e.path}"
        if tick is not None:
            tick(rel)
        try:
            size = store.size(rel)
        except (FileNotFoundError, OSError) as ex:
            problems.append(f"{rel}: missing ({ex.__class__.__name__})")
            continue
        if size != e.size:
            problems.append(f"{rel}: size {size} != manifest {e.size}")
            continue
        got = hash_file(store, rel, None if tick is None else (lambda: tick(rel)))
        if got.xxh3_64 != e.xxh3_64:
            problems.append(f"{rel}: {HASH_NAME} {got.xxh3_64} != manifest {e.xxh3_64}")
    return problems


def verify_step(store: Store, step_rel: str) -> list[str]:
    """Verify a whole step directory: committed, and every file intact.

    Returns:
        problem messages; empty when the step is committed and every byte matches.
    """
    doc = read_committed(store, step_rel)
    if doc is None:
        return [f"{step_rel}: not committed (no valid {MARKER}/{MANIFEST})"]
    return verify_files(store, step_rel, entries_of(doc))


def require_intact(store: Store, step_rel: str, entries: list[FileEntry]) -> None:
    """Raise :class:`VerificationError` listing every problem of ``entries``."""
    problems = verify_files(store, step_rel, entries)
    if problems:
        raise VerificationError("; ".join(problems[:5]) + (" …" if len(problems) > 5 else ""))
