"""The clock of every recorded time (tierckpt/clock.py): a forward step of the host's wall clock
inside a run moves no duration the scheduler uses — not R, not the MTBF's exposure — and a sample
that spans two disagreeing clocks is left out with a warning instead of multiplying R."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time

from tests import scenarios_clock
from tests.harness import run_world
from tierckpt import clock
from tierckpt.history.ledger import Ledger
from tierckpt.io.storage import Store
from tierckpt.records import parse_records, RestoreRecord, RunStartRecord
from tierckpt.sched.mtbf import evidence_from_ledger
from tierckpt.sched.schedule import Scheduler

DAY = 86400.0


def test_now_does_not_follow_a_wall_clock_step(monkeypatch):
    t0 = clock.now()
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + DAY)
    assert 0 <= clock.now() - t0 < 5.0
    assert abs(clock.wall_jump_s() - DAY) < 5.0


def test_anchor_is_inherited_by_child_processes_and_refused_from_another_boot():
    code = "from tierckpt import clock; print(clock._anchor[0], clock._anchor[1])"
    env = dict(os.environ)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    wall0, boot0 = map(float, out.stdout.split())
    assert (wall0, boot0) == clock._anchor
    env[clock.ANCHOR_ENV] = f"{clock._anchor[0] - DAY!r} {clock._anchor[1]!r} another-boot"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    wall1, _ = map(float, out.stdout.split())
    assert abs(wall1 - time.time()) < 60.0  # a fresh anchor on this host's wall clock


def test_a_day_forward_inside_a_run_moves_neither_R_nor_the_exposure(tmp_path):
    base = str(tmp_path)
    t_start = time.monotonic()
    run_world(scenarios_clock.phase_save_then_crash, 2, base, 3)
    out = run_world(scenarios_clock.phase_restore_with_jump, 2, base, DAY, 3)
    elapsed = time.monotonic() - t_start
    assert out[0].value["step"] == 3
    assert abs(out[0].value["jump"] - DAY) < 60.0  # the wall clock did jump in that run
    recs = parse_records(Ledger.read(Store(os.path.join(base, "pfs"))))
    run2 = [r for r in recs if isinstance(r, RunStartRecord)][-1].run_id
    restore = [r for r in recs if isinstance(r, RestoreRecord) and r.run_id == run2][0]
    start = [r for r in recs if isinstance(r, RunStartRecord) and r.run_id == run2][0]
    assert 0 <= restore.time - start.time < elapsed
    ev = evidence_from_ledger(recs)
    assert ev.failures == 1 and 0 < ev.exposure_s < elapsed, (ev, elapsed)
    sched = Scheduler(("local", "persistent"))
    sched.update_from_ledger(recs)
    assert 0 < sched.restart_s < elapsed, sched.restart_s


def test_a_sample_across_disagreeing_clocks_is_left_out_with_a_warning(caplog):
    base = {"run_id": "r2", "job": "j"}
    recs = [
        {"kind": "run_start", "time": 1000.0, "run_id": "r1", "job": "j", "world_size": 2},
        {"kind": "run_start", "time": 2000.0, "process_start": 1990.0, **base, "world_size": 2},
        # written by a host whose clock was a day ahead of the launcher's: t - process_start is a day
        {"kind": "restore", "time": 2000.0 + DAY, "step": 3, "seconds": 0.4, "sources": {}, **base},
        {"kind": "recovery", "time": 2001.0 + DAY, "total_s": DAY + 12.0, **base},
    ]
    sched = Scheduler(("local",))
    with caplog.at_level(logging.WARNING, logger="tierckpt.clock"):
        sched.update_from_ledger(recs)
    assert sched.restart_s == 0.4  # the restore's own (monotonic) duration, not a day
    assert "implausible" in caplog.text and "r2" in caplog.text
    # the scheduler's own samples: a day-long step or save is refused the same way
    sched.observe_step(1.0)
    sched.observe_step(DAY * 2)
    assert sched.step_s == 1.0
