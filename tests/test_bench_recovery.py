"""bench/bench_recovery.py's own logic on synthetic demo reports (the runs themselves are the
torchtitan demo, tests/test_titan_demo.py): rows from a report, medians per mode, the warm ÷
cold ratios, the targets and the verdict, and the table."""

from __future__ import annotations

from pathlib import Path

from tests.harness import load_script

REPO = Path(__file__).resolve().parent.parent


def _bench():
    return load_script("bench/bench_recovery.py", "tierckpt_bench_recovery")




def _report(recovery: float, restore_done: float, restore_s: float, ok: bool = True) -> dict:
    phases = {"survivors_stopped": 0.1, "launched": 0.15, "processes_started": 0.2, "imports_done": 0.3,
              "process_group_up": 0.4, "model_built": 0.6, "restore_done": restore_done,
              "first_step_done": restore_done + 1.5}
    return {"ok": ok, "recovery_seconds": recovery, "restore_seconds": restore_s,
            "first_step_after_restore_s": 1.5, "steady_step_s": 1.1, "warm": True,
            "restore_source": {"0": "own-local", "1": "peer-replica"}, "persistent_bytes_read_on_restore": 0,
            "recovery_phases": {"phases_s": phases, "kill_to_failure_noticed_s": 0.1}}


def test_rows_medians_ratios_and_targets():
    b = _bench()
    rows = [b.summarise_run("cold", _report(14.0, 12.0, 0.5)), b.summarise_run("warm", _report(3.0, 1.0, 0.4)),
            b.summarise_run("warm", _report(2.0, 0.8, 0.3)), b.summarise_run("cold", _report(16.0, 13.0, 0.5))]
    assert rows[0]["startup_s"] == 12.0 - 0.5 and rows[1]["phases_s"]["restore_done"] == 1.0
    s = b.summarise(rows)
    assert s["modes"]["warm"]["recovery_s"] == 2.5 and s["modes"]["cold"]["recovery_s"] == 15.0
    assert s["modes"]["warm"]["runs"] == 2
    assert abs(s["ratios"]["recovery"] - 2.5 / 15.0) < 1e-12
    assert abs(s["ratios"]["startup"] - statistics_median([0.6, 0.5]) / statistics_median([11.5, 12.5])) < 1e-12
    assert s["targets"] == {"warm_recovery_le_4s": True, "stop_replaced_le_30s": None} and s["ok"]
    text = b.render(rows, s)
    assert "| warm | 2 | 2.50 |" in text and "Verdict: PASS" in text


def statistics_median(xs):
    import statistics

    return statistics.median(xs)


def test_a_missed_target_or_a_failed_run_fails_the_verdict():
    b = _bench()
    slow = b.summarise([b.summarise_run("warm", _report(4.5, 1.0, 0.4))])
    assert slow["targets"]["warm_recovery_le_4s"] is False and not slow["ok"]
    assert slow["ratios"]["recovery"] is None  # no cold run: no ratio
    bad = b.summarise([b.summarise_run("warm", _report(2.0, 1.0, 0.4, ok=False))])
    assert not bad["ok"] and "Verdict: FAIL" in b.render([b.summarise_run("warm", {"ok": False})], bad)
    stop = b.summarise([b.summarise_run("warm-stop", _report(31.0, 20.0, 0.4))])
    assert stop["targets"]["stop_replaced_le_30s"] is False and not stop["ok"]
