"""In-cluster resharded restore: a job of another shape loads from the node-local copies.

A job saves every tier (local, replicas with replication_factor 2, persistent) at step K; a
job of another shape restores it. Every tensor of the model and of AdamW's state must equal
the saved global value bitwise (tests/scenarios_reshard.py), with these sources:

- 4 nodes → 3 (node 3 lost for good: its disk is gone): every node in-cluster, no persistent byte;
- 2 nodes → 3 (a new empty node): in-cluster;
- 2 nodes × 2 ranks → 2 nodes × 1 rank: in-cluster;
- 4 → 3 with replication_factor 1 (node 3's shards exist nowhere in the cluster): the
  persistent tier, and the ledger names the missing chunks; without a persistent tier, a
  NoCheckpointError naming them;
- a corrupt data file in node 0's own copy: node 0's chunks come from the next holder (node 1).
"""

from __future__ import annotations

import json
import os
import shutil

import pytest

from tests import scenarios_reshard as sr
from tests.harness import run_world

K = 3


def _save(tmp_path_factory, world, rpn, factor):
    base = str(tmp_path_factory.mktemp(f"save-w{world}r{rpn}f{factor}"))
    run_world(sr.phase_save, world, base, rpn, K, {"replication_factor": factor})
    return base


@pytest.fixture(scope="module")
def four_nodes(tmp_path_factory):
    return _save(tmp_path_factory, 4, 1, 2)


@pytest.fixture(scope="module")
def four_nodes_f1(tmp_path_factory):
    return _save(tmp_path_factory, 4, 1, 1)


def _copy(src, tmp_path):
    dst = str(tmp_path / "run")
    shutil.copytree(src, dst)
    return dst


def _lose_node(base, node):
    shutil.rmtree(os.path.join(base, "nvme", f"node-{node}"))


def _restore(base, world, rpn, factor=1, expect_ok=True):
    return run_world(sr.phase_restore, world, base, rpn, {"replication_factor": factor}, expect_ok)[0].value


def _restore_records(base):
    with open(os.path.join(base, "pfs", "tierckpt-ledger.jsonl")) as f:
        return [r for r in map(json.loads, f) if r["kind"] == "restore"]


def test_four_nodes_to_three_in_cluster(four_nodes, tmp_path):
    base = _copy(four_nodes, tmp_path)
    _lose_node(base, 3)
    out = _restore(base, 3, 1)
    assert out["step"] == K
    assert set(out["sources"].values()) == {("in-cluster", None)}, out
    assert out["persistent_bytes"] == 0
    assert out["resharded"] == {"from": {"nodes": 4, "world_size": 4}, "to": {"nodes": 3, "world_size": 3}}
    assert out["attempts"] == 1 and not out["failures"]
    rec = _restore_records(base)[-1]
    assert rec["persistent_bytes"] == 0 and rec["resharded"]["to"]["nodes"] == 3
    assert {v["source"] for v in rec["sources"].values()} == {"in-cluster"}


def test_two_nodes_to_three_in_cluster(tmp_path_factory, tmp_path):
    base = _copy(_save(tmp_path_factory, 2, 1, 2), tmp_path)
    out = _restore(base, 3, 1)
    assert set(out["sources"].values()) == {("in-cluster", None)}, out
    assert out["persistent_bytes"] == 0 and out["bytes"][2] > 0  # the new node got its chunks over the network


def test_ranks_per_node_two_to_one_in_cluster(tmp_path_factory, tmp_path):
    base = _copy(_save(tmp_path_factory, 4, 2, 2), tmp_path)
    out = _restore(base, 2, 1, factor=2)
    assert set(out["sources"].values()) == {("in-cluster", None)}, out
    assert out["resharded"]["from"] == {"nodes": 2, "world_size": 4}
    assert out["persistent_bytes"] == 0


def test_missing_chunks_fall_back_to_persistent_and_are_named(four_nodes_f1, tmp_path):
    base = _copy(four_nodes_f1, tmp_path)
    _lose_node(base, 3)
    out = _restore(base, 3, 1)
    assert set(out["sources"].values()) == {("persistent", None)}, out
    assert out["persistent_bytes"] > 0 and out["attempts"] == 2
    assert out["missing"] and all("elements in-cluster" in m or "in no in-cluster copy" in m for m in out["missing"])
    assert any("saved node(s) [3]" in f[4] for f in out["failures"]), out["failures"]
    rec = _restore_records(base)[-1]
    assert rec["missing"] == out["missing"]
    assert any(f["source"] == "in-cluster" for f in rec["failures"])


def test_missing_chunks_without_persistent_name_them(four_nodes_f1, tmp_path):
    base = _copy(four_nodes_f1, tmp_path)
    _lose_node(base, 3)
    shutil.rmtree(os.path.join(base, "pfs", f"step-{K}"))
    out = _restore(base, 3, 1, expect_ok=False)
    assert "saved node(s) [3]" in out["error"] and "in-cluster" in out["error"], out


def test_corrupt_copy_reads_from_the_next_holder(four_nodes, tmp_path):
    base = _copy(four_nodes, tmp_path)
    _lose_node(base, 3)
    step_dir = os.path.join(base, "nvme", "node-0", "local", f"step-{K}")
    data = sorted(f for f in os.listdir(step_dir) if f.endswith(".distcp"))[0]
    with open(os.path.join(step_dir, data), "r+b") as f:
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 0xFF]))
    out = _restore(base, 3, 1)
    assert set(out["sources"].values()) == {("in-cluster", None)}, out
    assert out["attempts"] == 2 and out["persistent_bytes"] == 0
    assert any("copy of node 0 on node 0" in f[4] for f in out["failures"]), out["failures"]
