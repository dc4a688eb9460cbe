"""One rank of tests/test_exit.py, run as its own process (``python -m tests.exit_script BASE
MODE``, torchrun's environment): train, save steps 20 (waited for) and 30 through the engine,
then leave *without* ``close()`` through the interpreter's normal exit. MODE: ``return`` (main
returns), ``raise`` (an uncaught exception on every rank), ``sys_exit`` (``sys.exit(0)``),
``sys_exit_3`` (``sys.exit(3)``: an error status),
``raise_one`` (rank 1 raises; rank 0 trains on, so its next collective fails once rank 1's
process is gone), ``hung_persistent`` (returns while the persistent write of step 30 hangs for
good: ``exit_timeout_s`` = 5 s gives up on it), ``hung_rebuild`` (restores step 20 with each node's
replica on its peer deleted, so a replica rebuild is queued on the local lane, and it hangs for
good; with ``local_wait_timeout_s = 0`` the local save of step 30 is queued behind it; the
persistent save of step 30 is waited for, then main returns). The step-30 state of each rank is written to
``BASE/ref/rank<r>.pt`` before the exit; :func:`phase_restore` (run through
tests.harness.run_world) restores it from each source kind and compares bitwise.
"""

from __future__ import annotations

import logging
import os
import sys
import time

import torch
import torch.distributed as dist

from tests import scenarios
from tierckpt.engine import TieredCheckpointer

MODES = ("return", "raise", "sys_exit", "sys_exit_3", "raise_one", "hung_persistent", "hung_rebuild")


def main() -> None:
    base, mode = sys.argv[1], sys.argv[2]
    assert mode in MODES, mode
    rank = int(os.environ["RANK"])
    logging.basicConfig(level=logging.INFO, format=f"[rank{rank}] %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    # the default exit_timeout_s (600 s) but where the test wants the exit to give up
    cfg = scenarios.make_config(base, **({"exit_timeout_s": 5.0} if mode == "hung_persistent" else
                                         {"exit_timeout_s": 5.0, "local_wait_timeout_s": 0.0} if mode == "hung_rebuild"
                                         else {}))
    eng = TieredCheckpointer(cfg, node_id=rank)
    model, opt = scenarios.build(seed=0)
    for s in range(1, 31):
        scenarios.train_step(model, opt, s, rank)
        if s == 20:
            eng.save(20, scenarios.app_state(model, opt))
            eng.wait(bounded=False)  # step 20 committed everywhere: the old code's resume point
            if mode == "hung_rebuild":
                _restore_with_a_hung_rebuild(eng, base, rank, model, opt)
    if mode == "hung_persistent":  # a shared file system that never answers again
        from tierckpt.tiers.persistent import PersistentTier

        PersistentTier.save = lambda *a, **kw: time.sleep(3600)  # type: ignore[method-assign]
    eng.save(30, scenarios.app_state(model, opt))
    if mode == "hung_rebuild":  # only the local lane is left running at the exit
        eng.wait(("persistent",), bounded=False)
    os.makedirs(os.path.join(base, "ref"), exist_ok=True)
    torch.save({"snap": scenarios.snapshot(model, opt)}, os.path.join(base, "ref", f"rank{rank}.pt"))
    # no close(): the save of step 30 is still running on the tier workers
    if mode in ("return", "hung_persistent", "hung_rebuild"):
        return
    if mode == "sys_exit":
        sys.exit(0)
    if mode == "sys_exit_3":
        sys.exit(3)
    if mode == "raise" or rank == 1:
        raise RuntimeError(f"trainer failed on rank {rank} after save(30)")
    for s in range(31, 41):  # raise_one, rank 0: trains on until the gone peer fails a collective
        scenarios.train_step(model, opt, s, rank)


def _restore_with_a_hung_rebuild(eng, base: str, rank: int, model, opt) -> None:
    """Delete this node's copy of its peer's step 20, restore step 20 (from each node's own
    copy) and let the replica rebuild that follows hang for good on the local lane."""
    import shutil
    import threading

    from tierckpt.restore import redundancy

    shutil.rmtree(os.path.join(base, "nvme", f"node-{rank}", "replicas", f"node-{1 - rank}", "step-20"))
    dist.barrier()
    replicate = redundancy.replicate

    def hanging(*a, **kw):
        if "pairs" in kw:  # the rebuild's copies (a save's replication names no pairs)
            threading.Event().wait()
        return replicate(*a, **kw)

    redundancy.replicate = hanging  # type: ignore[assignment]  # the rebuild job's (restore/redundancy.py)
    sd = scenarios.app_state(model, opt)
    res = eng.restore(sd)
    assert res is not None and res.step == 20, res
    scenarios.apply_state(model, opt, sd)
    assert eng.last_redundancy is not None  # the rebuild is queued on the local lane


def phase_restore(rank, world, base, kinds=("own-local", "peer-replica", "persistent")):
    """Restore step 30 from each source kind (own-local, peer-replica, persistent) into a
    fresh model, bitwise equal to the saved state each time; then the default restore.
    Returns ``{"by_kind": {kind: (step, [source kinds])}, "default": step}``."""
    eng = TieredCheckpointer(scenarios.make_config(base), node_id=rank)
    ref = torch.load(os.path.join(base, "ref", f"rank{rank}.pt"), weights_only=False)["snap"]
    out = {}
    for kind in kinds:
        model, opt = scenarios.build(seed=123)
        scenarios.train_step(model, opt, 999, rank)  # the fresh state differs everywhere
        sd = scenarios.app_state(model, opt)
        res = eng.restore(sd, step=30, sources=(kind,))
        assert res is not None, kind
        scenarios.apply_state(model, opt, sd)
        scenarios.assert_bitwise(scenarios.snapshot(model, opt), ref, kind)
        out[kind] = (res.step, sorted({o.source.kind for o in res.sources.values()}))
        eng.wait(bounded=False)  # the replica rebuild after each restore
    model, opt = scenarios.build(seed=123)
    sd = scenarios.app_state(model, opt)
    res = eng.restore(sd)
    scenarios.apply_state(model, opt, sd)
    scenarios.assert_bitwise(scenarios.snapshot(model, opt), ref, "default")
    eng.close()
    return {"by_kind": out, "default": None if res is None else res.step}


if __name__ == "__main__":
    main()
