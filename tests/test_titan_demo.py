"""The main demo's scenario end to end, shorter: torchtitan llama3 debugmodel on 2 CPU ranks
(2 simulated nodes), node 1 SIGKILLed after a replicated local checkpoint and its local root
wiped, the job restarted: node 1 comes back from node 0's replica, nothing is read from the
persistent tier, and every loss after the resume is bitwise equal to a reference run's.

Uses ``launch/local_demo.py``'s own functions (``run_demo``) with 12 steps, local tier every
3 steps, kill after local step 6. The runs go through the local launcher (``launch/local.py``:
one torchrun per node, the restart as its second attempt on a fresh port, restart count 1).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest


REPO = Path(__file__).resolve().parent.parent


from tests.harness import TITAN_TEST_ARGS, load_demo_launcher  # noqa: E402


def _launcher():
    return load_demo_launcher()


def test_clear_out_refuses_foreign_directories(tmp_path):
    ld = _launcher()
    (tmp_path / "precious.txt").write_text("x")
    with pytest.raises(ValueError, match="refusing"):
        ld.clear_out(str(tmp_path))
    assert (tmp_path / "precious.txt").exists()
    out = tmp_path / "demo"
    (out / "failure" / "nvme").mkdir(parents=True)
    (out / "report.json").write_text("{}")
    ld.clear_out(str(out))
    assert out.is_dir() and not any(out.iterdir())


def test_demo_short(tmp_path):
    from tierckpt.integration import accelerator_present

    if accelerator_present():
        pytest.skip("runs the CPU demo config (gloo, simulated nodes); the CPU patches are never applied on an accelerator machine")
    ld = _launcher()
    out = tmp_path / "demo"
    out.mkdir()
    params = ld.DemoParams(steps=12, kill_after=6, local_interval=3, persistent_interval=6, timeout=300,
                           extra=list(TITAN_TEST_ARGS))
    try:
        report = ld.run_demo(str(out), params)
    except ld.DemoError as e:
        pytest.fail(str(e))
    finally:
        ld.kill_live_jobs()
    assert not ld._LIVE
    saved = json.loads((out / "report.json").read_text())
    assert saved["ok"] == report["ok"]

    # the newest local step committed before the kill: step 6 (the kill follows its commit
    # within a step or two, long before step 9's background write could be committed)
    assert report["restored_step"] in (6, 9) and report["restored_step"] < report["killed_at_step"]
    assert report["restore_source"] == {"0": "own-local", "1": "peer-replica"}, report["restore"]
    assert report["persistent_bytes_read_on_restore"] == 0
    assert report["bitwise_equal"] is True, report["loss_mismatch_steps"]
    rstep = report["restored_step"]
    assert report["losses_compared"] == 12 - rstep
    after = report["losses"]["after_resume"]
    ref = report["losses"]["reference"]
    assert list(after) == [str(s) for s in range(rstep + 1, 13)]
    assert all(float(after[s]).hex() == float(ref[s]).hex() for s in after)
    assert report["losses_before_failure_equal_reference"] is True
    assert report["final_state_bitwise_equal"] is True, report["final_state_comparison"]
    assert report["recovery_seconds"] > 0
    assert report["ok"] is True

    saves = {(s["tier"], s["step"]) for s in report["saves"] if s["ok"]}
    assert {("local", 3), ("local", 6), ("local", 9), ("local", 12), ("persistent", 12)} <= saves
    for s in report["saves"]:
        assert s["bytes"] > 0 and s["blocking_s"] >= 0 and s["background_s"] >= 0

    # the launcher restarted the job itself: a fresh port, one log per node and attempt, and the
    # ledger has the killed run (no clean end) and the restarted one (restart count 1, clean)
    cfg = report["config"]
    assert cfg["ports"]["attempt_1"] != cfg["ports"]["attempt_2"]
    assert "tierckpt.launch" in cfg["failure_cmd"] and "--node-rank=0" in cfg["failure_cmd"]
    assert [Path(x).name for x in report["logs"]["attempt_2"]] == ["failure-attempt2-node0.log",
                                                                   "failure-attempt2-node1.log"]
    assert [(r["attempt"], r["restart_count"], r["clean"]) for r in report["ledger_runs"]] == [
        (1, 0, False), (2, 1, True)], report["ledger_runs"]

    # node 1's whole local root was deleted at the failure; the restart rebuilt it from the replica
    node1 = out / "failure" / "nvme" / "titan-demo" / "node-1" / "local"
    assert (node1 / "step-12" / "tierckpt.committed").exists()
