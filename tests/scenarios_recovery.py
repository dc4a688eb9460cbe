"""Rank functions of the recovery-timeline engine test (tests/test_engine_recovery.py)."""

from __future__ import annotations

import time

from tests.scenarios import app_state, apply_state, build, make_config, train_step
from tierckpt.engine import TieredCheckpointer
from tierckpt.recovery.timeline import mark_phase


def phase_save_then_fail(rank, world, base, k):
    """Train ``k`` steps reporting each to the engine (no restore: no recovery record and no
    collective), save every tier at step ``k``, wait for it, and end without a clean close
    (the failure)."""
    eng = TieredCheckpointer(make_config(base), node_id=rank)
    model, opt = build(seed=0)
    for s in range(1, k + 1):
        t = time.monotonic()
        train_step(model, opt, s, rank)
        eng.observe_step(time.monotonic() - t)
    eng.save(k, app_state(model, opt))
    eng.wait(bounded=False)
    eng.close(clean=False, reason="simulated failure")
    return eng._recovery.record


def phase_recover(rank, world, base, k):
    """The restarted attempt: stamp the trainer's phases as an adapter does, restore, run two
    steps with ``observe_step`` (the first writes the record, the second nothing)."""
    mark_phase("imports_done")
    mark_phase("process_group_up")  # the harness made the process group before calling us
    model, opt = build(seed=1)
    mark_phase("model_built")
    eng = TieredCheckpointer(make_config(base), node_id=rank)
    sd = app_state(model, opt)
    res = eng.restore(sd)
    assert res is not None and res.step == k
    apply_state(model, opt, sd)
    got = []
    for s in (k + 1, k + 2):
        t = time.monotonic()
        train_step(model, opt, s, rank)
        eng.observe_step(time.monotonic() - t)
        got.append(eng._recovery.record)
    eng.close()
    assert got[0] is not None and got[1] is got[0], "one record, at the first step after the restore"
    return got[0].as_ledger()
