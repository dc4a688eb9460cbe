"""Per-tier checkpoint intervals from measured stall time and observed MTBF.

Formulas (all times in seconds)
-------------------------------
- δ: blocking time of one checkpoint (training stalls for δ), M: mean time between failures,
  R: restart time (relaunch + restore until training resumes).
- **Young** (J. W. Young, "A first order approximation to the optimum checkpoint interval",
  CACM 17(9):530–531, 1974): the checkpoint *period* (start to start) minimising the
  first-order waste is ``sqrt(2δM)`` (:func:`young_interval`).
- **Daly** (J. T. Daly, "A higher order estimate of the optimum checkpoint interval for restart
  dumps", Future Generation Computer Systems 22(3):303–312, 2006): with τ the *compute* time
  between checkpoints (the period is τ + δ), the first-order optimum including the restart
  time is ``τ = sqrt(2δ(M+R)) − δ`` for δ < 2M, and ``τ = M`` for δ >= 2M
  (:func:`daly_interval`). With R = 0 its period τ + δ is Young's ``sqrt(2δM)``: the two agree;
  they name different intervals. Daly's higher-order estimate is :func:`daly_higher_order_interval`.
- **Waste** (first order, :func:`waste_fraction`): for a period P = τ + δ, the fraction of
  wall time not spent on useful work is ``δ/P + P/(2M) + R/M`` (checkpoint stalls, half a
  period recomputed per failure, one restart per failure). At P = sqrt(2δM) and R = 0 it is
  ``sqrt(2δ/M)``. Daly's complete model for Poisson failures (failures may also hit
  checkpoints and restarts) is :func:`daly_waste_fraction`.
- **Lost work per failure** (:func:`expected_lost_work`): a failure falls uniformly in a period
  of τ compute + δ checkpoint, and loses everything since the last completed checkpoint:
  ``(τ + δ)/2`` on average, plus R to restart.

The scheduler
-------------
:class:`Scheduler` applies Daly's formula per tier (docs/architecture.md, "Scheduling"):

- δ_i: exponential moving average (EMA) of what one save of tier i costs training: its
  measured blocking time plus, by default, the measured slowdown of the steps that ran while
  its background work was in flight (Σ max(0, step − step EMA), split evenly between tiers
  busy at once). Background writes share host CPU, memory bandwidth and NICs with the
  trainer; where they do not, the slowdown is ~0 and δ is the blocking time of the issue's
  formula (``interference=False`` forces that). C_i: EMA of its background completion time;
  the step time: EMA of the trainer's step time over steps without checkpoint stalls or
  background work. EMA: ``e_1 = x_1``, ``e_n = e_{n-1} + a·(x_n − e_{n-1})``.
- M: :mod:`tierckpt.sched.mtbf` Gamma–Poisson estimate (prior, then ledger evidence).
- R: prior until observed, then the mean of observed restart times.
- The local tier uses M. The persistent tier uses M/p: only the share p of failures that the
  local and replica tiers cannot serve (several nodes lost, a requeue on other nodes) needs
  it. p has a Beta(a0, b0) prior with mean ``persistent_share`` and strength
  ``persistent_share_weight`` pseudo-restores (a0 = share·weight, b0 = (1−share)·weight), updated
  with restores after a failure: ``p = (a0 + k)/(a0 + b0 + n)`` where k of n such restores read
  the persistent tier (posterior mean of the Beta–Binomial model). With no local tier, p = 1.
- τ_i is clamped: user ``min_s``/``max_s``, then never below C_i (saves would queue behind the
  previous background write), then turned into steps (``ceil(τ/step_time)``, >= 1), then user
  ``min_steps``/``max_steps``, then again never below C_i.
- ``fixed_steps={"local": 10}`` makes a tier save every 10 steps (the classic behaviour).

Every decision is a pure function of the observations, so equal inputs give equal decisions;
still, only global rank 0 decides (it alone reads the ledger) and the engine shares its
intervals at points every rank reaches together (:mod:`tierckpt.sched.cadence`). The options
(:class:`tierckpt.config.ScheduleOptions`) are validated where the config is built, on every rank.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable

from tierckpt.clock import plausible
from tierckpt.config import TIERS, ScheduleOptions, expand_per_tier, per_tier, validate_tiers
from tierckpt.errors import ConfigError
from tierckpt.records import (
    CheckpointRecord,
    LedgerRecord,
    RecoveryRecord,
    RestoreRecord,
    RunEndRecord,
    RunStartRecord,
    ScheduleRecord,
    parse_records,
)
from tierckpt.sched.mtbf import MTBFEstimator
from tierckpt.validators import non_negative_seconds, positive_seconds

MAX_SAMPLE_S = 86400.0
"""The largest plausible restart, step, blocking or background sample, seconds (a day). The
samples a process measures itself are monotonic durations and stay far below; one that spans
processes or hosts (a ``restore`` record's time minus its run's process start, a ``recovery``
record's ``total_s``) can meet two clocks that disagree — a ledger written before the records'
times were monotonic (:mod:`tierckpt.clock`), a host clock stepped between two hosts' stamps.
Such a sample is left out with a warning instead of multiplying R or τ."""

DEFAULT_DELTA_PRIOR_S = {"local": 5.0, "persistent": 60.0}
"""Blocking time assumed for a tier before its first checkpoint is measured, seconds."""

DURATION_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
"""Units :func:`parse_duration` accepts (seconds, minutes, hours, days)."""
_DURATION_RE = re.compile(r"^\s*([+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)\s*([A-Za-z]*)\s*$")


# --------------------------------------------------------------------------------------------
# durations
# --------------------------------------------------------------------------------------------
def parse_duration(text, option: str = "duration") -> float:
    """Seconds from ``"3.09h"``, ``"45m"``, ``"600s"``, ``"2d"`` or a plain number (seconds).

    Raises:
        ConfigError: naming ``option`` and the allowed units, for an unknown unit or a
            malformed number. The sign is not checked here.
    """
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        return float(text)
    allowed = ", ".join(DURATION_UNITS) + " (e.g. 600s, 45m, 3.09h, 2d; a plain number is seconds)"
    m = _DURATION_RE.match(str(text))
    if not m:
        raise ConfigError(option, f"{text!r} is not a duration; units: {allowed}")
    unit = m.group(2).lower()
    if unit and unit not in DURATION_UNITS:
        raise ConfigError(option, f"unknown unit {m.group(2)!r} in {text!r}; allowed units: {allowed}")
    value = float(m.group(1)) * DURATION_UNITS.get(unit, 1.0)
    if not math.isfinite(value):
        raise ConfigError(option, f"{text!r} is not a finite duration")
    return value


def format_duration(seconds: float | None) -> str:
    """Human form of a duration: ``"42.0 s"``, ``"50.9 min"``, ``"3.09 h"``, ``"2.5 d"``."""
    if seconds is None or not math.isfinite(seconds):
        return "-"
    s = float(seconds)
    if abs(s) < 120:
        return f"{s:.1f} s"
    if abs(s) < 2 * 3600:
        return f"{s / 60:.1f} min"
    if abs(s) < 2 * 86400:
        return f"{s / 3600:.2f} h"
    return f"{s / 86400:.1f} d"


# --------------------------------------------------------------------------------------------
# formulas
# --------------------------------------------------------------------------------------------
_POSITIVE_S, _SECONDS = positive_seconds(), non_negative_seconds()


def _check(value, option: str, *, positive: bool = False) -> float:
    return (_POSITIVE_S if positive else _SECONDS)(value, option)


def young_interval(delta: float, M: float) -> float:
    """Young's optimum checkpoint period ``sqrt(2δM)``, seconds (Young 1974).

    Args:
        delta: blocking time per checkpoint δ, seconds (>= 0).
        M: mean time between failures, seconds (> 0).

    Raises:
        ConfigError: naming ``delta`` or ``mtbf``.
    """
    d = _check(delta, "delta")
    m = _check(M, "mtbf", positive=True)
    return math.sqrt(2.0 * d * m)


def daly_interval(delta: float, M: float, R: float = 0.0) -> float:
    """Daly's first-order optimum compute time between checkpoints, seconds (Daly 2006).

    ``τ = sqrt(2δ(M+R)) − δ`` for δ < 2M; ``τ = M`` for δ >= 2M (Daly's rule for checkpoints
    as long as the MTBF). The checkpoint period is τ + δ.

    Args:
        delta: blocking time δ, seconds (>= 0; 0 gives 0: save at every opportunity).
        M: MTBF, seconds (> 0).
        R: restart time, seconds (>= 0).

    Raises:
        ConfigError: naming ``delta``, ``mtbf`` or ``restart``.
    """
    d = _check(delta, "delta")
    m = _check(M, "mtbf", positive=True)
    r = _check(R, "restart")
    if d >= 2.0 * m:
        return m
    return math.sqrt(2.0 * d * (m + r)) - d


def daly_higher_order_interval(delta: float, M: float) -> float:
    """Daly's higher-order optimum compute interval, seconds (Daly 2006, perturbation solution).

    ``τ = sqrt(2δM)·[1 + (1/3)·sqrt(δ/(2M)) + (1/9)·(δ/(2M))] − δ`` for δ < 2M, else M.
    Daly's Fig. 3–5 examples (δ = 5 min, R = 10 min): M = 24 h → 117 min, M = 6 h → 57 min,
    M = 15 min → 9.1 min.
    """
    d = _check(delta, "delta")
    m = _check(M, "mtbf", positive=True)
    if d >= 2.0 * m:
        return m
    x = d / (2.0 * m)
    return math.sqrt(2.0 * d * m) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - d


def waste_fraction(tau: float, delta: float, M: float, R: float = 0.0) -> float:
    """First-order wasted fraction of wall time for a checkpoint period ``tau``.

    ``f = δ/τ + τ/(2M) + R/M`` (Young 1974's first-order cost plus one restart per failure).
    ``tau`` is the period, start to start (compute + δ); Young's period minimises it, giving
    ``sqrt(2δ/M) + R/M``. Valid while τ, δ, R ≪ M; see :func:`daly_waste_fraction` otherwise.

    Args:
        tau: checkpoint period, seconds (> 0).
        delta: blocking time, seconds (>= 0).
        M: MTBF, seconds (> 0).
        R: restart time, seconds (>= 0).

    Returns:
        dimensionless fraction (0.1 = 10 % of wall time wasted).
    """
    t = _check(tau, "tau", positive=True)
    d = _check(delta, "delta")
    m = _check(M, "mtbf", positive=True)
    r = _check(R, "restart")
    return d / t + t / (2.0 * m) + r / m


def daly_waste_fraction(tau: float, delta: float, M: float, R: float = 0.0) -> float:
    """Wasted fraction under Daly's complete model with Poisson failures (Daly 2006).

    With compute time ``tau`` between checkpoints, a segment of τ + δ restarts from its
    beginning on every failure, each failure costs a restart R that failures may also
    interrupt. The expected wall time per segment is ``M·e^(R/M)·(e^((τ+δ)/M) − 1)``, so the
    wasted fraction is ``1 − τ / (M·e^(R/M)·(e^((τ+δ)/M) − 1))``. :mod:`tierckpt.sched.simulate`
    simulates exactly this model.

    Args:
        tau: compute time between checkpoints, seconds (> 0).
        delta, M, R: as in :func:`daly_interval`.
    """
    t = _check(tau, "tau", positive=True)
    d = _check(delta, "delta")
    m = _check(M, "mtbf", positive=True)
    r = _check(R, "restart")
    expected = m * math.exp(r / m) * math.expm1((t + d) / m)
    return 1.0 - t / expected


def expected_lost_work(tau: float, delta: float, R: float = 0.0) -> float:
    """Expected seconds lost per failure: ``(τ + δ)/2 + R``.

    Model: failures are Poisson, so one falls uniformly within the period of τ seconds of
    compute plus δ of checkpointing, and everything since the last completed checkpoint is
    recomputed (a failure during a checkpoint loses that checkpoint too): (τ + δ)/2 on
    average, valid while τ + δ ≪ M. R (restart + restore) is added; R = 0 gives the
    recomputation alone.

    Args:
        tau: compute time between checkpoints, seconds (>= 0).
        delta: blocking time, seconds (>= 0).
        R: restart time, seconds (>= 0).
    """
    return (_check(tau, "tau") + _check(delta, "delta")) / 2.0 + _check(R, "restart")


# --------------------------------------------------------------------------------------------
# scheduler
# --------------------------------------------------------------------------------------------
class Ema:
    """Exponential moving average: ``e_1 = x_1``, ``e_n = e_{n-1} + alpha·(x_n − e_{n-1})``.

    Attributes:
        value: current average (None before the first sample).
        n: samples seen.
    """

    def __init__(self, alpha: float):
        self.alpha = alpha
        self.value: float | None = None
        self.n = 0

    def add(self, x: float) -> float:
        """Add one sample; return the new average."""
        self.value = x if self.value is None else self.value + self.alpha * (x - self.value)
        self.n += 1
        return self.value


@dataclass(frozen=True)
class Decision:
    """One tier's interval and the inputs it came from (logged to the ledger as ``schedule``).

    Attributes:
        tier: ``"local"`` or ``"persistent"``.
        delta: δ used, seconds (EMA of blocking time + background slowdown, or the prior).
        M: job MTBF estimate, seconds.
        R: restart time used, seconds.
        p: share of failures only the persistent tier can serve (used by the persistent tier).
        tau_s: the interval after all clamps, seconds of training between saves.
        tau_steps: the interval in steps (None while no step time is known, outside fixed mode).
        reason: the rule that set the value: ``"daly"``, ``"daly (delta >= 2M: tau = M)"``,
            ``"clamped to min_s"``, ``"clamped to max_s"``, ``"clamped to background time"``,
            ``"clamped to min_steps"``, ``"clamped to max_steps"``, ``"fixed_steps"``, or
            ``"no step time yet"``.
        M_eff: MTBF the formula used (M for local, M/p for persistent), seconds.
        C: background completion time (EMA), seconds, or None if never measured.
        step_s: step time (EMA), seconds, or None.
        tau_model_s: Daly's τ before any clamp, seconds.
        sources: where each input came from: ``{"delta": "observed" | "ledger" | "prior",
            "M": "prior" | "ledger" | "evidence" | "set", "R": ..., "p": ...}``.
        delta_blocking: EMA of the blocking part of δ alone, seconds (None before a measurement).
    """

    tier: str
    delta: float
    M: float
    R: float
    p: float
    tau_s: float | None
    tau_steps: int | None
    reason: str
    M_eff: float
    C: float | None = None
    step_s: float | None = None
    tau_model_s: float | None = None
    sources: dict = field(default_factory=dict)
    delta_blocking: float | None = None

    def as_record(self) -> dict:
        """Fields for a ledger ``schedule`` record (JSON-ready)."""
        return asdict(self)


def _restarts_and_fallbacks(records: list[LedgerRecord]) -> tuple[list[float], int, int]:
    """R samples and p evidence of a ledger (rules in :meth:`Scheduler.update_from_ledger`).

    Returns:
        (restart times in seconds, one per ``restore``, the first of a run replaced by its
        ``recovery`` record's ``total_s`` when it has one; k, restores that read the persistent
        tier among n, the first restore of each run that follows a run without a clean end).
    """
    starts: dict[str, float] = {}
    first_sample: dict[str, int] = {}  # run -> index in restarts of its first restore's sample
    measured: set[str] = set()  # runs whose recovery record gave their sample
    clean_end: dict[str, bool] = {}  # run -> has a clean run_end (so far)
    after_failure: dict[str, bool] = {}  # run -> the run before it did not end cleanly
    restarts: list[float] = []
    counted: set[str] = set()
    k = n = 0
    prev: str | None = None
    for r in records:
        rid = "?" if r.run_id is None else r.run_id
        if rid not in clean_end:
            after_failure[rid] = prev is not None and not clean_end[prev]
            clean_end[rid] = False
            prev = rid
        t = r.time
        if isinstance(r, RunStartRecord) and t is not None:
            ps = r.process_start
            starts[rid] = ps if ps is not None and 0 < ps <= t else t
        elif isinstance(r, RunEndRecord):
            clean_end[rid] = r.clean
        elif isinstance(r, RecoveryRecord):
            total = plausible(r.total_s, f"the recovery time (total_s) of run {rid}", max_s=MAX_SAMPLE_S)
            if total is not None and rid not in measured:
                measured.add(rid)
                if rid in first_sample:
                    restarts[first_sample[rid]] = total
                else:
                    restarts.append(total)
        elif isinstance(r, RestoreRecord):
            sample = r.seconds  # the restore's own duration: one process's monotonic clock
            if rid in starts and t is not None and t >= starts[rid]:
                # spans the launcher's and the trainer's stamps: checked
                since = plausible(t - starts[rid], f"the restart time of run {rid} (restore time - process start)",
                                  max_s=MAX_SAMPLE_S)
                sample = sample if since is None else since
            if sample is not None:
                if rid not in first_sample and rid not in measured:
                    first_sample[rid] = len(restarts)
                restarts.append(sample)
            if rid not in counted and after_failure[rid]:
                counted.add(rid)
                n += 1
                if "persistent" in r.source_kinds():
                    k += 1
    return restarts, k, n


class Scheduler:
    """Chooses when each tier saves (see the module docstring for the formulas).

    Args:
        tiers: tiers to schedule, subset of :data:`tierckpt.config.TIERS`.
        gpus: GPUs (ranks on CPU) of the job, for the MTBF prior.
        options: the user's :class:`~tierckpt.config.ScheduleOptions` (MTBF and restart priors,
            δ priors, the prior of p, EMA weight, bounds in seconds and steps, interference);
            None = the defaults.
        fixed_steps: ``{tier: steps}`` tiers that save on a fixed step interval instead.

    Raises:
        ConfigError: naming the argument (``tiers``, ``gpus``, ``options``, ``fixed_steps``)
            and its allowed values.
    """

    def __init__(self, tiers=TIERS, *, gpus: int = 1, options: ScheduleOptions | None = None,
                 fixed_steps: dict | None = None):
        self.tiers = validate_tiers(tiers)
        if not self.tiers:
            raise ConfigError("tiers", f"at least one tier is required; allowed: {', '.join(TIERS)}")
        opts = ScheduleOptions() if options is None else options
        if not isinstance(opts, ScheduleOptions):
            raise ConfigError("options", f"must be a ScheduleOptions, got {opts!r}")
        self.estimator = MTBFEstimator(gpus=gpus, gpu_mtbf_s=opts.gpu_mtbf_s, weight=opts.mtbf_weight)
        self.restart_prior_s = opts.restart_prior_s
        self.delta_prior_s = {**DEFAULT_DELTA_PRIOR_S, **expand_per_tier(opts.delta_prior_s, self.tiers)}
        p0, w = opts.persistent_share, opts.persistent_share_weight
        self.share_a0, self.share_b0 = p0 * w, (1.0 - p0) * w
        self.ema_alpha = opts.ema_alpha
        self.min_s = expand_per_tier(opts.min_s, self.tiers)
        self.max_s = expand_per_tier(opts.max_s, self.tiers)
        self.min_steps = expand_per_tier(opts.min_steps, self.tiers)
        self.max_steps = expand_per_tier(opts.max_steps, self.tiers)
        self.fixed_steps = expand_per_tier(per_tier(fixed_steps, "fixed_steps", integer=True), self.tiers)
        for t in self.fixed_steps:
            if t not in self.tiers:
                raise ConfigError("fixed_steps", f"tier {t!r} is not scheduled; scheduled: {', '.join(self.tiers)}")
        self.interference = opts.interference
        self._delta = {t: Ema(self.ema_alpha) for t in self.tiers}
        self._blocking = {t: Ema(self.ema_alpha) for t in self.tiers}
        self._interference_acc = {t: 0.0 for t in self.tiers}
        self._bg = {t: Ema(self.ema_alpha) for t in self.tiers}
        self._ledger_delta: dict[str, float] = {}
        self._ledger_bg: dict[str, float] = {}
        self._ledger_step: float | None = None
        self._step = Ema(self.ema_alpha)
        self._mtbf = self.estimator.prior_mtbf_s
        self._mtbf_source = "prior"
        self._restarts: list[float] = []
        self._restart_source = "prior"
        self._share_k = 0
        self._share_n = 0
        self._share_source = "prior"

    # -- observations ---------------------------------------------------------------------------
    def _tier(self, tier: str) -> str:
        if tier not in self.tiers:
            raise ConfigError("tier", f"unknown tier {tier!r}; scheduled: {', '.join(self.tiers)}")
        return tier

    def observe_step(self, seconds: float, busy=()) -> None:
        """One training step took ``seconds`` of wall time (exclude checkpoint stalls).

        Args:
            seconds: the step's wall time (> 0).
            busy: tiers whose background work overlapped the step. Such a step does not move
                the step-time EMA; its excess over the EMA is charged to those tiers' next
                :meth:`observe_checkpoint` (evenly split), unless ``interference`` is off.
        """
        s = _check(seconds, "step_s", positive=True)
        if plausible(s, "a step time", max_s=MAX_SAMPLE_S) is None:
            return
        busy = [t for t in busy if t in self.tiers]
        base = self._step.value
        if not busy or base is None:
            self._step.add(s)
            return
        extra = max(0.0, s - base) / len(busy)
        for t in busy:
            self._interference_acc[t] += extra

    def take_interference(self, tier: str) -> float:
        """Seconds of step slowdown charged to ``tier`` since the last call (and reset it)."""
        self._tier(tier)
        v, self._interference_acc[tier] = self._interference_acc[tier], 0.0
        return v

    def observe_checkpoint(self, tier: str, blocking_s: float, background_s: float | None = None,
                           interference_s: float | None = None) -> None:
        """A save of ``tier`` blocked training ``blocking_s`` s (max over ranks), finished its
        background work ``background_s`` s later (C, max over ranks; None = unknown) and slowed
        the steps that overlapped it by ``interference_s`` s in total (None: what
        :meth:`observe_step` charged to the tier since the last save, see
        :meth:`take_interference`). δ sample = blocking + slowdown (blocking only with
        ``interference=False``)."""
        self._tier(tier)
        b = _check(blocking_s, "blocking_s")
        i = self.take_interference(tier) if interference_s is None else _check(interference_s, "interference_s")
        if plausible(b + i, f"a {tier} save's blocking time + slowdown", max_s=MAX_SAMPLE_S) is None:
            return
        if background_s is not None:
            # a negative value is a caller's bug (ConfigError); a huge one is a clock's (left out)
            background_s = plausible(_check(background_s, "background_s"), f"a {tier} save's background time",
                                     max_s=MAX_SAMPLE_S)
        self._blocking[tier].add(b)
        self._delta[tier].add(b + (i if self.interference else 0.0))
        if background_s is not None:
            self._bg[tier].add(background_s)

    def observe_restart(self, seconds: float) -> None:
        """A restart (relaunch + restore until training resumed) took ``seconds``."""
        r = _check(seconds, "restart_s")
        if plausible(r, "a restart time", max_s=MAX_SAMPLE_S) is None:
            return
        self._restarts.append(r)
        self._restart_source = "observed"

    def set_mtbf(self, M: float) -> None:
        """Use ``M`` seconds as the MTBF (overrides the estimate until the next update)."""
        self._mtbf = _check(M, "mtbf", positive=True)
        self._mtbf_source = "set"

    def update_mtbf(self, exposure_s: float, failures: float) -> float:
        """Gamma–Poisson update from ``failures`` in ``exposure_s`` seconds; returns M (s)."""
        self._mtbf = self.estimator.posterior(exposure_s, failures).mtbf_s
        self._mtbf_source = "evidence"
        return self._mtbf

    def update_from_ledger(self, records: Iterable[dict | LedgerRecord], current_run_id: str | None = None,
                           gpus: int | None = None, now: float | None = None) -> None:
        """Re-derive M, R, p (and δ, C of tiers not yet measured in this process) from a ledger.

        - M: :meth:`tierckpt.sched.mtbf.MTBFEstimator.from_ledger` (``gpus`` rebuilds the prior for a
          new job size; ``now`` extends the current run's exposure).
        - R: per run that restored, the ``total_s`` of its ``recovery`` record when it has one
          (:mod:`tierckpt.recovery.timeline`: the launcher noticing the failure → the first
          step after the restore, so teardown, relaunch, imports, process groups, model build,
          restore and the first step count); otherwise per ``restore`` record its time minus its
          run's start: the ``process_start`` of the ``run_start`` record (when the trainer
          process was created, so interpreter start, imports and model construction count),
          else the record's own time; the restore's ``seconds`` if neither is known. R is
          their mean. Queueing time before the new allocation started is not in the ledger and
          not counted.
        - p: restores in a run that follows a run without a clean end are failure recoveries;
          those whose ``sources`` include ``"persistent"`` are fallbacks.
        - δ, C: EMA over the tier's successful ``checkpoint`` records, used only until this
          process measures the tier itself.
        - step time: the ``step_s`` of the last ``schedule`` record, used only until this
          process measures a step, so a restarted job gets intervals in steps at once
          instead of its configured starting interval.

        Replaces M and p set by earlier updates, and R when the ledger has restores (the ledger
        is the authority; the current run's restore is in it), so do not also
        :meth:`observe_restart` the same restore.

        Args:
            records: ledger lines (:meth:`tierckpt.history.ledger.Ledger.read`) or typed
                records, oldest first; read by :func:`tierckpt.records.parse_records`.
        Raises:
            ConfigError: ``gpus`` < 1.
        """
        if gpus is not None and gpus != self.estimator.gpus:
            self.estimator = MTBFEstimator(gpus=gpus, gpu_mtbf_s=self.estimator.gpu_mtbf_s,
                                           weight=self.estimator.weight)
        recs = parse_records(records)
        est = self.estimator.from_ledger(recs, current_run_id, now=now)
        self._mtbf = est.mtbf_s
        self._mtbf_source = "ledger" if est.failures or est.exposure_s else "prior"
        restarts, self._share_k, self._share_n = _restarts_and_fallbacks(recs)
        if restarts:
            self._restarts = restarts
            self._restart_source = "ledger"
        self._share_source = "ledger" if self._share_n else "prior"
        self._ledger_delta, self._ledger_bg = self._costs_from_ledger(recs)
        self._ledger_step = next((r.step_s for r in reversed(recs)
                                  if isinstance(r, ScheduleRecord) and r.step_s is not None), None)

    def _costs_from_ledger(self, records: list[LedgerRecord]) -> tuple[dict[str, float], dict[str, float]]:
        """EMAs of δ (blocking + charged slowdown, when ``interference``) and of C per scheduled
        tier over its committed ``checkpoint`` records, seconds; tiers without one left out."""
        delta: dict[str, Ema] = {t: Ema(self.ema_alpha) for t in self.tiers}
        bg: dict[str, Ema] = {t: Ema(self.ema_alpha) for t in self.tiers}
        for r in records:
            if isinstance(r, CheckpointRecord) and r.ok and r.tier in delta:
                slowdown = r.interference_s if self.interference and r.interference_s is not None else 0.0
                delta[r.tier].add(r.blocking_s + slowdown)
                bg[r.tier].add(r.background_s)
        return ({t: e.value for t, e in delta.items() if e.value is not None},
                {t: e.value for t, e in bg.items() if e.value is not None})

    # -- state ------------------------------------------------------------------------------------
    @property
    def mtbf_s(self) -> float:
        """Current job MTBF M, seconds."""
        return self._mtbf

    @property
    def restart_s(self) -> float:
        """Current R: mean of observed restarts, else the prior; seconds."""
        return sum(self._restarts) / len(self._restarts) if self._restarts else self.restart_prior_s

    @property
    def persistent_share(self) -> float:
        """Current p (posterior mean of the Beta model); 1 when no local tier is scheduled."""
        if "local" not in self.tiers:
            return 1.0
        return (self.share_a0 + self._share_k) / (self.share_a0 + self.share_b0 + self._share_n)

    @property
    def step_s(self) -> float | None:
        """EMA of the step time, seconds (measured here, else the ledger's last, else None)."""
        return self._step.value if self._step.value is not None else self._ledger_step

    def delta_s(self, tier: str) -> tuple[float, str]:
        """(δ of ``tier`` in seconds, source: "observed" | "ledger" | "prior")."""
        self._tier(tier)
        observed = self._delta[tier].value
        if observed is not None:
            return observed, "observed"
        if tier in self._ledger_delta:
            return self._ledger_delta[tier], "ledger"
        return float(self.delta_prior_s.get(tier, DEFAULT_DELTA_PRIOR_S["local"])), "prior"

    def background_s(self, tier: str) -> float | None:
        """C of ``tier``, seconds (measured here, else from the ledger, else None)."""
        self._tier(tier)
        if self._bg[tier].value is not None:
            return self._bg[tier].value
        return self._ledger_bg.get(tier)

    # -- decisions --------------------------------------------------------------------------------
    def interval(self, tier: str) -> Decision:
        """The current interval of ``tier`` with its inputs (deterministic in the observations).

        Raises:
            ConfigError: ``tier`` is not scheduled.
        """
        self._tier(tier)
        delta, d_src = self.delta_s(tier)
        M, R, p = self._mtbf, self.restart_s, self.persistent_share
        M_eff = M / p if tier == "persistent" else M
        C = self.background_s(tier)
        step = self.step_s
        sources = {"delta": d_src, "M": self._mtbf_source, "R": self._restart_source, "p": self._share_source}
        common: dict[str, Any] = dict(tier=tier, delta=delta, M=M, R=R, p=p, M_eff=M_eff, C=C, step_s=step, sources=sources,
                      delta_blocking=self._blocking[tier].value)
        if tier in self.fixed_steps:
            n = int(self.fixed_steps[tier])
            return Decision(tau_s=None if step is None else n * step, tau_steps=n, reason="fixed_steps",
                            tau_model_s=None, **common)
        tau_model = daly_interval(delta, M_eff, R)
        reason = "daly" if delta < 2 * M_eff else "daly (delta >= 2M: tau = M)"
        tau = tau_model
        if tier in self.min_s and tau < self.min_s[tier]:
            tau, reason = float(self.min_s[tier]), "clamped to min_s"
        if tier in self.max_s and tau > self.max_s[tier]:
            tau, reason = float(self.max_s[tier]), "clamped to max_s"
        if C is not None and tau < C:
            tau, reason = C, "clamped to background time"
        if step is None:
            return Decision(tau_s=tau, tau_steps=None, reason="no step time yet", tau_model_s=tau_model, **common)
        steps = first = max(1, math.ceil(tau / step - 1e-9))
        if tier in self.min_steps and steps < self.min_steps[tier]:
            steps, reason = int(self.min_steps[tier]), "clamped to min_steps"
        if tier in self.max_steps and steps > self.max_steps[tier]:
            steps, reason = int(self.max_steps[tier]), "clamped to max_steps"
        if C is not None and steps * step < C - 1e-9:
            steps, reason = max(1, math.ceil(C / step - 1e-9)), "clamped to background time"
        if steps != first:
            tau = steps * step
        return Decision(tau_s=tau, tau_steps=steps, reason=reason, tau_model_s=tau_model, **common)

    def decisions(self) -> dict[str, Decision]:
        """:meth:`interval` of every scheduled tier."""
        return {t: self.interval(t) for t in self.tiers}


# --------------------------------------------------------------------------------------------
# the report behind `tierckpt interval`
# --------------------------------------------------------------------------------------------
def interval_report(delta: float, M: float, R: float = 0.0) -> dict:
    """What ``tierckpt interval`` prints (seconds and fractions).

    Keys:
        tau_s: the checkpoint interval, start to start: ``sqrt(2δ(M+R))`` = Daly's compute time
            τ plus δ (Daly 2006), which is Young's ``sqrt(2δM)`` when R = 0 (Young 1974). This
            is the τ of the issue's seed table (δ = 600 s, M = 3.09 h → 60.9 min).
        compute_s: training time between checkpoints, ``tau_s − δ`` (Daly's τ; what
            :class:`Scheduler` turns into steps, since step times exclude the stall).
        waste: first-order wasted fraction at ``tau_s`` (:func:`waste_fraction`),
            ``sqrt(2δ/M)`` when R = 0.
        lost_per_failure_s: ``tau_s/2 + R`` (:func:`expected_lost_work`).
        young_period_s: ``sqrt(2δM)``.
        daly_waste: the same interval under Daly's complete Poisson model
            (:func:`daly_waste_fraction`), None when the compute time is 0.

    Raises:
        ConfigError: naming ``delta``, ``mtbf`` or ``restart``.
    """
    compute = daly_interval(delta, M, R)
    period = compute + delta
    return {
        "tau_s": period,
        "compute_s": compute,
        "waste": waste_fraction(period, delta, M, R),
        "lost_per_failure_s": expected_lost_work(compute, delta, R),
        "young_period_s": young_interval(delta, M),
        "daly_waste": daly_waste_fraction(compute, delta, M, R) if compute > 0 else None,
    }
