"""Permission bits of what tierckpt creates under a node-local root (``local_permissions``).

A node-local root holds the model and optimizer state in plain DCP files; under the usual
umask 022 they would be readable by every user of a shared node. Every directory and file
tierckpt (or DCP, through :class:`tierckpt.io.dcp_io.HashingFileSystem`) creates there gets
the exact bits of the configured setting, whatever the process umask:

- a file is created with ``os.open(..., mode)`` (the umask can only clear bits, so it is never
  wider than the setting, not even for an instant) and then ``fchmod``-ed to the exact bits
  (the umask may have cleared bits the setting grants, e.g. ``"group"`` under umask 077, and
  ``O_TRUNC`` of an existing file keeps its old bits);
- a directory is created with ``os.mkdir(path, mode)`` and then ``chmod``-ed the same way.

The process umask is never changed: it is process-wide, and the trainer's other threads create
files of their own meanwhile. The persistent tier gets no modes (:class:`Modes` ``None``): its
files keep what the user's umask and default ACLs give, and :func:`narrow_like` makes sure a
file tierckpt rewrites there is never wider than the one it replaces.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from typing import Callable

from tierckpt.errors import ConfigError


@dataclass(frozen=True)
class Modes:
    """Exact permission bits (``0o7777`` part of ``st_mode``) for directories and files."""

    dir: int
    file: int


SETTINGS: dict[str, Modes] = {
    "private": Modes(dir=0o700, file=0o600),  # the job's user only
    "group": Modes(dir=0o750, file=0o640),  # plus read access for the user's group
}
"""Values of ``TierConfig.local_permissions`` and their modes."""


def modes_of(setting: str, option: str = "local_permissions") -> Modes:
    """The :class:`Modes` of a ``local_permissions`` setting.

    Raises:
        ConfigError: naming ``option`` and the allowed values, for an unknown setting.
    """
    if not isinstance(setting, str) or setting not in SETTINGS:
        allowed = ", ".join(f"{k!r} (directories {v.dir:04o}, files {v.file:04o})" for k, v in SETTINGS.items())
        raise ConfigError(option, f"unknown setting {setting!r}; allowed: {allowed}")
    return SETTINGS[setting]


def makedirs(path: str, mode: int, top: str | None = None) -> None:
    """Create directory ``path`` and its missing parents; existing directories are fine.

    Every directory created at or below ``top`` (None: every directory created) gets exactly
    ``mode``; parents above ``top`` are created with the default mode, since a prefix such as
    ``/tmp/tierckpt`` may be shared with other users' jobs. Directories that already exist are
    left as they are. Safe against concurrent creators (ranks of one node).

    Raises:
        OSError: a directory cannot be created, or ``path`` exists and is not a directory.
    """
    path = os.path.abspath(path)
    if os.path.isdir(path):
        return
    if top is not None and not _within(path, os.path.abspath(top)):
        os.makedirs(path, exist_ok=True)
        return
    parent = os.path.dirname(path)
    if parent != path:
        makedirs(parent, mode, top)
    try:
        os.mkdir(path, mode)  # the umask can only narrow it: never wider than ``mode``
    except FileExistsError:
        if os.path.isdir(path):
            return  # another rank made it (and sets its mode)
        raise
    os.chmod(path, mode)  # the bits the umask cleared (``"group"`` under umask 077)


def _within(path: str, top: str) -> bool:
    return path == top or path.startswith(top.rstrip(os.sep) + os.sep)


def open_fd(path: str, flags: int, mode: int) -> int:
    """``os.open(path, flags | O_CREAT, mode)`` with the file's bits then set to exactly ``mode``.

    Returns:
        the file descriptor (the caller closes it).
    Raises:
        OSError: as ``os.open`` / ``os.fchmod``; the descriptor is closed then.
    """
    fd = os.open(path, flags | os.O_CREAT, mode)
    try:
        if stat.S_IMODE(os.fstat(fd).st_mode) != mode:  # umask-cleared bits, or an existing file's
            os.fchmod(fd, mode)
    except BaseException:
        os.close(fd)
        raise
    return fd


def opener(mode: int) -> Callable[[str, int], int]:
    """An ``opener`` for the built-in ``open()`` that creates files with exactly ``mode``
    (:func:`open_fd`)."""
    def _open(path: str, flags: int) -> int:
        return open_fd(path, flags, mode)
    return _open


def narrow_like(fd: int, existing: str) -> None:
    """Clear the bits of the file open as ``fd`` that the file ``existing`` (which it is about
    to replace) does not have, so a rewrite never widens what the user narrowed. Nothing
    happens when ``existing`` does not exist. Bits are only ever cleared.

    Raises:
        OSError: as ``os.fchmod``.
    """
    try:
        old = stat.S_IMODE(os.stat(existing).st_mode)
    except FileNotFoundError:
        return
    new = stat.S_IMODE(os.fstat(fd).st_mode)
    if new & ~old:
        os.fchmod(fd, new & old)


def tighten(path: str, mode: int) -> bool:
    """Set an existing directory's bits to exactly ``mode`` (one tierckpt owns, left by an
    earlier run under another setting or an older version). Returns whether it changed them;
    False when ``path`` does not exist.

    Raises:
        OSError: as ``os.chmod`` (not the owner).
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    if not stat.S_ISDIR(st.st_mode) or stat.S_IMODE(st.st_mode) == mode:
        return False
    os.chmod(path, mode)
    return True
