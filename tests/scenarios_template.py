"""Rank functions for tests/test_template_check.py: a restore template that does not match the
saved step (dtype, global shape, missing key) is refused before any source is read.

The saved state: ``model.0.weight`` a DTensor (8, 4) sharded over every rank (each node's
local copy holds its rows), ``model.0.bias`` a plain (8,) tensor, an optimizer step counter
and a string; all float32 except the counter.
"""

from __future__ import annotations

import os
import shutil

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from tests.scenarios import make_config
from tierckpt.engine import TieredCheckpointer

STEP = 4


def _mesh(world):
    return init_device_mesh("cpu", (world,))


def state(world, seed: int, dtype=torch.float32, rows: int = 8, bias: int = 8, extra_key: bool = False,
          model_only: bool = False) -> dict:
    """The test's state dict (values from ``seed``; the same on every rank before sharding)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, 4, generator=g).to(dtype)
    sd: dict = {"model": {"0.weight": distribute_tensor(w, _mesh(world), [Shard(0)]),
                          "0.bias": torch.randn(bias, generator=g)}}
    if extra_key:
        sd["model"]["1.weight"] = torch.zeros(3, 3)
    if not model_only:
        sd["optim"] = {"step": torch.tensor(seed)}
        sd["extra"] = {"note": f"seed {seed}"}
    return sd


def phase_save(rank, world, base):
    eng = TieredCheckpointer(make_config(base), node_id=rank)
    eng.save(STEP, state(world, seed=1))
    eng.wait()
    eng.close()
    return True


def tree_stat(base: str) -> dict:
    """{path: (inode, mtime ns, size)} of every file and directory under ``base``."""
    out = {}
    for root, dirs, files in os.walk(base):
        for name in dirs + files + ["."]:
            p = os.path.normpath(os.path.join(root, name))
            st = os.stat(p)
            out[os.path.relpath(p, base)] = (st.st_ino, st.st_mtime_ns, st.st_size)
    return out


def _refused(eng, base, template, **kw) -> dict:
    """Run one restore that must be refused; what it raised, the rounds it ran, what changed."""
    calls = {"attempt": 0, "cluster": 0, "pull": 0}
    r = eng.restorer
    orig = {"attempt": r._attempt, "cluster": r._cluster_attempt, "pull": r._pull}

    def counting(name):
        def f(*a, **k):
            calls[name] += 1
            return orig[name](*a, **k)
        return f

    r._attempt, r._cluster_attempt, r._pull = counting("attempt"), counting("cluster"), counting("pull")
    dist.barrier()
    before = tree_stat(base)
    dist.barrier()
    err = None
    try:
        eng.restore(template, **kw)
    except Exception as e:  # the test checks the type
        err = e
    finally:
        r._attempt, r._cluster_attempt, r._pull = orig["attempt"], orig["cluster"], orig["pull"]
    dist.barrier()
    after = tree_stat(base)
    changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
    return {"type": type(err).__name__, "bases": [c.__name__ for c in type(err).__mro__],
            "message": str(err), "calls": calls, "changed": changed}


def phase_refuse(rank, world, base):
    """Restore with mismatching templates (own copies, then the persistent tier only), then a
    model-only template (keys the checkpoint has and the template lacks are fine)."""
    eng = TieredCheckpointer(make_config(base), node_id=rank)
    out = {
        "dtype": _refused(eng, base, state(world, seed=2, dtype=torch.bfloat16)),
        "shape": _refused(eng, base, state(world, seed=2, rows=10)),
        "missing": _refused(eng, base, state(world, seed=2, extra_key=True)),
        "plain_shape": _refused(eng, base, state(world, seed=2, bias=9)),
        "persistent": _refused(eng, base, state(world, seed=2, dtype=torch.bfloat16), sources=("persistent",)),
    }
    sd = state(world, seed=2, model_only=True)
    res = eng.restore(sd)
    ref = state(world, seed=1, model_only=True)
    out["model_only"] = {
        "step": res.step, "attempts": res.attempts,
        "sources": sorted({o.source.kind for o in res.sources.values()}),
        "equal": torch.equal(sd["model"]["0.weight"].to_local(), ref["model"]["0.weight"].to_local())
        and torch.equal(sd["model"]["0.bias"], ref["model"]["0.bias"]),
    }
    eng.close()
    return out


def phase_refuse_replica(rank, world, base):
    """Node 0's own copy is gone (its source is node 1's replica): still refused, no pull."""
    if rank == 0:
        shutil.rmtree(os.path.join(base, "nvme", "node-0", "local", f"step-{STEP}"))
    dist.barrier()
    eng = TieredCheckpointer(make_config(base), node_id=rank)
    plan = eng.restorer.inventory()
    out = _refused(eng, base, state(world, seed=2, dtype=torch.bfloat16))
    out["node0_sources"] = sorted(plan.holders(0, STEP))
    eng.close()
    return out


def phase_refuse_cluster(rank, world, base):
    """A job of another shape (2 nodes saved, 1 restores): the in-cluster read's merged view."""
    eng = TieredCheckpointer(make_config(base, replication_factor=1), node_id=rank)
    out = _refused(eng, base, state(world, seed=2, dtype=torch.bfloat16))
    sd = state(world, seed=2)
    res = eng.restore(sd)
    ref = state(world, seed=1)
    out["ok"] = {"sources": sorted({o.source.kind for o in res.sources.values()}), "attempts": res.attempts,
                 "equal": torch.equal(sd["model"]["0.weight"].to_local(), ref["model"]["0.weight"].to_local())}
    eng.close()
    return out
