"""torchtitan ``checkpoint.load_step`` and ``checkpoint.load_only`` (issue 14, item 2), through
``python -m titan_plugin.train`` on 2 ranks (local and persistent tier every 3 steps; the
last step of a run saves both tiers; 10 persistent steps kept).

1. Train 7 steps: local 6 and 7 (+ replicas), persistent 3, 6, 7.
2. Training run with ``load_step 3`` (a rollback by name): restores 3; the newer steps stay
   committed until its first commit (step 5), and only then are superseded; the ledger's
   ``rollback`` record follows that commit.
3. Evaluation run (``load_only``, ``load_step 3``): restores 3 and rewrites nothing; every
   committed step of every tier is still committed, and the next plain relaunch resumes at
   the newest one, 5 (the rollback's timeline; trains to 6).
"""

from __future__ import annotations

import json
import os

from tests.test_titan_resume import _train as _train_demo
from tierckpt.cli import find_steps


def _train(tmp, steps, *extra):
    return _train_demo(tmp, steps, "--checkpoint.keep_latest_k", "10", *extra)


def _committed(tmp: str) -> set[tuple[str, int | None, int]]:
    return {(s.tier, s.node, s.step) for s in find_steps(tmp) if s.committed}


def _runs(tmp: str) -> list[list[dict]]:
    """The ledger's records split per run (run_start first)."""
    runs: list[list[dict]] = []
    for line in open(os.path.join(tmp, "run", "checkpoint", "tierckpt-ledger.jsonl")):
        r = json.loads(line)
        if r["kind"] == "run_start":
            runs.append([])
        runs[-1].append(r)
    return runs


def test_load_only_keeps_history_and_load_step_in_training_rolls_back_at_first_commit(tmp_path):
    tmp = str(tmp_path)
    _train(tmp, 7)
    trained = _committed(tmp)
    every = {("local", n, s) for n in (0, 1) for s in (6, 7)} | {("replica", n, s) for n in (0, 1) for s in (6, 7)} \
        | {("persistent", None, s) for s in (3, 6, 7)}
    assert trained == every, trained

    # 2. training with load_step 3: a rollback, executed at the run's first commit
    before = trained
    _train(tmp, 5, "--checkpoint.load_step", "3")
    run = _runs(tmp)[1]
    assert [r["step"] for r in run if r["kind"] == "restore"] == [3]
    kinds = [(r["kind"], r.get("tier"), r.get("step")) for r in run if r["kind"] in ("checkpoint", "rollback")]
    first_commit = next(i for i, r in enumerate(run) if r["kind"] == "checkpoint" and r["ok"])
    rb = [i for i, r in enumerate(run) if r["kind"] == "rollback"]
    assert len(rb) == 1 and rb[0] > first_commit, kinds  # not before the new timeline's first commit
    rec = run[rb[0]]
    assert any(r["kind"] == "checkpoint" and r["ok"] and (r["tier"], r["step"]) == (rec["trigger"]["tier"], 5)
               for r in run[:rb[0]]), kinds
    assert (rec["from_step"], rec["to_step"], rec["trigger"]["step"]) == (7, 3, 5), rec
    newer = {x for x in before if x[2] > 3}
    assert sorted(rec["superseded"]) == sorted(
        f"persistent/{s}" if t == "persistent" else f"local node-{n}/{s}" if t == "local"
        else f"replica node-{1 - n}@node-{n}/{s}" for t, n, s in newer), rec
    rolled = _committed(tmp)
    assert {x for x in rolled if x[2] > 3} == {("local", 0, 5), ("local", 1, 5), ("replica", 0, 5),
                                               ("replica", 1, 5), ("persistent", None, 5)}, rolled
    for s in (6, 7):  # superseded, not deleted
        assert os.path.exists(os.path.join(tmp, "run", "checkpoint", f"step-{s}", "tierckpt.committed.superseded"))

    # 3. evaluation: load_only + load_step 3 (no step to train: nothing but the load runs)
    _train(tmp, 3, "--checkpoint.load_only", "true", "--checkpoint.load_step", "3")
    (ev,) = _runs(tmp)[2:]
    assert [r["step"] for r in ev if r["kind"] == "restore"] == [3]
    assert not [r for r in ev if r["kind"] in ("checkpoint", "rollback")], ev
    assert _committed(tmp) == rolled
    # the next plain relaunch resumes the newest committed step: the rollback's 5, not 7
    _train(tmp, 6)
    assert [r["step"] for r in _runs(tmp)[3] if r["kind"] == "restore"] == [5]
