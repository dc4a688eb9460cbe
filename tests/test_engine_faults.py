"""Crash consistency, uneven shards, bad input and a full local disk."""

from __future__ import annotations

import json
import os
import signal
import subprocess

import pytest

from tests import scenarios
from tests.harness import run_world


def test_sigkill_mid_background_write_leaves_torn_step_invisible(tmp_path):
    base = str(tmp_path)
    res = run_world(scenarios.phase_killed_mid_write, 2, base, 1, allow_killed=True, timeout=120)
    assert res[1].exitcode == -signal.SIGKILL, res
    torn = os.path.join(base, "nvme", "node-1", "local", "step-4")
    assert os.path.isdir(torn) and os.listdir(torn), "the kill must leave a torn step behind"
    assert not os.path.exists(os.path.join(torn, "tierckpt.committed"))
    out = run_world(scenarios.phase_restore_and_check, 2, base, 1, 2, 0)[0].value
    assert out["step"] == 2, out
    assert all(src[0] == "own-local" for src in out["sources"].values()), out


@pytest.mark.parametrize("world,rows,cols,factor,expect_rows", [
    (4, 6, 5, 2, [2, 2, 2, 0]),        # a length-6 dim on 4 ranks: the last shard is empty
    (3, 32003, 8, 3, [10668, 10668, 10667]),  # a 32003-row embedding on 3 ranks
], ids=["6rows-4ranks", "32003rows-3ranks"])
def test_uneven_shards_round_trip_every_tier(tmp_path, world, rows, cols, factor, expect_rows):
    res = run_world(scenarios.phase_uneven_every_tier, world, str(tmp_path), rows, cols, factor, timeout=300)
    assert [r.value["local_rows"] for r in res] == expect_rows
    assert res[0].value["sources_node1"] == ["own-local", "peer-replica", "persistent"]


def test_bad_input_names_the_option(tmp_path):
    res = run_world(scenarios.phase_bad_input, 2, str(tmp_path))
    for r in res:
        msgs = r.value
        assert "allowed" in msgs["F>nodes"] and "1..2" in msgs["F>nodes"]
        assert "must divide" in msgs["J*F"]
        assert "nvme" in msgs["tier"] and "local, persistent" in msgs["tier"]
        assert "not writable" in msgs["root"] or "another rank" in msgs["root"]


@pytest.fixture
def tiny_tmpfs(tmp_path):
    mnt = tmp_path / "nvme" / "node-1"
    mnt.mkdir(parents=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"a full disk is simulated with a 32 MiB tmpfs filled up, and mounting one failed: {r.stderr.strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_full_local_disk_degrades_to_persistent(tmp_path, tiny_tmpfs):
    res = run_world(scenarios.phase_full_local_disk, 2, str(tmp_path))
    out = res[0].value
    assert out["local"].ok is False and "No space left" in (out["local"].error or ""), out["local"]
    assert out["persistent"].ok is True
    assert out["step"] == 2 and out["sources"] == {0: "own-local", 1: "persistent"}


def test_retention_and_staging_isolation(tmp_path):
    res = run_world(scenarios.phase_retention_and_staging, 2, str(tmp_path))
    for r in res:
        assert r.value["local"] == ["step-4", "step-5"], r.value   # torn step-0 cleaned too
        assert r.value["replicas"] == ["step-4", "step-5"], r.value
        assert r.value["persistent"] == ["step-3", "step-4", "step-5"], r.value


def test_explicit_step_is_read_only_and_rollback_waits_for_the_first_commit(tmp_path):
    res = run_world(scenarios.phase_rollback, 2, str(tmp_path))
    for r in res:
        v = r.value
        assert v["read_only"] == 2 and v["after_read_only"] and v["default_after_read_only"] == 6, v
        assert v["rollback_armed"] == 2 and v["after_arm"] and v["default_after_crash"] == 6, v
        # the new timeline's step 3 is committed everywhere; 4 and 6 are not resume points any more
        tiers = {"local", "replica", "persistent"}
        assert {(t, s) for t, s in v["committed_after"] if s > 2} == {(t, 3) for t in tiers}, v
        assert v["default_after_commit"] == 3, v
    planned = sorted(["persistent/4", "persistent/6"] + [f"local node-{n}/{s}" for n in (0, 1) for s in (4, 6)]
                     + [f"replica node-{n}@node-{1 - n}/{s}" for n in (0, 1) for s in (4, 6)])
    assert res[0].value["rollbacks"] == [(6, 2, 3, planned)], res[0].value["rollbacks"]
    for rel in ("pfs/step-6", "pfs/step-4"):
        assert os.path.exists(os.path.join(str(tmp_path), rel, "tierckpt.committed.superseded"))
    from tierckpt.cli.steps import _committed_label, find_steps

    labels = {s.step: _committed_label(s) for s in find_steps(str(tmp_path / "pfs"))}
    assert labels == {2: "yes", 3: "yes", 4: "no (superseded by a rollback)", 6: "no (superseded by a rollback)"}, labels


def test_persistent_root_must_be_shared(tmp_path):
    res = run_world(scenarios.phase_unshared_persistent, 2, str(tmp_path))
    assert [r.value for r in res] == ["persistent_root", "persistent_root"]


@pytest.mark.parametrize("factor", [1, 2])
def test_retention_keeps_the_newest_step_every_node_committed(tmp_path, factor):
    res = run_world(scenarios.phase_retention_anchor, 2, str(tmp_path), factor)
    by_rank = {r.rank: r.value for r in res}
    assert by_rank[0]["local"] == ["step-2", "step-5", "step-6"], by_rank   # 2 kept beyond k = 2
    assert by_rank[1]["local"] == ["step-1", "step-2"], by_rank
    for v in by_rank.values():
        assert v["step"] == 2 and v["anchor"] == 2 and v["persistent_bytes"] == 0, v
        assert v["sources"] == {0: "own-local", 1: "own-local"}, v


def test_hung_local_disk_skips_the_local_tier_instead_of_stalling(tmp_path):
    limit = 3.0
    res = run_world(scenarios.phase_hung_local_disk, 2, str(tmp_path), limit)
    for r in res:
        v = r.value
        # step 3 waited for the stuck step-2 save at most ~limit, then went on without the local
        # tier; step 4 did not wait again
        assert limit - 0.5 < v["blocking"][3] < limit + 5.0, v["blocking"]
        assert v["blocking"][4] < limit - 0.5, v["blocking"]
        for s in (3, 4):
            assert ("local", s, False, True) in v["history"] and ("persistent", s, True, False) in v["history"], v
        for s in (2, 5):
            assert ("local", s, True, False) in v["history"], v["history"]
        assert v["step"] == 5 and v["sources"] == {0: "own-local", 1: "own-local"}, v
        assert v["waited3"][0] == {"persistent": True} and v["waited3"][1] < limit - 0.5, v["waited3"]
        assert limit - 0.5 < v["close_s"] < limit + 5.0, v["close_s"]  # close() does not hang either
    recs = [json.loads(line) for line in open(os.path.join(str(tmp_path), "pfs", "tierckpt-ledger.jsonl"))]
    skipped = [x for x in recs if x.get("kind") == "checkpoint" and x.get("skipped")]
    assert [(x["tier"], x["step"]) for x in skipped] == [("local", 3), ("local", 4)]
    assert all(x["stuck_nodes"] == [1] and "local_wait_timeout_s" in x["error"] for x in skipped), skipped
    assert [x.get("stuck_tiers") for x in recs if x.get("kind") == "run_end"] == [["local"]]
    # the persistent saves of steps 3 and 4 were not charged the local tier's wait
    pers = {x["step"]: x for x in recs if x.get("kind") == "checkpoint" and x.get("tier") == "persistent"}
    assert pers[3]["blocking_s"] < limit - 0.5, pers[3]


def test_local_wait_timeout_must_be_seconds(tmp_path):
    from tierckpt.config import TierConfig
    from tierckpt.errors import ConfigError
    for bad in (-1, "5", True, float("inf"), float("nan")):
        with pytest.raises(ConfigError, match="local_wait_timeout_s.*0 = wait without limit"):
            TierConfig(local_root=str(tmp_path / "{node}"), persistent_root=str(tmp_path),
                       local_wait_timeout_s=bad)
    with pytest.raises(ConfigError, match="staging_buffers.*>= 2 with a local tier"):
        TierConfig(local_root=str(tmp_path / "{node}"), persistent_root=str(tmp_path), staging_buffers=1)
    TierConfig(local_root=str(tmp_path / "{node}"), persistent_root=str(tmp_path), staging_buffers=1,
               local_wait_timeout_s=0)  # no limit: one buffer is enough


def test_read_item_reads_one_verified_local_copy_without_a_restore(tmp_path):
    res = run_world(scenarios.phase_peek, 2, str(tmp_path))
    for r in res:
        v = r.value
        # node 0's own copy first; then its replica of node 1; then node 1 itself
        assert v["newest"] == (2, b"step 2 node 0") and v["step1"] == (1, b"step 1 node 0"), v
        assert v["own_corrupt"] == (2, b"step 2 node 1") and v["node0_corrupt"] == (2, b"step 2 node 1"), v
        assert v["missing_key"] is None and v["no_local"] is None, v
        assert v["restores"] == 0, v  # no full restore ran, none was recorded


def test_close_gives_up_on_a_local_save_that_never_returns_and_the_process_exits(tmp_path):
    limit = 2.0
    (r,) = run_world(scenarios.phase_hung_local_exit, 1, str(tmp_path), limit, timeout=120)
    assert limit - 0.5 < r.value["close_s"] < limit + 5.0, r.value
    assert ("persistent", 1, True) in r.value["persistent"], r.value  # the persistent tier committed
    assert r.exitcode == 0


def test_background_persistent_failure_reaches_the_trainer(tmp_path):
    res = run_world(scenarios.phase_background_failure_policy, 2, str(tmp_path))
    for r in res:
        v = r.value
        assert v["a_step2"]["local"] == (True, None), v
        assert v["a_step2"]["persistent"][0] is False and "No space left" in v["a_step2"]["persistent"][1], v
        assert v["a_raised"][:2] == ("persistent", 2) and "No space left" in v["a_raised"][2], v
        assert v["a_retry_tiers"] == ["local", "persistent"] and v["a_committed"] == [1, 3], v
        assert v["b_raised"] == ("persistent", 1), v
        assert v["b_run_end"]["clean"] is False and v["b_run_end"]["durable_step"] is None, v
        assert v["b_run_end"]["failures"][0]["step"] == 1, v
        assert v["c_run_end"]["clean"] is True and v["c_run_end"]["durable_step"] == 2, v
        assert v["d_run_end"]["clean"] is False and v["d_run_end"]["durable_step"] is None, v
        assert v["e_persistent"][0] is False and "ledger" in v["e_persistent"][1], v
        assert v["e_raised"] == ("persistent", 1), v
    # the run_end that could not be written fails the clean close of the ledger's writer, as a
    # failure of the persistent tier (whose root holds the ledger), never a raw OSError
    assert res[0].value["e_close"] == ("persistent", True) and res[1].value["e_close"] is None


def test_local_steps_of_another_experiment_are_never_restored_and_purged_on_start(tmp_path):
    base = str(tmp_path)

    def run(pfs, steps):
        res = run_world(scenarios.phase_lineage, 2, base, pfs, steps)
        assert len({r.value["lineage"] for r in res}) == 1, res  # every rank agrees
        return res[0].value  # node 0's view; the restore result is the same on every rank

    a = run("pfsA", [2, 4])
    assert a["restored"] is None and a["end"] == {"local": [2, 4], "replicas/node-1": [2, 4]}, a
    # a new experiment (another persistent root) on the same node-local roots: a fresh start,
    # expA's steps are never offered; the start that creates a lineage deletes nothing (a new,
    # or wrongly empty, persistent root must not cost the real experiment its local steps)
    b = run("pfsB", [3])
    assert b["lineage"] != a["lineage"]
    assert b["after_start"] == {"local": [2, 4], "replicas/node-1": [2, 4]}, b
    assert b["restored"] is None and b["end"] == {"local": [2, 3, 4], "replicas/node-1": [2, 3, 4]}, b
    # a requeue of expB keeps its lineage, purges expA's steps and resumes its own step
    b2 = run("pfsB", [6])
    assert b2["lineage"] == b["lineage"] and b2["after_start"] == {"local": [3], "replicas/node-1": [3]}, b2
    assert b2["restored"] == 3 and b2["sources"] == ["own-local"], b2
    # expA again: its node-local steps went with expB's start (its persistent root never had a
    # step), so it starts fresh, and expB's steps go in turn
    a2 = run("pfsA", [])
    assert a2["lineage"] == a["lineage"]
    assert a2["after_start"] == {"local": [], "replicas/node-1": []} and a2["restored"] is None, a2
    # a persistent root deleted and created again is a new lineage
    import shutil

    shutil.rmtree(os.path.join(base, "pfsA"))
    assert run("pfsA", [])["lineage"] != a["lineage"]
