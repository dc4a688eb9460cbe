"""Pure-logic tests: topology detection, cliques, restore planning, retention rules."""

from __future__ import annotations

import os

import pytest

from tierckpt.io import layout, manifest
from tierckpt.errors import ConfigError
from tierckpt.restore import Inventory, Source, plan_restore
from tierckpt.tiers.retention import InUse, purge_dir, purge_persistent
from tierckpt.io.storage import Store
from tierckpt.cluster.topology import Topology, _local_node_label, check_replication, clique, peers


def test_cliques_follow_jump_and_factor():
    # 8 nodes, J=2, F=2: blocks of 4 → cliques {0,2}, {1,3}, {4,6}, {5,7}
    assert clique(0, 8, 2, 2) == [0, 2] and clique(3, 8, 2, 2) == [1, 3] and clique(6, 8, 2, 2) == [4, 6]
    assert peers(5, 8, 2, 2) == [7]
    # 6 nodes, J=1, F=3: {0,1,2}, {3,4,5}
    assert peers(4, 6, 1, 3) == [3, 5]
    # F=1: no replicas
    assert peers(2, 4, 1, 1) == []


@pytest.mark.parametrize("nodes,j,f,option", [(2, 1, 3, "replication_factor"), (4, 3, 1, "replication_jump"),
                                               (6, 2, 2, "replication_jump"), (2, 0, 2, "replication_jump")])
def test_impossible_replication_rejected(nodes, j, f, option):
    with pytest.raises(ConfigError) as e:
        check_replication(nodes, j, f)
    assert e.value.option == option


def test_node_ids_from_environment(monkeypatch):
    for k in ("TIERCKPT_NODE_ID", "TIERCKPT_RANKS_PER_NODE", "GROUP_RANK", "LOCAL_WORLD_SIZE", "SLURM_NODEID"):
        monkeypatch.delenv(k, raising=False)
    assert _local_node_label(5, None)[1] == "hostname"
    monkeypatch.setenv("SLURM_NODEID", "3")
    assert _local_node_label(5, None) == (3, "slurm")
    monkeypatch.setenv("GROUP_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert _local_node_label(5, None) == (1, "torchrun")
    monkeypatch.setenv("TIERCKPT_RANKS_PER_NODE", "2")
    assert _local_node_label(5, None) == (2, "override")
    assert _local_node_label(5, 7) == (7, "override")


def test_topology_from_hostnames_and_uneven_nodes():
    t = Topology.build(3, ["b", "b", "a", "a"], 1, 2, "hostname")
    assert t.node_of_rank == [0, 0, 1, 1] and t.node == 1 and t.local_rank == 1 and t.peers() == [0]
    with pytest.raises(ConfigError, match="same number of ranks"):
        Topology.build(0, ["a", "a", "b"], 1, 1, "hostname")


def test_plan_prefers_own_then_replica_then_persistent_and_newest_common_step():
    inv = Inventory(local={0: {10, 20}, 1: {10}}, replicas={1: {0: {10, 20}}, 0: {1: {10}}}, persistent={10})
    step, src = plan_restore(inv, 2, set())
    assert step == 20 and src == {0: Source("own-local", 0), 1: Source("peer-replica", 0)}
    bad = {(1, "peer-replica", 0, 20)}
    step, src = plan_restore(inv, 2, bad)
    assert step == 10 and src[1] == Source("own-local", 1)
    bad |= {(1, "own-local", 1, 10), (1, "peer-replica", 0, 10)}
    assert plan_restore(inv, 2, bad)[1][1] == Source("persistent", None)
    bad |= {(1, "persistent", None, 10)}
    assert plan_restore(inv, 2, bad) is None
    assert plan_restore(inv, 2, set(), step=15) is None


def _commit_step(store, rel, step):
    store.makedirs(rel)
    with store.open(f"{rel}/__0_0.distcp", "wb") as f:
        f.write(os.urandom(64))
    manifest.commit(store, rel, [manifest.FileEntry("__0_0.distcp", *_h(store, f"{rel}/__0_0.distcp"))], tier="local", step=step)


def _h(store, rel):
    e = manifest.hash_file(store, rel)
    return e.size, e.xxh3_64


def test_retention_keeps_k_skips_in_use_and_cleans_torn_steps(tmp_path):
    store = Store(str(tmp_path))
    for s in (1, 2, 3, 4):
        _commit_step(store, layout.local_step(s), s)
    store.makedirs("local/step-0")   # torn leftover → deleted
    store.makedirs("local/step-7")   # torn leftover newer than every commit (full disk) → deleted
    store.makedirs("local/step-9")   # being written right now → kept
    in_use = InUse()
    in_use.hold("local:local/step-1")  # being read by a restore → kept
    in_use.hold("local:local/step-9")
    deleted = purge_dir(store, "local", 2, in_use, "local:")
    assert sorted(deleted) == [0, 2, 7]
    assert store.listdir("local") == ["step-1", "step-3", "step-4", "step-9"]
    in_use.drop("local:local/step-1")
    assert purge_dir(store, "local", 2, in_use, "local:") == [1]
    assert purge_dir(store, "local", 0, in_use, "local:") == []  # 0 keeps every committed step


def test_persistent_retention_leaves_foreign_folders(tmp_path):
    store = Store(str(tmp_path))
    for s in (1, 2, 3):
        _commit_step(store, layout.persistent_step(s), s)
    store.makedirs("step-4")  # e.g. torchtitan's model-only export: not ours, never deleted
    store.makedirs("step-5")
    with store.open("step-5/" + layout.INPROGRESS, "wb") as f:
        f.write(b"x")  # a persistent save of ours that died: deleted
    assert sorted(purge_persistent(store, 2, InUse())) == [1, 5]
    assert store.listdir("") == ["step-2", "step-3", "step-4"]


def test_plan_reshards_in_cluster_then_persistent():
    from tierckpt.restore.plan import ALL_NODES, CLUSTER

    # step 5 saved by 4 nodes; this job has 3 (node 3 lost: its copy survives as node 2's replica)
    copies = {5: {0: {0: "local/step-5"}, 1: {1: "local/step-5"}, 2: {2: "local/step-5"},
                  3: {2: "replicas/node-3/step-5"}}}
    inv = Inventory(persistent={5}, copies=copies, shapes={5: (4, 4)})
    step, src = plan_restore(inv, 3, set(), world_size=3)
    assert step == 5 and set(src.values()) == {Source(CLUSTER, None)}
    # a bad copy of node 3 leaves none of it: still tried (coverage decides), then as a whole
    assert plan_restore(inv, 3, {(3, CLUSTER, 2, 5)}, world_size=3)[1][0] == Source(CLUSTER, None)
    assert plan_restore(inv, 3, {(ALL_NODES, CLUSTER, None, 5)}, world_size=3)[1][0] == Source("persistent", None)
    # without a world size (peek), shapes are not compared: per-node plan
    assert plan_restore(inv, 3, set())[1][0] == Source("own-local", 0)


def test_plan_follows_the_manifest_node_of_a_remapped_disk():
    # the two nodes' roots were swapped: node 0's local/ holds node 1's state and vice versa,
    # and each holds its own state as the replica it kept for the other
    copies = {3: {1: {0: "local/step-3", 1: "replicas/node-1/step-3"},
                  0: {1: "local/step-3", 0: "replicas/node-0/step-3"}}}
    inv = Inventory(persistent={3}, copies=copies, shapes={3: (2, 2)})
    step, src = plan_restore(inv, 2, set(), world_size=2)
    assert src == {0: Source("own-local", 0), 1: Source("own-local", 1)}
    assert inv.holders(0, 3)[0] == "replicas/node-0/step-3"


def test_merge_metadata_and_read_assignment():
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex,
                                                       TensorProperties, TensorStorageMetadata)
    from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

    from tierckpt.restore.chunkmap import assign_reads, merge_metadata

    def node_md(m, rows):  # node m saved rows [m*rows, (m+1)*rows) of "w" and the whole "b"
        w = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([2 * rows, 4]),
                                  [ChunkStorageMetadata(torch.Size([m * rows, 0]), torch.Size([rows, 4]))])
        b = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([4]),
                                  [ChunkStorageMetadata(torch.Size([0]), torch.Size([4]))])
        return Metadata({"w": w, "b": b}, storage_data={
            MetadataIndex("w", [m * rows, 0]): _StorageInfo(f"__{m}_0.distcp", 0, 100),
            MetadataIndex("b", [0]): _StorageInfo(f"__{m}_0.distcp", 100, 16)})

    md, origins = merge_metadata({0: node_md(0, 3), 1: node_md(1, 3)})
    assert len(md.state_dict_metadata["w"].chunks) == 2 and len(md.state_dict_metadata["b"].chunks) == 1
    assert [m for m, _ in origins[MetadataIndex("b", [0])]] == [0, 1]  # a replicated value: either node

    def item(fqn, off, lengths):
        return ReadItem(LoadItemType.TENSOR, MetadataIndex(fqn, off), [0] * len(off), MetadataIndex(fqn, off),
                        [0] * len(off), lengths)

    # 3 ranks on 3 nodes; node 2 holds nothing; every rank needs both halves of w and b
    plans = [LoadPlan([item("w", [0, 0], [3, 4]), item("w", [3, 0], [3, 4]), item("b", [0], [4])])
             for _ in range(3)]
    io = assign_reads(plans, origins, {0: [0], 1: [1]}, [0, 1, 2], md)
    assert io[0].local == {0: 0, 2: 0} and io[1].local == {1: 1, 2: 1}
    assert not io[2].local and sum(len(x[2]) for x in io[2].recv) == 3
    # node 2's reads are spread over both holders, and every receive has its matching send
    assert {src for _, src, _ in io[2].recv} == {0, 1}
    sends = {(xid, dst) for r in io for xid, dst, _ in r.send}
    assert sends == {(xid, r) for r in range(3) for xid, _, _ in io[r].recv}
    with pytest.raises(ValueError, match="no usable in-cluster copy"):
        assign_reads(plans, origins, {0: [0]}, [0, 1, 2], md)


def test_plan_restricted_to_source_kinds():
    inv = Inventory(local={0: {10}, 1: {10}}, persistent={10}, shapes={10: (2, 2)})
    assert plan_restore(inv, 2, set(), world_size=2)[1][0] == Source("own-local", 0)
    assert set(plan_restore(inv, 2, set(), world_size=2, kinds=("persistent",))[1].values()) == {
        Source("persistent", None)}
    assert plan_restore(Inventory(local={0: {10}, 1: {10}}), 2, set(), world_size=2, kinds=("persistent",)) is None
    with pytest.raises(ValueError, match="allowed"):
        plan_restore(inv, 2, set(), kinds=("nvme",))


def test_integer_node_ids_0_to_n_minus_1_are_kept():
    # the host that was node 1 comes back holding the lower ranks: it stays node 1
    t = Topology.build(0, [1, 1, 0, 0], 1, 2, "torchrun")
    assert t.node_of_rank == [1, 1, 0, 0] and t.node == 1 and t.nodes == 2
    assert t.ranks_of(0) == [2, 3] and t.local_ranks == [0, 1] and t.is_node_leader and t.peers() == [0]
    assert t.is_leader_rank(2) and not t.is_leader_rank(3)
    assert clique(1, 2, 1, 2) == [0, 1]
    t3 = Topology.build(2, [2, 0, 1], 1, 1, "override")
    assert t3.node_of_rank == [2, 0, 1] and t3.node == 1 and [t3.ranks_of(n) for n in range(3)] == [[1], [2], [0]]


@pytest.mark.parametrize("labels,expect", [
    ([5, 5, 7, 7], [0, 0, 1, 1]),            # Slurm node ids of a larger allocation: not 0..N-1
    ([1, 1, 2, 2], [0, 0, 1, 1]),            # a gap at 0
    (["b", "b", "a", "a"], [0, 0, 1, 1]),    # hostnames
    ([True, True, False, False], [0, 0, 1, 1]),  # bools are not node ids
    ([0, 0, "1", "1"], [0, 0, 1, 1]),        # mixed types
])
def test_other_node_labels_are_renumbered_by_lowest_rank(labels, expect):
    assert Topology.build(0, labels, 1, 1, "slurm").node_of_rank == expect


def test_missing_replicas_after_a_restore():
    from tierckpt.restore.plan import missing_replicas

    # node 1 was rebuilt from node 0's replica: node 0 holds both, node 1 only its own
    copies = {3: {0: {0: "local/step-3"}, 1: {0: "replicas/node-1/step-3", 1: "local/step-3"}}}
    pairs, missing = missing_replicas(Inventory(copies=copies), 3, 2, 1, 2)
    assert pairs == {(0, 1): "local/step-3"} and missing == []
    # a remapped disk: node 0's state is node 1's local/, node 1's is node 0's local/: F copies each
    swapped = {3: {1: {0: "local/step-3", 1: "replicas/node-1/step-3"},
                   0: {1: "local/step-3", 0: "replicas/node-0/step-3"}}}
    assert missing_replicas(Inventory(copies=swapped), 3, 2, 1, 2) == ({}, [])
    # node 1 was served by the persistent tier (its own copy failed): nothing to send for it;
    # the replica directory on node 0 is taken (by the copy that failed): never overwritten
    bad = {(1, "own-local", 1, 3)}
    copies = {3: {0: {0: "local/step-3", 1: "replicas/node-0/step-3"}, 1: {1: "local/step-3"}}}
    assert missing_replicas(Inventory(copies=copies), 3, 2, 1, 2, bad) == ({}, [1])
    copies = {3: {0: {0: "local/step-3"}, 1: {1: "local/step-3"}}}
    inv = Inventory(copies=copies, dirs={3: {(1, "replicas/node-0/step-3")}})  # a second copy of someone there
    assert missing_replicas(inv, 3, 2, 1, 2) == ({(1, 0): "local/step-3"}, [0])
    # 4 nodes, J=1, F=2: cliques {0,1} {2,3}; node 3 lost everything, node 2 still has both
    copies = {5: {0: {0: "local/step-5", 1: "replicas/node-0/step-5"}, 1: {1: "local/step-5", 0: "replicas/node-1/step-5"},
                  2: {2: "local/step-5"}, 3: {2: "replicas/node-3/step-5"}}}
    assert missing_replicas(Inventory(copies=copies), 5, 4, 1, 2) == ({(2, 3): "local/step-5"}, [3])


def test_plan_keeps_pulls_out_of_an_unavailable_root():
    from tierckpt.restore.plan import CLUSTER

    # node 1's local job hangs: its root is not listed and may not receive a pull
    inv = Inventory(copies={3: {0: {0: "local/step-3"}, 1: {0: "replicas/node-1/step-3"}}}, persistent={3},
                    shapes={3: (2, 2)}, unavailable={1})
    assert plan_restore(inv, 2, set(), world_size=2)[1] == {0: Source("own-local", 0), 1: Source("persistent", None)}
    inv.persistent = set()  # without a persistent step: read node 1's state over the network
    assert set(plan_restore(inv, 2, set(), world_size=2)[1].values()) == {Source(CLUSTER, None)}


def _commit_node_step(store, rel, step, node, payload):
    store.makedirs(rel)
    with store.open(f"{rel}/__0_0.distcp", "wb") as f:
        f.write(payload)
    manifest.commit(store, rel, [manifest.FileEntry("__0_0.distcp", *_h(store, f"{rel}/__0_0.distcp"))],
                    tier="local", step=step, node=node)


def test_swap_in_keeps_another_nodes_copy(tmp_path):
    from tierckpt.restore.pull import swap_in

    store = Store(str(tmp_path))
    # node 0's root holds node 1's state in local/ (a remapped disk); node 0's own state arrived
    _commit_node_step(store, "local/step-3", 3, 1, b"node1")
    _commit_node_step(store, layout.incoming_step(3), 3, 0, b"node0")
    assert swap_in(store, 0, 3) == (1, "replicas/node-1/step-3")
    assert manifest.read_committed(store, "local/step-3")["node"] == 0
    assert manifest.read_committed(store, "replicas/node-1/step-3")["node"] == 1
    assert store.read_bytes("replicas/node-1/step-3/__0_0.distcp") == b"node1"
    assert not store.exists(layout.incoming_step(3)) and manifest.verify_step(store, "local/step-3") == []
    # a second copy of node 1 where a committed one already is: only then is it dropped
    _commit_node_step(store, "local/step-4", 4, 1, b"node1-dup")
    _commit_node_step(store, "replicas/node-1/step-4", 4, 1, b"node1")
    _commit_node_step(store, layout.incoming_step(4), 4, 0, b"node0")
    assert swap_in(store, 0, 4) == (1, "replicas/node-1/step-4")
    assert store.read_bytes("replicas/node-1/step-4/__0_0.distcp") == b"node1"
    assert store.read_bytes("local/step-4/__0_0.distcp") == b"node0"
    # the node's own copy that failed, or a torn directory, is simply replaced
    _commit_node_step(store, "local/step-5", 5, 0, b"old")
    _commit_node_step(store, layout.incoming_step(5), 5, 0, b"new")
    assert swap_in(store, 0, 5) is None and store.read_bytes("local/step-5/__0_0.distcp") == b"new"
    assert layout.parse_step(layout.incoming_step(5).split("/")[1]) is None  # never listed as a step


def test_leftover_pulls_are_purged(tmp_path):
    from tierckpt.tiers.retention import purge_incoming

    store = Store(str(tmp_path))
    _commit_node_step(store, layout.incoming_step(7), 7, 0, b"x")
    _commit_node_step(store, "local/step-7", 7, 0, b"y")
    assert purge_incoming(store) == [layout.incoming_step(7)]
    assert store.listdir("local") == ["step-7"]


def test_a_transfer_to_itself_is_a_failed_receive_not_an_exception(tmp_path):
    from tierckpt.transport.transfer import Transfer, run_transfers

    # nothing is sent or received (no process group needed): both sides refuse it
    t = Transfer(src_rank=0, dst_rank=0, src_rel="local/step-3", dst_rel=layout.incoming_step(3), tag="pull node-0")
    got = run_transfers([t], 0, Store(str(tmp_path)), None, 4096)
    assert list(got) == [0] and not got[0].ok and "to itself" in got[0].problems[0]


def test_plan_combines_copies_of_one_save_only_newest_save_first():
    """Two saves under step 20 (an old timeline's leftovers next to a new one's): a plan never
    takes node 0's state from one and node 1's from the other; within a step the newest save
    (by agreed order, not by time) is tried first."""
    from tierckpt.restore.plan import choose

    a, b = "aaaaaaaaaaaa.1", "bbbbbbbbbbbb.0"
    # node 0's root is lost; node 1 saved 20 again in a newer run (generation 1), unreplicated
    inv2 = Inventory()
    inv2.add_copy(10, 0, 1, layout.replica_step(0, 10), "aaaaaaaaaaaa.0", (0, 0), (2, 2))
    inv2.add_copy(10, 1, 1, layout.local_step(10), "aaaaaaaaaaaa.0", (0, 0), (2, 2))
    inv2.add_copy(20, 0, 1, layout.replica_step(0, 20), a, (0, 1), (2, 2))
    inv2.add_copy(20, 1, 1, layout.local_step(20), b, (1, 0), (2, 2))
    per_node = ("own-local", "peer-replica", "persistent")  # (an in-cluster attempt checks coverage itself)
    assert plan_restore(inv2, 2, set(), world_size=2, kinds=per_node)[0] == 10
    c = choose(inv2, 2, set(), world_size=2, kinds=per_node)
    assert c is not None and (c.step, c.save_id) == (10, "aaaaaaaaaaaa.0"), c
    assert inv2.save_ids(20) == [b, a]
    # with both saves complete at 20, the newer generation wins although its seq is lower
    inv2.add_copy(20, 0, 1, "replicas/node-0/step-20-b", b, (1, 0), (2, 2))
    c = choose(inv2, 2, set(), world_size=2, kinds=per_node)
    assert (c.step, c.save_id) == (20, b) and c.view.holders(0, 20) == {1: "replicas/node-0/step-20-b"}, c
    # the older save's copy of node 0 is used only with the older save's copy of node 1
    c = choose(inv2, 2, {(1, "own-local", 1, 20), (0, "peer-replica", 1, 20)}, world_size=2, kinds=per_node)
    assert (c.step, c.save_id) == (10, "aaaaaaaaaaaa.0"), c


# -- the newest save is the newest in agreed order, not the highest step (issue 28) -------------
A0, A1, B0, B1 = "aaaaaaaaaaaa.0", "aaaaaaaaaaaa.1", "bbbbbbbbbbbb.0", "bbbbbbbbbbbb.1"


def _timelines() -> Inventory:
    """Timeline A saved 10 (A0) and 20 (A1); a rollback to 10 (run B, generation 1) saved 11 (B0);
    node 1's copies of A's 20 were never superseded (its rename failed)."""
    inv = Inventory()
    for n in (0, 1):
        for h in (0, 1):
            rel = layout.local_step if h == n else (lambda s, n=n: layout.replica_step(n, s))
            inv.add_copy(10, n, h, rel(10), A0, (0, 0), (2, 2))
            inv.add_copy(11, n, h, rel(11), B0, (1, 0), (2, 2))
    inv.add_copy(20, 1, 1, layout.local_step(20), A1, (0, 1), (2, 2))
    inv.add_copy(20, 0, 1, layout.replica_step(0, 20), A1, (0, 1), (2, 2))
    inv.add_persistent(10, A0, (0, 0))
    inv.add_persistent(20, A1, (0, 1))
    inv.add_persistent(11, B0, (1, 0))
    return inv


def test_restore_resumes_the_newest_save_not_the_highest_step():
    from tierckpt.restore.plan import choose

    inv = _timelines()
    assert inv.saves_newest_first() == [(11, B0), (20, A1), (10, A0)]
    assert inv.newest_save() == (11, B0) and inv.newest_persistent() == 11
    c = choose(inv, 2, set(), world_size=2)
    assert (c.step, c.save_id) == (11, B0) and {s.kind for s in c.sources.values()} == {"own-local"}, c
    # the explicit step is unchanged: the abandoned 20 can still be named
    c = choose(inv, 2, set(), step=20, world_size=2)
    assert (c.step, c.save_id) == (20, A1), c
    # legacy copies (no identity) keep ordering by step among themselves, before every identified save
    legacy = Inventory(local={0: {5, 30}, 1: {5, 30}})
    assert legacy.saves_newest_first() == [(30, None), (5, None)]
    legacy.add_copy(7, 0, 0, "local/step-7-id", B0, (1, 0))
    assert legacy.saves_newest_first()[0] == (7, B0)


def test_a_rollback_passes_over_newer_saves_by_order_and_higher_steps():
    from tierckpt.history.rollback import EXPLICIT, LEFTOVER, PendingRollback

    inv = _timelines()
    for n in (0, 1):  # node 0's step 20 of A was superseded (not listed): only node 1's are left
        inv.dirs.setdefault(10, set()).update({(0, layout.local_step(10)), (1, layout.local_step(10))})
        inv.dirs.setdefault(11, set()).update({(0, layout.local_step(11)), (1, layout.local_step(11))})
    inv.dirs[20] = {(1, layout.local_step(20)), (1, layout.replica_step(0, 20))}
    # a restart that resumed the newest save (B's 11) finds A's 20 left: leftovers, superseded
    rb = PendingRollback(11, inv, B0, "cccccccccccc", 0, LEFTOVER)
    assert rb.copies == {1: [(20, layout.local_step(20)), (20, layout.replica_step(0, 20))]} and rb.persistent == [20]
    assert rb.from_step == 20
    # an explicit rollback to A's 20 abandons B's 11 although its step number is lower
    rb = PendingRollback(20, inv, A1, "cccccccccccc", 0, EXPLICIT)
    assert sorted(rb.persistent) == [11] and rb.from_step == 11
    assert rb.copies == {0: [(11, layout.local_step(11))], 1: [(11, layout.local_step(11))]}
    # this run's own later saves are never passed over; older saves of lower steps are history
    assert not rb.passed_over(21, "cccccccccccc.0", (2, 0)) and not rb.passed_over(10, A0, (0, 0))


def _commit_saved(store, rel, step, sid, order):
    store.makedirs(rel)
    with store.open(f"{rel}/__0_0.distcp", "wb") as f:
        f.write(b"x%d" % step)
    manifest.commit(store, rel, [manifest.FileEntry("__0_0.distcp", *_h(store, f"{rel}/__0_0.distcp"))],
                    tier="persistent", step=step, save_id=sid, save_order=list(order))


def test_retention_keeps_the_newest_saves_not_the_highest_steps(tmp_path):
    """keep 1 after a rollback to 10 whose supersede of 20 failed: the new timeline's 11 is kept,
    the abandoned 20 (an older save) goes; legacy steps are older than every identified save."""
    store = Store(str(tmp_path))
    store.makedirs("")
    _commit_saved(store, "step-5", 5, None, (-1, -1))
    _commit_saved(store, "step-10", 10, A0, (0, 0))
    _commit_saved(store, "step-20", 20, A1, (0, 1))
    _commit_saved(store, "step-11", 11, B0, (1, 0))
    for s in (5, 10, 11, 20):
        store.write_atomic(f"step-{s}/{layout.INPROGRESS}", b"")
    assert sorted(purge_persistent(store, 2, InUse())) == [5, 10]
    assert manifest.read_committed(store, "step-11") is not None and manifest.read_committed(store, "step-20")
    assert purge_persistent(store, 1, InUse()) == [20]
    assert manifest.read_committed(store, "step-11") is not None


def test_durable_step_is_the_last_commit_still_there(tmp_path):
    from tierckpt.tiers.persistent import PersistentTier

    store = Store(str(tmp_path))
    store.makedirs("")
    _commit_saved(store, "step-20", 20, A1, (0, 1))
    _commit_saved(store, "step-15", 15, A1 + "x", (0, 3))
    tier = PersistentTier.__new__(PersistentTier)
    tier.store = store
    # this run committed 20, then (after an in-process rollback) 15: 15 is its newest save
    assert tier.newest_still_committed([20, 15]) == 15
    manifest.supersede(store, "step-15")
    assert tier.newest_still_committed([20, 15]) == 20
    assert tier.newest_save_step() == 20


def test_rollback_tracker_records_what_was_superseded_and_retries_what_failed(tmp_path, monkeypatch):
    """One process (no exchange): the record lists the copies actually renamed and the failed one
    with its error; the next commit retries it (a ``retry`` record); a copy replaced by this run's
    own save of the step is neither superseded nor failed."""
    from types import SimpleNamespace

    from tierckpt.history import rollback as rbm

    local, pfs = Store(str(tmp_path / "n0")), Store(str(tmp_path / "pfs"))
    _commit_saved(local, "local/step-20", 20, A1, (0, 1))
    _commit_saved(local, "local/step-30", 30, "cccccccccccc.0", (2, 0))  # this run's own save of step 30
    _commit_saved(local, "replicas/node-1/step-20", 20, A1, (0, 1))
    _commit_saved(pfs, "step-20", 20, A1, (0, 1))
    inv = Inventory()
    inv.dirs = {20: {(0, "local/step-20"), (0, "replicas/node-1/step-20")}, 30: {(0, "local/step-30")}}
    inv.saves = {20: {A1: {0: {0: "local/step-20"}, 1: {0: "replicas/node-1/step-20"}}},
                 30: {"aaaaaaaaaaaa.2": {0: {0: "local/step-30"}}}}
    inv.orders = {A1: (0, 1), "aaaaaaaaaaaa.2": (0, 2)}
    inv.add_persistent(20, A1, (0, 1))
    records = []
    journal = SimpleNamespace(rollback=lambda rb, tier, step, **kw: records.append((tier, step, kw)))
    tracker = rbm.RollbackTracker(journal, 0, local, pfs, ("local", "persistent"))
    real = manifest.supersede
    fails = {"replicas/node-1/step-20": 1}

    def flaky(store, rel, strict=False):
        if fails.get(rel):
            fails[rel] -= 1
            raise OSError(5, "injected", rel)
        return real(store, rel, strict)

    monkeypatch.setattr(manifest, "supersede", flaky)
    tracker.arm(10, inv, A0, "cccccccccccc", 0, rbm.EXPLICIT)
    assert tracker.wants("local") and tracker.wants("persistent")
    tracker.finish("local", 11)
    assert records[0][:2] == ("local", 11)
    assert records[0][2]["superseded"] == ["local node-0/20", "persistent/20"] and not records[0][2]["retry"]
    assert [f.split(":", 1)[0] for f in records[0][2]["failed"]] == ["replica node-1@node-0/20"]
    assert manifest.read_committed(local, "local/step-30") is not None  # replaced by this run: left alone
    assert tracker.wants("local")  # a copy failed: this tier retries at its next commit
    tracker.finish("local", 12)
    assert records[1][2] == {"superseded": ["replica node-1@node-0/20"], "failed": [], "retry": True}
    assert not tracker.wants("local") and tracker.wants("persistent")
    tracker.finish("persistent", 12)  # its first exchange: nothing new, no record; then done
    assert len(records) == 2 and not tracker.armed
    for store, rel in ((local, "local/step-20"), (local, "replicas/node-1/step-20"), (pfs, "step-20")):
        assert manifest.read_committed(store, rel) is None and manifest.superseded(store, rel), rel


# -- abandoned saves: proven by what each save descends from, not by renames (issue 28) ----------
def _d(parent, parent_order, step, since):
    from tierckpt.history.timeline import Descent

    return Descent(parent, parent_order, step, since)


def test_a_save_proves_the_saves_between_its_parent_and_its_run_abandoned():
    from tierckpt.history.timeline import abandoned_saves

    # A saved 10 (A0) and 20 (A1); run B rolled back to 10 and saved 11 (B0), 12 (B1)
    rb = _d(A0, (0, 0), 10, (1, 0))
    saves = {A0: ((0, 0), None), A1: ((0, 1), None), B0: ((1, 0), rb), B1: ((1, 1), rb)}
    assert abandoned_saves(saves) == {A1: B1}  # named by the newest save proving it
    # a fresh start (or an old manifest) proves nothing; copies without identity are never abandoned
    assert abandoned_saves({A0: ((0, 0), None), A1: ((0, 1), None), None: ((-1, -1), None)}) == {}
    legacy_parent = _d(None, (-1, -1), 5, (1, 0))
    assert abandoned_saves({None: ((-1, -1), None), A1: ((0, 1), None), B0: ((1, 0), legacy_parent)}) == {A1: B0}
    # the walk is newest first: an abandoned save proves nothing. Run C rolled back to A's 20 (its
    # rename had failed) after B had abandoned it: C abandons B, and B's proof no longer counts
    c = _d(A1, (0, 1), 20, (2, 0))
    saves[C0] = ((2, 0), c)
    assert abandoned_saves(saves) == {B0: C0, B1: C0}
    # a rollback inside one run: its saves after the restore prove its own saves in between
    inrun = _d(A0, (0, 0), 10, (0, 3))
    got = abandoned_saves({A0: ((0, 0), None), A1: ((0, 1), None), "aaaaaaaaaaaa.2": ((0, 2), None),
                           "aaaaaaaaaaaa.3": ((0, 3), inrun)})
    assert got == {A1: "aaaaaaaaaaaa.3", "aaaaaaaaaaaa.2": "aaaaaaaaaaaa.3"}
    # a live descent given by the caller (this run's own) proves as None
    assert abandoned_saves({A0: ((0, 0), None), A1: ((0, 1), None)}, proofs=(rb,)) == {A1: None}


C0 = "cccccccccccc.0"


def test_descends_from_in_the_manifest_and_its_tolerant_reader():
    from tierckpt.history.timeline import DESCENT_FIELD, SaveIdentity, Timeline, descent_of

    t = Timeline("bbbbbbbbbbbb", 1)
    assert t.for_step(5).manifest_fields() == {"save_id": "bbbbbbbbbbbb.0", "save_order": [1, 0], DESCENT_FIELD: None}
    t.restored((10, A0, (0, 0)), abandoned=[A1])
    ident = t.for_step(11)
    assert ident.descent == _d(A0, (0, 0), 10, (1, 1)) and ident.abandoned == {A1}
    doc = json_roundtrip({"tier": "local", "step": 11, **ident.manifest_fields()})
    assert list(doc) == ["tier", "step", "save_id", "save_order", "descends_from"]
    assert doc["descends_from"] == {"save_id": A0, "save_order": [0, 0], "step": 10, "since": [1, 1]}
    assert descent_of(doc) == ident.descent
    t.restored(None)  # a read-only explicit step: the saves prove nothing
    assert t.for_step(12).descent is None
    # older manifests (no field), null, and damaged values prove nothing
    for bad in ({}, {DESCENT_FIELD: None}, {DESCENT_FIELD: "x"}, {DESCENT_FIELD: {"save_id": A0}},
                {DESCENT_FIELD: {"save_id": 3, "save_order": [0, 0], "step": 1, "since": [1, 0]}},
                {DESCENT_FIELD: {"save_id": A0, "save_order": [0], "step": 1, "since": [1, 0]}}, None):
        assert descent_of(bad) is None, bad
    assert SaveIdentity("r", 0, 0) == SaveIdentity("r", 0, 0, abandoned=frozenset({"x"}))


def json_roundtrip(doc):
    import json

    return json.loads(json.dumps(doc))


def _double_fault() -> Inventory:
    """:func:`_timelines` with run B's copies recording that B rolled back to A's 10 — and every
    copy of B's 11 later corrupt (the test marks its sources bad)."""
    inv = _timelines()
    inv.descents[B0] = _d(A0, (0, 0), 10, (1, 0))
    return inv


def test_an_abandoned_save_is_never_planned_even_when_the_new_timeline_cannot_be_served():
    from tierckpt.restore.plan import choose

    inv = _double_fault()
    assert inv.abandoned() == {A1: B0} and inv.abandoned_saves() == [(20, A1, B0)]
    assert inv.saves_newest_first() == [(11, B0), (10, A0)] and inv.newest_persistent() == 11
    c = choose(inv, 2, set(), world_size=2)
    assert (c.step, c.save_id) == (11, B0), c
    # every source of B's 11 failed: the plan goes to the step B started from, never A's 20
    bad = {(n, k, h, 11) for n in (0, 1) for k, h in (("own-local", n), ("peer-replica", 1 - n),
                                                       ("persistent", None))}
    bad.add((-1, "in-cluster", None, 11))
    c = choose(inv, 2, bad, world_size=2)
    assert (c.step, c.save_id) == (10, A0), c
    assert choose(inv, 2, bad, world_size=2, kinds=("persistent",)).step == 10
    # an explicit step names no abandoned save either (as if its markers had been renamed)
    assert choose(inv, 2, set(), step=20, world_size=2) is None and inv.save_ids(20) == []
    # the record's reason, and the message when nothing is left
    from tierckpt.restore.restorer import _no_checkpoint_message, _skipped

    assert _skipped(inv, 10, A0) == [{"step": 20, "save_id": A1, "by": B0}] and _skipped(inv, 11, B0) == []
    assert f"step 20 (save {A1}, abandoned by save {B0})" in _no_checkpoint_message(20, inv, [])


def test_a_leftover_supersede_takes_every_abandoned_save_whatever_its_step():
    from tierckpt.history.rollback import LEFTOVER, PendingRollback

    inv = _double_fault()
    inv.add_copy(30, 0, 0, layout.local_step(30), B1, (1, 1), (2, 2), _d(A0, (0, 0), 10, (1, 0)))
    inv.add_copy(30, 1, 1, layout.local_step(30), B1, (1, 1), (2, 2), _d(A0, (0, 0), 10, (1, 0)))
    inv.add_copy(15, 1, 1, layout.local_step(15), "aaaaaaaaaaaa.9", (0, 9), (2, 2))  # abandoned too
    inv.dirs = {s: {(h, rel) for by_n in inv.copies[s].values() for h, rel in by_n.items()} for s in inv.copies}
    rb = PendingRollback(30, inv, B1, "dddddddddddd", 0, LEFTOVER)
    assert rb.copies == {1: [(15, layout.local_step(15)), (20, layout.local_step(20)), (20, layout.replica_step(0, 20))]}
    assert rb.persistent == [20]


def test_retention_never_counts_nor_deletes_an_abandoned_save(tmp_path):
    """keep 2 on a node whose rename of the abandoned 20 failed: the new timeline's 11 and the step
    it started from (10) are kept, 20 takes no slot (and is left for the next start's supersede)."""
    from tierckpt.tiers.retention import purge_local

    store = Store(str(tmp_path))
    b = _d(A0, (0, 0), 10, (1, 0))

    def commit(rel, step, sid, order, descent=None, store=store):
        store.makedirs(rel)
        with store.open(f"{rel}/__0_0.distcp", "wb") as f:
            f.write(b"x%d" % step)
        manifest.commit(store, rel, [manifest.FileEntry("__0_0.distcp", *_h(store, f"{rel}/__0_0.distcp"))],
                        tier="local", step=step, node=1, save_id=sid, save_order=list(order),
                        descends_from=None if descent is None else descent.manifest_value())

    commit("local/step-10", 10, A0, (0, 0))
    commit("local/step-20", 20, A1, (0, 1))
    commit("local/step-11", 11, B0, (1, 0), b)
    assert purge_local(store, 2, InUse()) == {"local": []}
    commit("local/step-12", 12, B1, (1, 1), b)
    assert purge_local(store, 2, InUse(), protect={20}) == {"local": [10]}  # protecting it gives it no slot
    assert manifest.read_committed(store, "local/step-20") is not None  # kept, not counted
    # the prover on another disk only: the caller's knowledge (the restore's inventory, its own
    # descent) counts the same; without it (an older run's view) today's rule applies
    other = Store(str(tmp_path / "other"))
    commit("replicas/node-0/step-10", 10, A0, (0, 0), store=other)
    commit("replicas/node-0/step-20", 20, A1, (0, 1), store=other)
    assert purge_local(other, 1, InUse(), abandoned={A1}) == {"local": [], "node-0": []}
    assert purge_local(other, 1, InUse(), proofs=(b,)) == {"local": [], "node-0": []}
    assert purge_local(other, 1, InUse()) == {"local": [], "node-0": [10]}


def test_persistent_retention_and_durable_step_skip_abandoned_saves(tmp_path):
    from tierckpt.tiers.persistent import PersistentTier

    store = Store(str(tmp_path))
    store.makedirs("")
    b = _d(A0, (0, 0), 10, (1, 0))
    _commit_saved(store, "step-10", 10, A0, (0, 0))
    _commit_saved(store, "step-20", 20, A1, (0, 1))
    store.makedirs("step-11")
    with store.open("step-11/__0_0.distcp", "wb") as f:
        f.write(b"x11")
    manifest.commit(store, "step-11", [manifest.FileEntry("__0_0.distcp", *_h(store, "step-11/__0_0.distcp"))],
                    tier="persistent", step=11, save_id=B0, save_order=[1, 0], descends_from=b.manifest_value())
    for s in (10, 11, 20):
        store.write_atomic(f"step-{s}/{layout.INPROGRESS}", b"")
    assert purge_persistent(store, 1, InUse()) == [10]
    assert manifest.read_committed(store, "step-20") is not None and manifest.read_committed(store, "step-11")
    tier = PersistentTier.__new__(PersistentTier)
    tier.store = store
    assert tier.survey()[11] == (B0, (1, 0), b) and tier.committed_saves()[11] == (B0, (1, 0))
    # a run that committed 20 then rolled back (in-run) to 10 and saved on: 20 is not durable
    inrun = _d(A0, (0, 0), 10, (0, 2))
    assert tier.newest_still_committed([20]) == 20
    assert tier.newest_still_committed([20], alive=lambda doc: not inrun.covers(*of_manifest(doc))) is None


def of_manifest(doc):
    from tierckpt.history.timeline import of_manifest as real

    return real(doc)
