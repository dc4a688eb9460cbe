"""Rank functions for overlapped CPU staging (``cpu_staging = "overlapped"``,
tierckpt/staging/overlap.py), run through tests.harness.run_world."""

from __future__ import annotations

import threading

import torch
from torch.optim.optimizer import _global_optimizer_pre_hooks

from tests.scenarios import app_state, apply_state, assert_bitwise, build, make_config, snapshot, train_step
from tierckpt.engine import TieredCheckpointer
from tierckpt.staging import overlap, pool as staging


def _pendings(eng):
    return [s._pending for s in eng.pool._slots if s._pending is not None]


def _gated_copies():
    """Replace the copy thread's run with one that waits for the Event the next save sets up;
    returns (arm, restore): ``arm()`` gives the Event the next queued copy waits for."""
    gates: list[threading.Event | None] = [None]
    run = overlap.PendingCopy.run

    def gated(self):
        gate = gates[0]
        if gate is not None:
            gate.wait(60)
        run(self)

    def arm() -> threading.Event:
        gates[0] = threading.Event()
        return gates[0]

    def restore():
        gates[0] = None
        overlap.PendingCopy.run = run

    overlap.PendingCopy.run = gated
    return arm, restore


def _restart(base, cfg_kw, rank, expected):
    """A fresh engine and model (other seed, one step trained) restore; the state must equal
    ``expected`` bitwise. Returns (engine, RestoreResult); the caller closes the engine."""
    eng = TieredCheckpointer(make_config(base, **cfg_kw), node_id=rank)
    model, opt = build(seed=123)
    train_step(model, opt, 999, rank)
    sd = app_state(model, opt)
    res = eng.restore(sd)
    apply_state(model, opt, sd)
    assert_bitwise(snapshot(model, opt), expected)
    return eng, res


def phase_overlapped_training(rank, world, base, racing_step):
    """Train and save every step with overlapped staging (every tensor deferred: the test
    model's tensors are all below the 64 KiB default), the optimizer step waiting through the
    global hook; the copy of the step before ``racing_step`` is held until the trainer has
    waited 0.4 s for it (that wait is part of the next save's δ); at ``racing_step`` the copy is
    held while the trainer writes the parameters in place right after ``save()`` without
    waiting. Then a fresh engine restores. Returns what the test asserts."""
    staging.OVERLAP_MIN_BYTES = 0
    cfg_kw = dict(cpu_staging="overlapped", warn_only=("local", "persistent"))
    eng = TieredCheckpointer(make_config(base, **cfg_kw), node_id=rank)
    model, opt = build(seed=0)
    snaps, deferred, sealed_by_optimizer = {}, [], []
    arm, restore_copies = _gated_copies()
    for s in range(1, racing_step):
        train_step(model, opt, s, rank)
        sealed_by_optimizer.append(all(p.sealed for p in _pendings(eng)))
        gate = arm() if s == racing_step - 1 else None
        eng.save(s, app_state(model, opt))
        snaps[s] = snapshot(model, opt)  # reads only: the copy may still run
        deferred.append(sum(p.nbytes for p in _pendings(eng) if not p.sealed))
    threading.Timer(0.4, gate.set).start()
    waited = eng.wait_for_staging()
    eng.wait()

    # the race: the copy is held, the trainer writes before it (no wait_for_staging)
    train_step(model, opt, racing_step, rank)
    gate = arm()
    h = eng.save(racing_step, app_state(model, opt))
    copied_at_return = all(s.copied() for s in eng.pool._slots)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1000.0)
    gate.set()
    eng.wait()
    restore_copies()
    racing = {t: (f.result().ok, f.result().error) for t, f in h.futures.items()}
    booked = (h.blocking_s, waited, [f.result().blocking_s for f in h.futures.values()])
    eng.close()
    hooks_after_close = len(_global_optimizer_pre_hooks)

    eng, res = _restart(base, cfg_kw, rank, snaps[racing_step - 1])
    committed = eng.committed_steps()
    eng.close()
    return {"restored": res.step, "kind": {n: o.source.kind for n, o in res.sources.items()},
            "deferred": deferred, "sealed_by_optimizer": sealed_by_optimizer,
            "copied_at_return": copied_at_return, "racing": racing, "committed": committed,
            "hooks_after_close": hooks_after_close, "booked": booked}


def phase_one_rank_races(rank, world, base):
    """Steps 1–3 saved on both tiers with overlapped staging; at step 4 only rank 1 writes a
    parameter in place before its held copy ran. Rank 1's check fails in agreed phases, so no
    collective is skipped on any rank: the persistent step fails everywhere, node 1's local
    step fails, node 0's commits (the agreed local record is a failure: not every node holds
    step 4). The restart restores step 3 (the newest step every node
    holds) bitwise. Returns what the test asserts."""
    staging.OVERLAP_MIN_BYTES = 0
    cfg_kw = dict(cpu_staging="overlapped", warn_only=("local", "persistent"))
    eng = TieredCheckpointer(make_config(base, **cfg_kw), node_id=rank)
    model, opt = build(seed=0)
    snaps = {}
    for s in range(1, 4):
        train_step(model, opt, s, rank)
        eng.save(s, app_state(model, opt))
        snaps[s] = snapshot(model, opt)
    train_step(model, opt, 4, rank)
    arm, restore_copies = _gated_copies()
    gate = arm()
    h = eng.save(4, app_state(model, opt))
    if rank == 1:
        with torch.no_grad():
            next(model.parameters()).add_(1.0)
    gate.set()
    eng.wait()
    restore_copies()
    outcome = {t: f.result().ok for t, f in h.futures.items()}
    committed = eng.committed_steps()
    eng.close()
    eng, res = _restart(base, cfg_kw, rank, snaps[3])
    eng.close()
    return {"outcome": outcome, "committed": committed, "restored": res.step}
