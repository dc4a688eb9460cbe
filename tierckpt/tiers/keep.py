"""Which committed steps of a tier retention keeps, and why: pure rules, no I/O.

Operators keep three layers of a durable tier (the newest steps to resume from, older steps to
roll back past a loss spike, milestones for good; Orbax's ``keep_period`` and
``keep_time_interval``, torchtitan's ``keep_latest_k``). :func:`decide` applies them to the
committed copies of one directory (``step-<N>`` of one save each), oldest save first, and
returns ``{step: reasons}`` of the steps kept; every other committed step may be deleted
(:mod:`tierckpt.tiers.retention` does, and records the reasons in ``tierckpt-retention.json``).

Rules of a :class:`Policy` (each a reason string, shown by ``tierckpt ls``):

- ``newest k`` (``latest_k``): the k newest saves by agreed order
  (:func:`tierckpt.history.timeline.save_key`), not by step number: after a rollback the new
  timeline's steps are the newest. ``latest_k = 0`` keeps every committed step (``keep all``).
- ``every N steps`` (``every_n_steps``): the first save at or after each positive multiple of N
  (steps N, 2N, … or the first one saved after it): one step per window ``[bN, (b+1)N)``,
  b >= 1. Window 0 holds the run's first steps, which a fresh start reproduces: no rollback
  target.
- ``one per T s`` (``interval_s``): the first save committed in each T-second window of the
  recording clock (``committed_s`` of the manifest, UNIX seconds on the monotonic clock of
  :mod:`tierckpt.clock`; window ``floor(committed_s / T)``): one step per hour on the hour with
  T = 3600. Copies recording no ``committed_s`` (written before it was recorded) take no part.
- ``period P`` (``period``): every step that is a multiple of P, forever (Orbax's
  ``keep_period``).
- ``milestone`` (``steps``): the listed steps, forever.
- ``protect``: steps the caller keeps for a reason of its own: the step the job restored from
  (``restored from``, the persistent tier), the newest step every node holds (``local anchor``).
- ``picked``: reasons an earlier decision recorded for the same save (same step and save id):
  the window rules pick from the saves that exist when they run, so a pick stays a pick across
  restarts and option changes (``tierckpt-retention.json``). Only :func:`sticky` reasons carry
  over; ``newest k`` and ``protect`` reasons are decided afresh at every pass.

The window rules pick among the copies passed in, i.e. the saves not abandoned by a rollback
or a fallback (:mod:`tierckpt.history.timeline`): after a rollback to step 120 a new timeline's
step 150 is the pick of window [150, 200), the abandoned timeline's step 150 is not.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

KEEP_ALL = "keep all"
MILESTONE = "milestone"
RESTORED = "restored from"
ANCHOR = "local anchor"
_TRANSIENT_PREFIXES = ("newest ",)
_TRANSIENT = (KEEP_ALL, RESTORED, ANCHOR)


def newest(k: int) -> str:
    """Reason of the ``latest_k`` rule: ``"newest 2"``."""
    return f"newest {k}"


def every(n: int) -> str:
    """Reason of the ``every_n_steps`` rule: ``"every 50 steps"``."""
    return f"every {n} steps"


def per_interval(seconds: float) -> str:
    """Reason of the ``interval_s`` rule: ``"one per 3600 s"``."""
    return f"one per {seconds:g} s"


def period(p: int) -> str:
    """Reason of the ``period`` rule: ``"period 100"``."""
    return f"period {p}"


def sticky(reason: str) -> bool:
    """Whether a recorded ``reason`` still keeps its save at a later pass: the window and
    milestone rules' picks do; ``newest k``, ``keep all`` and the caller's protections are
    decided afresh."""
    return reason not in _TRANSIENT and not reason.startswith(_TRANSIENT_PREFIXES)


@dataclass(frozen=True)
class Policy:
    """The retention rules of one tier (module docstring).

    Attributes:
        latest_k: newest saves kept (0 = every committed step).
        interval_s: one save kept per window of this many seconds (> 0), None: off.
        every_n_steps: one save kept per window of this many steps (>= 1), None: off.
        period: steps that are multiples of this (>= 1) kept forever, None: off.
        steps: steps kept forever (milestones).
    """

    latest_k: int = 0
    interval_s: float | None = None
    every_n_steps: int | None = None
    period: int | None = None
    steps: frozenset[int] = field(default_factory=frozenset)

    @classmethod
    def of(cls, cfg, tier: str) -> "Policy":
        """The policy of ``tier`` under a :class:`tierckpt.config.TierConfig`: the persistent
        tier gets every rule; the local tier its newest k only (node-local disks hold a few
        steps; rollback points and milestones belong in the durable tier, which outlives a
        node)."""
        k = cfg.keep_latest_k[tier]
        if tier != "persistent":
            return cls(latest_k=k)
        return cls(latest_k=k, interval_s=cfg.keep_interval_s, every_n_steps=cfg.keep_every_n_steps,
                   period=cfg.keep_period, steps=frozenset(cfg.keep_steps))

    def describe(self) -> dict:
        """The policy as JSON values (recorded with each decision)."""
        return {"keep_latest_k": self.latest_k, "keep_interval_s": self.interval_s,
                "keep_every_n_steps": self.every_n_steps, "keep_period": self.period,
                "keep_steps": sorted(self.steps)}


@dataclass(frozen=True)
class Copy:
    """A committed copy retention decides about.

    Attributes:
        step: its step.
        save_id: the save that wrote it (None: a copy without identity).
        key: its agreed order (:func:`tierckpt.history.timeline.save_key`; larger is newer).
        committed_s: when it was committed (``committed_s`` of its manifest: UNIX seconds,
            :func:`tierckpt.clock.now`), None: not recorded.
    """

    step: int
    save_id: str | None
    key: tuple
    committed_s: float | None = None


def _first_per_window(copies: Sequence[Copy], window, order) -> list[Copy]:
    """The first copy (by ``order``) of every window (``window(copy)``; None: no window)."""
    first: dict = {}
    for c in sorted(copies, key=order):
        w = window(c)
        if w is not None and w not in first:
            first[w] = c
    return list(first.values())


def decide(copies: Iterable[Copy], policy: Policy, *, protect: Mapping[int, str] | None = None,
           picked: Mapping[int, tuple[str | None, Sequence[str]]] | None = None) -> dict[int, tuple[str, ...]]:
    """The steps of ``copies`` that ``policy`` keeps, with why.

    Args:
        copies: the committed copies of one directory, one per step (abandoned saves left out).
        protect: ``{step: reason}`` kept whatever the rules say (a step not among ``copies`` is
            ignored).
        picked: ``{step: (save_id, reasons)}`` of an earlier decision; its :func:`sticky`
            reasons keep the copy when it is still the same save.
    Returns:
        ``{step: reasons}`` (reasons in rule order, no repeats) of the steps kept; the steps of
        ``copies`` left out may be deleted.
    """
    by_step = {c.step: c for c in copies}
    reasons: dict[int, list[str]] = {}

    def keep(step: int, why: str) -> None:
        if step in by_step and why not in reasons.setdefault(step, []):
            reasons[step].append(why)

    live = sorted(by_step.values(), key=lambda c: c.key)
    if policy.latest_k <= 0:
        for c in live:
            keep(c.step, KEEP_ALL)
    else:
        for c in live[-policy.latest_k:]:
            keep(c.step, newest(policy.latest_k))
    if policy.every_n_steps:
        n = policy.every_n_steps
        for c in _first_per_window(live, lambda c: c.step // n or None, lambda c: c.key):
            keep(c.step, every(n))
    if policy.interval_s:
        t = policy.interval_s
        timed = [c for c in live if c.committed_s is not None and math.isfinite(c.committed_s)]
        for c in _first_per_window(timed, lambda c: math.floor(c.committed_s / t), lambda c: (c.committed_s, c.key)):
            keep(c.step, per_interval(t))
    for c in live:
        if policy.period and c.step % policy.period == 0:
            keep(c.step, period(policy.period))
        if c.step in policy.steps:
            keep(c.step, MILESTONE)
    for step, (sid, why) in (picked or {}).items():
        if step in by_step and by_step[step].save_id == sid:
            for r in why:
                if sticky(r):
                    keep(step, r)
    for step, why in (protect or {}).items():
        keep(step, why)
    return {s: tuple(r) for s, r in sorted(reasons.items()) if r}
