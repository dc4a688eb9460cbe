"""close() joins the engine's gloo threads (tierckpt/cluster/topology.py: release_groups): a gloo
thread that outlives close() may free a collective's tensors while the interpreter finalises and
abort the process (SIGABRT, "terminate called without an active exception") after every save
committed. Counted as this process's OS threads named by gloo (Linux ``/proc/self/task/*/comm``)."""

from __future__ import annotations

import gc
import os

import pytest
import torch.distributed as dist

from tests import scenarios
from tests.harness import run_world
from tierckpt.engine import TieredCheckpointer


def _threads() -> int:
    """This process's gloo threads (torch 2.15 also starts autograd threads lazily: not counted)."""
    return sum(n.startswith(("gloo", "pt_gloo")) for n in _names())


def _names() -> list[str]:
    out = []
    for t in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{t}/comm") as f:
                out.append(f.read().strip())
        except OSError:
            pass
    return sorted(out)


def phase_close(rank, world, base, stuck_restore):
    gc.collect()
    before = _threads()
    eng = TieredCheckpointer(scenarios.make_config(base), node_id=rank)
    model, opt = scenarios.build(seed=0)
    scenarios.train_step(model, opt, 1, rank)
    eng.save(1, scenarios.app_state(model, opt))
    eng.wait(bounded=False)
    if stuck_restore:  # the second set of groups (a restore beside a stuck job) is the engine's too
        eng._spare.get("restore")
    during = _threads()
    eng.close()
    gc.collect()
    after = _threads()
    # the trainer's own group is untouched and still works
    out = [None] * world
    dist.all_gather_object(out, rank)
    return {"before": before, "during": during, "after": after, "world_ok": out == list(range(world)), "names": _names()}


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts OS threads through Linux /proc")
@pytest.mark.parametrize("extra", [False, True], ids=["groups", "with-second-groups"])
def test_close_joins_every_gloo_thread_of_the_engine(tmp_path, extra):
    for r in run_world(phase_close, 2, str(tmp_path), extra, timeout=300):
        v = r.value
        assert v["world_ok"], v
        assert v["during"] > v["before"], v  # the engine's groups do run threads (the check can fail)
        assert v["after"] <= v["before"], str(v)
