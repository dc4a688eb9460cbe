"""One clock for every time tierckpt records: UNIX seconds that advance with the host's monotonic
clock, so a step of the wall clock (NTP correcting a clock hours off, an operator's ``date -s``, a
VM resumed on another host) inside a run moves no duration that the scheduler uses — the MTBF's
exposure, the restart time R, a recovery's phases.

``now()`` is ``wall0 + (boottime() - boot0)``: one reading of the wall clock (``wall0``) and of
``CLOCK_BOOTTIME`` (``boot0``, the monotonic clock that also counts suspend; Linux's
clock_gettime(2)) taken together once, then the monotonic clock alone. The anchor is shared by
every process of the host that descends from the first one to take it: it travels in the
environment variable :data:`ANCHOR_ENV` (``"<wall0> <boot0> <boot_id>"``, the boot id of
``/proc/sys/kernel/random/boot_id``), set on import when absent, so a launcher, its ranks and
their DataLoader workers stamp on one timeline and the differences between their stamps are
monotonic durations. An anchor from another boot (a copied environment, a rebooted host) or one
that does not parse is replaced by a fresh one (logged at debug level). Off Linux, or where
``CLOCK_BOOTTIME`` is missing, ``time.monotonic()`` with a per-process anchor stands in.

What stays on the wall clock: times compared across hosts (each host anchors on its own wall
clock; the recovery timeline clamps what disagrees, :mod:`tierckpt.recovery.timeline`) and the
wall time written for people (``committed_at`` of a manifest, the lineage's ``created``).
:func:`wall_jump_s` tells how far the wall clock moved away from this clock since the anchor.
"""

from __future__ import annotations

import logging
import math
import os
import time

log = logging.getLogger(__name__)

ANCHOR_ENV = "TIERCKPT_CLOCK_ANCHOR"

_BOOTTIME = getattr(time, "CLOCK_BOOTTIME", None)


def boottime() -> float:
    """Seconds on the host's monotonic clock that counts suspend (``CLOCK_BOOTTIME``, since boot;
    ``time.monotonic()`` where that clock is missing)."""
    return time.clock_gettime(_BOOTTIME) if _BOOTTIME is not None else time.monotonic()


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return f"pid-{os.getpid()}"  # no host-wide monotonic basis: the anchor stays per process


def _parse(raw: str | None, boot_id: str) -> tuple[float, float] | None:
    if not raw:
        return None
    try:
        wall_s, boot_s, bid = raw.split()
        wall0, boot0 = float(wall_s), float(boot_s)
    except ValueError:
        log.debug("tierckpt: %s=%r does not parse; a new clock anchor is taken", ANCHOR_ENV, raw)
        return None
    if bid != boot_id or not (math.isfinite(wall0) and math.isfinite(boot0)) or boot0 > boottime():
        log.debug("tierckpt: %s=%r is from another boot or host; a new clock anchor is taken", ANCHOR_ENV, raw)
        return None
    return wall0, boot0


def _take_anchor() -> tuple[float, float]:
    bid = _boot_id()
    got = _parse(os.environ.get(ANCHOR_ENV), bid) if _BOOTTIME is not None else None
    if got is None:
        got = (time.time(), boottime())
        if _BOOTTIME is not None:
            os.environ[ANCHOR_ENV] = f"{got[0]!r} {got[1]!r} {bid}"
    return got


_anchor = _take_anchor()


def _after_fork() -> None:
    # time.monotonic() is per process where CLOCK_BOOTTIME is missing: a child re-anchors then
    global _anchor
    if _BOOTTIME is None:
        _anchor = (time.time(), boottime())


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)


def now() -> float:
    """UNIX seconds on the monotonic clock (module docstring): the value to stamp records with."""
    return _anchor[0] + (boottime() - _anchor[1])


def from_boottime(boot_s: float) -> float:
    """UNIX seconds (this clock) of a ``CLOCK_BOOTTIME`` reading, e.g. a process's start time
    from ``/proc/<pid>/stat`` (clock ticks since boot ÷ ``SC_CLK_TCK``)."""
    return _anchor[0] + (boot_s - _anchor[1])


def wall_of(monotonic_s: float) -> float:
    """UNIX seconds (this clock) of a ``time.monotonic()`` reading taken in this process."""
    return now() - (time.monotonic() - monotonic_s)


def wall_jump_s() -> float:
    """How far the wall clock moved from this clock since the anchor, seconds (positive: it
    jumped forward). Drift of a disciplined clock is milliseconds a day; more is a step."""
    return time.time() - now()


_told: set[tuple[str, str]] = set()


def plausible(seconds: float | None, what: str, *, max_s: float) -> float | None:
    """``seconds`` if it is a finite duration in ``[0, max_s]``, else None with a warning naming
    ``what`` (a sample spanning two clocks that disagree, or a record from a clock far off): the
    caller leaves the sample out instead of letting it move an estimate by orders of magnitude.

    Args:
        seconds: the sample, seconds (None passes through as None, silently).
        what: the sample's name for the warning (``"restart time R of run 3f2a…"``).
        max_s: the largest plausible value, seconds.
    """
    if seconds is None:
        return None
    if isinstance(seconds, (int, float)) and math.isfinite(seconds) and 0.0 <= seconds <= max_s:
        return float(seconds)
    key = (what, repr(seconds))
    if key in _told:  # a ledger is read again at every refresh: one warning per sample
        return None
    if len(_told) < 10_000:
        _told.add(key)
    log.warning("tierckpt: %s = %r s is implausible (outside [0, %g] s: two clocks disagree); sample left out",
                what, seconds, max_s)
    return None
