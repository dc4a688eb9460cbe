"""Discrete-event simulation of a training job under Poisson failures (``tierckpt simulate``).

Model (Daly 2006's complete model, see :func:`tierckpt.sched.schedule.daly_waste_fraction`):

- the job needs W seconds of useful work, done in steps of ``step_s`` seconds;
- after every interval of τ compute it checkpoints, blocking δ seconds (no checkpoint after
  the last step);
- failures form a Poisson process of rate 1/M over wall time (exponential inter-failure
  times), independent of what the job does; a failure at any moment — computing,
  checkpointing or restarting — loses everything since the last completed checkpoint and
  costs a restart of R seconds (which a further failure restarts);
- wasted fraction = (wall time − W) / wall time.

Policies:

- **fixed**: a constant interval (``--fixed-interval`` seconds, as torchtitan's
  ``checkpoint.interval`` steps × step time);
- **adaptive**: a :class:`tierckpt.sched.schedule.Scheduler` for the local tier that measures δ, R and
  the step time and learns M with the Gamma–Poisson estimator from the failures seen so far,
  starting from a deliberately wrong prior (``--prior-mtbf``, default 10 × M, weight one
  pseudo-failure) and a prior δ of 5 s;
- **oracle**: the fixed interval with the lowest mean waste over the same seeds, found by
  scanning intervals around Daly's τ (a hindsight optimum: it sees the failure sequences it is
  scored on).

Every policy sees the same failure times for a given seed (common random numbers), so their
difference is not sampling noise between policies. Stdlib :mod:`random` keeps runs
reproducible from ``--seed``.
"""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import asdict, dataclass

from tierckpt.config import ScheduleOptions
from tierckpt.errors import ConfigError
from tierckpt.validators import Number, optional, positive_int, positive_number
from tierckpt.sched.schedule import (
    Scheduler,
    daly_interval,
    daly_waste_fraction,
    format_duration,
    young_interval,
)

DEFAULT_MTBF_S = 54 * 24 * 3600 / 419
"""Llama 3's job MTBF, 54 · 24 / 419 h ≈ 3.09 h, in seconds."""
DEFAULT_DELTA_S = 60.0
DEFAULT_RESTART_S = 300.0
DEFAULT_WORK_S = 30 * 86400.0
DEFAULT_STEP_S = 1.0
DEFAULT_FIXED_INTERVAL_S = 3600.0
DEFAULT_RUNS = 8
DEFAULT_PRIOR_FACTOR = 10.0
"""Adaptive policy's prior MTBF as a multiple of the true one (deliberately wrong)."""
SCAN_POINTS = 25
SCAN_SPAN = 4.0
"""The oracle scans intervals from τ_Daly / SCAN_SPAN to τ_Daly · SCAN_SPAN (geometric)."""
MAX_WALL_FACTOR = 1000.0
"""A run stops (waste ≈ 1) once its wall time exceeds this multiple of W."""


@dataclass(frozen=True)
class SimParams:
    """Simulation inputs (seconds unless noted).

    Attributes:
        mtbf_s: true MTBF M of the failure process.
        delta_s: blocking time δ per checkpoint.
        restart_s: restart time R per failure.
        work_s: useful work W the job needs.
        step_s: step time (intervals are whole steps).
        seed: base seed; run i uses ``random.Random(f"{seed}:{i}")``.
        runs: independent runs (seeds) per policy.
        fixed_interval_s: the fixed policy's compute interval.
        prior_mtbf_s: the adaptive policy's prior MTBF (default 10 × ``mtbf_s``).
        prior_weight: its weight in pseudo-failures.
    """

    mtbf_s: float = DEFAULT_MTBF_S
    delta_s: float = DEFAULT_DELTA_S
    restart_s: float = DEFAULT_RESTART_S
    work_s: float = DEFAULT_WORK_S
    step_s: float = DEFAULT_STEP_S
    seed: int = 0
    runs: int = DEFAULT_RUNS
    fixed_interval_s: float = DEFAULT_FIXED_INTERVAL_S
    prior_mtbf_s: float | None = None
    prior_weight: float = 1.0

    def validate(self) -> "SimParams":
        """Check every field; fill ``prior_mtbf_s``.

        Raises:
            ConfigError: naming the option (CLI spelling) and its allowed values.
        """
        positive, non_negative = positive_number(), Number(min=0)
        for name, opt, rule in (("mtbf_s", "--mtbf", positive), ("delta_s", "--delta", non_negative),
                                ("restart_s", "--restart", non_negative), ("work_s", "--work", positive),
                                ("step_s", "--step-time", positive), ("fixed_interval_s", "--fixed-interval", positive),
                                ("prior_weight", "--prior-weight", positive),
                                ("prior_mtbf_s", "--prior-mtbf", optional(positive, "10 x --mtbf")),
                                ("runs", "--runs", positive_int()), ("seed", "--seed", Number(integer=True))):
            rule(getattr(self, name), opt)
        if self.step_s > self.work_s:
            raise ConfigError("--step-time", f"must not exceed --work ({self.work_s} s), got {self.step_s}")
        prior = self.prior_mtbf_s if self.prior_mtbf_s is not None else DEFAULT_PRIOR_FACTOR * self.mtbf_s
        return SimParams(**{**asdict(self), "prior_mtbf_s": float(prior)})


@dataclass
class RunResult:
    """One simulated job.

    Attributes:
        wall_s: wall time to finish (or to give up, see :data:`MAX_WALL_FACTOR`).
        work_s: useful work done, seconds.
        failures: failures (including failures during restarts).
        checkpoints: completed checkpoints.
        interval_sum_s: sum of the compute intervals of completed checkpoints, seconds.
        finished: whether all the work was done.
        final_mtbf_s: the policy's MTBF belief at the end (adaptive only).
    """

    wall_s: float
    work_s: float
    failures: int
    checkpoints: int
    interval_sum_s: float
    finished: bool = True
    final_mtbf_s: float | None = None

    @property
    def waste(self) -> float:
        """(wall time − useful work) / wall time."""
        return (self.wall_s - self.work_s) / self.wall_s if self.wall_s > 0 else 0.0


class FixedPolicy:
    """Checkpoint every ``steps`` steps."""

    name = "fixed"

    def __init__(self, steps: int):
        self.steps = max(1, int(steps))

    def interval_steps(self) -> int:
        """Steps of compute until the next checkpoint."""
        return self.steps

    def on_checkpoint(self, wall_s: float, failures: int) -> None:
        """A checkpoint completed at ``wall_s``."""

    def on_failure(self, wall_s: float, failures: int) -> None:
        """A failure happened; the restart finished at ``wall_s``."""

    def mtbf_belief(self) -> float | None:
        """The MTBF the policy believes in (None: it has none)."""
        return None


class AdaptivePolicy(FixedPolicy):
    """The :class:`~tierckpt.sched.schedule.Scheduler` of one local tier, fed what the job measures."""

    name = "adaptive"

    def __init__(self, params: SimParams):
        self.params = params
        self.sched = Scheduler(tiers=("local",), gpus=1, options=ScheduleOptions(
            gpu_mtbf_s=params.prior_mtbf_s or DEFAULT_PRIOR_FACTOR * params.mtbf_s, mtbf_weight=params.prior_weight))
        self.sched.observe_step(params.step_s)

    def interval_steps(self) -> int:
        steps = self.sched.interval("local").tau_steps
        assert steps is not None  # the step time is observed in __init__
        return steps

    def on_checkpoint(self, wall_s: float, failures: int) -> None:
        self.sched.observe_checkpoint("local", self.params.delta_s, None)
        self.sched.update_mtbf(wall_s, failures)

    def on_failure(self, wall_s: float, failures: int) -> None:
        self.sched.observe_restart(self.params.restart_s)
        self.sched.update_mtbf(wall_s, failures)

    def mtbf_belief(self) -> float | None:
        return self.sched.mtbf_s


def simulate_run(policy: FixedPolicy, params: SimParams, run: int) -> RunResult:
    """Simulate one job with ``policy`` on the failure sequence of run ``run`` of ``params``."""
    rng = random.Random(f"{params.seed}:{run}")
    rate = 1.0 / params.mtbf_s
    step, delta, R = params.step_s, params.delta_s, params.restart_s
    total = max(1, math.ceil(params.work_s / step - 1e-9))
    limit = MAX_WALL_FACTOR * total * step
    t = 0.0
    done = failures = checkpoints = 0
    interval_sum = 0.0
    next_fail = rng.expovariate(rate)
    finished = True
    while done < total:
        if t > limit:
            finished = False
            break
        k = min(policy.interval_steps(), total - done)
        last = done + k >= total
        seg = k * step + (0.0 if last else delta)
        if t + seg <= next_fail:
            t += seg
            done += k
            if not last:
                checkpoints += 1
                interval_sum += k * step
                policy.on_checkpoint(t, failures)
            continue
        t = next_fail  # failure: progress since the last checkpoint is lost
        failures += 1
        next_fail = t + rng.expovariate(rate)
        while t + R > next_fail:  # failure during the restart: restart again
            t = next_fail
            failures += 1
            next_fail = t + rng.expovariate(rate)
        t += R
        policy.on_failure(t, failures)
    return RunResult(wall_s=t, work_s=done * step, failures=failures, checkpoints=checkpoints,
                     interval_sum_s=interval_sum, finished=finished, final_mtbf_s=policy.mtbf_belief())


@dataclass
class PolicyResult:
    """A policy's results over all runs.

    Attributes:
        name: ``fixed``, ``adaptive`` or ``oracle``.
        interval_s: the fixed interval, or the adaptive policy's mean interval, seconds.
        waste: mean wasted fraction over runs.
        waste_sd: its standard deviation over runs.
        failures: mean failures per run.
        checkpoints: mean checkpoints per run.
        final_mtbf_s: mean final MTBF belief (adaptive).
        unfinished: runs stopped at :data:`MAX_WALL_FACTOR`.
    """

    name: str
    interval_s: float
    waste: float
    waste_sd: float
    failures: float
    checkpoints: float
    final_mtbf_s: float | None = None
    unfinished: int = 0


def _summarise(name: str, results: list[RunResult], interval_s: float | None) -> PolicyResult:
    wastes = [r.waste for r in results]
    if interval_s is None:
        n = sum(r.checkpoints for r in results)
        interval_s = sum(r.interval_sum_s for r in results) / n if n else float("nan")
    beliefs = [r.final_mtbf_s for r in results if r.final_mtbf_s is not None]
    return PolicyResult(
        name=name, interval_s=interval_s, waste=statistics.fmean(wastes),
        waste_sd=statistics.stdev(wastes) if len(wastes) > 1 else 0.0,
        failures=statistics.fmean(r.failures for r in results),
        checkpoints=statistics.fmean(r.checkpoints for r in results),
        final_mtbf_s=statistics.fmean(beliefs) if beliefs else None,
        unfinished=sum(not r.finished for r in results),
    )


def _steps(interval_s: float, step_s: float) -> int:
    return max(1, math.ceil(interval_s / step_s - 1e-9))


def run_fixed(params: SimParams, interval_s: float, name: str = "fixed") -> PolicyResult:
    """Mean waste of a fixed compute interval (rounded up to whole steps) over ``params.runs``."""
    steps = _steps(interval_s, params.step_s)
    res = [simulate_run(FixedPolicy(steps), params, i) for i in range(params.runs)]
    return _summarise(name, res, steps * params.step_s)


def run_adaptive(params: SimParams) -> PolicyResult:
    """Mean waste of the adaptive policy over ``params.runs`` (a fresh prior per run)."""
    res = [simulate_run(AdaptivePolicy(params), params, i) for i in range(params.runs)]
    return _summarise("adaptive", res, None)


def scan_intervals(params: SimParams) -> list[float]:
    """Intervals the oracle tries: geometric around Daly's τ, whole steps, deduplicated."""
    centre = max(daly_interval(params.delta_s, params.mtbf_s, params.restart_s), params.step_s)
    out: list[float] = []
    for i in range(SCAN_POINTS):
        x = centre * SCAN_SPAN ** (2.0 * i / (SCAN_POINTS - 1) - 1.0)
        s = _steps(x, params.step_s) * params.step_s
        if not out or s > out[-1]:
            out.append(s)
    return out


def simulate(params: SimParams) -> dict:
    """Run the three policies; return a JSON-ready dict.

    Keys: ``params``; ``young_period_s`` (sqrt(2δM)); ``daly_tau_s``; ``model_waste_at_daly``
    (:func:`~tierckpt.sched.schedule.daly_waste_fraction` at Daly's τ); ``policies`` (``fixed``,
    ``adaptive``, ``oracle``: :class:`PolicyResult` fields); ``scan`` (``interval_s``,
    ``waste``, ``waste_sd``, ``model_waste`` per scanned interval).
    """
    p = params.validate()
    scan = [run_fixed(p, x, name="scan") for x in scan_intervals(p)]
    best = min(scan, key=lambda r: r.waste)
    oracle = PolicyResult(**{**asdict(best), "name": "oracle"})
    fixed = run_fixed(p, p.fixed_interval_s)
    adaptive = run_adaptive(p)
    daly = daly_interval(p.delta_s, p.mtbf_s, p.restart_s)
    return {
        "params": asdict(p),
        "young_period_s": young_interval(p.delta_s, p.mtbf_s),
        "daly_tau_s": daly,
        "model_waste_at_daly": daly_waste_fraction(daly, p.delta_s, p.mtbf_s, p.restart_s) if daly > 0 else None,
        "policies": {r.name: asdict(r) for r in (fixed, adaptive, oracle)},
        "scan": [{"interval_s": r.interval_s, "waste": r.waste, "waste_sd": r.waste_sd,
                  "model_waste": daly_waste_fraction(r.interval_s, p.delta_s, p.mtbf_s, p.restart_s)}
                 for r in scan],
    }


def plot(result: dict, path: str) -> None:
    """Mean waste against the interval (scan and Daly's model), with each policy and Young's /
    Daly's τ marked, written to ``path`` (PNG) with matplotlib's Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    p = result["params"]
    scan = result["scan"]
    xs = [s["interval_s"] for s in scan]
    fig, ax = plt.subplots(figsize=(8, 5))
    ax.errorbar(xs, [100 * s["waste"] for s in scan], yerr=[100 * s["waste_sd"] for s in scan],
                fmt="o-", ms=3, lw=1, capsize=2, label=f"fixed interval, simulated (mean of {p['runs']} runs)")
    ax.plot(xs, [100 * s["model_waste"] for s in scan], "--", color="gray", lw=1,
            label="Daly 2006 complete model")
    ax.axvline(result["daly_tau_s"], color="tab:green", ls=":",
               label=f"Daly tau = {format_duration(result['daly_tau_s'])}")
    ax.axvline(result["young_period_s"], color="tab:olive", ls="-.",
               label=f"Young sqrt(2 delta M) = {format_duration(result['young_period_s'])}")
    marks = {"fixed": ("s", "tab:red"), "adaptive": ("*", "tab:purple"), "oracle": ("D", "black")}
    for name, pol in result["policies"].items():
        m, c = marks.get(name, ("x", None))
        ax.plot([pol["interval_s"]], [100 * pol["waste"]], m, color=c, ms=11 if m == "*" else 8,
                label=f"{name}: {format_duration(pol['interval_s'])}, {100 * pol['waste']:.2f} %")
    ax.set_xscale("log")
    ax.set_xlabel("compute interval between checkpoints tau (s)")
    ax.set_ylabel("wasted fraction of wall time (%)")
    ax.set_title(f"M = {format_duration(p['mtbf_s'])}, delta = {p['delta_s']:g} s, R = {p['restart_s']:g} s, "
                 f"W = {format_duration(p['work_s'])}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
