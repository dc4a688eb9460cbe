"""Small helpers so that every rank of a group reaches the same decision after local work.

Background tier jobs must never leave a rank waiting in a collective that another rank
skipped because it raised. Each phase runs locally inside ``try``, then the outcome is
exchanged with :func:`agree`, and all ranks raise (or continue) together.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

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
    mine = [] if error is None else [(dist.get_rank(group), f"{type(error).__name__}: {error}")]
    failed = gather_reduced(mine, group, first_by_rank(4))
    if failed:
        detail = "; ".join(f"group rank {i}: {m}" for i, m in failed)
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


# ------------------------------------------------------------------ node-leader (two-level) exchange
@dataclass(frozen=True)
class Tree:
    """The two levels under one all-ranks group: this node's ranks and the node leaders.

    A flat ``all_gather_object`` over W ranks makes every rank receive W entries (O(W) bytes
    per rank, W−1 ring steps on gloo). Through the tree, ranks talk within their node (R ranks)
    and only leaders talk across nodes (N ranks): O(R + N) per rank for a per-node summary.
    Every group of a tree must be owned by the thread that owns its all-ranks group (gloo
    collectives of one group must not interleave across threads).

    Attributes:
        node: this node's ranks (group rank 0 is the node leader, the lowest global rank).
        leaders: the first rank of every node, in ascending global rank; None on non-leaders.
        leader: global rank of this node's leader.
        rank: this rank's global rank.
    """

    node: dist.ProcessGroup
    leaders: dist.ProcessGroup | None
    leader: int
    rank: int


_TREES: dict[int, tuple[dist.ProcessGroup, Tree]] = {}


def register_tree(group: dist.ProcessGroup, tree: Tree) -> None:
    """Route the node-leader helpers below on all-ranks ``group`` through ``tree``."""
    _TREES[id(group)] = (group, tree)  # the group is kept alive so its id is never reused


def unregister_tree(group: dist.ProcessGroup) -> None:
    """Forget the tree of ``group`` (and the reference that kept the group alive)."""
    got = _TREES.get(id(group))
    if got is not None and got[0] is group:
        del _TREES[id(group)]


def tree_of(group) -> Tree | None:
    """The tree registered for ``group`` (None: the helpers run flat on ``group``)."""
    got = _TREES.get(id(group))
    return got[1] if got is not None and got[0] is group else None


def _node_broadcast(obj, tree: Tree):
    """The node leader's ``obj`` on every rank of the node (collective over ``tree.node``)."""
    box = [obj]
    dist.broadcast_object_list(box, src=tree.leader, group=tree.node)
    return box[0]


def gather_reduced(obj, group, reduce: Callable[[list], object]):
    """``reduce(all_gather(obj, group))`` on every rank, computed as ``reduce`` of the nodes'
    ``reduce`` s when ``group`` has a tree (collective over ``group``).

    ``reduce`` must take a list of its own inputs/outputs and give the same value whether it is
    applied to all W entries at once or to per-node results (as all/any, sum of integers, max,
    min-by-rank, set union do); entries arrive in ascending global rank within a node and
    nodes in ascending leader rank, so an order-sensitive ``reduce`` must key on a rank it
    carries. Bytes per rank: O(R) within the node plus O(N) summaries among leaders, instead
    of O(W).
    """
    tree = tree_of(group)
    if tree is None:
        return reduce(all_gather(obj, group))
    mine = reduce(all_gather(obj, tree.node))
    if tree.leaders is not None:
        mine = reduce(all_gather(mine, tree.leaders))
    return _node_broadcast(mine, tree)


def gather_leaders(obj, group, is_leader: bool) -> list:
    """The ``obj`` of every node leader of ``group``, in ascending global rank, on every rank
    (collective over ``group``; ``obj`` of other ranks is ignored and need not be computed).

    With a tree only leaders exchange (N entries per rank, not W); the list is the same as
    the leaders' entries of a flat ``all_gather`` of ``group``.
    """
    tree = tree_of(group)
    if tree is None:
        return [o for o, lead in all_gather((obj, is_leader), group) if lead]
    got = all_gather(obj, tree.leaders) if tree.leaders is not None else None
    return _node_broadcast(got, tree)


def first_by_rank(k: int) -> Callable[[list], list]:
    """A ``reduce`` for :func:`gather_reduced` over lists of ``(rank, value)``: the ``k``
    entries of lowest rank, ascending (what the first ``k`` of a flat gather would be)."""
    def reduce(parts: list) -> list:
        return sorted((x for part in parts for x in part), key=lambda x: x[0])[:k]
    return reduce


def union(parts: list) -> set:
    """A ``reduce`` for :func:`gather_reduced`: the union of sets."""
    return set().union(*parts)


def broadcast_from_first(obj, group):
    """Group rank 0's ``obj`` on every rank of all-ranks ``group`` (collective; other ranks'
    ``obj`` is ignored). Through the tree: leaders, then each node; flat: one broadcast.
    O(1) entries per rank instead of the W of an ``all_gather`` whose first entry is kept."""
    tree = tree_of(group)
    if tree is None:
        box = [obj]
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
        return box[0]
    if tree.leaders is not None:
        box = [obj]
        dist.broadcast_object_list(box, src=dist.get_global_rank(tree.leaders, 0), group=tree.leaders)
        obj = box[0]
    return _node_broadcast(obj, tree)
