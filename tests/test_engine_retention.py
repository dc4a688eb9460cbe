"""Retention as operators run it (issue 33 §2): a 200-step run with the newest k = 2, one step
every 50 and milestone 120 keeps exactly the promised steps after every save, across a
rollback by name and a fallback from a corrupt newest step, and says why (``tierckpt ls``).

Two ranks, persistent tier only (tests/scenarios_retention.py). What is promised is derived
here from the rules (:func:`promised`), not copied from a run: the timeline's saves in order,
the newest k of them, the first save of every window [50b, 50(b+1)), b >= 1, the milestones,
and the step the run restored from.
"""

from __future__ import annotations

import json
import os

from tests import scenarios_retention as sc
from tests.harness import run_world
from tests.scenarios_timeline import corrupt_step_dir
from tierckpt.cli import main as cli_main

K, EVERY, MILESTONE = 2, 50, 120
CFG = {"keep_latest_k": {"persistent": K}, "keep_every_n_steps": EVERY, "keep_steps": (MILESTONE,)}


def promised(timeline: list[int], restored: int | None = None) -> set[int]:
    """The steps the rules keep after the saves ``timeline`` (the live timeline, oldest first)."""
    first_of_window: dict[int, int] = {}
    for s in timeline:
        if s // EVERY >= 1:
            first_of_window.setdefault(s // EVERY, s)
    keep = set(timeline[-K:]) | set(first_of_window.values()) | {s for s in timeline if s == MILESTONE}
    return keep | ({restored} if restored is not None else set())


def _check_run(out, timeline: list[int], restored: int | None) -> list[int]:
    """Every save's committed steps are the promise of the timeline so far; returns the final one."""
    rank0 = out[0].value
    assert rank0["restored"] == restored and all(r.value["restored"] == restored for r in out), [r.value for r in out]
    if restored is not None:
        assert all(r.value["value"] == float(restored) for r in out)  # the save of that step, loaded
    assert [s for s, _ in rank0["after"]] == [s for s in timeline if s > (restored or 0)], rank0["after"]
    for s, committed in rank0["after"]:
        upto = timeline[:timeline.index(s) + 1]
        assert set(committed) == promised(upto, restored), (s, committed, sorted(promised(upto, restored)))
    return rank0["after"][-1][1]


def _record(base: str) -> dict:
    with open(os.path.join(base, "pfs", "tierckpt-retention.json")) as f:
        return json.load(f)["kept"]


def test_200_steps_rollback_and_fallback_keep_exactly_the_promised_steps(tmp_path, capsys):
    base = str(tmp_path)
    steps = list(range(sc.SAVE_EVERY, 201, sc.SAVE_EVERY))
    # run 1: 200 steps from scratch
    final = _check_run(run_world(sc.phase_run, 2, base, 200, CFG), steps, None)
    assert final == sorted(promised(steps)) == [50, 100, 120, 150, 190, 200]
    kept = _record(base)
    assert kept["step-50"]["reasons"] == ["every 50 steps"] and kept["step-120"]["reasons"] == ["milestone"]
    assert kept["step-200"]["reasons"] == ["newest 2", "every 50 steps"], kept

    # run 2: a training run rolls back to 120 and saves up to 160; the abandoned timeline's 150 and
    # 200 (picks of their windows) are superseded, the new timeline's 150 is the window's pick
    timeline = [s for s in steps if s <= 120] + [130, 140, 150, 160]
    final = _check_run(run_world(sc.phase_run, 2, base, 160, CFG, {"step": 120}), timeline, 120)
    assert final == sorted(promised(timeline, 120))
    assert 190 not in final and 200 not in final

    # run 3: the newest step (160) is corrupt: the restore falls back to 150, which is kept for the
    # run whatever k says; the saves go on to 180
    assert corrupt_step_dir(os.path.join(base, "pfs", "step-160")) > 0
    timeline = [s for s in timeline if s <= 150] + [160, 170, 180]
    final = _check_run(run_world(sc.phase_run, 2, base, 180, CFG, {}), timeline, 150)
    assert final == sorted(promised(timeline, 150))
    kept = _record(base)
    assert kept["step-150"]["reasons"] == ["every 50 steps", "restored from"], kept

    # run 4: another fallback (180 corrupt) to 170, which no rule but "restored from" keeps: still
    # there when the run's saves 190 and 200 are the newest 2
    assert corrupt_step_dir(os.path.join(base, "pfs", "step-180")) > 0
    timeline = [s for s in timeline if s <= 170] + [180, 190, 200]
    final = _check_run(run_world(sc.phase_run, 2, base, 200, CFG, {}), timeline, 170)
    assert 170 in final and final == sorted(promised(timeline, 170))

    # tierckpt ls says why each step is kept
    capsys.readouterr()
    assert cli_main(["ls", "--json", os.path.join(base, "pfs")]) == 0
    rows = {r["step"]: r for r in json.loads(capsys.readouterr().out) if r["committed"]}
    assert sorted(rows) == final
    assert rows[120]["kept_because"] == ["milestone"] and rows[190]["kept_because"] == ["newest 2"], rows
    assert rows[170]["kept_because"] == ["restored from"], rows
    assert cli_main(["ls", os.path.join(base, "pfs")]) == 0
    table = capsys.readouterr().out
    assert "kept because" in table and "milestone" in table and "every 50 steps" in table
