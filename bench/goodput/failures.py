"""The failure schedule every system of a goodput campaign sees, and its injector.

A campaign cell (one MTBF, one seed) draws one Poisson process: the gaps between failures are
exponential with mean ``mtbf_s`` from ``random.Random(seed)`` (the same generator and order as
``bench/bench_schedule.py``, so its seeds mean the same failures), counted from the first
training step of each system's run; failure i strikes node ``victim_of(i, nodes)`` (its own
seed i). Every system therefore loses the same node at the same training-clock offsets
(common random numbers): a difference in ETTR is the system's, not the draw's.

A failure is a node loss: the :class:`WipingInjector` (``bench_schedule.FailureInjector``, which
SIGKILLs the victim's ranks through the launcher and reconciles the failures with its
attempts) also deletes the victim's local disk, as a replaced node comes back empty.
"""

from __future__ import annotations

import os
import random
import shutil
from dataclasses import dataclass, field

from bench import bench_schedule as bs

GAPS_DRAWN = 10000  # more failures than any run can see; only the prefix a run reaches is used


@dataclass(frozen=True)
class FailurePlan:
    """The failures of one campaign cell: ``gaps`` (seconds of wall time between consecutive
    failures, the first counted from the first step) and the victims, for ``nodes`` nodes."""

    mtbf_s: float
    seed: int
    nodes: int
    gaps: tuple[float, ...] = field(repr=False)

    def due_times(self, horizon_s: float) -> list[float]:
        """Cumulative due times (s after the first step) up to ``horizon_s``."""
        out, t = [], 0.0
        for g in self.gaps:
            t += g
            if t > horizon_s:
                break
            out.append(t)
        return out

    def victims(self, n: int) -> list[int]:
        """The node each of the first ``n`` failures strikes."""
        return [bs.victim_of(i, self.nodes) for i in range(n)]


def failure_plan(mtbf_s: float, seed: int, nodes: int = 2) -> FailurePlan:
    """The :class:`FailurePlan` of (``mtbf_s``, ``seed``): the same for every system.

    Raises:
        ValueError: ``mtbf_s`` ≤ 0 or ``nodes`` < 2 (a node loss needs a survivor).
    """
    if not mtbf_s > 0:
        raise ValueError(f"--mtbf must be > 0 seconds, got {mtbf_s!r}")
    if nodes < 2:
        raise ValueError(f"--nodes must be >= 2 (a lost node's replica lives on a survivor), got {nodes}")
    rng = random.Random(seed)
    return FailurePlan(float(mtbf_s), int(seed), int(nodes),
                       tuple(rng.expovariate(1.0 / mtbf_s) for _ in range(GAPS_DRAWN)))


class WipingInjector(bs.FailureInjector):
    """:class:`bench_schedule.FailureInjector` that also deletes the victim's local disk
    (``local_root`` with ``{node}``; None: the system has no node-local state) right after the
    kill. Each failure's record gets ``wiped``: the path deleted (or None)."""

    def __init__(self, *args, local_root: str | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.local_root = local_root

    def __call__(self, launcher, a) -> None:
        before = len(self.fails)
        super().__call__(launcher, a)
        if len(self.fails) > before:
            f = self.fails[-1]
            path = self.local_root.format(node=f["victim"]) if self.local_root else None
            if path and os.path.isdir(path):
                shutil.rmtree(path, ignore_errors=True)
            f["wiped"] = path
