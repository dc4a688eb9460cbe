"""Fault point ``exit-without-close`` of the fault campaign (bench/fault_campaign.py): the
trainer leaves right after a save without ``close()`` (tierckpt/exit.py).

The faulty run cannot use the campaign's forkserver ranks, whose entry point catches every
exception and ends with ``os._exit`` (it would mask the interpreter exit under test): each
rank here is its own ``python -m bench.campaign_exit BASE`` process (torchrun's environment,
gloo initialised by the script) that trains, saves the local tier at every step (and the
persistent tier at the plan's steps), waits for every save but the last, and then, right
after ``save(step)``:

- ``return``: main returns; ``sys_exit``: ``sys.exit(0)``; ``raise``: every rank raises;
- ``raise-one``: rank ``victim`` raises, the others train on (their next collective fails
  once the victim's process is gone, and they raise too).

Invariants (besides the campaign's restore checks on the restart that follows):

- every rank exits with the script's own status (0, or 1 for an uncaught exception), within
  the bound; no SIGABRT, no "terminate called" in its output;
- the ledger has the run's ``run_end`` with ``exit = "without close()"``; ``clean`` exactly
  when no rank 0 exception ended the run, nothing was left unfinished and a persistent step was
  committed (the engine's rule for any run that saved);
- the last step is committed in every tier it was saved to (the local step on every node,
  its replicas, the persistent step) or named in ``run_end.unfinished``; and when committed
  it is the step the restart must restore (checked against the files, independently of the
  planner).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

HOWS = ("return", "sys_exit", "raise", "raise-one")


def plan_exit(plan, rng: random.Random, steps: int) -> None:
    """Draw the fault of an ``exit-without-close`` trial into ``plan`` (a
    :class:`bench.fault_campaign.Plan`): how, at which step, the victim of ``raise-one``."""
    how = rng.choice(HOWS)
    plan.fault.update(how=how, step=rng.randint(2, steps))
    if how == "raise-one":
        plan.fault["victim"] = f"r{rng.randrange(plan.nodes)}"
    plan.script = ["train", "restore"]  # its "train" runs run_exit_phase (bench/fault_campaign.py: run_trial)


def expected_status(how: str) -> int:
    """Exit status every rank must have (a ``raise-one`` survivor raises on its failed collective)."""
    return 0 if how in ("return", "sys_exit") else 1


# -- the rank process ----------------------------------------------------------------------------
def rank_main(base: str) -> None:
    """One rank of the faulty run (see the module docstring); the plan is ``BASE/plan.json``."""
    import logging

    import torch
    import torch.distributed as dist

    from bench import fault_campaign as fc
    from tests import scenarios
    from tierckpt.engine import TieredCheckpointer

    plan = json.loads(Path(base, "plan.json").read_text())
    f, rank = plan["fault"], int(os.environ["RANK"])
    logging.basicConfig(level=logging.WARNING, format=f"[rank{rank}] %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    eng = TieredCheckpointer(fc._config(base, plan), node_id=rank)
    model, opt = scenarios.build(seed=0)
    os.makedirs(os.path.join(base, "snaps"), exist_ok=True)
    for s in range(1, f["step"] + 1):
        scenarios.train_step(model, opt, s, rank)
        torch.save(scenarios.snapshot(model, opt), fc._snap_path(base, rank, s))
        eng.save(s, scenarios.app_state(model, opt),
                 tiers=["local"] + (["persistent"] if s in plan["persistent_steps"] else []))
        if s < f["step"]:
            eng.wait()
    # the instant: the last save runs in the background, and the trainer leaves without close()
    victim = f.get("victim") in (None, f"r{rank}")
    fired = os.path.join(base, "fired", f"train-exit-without-close-r{rank}.json")
    os.makedirs(os.path.dirname(fired), exist_ok=True)
    Path(fired).write_text(json.dumps({"rank": rank, "phase": "train", "time": time.time(),
                                       "what": f"{f['how'] if victim else 'trains on'} right after save({f['step']})"}))
    if f["how"] == "return":
        return
    if f["how"] == "sys_exit":
        sys.exit(0)
    if victim:
        raise RuntimeError(f"injected: the trainer raised on rank {rank} right after save({f['step']})")
    for s in range(f["step"] + 1, f["step"] + 20):  # until the gone victim fails a collective
        scenarios.train_step(model, opt, s, rank)
    raise AssertionError("trained on although a peer's process is gone")


# -- the driver side -----------------------------------------------------------------------------
def run_exit_phase(plan, base: str, bound: float) -> list[str]:
    """Run the faulty run of an ``exit-without-close`` trial on ``plan.nodes`` processes and
    check its invariants; returns the violations."""
    from bench import campaign_checks as checks
    from bench import fault_campaign as fc

    f = plan.fault
    Path(base, "plan.json").write_text(json.dumps(fc.asdict(plan)))
    os.makedirs(os.path.join(base, "logs"), exist_ok=True)
    lines_before = checks.ledger_lines(base)
    port = fc._free_port()
    procs, logs = [], []
    for r in range(plan.nodes):
        env = {**os.environ, "PYTHONPATH": str(REPO), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(plan.nodes), "OMP_NUM_THREADS": "1"}
        log = open(os.path.join(base, "logs", f"train-exit-r{r}.log"), "w")
        logs.append(log)
        procs.append(subprocess.Popen([sys.executable, "-m", "bench.campaign_exit", base], cwd=str(REPO), env=env,
                                      stdout=log, stderr=subprocess.STDOUT))
    out: list[str] = []
    # the exit is bounded from the instant (every rank reached it); fresh processes importing
    # torch on a loaded machine take long to get there, which is not the exit's doing
    fired = Path(base, "fired")
    start, at = time.monotonic(), None
    while any(p.poll() is None for p in procs):
        now = time.monotonic()
        if at is None and fired.is_dir() and len(list(fired.glob("train-exit-without-close-r*.json"))) >= plan.nodes:
            at = now
        if (at is not None and now - at > bound) or now - start > 4 * bound:
            out += [f"hang: rank {r} did not exit within {bound:g} s of the instant" if at is not None else
                    f"hang: rank {r} neither reached the instant nor exited within {4 * bound:g} s"
                    for r, p in enumerate(procs) if p.poll() is None]
            break
        time.sleep(0.2)
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
            p.wait()
    for log in logs:
        log.close()
    want = expected_status(f["how"])
    for r, p in enumerate(procs):
        text = Path(base, "logs", f"train-exit-r{r}.log").read_text(errors="replace")
        if p.returncode == -signal.SIGABRT or "terminate called" in text:
            out.append(f"rank {r}: SIGABRT at exit (status {p.returncode}): {text[-300:]!r}")
        elif p.returncode != want and p.returncode != -signal.SIGKILL:
            out.append(f"rank {r}: exit status {p.returncode}, the script's own is {want}: {text[-300:]!r}")
    after = checks.scan_disk(base)
    out += fc._common_disk_checks(base, after)
    records = checks.ledger_records(base, lines_before)
    out += checks.check_ok_records_on_disk(records, after, plan.keep_persistent)
    ends = [x for x in records if x.get("kind") == "run_end"]
    if len(ends) != 1:
        return out + [f"ledger: {len(ends)} run_end records after an exit without close() (want 1)"]
    end = ends[0]
    unfinished = {u.get("tier") for u in end.get("unfinished", []) if u.get("step") == f["step"]}
    if end.get("exit") != "without close()":
        out.append(f"ledger: run_end.exit = {end.get('exit')!r}, want 'without close()'")
    rank0_raised = f["how"] == "raise" or f["how"] == "raise-one"  # a survivor raises on its failed collective
    # the engine's own rule too: a run that saved is clean only with a durable (persistent) step
    durable = any(s <= f["step"] for s in plan.persistent_steps)
    if end.get("clean") is not (not rank0_raised and not unfinished and durable):
        out.append(f"ledger: run_end.clean = {end.get('clean')} after {f['how']} (unfinished: {sorted(unfinished)})")
    step = f["step"]
    tiers = ["local"] + (["persistent"] if step in plan.persistent_steps else [])
    for tier in tiers:
        if tier in unfinished:
            continue
        if tier == "persistent" and not any(c.where == "pfs" and c.committed and c.step == step for c in after):
            out.append(f"step {step}: the persistent step is neither committed nor named unfinished in run_end")
        if tier == "local":
            for n in range(plan.nodes):
                copies = {c.holder for c in after if c.where != "pfs" and c.node == n and c.step == step
                          and c.committed and c.intact}
                if len(copies) < plan.factor:
                    out.append(f"step {step}: node {n}'s state has {len(copies)} committed node-local copies "
                               f"(F = {plan.factor}) and run_end names no unfinished local save")
    if "local" not in unfinished and checks.expected_step(after, plan.nodes) != step:
        out.append(f"the restart's expected step is {checks.expected_step(after, plan.nodes)}, not the last saved "
                   f"step {step}")
    return out


if __name__ == "__main__":
    rank_main(sys.argv[1])
