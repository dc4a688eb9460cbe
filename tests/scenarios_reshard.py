"""Rank functions of the in-cluster resharded restore tests (tests/test_engine_reshard.py).

The state is :class:`tests.scenarios.Net` under FSDP2 + AdamW: every sharded dimension (37,
20) is uneven on 2, 3 and 4 ranks, and the state also holds a plain tensor and a bytes item
(``extra``). The reference is the *global* value of every tensor (``full_tensor()``), which a
job of any shape can compare bitwise.
"""

from __future__ import annotations

import os

import torch

from tests.scenarios import app_state, apply_state, build, make_config, train_step
from tierckpt.engine import TieredCheckpointer


def global_values(model, opt) -> dict:
    """{key: global tensor or value} of the model and optimizer state (collective: full_tensor)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)

    def full(v):
        if hasattr(v, "full_tensor"):
            return v.full_tensor().clone()
        if isinstance(v, torch.Tensor):
            return v.clone()
        if isinstance(v, dict):
            return {k: full(x) for k, x in sorted(v.items(), key=lambda kv: str(kv[0]))}
        if isinstance(v, list):
            return [full(x) for x in v]
        return v

    return {"model": full(msd), "optim": full(osd)}


def phase_save(rank, world, base, rpn, k, cfg_kw):
    """Train ``k`` steps on ``world`` ranks (``rpn`` per node), save every tier at step ``k``;
    rank 0 writes the global values to ``base/ref-global.pt``."""
    eng = TieredCheckpointer(make_config(base, **cfg_kw), node_id=rank // rpn)
    model, opt = build(seed=0)
    for s in range(1, k + 1):
        train_step(model, opt, s, rank)
    eng.save(k, app_state(model, opt))
    eng.wait()
    ref = global_values(model, opt)
    eng.close()
    if rank == 0:
        torch.save(ref, os.path.join(base, "ref-global.pt"))
    return True


def phase_restore(rank, world, base, rpn, cfg_kw, expect_ok=True):
    """A fresh job of ``world`` ranks (``rpn`` per node) restores; its global values must equal
    the saved ones bitwise. Returns what the restore did (or the error when ``expect_ok`` is
    False)."""
    from tests.scenarios import assert_bitwise
    from tierckpt.errors import NoCheckpointError

    eng = TieredCheckpointer(make_config(base, **cfg_kw), node_id=rank // rpn)
    model, opt = build(seed=123)
    train_step(model, opt, 999, rank)  # every value differs from the saved one
    sd = app_state(model, opt)
    try:
        res = eng.restore(sd)
    except NoCheckpointError as e:
        eng.close()
        if expect_ok:
            raise
        return {"error": str(e)}
    assert res is not None, "nothing restored"
    apply_state(model, opt, sd)
    assert sd["extra"]["note"] == "x"
    assert_bitwise(global_values(model, opt), torch.load(os.path.join(base, "ref-global.pt"), weights_only=False))
    eng.close()
    return {
        "step": res.step,
        "sources": {n: (o.source.kind, o.source.holder) for n, o in res.sources.items()},
        "bytes": {n: o.bytes for n, o in res.sources.items()},
        "persistent_bytes": res.persistent_bytes_read,
        "failures": [(f.node, f.source.kind, f.source.holder, f.step, f.error) for f in res.failures],
        "attempts": res.attempts,
        "resharded": res.resharded,
        "missing": res.missing,
    }
