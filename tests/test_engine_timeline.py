"""Never resume the wrong state (issue 28 A): one save per restore, fallbacks start a timeline,
rollbacks decided by save identity, not by the clocks of the hosts that wrote the markers.

Two ranks = two simulated nodes (rank r is node r), every tier, F = 2: node n's own copies live
in ``nvme/node-n/local``, its replica on the other node in ``nvme/node-(1-n)/replicas/node-n``,
the persistent steps in ``pfs``.
"""

from __future__ import annotations

import json
import os

import pytest

from tests import scenarios_timeline as sc
from tests.harness import run_world

COMMITTED = "tierckpt.committed"
# the five copies of timeline A's step 20 (rollback record labels: their directories)
STEP20 = {"local node-0/20": "nvme/node-0/local/step-20", "local node-1/20": "nvme/node-1/local/step-20",
          "replica node-1@node-0/20": "nvme/node-0/replicas/node-1/step-20",
          "replica node-0@node-1/20": "nvme/node-1/replicas/node-0/step-20", "persistent/20": "pfs/step-20"}
NODE1 = ["local node-1/20", "replica node-0@node-1/20"]  # node 1's copies of them


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
    recs = sc.ledger(base)
    # the fallback's restore record: step 10, every source of step 20 named failed, one save
    (fb,) = [x for x in recs if x["kind"] == "restore"]
    assert fb["step"] == 10 and fb["attempts"] > 1 and fb["save_id"], fb
    assert fb["failures"] and {f["step"] for f in fb["failures"]} == {20}, fb
    assert {f["node"] for f in fb["failures"]} == {0, 1}, fb
    # its first commit superseded every copy of the corrupt step 20 (a fallback, not by name)
    (rb,) = [x for x in recs if x["kind"] == "rollback"]
    assert (rb["from_step"], rb["to_step"], rb["cause"], rb["save_id"]) == (20, 10, "fallback", fb["save_id"]), rb
    assert sorted(rb["superseded"]) == sorted(STEP20) and "failed" not in rb, rb
    ends = [x for x in recs if x["kind"] == "run_end"]
    assert ends[-1]["durable_step"] == 15 and ends[-1]["clean"] is True, ends[-1]
    assert _committed(os.path.join(base, "pfs", f"step-{ends[-1]['durable_step']}"))
    for n in (0, 1):
        sc.wipe_local_root(base, n)
    res = run_world(sc.phase_restore_only, 2, base, kw, ["A10", "A20", "R15"])
    for r in res:
        v = r.value
        assert v["step"] == 15 and v["attempts"] == 1 and set(v["sources"].values()) == {"persistent"}, v
        assert v["matches"] == ["R15"], v
    last = [x for x in sc.ledger(base) if x["kind"] == "restore"][-1]
    assert last["step"] == 15 and last["attempts"] == 1 and not last["failures"], last
    assert last["save_id"] == res[0].value["save_id"] and last["save_id"] != fb["save_id"], last


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
    assert sorted(rb[0]["superseded"]) == sorted(STEP20) and "failed" not in rb[0], rb
    # as if the run had died right after its first commit, before any node superseded anything:
    # every copy of the abandoned step 20 committed again — the restart resumes the new timeline
    for rel in STEP20.values():
        p = os.path.join(base, rel)
        os.rename(os.path.join(p, COMMITTED + ".superseded"), os.path.join(p, COMMITTED))
    res = run_world(sc.phase_restore_only, 2, base, None, ["A10", "A20", "R11"])
    for r in res:
        assert r.value["step"] == 11 and r.value["matches"] == ["R11"] and r.value["attempts"] == 1, r.value
        assert set(r.value["sources"].values()) == {"own-local"}, r.value


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


def test_an_abandoned_step_left_committed_on_a_node_is_never_resumed(tmp_path):
    """The window of A.3: the rollback's first commit (step 11) supersedes step 20 everywhere but
    on node 1, whose renames fail (as a node that died before its own supersede leaves it). The
    rollback record names what was superseded and what failed; the restart resumes the new
    timeline's 11 — the newest save in agreed order, not the highest step — bitwise on every
    rank, and its first commit supersedes the leftovers (a ``leftover`` rollback record)."""
    base = str(tmp_path)
    run_world(sc.phase_timeline_a, 2, base, [10, 20])
    run_world(sc.phase_rollback_failing_supersede, 2, base, 10, [(11, None)], 1, None)
    for label, rel in STEP20.items():
        left = label in NODE1
        assert _committed(os.path.join(base, rel)) == left and _superseded(os.path.join(base, rel)) != left, rel
    rb = [x for x in sc.ledger(base) if x["kind"] == "rollback"]
    assert len(rb) == 1, rb
    assert (rb[0]["from_step"], rb[0]["to_step"], rb[0].get("cause")) == (20, 10, None), rb
    assert sorted(rb[0]["superseded"]) == sorted(set(STEP20) - set(NODE1)), rb  # what was actually renamed
    assert sorted(f.split(":", 1)[0] for f in rb[0]["failed"]) == sorted(NODE1), rb
    assert all("injected: rename failed" in f for f in rb[0]["failed"]), rb
    out = run_world(sc.phase_restore_then_save_tagged, 2, base, 12, ["A10", "A20", "R11"])
    r11 = {r.value["save_id"] for r in out}
    for r in out:
        v = r.value
        assert v["step"] == 11 and v["matches"] == ["R11"] and v["attempts"] == 1, v
        assert set(v["sources"].values()) == {"own-local"}, v
    recs = sc.ledger(base)
    restores = [x for x in recs if x["kind"] == "restore"]
    assert restores[-1]["step"] == 11 and {restores[-1]["save_id"]} == r11 and not restores[-1]["failures"], restores
    rb = [x for x in recs if x["kind"] == "rollback"]
    assert len(rb) == 2, rb
    assert (rb[1]["from_step"], rb[1]["to_step"], rb[1]["cause"], rb[1]["save_id"]) == (20, 11, "leftover", *r11), rb
    assert sorted(rb[1]["superseded"]) == sorted(NODE1) and "failed" not in rb[1] and "retry" not in rb[1], rb
    for rel in STEP20.values():  # superseded (node-local ones the start purges once superseded)
        assert not _committed(os.path.join(base, rel)), rel
    for label in NODE1:
        assert _superseded(os.path.join(base, STEP20[label])), label
    res = run_world(sc.phase_restore_only, 2, base, None, ["A20", "R11", "R12"])
    for r in res:
        assert r.value["step"] == 12 and r.value["matches"] == ["R12"], r.value


def test_a_failed_supersede_is_retried_at_the_next_commit_and_recorded(tmp_path):
    """Node 1's first rename fails once: the rollback record names it failed, the next commit
    retries it and a ``retry`` record names it superseded; nothing of step 20 stays committed."""
    base = str(tmp_path)
    run_world(sc.phase_timeline_a, 2, base, [10, 20])
    run_world(sc.phase_rollback_failing_supersede, 2, base, 10, [(11, ("local",)), (12, None)], 1, 1)
    for rel in STEP20.values():
        assert _superseded(os.path.join(base, rel)) and not _committed(os.path.join(base, rel)), rel
    rb = [x for x in sc.ledger(base) if x["kind"] == "rollback"]
    assert len(rb) == 2, rb
    assert rb[0]["trigger"] == {"tier": "local", "step": 11} and "retry" not in rb[0], rb
    assert sorted(rb[0]["superseded"]) == sorted(set(STEP20) - {"local node-1/20"}), rb
    assert [f.split(":", 1)[0] for f in rb[0]["failed"]] == ["local node-1/20"], rb
    assert rb[1]["retry"] is True and rb[1]["superseded"] == ["local node-1/20"] and "failed" not in rb[1], rb
    assert rb[1]["trigger"]["step"] == 12 and (rb[1]["from_step"], rb[1]["to_step"]) == (20, 10), rb
    res = run_world(sc.phase_restore_only, 2, base, None, ["A20", "R11", "R12"])
    for r in res:
        assert r.value["step"] == 12 and r.value["matches"] == ["R12"] and r.value["attempts"] == 1, r.value


STEP11 = {label.replace("/20", "/11"): rel.replace("step-20", "step-11") for label, rel in STEP20.items()}


def _revive(base: str, rel: str) -> None:
    """Rename a superseded marker back: the state a node that died before its own rename leaves."""
    p = os.path.join(base, rel)
    os.rename(os.path.join(p, COMMITTED + ".superseded"), os.path.join(p, COMMITTED))


@pytest.mark.parametrize("how", ["rename-fails", "died-before-rename"])
def test_a_double_fault_never_resumes_the_abandoned_save(tmp_path, how):
    """The rollback to 10 commits 11 on both nodes, but node 1's copies of the abandoned 20 stay
    committed (its renames fail, or it died before them); then every copy of 11 is corrupt, the
    persistent one too. Node 1 still holds a complete copy of 20 (its own and its replica of node
    0), yet the restart resumes 10 — the step the new timeline started from — bitwise on every
    rank, never 20: 11's manifests record that its run resumed 10, which proves 20 abandoned.
    The restore record names the corrupt sources and the abandoned save it skipped; the new
    timeline's first commit supersedes 11 and the leftovers of 20 (a ``fallback`` record)."""
    base = str(tmp_path)
    run_world(sc.phase_timeline_a, 2, base, [10, 20])
    run_world(sc.phase_rollback_failing_supersede, 2, base, 10, [(11, None)], 1 if how == "rename-fails" else None,
              None)
    if how == "died-before-rename":
        for label in NODE1:
            _revive(base, STEP20[label])
    for label, rel in STEP20.items():
        assert _committed(os.path.join(base, rel)) == (label in NODE1), rel
    a20, r11 = sc.save_id_of(base, STEP20["local node-1/20"]), sc.save_id_of(base, STEP11["local node-0/11"])
    for rel in STEP11.values():
        assert sc.corrupt_step_dir(os.path.join(base, rel)) > 0, rel
    out = run_world(sc.phase_restore_then_save_tagged, 2, base, 12, ["A10", "A20", "R11"])
    a10 = {r.value["save_id"] for r in out}
    for r in out:
        v = r.value
        assert v["step"] == 10 and v["matches"] == ["A10"] and v["attempts"] > 1, v
    recs = sc.ledger(base)
    rest = [x for x in recs if x["kind"] == "restore"][-1]
    assert rest["step"] == 10 and {rest["save_id"]} == a10, rest
    assert rest["failures"] and {f["step"] for f in rest["failures"]} == {11}, rest  # why 11 was not resumed
    assert rest["abandoned"] == [{"step": 20, "save_id": a20, "by": r11}], rest  # why 20 was not tried
    rb = [x for x in recs if x["kind"] == "rollback"][-1]
    assert (rb["to_step"], rb["cause"], rb["save_id"], rb["from_step"]) == (10, "fallback", *a10, 11), rb
    assert set(NODE1) <= set(rb["superseded"]) and set(STEP11) <= set(rb["superseded"]), rb
    assert "failed" not in rb, rb
    for rel in list(STEP20.values()) + list(STEP11.values()):
        assert not _committed(os.path.join(base, rel)), rel
    res = run_world(sc.phase_restore_only, 2, base, None, ["A10", "A20", "R11", "R12"])
    for r in res:
        assert r.value["step"] == 12 and r.value["matches"] == ["R12"] and r.value["attempts"] == 1, r.value


def test_retention_with_a_failed_supersede_keeps_the_promised_saves(tmp_path):
    """keep_latest_k 2 (local and persistent); the rollback to 10 commits 11 while every rename
    of node 0 and global rank 0 (its local root, its replica of node 1, the persistent root)
    fails: the abandoned 20 takes no slot, so 10 and 11 are both kept on node 0 and in the
    persistent root (before: 20 and 11, and the step the new timeline started from deleted).
    With the new timeline's 11 then corrupt everywhere, the restart resumes 10 from every node's
    own disk."""
    base = str(tmp_path)
    kw = {"keep_latest_k": {"local": 2, "persistent": 2}}
    run_world(sc.phase_timeline_a, 2, base, [10, 20], kw)
    run_world(sc.phase_rollback_failing_supersede, 2, base, 10, [(11, None)], 0, None, kw)
    node0 = ["local node-0/20", "replica node-1@node-0/20", "persistent/20"]
    for label, rel in STEP20.items():
        assert _committed(os.path.join(base, rel)) == (label in node0), rel  # node 0's renames all failed
    rb = [x for x in sc.ledger(base) if x["kind"] == "rollback"]
    assert len(rb) == 1 and sorted(f.split(":", 1)[0] for f in rb[0]["failed"]) == sorted(node0), rb
    for rel in ("nvme/node-0/local/step-10", "nvme/node-0/replicas/node-1/step-10", "pfs/step-10",
                "nvme/node-0/local/step-11", "nvme/node-0/replicas/node-1/step-11", "pfs/step-11",
                "nvme/node-1/local/step-10", "nvme/node-1/local/step-11"):
        assert _committed(os.path.join(base, rel)), rel  # the promised two non-abandoned saves
    for rel in STEP11.values():
        sc.corrupt_step_dir(os.path.join(base, rel))
    out = run_world(sc.phase_restore_then_save_tagged, 2, base, 12, ["A10", "A20", "R11"], kw)
    for r in out:
        v = r.value
        assert v["step"] == 10 and v["matches"] == ["A10"], v
        assert set(v["sources"].values()) == {"own-local"}, v
