"""The agreed, bounded decision to save after a DataLoader whose workers a preemption notice
killed (``TieredCheckpointManager.save_on_loader_death``).

The save is collective, so it is right only when every rank's fetch failed the same way at
the same step. With unprotected loader workers that is the usual case (the notice reaches
every rank's workers while the ranks wait for data), but not a certainty: one rank's
workers may die while another rank already fetched its batch and is inside a training
collective waiting for this one. Saving then would pair the save's collectives with nothing
(or with the wrong ones) and hang.

So the ranks vote through the process group's key-value store (never a collective, which
could pair with one a rank is already in): each rank posts whether its fetch failed on the
notice and at which step; a rank that failed otherwise posts "no" and leaves at once. A rank
that wants to save waits for every vote at most ``collective_timeout_s`` seconds and saves only
when every rank failed on the notice at the same step; otherwise it gives the save up with a
warning (the step stays what the last periodic save made durable).
"""

from __future__ import annotations

import datetime
import json
import logging
from typing import Any

import torch.distributed as dist

from tierckpt import preempted_by

log = logging.getLogger(__name__)

__all__ = ["agree_loader_death"]


def agree_loader_death(engine: Any, exc: BaseException, step: int, store: Any = None) -> str | None:
    """Whether to save step ``step`` (the last finished one) after ``exc`` ended the training
    loop: the notice's signal name when every rank's fetch failed on the notice at ``step``,
    else None (``exc`` is another error on this rank or some other rank, the ranks disagree on
    the step, or not every rank voted within ``engine.cfg.collective_timeout_s`` seconds).
    Call it on every rank that leaves the loop on an exception; it runs no collective.

    Args:
        engine: the :class:`~tierckpt.engine.TieredCheckpointer` (its ``preemption`` watch,
            ``topo``, ``timeline.run`` and ``cfg.collective_timeout_s``).
        exc: the exception the training loop raised on this rank.
        step: the step the save would name (``trainer.step - 1``); below 1 nothing is saved.
        store: the key-value store to vote through (default: the default process group's).
    """
    sig = preempted_by(exc, engine.preemption)
    mine = {"step": step, "signal": sig} if sig is not None and step >= 1 else None
    topo = engine.topo
    if topo.world_size == 1:
        return sig if mine is not None else None
    prefix = f"tierckpt/loader-death/{engine.timeline.run}"
    keys = [f"{prefix}/{r}" for r in range(topo.world_size)]
    try:
        store = store if store is not None else dist.distributed_c10d._get_default_store()
        store.set(keys[topo.rank], json.dumps(mine))
    except Exception as e:  # noqa: BLE001 - a store gone with a peer: no agreement, no save
        if mine is not None:
            log.warning("tierckpt: %s: cannot agree on the save after the DataLoader's death (%s: %s); not saving",
                        sig, type(e).__name__, e)
        return None
    if mine is None:  # failed otherwise: the vote says so, and this rank does not wait
        return None
    timeout = engine.cfg.collective_timeout_s
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout))
        votes = [json.loads(store.get(k)) for k in keys]
    except Exception as e:  # noqa: BLE001 - a timeout (a rank inside a collective) or a store gone
        log.warning("tierckpt: %s: the DataLoader's workers died on the notice, but not every rank voted to save "
                    "within collective_timeout_s = %gs (a rank inside a collective?): %s: %s; not saving, the "
                    "last committed step stays the resume point", sig, timeout, type(e).__name__, e)
        return None
    others = [r for r, v in enumerate(votes) if v is None or v.get("step") != step]
    if others:
        log.warning("tierckpt: %s: the DataLoader's workers died on the notice at step %d, but ranks %s failed "
                    "otherwise or at another step; not saving, the last committed step stays the resume point",
                    sig, step + 1, others[:16])
        return None
    return sig
