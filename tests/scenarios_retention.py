"""Rank functions: retention as operators run it (issue 33 §2), through whole runs of the job.

Each phase is one run (one engine on every rank, the persistent tier only): it optionally
restores, then saves every ``SAVE_EVERY`` steps and, on global rank 0, lists the committed
persistent steps after each save's retention. The state is a replicated tensor holding the
step it was saved at, so a restore says which save it loaded.
"""

from __future__ import annotations

import os

import torch

from tierckpt.config import TierConfig
from tierckpt.engine import TieredCheckpointer

SAVE_EVERY = 10


def config(base: str, **kw) -> TierConfig:
    """Persistent tier only under ``base/pfs``; every save waits for the previous one."""
    return TierConfig(persistent_root=os.path.join(base, "pfs"), tiers=("persistent",), replication_factor=1,
                      busy_tier_policy="wait", job_id="test", **kw)


def _state(step: float) -> dict:
    return {"w": torch.full((64,), float(step)), "extra": {"note": "retention"}}


def phase_run(rank, world, base, last, cfg_kw, restore=None):
    """One run: ``restore`` None (fresh start), ``{"step": N}`` (a rollback by name, as a
    training run that names an older step) or ``{}`` (a restore without a step: the newest save,
    or a fallback); then save every ``SAVE_EVERY`` steps up to ``last``.

    Returns ``{"restored": step or None, "value": the restored tensor's value, "after":
    [(step saved, committed persistent steps after its retention)] (global rank 0 only)}``.
    """
    eng = TieredCheckpointer(config(base, **cfg_kw))
    start, restored, value = 0, None, None
    if restore is not None:
        sd = _state(-1)
        res = eng.restore(sd, restore.get("step"), rollback="step" in restore)
        assert res is not None
        start, restored, value = res.step, res.step, float(sd["w"][0])
    after = []
    for s in range(start + SAVE_EVERY, last + 1, SAVE_EVERY):
        h = eng.save(s, _state(s))
        eng.wait()
        assert all(f.result().ok for f in h.futures.values()), [f.result() for f in h.futures.values()]
        if rank == 0:
            after.append((s, eng.persistent_steps()))
    eng.close()
    return {"restored": restored, "value": value, "after": after}
