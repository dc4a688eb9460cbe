"""Background priority: the CPU and I/O priority of tierckpt's background threads.

A save's real cost to a trainer is not the blocking copy (δ) but what its background work — the
node-local write, the checksums, the replica sent and the one received, the persistent write —
takes from the training step's cores and disk. Megatron-Core gives its asynchronous checkpoint
worker a lower CPU and I/O priority for the same reason; tierckpt does it per thread, since its
background work runs in threads of the training process:

- **CPU**: ``setpriority(PRIO_PROCESS, tid, nice)`` on the thread's kernel task id. On Linux the
  nice value is a property of the thread (setpriority(2), "BUGS": the threads of a process do not
  share it), and under CFS a thread at nice ``n`` gets ``1.25**-n`` the share of a nice-0 thread
  when both want the same core (the kernel's ``sched_prio_to_weight`` table: nice 10 → weight
  110 against 1024). Threads the background thread starts inherit its nice value (clone(2)).
- **I/O**: ``ioprio_set(IOPRIO_WHO_PROCESS, tid, IOPRIO_PRIO_VALUE(class, level))``
  (ioprio_set(2); class best-effort = 2 with level 0..7, idle = 3), honoured by the BFQ and (on
  older kernels) CFQ I/O schedulers; with ``none``/``mq-deadline`` it changes nothing, which is
  harmless. Threads started afterwards inherit it.

Lowering either needs no privilege; raising it back would (``CAP_SYS_NICE``), so the priority is
only ever lowered, only on threads that tierckpt owns, and never on the thread that calls
``save()`` or on the staging copy that ``wait_for_staging()`` waits on (lowering those would move
cost into the training step instead of out of it). A platform or container that refuses a change
gets one warning and the thread goes on at its priority: priority is an optimisation, never a
reason to fail a save.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import sys
import threading
from dataclasses import dataclass

log = logging.getLogger(__name__)

IO_CLASSES = ("best-effort", "idle", "none")
"""Values of ``TierConfig.background_io_class``: the I/O class of the background threads
(``best-effort`` at level 7, the lowest of that class; ``idle``: only when the disk is otherwise
idle — may starve a save under a trainer that reads continuously; ``none``: leave it)."""

_IOPRIO_CLASS_SHIFT = 13  # include/uapi/linux/ioprio.h
_IOPRIO_WHO_PROCESS = 1
_IOPRIO_CLASS = {"best-effort": 2, "idle": 3}
_BE_LOWEST_LEVEL = 7
# ioprio_set's syscall number per architecture (arch/*/syscall tables); absent: not attempted
_SYS_IOPRIO_SET = {"x86_64": 251, "aarch64": 30, "ppc64le": 273, "s390x": 282, "i686": 289}

_warned: set[str] = set()
_warn_lock = threading.Lock()


@dataclass(frozen=True)
class BackgroundPriority:
    """The priority tierckpt's background threads take (``TierConfig.background_nice`` and
    ``background_io_class``).

    Attributes:
        nice: added to the thread's nice value, 0..19 (0: unchanged; the result is capped at 19).
        io_class: one of :data:`IO_CLASSES`.
    """

    nice: int = 10
    io_class: str = "best-effort"

    @property
    def off(self) -> bool:
        return self.nice == 0 and self.io_class == "none"


def _warn_once(what: str, err: BaseException | str) -> None:
    with _warn_lock:
        if what in _warned:
            return
        _warned.add(what)
    log.warning("tierckpt: could not lower the %s priority of the background threads (%s); they run at "
                "the trainer's priority", what, err)


def _ioprio_set(tid: int, value: int) -> None:
    """ioprio_set(IOPRIO_WHO_PROCESS, tid, value) through libc's ``syscall`` (no libc wrapper
    exists). Raises OSError with the errno on failure, NotImplementedError off Linux or on an
    architecture whose syscall number is not in the table."""
    nr = _SYS_IOPRIO_SET.get(platform.machine())
    if not sys.platform.startswith("linux") or nr is None:
        raise NotImplementedError(f"ioprio_set on {sys.platform}/{platform.machine()}")
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(ctypes.c_long(nr), ctypes.c_int(_IOPRIO_WHO_PROCESS), ctypes.c_int(tid),
                    ctypes.c_int(value)) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


def ioprio_get(tid: int) -> int:
    """The raw I/O priority value of task ``tid`` (``class << 13 | level``; 0: none set, the
    kernel derives it from the nice value). Linux only; raises OSError or NotImplementedError."""
    nr = {"x86_64": 252, "aarch64": 31, "ppc64le": 274, "s390x": 283, "i686": 290}.get(platform.machine())
    if not sys.platform.startswith("linux") or nr is None:
        raise NotImplementedError(f"ioprio_get on {sys.platform}/{platform.machine()}")
    libc = ctypes.CDLL(None, use_errno=True)
    v = libc.syscall(ctypes.c_long(nr), ctypes.c_int(_IOPRIO_WHO_PROCESS), ctypes.c_int(tid))
    if v < 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))
    return int(v)


def lower_current_thread(prio: BackgroundPriority | None) -> None:
    """Lower the calling thread's CPU and I/O priority to ``prio`` (never raises; a refusal is
    logged once per kind). Call it first thing in a background thread tierckpt owns.

    Args:
        prio: the target priority; None or :attr:`BackgroundPriority.off` leaves the thread as is.
    """
    if prio is None or prio.off:
        return
    tid = threading.get_native_id()
    if prio.nice > 0 and hasattr(os, "setpriority"):
        try:
            now = os.getpriority(os.PRIO_PROCESS, tid)
            want = min(19, now + prio.nice)
            if want > now:
                os.setpriority(os.PRIO_PROCESS, tid, want)
        except OSError as e:
            _warn_once("CPU", e)
    if prio.io_class != "none":
        try:
            level = _BE_LOWEST_LEVEL if prio.io_class == "best-effort" else 0
            _ioprio_set(tid, (_IOPRIO_CLASS[prio.io_class] << _IOPRIO_CLASS_SHIFT) | level)
        except NotImplementedError as e:
            log.debug("tierckpt: %s; the I/O priority stays", e)
        except OSError as e:
            _warn_once("I/O", e)
