"""Shared storage behind one bandwidth limit, for every process of a bench run.

On a cluster the persistent (shared) folder is a network filesystem that every node shares and
that is slower than node-local disk; on one machine a "shared" folder is the same disk as the
local tier, which would hide the reason tiering exists. This layer makes it what it is on a
cluster: every byte read from or written to a file under ``root`` passes one FIFO link of
``bytes_per_s`` shared by all processes (all simulated nodes), as a network filesystem's
aggregate bandwidth is. Node-local disks (any other path) are not throttled.

The link is a token reservation in a small state file (``state``, locked with ``flock``): a
transfer of n bytes reserves the interval ``[max(now, free), max(now, free) + n / B)`` of the
link and sleeps until its end before it returns, so concurrent writers of all nodes queue
behind each other (a write larger than ``CHUNK`` bytes is split, so they interleave). Times
are ``time.monotonic()``, one clock for every process of the machine (Linux CLOCK_MONOTONIC).

It is installed in a process by :func:`install` (``bench/goodput/site/sitecustomize.py`` does it
at interpreter start when ``$TIERCKPT_BENCH_SHARED_ROOT`` is set, so the launcher's node agents
and every rank forked from them have it): ``builtins.open`` is wrapped, which covers DCP's
``FileSystem.create_stream`` (torchtitan's stock checkpointer, through ``pathlib``'s
``io.open``), tierckpt's hashing writer and
fsspec's local files — what writes checkpoint data. A C-level open (``torch.save`` to a path
string) is not throttled; neither DCP nor tierckpt writes checkpoint data that way.
"""

from __future__ import annotations

import builtins
import fcntl
import io
import os
import struct
import time
from typing import Any

ENV_ROOT = "TIERCKPT_BENCH_SHARED_ROOT"
ENV_BPS = "TIERCKPT_BENCH_SHARED_BPS"
ENV_STATE = "TIERCKPT_BENCH_SHARED_STATE"
CHUNK = 4 << 20  # bytes per reservation: concurrent writers interleave at this grain
SETTLE = 1 << 20  # small transfers pass the link together once they sum to this many bytes
_FMT = "dQQ"  # link free at (monotonic s), bytes moved, transfers
_real_open = builtins.open


class SharedLink:
    """One FIFO link of ``bytes_per_s`` shared through the state file ``state``.

    Args:
        state: path of the state file (created; 24 bytes).
        bytes_per_s: bandwidth of the link, bytes per second, > 0.
        clock, sleep: injectable for tests (default ``time.monotonic``, ``time.sleep``).

    Raises:
        ValueError: ``bytes_per_s`` ≤ 0.
    """

    def __init__(self, state: str, bytes_per_s: float, clock=time.monotonic, sleep=time.sleep):
        if not bytes_per_s > 0:
            raise ValueError(f"bytes_per_s must be > 0, got {bytes_per_s!r}")
        self.state, self.bps, self.clock, self.sleep = state, float(bytes_per_s), clock, sleep
        fd = os.open(state, os.O_RDWR | os.O_CREAT, 0o644)
        os.close(fd)

    def reserve(self, n: int) -> float:
        """Reserve the link for ``n`` bytes; returns the monotonic time the transfer ends."""
        fd = os.open(self.state, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            raw = os.pread(fd, struct.calcsize(_FMT), 0)
            free, moved, count = struct.unpack(_FMT, raw) if len(raw) == struct.calcsize(_FMT) else (0.0, 0, 0)
            end = max(self.clock(), free) + n / self.bps
            os.pwrite(fd, struct.pack(_FMT, end, moved + n, count + 1), 0)
        finally:
            os.close(fd)  # releases the lock
        return end

    def transfer(self, n: int) -> None:
        """Block until ``n`` bytes have passed the link (after every reservation made before)."""
        if n <= 0:
            return
        wait = self.reserve(n) - self.clock()
        if wait > 0:
            self.sleep(wait)

    def totals(self) -> dict[str, float]:
        """``{"bytes", "transfers", "busy_until"}`` of every process so far."""
        with _real_open(self.state, "rb") as f:  # not throttled
            raw = f.read()
        if len(raw) != struct.calcsize(_FMT):
            return {"bytes": 0, "transfers": 0, "busy_until": 0.0}
        free, moved, count = struct.unpack(_FMT, raw)
        return {"bytes": moved, "transfers": count, "busy_until": free}


class ThrottledFile:
    """A file object whose ``write``, ``read`` and ``readinto`` pass ``link``; everything else
    (seek, tell, fileno, flush, close, context manager) is the wrapped file's. Transfers under
    ``SETTLE`` bytes are summed and pass the link together (pickle writes many small pieces:
    one reservation and one sleep each would cost more than the bytes), at the latest on
    ``flush`` or ``close``."""

    def __init__(self, f, link: SharedLink):
        self._f, self._link, self._debt = f, link, 0

    def _pass(self, n: int) -> None:
        self._debt += n
        if self._debt >= SETTLE:
            self._settle()

    def _settle(self) -> None:
        n, self._debt = self._debt, 0
        self._link.transfer(n)

    def write(self, b) -> int:
        view = memoryview(b).cast("B")
        done = 0
        for off in range(0, len(view), CHUNK):
            part = view[off:off + CHUNK]
            self._pass(len(part))
            done += self._f.write(part)
        return done

    def read(self, n: int = -1):
        data = self._f.read(n)
        self._pass(len(data))
        return data

    def readinto(self, b) -> int:
        n = self._f.readinto(b)
        self._pass(n or 0)
        return n

    def flush(self) -> None:
        self._settle()
        self._f.flush()

    def close(self) -> None:
        self._settle()
        self._f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __iter__(self):
        return iter(self._f)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)


def install(root: str, bytes_per_s: float, state: str) -> SharedLink:
    """Throttle every ``open`` of a file under ``root`` in this process through one
    :class:`SharedLink` (``state``, ``bytes_per_s``); binary modes only (text files there are
    small side files); ``builtins.open`` and ``io.open`` are replaced. Returns the link. Idempotent per process (a second call replaces the
    link)."""
    link = SharedLink(state, bytes_per_s)
    prefix = os.path.realpath(root).rstrip("/") + "/"

    def open_(file, mode="r", *args, **kwargs):
        f = _real_open(file, mode, *args, **kwargs)
        if "b" in mode and isinstance(file, (str, bytes, os.PathLike)):
            path = os.fsdecode(os.fspath(file))
            if os.path.realpath(path).startswith(prefix):
                return ThrottledFile(f, link)
        return f

    builtins.open = io.open = open_  # io.open: pathlib's Path.open (DCP's FileSystem.create_stream)
    return link


def install_from_env() -> SharedLink | None:
    """:func:`install` from ``$TIERCKPT_BENCH_SHARED_ROOT`` / ``_BPS`` / ``_STATE``; None when the
    root is unset. Raises ValueError for a missing or non-positive ``_BPS``."""
    root = os.environ.get(ENV_ROOT)
    if not root:
        return None
    try:
        bps = float(os.environ.get(ENV_BPS, ""))
    except ValueError:
        raise ValueError(f"{ENV_BPS} must be a number of bytes per second > 0, got "
                         f"{os.environ.get(ENV_BPS)!r}") from None
    return install(root, bps, os.environ.get(ENV_STATE) or os.path.join(root, ".bench-link"))


def env_for(root: str, bytes_per_s: float, state: str) -> dict[str, str]:
    """The environment that makes a launched process throttle ``root`` (with ``PYTHONPATH``
    holding ``bench/goodput/site``, whose ``sitecustomize`` calls :func:`install_from_env`)."""
    site = os.path.join(os.path.dirname(os.path.abspath(__file__)), "site")
    return {ENV_ROOT: root, ENV_BPS: repr(float(bytes_per_s)), ENV_STATE: state, "PYTHONPATH": site}
