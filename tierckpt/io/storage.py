"""Filesystem access for the tiers: a local directory (with fsync) or any fsspec URL.

The local tier and a persistent tier on a POSIX path need fsync for the commit protocol;
object stores have no fsync but make an object visible only once it is fully written, so the
same protocol (data → manifest → marker) holds there too. Paths handed to a :class:`Store`
are always relative, '/'-separated, so ``s3://`` URLs never go through ``os.path``.

A node-local root's Store carries :class:`~tierckpt.io.perms.Modes` (``local_permissions``):
every directory and file it creates gets exactly those bits (:mod:`tierckpt.io.perms`). A
Store without modes (the persistent tier) creates what the umask and default ACLs give.
"""

from __future__ import annotations

import os
import posixpath
from typing import IO, Iterator, Mapping

import fsspec
from fsspec.implementations.local import LocalFileSystem

from tierckpt.io import perms
from tierckpt.io.perms import Modes


_REGISTERED: dict[str, dict] = {}  # URL prefix -> fsspec options (register_options)


def register_options(prefix: str, options: Mapping) -> None:
    """Make ``options`` the fsspec options of every remote :class:`Store` opened without options
    of its own in this process whose URL lies under ``prefix`` ("" = every URL): the engine
    registers the persistent root's (``TierConfig.storage_options``) at start-up, the CLI its
    ``--storage-options``, so code handed only a step's URL (a framework hook reading a side
    file, a listing of the root's parent) reaches it with the same endpoint and credentials."""
    _REGISTERED[prefix] = dict(options)


def options_under(url: str) -> dict:
    """A copy of the options :func:`register_options` gave the longest prefix ``url`` lies under
    ({} when none)."""
    def under(prefix: str) -> bool:
        return not prefix or url == prefix or url.startswith(prefix.rstrip("/") + "/")

    prefixes = [p for p in _REGISTERED if under(p)]
    return dict(_REGISTERED[max(prefixes, key=len)]) if prefixes else {}


def _is_local_url(url: str) -> bool:
    return "://" not in url or url.startswith("file://")


class Store:
    """A directory tree rooted at ``root`` (path or fsspec URL).

    Args:
        root: local path or fsspec URL, e.g. ``/lustre/run1`` or ``s3://bucket/run1``.
        modes: exact permission bits of every directory and file this Store creates (the root
            included when it creates it, not the root's missing parents); local paths only.
            None: the umask's and default ACLs' bits, and a file :meth:`write_atomic`
            replaces keeps no bit its predecessor lacked.
        storage_options: passed to ``fsspec.core.url_to_fs`` for remote URLs
            (``TierConfig.options_for``; none given: :func:`options_under` the URL), kept as
            :attr:`storage_options` for DCP's fsspec reader and writer and for :meth:`sub`;
            ignored for local paths. fsspec's listings cache is turned off unless they say
            otherwise.

    All ``rel`` arguments are '/'-separated paths relative to ``root``.
    """

    def __init__(self, root: str, modes: Modes | None = None, **storage_options):
        self.url = str(root)
        self.local = _is_local_url(self.url)
        self.modes = modes if self.local else None
        # other ranks and nodes write under the same root: a cached listing would hide their
        # steps and probes (fsspec's listings cache is on by default)
        self.storage_options = {} if self.local else {"use_listings_cache": False,
                                                      **(storage_options or options_under(self.url))}
        if self.local:
            path = self.url[len("file://"):] if self.url.startswith("file://") else self.url
            self.root = os.path.abspath(path)
            self.fs = LocalFileSystem()
        else:
            self.fs, self.root = fsspec.core.url_to_fs(self.url, **self.storage_options)


    def __repr__(self) -> str:
        return f"Store({self.url!r})"

    # -- paths -------------------------------------------------------------------------------
    def path(self, rel: str = "") -> str:
        """Absolute path (local) or protocol-less fsspec path of ``rel``."""
        return posixpath.join(self.root, rel) if rel else self.root

    def url_of(self, rel: str = "") -> str:
        """A path DCP's FileSystemWriter/FsspecWriter accepts for ``rel``."""
        if self.local:
            return self.path(rel)
        return self.fs.unstrip_protocol(self.path(rel))

    def sub(self, rel: str) -> "Store":
        """A Store rooted at ``rel``."""
        if self.local:
            return Store(self.path(rel), self.modes)
        return Store(self.url_of(rel), **self.storage_options)

    # -- queries -----------------------------------------------------------------------------
    def exists(self, rel: str) -> bool:
        """Whether ``rel`` exists."""
        return os.path.exists(self.path(rel)) if self.local else self.fs.exists(self.path(rel))

    def isdir(self, rel: str) -> bool:
        """Whether ``rel`` is a directory."""
        return os.path.isdir(self.path(rel)) if self.local else self.fs.isdir(self.path(rel))

    def listdir(self, rel: str = "") -> list[str]:
        """Names (not paths) of the entries of ``rel``; [] when it does not exist."""
        if self.local:
            try:
                return sorted(os.listdir(self.path(rel)))
            except (FileNotFoundError, NotADirectoryError):
                return []
        target = self.path(rel).rstrip("/")
        try:
            paths = self.fs.ls(target, detail=False)
        except (FileNotFoundError, NotADirectoryError):
            return []
        # fsspec's ls of a file returns the file itself; a file has no entries.
        return sorted(posixpath.basename(p.rstrip("/")) for p in paths if p.rstrip("/") != target)

    def size(self, rel: str) -> int:
        """Size of file ``rel`` in bytes."""
        return os.path.getsize(self.path(rel)) if self.local else int(self.fs.size(self.path(rel)))

    def walk_files(self, rel: str = "") -> Iterator[str]:
        """Relative paths (to ``rel``) of every regular file under ``rel``, sorted."""
        base = self.path(rel)
        if self.local:
            out = []
            for d, _, files in os.walk(base):
                for f in files:
                    out.append(os.path.relpath(os.path.join(d, f), base).replace(os.sep, "/"))
            return iter(sorted(out))
        return iter(sorted(posixpath.relpath(p, base) for p in self.fs.find(base)))

    # -- I/O ---------------------------------------------------------------------------------
    def open(self, rel: str, mode: str = "rb") -> IO:
        """Open ``rel`` (parent directories are created for writes on local paths; a file
        created gets the Store's modes)."""
        if self.local:
            if any(c in mode for c in "wax"):
                self._makedirs_path(os.path.dirname(self.path(rel)))
                if self.modes is not None:
                    return open(self.path(rel), mode, opener=perms.opener(self.modes.file))
            return open(self.path(rel), mode)
        return self.fs.open(self.path(rel), mode)

    def create_fd(self, rel: str, flags: int) -> int:
        """``os.open`` of local file ``rel`` with ``flags | O_CREAT`` (parents created), with
        the Store's file mode (None: ``0o644`` under the umask). The caller closes it.

        Raises:
            OSError: as ``os.open`` (e.g. a filesystem refusing ``O_DIRECT``).
        """
        path = self.path(rel)
        self._makedirs_path(os.path.dirname(path))
        if self.modes is None:
            return os.open(path, flags | os.O_CREAT, 0o644)
        return perms.open_fd(path, flags, self.modes.file)

    def _makedirs_path(self, path: str) -> None:
        if self.modes is None:
            os.makedirs(path, exist_ok=True)
        else:
            perms.makedirs(path, self.modes.dir, top=self.root)

    def read_bytes(self, rel: str) -> bytes:
        """Whole content of ``rel``."""
        with self.open(rel, "rb") as f:
            return f.read()

    def read_many(self, rels: list[str]) -> dict[str, bytes]:
        """``{rel: content}`` of the files ``rels`` (remote: fetched concurrently by fsspec's
        ``cat``); a file missing by the time it is read is left out.

        Raises:
            OSError: a file could not be read for another reason.
        """
        if self.local:
            out = {}
            for rel in rels:
                try:
                    out[rel] = self.read_bytes(rel)
                except FileNotFoundError:
                    pass
            return out
        paths = {self.path(rel): rel for rel in rels}
        got = self.fs.cat(list(paths), on_error="return")
        out = {}
        for path, data in got.items():
            if isinstance(data, FileNotFoundError):
                continue
            if isinstance(data, BaseException):
                raise data
            out[paths[path]] = data
        return out

    def makedirs(self, rel: str = "") -> None:
        """Create directory ``rel`` and its parents (with the Store's modes); existing is fine."""
        if self.local:
            self._makedirs_path(self.path(rel))
        else:
            self.fs.makedirs(self.path(rel), exist_ok=True)

    def write_atomic(self, rel: str, data: bytes, *, sync: bool = True, sync_dir: bool = True) -> None:
        """Write ``data`` so readers see either nothing or all of it.

        Local: write ``rel.tmp`` → fsync → rename → fsync the directory (POSIX rename is
        atomic); the file gets the Store's modes, or without modes is no wider than the file
        it replaces (a user who narrowed it keeps it narrow). Remote: a single put, which
        object stores make visible only when complete.

        ``sync=False``: neither fsync (atomic for readers, not durable across a power loss:
        for records nothing depends on); ``sync_dir=False``: the file is fsynced, its rename
        becomes durable with the next fsync of its directory (a caller that writes another
        file there next and fsyncs the directory then).
        """
        if self.local:
            p = self.path(rel)
            tmp = p + ".tmp"
            with self.open(rel + ".tmp", "wb") as f:  # parents created, the Store's modes
                if self.modes is None:
                    perms.narrow_like(f.fileno(), p)
                f.write(data)
                if sync:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, p)
            if sync and sync_dir:
                fsync_dir(os.path.dirname(p))
        else:
            with self.fs.open(self.path(rel), "wb") as f:
                f.write(data)

    def remove(self, rel: str) -> None:
        """Remove a file; missing is fine."""
        try:
            if self.local:
                os.remove(self.path(rel))
            else:
                self.fs.rm(self.path(rel))
        except FileNotFoundError:
            pass

    def rmtree(self, rel: str) -> None:
        """Remove a directory tree; missing is fine."""
        import shutil

        if self.local:
            shutil.rmtree(self.path(rel), ignore_errors=True)
        else:
            try:
                self.fs.rm(self.path(rel), recursive=True)
            except FileNotFoundError:
                pass

    def rename(self, src: str, dst: str) -> None:
        """Rename ``src`` to ``dst`` (atomic on POSIX; directory fsynced)."""
        if self.local:
            os.replace(self.path(src), self.path(dst))
            fsync_dir(os.path.dirname(self.path(dst)))
        else:
            self.fs.mv(self.path(src), self.path(dst), recursive=True)

    def fsync_tree(self, rel: str = "") -> None:
        """fsync every file and directory under ``rel`` (local only; no-op for object stores)."""
        if not self.local:
            return
        base = self.path(rel)
        for d, _, files in os.walk(base):
            for name in files:
                fd = os.open(os.path.join(d, name), os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            fsync_dir(d)


def fsync_dir(path: str) -> None:
    """fsync a directory so a rename or create inside it survives a power loss."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
