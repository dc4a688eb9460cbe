"""Rank functions of tests/test_hung_edges.py: the reads outside a restore's sources that a hung
file system (a FIFO in place of a file, or an open that never returns) must not hold forever —
the engine's start, a replicated value read from another rank's file, the persistent tier's
listing, the save-on-loader-death decision."""

from __future__ import annotations

import os
import pathlib
import threading
import time

import torch

from tests.scenarios import app_state, apply_state, assert_bitwise, build, make_config, snapshot, train_step
from tierckpt import TieredCheckpointer


def _facts(res) -> dict:
    return {"step": res.step,
            "sources": {n: (o.source.kind, o.source.holder) for n, o in res.sources.items()},
            "failures": [(f.node, f.source.kind, f.source.holder, f.step, f.error) for f in res.failures]}


def phase_start_and_restore(rank, world, base, cfg_kw):
    """Build the engine (timed) and restore into a fresh model: bitwise equal to the saved
    step-k snapshot. Returns the restore's facts, the constructor's and the restore's wall
    times; a restore that raises returns ``{"error": (type name, message)}`` instead."""
    t0 = time.monotonic()
    eng = TieredCheckpointer(make_config(base, **cfg_kw), node_id=rank)
    start = time.monotonic() - t0
    model, opt = build(seed=123)
    train_step(model, opt, 999, rank)  # every value differs from the saved one
    sd = app_state(model, opt)
    t0 = time.monotonic()
    try:
        res = eng.restore(sd)
    except Exception as e:  # noqa: BLE001 - the test checks which
        eng.close(clean=False, raise_failures=False)
        return {"error": (type(e).__name__, str(e)), "start": start, "wall": time.monotonic() - t0}
    wall = time.monotonic() - t0
    assert res is not None, "nothing restored"
    apply_state(model, opt, sd)
    ref = torch.load(os.path.join(base, "ref", f"rank{rank}.pt"), weights_only=False)
    assert_bitwise(snapshot(model, opt), ref["snap"])
    if eng.last_redundancy is not None:
        eng.last_redundancy.result(timeout=120)
    eng.close()
    return {**_facts(res), "start": start, "wall": wall}


def phase_restore_other_files_hang(rank, world, base, rpn, cfg_kw):
    """``rpn`` ranks per node; on node 1 every open of a file of its node-local root through
    ``pathlib.Path.open`` (what DCP's reader uses for a file not in memory: a replicated value
    DCP wrote into the other rank's file) never returns. Restores into the per-rank template;
    every rank must get its own values bitwise (tests/scenarios_per_rank.py). Returns the
    restore's facts and wall time."""
    from tests import scenarios_per_rank as sp

    eng = TieredCheckpointer(make_config(base, **cfg_kw), node_id=rank // rpn)
    if rank // rpn == 1:
        hung_dir = os.path.realpath(os.path.join(base, "nvme", "node-1")) + os.sep
        real_open = pathlib.Path.open

        def hanging_open(self, *a, **kw):
            if os.path.realpath(str(self)).startswith(hung_dir):
                threading.Event().wait()  # a disk that stopped answering
            return real_open(self, *a, **kw)

        pathlib.Path.open = hanging_open  # type: ignore[method-assign]
    sd = sp.template()
    t0 = time.monotonic()
    res = eng.restore(sd)
    wall = time.monotonic() - t0
    assert res is not None, "nothing restored"
    assert_bitwise(sd, sp.expected(rank), f"rank {rank}")
    eng.close()
    return {**_facts(res), "wall": wall}


def phase_loader_death(rank, world, base, cfg_kw, dead_ranks, step, api="titan", others="collective"):
    """The trainer's exception after a preemption notice: on ``dead_ranks`` the DataLoader's
    workers died on it while the rank fetched the batch of ``step + 1``. The other ranks
    (``others``): ``"collective"``: fetched their batch and are inside a training collective (an
    all-reduce of the default group, of ``rank + 1`` each) that the dead ranks join only after
    their decision; ``"error"``: failed otherwise at once (not a loader death). Every rank then
    decides: ``api`` ``"titan"``: torchtitan's ``TieredCheckpointManager.save_on_loader_death``;
    ``"engine"``: the engine API's recipe (``agree_loader_death``, then ``save_for_preemption``
    of the last finished step when it agreed). Returns ``(saved: whether a preemption save ran,
    seconds the decision took, the trainer's step afterwards, persistent steps, the training
    collective's sum or None)``."""
    import types

    import torch.distributed as dist

    from tierckpt.integration import agree_loader_death
    from titan_plugin.manager import TieredCheckpointManager

    eng = TieredCheckpointer(make_config(base, **cfg_kw), node_id=rank)
    model, opt = build(seed=0)
    for s in range(1, step + 1):
        train_step(model, opt, s, rank)
    manager = types.SimpleNamespace(engine=eng, _engine=eng, _states_to_save=lambda: app_state(model, opt))
    trainer = types.SimpleNamespace(step=step + 1)
    eng.preemption.received = "SIGTERM"  # the notice reached every rank

    def decide(exc: BaseException):
        if api == "titan":
            return TieredCheckpointManager.save_on_loader_death(manager, exc, trainer)
        sig = agree_loader_death(eng, exc, trainer.step - 1)
        if sig is None:
            return None
        trainer.step -= 1
        return eng.save_for_preemption(trainer.step, app_state(model, opt), sig)

    total = None
    if rank in dead_ranks:
        exc: BaseException = RuntimeError("DataLoader worker (pid(s) 4242) exited unexpectedly")
        t0 = time.monotonic()
        pre = decide(exc)
        took = time.monotonic() - t0
        if len(dead_ranks) < world and others == "collective":
            x = torch.tensor([float(rank + 1)])
            dist.all_reduce(x)  # only now: the others' collective completes (this rank gave the save up)
            total = x.item()
    elif others == "collective":
        x = torch.tensor([float(rank + 1)])
        dist.all_reduce(x)  # the training collective this rank was already in
        total = x.item()
        t0 = time.monotonic()
        pre = decide(RuntimeError("collective failed"))
        took = time.monotonic() - t0
    else:
        t0 = time.monotonic()
        pre = decide(RuntimeError("CUDA error: an illegal memory access was encountered"))
        took = time.monotonic() - t0
    eng.wait(bounded=False)
    steps = eng.persistent.committed_steps()
    eng.close(clean=False, raise_failures=False)
    return pre is not None, took, trainer.step, steps, total
