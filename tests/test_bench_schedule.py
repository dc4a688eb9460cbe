"""bench/bench_schedule.py's own logic without processes (the runs themselves are the torchtitan
demo under launch/local.py): the failure monitor against a fake launcher (real
:class:`Attempt` records, fake clock and kill), the reconciliation of the injected failures
with the launcher's attempts, one policy's LocalLauncher wiring with a fake launcher, and the
analysis of a synthetic step log and ledger (waste, R from the step log and from the ledger's
``recovery`` record, the report's mode)."""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
from pathlib import Path

import pytest

from bench import bench_schedule as bs
from tierckpt.history.ledger import Ledger
from tierckpt.io.storage import Store
from tierckpt.records import RECOVERY_PHASES, CheckpointRecord, RecoveryRecord

LO = bs._load_demo().local_launcher()  # launch/local.py (Attempt, the launcher's record of one start)


def _write_steps(path: str, recs: list[dict]) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "a") as f:
        for r in recs:
            f.write(json.dumps({"loss": 1.0, **r}) + "\n")


class Clock:
    def __init__(self, t: float):
        self.t = t

    def __call__(self) -> float:
        return self.t


class FakeLauncher:
    """What FailureInjector uses of a LocalLauncher: ``attempts``, ``workers(node)``, ``failure_text``."""

    def __init__(self):
        self.attempts: list = []
        self.pids: dict[int, list[int]] = {}

    def start(self, t: float, pids: dict[int, list[int]]):
        a = LO.Attempt(index=len(self.attempts), restart_count=len(self.attempts), port=0, t_start=t, nodes=2)
        self.attempts.append(a)
        self.pids = pids
        return a

    def fail(self, a, node: int, t: float) -> None:  # what LocalLauncher._failed records
        a.failure_noticed, a.failed_node, a.failed_nodes, a.cause = t, node, [node], "node-failure"
        a.survivors_stopped = a.t_end = t + 0.05

    def workers(self, node: int) -> list[int]:
        return list(self.pids.get(node, []))

    def failure_text(self, a=None) -> str:
        return f"attempt {(a or self.attempts[-1]).index} log tail"


def test_victims_and_planned_failures_as_before():
    # failure i strikes the node the old bench drew for rank i: random.Random(i).randrange(world)
    assert [bs.victim_of(i, 2) for i in range(8)] == [random.Random(i).randrange(2) for i in range(8)]
    assert bs.planned_failures([10.0, 20.0, 30.0, 40.0], 60.0) == 3  # due at 10, 30, 60 (on the cap), 100
    assert bs.planned_failures([10.0, 20.0, 30.0, 40.0], 59.9) == 2
    assert bs.planned_failures([100.0], 50.0) == 0


def test_monitor_kills_the_victims_ranks_once_per_attempt_at_the_seeded_times(tmp_path):
    metrics = str(tmp_path / "losses.jsonl")
    clock, kills, la = Clock(1000.0), [], FakeLauncher()
    inj = bs.FailureInjector("adaptive", metrics, [5.0, 1.0, 100.0], t_ref=1.0, cap_s=1e6, nodes=2,
                             timeout_s=60.0, t_launch0=1000.0, clock=clock, kill=lambda pid, sig: kills.append((pid, sig)))
    a0 = la.start(1000.0, {0: [10], 1: [11]})
    inj(la, a0)  # no step yet: nothing is due
    assert inj.t_first is None and kills == []
    _write_steps(metrics, [{"step": 1, "time": 1002.0, "pid": 10}, {"step": 2, "time": 1003.0, "pid": 10}])
    clock.t = 1003.5
    inj(la, a0)
    assert inj.t_first == 1001.0 and inj.fail_at == 1006.0 and kills == []  # first step − t_ref + gaps[0]
    _write_steps(metrics, [{"step": s, "time": 1001.0 + s, "pid": 10} for s in (3, 4, 5)])
    clock.t = 1006.0
    inj(la, a0)
    v0 = bs.victim_of(0, 2)
    assert kills == [(10 + v0, signal.SIGKILL)]
    assert inj.fails == [{"time": 1006.0, "due": 1006.0, "attempt": 0, "victim": v0, "last_step": 5}]
    assert inj.fail_at == 1007.0  # the next due time counts from this one's due time
    clock.t = 1007.2  # due again, but the launcher has not restarted yet: one failure per attempt
    inj(la, a0)
    assert len(kills) == 1
    la.fail(a0, v0, 1007.3)
    a1 = la.start(1007.4, {})  # ranks not reported started yet: the due failure waits for them
    clock.t = 1007.5
    inj(la, a1)
    assert len(kills) == 1
    la.pids = {0: [20], 1: [21]}
    clock.t = 1007.6
    inj(la, a1)
    v1 = bs.victim_of(1, 2)
    assert kills[1] == (20 + v1, signal.SIGKILL)
    assert inj.fails[1] == {"time": 1007.6, "due": 1007.0, "attempt": 1, "victim": v1, "last_step": None}
    assert inj.fail_at == 1107.0
    la.fail(a1, v1, 1007.7)
    a2 = la.start(1007.8, {0: [30], 1: [31]})
    clock.t = 1100.0
    inj(la, a2)  # not due: nothing happens
    assert len(kills) == 2 and bs.reconcile_fails(inj.fails, la.attempts, finished=False) == []


def test_monitor_raises_for_a_failure_it_did_not_inject_the_cap_and_the_timeout(tmp_path):
    metrics = str(tmp_path / "losses.jsonl")
    clock, la = Clock(1000.0), FakeLauncher()

    def injector(**kw):
        args = dict(t_ref=1.0, cap_s=50.0, nodes=2, timeout_s=60.0, t_launch0=1000.0, clock=clock,
                    kill=lambda pid, sig: None)
        args.update(kw)
        return bs.FailureInjector("fixed-local-10", metrics, [1e9, 1e9], **args)

    inj = injector()
    a0 = la.start(1000.0, {0: [10], 1: [11]})
    clock.t = 1061.0
    with pytest.raises(RuntimeError, match="no step logged within 60s"):
        inj(la, a0)
    _write_steps(metrics, [{"step": 1, "time": 1010.0, "pid": 10}])
    inj = injector()
    clock.t = 1020.0
    inj(la, a0)
    la.fail(a0, 1, 1021.0)  # a rank died on its own
    a1 = la.start(1021.5, {0: [20], 1: [21]})
    with pytest.raises(RuntimeError, match=r"(?s)attempt 1 failed without an injected failure \(cause node-failure, nodes \[1\].*attempt 0 log tail"):
        inj(la, a1)
    inj = injector()
    inj(la, a0)
    clock.t = 1009.0 + 50.01  # t_first = 1009: the cap of 50 s passed
    with pytest.raises(bs.CapReached):
        inj(la, a0)


def test_reconcile_fails_matches_the_launchers_attempts():
    la = FakeLauncher()
    a0, fails = la.start(100.0, {}), [{"time": 110.0, "attempt": 0, "victim": 1, "last_step": 9}]
    la.fail(a0, 1, 110.1)
    a1 = la.start(110.3, {})
    a1.t_end = 150.0  # finished
    assert bs.reconcile_fails(fails, la.attempts, finished=True) == []
    assert fails[0]["noticed"] == 110.1 and fails[0]["survivors_stopped"] == pytest.approx(110.15)
    assert fails[0]["relaunched"] == 110.3 and fails[0]["launcher_cause"] == "node-failure"
    assert fails[0]["launcher_failed_nodes"] == [1]
    # a failed attempt without an injected failure, and a failure the analysis puts elsewhere
    la2 = FakeLauncher()
    b0 = la2.start(100.0, {})
    la2.fail(b0, 0, 105.0)
    b1 = la2.start(105.2, {})
    la2.fail(b1, 1, 120.0)
    b2 = la2.start(120.2, {})
    b2.t_end = 160.0
    problems = bs.reconcile_fails([{"time": 119.9, "attempt": 1, "victim": 1}], la2.attempts, finished=True)
    assert any("failure 1 struck attempt 1, expected attempt 0" in p for p in problems)
    assert any("attempt 0 failed (node-failure, nodes [0]) without an injected failure" in p for p in problems)
    # stopped at the cap right after a kill the launcher had no time to act on: consistent
    la3 = FakeLauncher()
    c0 = la3.start(100.0, {})
    assert bs.reconcile_fails([{"time": 130.0, "attempt": 0, "victim": 0}], la3.attempts, finished=False) == []
    # ... but not when the run finished: that kill found no rank
    c0.t_end = 140.0
    assert any("then finished" in p for p in
               bs.reconcile_fails([{"time": 130.0, "attempt": 0, "victim": 0}], la3.attempts, finished=True))
    # a last attempt that failed and was never restarted is not a finished run nor a cap
    la4 = FakeLauncher()
    la4.fail(la4.start(100.0, {}), 0, 101.0)
    assert any("was not restarted" in p for p in
               bs.reconcile_fails([{"time": 100.9, "attempt": 0, "victim": 0}], la4.attempts, finished=False))


def _args(**kw) -> argparse.Namespace:
    base = dict(mtbf=90.0, steps=30, prior_factor=4.0, world=2, restart_prior=10.0, cap=100.0, cap_default=1.25,
                cold=False, timeout=60.0, seed=1)
    base.update(kw)
    return argparse.Namespace(**base)


def _fake_demo(plan: dict, seen: dict):
    """A ``demo`` whose ``local_launcher().LocalLauncher`` runs attempts without processes: each
    attempt logs one step ``back`` seconds in the past and calls the monitor; an attempt whose
    rank the monitor killed fails (the launcher's record of it), one in ``plan["own"]`` fails on
    its own, any other finishes."""
    killed: set[int] = set()
    plan["kill"] = lambda pid, sig: killed.add(pid)

    class FakeLocalLauncher(FakeLauncher):
        def __init__(self, command, **kw):
            super().__init__()
            seen.update(kw, command=command)
            self.dump = command[command.index("--dump_folder") + 1]

        def run(self, timeout=None, monitor=None, log=None):
            import time

            while len(self.attempts) < seen["max_attempts"]:
                a = self.start(time.time(), {0: [100 + 2 * len(self.attempts)], 1: [101 + 2 * len(self.attempts)]})
                _write_steps(os.path.join(self.dump, "metrics", "losses.jsonl"),
                             [{"step": a.index + 1, "time": time.time() - plan["back"], "pid": self.pids[0][0]}])
                monitor(self, a)
                hit = [n for n, pids in self.pids.items() if set(pids) & killed]
                if hit or a.index in plan.get("own", ()):
                    self.fail(a, hit[0] if hit else 0, time.time())
                    continue
                a.t_end = time.time()
                return 0
            return 1

    lo = argparse.Namespace(LocalLauncher=FakeLocalLauncher, LaunchError=LO.LaunchError)
    return argparse.Namespace(local_launcher=lambda: lo, RUN_ENV={"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})


def test_run_policy_is_one_local_launcher_run_with_injected_failures(tmp_path):
    seen: dict = {}
    plan: dict = {"back": 100.0}
    demo = _fake_demo(plan, seen)
    # t_first = now − 101: failures due 51 s and 31 s ago (both strike at once, one per attempt), then never
    r = bs.run_policy(demo, str(tmp_path), "adaptive", _args(), [50.0, 20.0, 1e9], 1.0, kill=plan["kill"])
    assert seen["nodes"] == 2 and seen["nproc_per_node"] == 1 and seen["warm"] is True
    assert seen["max_attempts"] == 4  # 2 failures due before the cap (100 x 30 x 1 s), the last attempt, a spare
    assert seen["env"] == {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"} and seen["agent_ready_timeout_s"] == 60.0
    assert seen["local_root"] == os.path.join(str(tmp_path), "nvme-adaptive", "bench-adaptive", "node-{node}")
    cmd = seen["command"]
    assert cmd[:4] == ["-m", "titan_plugin.train", "--toml", bs.TOML] and "--checkpoint.adaptive" in cmd
    assert cmd[cmd.index("--checkpoint.restart_prior_s") + 1] == "10.0"
    assert r["finished"] and r["attempts"] == 3 and r["failures"] == 2 and r["bookkeeping"] == []
    assert [(f["attempt"], f["victim"]) for f in r["fails"]] == [(0, bs.victim_of(0, 2)), (1, bs.victim_of(1, 2))]
    assert all(f["noticed"] is not None and f["relaunched"] is not None for f in r["fails"])
    assert r["recoveries"] == [None, None] and r["recovery_total_s"] == []  # the fake wrote no ledger

    # --cold: the same run with LocalLauncher(warm=False); the cap stops it (not finished)
    seen.clear()
    r = bs.run_policy(demo, str(tmp_path / "cold"), "fixed-local-10", _args(cold=True, cap=1.0), [50.0, 1e9], 1.0,
                      kill=plan["kill"])
    assert seen["warm"] is False and seen["max_attempts"] == 2  # cap 30 s: no failure is due before it
    assert not r["finished"] and r["failures"] == 0 and r["attempts"] == 1 and r["bookkeeping"] == []

    # an attempt that fails on its own ends the policy with the failed attempt's log
    plan["own"] = {0}
    with pytest.raises(RuntimeError, match="attempt 1 failed without an injected failure"):
        bs.run_policy(demo, str(tmp_path / "own"), "adaptive", _args(), [1e9], 1.0, kill=plan["kill"])


def _synthetic_policy(dump: Path, base: float) -> list[dict]:
    """Attempt 0 (pid 100) steps 1-12 at 1 s each, local save at 10; node 1 killed at +12.5;
    attempt 1 (pid 200) resumes at 11, its first step at +15.5, steps to 30; the ledger has the
    save and attempt 1's recovery record (noticed 0.125 s after the kill, total 2.75 s)."""
    _write_steps(str(dump / "metrics" / "losses.jsonl"),
                 [{"step": s, "time": base + s, "pid": 100} for s in range(1, 13)]
                 + [{"step": s, "time": base + 15.5 + (s - 11), "pid": 200} for s in range(11, 31)])
    led = Ledger(Store(str(dump / "checkpoint")), enabled=True, run_id="run-a1", job="bench-adaptive")
    led.append(CheckpointRecord(tier="local", step=10, ok=True, blocking_s=0.05))
    secs = [0.0, 0.05, 0.06, 0.1, 0.2, 0.4, 0.9, 1.5, 2.75]
    led.append(RecoveryRecord(step=10, cause="node-failure", attempt=1, restart_count=1, failed_nodes=[1], warm=True,
                              phases={p: base + 12.625 + x for p, x in zip(RECOVERY_PHASES, secs)},
                              phases_s=dict(zip(RECOVERY_PHASES, secs)), total_s=2.75))
    return [{"time": base + 12.5, "due": base + 12.5, "attempt": 0, "victim": 1, "last_step": 12}]


def test_analysis_reports_r_from_the_step_log_and_from_the_ledger(tmp_path):
    base = 1.7e9
    fails = _synthetic_policy(tmp_path / "adaptive", base)
    r = bs.analyse_policy("adaptive", str(tmp_path / "adaptive"), fails, base, True, 2, 30, 1.0, bookkeeping=[])
    assert r["t_step"] == pytest.approx(1.0) and r["wall_s"] == pytest.approx(34.5)
    assert r["waste"] == pytest.approx(1 - 30 / 34.5)
    assert r["restart_s"] == [pytest.approx(2.0)] and r["restart_warm_s"] == [pytest.approx(2.0)]
    assert r["lost_steps"] == [2] and r["checkpoints"] == {"local": 1, "persistent": 0}
    (rec,) = r["recoveries"]
    assert rec["attempt"] == 1 and rec["total_s"] == 2.75 and rec["warm"] is True and rec["restored_step"] == 10
    assert rec["kill_to_noticed_s"] == 0.125 and rec["phases_s"]["restore_done"] == 1.5
    assert r["recovery_total_s"] == [2.75] and r["recovery_phases_mean_s"]["model_built"] == pytest.approx(0.9)

    rep = bs.summarise(_args(), {"t_ref": 1.0, "final_loss": 1.0}, [r], 60.0)
    assert rep["mode"] == "warm" and rep["launcher"] == bs.MODES["warm"]
    opt = rep["optimum"]
    assert opt["R_ledger_total_s"] == 2.75 and opt["R_ledger_records"] == 1
    assert opt["kill_to_noticed_s"] == 0.125 and opt["R_s"] == pytest.approx(2.0)
    assert rep["verdict"]["waste_le_target"] is False  # 13 % > 10 %
    text = bs.render(rep)
    assert text.splitlines()[0].startswith("restarts: warm (launch/local.py: one warm node agent")
    assert "ledger recovery records (1): total 2.75 s" in text and "restore done 1.50" in text
    assert "| 2.0 (n = 1) / 2.8 (n = 1) |" in text
    assert "adaptive waste ≤ 10 % (issue 31): FAIL" in text
    assert bs.summarise(_args(cold=True), {"t_ref": 1.0, "final_loss": 1.0}, [r], 60.0)["mode"] == "cold"

    # a report of the old bench (no --cold in its args): the legacy mode; a bookkeeping
    # mismatch makes the verdict fail
    old = vars(_args())
    old.pop("cold")
    r["bookkeeping"] = ["attempt 0 failed (node-failure, nodes [0]) without an injected failure"]
    rep = bs.summarise(argparse.Namespace(**old), {"t_ref": 1.0, "final_loss": 1.0}, [r], 60.0)
    assert rep["mode"] == "legacy" and rep["verdict"]["near_optimum"] is False
    assert "failure bookkeeping does not match the launcher's attempts (adaptive: attempt 0" in rep["verdict"]["warning"]
    assert bs.render(rep).splitlines()[0] == f"restarts: legacy ({bs.MODES['legacy']})"


def test_reanalyse_keeps_the_bookkeeping_and_the_mode(tmp_path):
    base = 1.7e9
    fails = _synthetic_policy(tmp_path / "adaptive", base)
    r = bs.analyse_policy("adaptive", str(tmp_path / "adaptive"), fails, base, True, 2, 30, 1.0, bookkeeping=[])
    rep = bs.summarise(_args(cold=True), {"t_ref": 1.0, "final_loss": 1.0}, [r], 60.0)
    with open(tmp_path / "report.json", "w") as f:
        json.dump(rep, f, default=str)
    again, text = bs.reanalyse(str(tmp_path))
    assert again["mode"] == "cold" and again["policies"][0]["recovery_total_s"] == [2.75]
    assert again["policies"][0]["fails"][0]["attempt"] == 0 and again["policies"][0]["bookkeeping"] == []
    assert text.startswith("restarts: cold (launch/local.py --cold")


def test_main_names_the_mode_and_keeps_cold_runs_apart(tmp_path, monkeypatch, capsys):
    base = 1.7e9
    calls: list = []

    def fake_ref(demo, out, steps, world, timeout, cold=False):
        calls.append(("reference", out, cold))
        return {"t_ref": 1.0, "samples": 20, "final_loss": 1.0}

    def fake_policy(demo, out, name, args, gaps, t_ref, kill=None):
        calls.append((name, out, args.cold, args.steps, args.restart_prior))
        fails = _synthetic_policy(Path(out) / name, base)
        return bs.analyse_policy(name, os.path.join(out, name), fails, base, True, 2, args.steps, t_ref,
                                 bookkeeping=[])

    monkeypatch.setattr(bs, "measure_step_time", fake_ref)
    monkeypatch.setattr(bs, "run_policy", fake_policy)
    monkeypatch.setattr(bs, "_load_demo", lambda: None)
    monkeypatch.setattr(bs, "REPO", str(tmp_path))
    assert bs.main(["--cold", "--steps", "30", "--policies", "adaptive"]) in (0, 1)
    out = str(tmp_path / "outputs" / "bench-schedule-cold")
    assert calls == [("reference", out, True), ("adaptive", out, True, 30, 10.0)]
    with open(os.path.join(out, "report.json")) as f:
        rep = json.load(f)
    assert rep["mode"] == "cold" and rep["args"]["cold"] is True and rep["policies"][0]["recovery_total_s"] == [2.75]
    assert "restarts: cold (launch/local.py --cold" in capsys.readouterr().out
