"""Rank functions of tests/test_engine_defer.py: a tier due while its previous save still runs
(``busy_tier_policy``), 2 nodes × 1 rank, FSDP2 + AdamW (tests/scenarios.py).

A slow write is a sleep injected into the tier's save on every rank (persistent) or on node 1
only (local); the tests bound blocking times against that sleep, never against a clock.
"""

from __future__ import annotations

import time

import torch.distributed as dist

from tests.scenarios import app_state, apply_state, assert_bitwise, build, make_config, snapshot, train_step
from tierckpt.engine import TieredCheckpointer
from tierckpt.staging.pool import StagingSlot
from tierckpt.tiers.local_tier import LocalTier
from tierckpt.tiers.persistent import PersistentTier

STEP_S = 0.05  # each training step sleeps this long, so a slow save spans many steps


def _slow(cls, slow_step: int, delay: float, only_rank: int | None, rank: int):
    """Make ``cls.save`` sleep ``delay`` seconds before writing ``slow_step``; returns the
    original for the caller to put back."""
    original = cls.save

    def slow(self, staged, step, *a, **kw):
        if step == slow_step and (only_rank is None or rank == only_rank):
            time.sleep(delay)
        return original(self, staged, step, *a, **kw)

    cls.save = slow
    return original


def _everyone(x, world):
    out = [None] * world
    dist.all_gather_object(out, x)
    return out


def phase_defer_with_due(rank, world, base, tier, delay, interval, max_steps):
    """``tier`` alone, fixed ``interval`` through ``due()``. Its save of step ``interval`` is
    slow; the save due at ``2*interval`` must be deferred without waiting; ``due()`` must
    bring the tier back at the first step at which the slow job finished on every rank; the
    step saved then restores bitwise. Returns what happened, gathered from every rank."""
    cls = PersistentTier if tier == "persistent" else LocalTier
    original = _slow(cls, interval, delay, None if tier == "persistent" else 1, rank)
    cfg = make_config(base, tiers=(tier,), intervals={tier: interval}, busy_tier_policy="defer")
    eng = TieredCheckpointer(cfg, node_id=rank)
    model, opt = build(seed=0)
    slow_job, deferred_handle, retry_step, snap = None, None, None, None
    due_steps, busy_before, busy_after = [], {}, {}
    for s in range(1, max_steps + 1):
        train_step(model, opt, s, rank)
        time.sleep(STEP_S)
        if slow_job is not None:  # sampled before due()'s poll (done only ever turns true)
            busy_before[s] = not slow_job.done()
        tiers = eng.due(s)
        if slow_job is not None:  # and after it
            busy_after[s] = not slow_job.done()
        if not tiers:
            continue
        due_steps.append(s)
        h = eng.save(s, app_state(model, opt), tiers=tiers)
        if s == interval:
            slow_job = h.futures[tier]
        elif deferred_handle is None:
            deferred_handle = h
        else:
            retry_step, snap = s, snapshot(model, opt)
            break
    eng.wait(bounded=False)
    m2, o2 = build(seed=7)
    sd = app_state(m2, o2)
    res = eng.restore(sd, step=retry_step)
    apply_state(m2, o2, sd)
    assert_bitwise(snapshot(m2, o2), snap)
    rec = deferred_handle.skipped.get(tier)
    history = [(h.tier, h.step, h.ok, h.deferred) for h in eng.history]
    eng.close()
    cls.save = original
    return {"due_steps": due_steps, "retry_step": retry_step, "restored": res.step,
            "deferred": None if rec is None else {"step": rec.step, "running_step": rec.running_step,
                                                  "deferred": rec.deferred, "skipped": rec.skipped, "ok": rec.ok},
            "deferred_blocking_s": deferred_handle.blocking_s, "started": list(deferred_handle.futures),
            "history": history, "busy_before": _everyone(busy_before, world),
            "busy_after": _everyone(busy_after, world)}


def phase_policy(rank, world, base, policy, delay, wait_previous):
    """Persistent tier only, no intervals: a slow save of step 2, then a save of step 4 at once
    under ``policy`` (and ``wait_previous``). Returns its blocking time and outcomes."""
    original = _slow(PersistentTier, 2, delay, None, rank)
    eng = TieredCheckpointer(make_config(base, tiers=("persistent",), busy_tier_policy=policy), node_id=rank)
    model, opt = build(seed=0)
    train_step(model, opt, 2, rank)
    eng.save(2, app_state(model, opt))
    train_step(model, opt, 4, rank)
    staged = []  # state copies made by the save of step 4 (a deferred save needs none)
    stage = StagingSlot.stage

    def counting(self, *a, **kw):
        staged.append(1)
        return stage(self, *a, **kw)

    StagingSlot.stage = counting
    try:
        h = eng.save(4, app_state(model, opt), wait_previous=wait_previous)
    finally:
        StagingSlot.stage = stage
    snap = snapshot(model, opt)
    recs = {t: r.ok for t, r in h.wait().items()}
    eng.wait()
    out = {"blocking_s": h.blocking_s, "started": list(h.futures), "outcome": recs, "copies": len(staged),
           "deferred": {t: (r.deferred, r.running_step) for t, r in h.skipped.items()},
           "committed": eng.persistent_steps()}
    if 4 in out["committed"]:
        m2, o2 = build(seed=7)
        sd = app_state(m2, o2)
        assert eng.restore(sd, step=4).step == 4
        apply_state(m2, o2, sd)
        assert_bitwise(snapshot(m2, o2), snap)
    eng.close()
    PersistentTier.save = original
    return out


def phase_preemption_after_defer(rank, world, base, delay):
    """A slow persistent save of step 2; step 3's save is deferred; a preemption notice at
    step 3 must wait for step 2 and commit step 3 on the persistent tier."""
    original = _slow(PersistentTier, 2, delay, None, rank)
    cfg = make_config(base, tiers=("persistent",), busy_tier_policy="defer", preemption_grace_s=120.0)
    eng = TieredCheckpointer(cfg, node_id=rank)
    model, opt = build(seed=0)
    train_step(model, opt, 2, rank)
    eng.save(2, app_state(model, opt))
    train_step(model, opt, 3, rank)
    h = eng.save(3, app_state(model, opt))
    deferred = "persistent" in h.skipped and h.skipped["persistent"].deferred
    snap = snapshot(model, opt)
    pre = eng.save_for_preemption(3, app_state(model, opt), "SIGTERM", handle=h)
    committed = eng.persistent_steps()
    m2, o2 = build(seed=7)
    sd = app_state(m2, o2)
    assert eng.restore(sd).step == 3
    apply_state(m2, o2, sd)
    assert_bitwise(snapshot(m2, o2), snap)
    eng.close()
    PersistentTier.save = original
    return {"deferred_first": deferred, "preempted_committed": pre.committed, "committed": committed}
