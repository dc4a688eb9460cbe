"""Rank functions for overlapped CPU staging (``cpu_staging = "overlapped"``,
tierckpt/io/overlap.py), run through tests.harness.run_world."""

from __future__ import annotations

import time

import torch
from torch.optim.optimizer import _global_optimizer_pre_hooks

from tests.scenarios import app_state, apply_state, assert_bitwise, build, make_config, snapshot, train_step
from tierckpt.engine import TieredCheckpointer
from tierckpt.io import overlap, staging


def _pendings(eng):
    return [s._pending for s in eng.pool._slots if s._pending is not None]


def phase_overlapped_training(rank, world, base, racing_step):
    """Train and save every step with overlapped staging (every tensor deferred: the test
    model's tensors are all below the 64 KiB default), the optimizer step waiting through the
    global hook; the copy of the step before ``racing_step`` is slow and waited for (that wait
    is part of the next save's δ); at ``racing_step`` the copy thread is held back and the
    trainer writes the parameters in place right after ``save()`` without waiting. Then a
    fresh engine restores.
    Returns what the test asserts."""
    staging.OVERLAP_MIN_BYTES = 0
    cfg_kw = dict(cpu_staging="overlapped", warn_only=("local", "persistent"))
    eng = TieredCheckpointer(make_config(base, **cfg_kw), node_id=rank)
    model, opt = build(seed=0)
    snaps, deferred, sealed_by_optimizer = {}, [], []
    run = overlap.PendingCopy.run

    def late(self):
        time.sleep(0.5)
        run(self)

    for s in range(1, racing_step):
        train_step(model, opt, s, rank)
        sealed_by_optimizer.append(all(p.sealed for p in _pendings(eng)))
        if s == racing_step - 1:  # a slow copy: the trainer's wait for it is booked into the next δ
            overlap.PendingCopy.run = late
        eng.save(s, app_state(model, opt))
        snaps[s] = snapshot(model, opt)  # reads only: the copy may still run
        deferred.append(sum(p.nbytes for p in _pendings(eng) if not p.sealed))
    waited = eng.wait_for_staging()
    eng.wait()

    # the race: the copy starts late, the trainer writes before it (no wait_for_staging)
    train_step(model, opt, racing_step, rank)
    t0 = time.perf_counter()
    h = eng.save(racing_step, app_state(model, opt))
    save_s = time.perf_counter() - t0
    copied_at_return = all(s.copied() for s in eng.pool._slots)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1000.0)
    eng.wait()
    overlap.PendingCopy.run = run
    racing = {t: (f.result().ok, f.result().error) for t, f in h.futures.items()}
    booked = (h.blocking_s, waited, [f.result().blocking_s for f in h.futures.values()])
    eng.close()
    hooks_after_close = len(_global_optimizer_pre_hooks)

    eng = TieredCheckpointer(make_config(base, **cfg_kw), node_id=rank)
    model, opt = build(seed=123)
    train_step(model, opt, 999, rank)
    sd = app_state(model, opt)
    res = eng.restore(sd)
    apply_state(model, opt, sd)
    assert_bitwise(snapshot(model, opt), snaps[racing_step - 1])
    committed = eng.committed_steps()
    eng.close()
    return {"restored": res.step, "kind": {n: o.source.kind for n, o in res.sources.items()},
            "deferred": deferred, "sealed_by_optimizer": sealed_by_optimizer, "save_s": save_s,
            "copied_at_return": copied_at_return, "racing": racing, "committed": committed,
            "hooks_after_close": hooks_after_close, "booked": booked}
