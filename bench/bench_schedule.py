"""Adaptive vs fixed checkpoint intervals on the real torchtitan demo under injected failures.

The experiment of issue 4, item 6 (``make bench-schedule``), run the way a user of this product
runs a job: the torchtitan demo (``configs/titan_demo.toml``: llama3 debug model, 2 simulated
nodes of 1 CPU rank, FSDP2 over gloo) trains ``--steps`` steps under each policy as **one run
of** ``launch/local.py``'s :class:`LocalLauncher` (2 nodes, ``-m titan_plugin.train --toml
configs/titan_demo.toml`` + the policy's overrides, the demo's environment ``RUN_ENV``:
OMP_NUM_THREADS=1 …). A monitor of that run (:class:`FailureInjector`) SIGKILLs the ranks of
one node (``launcher.workers(victim)``) at the arrivals of a Poisson process with a compressed
MTBF (``--mtbf``, seconds of wall time); the launcher notices the failure, stops the other
node's ranks (warm: SIGKILL through its agent; cold: SIGTERM to its torchrun, SIGKILL after the
launcher's grace) and starts the next attempt by itself. Node disks survive (only processes die),
so a restart restores from the local tier. Launcher modes (the report names it):

- warm (default): one node agent per node imports torch, torchtitan and the plugin once and
  forks every attempt's ranks (a restart pays no interpreter start and no imports);
- ``--cold``: ``launch/local.py --cold`` semantics (``LocalLauncher(warm=False)``): a torchrun
  per node and attempt, every rank a new interpreter (the restart cost before issue 31).

Policies:

- ``torchtitan-default``: torchtitan's own fixed interval (``checkpoint.interval`` = 500 steps,
  the default of ``torchtitan.components.checkpointer.base``), no local tier;
- ``fixed-local-10``: tierckpt's default fixed local interval (10 steps, replicated) with the
  persistent tier at torchtitan's 500;
- ``adaptive``: both tiers adaptive (``checkpoint.adaptive = ["local", "persistent"]``), with a
  deliberately wrong MTBF prior (``--prior-factor`` × the true MTBF, weight 1 pseudo-failure) so
  the estimate has to be learned from the failures in the ledger.

All policies see the same failure times (common random numbers: the same seeded gaps, counted
from the first training step of the first attempt, the victim node of failure i drawn from seed
i). A failure that falls due while the victim's ranks are not running yet (the launcher is still
starting the next attempt) strikes as soon as they are: its recorded time is the kill itself.
Before the policies, a failure-free run without checkpoints (one LocalLauncher run in the same
mode) measures the step time ``t_ref`` in the same session (this machine is shared and noisy;
ratios within one run are what we compare).

Wasted fraction of a policy, over the wall time ``W`` from the first logged step of the first
attempt to the last step's log line (plus one step)::

    waste = 1 − N · t_step / W

where ``t_step`` is the policy's own quiet step time: the median step at least 3 steps after a
save, in its own run (``t_ref`` from the reference run is only used to size the run and the
caps; a change of the machine's load between phases would otherwise leak into the waste).

so lost work, checkpoint stalls, background slowdown and restarts all count. A policy that does
not finish within ``--cap`` × N · t_ref is stopped (the monitor raises; the launcher stops every
process); its waste is reported from the last committed step instead
(``1 − step_committed · t_step / W``, a lower bound).

Per failure the report keeps the monitor's bookkeeping — the launcher attempt it struck, the
victim node, the last step logged before the kill — reconciled with ``launcher.attempts``
(failure i fails attempt i; the launcher's cause, failed nodes, when it noticed the failure and
stopped the survivors, when it launched the next attempt): a mismatch, or an attempt that failed
without an injected failure, makes the run invalid.

The theoretical optimum is Daly's complete model for Poisson failures
(:func:`tierckpt.sched.schedule.daly_waste_fraction`) minimised over the interval, with the injected
MTBF and two costs measured from the trainer's own step log (not from the engine's estimates):

- δ, the full cost of one save: the step-time excess over ``t_ref`` of all steady steps (each
  process's first 3 steps excluded) divided by the number of saves among them. On 2 shared
  cores the background write and replication slow the following steps; blocking time alone (the
  ledger's ``blocking_s``, also printed) understates δ and so the optimum's waste;
- R, kill → the 4th step of the next process − 4 t_ref (notice, teardown, start, init, restore,
  warm-up); every rank is a new process in each attempt (warm: forked), so steps group by pid.

R is also reported from the ledger's ``recovery`` records (:class:`tierckpt.records.RecoveryRecord`,
one per restarted attempt that reached its first step after a restore): ``total_s`` (the
launcher noticing the failure → the first step done, that step included), its phases (survivors
stopped, launched, processes started, imports done, process group up, model built, restore done,
first step done) and the kill → noticed gap; the adaptive scheduler's own R is that ``total_s``.

Targets (issue 4): adaptive ≤ 1.25 × optimum, and adaptive < the fixed default. Issue 31:
``--mtbf 90``, two seeds, wasted time ≤ 10 % (from ~21 % with cold restarts).

``torchtitan-default`` stops at ``--cap-default`` (1.25) × N · t_ref: with N < 500 steps its
interval commits nothing, so after its first failure no cap lets it finish.

The adaptive policy's restart prior (``--restart-prior``, ``checkpoint.restart_prior_s``)
stands for what an operator knows of the launcher. Its default is 10 s, down from 60 s (a rough
guess of a cold batch-job restart): restarts are now seconds (issue 31's target for a warm
restart, kill → first step, is ≤ 4 s: failure noticed → ranks forked takes 0.13 s where a cold
start spent 9–10 s; this bench measured R ≈ 10 s with cold restarts), and 10 s is the right order
for both modes without being tuned to either, so ``--cold`` changes only the launcher. It only
matters before the first restart: the scheduler's R is the mean of the measured recoveries as
soon as the ledger has one (the prior is not blended in), and the first interval moves as
sqrt(M0 + R0) with the MTBF prior M0 = ``--prior-factor`` × MTBF (360 s): 10 s against a 4 s
restart is +1 % of τ (60 s was +7 %).

Usage::

    .venv/bin/python bench/bench_schedule.py [--mtbf 90] [--steps 0] [--seed 1] [--cap 4] [--cold] [--record]

``--steps 0`` (default) sizes the run from the measured step time so that the failure-free
training lasts ``--failures-expected`` MTBFs (4 by default): with fewer failures one run says
little (a realisation with one early failure measures checkpoint overhead only). The verdict
says so when a policy saw fewer than 3 failures.

``--record`` appends the result table to bench/history/<YYYY-MM>.md. Outputs go to
``outputs/bench-schedule`` (``outputs/bench-schedule-cold`` with ``--cold``): report.json,
per-policy dump folders, node disks (``nvme-<policy>``) and the launcher's logs
(``logs/<policy>-attempt<k>-node<n>.log``).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import math
import os
import platform
import random
import shlex
import shutil
import signal
import statistics
import sys
import time
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from tierckpt.history.ledger import Ledger  # noqa: E402
from tierckpt.records import RECOVERY_PHASES, RecoveryRecord, parse_records  # noqa: E402
from tierckpt.sched.schedule import daly_interval, daly_waste_fraction  # noqa: E402
from tierckpt.io.storage import Store  # noqa: E402

RESULTS_MD = os.path.join(REPO, "bench", "history", time.strftime("%Y-%m", time.gmtime()) + ".md")  # dated notebook
TOML = os.path.join(REPO, "configs", "titan_demo.toml")
TORCHTITAN_DEFAULT_INTERVAL = 500  # torchtitan.components.checkpointer.base CheckpointManager.Config.interval
TARGET_VS_OPTIMUM = 1.25
WASTE_TARGET = 0.10  # issue 31: make bench-schedule (MTBF 90 s, two seeds), wasted time <= 10 %


MODES = {"warm": "launch/local.py: one warm node agent per simulated node, every attempt's ranks forked from it",
         "cold": "launch/local.py --cold: a torchrun per simulated node and attempt, every rank a new interpreter",
         # a report of the bench before it ran its jobs through LocalLauncher (--reanalyse)
         "legacy": "rank processes started and restarted by the bench itself, cold (launch/local_demo.py Job)"}
LEGACY_MODE = "legacy"


def _load_demo():
    """``launch/local_demo.py`` as a module: its ``RUN_ENV`` (the demo's rank environment) and
    ``local_launcher()`` (``launch/local.py``, whose :class:`LocalLauncher` runs every job here)."""
    name = "tierckpt_local_demo"
    if name not in sys.modules:  # registered first: its dataclasses look their module up
        spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, "launch", "local_demo.py"))
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


def _read_steps(path: str) -> list[dict]:
    """Lines of the metrics JSONL (``{"step", "loss", "time", "pid", …}``); a torn tail is skipped."""
    out = []
    try:
        with open(path) as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if isinstance(rec, dict) and "step" in rec and "time" in rec:
                    out.append(rec)
    except FileNotFoundError:
        pass
    return out


def policy_overrides(name: str, mtbf_s: float, prior_factor: float, world: int,
                     restart_prior_s: float = 0.0) -> list[str]:
    """``--section.key value`` overrides of one policy (see the module docstring)."""
    if name == "torchtitan-default":
        return ["--checkpoint.local_interval", "0", "--checkpoint.interval", str(TORCHTITAN_DEFAULT_INTERVAL)]
    if name == "fixed-local-10":
        return ["--checkpoint.local_interval", "10", "--checkpoint.interval", str(TORCHTITAN_DEFAULT_INTERVAL)]
    if name == "adaptive":
        # the prior is per GPU (rank): the job prior M0 = gpu_mtbf / world
        gpu_mtbf_h = prior_factor * mtbf_s * world / 3600.0
        return ["--checkpoint.local_interval", "10", "--checkpoint.interval", str(TORCHTITAN_DEFAULT_INTERVAL),
                "--checkpoint.adaptive", "local,persistent", "--checkpoint.gpu_mtbf_hours", repr(gpu_mtbf_h)] + (
                ["--checkpoint.restart_prior_s", repr(restart_prior_s)] if restart_prior_s else [])
    raise ValueError(f"unknown policy {name!r}; allowed: torchtitan-default, fixed-local-10, adaptive")


def common_overrides(dump: str, steps: int, job: str, nvme: str) -> list[str]:
    return ["--dump_folder", dump, "--training.steps", str(steps), "--checkpoint.enable", "true",
            "--checkpoint.last_save_model_only", "false", "--checkpoint.simulated_ranks_per_node", "1",
            "--checkpoint.replication_factor", "2", "--checkpoint.job_id", job,
            "--checkpoint.local_root", os.path.join(nvme, "{job}", "node-{node}")]


def make_launcher(lo, name: str, overrides: list[str], *, out: str, nodes: int, max_attempts: int, cold: bool,
                  timeout: float, env: dict[str, str], local_root: str | None = None):
    """The :class:`LocalLauncher` of one run: ``-m titan_plugin.train --toml configs/titan_demo.toml``
    + ``overrides`` on ``nodes`` simulated nodes of one rank, the demo's environment ``env``,
    warm node agents unless ``cold`` (their start-up and imports within ``timeout``), logs under
    ``out/logs`` named by ``name``; ``local_root`` (``{node}`` template) names the node disks."""
    return lo.LocalLauncher(["-m", "titan_plugin.train", "--toml", TOML, *overrides], nodes=nodes, nproc_per_node=1,
                            max_attempts=max_attempts, log_dir=os.path.join(out, "logs"), name=name, env=dict(env),
                            warm=not cold, local_root=local_root, agent_ready_timeout_s=timeout)


def _say(name: str):
    return lambda line: print(f"[bench-schedule {time.strftime('%H:%M:%S')}] {name}: {line}", flush=True)


def measure_step_time(demo, out: str, steps: int, world: int, timeout: float, cold: bool = False) -> dict:
    """Failure-free run without checkpoints, one LocalLauncher run in the policies' mode: median
    seconds between consecutive logged steps, skipping the first 3 (warm-up)."""
    lo = demo.local_launcher()
    dump = os.path.join(out, "reference")
    job = make_launcher(lo, "reference", ["--dump_folder", dump, "--training.steps", str(steps),
                                          "--checkpoint.enable", "false"],
                        out=out, nodes=world, max_attempts=1, cold=cold, timeout=timeout, env=demo.RUN_ENV)
    try:
        rc = job.run(timeout=timeout, log=_say("reference"))
    except lo.LaunchError as e:
        raise RuntimeError(f"reference run: {e}") from None
    if rc != 0:
        raise RuntimeError(f"reference run exited {rc}\n{job.failure_text()}")
    recs = sorted(_read_steps(os.path.join(dump, "metrics", "losses.jsonl")), key=lambda r: r["step"])
    gaps = [b["time"] - a["time"] for a, b in zip(recs, recs[1:]) if b["step"] == a["step"] + 1 and a["step"] > 3]
    if len(gaps) < 3:
        raise RuntimeError(f"reference run logged {len(recs)} steps; see {job.attempts[-1].logs}")
    return {"t_ref": statistics.median(gaps), "samples": len(gaps), "final_loss": recs[-1]["loss"]}


def victim_of(i: int, nodes: int) -> int:
    """The node failure ``i`` (0-based) strikes: the same for every policy (its own seed)."""
    return random.Random(i).randrange(nodes)


def planned_failures(gaps: list[float], horizon_s: float) -> int:
    """Failures whose due time (cumulative ``gaps``, from the first step) is within ``horizon_s``."""
    t, n = 0.0, 0
    for g in gaps:
        t += g
        if t > horizon_s:
            break
        n += 1
    return n


class CapReached(Exception):
    """Raised by :class:`FailureInjector` when a policy's cap passed: the launcher stops every
    process and re-raises it; the policy did not finish."""


class FailureInjector:
    """The ``monitor`` of one policy's :class:`LocalLauncher` run (called about every 50 ms with
    the running attempt).

    Until the first step is logged (``metrics``) it only waits (``timeout_s`` from ``t_launch0``,
    the launcher's start, agents' imports included); the first step sets ``t_first`` (that step's
    time − ``t_ref``) and the first failure's due time ``t_first + gaps[0]``; failure i+1 is due
    ``gaps[i+1]`` after failure i's due time, whatever the restarts took. A due failure SIGKILLs
    every rank of node ``victim_of(i, nodes)`` in the current attempt (``launcher.workers``; when
    they are not running yet, at the first call they are), at most once per attempt: the
    launcher notices it, stops the other node's ranks and starts the next attempt itself.
    ``fails`` gets ``{"time": kill, "due", "attempt", "victim", "last_step"}`` per failure
    (``last_step``: the newest step this attempt logged before the kill).

    Raises (from the launcher's loop, which stops every process first):
        CapReached: ``cap_s`` passed since ``t_first``.
        RuntimeError: no step within ``timeout_s``, or an attempt failed that no injected
            failure struck (a rank failed on its own, a hang verdict).
    """

    def __init__(self, name: str, metrics: str, gaps: list[float], *, t_ref: float, cap_s: float, nodes: int,
                 timeout_s: float, t_launch0: float, clock=time.time, kill=os.kill):
        self.name, self.metrics, self.gaps = name, metrics, gaps
        self.t_ref, self.cap_s, self.nodes, self.timeout_s, self.t_launch0 = t_ref, cap_s, nodes, timeout_s, t_launch0
        self.clock, self.kill = clock, kill
        self.t_first: float | None = None
        self.fail_at: float | None = None
        self.fails: list[dict] = []
        self._seen = 0  # newest attempt index checked

    def __call__(self, launcher, a) -> None:
        now = self.clock()
        if a.index > self._seen:  # a new attempt: the one before it failed; was it our kill?
            if not self.fails or self.fails[-1]["attempt"] != a.index - 1:
                prev = launcher.attempts[a.index - 1]
                raise RuntimeError(f"{self.name}: attempt {a.index} failed without an injected failure (cause "
                                   f"{prev.cause}, nodes {list(prev.failed_nodes)}{': ' + prev.hang_detail if prev.hang_detail else ''}"
                                   f"; a rank failed on its own or the launcher found a hang):\n"
                                   f"{launcher.failure_text(prev)}")
            self._seen = a.index
        if self.t_first is None:
            recs = _read_steps(self.metrics)
            if not recs:
                if now - self.t_launch0 > self.timeout_s:
                    raise RuntimeError(f"{self.name}: no step logged within {self.timeout_s:.0f}s; logs: {a.logs}")
                return
            self.t_first = recs[0]["time"] - self.t_ref
            self.fail_at = self.t_first + self.gaps[0]
        if now - self.t_first > self.cap_s:
            raise CapReached(f"{self.name}: cap of {self.cap_s:.0f} s reached")
        assert self.fail_at is not None
        if now < self.fail_at or (self.fails and self.fails[-1]["attempt"] == a.index):
            return
        i = len(self.fails)
        victim = victim_of(i, self.nodes)
        pids = launcher.workers(victim)
        if not pids:  # its ranks are not running yet: strike when they are
            return
        for pid in pids:
            try:
                self.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        last = max((r["step"] for r in _read_steps(self.metrics) if r["time"] >= a.t_start), default=None)
        self.fails.append({"time": now, "due": self.fail_at, "attempt": a.index, "victim": victim,
                           "last_step": last})
        self.fail_at += self.gaps[i + 1]


def reconcile_fails(fails: list[dict], attempts: list, finished: bool) -> list[str]:
    """Check the injected failures against what the launcher did and add its view to each.

    Failure i must have struck attempt i, and every attempt but the last must have failed: one
    failure per restart. The last attempt finished (``finished``) or was stopped at the cap, in
    which case it may hold one more failure the launcher had no time to act on. Each failure of
    a failed attempt gets ``noticed``, ``survivors_stopped`` (UNIX s), ``relaunched`` (the next
    attempt's start, or None), ``launcher_cause`` and ``launcher_failed_nodes``.

    Returns:
        What does not match (empty when everything does).
    """
    problems = []
    for i, f in enumerate(fails):
        if f.get("attempt") != i:
            problems.append(f"failure {i + 1} struck attempt {f.get('attempt')}, expected attempt {i} "
                            "(one failure per restart)")
        k = f.get("attempt")
        if not isinstance(k, int) or not 0 <= k < len(attempts):
            problems.append(f"failure {i + 1}: the launcher has no attempt {k} ({len(attempts)} attempts)")
            continue
        a = attempts[k]
        f.update(noticed=a.failure_noticed, survivors_stopped=a.survivors_stopped,
                 relaunched=attempts[k + 1].t_start if k + 1 < len(attempts) else None,
                 launcher_cause=a.cause, launcher_failed_nodes=list(a.failed_nodes))
        if a.failure_noticed is None and not (k == len(attempts) - 1 and not finished):
            problems.append(f"failure {i + 1}: attempt {k} did not fail in the launcher")
    struck = {f.get("attempt") for f in fails}
    for a in attempts[:-1]:
        if a.index not in struck:
            problems.append(f"attempt {a.index} failed ({a.cause}, nodes {list(a.failed_nodes)}) without an "
                            "injected failure")
    if attempts:
        last = attempts[-1]
        if finished and not last.ok:
            problems.append(f"the run finished but its last attempt {last.index} did not succeed")
        if finished and last.index in struck:
            problems.append(f"failure in attempt {last.index}, which then finished (the kill found no rank)")
        if not finished and last.failure_noticed is not None:
            problems.append(f"the last attempt {last.index} failed and was not restarted")
    return problems


def run_policy(demo, out: str, name: str, args, gaps: list[float], t_ref: float, kill=os.kill) -> dict:
    """Train ``args.steps`` steps under policy ``name`` as one LocalLauncher run, with failures
    at the cumulative ``gaps`` injected by a :class:`FailureInjector` (which signals the
    victims' ranks with ``kill``)."""
    lo = demo.local_launcher()
    dump = os.path.join(out, name)
    nvme = os.path.join(out, "nvme-" + name)
    job_id = "bench-" + name
    metrics = os.path.join(dump, "metrics", "losses.jsonl")
    ov = common_overrides(dump, args.steps, job_id, nvme) + policy_overrides(
        name, args.mtbf, args.prior_factor, args.world, args.restart_prior)
    # torchtitan's 500-step interval cannot commit within N < 500 steps, so after the first failure it
    # can only end at the cap; a shorter cap for it spends less of the session on a known outcome
    cap_s = (args.cap_default if name == "torchtitan-default" else args.cap) * args.steps * t_ref
    # one attempt per failure that can fall due before the cap, the last one, and one spare
    max_attempts = planned_failures(gaps, cap_s) + 2
    launcher = make_launcher(lo, name, ov, out=out, nodes=args.world, max_attempts=max_attempts, cold=args.cold,
                             timeout=args.timeout, env=demo.RUN_ENV, local_root=os.path.join(nvme, job_id, "node-{node}"))
    inj = FailureInjector(name, metrics, gaps, t_ref=t_ref, cap_s=cap_s, nodes=args.world, timeout_s=args.timeout,
                          t_launch0=time.time(), kill=kill)
    finished = False
    try:
        rc = launcher.run(monitor=inj, log=_say(name))
    except CapReached:
        rc = None
    except lo.LaunchError as e:
        raise RuntimeError(f"{name}: {e}") from None
    if rc is not None:
        if rc != 0:
            raise RuntimeError(f"{name}: the launcher gave up (exit {rc}) after {len(launcher.attempts)} attempts\n"
                               f"{launcher.failure_text()}")
        finished = True
    problems = reconcile_fails(inj.fails, launcher.attempts, finished)
    return analyse_policy(name, dump, inj.fails, inj.t_first, finished, len(launcher.attempts), args.steps, t_ref,
                          bookkeeping=problems)


def ledger_recoveries(records: list[dict], fails: list[dict]) -> list[dict | None]:
    """Per failure, the ``recovery`` ledger record of the attempt after it (``attempt`` = the
    failure's + 1) as ``{"attempt", "total_s", "phases_s", "kill_to_noticed_s", "warm", "cause",
    "failed_nodes", "restored_step"}``; None when the restarted attempt wrote none (no restore:
    nothing was committed, or it failed again before its first step)."""
    by_attempt: dict[int, RecoveryRecord] = {}
    for r in parse_records(records):
        if isinstance(r, RecoveryRecord) and r.attempt is not None:
            by_attempt.setdefault(r.attempt, r)
    out: list[dict | None] = []
    for f in fails:
        k = f.get("attempt")
        rec = by_attempt.get(k + 1) if isinstance(k, int) else None
        if rec is None:
            out.append(None)
            continue
        noticed = rec.phases.get("failure_noticed")
        gap = noticed - f["time"] if isinstance(noticed, (int, float)) and isinstance(f.get("time"), (int, float)) \
            else None
        out.append({"attempt": rec.attempt, "total_s": rec.total_s, "phases_s": dict(rec.phases_s),
                    "kill_to_noticed_s": gap, "warm": rec.warm, "cause": rec.cause,
                    "failed_nodes": list(rec.failed_nodes), "restored_step": rec.step})
    return out


def mean_phases(recoveries: list[dict | None]) -> dict[str, float | None]:
    """Mean seconds since failure noticed of each recovery phase over the records that have it."""
    out: dict[str, float | None] = {}
    for p in RECOVERY_PHASES:
        vals = [r["phases_s"][p] for r in recoveries
                if r is not None and isinstance(r["phases_s"].get(p), (int, float))]
        out[p] = statistics.fmean(vals) if vals else None
    return out


def analyse_policy(name: str, dump: str, fails: list[dict], t_first: float | None, finished: bool,
                   attempts: int, steps: int, t_ref: float, bookkeeping: list[str] | None = None) -> dict:
    """A policy's result from its step log (``dump``/metrics), its ledger and the kill times.

    Every cost is measured against the policy's own quiet step time ``t_step`` (median of
    steps at least 3 past a save, :func:`quiet_step_median`; ``t_ref`` if there are too few),
    so a change of the machine's load between the reference run and this policy does not
    leak into its waste: ``waste = 1 − useful_steps · t_step / W``. ``bookkeeping``: the
    mismatches :func:`reconcile_fails` found (kept in the result; they invalidate the run).
    """
    recs = _read_steps(os.path.join(dump, "metrics", "losses.jsonl"))
    by_step = {}
    for r in recs:  # the last line for a step wins (re-run steps after a resume)
        by_step[r["step"]] = r
    last_rec = max(recs, key=lambda r: r["time"]) if recs else None
    W = (last_rec["time"] - t_first) if (last_rec and t_first is not None) else float("nan")
    times = sorted(recs, key=lambda r: r["time"])
    records = Ledger.read(Store(os.path.join(dump, "checkpoint")))
    ckpts = [r for r in records if r.get("kind") == "checkpoint" and r.get("ok")]
    save_steps = {r["step"] for r in ckpts}
    quiet = quiet_step_median(times, save_steps)
    t_step = quiet or t_ref

    restarts, lost_steps, warm_restarts = restart_times(fails, times, t_step)
    for f in fails:
        nxt = next((r for r in times if r["time"] > f["time"]), None)
        if nxt is not None and f.get("last_step") is not None:
            lost_steps.append(max(0, f["last_step"] - (nxt["step"] - 1)))
    recoveries = ledger_recoveries(records, fails)
    blocking = {t: [r["blocking_s"] for r in ckpts if r.get("tier") == t and isinstance(r.get("blocking_s"), (int, float))]
                for t in ("local", "persistent")}
    decisions = [r for r in records if r.get("kind") == "schedule"]
    committed = max((r["step"] for r in ckpts), default=0)
    excess_s, n_gaps, n_saves = step_excess(times, t_step, save_steps)
    useful_steps = steps if finished else committed
    res: dict[str, Any] = {
        "policy": name, "finished": finished, "wall_s": W, "attempts": attempts, "failures": len(fails),
        "useful_steps": useful_steps, "t_step": t_step, "quiet_step_s": quiet,
        "waste": 1.0 - useful_steps * t_step / W if W > 0 else float("nan"),
        "waste_vs_t_ref": 1.0 - useful_steps * t_ref / W if W > 0 else float("nan"),
        "restart_s": restarts, "restart_warm_s": warm_restarts, "lost_steps": lost_steps,
        "recoveries": recoveries,
        "recovery_total_s": [r["total_s"] for r in recoveries if r is not None and r["total_s"] is not None],
        "recovery_phases_mean_s": mean_phases(recoveries),
        "step_excess_s": excess_s, "steady_gaps": n_gaps, "save_events": n_saves,
        "checkpoints": {t: len(v) for t, v in blocking.items()},
        "blocking_mean_s": {t: (statistics.fmean(v) if v else None) for t, v in blocking.items()},
        "stall_total_s": sum(sum(v) for v in blocking.values()),
        "final_loss": by_step[steps]["loss"] if finished and steps in by_step else None,
        "last_decisions": {},
        "t_first": t_first,
        "fails": fails,
        "fail_times_s": [f["time"] - t_first for f in fails] if t_first is not None else [],
        "bookkeeping": list(bookkeeping or []),
    }
    for d in decisions:
        res["last_decisions"][d.get("tier")] = {k: d.get(k) for k in ("tau_steps", "tau_s", "delta", "M", "R", "p", "reason")}
    return res


WARMUP_STEPS = 3  # measure_step_time skips these; after a restart they are restart cost


def restart_times(fails: list[dict], times: list[dict], t_ref: float) -> tuple[list, list, list]:
    """Restart time R of each failure not followed by another before training resumed, seconds.

    ``R`` = first step logged after the kill − kill − t_ref (the launcher noticing the failure and
    stopping the survivors, process start or fork, init, restore);
    ``R_warm`` also counts the slow warm-up steps after the restart: the ``WARMUP_STEPS``-th step
    after the first − kill − (1 + WARMUP_STEPS)·t_ref (R when the attempt did not get that far).
    Returns (R list, [] for lost steps, filled by the caller, R_warm list)."""
    restarts, warm = [], []
    for f in fails:
        after = [r for r in times if r["time"] > f["time"]]
        if not after or any(f["time"] < g["time"] < after[0]["time"] for g in fails):
            continue
        R = after[0]["time"] - f["time"] - t_ref
        restarts.append(R)
        pid = after[0].get("pid")
        same = [r for r in after if r.get("pid") == pid]
        if len(same) > WARMUP_STEPS and not any(f["time"] < g["time"] < same[WARMUP_STEPS]["time"] for g in fails):
            warm.append(same[WARMUP_STEPS]["time"] - f["time"] - (1 + WARMUP_STEPS) * t_ref)
        else:
            warm.append(R)
    return restarts, [], warm


DRIFT_LIMIT = 0.05  # relative change of the quiet step time that makes a run unreliable


def quiet_step_median(times: list[dict], save_steps: set, after: int = 3) -> float | None:
    """Median gap between consecutive steady steps of one process that are at least ``after``
    steps past the last save: the step time without checkpoint work, measured during the
    policy's own run. Compared with ``t_ref`` it shows whether the machine's load changed
    (this machine is shared) between the reference and the policy."""
    by_pid: dict = {}
    for r in times:
        by_pid.setdefault(r.get("pid"), []).append(r)
    saves = sorted(save_steps)
    gaps = []
    for recs in by_pid.values():
        recs = sorted(recs, key=lambda r: r["time"])[WARMUP_STEPS:]
        for a, b in zip(recs, recs[1:]):
            last = max((x for x in saves if x <= a["step"]), default=None)
            if b["step"] == a["step"] + 1 and (last is None or a["step"] - last >= after):
                gaps.append(b["time"] - a["time"])
    return statistics.median(gaps) if len(gaps) >= 5 else None


def step_excess(times: list[dict], t_ref: float, save_steps: set) -> tuple[float, int, int]:
    """Checkpoint overhead seen from the trainer's own step log, independent of the engine.

    Sums ``gap − t_ref`` over consecutive logged steps (step s → s + 1) of one process, skipping
    each process's first ``WARMUP_STEPS`` steps; a save at step s (ledger ``checkpoint`` record)
    sits in the gap s → s + 1 and its background write slows the following steps, so
    excess / (saves in counted gaps) is the full cost of one save, δ_eff in seconds (blocking
    + background interference). Returns (excess seconds, gaps counted, save events in them)."""
    by_pid: dict = {}
    for r in times:
        by_pid.setdefault(r.get("pid"), []).append(r)
    excess, n, saves = 0.0, 0, 0
    for recs in by_pid.values():
        recs = sorted(recs, key=lambda r: r["time"])[WARMUP_STEPS:]
        for a, b in zip(recs, recs[1:]):
            if b["step"] != a["step"] + 1:
                continue
            excess += b["time"] - a["time"] - t_ref
            n += 1
            saves += a["step"] in save_steps
    return excess, n, saves


def summarise(args, ref: dict, results: list[dict], elapsed_s: float) -> dict:
    """The report: the theoretical optimum from the pooled measured δ and R, each policy's
    result, the verdict against the targets and warnings about unreliable runs."""
    deltas = [p["blocking_mean_s"]["local"] for p in results if p["blocking_mean_s"]["local"] is not None]
    delta_block = statistics.fmean(deltas) if deltas else 0.0
    saves = sum(p["save_events"] for p in results)
    delta_eff = max(delta_block, sum(p["step_excess_s"] for p in results if p["save_events"]) / saves) \
        if saves else delta_block
    Rs = [x for p in results for x in p["restart_s"]]
    Rw = [x for p in results for x in p["restart_warm_s"]]
    R = statistics.fmean(Rw) if Rw else 0.0
    opt = theoretical_optimum(delta_eff, args.mtbf, R)
    opt["delta_blocking_s"] = delta_block
    opt["R_first_step_s"] = statistics.fmean(Rs) if Rs else 0.0
    opt["blocking_only"] = theoretical_optimum(delta_block, args.mtbf, opt["R_first_step_s"])
    totals = [x for p in results for x in p.get("recovery_total_s", [])]
    recs = [r for p in results for r in p.get("recoveries", [])]
    gaps = [r["kill_to_noticed_s"] for r in recs if r is not None and r.get("kill_to_noticed_s") is not None]
    opt["R_ledger_total_s"] = statistics.fmean(totals) if totals else None
    opt["R_ledger_records"] = len(totals)
    opt["R_ledger_phases_s"] = mean_phases(recs)
    opt["kill_to_noticed_s"] = statistics.fmean(gaps) if gaps else None
    for p in results:  # the same optimum at the failure rate this policy's run actually saw
        m_real = p["wall_s"] / p["failures"] if p["failures"] else float("inf")
        p["M_realised_s"] = m_real
        p["waste_opt_realised"] = theoretical_optimum(delta_eff, m_real, R)["waste_opt"] if p["failures"] else \
            None
    by = {p["policy"]: p for p in results}
    # a failure-free run of the same steps is bitwise reproducible; compare the loss at the
    # reference run's last step only when the reference went that far
    ref_steps = 25
    losses_equal = "n/a (reference shorter than the runs)" if args.steps != ref_steps else all(
        p["final_loss"] == ref["final_loss"] for p in results if p["finished"])
    finished_losses = {p["final_loss"] for p in results if p["finished"]}
    if args.steps != ref_steps:
        losses_equal = "all finished policies end on the same loss" if len(finished_losses) <= 1 else \
            f"DIFFERENT final losses: {sorted(finished_losses)}"
    verdict = {}
    if "adaptive" in by:
        a = by["adaptive"]["waste"]
        verdict["adaptive_vs_optimum"] = a / opt["waste_opt"] if opt["waste_opt"] > 0 else float("nan")
        verdict["near_optimum"] = verdict["adaptive_vs_optimum"] <= TARGET_VS_OPTIMUM
        if by["adaptive"]["failures"] < 3:  # one realisation with 0-2 failures tests overhead only
            verdict["near_optimum"] = None
        w_real = by["adaptive"].get("waste_opt_realised")
        verdict["adaptive_vs_realised_optimum"] = a / w_real if w_real else None
        if "torchtitan-default" in by:
            verdict["beats_default"] = a < by["torchtitan-default"]["waste"]
        if "fixed-local-10" in by:
            verdict["adaptive_vs_fixed10"] = a / by["fixed-local-10"]["waste"]
        verdict["waste_le_target"] = a <= WASTE_TARGET  # issue 31
    verdict["losses_equal"] = losses_equal
    warnings = []
    few = [p["policy"] for p in results if p["failures"] < 3]
    if few:
        warnings.append(f"{', '.join(few)} saw fewer than 3 failures: this run measures mostly checkpoint "
                        "overhead; use more steps or seeds for the comparison")
    drift = {p["policy"]: p["quiet_step_s"] / ref["t_ref"] - 1.0 for p in results if p["quiet_step_s"]}
    verdict["step_time_drift"] = drift
    moved = {k: v for k, v in drift.items() if abs(v) > DRIFT_LIMIT}
    if moved:
        warnings.append("the step time without checkpoint work moved against t_ref ("
                        + ", ".join(f"{k} {100 * v:+.0f} %" for k, v in moved.items())
                        + "): the machine's load changed between phases; each waste is measured against the "
                        "policy's own quiet step time, but δ and R are pooled across phases")
    broken = {p["policy"]: p["bookkeeping"] for p in results if p.get("bookkeeping")}
    if broken:  # the failures the analysis counts are not the restarts the launcher made
        verdict["near_optimum"] = False
        warnings.append("failure bookkeeping does not match the launcher's attempts ("
                        + "; ".join(f"{k}: {', '.join(v)}" for k, v in broken.items()) + "): rerun")
    negative = [p["policy"] for p in results if p["waste"] < 0]
    if negative:  # faster than failure-free training: the step time baseline is wrong
        verdict["near_optimum"] = False
        warnings.append(f"negative waste ({', '.join(negative)}): the step-time baseline is invalid; rerun")
    if warnings:
        verdict["warning"] = "; ".join(warnings)
    cold = getattr(args, "cold", None)
    mode = LEGACY_MODE if cold is None else "cold" if cold else "warm"
    return {"args": vars(args), "mode": mode, "launcher": MODES[mode], "t_ref": ref["t_ref"],
            "reference": ref, "optimum": opt, "policies": results, "verdict": verdict, "elapsed_s": elapsed_s}


def reanalyse(out: str) -> tuple[dict, str]:
    """Recompute the report of an earlier run from its outputs (step logs, ledgers and the
    kill times in ``out/report.json``) with this version's analysis. Returns (report, text)."""
    with open(os.path.join(out, "report.json")) as f:
        old = json.load(f)
    args = argparse.Namespace(**old["args"])
    t_ref = old["t_ref"]
    results = []
    for p in old["policies"]:
        name = p["policy"]
        recs = sorted(_read_steps(os.path.join(out, name, "metrics", "losses.jsonl")), key=lambda r: r["time"])
        t_first = p.get("t_first") or (recs[0]["time"] - t_ref if recs else None)
        fails = p.get("fails") or [{"time": t_first + ft} for ft in p["fail_times_s"]]
        for f in fails:  # the last step logged before each kill
            f.setdefault("last_step", max((r["step"] for r in recs if r["time"] < f["time"]), default=None))
        results.append(analyse_policy(name, os.path.join(out, name), fails, t_first, p["finished"],
                                      p["attempts"], args.steps, t_ref, bookkeeping=p.get("bookkeeping")))
    report = summarise(args, old["reference"], results, old.get("elapsed_s", float("nan")))
    report["reanalysed_from"] = out
    return report, render(report)


def theoretical_optimum(delta: float, M: float, R: float) -> dict:
    """Interval (compute seconds) minimising Daly's complete-model waste, by a dense geometric
    scan, and that waste; plus Daly's first-order interval for reference."""
    lo, hi = max(delta, 1e-3) / 10.0, 10.0 * M
    best: tuple[float, float] | None = None
    n = 4000
    for i in range(n + 1):
        tau = lo * (hi / lo) ** (i / n)
        w = daly_waste_fraction(tau, delta, M, R)
        if best is None or w < best[1]:
            best = (tau, w)
    assert best is not None  # the scan has n + 1 ≥ 1 points
    return {"tau_opt_s": best[0], "waste_opt": best[1], "tau_daly_s": daly_interval(delta, M, R),
            "delta_s": delta, "M_s": M, "R_s": R}


def _mean_text(xs: list) -> str:
    return f"{statistics.fmean(xs):.1f} (n = {len(xs)})" if xs else "–"


def render_ledger_recovery(opt: dict) -> str:
    """The line of the ledger's ``recovery`` records: mean total and mean phases."""
    total = opt.get("R_ledger_total_s")
    if total is None:
        return "ledger recovery records: none (no restarted attempt reached its first step after a restore)"
    ph = opt.get("R_ledger_phases_s") or {}
    gap = opt.get("kill_to_noticed_s")
    phases = ", ".join(f"{k.replace('_', ' ')} {ph[k]:.2f}" for k in RECOVERY_PHASES[1:]
                       if ph.get(k) is not None)
    return (f"ledger recovery records ({opt.get('R_ledger_records', 0)}): total {total:.2f} s (failure noticed → "
            f"first step done, that step included; kill → noticed {'–' if gap is None else f'{gap:.2f}'} s); "
            f"mean phases, s since noticed: {phases or '–'}")


def render(report: dict) -> str:
    t_ref = report["t_ref"]
    opt = report["optimum"]
    mode = report.get("mode", LEGACY_MODE)
    lines = [
        f"restarts: {mode} ({report.get('launcher') or MODES.get(mode, '?')})",
        f"t_ref (failure-free step, no checkpoints) = {t_ref:.3f} s; N = {report['args']['steps']} steps; "
        f"injected MTBF M = {opt['M_s']:.0f} s",
        f"measured: δ = {opt['delta_s']:.3f} s per save (step-log excess per save: blocking "
        f"{opt['delta_blocking_s']:.3f} s + background slowdown), R = {opt['R_s']:.1f} s per restart "
        f"(step log: kill → steady training; {opt['R_first_step_s']:.1f} s to the first step)",
        render_ledger_recovery(opt),
        f"theoretical optimum (Daly complete model, these δ and R): τ* = {opt['tau_opt_s']:.1f} s of training "
        f"(≈ {opt['tau_opt_s'] / t_ref:.1f} steps), waste* = {100 * opt['waste_opt']:.1f} % "
        f"(with blocking-only δ and first-step R: {100 * opt['blocking_only']['waste_opt']:.1f} %)",
        "",
        "| policy | finished | failures | checkpoints (local/persistent) | quiet step s | wall s | waste | vs optimum "
        "| vs optimum at its realised MTBF | R s (step log / ledger total) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in report["policies"]:
        c = p["checkpoints"]
        vs = p["waste"] / opt["waste_opt"] if opt["waste_opt"] > 0 else float("nan")
        lines.append(f"| {p['policy']} | {'yes' if p['finished'] else 'no (cap; waste from committed step)'} | "
                     f"{p['failures']} | {c['local']}/{c['persistent']} | "
                     f"{p['t_step'] if p.get('t_step') else float('nan'):.3f} | {p['wall_s']:.0f} | "
                     f"{100 * p['waste']:.1f} % | {vs:.2f}x | " + (
                         f"{p['waste'] / p['waste_opt_realised']:.2f}x (M = {p['M_realised_s']:.0f} s) |"
                         if p.get("waste_opt_realised") else "– (no failure) |")
                     + f" {_mean_text(p['restart_s'])} / {_mean_text(p.get('recovery_total_s', []))} |")
    v = report["verdict"]
    verdicts = [f"adaptive / optimum = {v['adaptive_vs_optimum']:.2f} (target ≤ {TARGET_VS_OPTIMUM}): "
                f"{'INCONCLUSIVE (< 3 failures)' if v['near_optimum'] is None else 'PASS' if v['near_optimum'] else 'FAIL'}"]
    if v.get("adaptive_vs_realised_optimum"):
        verdicts.append(f"adaptive / optimum at its realised MTBF = {v['adaptive_vs_realised_optimum']:.2f}")
    if "beats_default" in v:
        verdicts.append(f"adaptive better than torchtitan-default: {'PASS' if v['beats_default'] else 'FAIL'}")
    if "adaptive_vs_fixed10" in v:
        verdicts.append(f"adaptive / fixed-local-10 = {v['adaptive_vs_fixed10']:.2f}")
    if "waste_le_target" in v:
        verdicts.append(f"adaptive waste ≤ {100 * WASTE_TARGET:.0f} % (issue 31): "
                        f"{'PASS' if v['waste_le_target'] else 'FAIL'}")
    verdicts.append(f"restores exact: {v['losses_equal']}")
    if v.get("warning"):
        verdicts.append("WARNING: " + v["warning"])
    lines += ["", "; ".join(verdicts)]
    ad = next((p for p in report["policies"] if p["policy"] == "adaptive"), None)
    if ad and ad["last_decisions"]:
        for tier, d in ad["last_decisions"].items():
            lines.append(f"adaptive, last decision for {tier}: τ = {d['tau_steps']} steps ({d['tau_s'] or 0:.1f} s), "
                         f"δ = {d['delta']:.3f} s, M = {d['M']:.0f} s, R = {d['R']:.1f} s, p = {d['p']:.2f}, {d['reason']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mtbf", type=float, default=90.0, help="injected MTBF, seconds of wall time (issue: 60-120)")
    ap.add_argument("--steps", type=int, default=0,
                    help="training steps per policy (0 = failures-expected x MTBF of failure-free training)")
    ap.add_argument("--failures-expected", type=float, default=4.0,
                    help="with --steps 0: failure-free training time in MTBFs")
    ap.add_argument("--seed", type=int, default=1, help="seed of the failure times (common to all policies)")
    ap.add_argument("--world", type=int, default=2, help="ranks (= simulated nodes)")
    ap.add_argument("--prior-factor", type=float, default=4.0, help="adaptive's MTBF prior / the true MTBF")
    ap.add_argument("--cap", type=float, default=4.0, help="stop a policy after cap × N × t_ref seconds")
    ap.add_argument("--cap-default", type=float, default=1.25,
                    help="the cap of torchtitan-default (its 500-step interval commits nothing in N < 500 steps)")
    ap.add_argument("--restart-prior", type=float, default=10.0,
                    help="adaptive's restart-time prior R0, seconds (checkpoint.restart_prior_s; what an "
                         "operator knows of the launcher's restart latency, replaced by the first measured "
                         "recovery; 0 = the plugin default 300 s)")
    ap.add_argument("--cold", action="store_true",
                    help="restart cold (launch/local.py --cold: a torchrun per node and attempt, new interpreters) "
                         "instead of from warm node agents")
    ap.add_argument("--policies", default="torchtitan-default,fixed-local-10,adaptive")
    ap.add_argument("--timeout", type=float, default=300.0,
                    help="seconds to wait for a first step (warm: the node agents' start-up and imports included)")
    ap.add_argument("--out", default=None,
                    help="output folder (default outputs/bench-schedule, outputs/bench-schedule-cold with --cold)")
    ap.add_argument("--record", action="store_true", help="append the results to bench/history/<YYYY-MM>.md")
    ap.add_argument("--reanalyse", metavar="OUT", default=None,
                    help="recompute the report of an earlier run's output folder (no training); "
                         "with --record, append it to bench/history/<YYYY-MM>.md")
    args = ap.parse_args(argv)
    if args.reanalyse:
        report, text = reanalyse(args.reanalyse)
        with open(os.path.join(args.reanalyse, "report-reanalysed.json"), "w") as f:
            json.dump(report, f, indent=2, default=str)
        print(text)
        if args.record:
            rel = os.path.relpath(args.reanalyse, REPO)
            _record(f"Re-analysis of {rel} (seed {report['args']['seed']}) — {datetime.date.today()}",
                    f"bench/bench_schedule.py --reanalyse {rel}", text)
        return _exit_code(report["verdict"])
    if not args.restart_prior >= 0:
        ap.error(f"--restart-prior must be >= 0 seconds, got {args.restart_prior}")
    for opt, v in (("--mtbf", args.mtbf), ("--cap", args.cap), ("--cap-default", args.cap_default),
                   ("--prior-factor", args.prior_factor),
                   ("--failures-expected", args.failures_expected)):
        if not v > 0:
            ap.error(f"{opt} must be > 0, got {v}")
    if args.steps < 0:
        ap.error(f"--steps must be >= 0 (0 = sized from the MTBF), got {args.steps}")
    policies = [p for p in args.policies.split(",") if p]
    for p in policies:
        policy_overrides(p, 1.0, 1.0, 1)  # validates the name

    if args.out is None:
        args.out = os.path.join(REPO, "outputs", "bench-schedule-cold" if args.cold else "bench-schedule")

    demo = _load_demo()
    shutil.rmtree(args.out, ignore_errors=True)
    os.makedirs(args.out)
    rng = random.Random(args.seed)
    gaps = [rng.expovariate(1.0 / args.mtbf) for _ in range(10000)]
    t0 = time.time()
    mode = "cold" if args.cold else "warm"
    print(f"restarts: {mode} ({MODES[mode]})", flush=True)
    # every job is a LocalLauncher run, which stops its processes when it ends or raises
    ref = measure_step_time(demo, args.out, 25, args.world, args.timeout, cold=args.cold)
    print(f"reference: t_ref = {ref['t_ref']:.3f} s/step ({ref['samples']} samples)", flush=True)
    if args.steps == 0:
        args.steps = max(20, math.ceil(args.failures_expected * args.mtbf / ref["t_ref"]))
        print(f"steps: {args.steps} (~{args.failures_expected:g} MTBFs of failure-free training)", flush=True)
    results = []
    for p in policies:
        r = run_policy(demo, args.out, p, args, gaps, ref["t_ref"])
        print(f"{p}: finished={r['finished']} failures={r['failures']} attempts={r['attempts']} "
              f"wall={r['wall_s']:.0f}s waste={100 * r['waste']:.1f}% checkpoints={r['checkpoints']}", flush=True)
        results.append(r)

    report = summarise(args, ref, results, time.time() - t0)
    with open(os.path.join(args.out, "report.json"), "w") as f:
        json.dump(report, f, indent=2, default=str)
    text = render(report) if any(p["policy"] == "adaptive" for p in results) else json.dumps(report["verdict"])
    print(text)
    if args.record:
        cmd = "bench/bench_schedule.py " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
        _record(f"Adaptive intervals under injected failures, {mode} restarts — {datetime.date.today()} "
                f"({platform.machine()}, {os.cpu_count()} cores)",
                cmd.strip(), text, note=f" (seed {args.seed}, {time.time() - t0:.0f} s)")
    return _exit_code(report["verdict"])


def _record(title: str, cmd: str, text: str, note: str = "") -> None:
    """Append a report to the month's notebook bench/history/<YYYY-MM>.md: ``### title``, the command line, ``note``, ``text``."""
    with open(RESULTS_MD, "a") as f:
        f.write(f"\n### {title}\n\n`{cmd}`{note}\n\n{text}\n")


def _exit_code(verdict: dict) -> int:
    """0 when adaptive met the optimum target and beat the default (inconclusive counts as not)."""
    return 0 if verdict.get("near_optimum") and verdict.get("beats_default", True) else 1


if __name__ == "__main__":
    sys.exit(main())
