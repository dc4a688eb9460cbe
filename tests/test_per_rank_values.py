"""Values that differ per rank under one key come back to their own rank (issue 28 case B).

Every rank saves ``probe``/``rng``/``counter``/``obj`` of its own under the same keys
(tests/scenarios_per_rank.py) to every tier, with 1 and 2 ranks per node, and restores from
each source: its own node-local copy, a peer's replica, the persistent tier only, and the
node-local copies after a world-size change (in-cluster). Every rank must get its own values
bitwise; replicated values stay one copy; a stock ``dcp.load`` reads the persistent step.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from tests import scenarios_per_rank as sp
from tests.harness import run_world
from tests.scenarios import assert_bitwise
from tierckpt.io import per_rank

K = 2


@pytest.fixture(scope="module", params=[1, 2], ids=["1-rank-per-node", "2-ranks-per-node"])
def saved(request, tmp_path_factory):
    rpn = request.param
    base = str(tmp_path_factory.mktemp(f"perrank-r{rpn}"))
    run_world(sp.phase_save, 2 * rpn, base, rpn, K)
    return base, rpn


def _copy(saved, tmp_path):
    base, rpn = saved
    dst = str(tmp_path / "run")
    shutil.copytree(base, dst)
    return dst, rpn


def _restore(base, world, rpn, saved_world):
    return [r.value for r in run_world(sp.phase_restore, world, base, rpn, saved_world)]


def _kinds(out):
    return {kind for o in out for kind, _ in o["sources"].values()}


def _ledger(base):
    with open(os.path.join(base, "pfs", "tierckpt-ledger.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def _check_restored(base, out, sources, attempts=1):
    """Every rank restored step K of one save from ``sources`` ({node: kind}) — the ranks' own
    values were asserted bitwise in the rank function — and the ledger's last ``restore`` record
    says the same: step K, that save, those per-node sources, no failure (``attempts`` rounds)."""
    assert all(o["step"] == K for o in out), out
    assert len({o["save_id"] for o in out}) == 1 and out[0]["save_id"] is not None, out
    assert all({n: k for n, (k, _) in o["sources"].items()} == sources for o in out), out
    rec = [r for r in _ledger(base) if r["kind"] == "restore"][-1]
    assert rec["step"] == K and rec["save_id"] == out[0]["save_id"] and rec["attempts"] == attempts, rec
    assert {int(n): v["source"] for n, v in rec["sources"].items()} == sources and not rec["failures"], rec
    with open(os.path.join(base, "pfs", f"step-{K}", "tierckpt.manifest.json")) as f:
        assert json.load(f)["save_id"] == rec["save_id"], rec  # the one save of step K (every tier)


def test_own_local(saved, tmp_path):
    base, rpn = _copy(saved, tmp_path)
    out = _restore(base, 2 * rpn, rpn, 2 * rpn)
    _check_restored(base, out, {0: "own-local", 1: "own-local"})


def test_peer_replica(saved, tmp_path):
    base, rpn = _copy(saved, tmp_path)
    shutil.rmtree(os.path.join(base, "nvme", "node-1", "local", f"step-{K}"))
    out = _restore(base, 2 * rpn, rpn, 2 * rpn)
    _check_restored(base, out, {0: "own-local", 1: "peer-replica"})
    assert all(o["sources"][1] == ("peer-replica", 0) for o in out), out


def test_persistent_only(saved, tmp_path):
    base, rpn = _copy(saved, tmp_path)
    shutil.rmtree(os.path.join(base, "nvme"))
    out = _restore(base, 2 * rpn, rpn, 2 * rpn)
    _check_restored(base, out, {0: "persistent", 1: "persistent"})


def test_in_cluster_after_world_size_change(saved, tmp_path):
    """2×1 → 2×2 (new ranks 2, 3 get rank 0's values); 2×2 → 2×1."""
    base, rpn = _copy(saved, tmp_path)
    new_rpn = 2 if rpn == 1 else 1
    out = _restore(base, 2 * new_rpn, new_rpn, 2 * rpn)
    _check_restored(base, out, {0: "in-cluster", 1: "in-cluster"})
    assert [o["probe"] for o in out[:min(2 * rpn, 2 * new_rpn)]] == [100.0 + r for r in range(min(2 * rpn, 2 * new_rpn))]
    rec = [r for r in _ledger(base) if r["kind"] == "restore"][-1]
    assert rec["resharded"] == {"from": {"nodes": 2, "world_size": 2 * rpn},
                                "to": {"nodes": 2, "world_size": 2 * new_rpn}}, rec


def test_in_cluster_refused_when_a_ranks_value_is_lost(saved, tmp_path):
    """2×rpn → 4×1 with every copy of node 1 gone: the node-local copies cannot tell node 1's
    ranks' values, so the in-cluster read is refused and they read their own from persistent."""
    base, rpn = _copy(saved, tmp_path)
    shutil.rmtree(os.path.join(base, "nvme", "node-1"))
    shutil.rmtree(os.path.join(base, "nvme", "node-0", "replicas", "node-1"))
    out = [r.value for r in run_world(sp.phase_restore, 4, base, 1, 2 * rpn)]
    assert all(o["step"] == K and {k for k, _ in o["sources"].values()} == {"persistent"} for o in out), out
    rec = [r for r in _ledger(base) if r["kind"] == "restore"][-1]
    assert rec["step"] == K and rec["save_id"] == out[0]["save_id"], rec
    assert {v["source"] for v in rec["sources"].values()} == {"persistent"} and len(rec["sources"]) == 4, rec


def test_files_one_copy_of_replicated_values_and_stock_load(saved):
    """Per-rank keys only for values that differ; stock DCP still loads the plain keys."""
    base, rpn = saved
    world = 2 * rpn
    step = os.path.join(base, "pfs", f"step-{K}")
    keys = set(FileSystemReader(step).read_metadata().state_dict_metadata)
    per_key = {"probe", "rng", "counter", "obj.rank", "obj.tag"}
    assert keys == per_key | {"shared", "note"} | {per_rank.qualified(r, k) for r in range(world) for k in per_key}
    for node in range(2):
        local = os.path.join(base, "nvme", f"node-{node}", "local", f"step-{K}")
        lkeys = set(FileSystemReader(local).read_metadata().state_dict_metadata)
        ranks = range(node * rpn, (node + 1) * rpn)
        # a node of one rank has nothing that differs inside it: no qualified key
        want = {per_rank.qualified(r, k) for r in ranks for k in per_key} if rpn > 1 else set()
        assert lkeys == per_key | {"shared", "note"} | want, (node, lkeys)
    # the step before, saved with the same value on every rank: no qualified key anywhere
    first = [os.path.join(base, "pfs", f"step-{K - 1}")] + [
        os.path.join(base, "nvme", f"node-{n}", "local", f"step-{K - 1}") for n in range(2)]
    for d in first:
        assert set(FileSystemReader(d).read_metadata().state_dict_metadata) == per_key | {"shared", "note"}, d
    sd = sp.template()
    dcp.load(sd, checkpoint_id=step, no_dist=True)
    assert_bitwise(sd, sp.expected(0), "stock dcp.load")  # the plain keys hold rank 0's values
