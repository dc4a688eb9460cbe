"""bench/bench_goodput.py's own logic without training processes (the runs themselves are the
torchtitan demo under launch/local.py): the failure times every system shares, the
kill-and-wipe injector against a fake launcher, the ETTR/waste partition of synthetic step
logs, the shared-storage throttle, the systems' commands, the tables, verdict, record entry and
plot, and ``main`` end to end with the runs replaced by synthetic results (a few seconds)."""

from __future__ import annotations

import json
import os
import random
import signal

import pytest

from bench import bench_goodput as bg
from bench.goodput import accounting, failures, report, runner, systems, throttle
from tests.test_bench_schedule import Clock, FakeLauncher, _write_steps


def test_failure_times_are_the_same_for_every_system_and_differ_by_seed():
    a, b = failures.failure_plan(60.0, 3), failures.failure_plan(60.0, 3)
    assert a.gaps == b.gaps and a.victims(8) == b.victims(8)  # what each system's injector gets
    rng = random.Random(3)  # the generator and order of bench_schedule: its seeds mean the same failures
    assert list(a.gaps[:5]) == [rng.expovariate(1 / 60.0) for _ in range(5)]
    assert failures.failure_plan(60.0, 4).gaps[:3] != a.gaps[:3]
    due = a.due_times(300.0)
    assert due == sorted(due) and all(t <= 300.0 for t in due)
    assert len(due) == len(a.due_times(due[-1])) and due[0] == pytest.approx(a.gaps[0])
    with pytest.raises(ValueError, match="--mtbf"):
        failures.failure_plan(0.0, 1)
    with pytest.raises(ValueError, match="--nodes"):
        failures.failure_plan(60.0, 1, nodes=1)


def test_injector_kills_the_victim_and_wipes_its_disk(tmp_path):
    metrics = str(tmp_path / "losses.jsonl")
    disks = str(tmp_path / "nvme" / "node-{node}")
    for n in (0, 1):
        os.makedirs(disks.format(node=n) + "/step-5")
    clock, kills, la = Clock(1000.0), [], FakeLauncher()
    plan = failures.failure_plan(60.0, 1)
    gaps = [5.0] + list(plan.gaps[1:])
    inj = failures.WipingInjector("s", metrics, gaps, t_ref=1.0, cap_s=1e6, nodes=2, timeout_s=60.0,
                                  t_launch0=1000.0, clock=clock, kill=lambda pid, sig: kills.append((pid, sig)),
                                  local_root=disks)
    a0 = la.start(1000.0, {0: [10], 1: [11]})
    _write_steps(metrics, [{"step": s, "time": 1001.0 + s, "pid": 10} for s in (1, 2, 3)])
    clock.t = 1003.5
    inj(la, a0)
    assert kills == [] and os.path.isdir(disks.format(node=0))
    clock.t = 1006.0  # first step at 1002 → t_first 1001, due at 1006
    inj(la, a0)
    v = plan.victims(1)[0]
    assert kills == [(10 + v, signal.SIGKILL)]
    assert not os.path.exists(disks.format(node=v)) and os.path.isdir(disks.format(node=1 - v))
    assert inj.fails[0]["wiped"] == disks.format(node=v) and inj.fails[0]["last_step"] == 3


def _steps(pid, pairs):
    return [{"step": s, "time": t, "pid": pid} for s, t in pairs]


def test_account_partitions_wall_time_into_the_waste_buckets():
    # t_ref 1 s; first process: steps 1-3 at speed (warm-up), a save after step 4 (0.5 s blocking),
    # step 6 0.3 s slow (background), killed 0.5 s after step 7; the restart resumes at step 5
    # (4 done again... steps 5-7 re-run), its downtime 5.7 s holds a 2 s restore, its 2nd step 0.5 s slow
    a = _steps("A", [(1, 101.0), (2, 102.0), (3, 103.0), (4, 104.0), (5, 105.5), (6, 106.8), (7, 107.8)])
    b = _steps("B", [(5, 115.0), (6, 116.5), (7, 117.5), (8, 118.5)])
    acc = accounting.account(b + a, [{"time": 108.3, "attempt": 0}], {4}, 1.0, {1: 2.0})
    w = acc["waste_s"]
    assert acc["wall_s"] == pytest.approx(18.5) and acc["useful_s"] == 8.0 and acc["final_step"] == 8
    assert acc["ettr"] == pytest.approx(8 / 18.5)
    assert w["blocking"] == pytest.approx(0.5) and w["background"] == pytest.approx(0.3)
    assert w["lost"] == pytest.approx(0.5 + 3.0)  # the step in flight + 3 steps re-run
    assert w["restore"] == pytest.approx(2.0) and w["restart"] == pytest.approx(3.7 + 0.5)
    assert w["other"] == pytest.approx(0.0, abs=1e-9)
    assert sum(w.values()) + acc["useful_s"] == pytest.approx(acc["wall_s"])
    assert acc["restarts"] == [{"attempt": 0, "downtime_s": pytest.approx(5.7), "restore_s": 2.0}]
    assert sum(acc["waste_frac"].values()) == pytest.approx(1 - acc["ettr"])


def test_account_a_failure_during_a_restart_and_no_restore_measured():
    a = _steps("A", [(1, 101.0), (2, 102.0), (3, 103.0), (4, 104.0)])
    b = _steps("C", [(1, 115.0), (2, 116.0)])  # nothing saved: starts over from step 1
    kills = [{"time": 104.4, "attempt": 0}, {"time": 110.0, "attempt": 1}]
    acc = accounting.account(a + b, kills, set(), 1.0, {1: 3.0})  # attempt 1's restore: it was struck
    w = acc["waste_s"]
    assert w["restore"] == 0.0  # attempt 2 (after the last kill) measured none
    assert w["lost"] == pytest.approx(0.4 + 4.0)  # all 4 steps of the first process re-run
    assert w["restart"] == pytest.approx((110.0 - 104.4) + (115.0 - 1.0 - 110.0))
    assert acc["final_step"] == 2 and acc["ettr"] == pytest.approx(2 / 16.0)
    with pytest.raises(ValueError, match="t_ref"):
        accounting.account(a, [], set(), 0.0)
    assert accounting.account([], [], set(), 1.0)["ettr"] != accounting.account([], [], set(), 1.0)["ettr"]  # NaN


def test_quiet_step_and_useful_curve():
    recs = _steps("A", [(s, 100.0 + 1.1 * s) for s in range(1, 30)])
    assert accounting.quiet_step_s(recs, {10, 20}) == pytest.approx(1.1)
    assert accounting.quiet_step_s(recs[:6], set()) is None  # too few gaps
    xs, ys = accounting.useful_curve(_steps("A", [(1, 11.0), (2, 12.0)]) + _steps("B", [(2, 20.0)]), 10.0)
    assert xs == [0.0, 1.0, 2.0, 10.0] and ys == [0, 1, 2, 2]
    assert accounting.summarise_seeds([0.5, float("nan"), 0.7]) == {"mean": pytest.approx(0.6), "min": 0.5,
                                                                    "max": 0.7, "n": 2}


def test_shared_link_queues_every_process_behind_one_bandwidth(tmp_path):
    clock, slept = Clock(10.0), []
    state = str(tmp_path / "link")
    a = throttle.SharedLink(state, 100.0, clock=clock, sleep=slept.append)
    b = throttle.SharedLink(state, 100.0, clock=clock, sleep=slept.append)  # another node, same link
    a.transfer(50)
    b.transfer(100)  # queued behind a's reservation: ends at 10 + 0.5 + 1.0
    assert slept == [pytest.approx(0.5), pytest.approx(1.5)]
    assert a.totals() == {"bytes": 150, "transfers": 2, "busy_until": pytest.approx(11.5)}
    clock.t = 20.0  # an idle link starts a transfer now
    assert b.reserve(100) == pytest.approx(21.0)
    with pytest.raises(ValueError, match="bytes_per_s"):
        throttle.SharedLink(state, 0)


def test_throttled_file_settles_small_writes_together(tmp_path):
    class Link:
        def __init__(self):
            self.passed = []

        def transfer(self, n):
            self.passed.append(n)

    link = Link()
    with throttle.ThrottledFile(open(tmp_path / "f", "wb"), link) as f:
        for _ in range(3):
            f.write(b"x" * 1000)
        assert link.passed == []  # below SETTLE
        f.write(b"y" * (throttle.CHUNK + 10))
    assert sum(link.passed) == 3000 + throttle.CHUNK + 10 and os.path.getsize(tmp_path / "f") == 3000 + \
        throttle.CHUNK + 10


def test_install_throttles_only_files_under_the_shared_root(tmp_path, monkeypatch):
    import builtins
    import io

    monkeypatch.setattr(builtins, "open", builtins.open)
    monkeypatch.setattr(io, "open", io.open)  # restored after the test
    root = tmp_path / "shared"
    root.mkdir()
    link = throttle.install(str(root), 1e12, str(tmp_path / "link"))
    (root / "a.bin").write_bytes(b"z" * (2 << 20))  # pathlib: io.open
    with open(root / "b.txt", "w") as f:  # text side file: not throttled
        f.write("hello")
    (tmp_path / "local.bin").write_bytes(b"z" * (3 << 20))  # a node-local disk
    assert (root / "a.bin").read_bytes()[:1] == b"z"
    assert link.totals()["bytes"] == 2 * (2 << 20)  # written once, read once
    env = throttle.env_for(str(root), 2e8, "/x/link")
    assert env[throttle.ENV_BPS] == "200000000.0" and env["PYTHONPATH"].endswith(os.path.join("goodput", "site"))
    assert os.path.exists(os.path.join(env["PYTHONPATH"], "sitecustomize.py"))


def test_systems_parse_and_commands(tmp_path):
    names = [s.name for s in systems.parse_systems("tierckpt-adaptive,titan-stock-20,tierckpt-fixed-5,torchft,"
                                                    "titan-stock-20")]
    assert names == ["tierckpt-adaptive", "titan-stock-20", "tierckpt-fixed-5", "torchft"]
    for bad in ("titan-stock-0", "dcp", "tierckpt-fixed-x", ""):
        with pytest.raises(ValueError, match="--systems"):
            systems.parse_systems(bad)
    kw = dict(dump="/d", nvme="/n", job="j", steps=50)
    ad = systems.command(systems.parse_system("tierckpt-adaptive"), **kw)
    assert ad[:2] == ["-m", "titan_plugin.train"] and "local,persistent" in ad and "50" in ad
    assert "--checkpoint.gpu_mtbf_hours" not in ad  # default settings: the plugin's prior
    pr = systems.command(systems.parse_system("tierckpt-adaptive-prior4"), **kw, mtbf_s=60.0, ranks=2)
    assert float(pr[pr.index("--checkpoint.gpu_mtbf_hours") + 1]) == pytest.approx(4 * 60.0 * 2 / 3600)
    with pytest.raises(ValueError, match="F > 0"):
        systems.parse_system("tierckpt-adaptive-prior0")
    fx = systems.command(systems.parse_system("tierckpt-fixed-7"), **kw)
    assert fx[fx.index("--checkpoint.local_interval") + 1] == "7" and "--checkpoint.adaptive" not in fx
    st = systems.command(systems.parse_system("titan-stock-20"), **kw)
    assert st[:2] == ["-m", "torchtitan.train"] and st[st.index("--checkpoint.async_mode") + 1] == "async"
    assert st[st.index("--checkpoint.interval") + 1] == "20" and st[st.index("--module") + 1] == \
        "bench.goodput.titan_stock"
    with pytest.raises(ValueError, match="not run"):
        systems.command(systems.parse_system("torchft"), **kw)
    assert systems.torchft_status(str(tmp_path)).startswith("not run: torchft 0.2.0 is on the package index")
    assert systems.local_root("/n", "j") == "/n/j/node-{node}"


def test_failure_reason_names_the_ranks_exception():
    text = ("s: attempt 2 failed without an injected failure (cause node-failure)\n--- log:\n  File x\n"
            "tierckpt.errors.NoCheckpointError: no source could restore any step on every node\n  2x no copy")
    assert bg.failure_reason(text) == ("failed: s: attempt 2 failed without an injected failure (cause node-failure)"
                                       " — tierckpt.errors.NoCheckpointError: no source could restore any step on "
                                       "every node")
    assert bg.failure_reason("x") == "failed: x"


def test_parse_args_quick_and_errors():
    a = bg.parse_args(["--quick"])
    assert a.mtbfs == [20.0] and a.seed_list == [1] and a.failures_expected == 2.0
    assert [s.name for s in a.system_list] == list(systems.QUICK_SYSTEMS)
    assert bg.parse_args(["--quick", "--seeds", "4,5"]).seed_list == [4, 5]  # an explicit option wins
    d = bg.parse_args([])
    assert d.mtbfs == [60.0, 180.0] and len(d.seed_list) >= 3 and d.shared_mb_per_s == 200.0
    for argv in (["--mtbf", "0"], ["--seeds", "a"], ["--systems", "nope"], ["--steps", "-1"], ["--cap", "0"]):
        with pytest.raises(SystemExit):
            bg.parse_args(argv)


def _row(system, seed, ettr, mtbf=60.0):
    w = dict.fromkeys(accounting.BUCKETS, (1 - ettr) / len(accounting.BUCKETS))
    return {"system": system, "mtbf_s": mtbf, "seed": seed, "ettr": ettr, "finished": True, "failures": 3,
            "final_step": 80, "wall_s": 200.0, "waste_frac": w, "checkpoints": {"local": 8}, "quiet_step_s": 2.2,
            "t_ref": 2.0, "bookkeeping": [], "curve": {"t": [0.0, 100.0, 200.0], "steps": [0, 40, 80]}}


def _rows():
    rows = []
    for seed in (1, 2, 3):
        rows += [_row("tierckpt-adaptive", seed, 0.80 + 0.01 * seed), _row("tierckpt-fixed-10", seed, 0.81),
                 _row("tierckpt-fixed-20", seed, 0.70), _row("titan-stock-20", seed, 0.60),
                 _row("titan-stock-40", seed, 0.65),
                 {"system": "torchft", "mtbf_s": 60.0, "seed": seed, "skipped": "not run: why"}]
    return rows


def test_verdict_picks_the_best_intervals_and_checks_every_seed():
    v = report.verdict(_rows())[60.0]
    assert v["best_stock"] == "titan-stock-40" and v["best_fixed"] == "tierckpt-fixed-10"
    assert v["vs_stock"] == pytest.approx(0.82 / 0.65) and v["stock_ok"] is True
    assert v["vs_fixed_min"] == pytest.approx(0.81 / 0.81) and v["fixed_ok"] is True
    assert v["torchft"].startswith("not checked")
    bad = _rows()
    bad[0]["ettr"] = 0.78  # seed 1: 0.78 / 0.81 < 0.97
    assert report.verdict(bad)[60.0]["fixed_ok"] is False
    invalid = _rows()
    invalid[0]["bookkeeping"] = ["failure 1 struck attempt 2"]  # left out of the comparison
    assert report.per_system(invalid)[60.0]["tierckpt-adaptive"]["n"] == 2


def test_tables_record_entry_and_plot(tmp_path):
    rows = _rows()
    table = report.rows_table(rows)
    assert table.count("\n") == 1 + len(rows) and "| torchft | 60 | 1 | not run |" in table
    assert "**0.810**" in table and "checkpoints local 8" in table
    summary = report.summary_table(rows)
    assert "| 60 | tierckpt-adaptive | 3 | 0.820 | 0.810 – 0.830 |" in summary
    assert "adaptive ÷ best stock (titan-stock-40) = 1.26×" in summary and "PASS" in summary
    png = report.plot(rows, str(tmp_path / "p.png"))
    assert os.path.getsize(png) > 10_000
    entry = report.record_entry("T", "cmd", "setup", rows, "p.png")
    assert entry.startswith("\n### T\n") and "![useful steps against wall time](p.png)" in entry
    with pytest.raises(ValueError, match="nothing to plot"):
        report.plot(rows[5:6], str(tmp_path / "q.png"))


def test_main_records_a_campaign_of_synthetic_runs(tmp_path, monkeypatch):
    calls = []

    def fake_ref(demo, out, p, steps=15):
        return {"t_ref": 2.0, "samples": 10}

    def fake_run(demo, out, system, plan, p, t_ref):
        calls.append((system.name, plan.seed, plan.gaps[:2], p.steps, p.shared_bps))
        return {**_row(system.name, plan.seed, 0.8 if system.name == "tierckpt-adaptive" else 0.6), "fails": []}

    history = tmp_path / "history" / "2026-12.md"
    monkeypatch.setattr(bg, "measure_reference", fake_ref)
    monkeypatch.setattr(bg, "run_system", fake_run)
    monkeypatch.setattr(bg, "history_md", lambda: str(history))
    monkeypatch.setattr(bg, "REPO", str(tmp_path))
    monkeypatch.setattr(bg.bs, "_load_demo", lambda: None)
    loads = iter([1.0] + [1.5, 2.5] * 20)  # the campaign's start, then before and after each run
    monkeypatch.setattr(bg.os, "getloadavg", lambda: (next(loads), 0.0, 0.0))
    rc = bg.main(["--mtbf", "60", "--seeds", "1,2", "--systems", "tierckpt-adaptive,titan-stock-20,"
                  "tierckpt-fixed-10,torchft", "--out", str(tmp_path / "out"), "--record"])
    assert rc == 0  # adaptive 0.8: ≥ 0.97 × fixed 0.6 on each seed, 1.33× stock (torchft: reported unchecked)
    # every system of a cell got the same failure plan; seed 2 ran in the reverse order
    assert [c[0] for c in calls] == ["tierckpt-adaptive", "titan-stock-20", "tierckpt-fixed-10",
                                     "tierckpt-fixed-10", "titan-stock-20", "tierckpt-adaptive"]
    assert len({c[2] for c in calls[:3]}) == 1 and calls[0][2] != calls[3][2]
    assert {c[3] for c in calls} == {90} and {c[4] for c in calls} == {200e6}  # 3 MTBFs / t_ref; 200 MB/s
    text = history.read_text()
    assert "### Goodput under node failures" in text and "200 MB/s link" in text and "load average" in text
    pngs = [f for f in os.listdir(tmp_path / "bench" / "history") if f.endswith(".png")]
    assert len(pngs) == 1 and f"]({pngs[0]})" in text
    rep = json.loads((tmp_path / "out" / "report.json").read_text())
    assert len(rep["rows"]) == 8 and rep["rows"][3]["skipped"].startswith("not run")
    assert "load 1.5→2.5" in text and "1.5 – 2.5 at the starts and ends of the runs" in text
    assert "within this campaign only" in text and rep["setup"] in text
    assert bg.main(["--from-report", str(tmp_path / "out")]) == 0  # the same tables, no training
    assert len(calls) == 6 and history.read_text() == text  # nothing run, nothing recorded without --record
    assert runner.STOCK_RESTORE_RE.search("Finished loading the checkpoint in 1.25 seconds.").group(1) == "1.25"
