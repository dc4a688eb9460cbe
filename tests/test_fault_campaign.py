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


def _commit(root: str, rel: str, *, node: int | None, step: int, nodes: int = 2, save: str | None = None,
            order: tuple[int, int] | None = None, descends_from: dict | None = None) -> None:
    """A small committed step directory: .metadata and one data file, manifest and marker
    (``save``/``order``: the save identity its manifest records; ``descends_from``: its run's parent)."""
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
    if save is not None:
        meta.update(save_id=save, save_order=list(order or (0, 0)))
    if descends_from is not None:
        meta.update(descends_from=descends_from)
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


@pytest.fixture
def two_timelines(tmp_path):
    """2 nodes, F = 2. Timeline A (run ``a``, generation 0) saved steps 4 and 5 everywhere and
    persistent step 4; node 0's own step 5 and node 0's replica of node 1's step 5 are corrupt. A
    fallback to 4 started timeline B (run ``b``, generation 1), which saved step 5 local-only on
    node 1 (replacing A's copy there) and superseded nothing yet (it died before its first
    commit's supersede): per node, step 5 has an intact copy (node 0: A's replica on node 1;
    node 1: B's own), but of two saves."""
    base = str(tmp_path)
    roots = [os.path.join(base, "nvme", f"node-{n}") for n in (0, 1)]
    for s, seq in ((4, 0), (5, 1)):
        for n in (0, 1):
            _commit(roots[n], f"local/step-{s}", node=n, step=s, save=f"a.{seq}", order=(0, seq))
            _commit(roots[1 - n], f"replicas/node-{n}/step-{s}", node=n, step=s, save=f"a.{seq}", order=(0, seq))
    _commit(os.path.join(base, "pfs"), "step-4", node=None, step=4, save="a.0", order=(0, 0))
    for rel, root in (("local/step-5", roots[0]), ("replicas/node-1/step-5", roots[0])):
        with open(os.path.join(root, rel, "__0_0.distcp"), "r+b") as f:
            f.write(b"X")
    # timeline B's step 5 on node 1 replaces A's own copy there (node 0's own dir stays A's, corrupt)
    shutil.rmtree(os.path.join(roots[1], "local", "step-5"))
    _commit(roots[1], "local/step-5", node=1, step=5, save="b.0", order=(1, 0))
    return base


def test_expected_save_never_combines_two_saves_under_one_step(two_timelines):
    copies = checks.scan_disk(two_timelines)
    assert {c.save_id for c in copies if c.step == 5 and c.committed} == {"a.1", "b.0"}
    # every node has an intact copy of step 5, but of two saves: not a restorable step
    assert checks.expected_save(copies, 2) == (4, "a.0") and checks.expected_step(copies, 2) == 4
    # B's copy of node 0 appears: B's step 5 is complete, and it orders after A's
    extra = checks.Copy("node-0", 0, "elsewhere/step-5", 5, 0, True, True, 2, 2, [], "b.0", (1, 0))
    assert checks.expected_save(copies + [extra], 2) == (5, "b.0")
    assert checks.expected_save(copies + [extra], 2, step=4) == (4, "a.0")
    # JSON round trip (the pre-fault snapshot file) keeps the order a tuple
    again = checks.copies_from_json([json.loads(json.dumps(c.__dict__)) for c in copies])
    assert [(c.save_id, c.order) for c in again] == [(c.save_id, c.order) for c in copies]


def test_one_save_check_flags_a_restore_that_combined_two_saves(two_timelines):
    copies = checks.scan_disk(two_timelines)
    ok = {"kind": "restore", "step": 4, "save_id": "a.0", "sources": {
        "0": {"source": "own-local", "holder": 0}, "1": {"source": "peer-replica", "holder": 0}}}
    assert checks.check_one_save(ok, checks.served_by_record(ok, copies), strict=True) == []
    pers = {**ok, "sources": {"0": {"source": "persistent", "holder": None}, "1": {"source": "persistent", "holder": None}}}
    assert checks.check_one_save(pers, checks.served_by_record(pers, copies), strict=True) == []
    # step 5: node 0 from A's replica on node 1, node 1 from B's own copy: a mix, whatever the record says
    mix = {"kind": "restore", "step": 5, "save_id": "b.0", "sources": {
        "0": {"source": "peer-replica", "holder": 1}, "1": {"source": "own-local", "holder": 1}}}
    found = checks.check_one_save(mix, checks.served_by_record(mix, copies), strict=True)
    assert len(found) == 1 and "node 0" in found[0] and "a.1" in found[0], found
    assert len(checks.check_one_save({**mix, "save_id": "a.1"}, checks.served_by_record(mix, copies), strict=True)) == 1
    # a legacy record (no save id) over identified copies is a violation too
    assert checks.check_one_save({**ok, "save_id": None}, checks.served_by_record(ok, copies), strict=True)
    # a served copy gone: a violation only where nothing may have deleted it
    gone = {"kind": "restore", "step": 3, "save_id": "a.0", "sources": {"0": {"source": "own-local", "holder": 0}}}
    assert checks.check_one_save(gone, checks.served_by_record(gone, copies), strict=True)
    assert checks.check_one_save(gone, checks.served_by_record(gone, copies), strict=False) == []


def test_new_timeline_check_flags_unsuperseded_copies_and_a_lost_last_save(two_timelines):
    base = two_timelines
    before = checks.scan_disk(base)
    # B saved step 5 (save b.0) on node 1 only: its last save is not the newest complete one
    recs = [{"kind": "rollback", "from_step": 5, "to_step": 4, "cause": "fallback",
             "superseded": ["local node-0/5", "replica node-0@node-1/5", "replica node-1@node-0/5"]},
            {"kind": "run_end", "clean": True, "durable_step": None}]
    kw = dict(nodes=2, to_step=4, keep="a.0", saved=[(5, "b.0", ["local"])], cause="fallback",
              keep_local=2, keep_persistent=2)
    found = checks.check_new_timeline(before, before, recs, **kw)
    # A's step 5 is still committed on node 0 (own) and as both replicas
    assert len([v for v in found if v.startswith("abandoned timeline")]) == 3, found
    assert any("should be the newest save complete on disk" in v for v in found), found
    # supersede A's copies and give B node 0's copy: nothing left to flag
    for rel in ("nvme/node-0/local/step-5", "nvme/node-0/replicas/node-1/step-5", "nvme/node-1/replicas/node-0/step-5"):
        os.rename(os.path.join(base, rel, "tierckpt.committed"), os.path.join(base, rel, "tierckpt.committed.superseded"))
    shutil.rmtree(os.path.join(base, "nvme", "node-0", "local", "step-5"))
    _commit(os.path.join(base, "nvme", "node-0"), "local/step-5", node=0, step=5, save="b.0", order=(1, 0))
    after = checks.scan_disk(base)
    assert checks.check_new_timeline(before, after, recs, base=base, **kw) == []
    # the record must name every copy superseded on disk, only abandoned ones, and nothing failed
    for wrong in (["replica node-0@node-1/5"], ["replica node-0@node-1/5", "replica node-1@node-0/5", "local node-1/4"]):
        bad = [{**recs[0], "superseded": wrong}, recs[1]]
        assert any("the rollback record names" in v for v in checks.check_new_timeline(before, after, bad, base=base, **kw))
    failed = [{**recs[0], "failed": ["replica node-0@node-1/5: OSError"]}, recs[1]]
    assert any("the rollback record names" in v for v in checks.check_new_timeline(before, after, failed, **kw))
    # the durable step must be the run's newest persistent step, and exist
    bad_end = [recs[0], {"kind": "run_end", "durable_step": 4}]
    assert any("durable_step 4" in v for v in checks.check_new_timeline(before, after, bad_end, **kw))
    # a rollback by name has no cause; a missing rollback record is flagged
    assert any("rollback record" in v for v in checks.check_new_timeline(before, after, recs[1:], **kw))
    # retention taking the restored save's step 4 with too few newer steps is a loss
    shutil.rmtree(os.path.join(base, "pfs", "step-4"))
    assert any("persistent step 4" in v for v in checks.check_new_timeline(before, checks.scan_disk(base), recs, **kw))


def test_timeline_plans_leave_an_older_step_to_fall_back_or_roll_back_to():
    """Every issue-28 plan keeps (after the training run's retention) a complete step older than
    the newest one: the fallback past the corrupt newest step, or the rollback target."""
    seen = Counter()
    for i in range(600):
        p = fc.make_plan(3, i)
        if p.point not in fc.TIMELINE_POINTS:
            continue
        seen[p.point] += 1
        local = set(range(fc.STEPS - p.keep_local + 1, fc.STEPS + 1))
        pers = set(p.persistent_steps[-p.keep_persistent:])
        older = {s for s in local | pers if s < fc.STEPS}
        assert older, p
        if p.point == "rollback-skewed-clock":
            assert p.fault["to_step"] in older and p.script == ["train", "timeline", "restore"], p
        else:
            assert p.script[:3] == ["train", "corrupt-newest", "timeline"] and p.script[-1] == "restore", p
            assert all(a.startswith("wipe:") for a in p.script[3:-1]) and 0 <= p.fault["node"] < p.nodes, p
    assert set(seen) == set(fc.TIMELINE_POINTS) and min(seen.values()) >= 20, seen


def test_per_rank_plans_draw_persistent_in_cluster_and_two_ranks_per_node():
    """The per-rank-values point restores from every kind of source, with 1 and 2 ranks per node."""
    seen = Counter()
    for i in range(900):
        p = fc.make_plan(0, i)
        if p.point != "per-rank-values":
            continue
        seen[(p.rpn, p.restore_from)] += 1
        assert p.rpn in (1, 2) and (p.rpn == 1 or p.nodes == 2) and p.world == p.nodes * p.rpn, p
        for f in (p.fault, p.second):
            v = str((f or {}).get("victim", ""))
            assert not v.startswith("r") or int(v[1:]) < p.world, p
        last = p.script[-1]
        if p.restore_from == "in-cluster":
            assert last == "restore:in-cluster" and "wipe-all" not in p.script, p
        else:
            assert last == "restore", p
            assert (p.script[-2] == "wipe-all") == (p.restore_from == "persistent"), p
        json.dumps(p.__dict__)
    assert set(seen) == {(r, k) for r in (1, 2) for k in fc.PER_RANK_SOURCES}, seen
    assert fc.make_plan(5, 23) == fc.make_plan(5, 23)


def test_check_per_rank_files_two_ranks_per_node(tmp_path):
    """A node-local copy of a two-rank node holds each of its ranks' values under the rank's
    qualified key (the plain key: the node's lowest rank's); another node's values fail."""
    from tierckpt.io.per_rank import qualified

    base, step = str(tmp_path), 4

    def flat(rank, prefix=""):
        v = checks.per_rank_values(rank, step)
        return {f"{prefix}per_rank.probe": v["probe"], f"{prefix}per_rank.rng": v["rng"],
                f"{prefix}per_rank.counter": v["counter"], f"{prefix}per_rank.obj.rank": v["obj"]["rank"],
                f"{prefix}per_rank.obj.step": v["obj"]["step"]}

    def node_copy(ranks):
        sd = flat(ranks[0])
        for r in ranks:
            sd.update({qualified(r, k): v for k, v in flat(r).items() if k != "per_rank.obj.step"})
        return sd

    _save_flat(os.path.join(base, "nvme", "node-1", "local", f"step-{step}"), node_copy([2, 3]))
    _save_flat(os.path.join(base, "nvme", "node-0", "replicas", "node-1", f"step-{step}"), node_copy([0, 1]))
    own = checks.Copy("node-1", 1, f"local/step-{step}", step, 1, True, True, nodes=2, world_size=4)
    wrong = checks.Copy("node-0", 0, f"replicas/node-1/step-{step}", step, 1, True, True, nodes=2, world_size=4)
    assert checks.check_per_rank_files([own], base) == []
    bad = checks.check_per_rank_files([wrong], base)
    assert bad and all("not all readable" in b or "rank 2" in b or "rank 3" in b for b in bad), bad


def test_expected_save_and_retention_allowance_follow_save_order(tmp_path):
    """A's 4 and 5, then B's 3 (a newer run after a rollback whose supersede of A's 5 did not
    happen): B's lower step is the newest save, the expected restore; retention purging A's
    abandoned 5 (an older save) is no loss once k newer saves are committed."""
    base = str(tmp_path)
    roots = [os.path.join(base, "nvme", f"node-{n}") for n in (0, 1)]
    for n in (0, 1):
        _commit(roots[n], "local/step-4", node=n, step=4, save="a.0", order=(0, 0))
        _commit(roots[n], "local/step-5", node=n, step=5, save="a.1", order=(0, 1))
        _commit(roots[n], "local/step-3", node=n, step=3, save="b.0", order=(1, 0))
    copies = checks.scan_disk(base)
    assert checks.expected_save(copies, 2) == (3, "b.0")
    assert checks.expected_save(copies, 2, step=5) == (5, "a.1")
    assert checks.expected_save(copies, 2, world=4) is None  # saved by a job of another shape
    before = copies
    for n in (0, 1):
        shutil.rmtree(os.path.join(roots[n], "local", "step-5"))
    after = checks.scan_disk(base)
    assert checks.check_no_loss(before, after, keep_local=1, keep_persistent=1, allow_retention=True) == []
    assert checks.check_no_loss(before, after, keep_local=2, keep_persistent=1, allow_retention=True)


def test_expected_save_never_counts_an_abandoned_save(tmp_path):
    """A's 4 and 5; B rolled back to 4 and saved 6, whose manifests record it (``descends_from``);
    A's 5 is still committed on both nodes (its supersede failed). With B's 6 corrupt on every
    copy, the expected restore is 4 — never the abandoned 5 — and A's 5 superseded is no loss."""
    base = str(tmp_path)
    roots = [os.path.join(base, "nvme", f"node-{n}") for n in (0, 1)]
    b = {"save_id": "a.0", "save_order": [0, 0], "step": 4, "since": [1, 0]}
    for n in (0, 1):
        _commit(roots[n], "local/step-4", node=n, step=4, save="a.0", order=(0, 0))
        _commit(roots[n], "local/step-5", node=n, step=5, save="a.1", order=(0, 1))
        _commit(roots[n], "local/step-6", node=n, step=6, save="b.0", order=(1, 0), descends_from=b)
    copies = checks.scan_disk(base)
    assert checks.abandoned_saves(copies) == {"a.1": "b.0"}
    assert checks.expected_save(copies, 2) == (6, "b.0")
    assert checks.expected_save(copies, 2, step=5) is None  # not even by name
    for n in (0, 1):
        with open(os.path.join(roots[n], "local", "step-6", "__0_0.distcp"), "r+b") as f:
            f.write(b"X")
    corrupt = checks.scan_disk(base)
    assert checks.expected_save(corrupt, 2) == (4, "a.0")
    # without the record (an older manifest) today's rule: the newer save 5
    legacy = [checks.Copy(**{**c.__dict__, "descends_from": None}) for c in corrupt]
    assert checks.expected_save(legacy, 2) == (5, "a.1")
    # a JSON round trip keeps it; superseding the abandoned 5 loses nothing
    again = checks.copies_from_json([json.loads(json.dumps(c.__dict__)) for c in corrupt])
    assert checks.abandoned_saves(again) == {"a.1": "b.0"}
    for n in (0, 1):
        p = os.path.join(roots[n], "local", "step-5")
        os.rename(os.path.join(p, "tierckpt.committed"), os.path.join(p, "tierckpt.committed.superseded"))
    assert checks.check_no_loss(corrupt, checks.scan_disk(base), keep_local=2, keep_persistent=1,
                                allow_retention=False) == []


def test_the_record_names_its_commit_and_every_invariant():
    import argparse

    row = fc.TrialResult(0, 0, "per-rank-values", 2, "f", "-", "ok", "3", "3", [], 1.0)
    text = fc.render([row], argparse.Namespace(trials=1, seed=0), 1.0, "abc123 (clean)")
    assert text.splitlines()[0].startswith("# Fault campaign (issues 15 and 28"), text[:200]
    assert "Run on commit `abc123 (clean)`." in text
    assert "**every rank gets its own values**" in text and "__tierckpt_rank__/<rank>/per_rank.<k>" in text
    assert "**one save**" in text and "persistent tier with every node-local root wiped" in text
    rev = fc.source_revision()
    assert rev.endswith("(clean)") or "dirty" in rev or rev.startswith("unknown"), rev
