"""Rank functions of tests/test_clock.py: a run whose host wall clock steps forward by a day
inside it (after its ``run_start``, before its restore, saves and steps)."""

from __future__ import annotations

import time

from tests.scenarios import app_state, apply_state, build, make_config, train_step
from tierckpt import clock
from tierckpt.engine import TieredCheckpointer


def phase_save_then_crash(rank, world, base, steps):
    """Train and save every step on every tier; end with ``close(clean=False)``: for the MTBF's
    evidence the run failed."""
    eng = TieredCheckpointer(make_config(base), node_id=rank)
    model, opt = build(seed=0)
    for s in range(1, steps + 1):
        train_step(model, opt, s, rank)
        eng.save(s, app_state(model, opt))
    eng.wait()
    eng.close(clean=False, reason="crash")
    return steps


def phase_restore_with_jump(rank, world, base, jump_s, steps):
    """Start a run, step the wall clock ``jump_s`` forward (``time.time`` of this process), then
    restore, train ``steps`` steps with ``observe_step``, save and close cleanly."""
    eng = TieredCheckpointer(make_config(base), node_id=rank)
    real = time.time
    time.time = lambda: real() + jump_s  # every later wall-clock reading of this process
    try:
        model, opt = build(seed=1)
        sd = app_state(model, opt)
        res = eng.restore(sd)
        apply_state(model, opt, sd)
        t_prev = time.perf_counter()
        for s in range(res.step + 1, res.step + 1 + steps):
            train_step(model, opt, s, rank)
            eng.observe_step(time.perf_counter() - t_prev)
            t_prev = time.perf_counter()
        eng.save(res.step + steps, app_state(model, opt))
        eng.close()
        return {"step": res.step, "jump": clock.wall_jump_s()}
    finally:
        time.time = real
