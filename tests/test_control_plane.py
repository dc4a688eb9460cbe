"""The node-leader exchange (tierckpt.cluster.collectives: gather_reduced, gather_leaders,
broadcast_from_first) gives exactly what the flat all-gathers it replaced gave."""

from __future__ import annotations

import itertools

from tests.harness import run_world
from tierckpt.cluster.collectives import first_by_rank, union
from tierckpt.restore.redundancy import merge_redundancy
from tierckpt.tiers.jobs import merge_stats
from tierckpt.tiers.replication import _and_by_node

STATS = [  # (rank, ok, error, bytes, background_s, blocking_s) of 6 ranks
    (0, True, None, 100, 0.5, 0.01),
    (1, False, "rank 1 disk full", 0, 0.7, 0.02),
    (2, True, None, 50, 0.9, 0.015),
    (3, False, "rank 3 boom", 0, 0.2, 0.03),
    (4, True, "", 7, 0.1, 0.005),
    (5, True, None, 0, 0.3, 0.04),
]


def _flat_record(parts):
    """What RunJournal.checkpoint derived from a flat gather of (ok, error, bytes, bg, delta)."""
    return (all(p[0] for p in parts), next((p[1] for p in parts if p[1]), None), sum(p[2] for p in parts),
            max(p[3] for p in parts), max(p[4] for p in parts))


def test_merge_stats_per_node_equals_flat_for_every_node_split():
    flat = _flat_record([s[1:] for s in STATS])
    assert flat == (False, "rank 1 disk full", 157, 0.9, 0.04)
    # any assignment of the 6 ranks to nodes (nodes not contiguous in rank), in any node order
    for labels in itertools.product(range(3), repeat=6):
        nodes = {}
        for s, n in zip(STATS, labels):
            nodes.setdefault(n, []).append(s)
        for order in itertools.permutations(sorted(nodes)):
            summaries = [merge_stats(nodes[n]) for n in order]
            assert merge_stats(summaries)[1:] == flat


def test_other_reductions_per_node_equal_flat():
    assert first_by_rank(2)([[(3, "c")], [(1, "a"), (5, "e")], [], [(2, "b")]]) == [(1, "a"), (2, "b")]
    assert first_by_rank(2)([first_by_rank(2)([[(3, "c")], [(1, "a")]]), first_by_rank(2)([[(5, "e")], [(2, "b")]])]) \
        == [(1, "a"), (2, "b")]
    assert union([{1, 2}, set(), {2, 3}]) == {1, 2, 3}
    assert _and_by_node([{0: True}, {1: True}, {0: False}, {1: True}]) == {0: False, 1: True}
    assert _and_by_node([_and_by_node([{0: True}, {0: False}]), _and_by_node([{1: True}, {1: True}])]) == \
        {0: False, 1: True}
    a = ({(0, 1)}, [(2, "node 0→node 1: x")], 10)
    b = ({(1, 0)}, [(1, "node 1→node 0: y")], 5)
    c = (set(), [], 1)
    assert merge_redundancy([a, b, c]) == ({(0, 1), (1, 0)}, [(1, "node 1→node 0: y")], 16)
    assert merge_redundancy([merge_redundancy([a, c]), merge_redundancy([b])]) == merge_redundancy([a, b, c])


def _exchange(rank, world):
    """Each helper through the trees (node ids interleaved: node = 1 - rank % 2) and flat."""
    import torch.distributed as dist

    from tierckpt.cluster.collectives import (
        all_gather,
        broadcast_from_first,
        gather_leaders,
        gather_reduced,
        tree_of,
    )
    from tierckpt.cluster.topology import discover

    topo, groups = discover(1, 2, node_id=1 - rank % 2, timeout_s=60)
    g = groups.local_world
    assert tree_of(g) is groups.local_tree and tree_of(groups.persistent_world) is groups.persistent_tree
    stat = STATS[rank]
    tree = {
        "stats": gather_reduced(stat, g, merge_stats)[1:],
        "leaders": gather_leaders((topo.node, rank), g, topo.is_node_leader),
        "bcast": broadcast_from_first(("from", rank), g),
        "sum": gather_reduced(rank * 10, groups.persistent_world, sum),
        "flags": gather_reduced({topo.node: rank != 2}, g, _and_by_node),
    }
    flat_all = all_gather(stat, dist.group.WORLD)
    flat = {
        "stats": _flat_record([s[1:] for s in flat_all]),
        "leaders": [x for x, r in zip(all_gather((topo.node, rank), dist.group.WORLD), range(world))
                    if topo.is_leader_rank(r)],
        "bcast": ("from", 0),
        "sum": sum(r * 10 for r in range(world)),
        "flags": {0: True, 1: False},  # rank 2 is on node 1
    }
    return {"tree": tree, "flat": flat, "node": topo.node, "leader": topo.is_node_leader}


def test_tree_helpers_equal_flat_on_gloo_with_interleaved_nodes():
    out = [r.value for r in run_world(_exchange, 4, timeout=180)]
    assert [o["node"] for o in out] == [1, 0, 1, 0]
    assert [o["leader"] for o in out] == [True, True, False, False]
    for o in out:
        assert o["tree"] == o["flat"]
    assert out[0]["tree"]["stats"] == (False, "rank 1 disk full", 150, 0.9, 0.03)
    assert out[0]["tree"]["leaders"] == [(1, 0), (0, 1)]
    assert out[0]["tree"]["flags"] == {0: True, 1: False}
