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


def test_recovery_phases_of_the_report(capsys):
    """The report's ``recovery_phases``: the ledger's last recovery record and the kill →
    failure-noticed gap, printed as a table after the main one (both demos)."""
    from rich.console import Console

    from tierckpt.records import RECOVERY_PHASES, RecoveryRecord

    ld = _launcher()
    assert ld.recovery_phases([{"kind": "restore", "step": 3}], 1.0) is None
    rec = RecoveryRecord(step=3, cause="node-failure", attempt=1, failed_nodes=[1],
                         phases={p: 100.0 + i for i, p in enumerate(RECOVERY_PHASES)},
                         phases_s={p: float(i) for i, p in enumerate(RECOVERY_PHASES)}, total_s=8.0)
    ledger = [{"kind": "run_start"}, rec.as_line()]
    got = ld.recovery_phases(ledger, 99.5)
    assert got["kill_to_failure_noticed_s"] == 0.5 and got["total_s"] == 8.0 and got["kind"] == "recovery"
    con = Console(width=100, force_terminal=False)
    ld.print_recovery(con, got)
    ld.print_recovery(con, None)
    out = capsys.readouterr().out
    assert "recovery phases (tierckpt ledger)" in out and "first step done" in out and "8.00" in out
    assert "SIGKILL → failure noticed by the launcher: 0.50 s" in out
    assert "no recovery record in the ledger" in out


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
    # the restarted attempt's recovery record (tierckpt/recovery/timeline.py): the launcher's
    # TIERCKPT_RECOVERY, every rank-side phase stamped through torchtitan, in order
    ph = report["recovery_phases"]
    assert (ph["kind"], ph["cause"], ph["attempt"], ph["failed_nodes"], ph["warm"]) == (
        "recovery", "node-failure", 1, [1], True), ph  # both ranks forked by their warm node agents
    assert report["warm"] is True and report["replaced"] == {}
    assert ph["step"] == rstep and ph["restart_count"] == 1 and ph["origin"] == "failure_noticed"
    secs = list(ph["phases_s"].values())
    assert list(ph["phases_s"]) == ["failure_noticed", "survivors_stopped", "launched", "processes_started",
                                    "imports_done", "process_group_up", "model_built", "restore_done",
                                    "first_step_done"]
    assert None not in secs and secs == sorted(secs) and secs[0] == 0.0, ph
    assert ph["total_s"] == ph["phases_s"]["first_step_done"] > 0
    assert {n: v["source"] for n, v in ph["nodes"].items()} == report["restore_source"]
    assert 0 <= ph["kill_to_failure_noticed_s"] < 30
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
