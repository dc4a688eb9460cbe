"""The collector is kept out of the stall and the restore (tierckpt/gcpause.py): automatic
garbage collection is off inside ``save()`` (except a planned exit's) and ``restore()``, back
on afterwards, and a collector the user turned off stays off."""

from __future__ import annotations

import gc

import torch

from tests import scenarios
from tests.harness import run_world
from tierckpt.gcpause import collector_paused


def test_collector_paused_restores_the_previous_state_and_nests():
    assert gc.isenabled()
    with collector_paused():
        assert not gc.isenabled()
        with collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the inner block found it off: leaves it off
    assert gc.isenabled()
    gc.disable()
    try:
        with collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the user's choice stands
    finally:
        gc.enable()


def phase_collector_states(rank, world, base):
    """What ``gc.isenabled()`` says inside a save's staging, a planned exit's staging and a
    restore's load, and after each; then the same with the collector off (the user's)."""
    from tierckpt.engine import TieredCheckpointer
    from tierckpt.restore import restorer

    seen: list[tuple[str, bool]] = []
    eng = TieredCheckpointer(scenarios.make_config(base, tiers=("local",), replication_factor=1), node_id=rank)
    stage, early, load = eng.pool.stage, eng.pool.stage_early, restorer.load_dir

    def staging(*a, **kw):
        seen.append(("stage", gc.isenabled()))
        return stage(*a, **kw)

    def staging_early(*a, **kw):
        seen.append(("stage", gc.isenabled()))
        return early(*a, **kw)

    def loading(*a, **kw):
        seen.append(("load", gc.isenabled()))
        return load(*a, **kw)

    eng.pool.stage, eng.pool.stage_early = staging, staging_early  # type: ignore[method-assign]
    restorer.load_dir = loading
    sd = {"w": torch.arange(1000.0)}
    for user_off in (False, True):
        if user_off:
            gc.disable()
        eng.save(1 + 10 * user_off, sd).wait()
        seen.append(("after save", gc.isenabled()))
        eng.save(2 + 10 * user_off, sd, wait_previous=True).wait()
        seen.append(("after exit save", gc.isenabled()))
        sd["w"].zero_()
        res = eng.restore(sd)
        seen.append(("after restore", gc.isenabled()))
        assert res is not None and res.step == 2 + 10 * user_off and torch.equal(sd["w"], torch.arange(1000.0))
    gc.enable()
    eng.close()
    return seen


def test_save_and_restore_run_without_the_collector(tmp_path):
    seen = run_world(phase_collector_states, 1, str(tmp_path))[0].value
    assert seen == [("stage", False), ("after save", True), ("stage", True), ("after exit save", True),
                    ("load", False), ("after restore", True),
                    ("stage", False), ("after save", False), ("stage", False), ("after exit save", False),
                    ("load", False), ("after restore", False)], seen
