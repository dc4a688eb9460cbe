"""One run of one system (or of the reference) under ``launch/local.py``'s launcher.

Each run is its own :class:`LocalLauncher` (2 simulated nodes × 1 rank, warm node agents) with
its own dump folder, node disks and throttled shared folder; the failures of the campaign
cell are injected by a :class:`~bench.goodput.failures.WipingInjector` (kill + wiped node
disk), and the run is analysed from its step log (:mod:`bench.goodput.accounting`), the
tierckpt ledger (save steps, restore seconds) or torchtitan's logs (stock: its restore line).
"""

from __future__ import annotations

import os
import re
import statistics
import time
from dataclasses import dataclass

from bench import bench_schedule as bs
from bench.goodput import accounting, throttle
from bench.goodput.failures import FailurePlan, WipingInjector
from bench.goodput.systems import STOCK_PRELOAD, System, command, local_root, reference_command
from tierckpt.history.ledger import Ledger
from tierckpt.io.storage import Store

STOCK_RESTORE_RE = re.compile(r"Finished loading the checkpoint in ([0-9.]+) seconds")


@dataclass
class RunParams:
    """What every run of a campaign shares: training ``steps``, ``nodes``, the shared folder's
    bandwidth (bytes/s), the cap (× steps × t_ref seconds before a run is stopped) and the
    first-step timeout (s, agents' imports included)."""

    steps: int
    nodes: int = 2
    shared_bps: float = 200e6
    cap: float = 4.0
    timeout_s: float = 300.0


def _launcher(lo, name: str, cmd: list[str], *, out: str, nodes: int, attempts: int, env: dict, timeout_s: float,
              disks: str | None):
    return lo.LocalLauncher(cmd, nodes=nodes, nproc_per_node=1, max_attempts=attempts,
                            log_dir=os.path.join(out, "logs"), name=name, env=env, warm=True, local_root=disks,
                            preload=list(STOCK_PRELOAD), agent_ready_timeout_s=timeout_s)


def measure_reference(demo, out: str, p: RunParams, steps: int = 15) -> dict:
    """Failure-free, checkpoint-free run: ``{"t_ref": median step gap after warm-up (s), "samples"}``.

    Raises:
        RuntimeError: the run failed or logged too few steps.
    """
    lo = demo.local_launcher()
    dump = os.path.join(out, "reference")
    job = _launcher(lo, "reference", reference_command(dump, steps), out=out, nodes=p.nodes, attempts=1,
                    env=dict(demo.RUN_ENV), timeout_s=p.timeout_s, disks=None)
    rc = job.run(timeout=p.timeout_s + 30 * steps, log=bs._say("reference"))
    if rc != 0:
        raise RuntimeError(f"reference run exited {rc}\n{job.failure_text()}")
    recs = sorted(bs._read_steps(os.path.join(dump, "metrics", "losses.jsonl")), key=lambda r: r["step"])
    gaps = [b["time"] - a["time"] for a, b in zip(recs, recs[1:])
            if b["step"] == a["step"] + 1 and a["step"] > accounting.WARMUP_STEPS]
    if len(gaps) < 3:
        raise RuntimeError(f"reference run logged {len(recs)} steps; see {job.attempts[-1].logs}")
    return {"t_ref": statistics.median(gaps), "samples": len(gaps)}


def run_system(demo, out: str, system: System, plan: FailurePlan, p: RunParams, t_ref: float) -> dict:
    """Train ``p.steps`` steps of ``system`` under ``plan``'s failures; the analysed result.

    Returns:
        :func:`analyse`'s dict plus ``finished``, ``attempts``, ``fails`` and ``bookkeeping``
        (mismatches between the injected failures and the launcher's attempts; not empty =
        the run is invalid).
    Raises:
        RuntimeError: the launcher gave up or a failure was not ours (a rank died by itself).
    """
    lo = demo.local_launcher()
    dump, nvme = os.path.join(out, system.name), os.path.join(out, "nvme-" + system.name)
    job_id = "goodput-" + system.name
    disks = local_root(nvme, job_id) if system.kind == "tierckpt" else None
    shared = os.path.join(dump, "checkpoint")  # the persistent tier / torchtitan's folder
    os.makedirs(shared, exist_ok=True)
    env = {**demo.RUN_ENV, **throttle.env_for(shared, p.shared_bps, os.path.join(out, system.name + ".link"))}
    cap_s = p.cap * p.steps * t_ref
    launcher = _launcher(lo, system.name, command(system, dump=dump, nvme=nvme, job=job_id, steps=p.steps,
                                                     mtbf_s=plan.mtbf_s, ranks=p.nodes), out=out,
                         nodes=p.nodes, attempts=len(plan.due_times(cap_s)) + 2, env=env, timeout_s=p.timeout_s,
                         disks=disks)
    inj = WipingInjector(system.name, os.path.join(dump, "metrics", "losses.jsonl"), list(plan.gaps), t_ref=t_ref,
                         cap_s=cap_s, nodes=p.nodes, timeout_s=p.timeout_s, t_launch0=time.time(), local_root=disks)
    finished = False
    try:
        rc = launcher.run(monitor=inj, log=bs._say(system.name))
        if rc != 0:
            raise RuntimeError(f"{system.name}: the launcher gave up (exit {rc}) after {len(launcher.attempts)} "
                               f"attempts\n{launcher.failure_text()}")
        finished = True
    except bs.CapReached:
        pass
    problems = bs.reconcile_fails(inj.fails, launcher.attempts, finished)
    res = analyse(system, dump, inj.fails, t_ref, [a.logs for a in launcher.attempts])
    res.update(finished=finished, attempts=len(launcher.attempts), fails=inj.fails, bookkeeping=problems,
               link=throttle.SharedLink(os.path.join(out, system.name + ".link"), p.shared_bps).totals())
    return res


def save_steps_and_restores(system: System, dump: str, fails: list[dict], recs: list[dict],
                            attempt_logs: list[list[str]]) -> tuple[set, dict, dict]:
    """(steps a save started after, {attempt: restore s}, extra facts) of one run: from the
    ledger for tierckpt (checkpoint records; the ``recovery`` record's restore phase), from the
    schedule and torchtitan's logs for stock (``step % K == 0``; "Finished loading the
    checkpoint in X seconds", the slowest node)."""
    if system.kind == "tierckpt":
        records = Ledger.read(Store(os.path.join(dump, "checkpoint")))
        ckpts = [r for r in records if r.get("kind") == "checkpoint"]
        saves = {r["step"] for r in ckpts if isinstance(r.get("step"), int)}
        restores = {}
        for rec in bs.ledger_recoveries(records, fails):
            ph = (rec or {}).get("phases_s") or {}
            if rec and isinstance(ph.get("restore_done"), (int, float)) and isinstance(ph.get("model_built"),
                                                                                        (int, float)):
                restores[rec["attempt"]] = ph["restore_done"] - ph["model_built"]
        blocking = [r["blocking_s"] for r in ckpts if isinstance(r.get("blocking_s"), (int, float))]
        decisions = {r.get("tier"): r.get("tau_steps") for r in records if r.get("kind") == "schedule"}
        extra = {"checkpoints": {t: sum(1 for r in ckpts if r.get("tier") == t and r.get("ok"))
                                 for t in ("local", "persistent")},
                 "ledger_blocking_mean_s": statistics.fmean(blocking) if blocking else None,
                 "last_intervals": decisions}
        return saves, restores, extra
    saves = {r["step"] for r in recs if system.interval and r["step"] % system.interval == 0}
    restores = {}
    for k, logs in enumerate(attempt_logs):
        found = []
        for path in logs:
            try:
                with open(path, errors="replace") as f:
                    found += [float(x) for x in STOCK_RESTORE_RE.findall(f.read())]
            except FileNotFoundError:
                continue
        if found:
            restores[k] = max(found)
    folder = os.path.join(dump, "checkpoint")
    steps = [d for d in (os.listdir(folder) if os.path.isdir(folder) else [])
             if os.path.exists(os.path.join(folder, d, ".metadata"))]
    return saves, restores, {"checkpoints": {"persistent": len(steps)}}


def analyse(system: System, dump: str, fails: list[dict], t_ref: float, attempt_logs: list[list[str]]) -> dict:
    """One run's ETTR, waste buckets, quiet step time, the useful-steps curve and its facts."""
    recs = bs._read_steps(os.path.join(dump, "metrics", "losses.jsonl"))
    saves, restores, extra = save_steps_and_restores(system, dump, fails, recs, attempt_logs)
    # the run's own quiet step time, not the reference's: on this shared machine the load moves
    # by ±30 % between runs minutes apart (bench_schedule measures its waste the same way)
    quiet = accounting.quiet_step_s(recs, saves)
    t_step = quiet or t_ref
    acc = accounting.account(recs, fails, saves, t_step, restores)
    curve = accounting.useful_curve(recs, acc["t0"]) if acc["t0"] is not None else ([], [])
    return {"system": system.name, "kind": system.kind, "t_ref": t_ref, "t_step": t_step, **acc,
            "quiet_step_s": quiet, "saves": len(saves), "failures": len(fails),
            "curve": {"t": curve[0], "steps": curve[1]}, **extra}
