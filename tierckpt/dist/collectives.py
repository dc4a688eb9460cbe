"""Small helpers so that every rank of a group reaches the same decision after local work.

Background tier jobs must never leave a rank waiting in a collective that another rank
skipped because it raised. Each phase runs locally inside ``try``, then the outcome is
exchanged with :func:`agree`, and all ranks raise (or continue) together.
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from tierckpt.errors import TierckptError

# DCP raises CheckpointException, a BaseException subclass: catch it wherever Exception is.
FAILURES = (Exception, CheckpointException)


class PeerFailure(TierckptError, RuntimeError):
    """Another rank of the group failed a phase this rank completed (or this rank failed)."""


def all_gather(obj, group) -> list:
    """``all_gather_object`` over ``group``; returns one entry per group rank."""
    out: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def agree(error: BaseException | None, group, what: str) -> None:
    """Raise :class:`PeerFailure` on every rank of ``group`` if any rank passed an error.

    Args:
        error: this rank's exception from the phase, or None.
        what: phase name for the message.
    """
    msgs = all_gather(None if error is None else f"{type(error).__name__}: {error}", group)
    failed = [(i, m) for i, m in enumerate(msgs) if m is not None]
    if failed:
        detail = "; ".join(f"group rank {i}: {m}" for i, m in failed[:4])
        raise PeerFailure(f"{what} failed — {detail}") from error


def run_agreed(fn, group, what: str):
    """Run ``fn()`` on every rank, then :func:`agree` on the outcome. Returns ``fn``'s result."""
    err = None
    result = None
    try:
        result = fn()
    except FAILURES as e:  # exchanged with peers by agree(), then raised on every rank
        err = e
    agree(err, group, what)
    return result
