"""Never resume the wrong state (issue 28 A): one save per restore, fallbacks start a timeline,
rollbacks decided by save identity, not by the clocks of the hosts that wrote the markers.

Two ranks = two simulated nodes (rank r is node r), every tier, F = 2: node n's own copies live
in ``nvme/node-n/local``, its replica on the other node in ``nvme/node-(1-n)/replicas/node-n``,
the persistent steps in ``pfs``.
"""

from __future__ import annotations

import json
import os

from tests import scenarios_timeline as sc
from tests.harness import run_world

COMMITTED = "tierckpt.committed"


def _committed(path: str) -> bool:
    return os.path.exists(os.path.join(path, COMMITTED))


def _superseded(path: str) -> bool:
    return os.path.exists(os.path.join(path, COMMITTED + ".superseded"))


def test_a_restore_never_combines_two_runs_copies_of_one_step(tmp_path):
    """A.1: after a fallback the new timeline saves step 20 without replicas; node 1 still holds
    timeline A's replica of node 0's step 20. With node 0's disk lost, step 20 is A's on node 0
    and B's on node 1: it must not be restored (today: step 20 in one attempt, mixed)."""
    base = str(tmp_path)
    run_world(sc.phase_timeline_a, 2, base, [10, 20])
    for rel in ("nvme/node-1/local/step-20", "nvme/node-0/replicas/node-1/step-20", "pfs/step-20"):
        assert sc.corrupt_step_dir(os.path.join(base, rel)) > 0, rel
    out = run_world(sc.phase_fallback_then_unreplicated_save, 2, base)
    for r in out:
        assert r.value["step"] == 10, r.value
        assert any(t == "local" and ok and rf for t, ok, rf in r.value["local20"]), r.value  # replicas_failed
    # the fallback's first commit superseded every copy of timeline A's step 20 it had seen
    assert _superseded(os.path.join(base, "nvme/node-1/replicas/node-0/step-20"))
    assert _superseded(os.path.join(base, "pfs/step-20"))
    recs = sc.ledger(base)
    rb = [x for x in recs if x["kind"] == "rollback"]
    assert len(rb) == 1 and rb[0]["cause"] == "fallback" and (rb[0]["from_step"], rb[0]["to_step"]) == (20, 10), rb
    assert "replica node-0@node-1/20" in rb[0]["superseded"] and "persistent/20" in rb[0]["superseded"], rb
    sc.wipe_local_root(base, 0)
    res = run_world(sc.phase_restore_only, 2, base, None, ["A10", "A20", "B20"])
    for r in res:
        v = r.value
        assert v["step"] == 10 and v["matches"] == ["A10"], v  # B's 20 lacks node 0; A's is superseded
    restores = [x for x in sc.ledger(base) if x["kind"] == "restore"]
    assert restores[-1]["step"] == 10 and restores[-1]["save_id"] == restores[0]["save_id"], restores


def test_copies_of_two_saves_under_one_step_are_never_combined_even_unsuperseded(tmp_path):
    """The same mix when the fallback's run died between its commit and the supersede (so A's
    replica of node 0 is still committed): save identity alone keeps the restore at step 10."""
    base = str(tmp_path)
    run_world(sc.phase_timeline_a, 2, base, [10, 20])
    for rel in ("nvme/node-1/local/step-20", "nvme/node-0/replicas/node-1/step-20", "pfs/step-20"):
        sc.corrupt_step_dir(os.path.join(base, rel))
    run_world(sc.phase_fallback_then_unreplicated_save, 2, base)
    # undo the supersede: the state a crash right after the commit would have left
    for rel in ("nvme/node-1/replicas/node-0/step-20", "pfs/step-20"):
        if _superseded(os.path.join(base, rel)):
            os.rename(os.path.join(base, rel, COMMITTED + ".superseded"), os.path.join(base, rel, COMMITTED))
        assert _committed(os.path.join(base, rel)), rel
    sc.wipe_local_root(base, 0)
    res = run_world(sc.phase_restore_only, 2, base, None, ["A10", "A20", "B20"])
    for r in res:
        assert r.value["step"] == 10 and r.value["matches"] == ["A10"], r.value


def test_retention_never_keeps_a_corrupt_step_over_the_one_just_committed(tmp_path):
    """A.2: keep_latest_k local 2 / persistent 1; step 20 corrupt in every copy; the restart falls
    back to 10 and saves 15 to every tier: persistent step 15 must be kept (today: deleted, the
    corrupt 20 kept), run_end's durable_step exists, and with every node-local root lost the
    next restart restores 15 in one attempt."""
    base = str(tmp_path)
    kw = {"keep_latest_k": {"local": 2, "persistent": 1}}
    run_world(sc.phase_timeline_a, 2, base, [10, 20], kw)
    for rel in ("nvme/node-0/local/step-20", "nvme/node-1/local/step-20", "nvme/node-0/replicas/node-1/step-20",
                "nvme/node-1/replicas/node-0/step-20", "pfs/step-20"):
        assert sc.corrupt_step_dir(os.path.join(base, rel)) > 0, rel
    out = run_world(sc.phase_fallback_then_save, 2, base, kw, 15)
    assert all(r.value["restored"] == 10 for r in out), out
    assert _committed(os.path.join(base, "pfs/step-15"))
    assert not _committed(os.path.join(base, "pfs/step-20")) and _superseded(os.path.join(base, "pfs/step-20"))
    ends = [x for x in sc.ledger(base) if x["kind"] == "run_end"]
    assert ends[-1]["durable_step"] == 15 and ends[-1]["clean"] is True, ends[-1]
    assert _committed(os.path.join(base, "pfs", f"step-{ends[-1]['durable_step']}"))
    for n in (0, 1):
        sc.wipe_local_root(base, n)
    res = run_world(sc.phase_restore_only, 2, base, kw, ["A10", "A20", "R15"])
    for r in res:
        v = r.value
        assert v["step"] == 15 and v["attempts"] == 1 and set(v["sources"].values()) == {"persistent"}, v
        assert v["matches"] == ["R15"], v


def test_rollback_supersedes_by_save_identity_whatever_the_hosts_clocks(tmp_path):
    """A.3: node 1's clock runs an hour ahead while timeline A saves 10 and 20. An explicit
    rollback to 10 that commits 11 must supersede all five copies of step 20 (today: node 1's
    copies stay committed, the ledger lists them as superseded, and the next restart resumes
    the abandoned 20)."""
    base = str(tmp_path)
    run_world(sc.phase_timeline_a, 2, base, [10, 20], {"clock_skew_rank": 1})
    out = run_world(sc.phase_rollback_then_commit, 2, base, 10, 11)
    assert all(r.value["restored"] == 10 for r in out), out
    step20 = ["nvme/node-0/local/step-20", "nvme/node-1/local/step-20", "nvme/node-0/replicas/node-1/step-20",
              "nvme/node-1/replicas/node-0/step-20", "pfs/step-20"]
    for rel in step20:
        assert _superseded(os.path.join(base, rel)) and not _committed(os.path.join(base, rel)), rel
    rb = [x for x in sc.ledger(base) if x["kind"] == "rollback"]
    assert len(rb) == 1 and len([c for c in rb[0]["superseded"] if c.endswith("/20")]) == 5, rb
    assert "cause" not in rb[0], rb  # a rollback by name (the record's keys are unchanged)
    res = run_world(sc.phase_restore_only, 2, base, None, ["A10", "A20", "R11"])
    for r in res:
        assert r.value["step"] == 11 and r.value["matches"] == ["R11"], r.value


def test_a_step_saved_by_two_calls_is_one_save(tmp_path):
    """A step whose local and persistent copies come from two save() calls in a row is one save:
    the restart serves every node from its own disk (not the persistent tier) and supersedes
    nothing at its first commit."""
    base = str(tmp_path)
    run_world(sc.phase_split_tiers, 2, base)
    out = run_world(sc.phase_restore_then_save, 2, base, 6)
    for r in out:
        assert r.value["step"] == 5 and r.value["attempts"] == 1, r.value
        assert set(r.value["sources"].values()) == {"own-local"}, r.value
    assert [x for x in sc.ledger(base) if x["kind"] == "rollback"] == []
    for rel in ("nvme/node-0/local/step-5", "nvme/node-1/local/step-5", "pfs/step-5"):
        assert _committed(os.path.join(base, rel)), rel
    ids = {json.load(open(os.path.join(base, rel, "tierckpt.manifest.json")))["save_id"]
           for rel in ("nvme/node-0/local/step-5", "nvme/node-1/replicas/node-0/step-5", "pfs/step-5")}
    assert len(ids) == 1, ids
