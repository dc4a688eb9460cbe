"""A rank's beacon: liveness and progress a node agent reads without talking to the rank.

A node agent (:mod:`tierckpt.recovery.agent`) creates one small file per rank (32 bytes, in
the agent's own temporary directory, ideally on tmpfs) and names it in the rank's
``TIERCKPT_BEACON``. Both sides map it (``mmap``, ``MAP_SHARED``), so reading it costs the
agent no system call per rank and the rank no I/O:

==========  ========  ============================================================
offset      type      field
==========  ========  ============================================================
0           uint64    ``alive``: incremented every ``interval`` by a daemon thread of the rank
8           int64     ``step``: the last training step reported (-1: none yet)
16          float64   ``progress_at``: UNIX seconds of that report (0.0: none)
24          uint64    ``pid`` of the rank
==========  ========  ============================================================

Why a thread and a step counter: a rank whose main thread waits in a collective for a peer
(a deadlock, a hung peer) still ticks ``alive`` but reports no ``step``; a SIGSTOPped or
frozen process ticks neither. The agent tells the two apart and the launcher replaces a node
whose ranks stopped ticking within its ``hang_timeout_s``, instead of waiting out the
trainer's own collective timeouts (torchtitan: 100 s / 300 s).

The rank side is :func:`start_from_env` (the agent's child bootstrap calls it; idempotent) and
:func:`report_progress` (the engine calls it from ``observe_step``, every step; a no-op without
a beacon). Nothing here touches CUDA or any process group.
"""

from __future__ import annotations

import logging
import mmap
import os
import struct
import threading
import time
from dataclasses import dataclass

from tierckpt import clock

log = logging.getLogger(__name__)

BEACON_ENV = "TIERCKPT_BEACON"
_FMT = "<QqdQ"
SIZE = struct.calcsize(_FMT)  # 32 bytes
DEFAULT_INTERVAL_S = 0.25

_lock = threading.Lock()
_mine: "_RankBeacon | None" = None


class _RankBeacon:
    """The rank's end: the mapped file and its ticking thread."""

    def __init__(self, path: str, interval_s: float):
        fd = os.open(path, os.O_RDWR)
        try:
            self.map = mmap.mmap(fd, SIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        struct.pack_into("<Q", self.map, 24, os.getpid())
        self.interval_s = interval_s
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._tick, name="tierckpt-beacon", daemon=True)
        self.thread.start()

    def _tick(self) -> None:
        n = 0
        while not self._stop.wait(self.interval_s):
            n += 1
            struct.pack_into("<Q", self.map, 0, n)

    def progress(self, step: int) -> None:
        struct.pack_into("<qd", self.map, 8, int(step), clock.now())


def start_from_env(interval_s: float = DEFAULT_INTERVAL_S) -> bool:
    """Start ticking the beacon named by ``$TIERCKPT_BEACON`` (once per process).

    Returns:
        True when a beacon ticks (now or since an earlier call), False without the variable or
        when the file cannot be mapped (logged; monitoring is best effort, training goes on).
    """
    global _mine
    path = os.environ.get(BEACON_ENV, "").strip()
    if not path:
        return False
    with _lock:
        if _mine is not None:
            return True
        try:
            _mine = _RankBeacon(path, interval_s)
        except (OSError, ValueError) as e:
            log.warning("tierckpt: cannot map the beacon %s=%s (%s): this rank's liveness is not monitored",
                        BEACON_ENV, path, e)
            return False
    return True


def report_progress(step: int) -> None:
    """Record that training step ``step`` finished (cheap: one 16-byte write to shared memory;
    a no-op when this process has no beacon)."""
    b = _mine
    if b is not None:
        b.progress(step)


def create(path: str) -> None:
    """Create the zeroed beacon file ``path`` (the agent's side, before the rank starts).

    Raises:
        OSError: it cannot be written.
    """
    with open(path, "wb") as f:
        f.write(struct.pack(_FMT, 0, -1, 0.0, 0))


@dataclass
class BeaconState:
    """What an agent last read from one beacon.

    Attributes:
        alive: the tick counter.
        step: the last step reported (-1: none).
        progress_at: UNIX seconds of that report (0.0: none).
        alive_age_s: seconds since ``alive`` last changed (as the reader saw it).
    """

    alive: int
    step: int
    progress_at: float
    alive_age_s: float


class BeaconReader:
    """The agent's end of one beacon (see the module docstring).

    Args:
        path: the beacon file (created with :func:`create`).

    Raises:
        OSError: the file cannot be mapped.
    """

    def __init__(self, path: str):
        self.path = path
        fd = os.open(path, os.O_RDONLY)
        try:
            self.map = mmap.mmap(fd, SIZE, mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            os.close(fd)
        self._last_alive = -1
        self._changed_at = time.monotonic()

    def read(self) -> BeaconState:
        """The current values; ``alive_age_s`` counts from this reader's creation until the
        rank's first tick."""
        alive, step, at, _pid = struct.unpack_from(_FMT, self.map, 0)
        now = time.monotonic()
        if alive != self._last_alive:
            self._last_alive, self._changed_at = alive, now
        return BeaconState(alive=alive, step=step, progress_at=at, alive_age_s=now - self._changed_at)

    def close(self) -> None:
        """Unmap (the file is the agent's to delete)."""
        self.map.close()
