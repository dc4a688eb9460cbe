"""Restores whose source read hangs (a FIFO in place of a step's data file blocks on open, as a
hung NFS/NVMe read blocks): tests/test_restore_hung_read.py."""

from __future__ import annotations

import json
import os
import time

import torch

from tests.scenarios import app_state, apply_state, assert_bitwise, build, make_config, snapshot, train_step
from tierckpt import TieredCheckpointer


def data_files(step_dir: str) -> list[str]:
    """The DCP data files of a step directory."""
    return sorted(n for n in os.listdir(step_dir) if n.endswith(".distcp"))


def hang(path: str) -> None:
    """Replace ``path`` by a FIFO nobody writes: opening it for reading blocks forever."""
    os.remove(path)
    os.mkfifo(path)


def phase_restore_timed(rank, world, base, cfg_kw):
    """Fresh model → restore (timed) → bitwise equal to the saved step-k snapshot and the next
    losses equal the reference run's. Returns the restore's facts and its wall time."""
    eng = TieredCheckpointer(make_config(base, **cfg_kw), node_id=rank)
    model, opt = build(seed=123)
    train_step(model, opt, 999, rank)  # every value differs from the saved one
    sd = app_state(model, opt)
    t0 = time.monotonic()
    res = eng.restore(sd)
    wall = time.monotonic() - t0
    assert res is not None, "nothing restored"
    apply_state(model, opt, sd)
    ref = torch.load(os.path.join(base, "ref", f"rank{rank}.pt"), weights_only=False)
    assert_bitwise(snapshot(model, opt), ref["snap"])
    k = res.step
    losses = [train_step(model, opt, s, rank) for s in range(k + 1, k + 1 + len(ref["losses"]))]
    assert losses == ref["losses"], f"losses {losses} != reference {ref['losses']}"
    if eng.last_redundancy is not None:
        eng.last_redundancy.result(timeout=120)
    eng.close()
    return {
        "step": res.step, "wall": wall, "attempts": res.attempts,
        "sources": {n: (o.source.kind, o.source.holder) for n, o in res.sources.items()},
        "failures": [(f.node, f.source.kind, f.source.holder, f.step, f.error) for f in res.failures],
    }


def ledger_restores(base: str) -> list[dict]:
    """The ``restore`` records of the ledger in the persistent root."""
    with open(os.path.join(base, "pfs", "tierckpt-ledger.jsonl")) as f:
        return [r for r in map(json.loads, f) if r.get("kind") == "restore"]
