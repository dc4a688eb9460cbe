"""The fault campaign's plans and invariant checker (bench/fault_campaign.py, bench/campaign_checks.py),
without processes: the checks must be able to fail, so each is fed a deliberately wrong outcome."""

from __future__ import annotations

import json
import os
import shutil
from collections import Counter

import pytest

from bench import campaign_checks as checks
from bench import fault_campaign as fc
from tierckpt.io import manifest
from tierckpt.io.storage import Store


def _commit(root: str, rel: str, *, node: int | None, step: int, nodes: int = 2) -> None:
    """A small committed step directory: .metadata and one data file, manifest and marker."""
    store = Store(root)
    entries = []
    for name, data in ((".metadata", b"meta %d" % step), ("__0_0.distcp", b"data %d %s" % (step, str(node).encode()))):
        with store.open(f"{rel}/{name}", "wb") as f:
            f.write(data)
        e = manifest.hash_file(store, f"{rel}/{name}")
        entries.append(manifest.FileEntry(name, e.size, e.xxh3_64))
    meta = {"tier": "local" if node is not None else "persistent", "step": step, "world_size": nodes}
    if node is not None:
        meta.update(node=node, nodes=nodes)
    manifest.commit(store, rel, entries, **meta)


@pytest.fixture
def disk(tmp_path):
    """2 nodes, F = 2: steps 2 and 3 on node 0 (own + node 1's replica of 2), step 2 on node 1
    (own + node 0's replica of 2 and 3), persistent step 1; node 1's own step 3 is torn."""
    base = str(tmp_path)
    n0, n1, pfs = (os.path.join(base, "nvme", "node-0"), os.path.join(base, "nvme", "node-1"),
                   os.path.join(base, "pfs"))
    for s in (2, 3):
        _commit(n0, f"local/step-{s}", node=0, step=s)
        _commit(n1, f"replicas/node-0/step-{s}", node=0, step=s)
    _commit(n1, "local/step-2", node=1, step=2)
    _commit(n0, "replicas/node-1/step-2", node=1, step=2)
    os.makedirs(os.path.join(n1, "local", "step-3"))
    with open(os.path.join(n1, "local", "step-3", "__0_0.distcp"), "wb") as f:
        f.write(b"torn")
    _commit(pfs, "step-1", node=None, step=1)
    return base


def test_plans_are_reproducible_and_cover_every_point_ten_times_in_300_trials():
    assert fc.make_plan(7, 33) == fc.make_plan(7, 33)
    counts = Counter(fc.make_plan(0, i).point for i in range(300))
    assert set(counts) == set(fc.POINTS) and min(counts.values()) >= 10, counts
    for i in range(300):
        p = fc.make_plan(0, i)
        assert p.nodes in (2, 3, 4) and p.nodes % p.factor == 0 and p.script[0] == "train", p
        json.dumps(p.__dict__)  # handed to the rank processes as is


def test_expected_step_is_the_newest_step_complete_for_every_node(disk):
    copies = checks.scan_disk(disk)
    assert checks.expected_step(copies, 2) == 2  # node 1 has no committed copy of step 3
    torn = [c for c in copies if c.path == "node-1/local/step-3"]
    assert torn and not torn[0].committed
    # node 1 lost with every copy of its state: only the persistent step serves both nodes
    assert checks.expected_step([c for c in copies if c.node != 1], 2) == 1
    assert checks.expected_step([], 2) is None and not checks.any_committed([])


def test_checker_flags_a_wrong_restored_step_and_wrong_state(disk):
    copies = checks.scan_disk(disk)
    exp = checks.expected_step(copies, 2)
    good = {0: {"step": 2, "error": None, "mismatch": None}, 1: {"step": 2, "error": None, "mismatch": None}}
    assert checks.check_restored(exp, True, good) == []
    wrong = {**good, 1: {"step": 1, "error": None, "mismatch": None}}
    assert any("restored step 1" in v for v in checks.check_restored(exp, True, wrong))
    bits = {**good, 0: {"step": 2, "error": None, "mismatch": "state.model.w differs"}}
    assert any("differs" in v for v in checks.check_restored(exp, True, bits))
    raw = {**good, 0: {"step": None, "error": "RuntimeError: Pair is not connected", "mismatch": None}}
    assert any("Pair is not connected" in v for v in checks.check_restored(exp, True, raw))
    # nothing complete but something committed: NoCheckpointError, never a fresh start
    fresh = {0: {"step": None, "error": None}, 1: {"step": None, "error": None}}
    assert checks.check_restored(None, True, fresh)
    assert checks.check_restored(None, True, {0: {"error": "NoCheckpointError: x"}}) == []
    assert checks.check_restored(None, False, fresh) == []
    # a source that was not on disk
    assert checks.check_sources({"0": ["own-local", 0], "1": ["peer-replica", 0]}, 2, copies) == []
    assert checks.check_sources({"0": ["own-local", 0], "1": ["own-local", 1]}, 3, copies)


def test_checker_flags_a_deleted_committed_step(disk):
    before = checks.scan_disk(disk)
    assert checks.check_no_loss(before, before, keep_local=1, keep_persistent=1, allow_retention=False) == []
    shutil.rmtree(os.path.join(disk, "nvme", "node-0", "replicas", "node-1", "step-2"))
    after = checks.scan_disk(disk)
    lost = checks.check_no_loss(before, after, keep_local=1, keep_persistent=1, allow_retention=True)
    assert lost == ["committed copy lost: node 1's step 2 had 2 committed copies before, 1 after"], lost
    # a copy on a node that was lost on purpose is not counted
    assert checks.check_no_loss(before, after, keep_local=1, keep_persistent=1, allow_retention=False,
                                lost_holders={0}) == []
    # retention may purge node 0's step 2 once a newer step of node 0 is committed (keep 1), not with keep 2
    os.remove(os.path.join(disk, "nvme", "node-0", "local", "step-2", "tierckpt.committed"))
    after = checks.scan_disk(disk)
    kw = dict(keep_persistent=1)
    assert not [v for v in checks.check_no_loss(before, after, keep_local=1, allow_retention=True, **kw)
                if "node 0's" in v]
    assert [v for v in checks.check_no_loss(before, after, keep_local=2, allow_retention=True, **kw) if "node 0's" in v]


def test_checker_flags_a_visible_uncommitted_step(disk):
    copies = checks.scan_disk(disk)
    rows, verify_doc, problems = checks.run_cli(disk)
    assert problems == [] and checks.check_visible(rows, verify_doc, copies, disk) == []
    assert sum(r["committed"] for r in rows) == 7 and len(rows) == 8
    # a row claiming the torn step is committed
    torn = os.path.join(disk, "nvme", "node-1", "local", "step-3")
    fake = rows + [{"path": torn, "committed": True}]
    assert any("not committed on disk" in v for v in checks.check_visible(fake, verify_doc, copies, disk))
    # a committed step whose data file vanished: ls still says committed, the checker does not agree
    os.remove(os.path.join(disk, "nvme", "node-0", "local", "step-3", "__0_0.distcp"))
    copies = checks.scan_disk(disk)
    rows, verify_doc, _ = checks.run_cli(disk)
    found = checks.check_visible(rows, verify_doc, copies, disk)
    assert any("ls shows" in v and "step-3" in v for v in found), found
    assert any("verify" in v and "CORRUPT" in v for v in found), found


def test_ledger_checks(tmp_path):
    good = [json.dumps({"kind": "run_start"}).encode(), b'{"kind": "checkp', json.dumps({"kind": "restore"}).encode()]
    assert checks.check_ledger_parse(good, torn_injected=1) == []
    assert checks.check_ledger_parse(good, torn_injected=0)
    merged = [b'{"kind": "checkp{"kind": "restore", "step": 3}']
    assert any("appended onto a torn line" in v for v in checks.check_ledger_parse(merged, torn_injected=1))
    rec = {"kind": "restore", "step": 3, "sources": {"0": {"source": "own-local", "holder": 0}}}
    assert checks.check_restore_record([rec], 3, {"0": ["own-local", 0]}) == []
    assert checks.check_restore_record([rec], 3, {"0": ["peer-replica", 1]})
    assert checks.check_restore_record([], 3, {"0": ["own-local", 0]})
    failed = {"kind": "checkpoint", "tier": "local", "step": 4, "ok": False}
    assert checks.check_failure_records([failed], "local", [4]) == []
    assert checks.check_failure_records([failed], "local", [4, 5])
    assert checks.check_failure_records([], "local", [], skipped_node=1)


def _save_flat(path: str, sd: dict) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save(sd, checkpoint_id=path, no_dist=True)


def test_check_per_rank_files_flags_a_rank_that_got_another_ranks_value(tmp_path):
    """A persistent step written with one copy per key (DCP's default) fails the check; one with
    every rank's qualified values and rank 0's plain copy passes; so does a node-local step
    holding its node's own values, and not one holding another node's."""
    from tierckpt.io.per_rank import qualified

    base = str(tmp_path)
    step = 3

    def flat(rank, prefix=""):
        v = checks.per_rank_values(rank, step)
        return {f"{prefix}per_rank.probe": v["probe"], f"{prefix}per_rank.rng": v["rng"],
                f"{prefix}per_rank.counter": v["counter"], f"{prefix}per_rank.obj.rank": v["obj"]["rank"],
                f"{prefix}per_rank.obj.step": v["obj"]["step"]}

    good = flat(0)
    for r in range(2):  # obj.step is the same on both ranks: plain only
        good.update({qualified(r, k): v for k, v in flat(r).items() if k != "per_rank.obj.step"})
    _save_flat(os.path.join(base, "pfs", "step-3"), good)
    _save_flat(os.path.join(base, "pfsbad", "step-3"), flat(0))
    _save_flat(os.path.join(base, "nvme", "node-1", "local", "step-3"), flat(1))
    _save_flat(os.path.join(base, "nvme", "node-0", "replicas", "node-1", "step-3"), flat(0))
    pfs = checks.Copy("pfs", None, "step-3", step, None, True, True, world_size=2)
    own = checks.Copy("node-1", 1, "local/step-3", step, 1, True, True)
    wrong = checks.Copy("node-0", 0, "replicas/node-1/step-3", step, 1, True, True)
    assert checks.check_per_rank_files([pfs, own], base) == []
    bad = checks.check_per_rank_files([wrong], base)
    assert len(bad) == 4 and all("rank 1's value" in b for b in bad), bad  # obj.step is the same
    shutil.move(os.path.join(base, "pfs"), os.path.join(base, "pfsgood"))
    shutil.move(os.path.join(base, "pfsbad"), os.path.join(base, "pfs"))
    bad = checks.check_per_rank_files([pfs], base)
    assert bad and "not all readable" in bad[0], bad
    shutil.rmtree(os.path.join(base, "pfs"))
    _save_flat(os.path.join(base, "pfs", "step-3"), {**good, qualified(0, "per_rank.obj.step"): step})
    bad = checks.check_per_rank_files([pfs], base)
    assert bad and "written per rank too" in bad[0], bad
