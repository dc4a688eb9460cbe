"""MTBF of a training job: a Gamma–Poisson estimate from a prior and the job's ledger.

Model
-----
Failures of the job arrive as a Poisson process with an unknown rate λ (failures per second of
wall time the job is running). The conjugate prior of a Poisson rate is the Gamma distribution
(shape α, rate β)::

    λ ~ Gamma(α0, β0)                     prior
    f failures in T seconds | λ ~ Poisson(λ·T)
    λ | f, T ~ Gamma(α0 + f, β0 + T)      posterior (Gamma–Poisson conjugacy)

(Gelman et al., *Bayesian Data Analysis*, 3rd ed., §2.6 "Other standard single-parameter
models: Poisson"; Fink, *A Compendium of Conjugate Priors*, 1997, §"Poisson".)

The prior is written in the units people know: a mean time between failures and a weight.
With ``weight`` w pseudo-failures and a prior job MTBF M0::

    α0 = w,    β0 = w · M0        so that  α0/β0 = 1/M0

i.e. the prior counts as "w failures observed in w·M0 seconds". M0 is a per-GPU MTBF divided by
the number of GPUs (failures of independent GPUs add up: λ_job = n · λ_gpu; on CPU, ranks stand
in for GPUs).

Estimator
---------
:attr:`MTBFEstimate.mtbf_s` is ``M = β/α = 1/E[λ]``, the reciprocal of the posterior mean rate.
It is defined for every α > 0 (the posterior mean of 1/λ, ``β/(α−1)``, needs α > 1 and is
infinite with one pseudo-failure and no evidence), it equals M0 before any evidence, and it
tends to the maximum-likelihood estimate T/f as evidence accumulates. The posterior standard
deviation of λ, ``sqrt(α)/β``, is reported as :attr:`MTBFEstimate.rate_sd` so a caller can tell a
prior-dominated estimate from a measured one.

Default prior
-------------
Llama 3 405B pre-training (Dubey et al., *The Llama 3 Herd of Models*, 2024, §3.3.4): 16,384
H100 GPUs, 54 days, 419 unexpected interruptions. Per GPU::

    M_gpu = 16384 · 54 · 86400 s / 419 ≈ 1.824e8 s  (≈ 2111.5 days)

so a 16,384-GPU job has M0 = 54 · 24 / 419 h ≈ 3.09 h, a 1,024-GPU job ≈ 49.5 h.

Evidence from the ledger
------------------------
See :func:`evidence_from_ledger`: exposure is the wall time of every run of the job (scaled by
the run's size relative to the current one); failures are runs without a clean ``run_end``
(never the run in progress) plus allocations the ledger never saw, found from gaps in the
restart counters (``SLURM_RESTART_COUNT`` / the launcher's) recorded in ``run_start``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

from tierckpt.errors import ConfigError
from tierckpt.priors import DEFAULT_GPU_MTBF_S, DEFAULT_WEIGHT
from tierckpt.records import LedgerRecord, RunEndRecord, RunStartRecord, parse_records
from tierckpt.validators import positive_int, positive_number, positive_seconds

# the prior's defaults live below every wing (tierckpt/priors.py): TierConfig reads them too
_SECONDS = positive_seconds()
_WEIGHT = positive_number(unit="pseudo-failures")
_GPUS = positive_int(note="GPUs, or ranks on CPU")


def _gpus(value, option: str = "gpus") -> int:
    return _GPUS(value, option)


def prior_params(gpu_mtbf_s: float = DEFAULT_GPU_MTBF_S, gpus: int = 1,
                 weight: float = DEFAULT_WEIGHT) -> tuple[float, float]:
    """Gamma prior (α0, β0) of the job's failure rate.

    Args:
        gpu_mtbf_s: MTBF of one GPU (one rank on CPU), seconds; > 0.
        gpus: GPUs (ranks) of the job; >= 1. The job's prior MTBF is ``gpu_mtbf_s / gpus``.
        weight: prior strength in pseudo-failures; > 0.

    Returns:
        ``(α0, β0) = (weight, weight · gpu_mtbf_s / gpus)``; α0 is dimensionless, β0 in seconds.

    Raises:
        ConfigError: naming ``gpu_mtbf_s``, ``gpus`` or ``mtbf_weight``.
    """
    m = _SECONDS(gpu_mtbf_s, "gpu_mtbf_s")
    n = _gpus(gpus)
    w = _WEIGHT(weight, "mtbf_weight")
    return w, w * m / n


@dataclass(frozen=True)
class Evidence:
    """What the ledger says about failures of a job.

    Attributes:
        exposure_s: wall seconds the job ran, in units of the current job size (a run with
            ``world_size`` n for T s counts ``T · n / gpus``).
        failures: ``unclean_runs + unseen_allocations`` (see :func:`evidence_from_ledger`).
        unclean_runs: finished runs without a clean ``run_end`` (the run in progress excluded).
        unseen_allocations: restarts the counters show but that left no record.
        runs: runs found (including the current one).
    """

    exposure_s: float = 0.0
    failures: int = 0
    unclean_runs: int = 0
    unseen_allocations: int = 0
    runs: int = 0


def _runs(records: list[LedgerRecord]) -> tuple[list[str], dict[str, dict]]:
    """Group records by run: ``{run_id: {start, first, last (UNIX s), end (the run's last
    RunEndRecord), restart_count, world_size, job}}`` and the run ids in order of appearance."""
    order: list[str] = []
    runs: dict[str, dict] = {}
    for r in records:
        rid = "?" if r.run_id is None else r.run_id
        run = runs.get(rid)
        if run is None:
            run = runs[rid] = {"start": None, "first": None, "last": None, "end": None,
                               "restart_count": None, "world_size": None, "job": r.job}
            order.append(rid)
        t = r.time
        if t is not None:
            run["first"] = t if run["first"] is None else min(run["first"], t)
            run["last"] = t if run["last"] is None else max(run["last"], t)
        if isinstance(r, RunStartRecord):
            run["start"] = t if t is not None else run["start"]
            run["restart_count"], run["world_size"] = r.restart_count, r.world_size
            if r.job is not None:
                run["job"] = r.job
        elif isinstance(r, RunEndRecord):
            run["end"] = r  # the last run_end of a run wins
    return order, runs


def run_exposure(run: dict, now: float | None = None, current: bool = False) -> float:
    """Wall seconds of one run (as grouped by :func:`evidence_from_ledger`), >= 0.

    ``run_end.exposure_s`` when present; else (last record time, or ``now`` for the current
    run) minus ``run_start`` time (the first record's time if ``run_start`` was lost).
    """
    end = run["end"]
    if end is not None and end.exposure_s is not None:
        return end.exposure_s
    start = run["start"] if run["start"] is not None else run["first"]
    last = run["last"]
    if current and now is not None:
        last = now if last is None else max(last, now)
    if start is None or last is None:
        return 0.0
    return max(0.0, float(last) - float(start))


def evidence_from_ledger(records: Iterable[dict | LedgerRecord], current_run_id: str | None = None,
                         gpus: int | None = None, now: float | None = None,
                         job: str | None = None) -> Evidence:
    """Exposure and failure count of a job from its ledger records.

    Records are grouped into runs by ``run_id`` (see :mod:`tierckpt.records` for the kinds).

    - **Exposure** (seconds): per run, ``run_end.exposure_s``; a run without ``run_end``
      (crashed, or in progress) counts from its ``run_start`` time (its first record's time if
      that line was torn) to its last record — or to ``now`` for ``current_run_id`` — which
      under-counts the time between the last record and the crash by at most one checkpoint
      interval. When ``gpus`` is given and the run's ``run_start`` has ``world_size`` n, the
      run counts ``T · n / gpus``: with λ_job = n·λ_gpu, a run of another size exposes the job
      to failures at another rate.
    - **Failures**: (a) runs other than ``current_run_id`` that have no ``run_end`` with
      ``clean: true`` (crash, kill, ``close(clean=False)``, or only a torn ``run_start``);
      plus (b) allocations that never wrote a ``run_start``. (b) comes from the restart
      counters: allocation k of a job runs with restart count k (``SLURM_RESTART_COUNT``; the
      first allocation has none, counted as 0), so every k in ``0..max(seen)`` with no run
      carrying it is an allocation that died before its ``run_start`` (node failure at
      launch, a hang in initialisation): a failure the ledger never saw. Counting gaps, not
      ``max(restart_count)``, avoids double counting runs that are already in (a) and does not
      treat clean requeues (time limit, preemption after a clean ``run_end``) as failures.
      Gaps are counted per ``job`` field, since counters restart with a new job id; a run
      whose ``run_start`` line was lost (torn) may be one of the gaps, so each such run
      fills one gap instead of counting twice.

    Args:
        records: ledger lines as :meth:`tierckpt.history.ledger.Ledger.read` returns them, or
            typed records (:func:`tierckpt.records.parse_records`), oldest first.
        current_run_id: the run in progress: its exposure counts, its missing ``run_end``
            does not make it a failure.
        gpus: current job size for the exposure scaling; None = no scaling.
        now: UNIX seconds; extends the current run's exposure to this time.
        job: only consider records whose ``job`` equals this (None = all records).

    Returns:
        :class:`Evidence`.
    """
    if gpus is not None:
        _gpus(gpus)
    recs = parse_records(records)
    if job is not None:
        recs = [r for r in recs if r.job == job]
    order, runs = _runs(recs)
    exposure = 0.0
    unclean = 0
    seen_counts: dict[object, list] = {}  # job -> [restart counts seen, runs without run_start]
    for rid in order:
        run = runs[rid]
        current = rid == current_run_id
        t = run_exposure(run, now=now, current=current)
        if gpus is not None and run["world_size"] is not None:
            t *= run["world_size"] / gpus
        exposure += t
        if not current:
            if run["end"] is None or not run["end"].clean:
                unclean += 1
        counts = seen_counts.setdefault(run["job"], [set(), 0])
        if run["start"] is not None:
            counts[0].add(run["restart_count"] if run["restart_count"] is not None else 0)
        else:
            counts[1] += 1  # its restart count is unknown: it may fill one of the gaps
    unseen = 0
    for seen, unknown in seen_counts.values():
        if seen:
            unseen += max(0, (max(seen) + 1) - len(seen) - unknown)
    return Evidence(exposure_s=exposure, failures=unclean + unseen, unclean_runs=unclean,
                    unseen_allocations=unseen, runs=len(order))


@dataclass(frozen=True)
class MTBFEstimate:
    """A posterior of the job's failure rate and the MTBF derived from it.

    Attributes:
        alpha: posterior shape α = α0 + f (dimensionless).
        beta: posterior rate β = β0 + T, seconds.
        mtbf_s: the estimate M = β/α = 1/E[λ], seconds.
        prior_mtbf_s: M0 = β0/α0, seconds.
        exposure_s: T, seconds of evidence.
        failures: f, failures of evidence.
        rate_sd: posterior standard deviation of λ, sqrt(α)/β, failures per second.
    """

    alpha: float
    beta: float
    mtbf_s: float
    prior_mtbf_s: float
    exposure_s: float
    failures: float
    rate_sd: float


class MTBFEstimator:
    """Gamma–Poisson estimator of a job's MTBF (see the module docstring for the model).

    Args:
        gpus: GPUs (ranks on CPU) of the job, >= 1.
        gpu_mtbf_s: prior MTBF of one GPU, seconds (default: Llama 3, :data:`DEFAULT_GPU_MTBF_S`).
        weight: prior weight in pseudo-failures, > 0.

    Attributes:
        alpha0, beta0: the prior (:func:`prior_params`).
        per_gpu: rescale ledger exposure of runs of another ``world_size`` to ``gpus``
            (False for :meth:`from_job_mtbf`, whose prior is for the job as a whole).

    The prior's pseudo-exposure is ``weight · M0`` seconds: a prior far off (say the Llama 3
    default on a 2-rank CPU demo with failures injected every 90 s) needs a matching
    ``gpu_mtbf_s`` or a small ``weight``, or evidence takes that long to outweigh it.

    Raises:
        ConfigError: naming ``gpus``, ``gpu_mtbf_s`` or ``mtbf_weight``.
    """

    def __init__(self, gpus: int = 1, gpu_mtbf_s: float = DEFAULT_GPU_MTBF_S,
                 weight: float = DEFAULT_WEIGHT):
        self.alpha0, self.beta0 = prior_params(gpu_mtbf_s, gpus, weight)
        self.gpus = gpus
        self.per_gpu = True
        self.gpu_mtbf_s = float(gpu_mtbf_s)
        self.weight = float(weight)

    @classmethod
    def from_job_mtbf(cls, mtbf_s: float, weight: float = DEFAULT_WEIGHT) -> "MTBFEstimator":
        """An estimator whose prior job MTBF is ``mtbf_s`` seconds (gpus = 1)."""
        _SECONDS(mtbf_s, "mtbf")
        est = cls(gpus=1, gpu_mtbf_s=mtbf_s, weight=weight)
        est.per_gpu = False  # a job-level prior: ledger exposure is not rescaled by world_size
        return est

    @property
    def prior_mtbf_s(self) -> float:
        """M0 = β0/α0 = gpu_mtbf_s / gpus, seconds."""
        return self.beta0 / self.alpha0

    def posterior(self, exposure_s: float = 0.0, failures: float = 0) -> MTBFEstimate:
        """Posterior after ``failures`` failures in ``exposure_s`` seconds.

        ``α = α0 + failures``, ``β = β0 + exposure_s``, ``M = β/α``.

        Raises:
            ConfigError: negative or non-finite exposure or failures.
        """
        if not (isinstance(exposure_s, (int, float)) and math.isfinite(exposure_s) and exposure_s >= 0):
            raise ConfigError("exposure_s", f"must be a number of seconds >= 0, got {exposure_s!r}")
        if not (isinstance(failures, (int, float)) and math.isfinite(failures) and failures >= 0):
            raise ConfigError("failures", f"must be a count >= 0, got {failures!r}")
        a = self.alpha0 + failures
        b = self.beta0 + exposure_s
        return MTBFEstimate(alpha=a, beta=b, mtbf_s=b / a, prior_mtbf_s=self.prior_mtbf_s,
                            exposure_s=float(exposure_s), failures=failures,
                            rate_sd=math.sqrt(a) / b)

    def from_ledger(self, records: Iterable[dict | LedgerRecord], current_run_id: str | None = None,
                    now: float | None = None, job: str | None = None) -> MTBFEstimate:
        """Posterior from ledger records (:func:`evidence_from_ledger`; exposure scaled to
        ``gpus`` unless the estimator was built by :meth:`from_job_mtbf`)."""
        ev = evidence_from_ledger(records, current_run_id, gpus=self.gpus if self.per_gpu else None,
                                  now=now, job=job)
        return self.posterior(ev.exposure_s, ev.failures)
