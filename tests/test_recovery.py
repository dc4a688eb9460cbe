"""The recovery timeline (tierckpt/recovery/timeline.py): the launchers' environment contract
(TIERCKPT_RECOVERY, TIERCKPT_PROCESS_STARTED), the phase stamps, the merge of every rank's
stamps and the ``recovery`` record built from them (ordering, clamping, notes)."""

from __future__ import annotations

import json
import logging
import os

import pytest

from tierckpt.records import RecoveryRecord
from tierckpt.recovery import timeline as tl
from tierckpt.restore import NodeOutcome, RestoreResult, Source

T0 = 1_700_000_000.0
GOOD = {"attempt": 1, "cause": "node-failure", "failed_nodes": [1], "failure_noticed": T0,
        "survivors_stopped": T0 + 0.5, "launched": T0 + 0.6, "warm": False, "replaced": {"1": "spare slot 3"}}


def _env(**kw) -> dict[str, str]:
    return {k: v if isinstance(v, str) else json.dumps(v) for k, v in kw.items()}


# -- TIERCKPT_RECOVERY ---------------------------------------------------------------------------
def test_recovery_env_good():
    got = tl.launcher_recovery(_env(TIERCKPT_RECOVERY=GOOD))
    assert got == tl.LauncherRecovery(attempt=1, cause="node-failure", failed_nodes=(1,), failure_noticed=T0,
                                      survivors_stopped=T0 + 0.5, launched=T0 + 0.6, warm=False,
                                      replaced={"1": "spare slot 3"})
    assert got.notes == ()


def test_recovery_env_missing_or_empty():
    assert tl.launcher_recovery({}) is None
    assert tl.launcher_recovery({"TIERCKPT_RECOVERY": "  "}) is None


@pytest.mark.parametrize("raw", ["{not json", "[1, 2]", "3"])
def test_recovery_env_bad_json_warns_and_marks_the_phases_unknown(raw, caplog):
    with caplog.at_level(logging.WARNING, logger="tierckpt.recovery.timeline"):
        got = tl.launcher_recovery({"TIERCKPT_RECOVERY": raw})
    assert got is not None and got.cause == "unknown"
    assert (got.failure_noticed, got.survivors_stopped, got.launched) == (None, None, None)
    assert len(got.notes) == 1 and "TIERCKPT_RECOVERY" in got.notes[0]
    assert "TIERCKPT_RECOVERY" in caplog.text


def test_recovery_env_bad_fields_are_unknown_each_named(caplog):
    bad = {**GOOD, "attempt": -1, "failure_noticed": "soon", "launched": -5,
           "warm": "yes", "failed_nodes": ["a"], "replaced": [1], "cause": ""}
    with caplog.at_level(logging.WARNING, logger="tierckpt.recovery.timeline"):
        got = tl.launcher_recovery(_env(TIERCKPT_RECOVERY=bad))
    assert got.attempt is None and got.failure_noticed is None and got.launched is None and got.warm is None
    assert got.survivors_stopped == T0 + 0.5  # the good field is kept
    assert got.cause == "unknown" and got.failed_nodes == () and got.replaced == {}
    named = " ".join(got.notes)
    for key in ("attempt", "failure_noticed", "launched", "warm", "failed_nodes", "replaced", "cause"):
        assert f"TIERCKPT_RECOVERY: {key}=" in named
    assert caplog.text.count("TIERCKPT_RECOVERY") == len(got.notes)


# -- TIERCKPT_PROCESS_STARTED and the stamps -------------------------------------------------------
def test_process_started_env_then_proc(caplog):
    assert tl.process_started({"TIERCKPT_PROCESS_STARTED": str(T0)}) == (T0, [])
    proc, notes = tl.process_started({})
    assert notes == [] and proc is not None and proc <= tl.wall_of(__import__("time").monotonic()) + 1
    with caplog.at_level(logging.WARNING, logger="tierckpt.recovery.timeline"):
        for bad in ("x", "-3", "inf"):
            t, notes = tl.process_started({"TIERCKPT_PROCESS_STARTED": bad})
            assert t == proc and len(notes) == 1 and "TIERCKPT_PROCESS_STARTED" in notes[0]
    assert caplog.text.count("TIERCKPT_PROCESS_STARTED") == 3


def test_mark_phase_once_per_process(monkeypatch):
    monkeypatch.setattr(tl, "_stamps", {})
    first = tl.mark_phase("imports_done")
    assert tl.mark_phase("imports_done") == first  # the first stamp wins
    assert tl.mark_phase("model_built", at=T0) == T0
    with pytest.raises(ValueError, match="unknown phase"):
        tl.mark_phase("restore_done")  # the engine stamps its run's phases itself
    stamps, _ = tl.phase_stamps({"TIERCKPT_PROCESS_STARTED": str(T0 - 1)})
    assert stamps == {"imports_done": first, "model_built": T0, "processes_started": T0 - 1}
    tl._after_fork()  # a forked child starts with no stamps
    assert tl.phase_stamps({})[0].keys() == {"processes_started"}


def test_process_group_hook_stamps_the_return(monkeypatch):
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    monkeypatch.setattr(tl, "_stamps", {})
    calls = []

    def fake(*a, **kw):
        calls.append((a, kw))
        assert "process_group_up" not in tl._stamps  # stamped when it returns
        return "pg"

    monkeypatch.setattr(dist, "init_process_group", fake)
    monkeypatch.setattr(c10d, "init_process_group", fake)
    assert tl.install_process_group_hook() is True
    assert tl.install_process_group_hook() is False  # once per process
    assert dist.init_process_group is c10d.init_process_group is not fake
    assert dist.init_process_group("gloo", rank=0) == "pg" and calls == [(("gloo",), {"rank": 0})]
    assert "process_group_up" in tl._stamps


# -- merge and record -------------------------------------------------------------------------------
def _rank(rank, node, start, launcher=GOOD, **extra):
    stamps = {"processes_started": start, "imports_done": start + 5.0, "process_group_up": start + 6.0,
              "model_built": start + 7.0, "restore_done": start + 7.5, "first_step_done": start + 9.0, **extra}
    rec = tl.launcher_recovery(_env(TIERCKPT_RECOVERY=launcher)) if launcher is not None else None
    return tl.rank_summary(rank, node, stamps, rec)


def _result():
    return RestoreResult(step=6, sources={0: NodeOutcome(0, 6, Source("own-local", 0), True, bytes=10, seconds=0.2),
                                          1: NodeOutcome(1, 6, Source("peer-replica", 0), True, bytes=12,
                                                         seconds=0.3)},
                         attempts=1, failures=[], seconds=0.4, persistent_bytes_read=0)


def test_merge_is_the_same_flat_or_by_node():
    parts = [_rank(0, 0, T0 + 1.0), _rank(1, 0, T0 + 1.2), _rank(2, 1, T0 + 1.1), _rank(3, 1, T0 + 0.9)]
    flat = tl.merge_summaries(parts)
    tree = tl.merge_summaries([tl.merge_summaries(parts[:2]), tl.merge_summaries(parts[2:])])
    assert flat == tree
    assert flat["phases"]["processes_started"] == T0 + 1.2 and flat["first_start"] == T0 + 0.9
    assert flat["nodes"] == {0: {"processes_started": T0 + 1.2, "imports_done": T0 + 6.2},
                             1: {"processes_started": T0 + 1.1, "imports_done": T0 + 6.1}}
    assert flat["info"][0] == 0 and flat["recovering"] is True


def test_record_after_a_launcher_failure():
    merged = tl.merge_summaries([_rank(0, 0, T0 + 1.0), _rank(1, 1, T0 + 1.2)])
    rec = tl.build_record(merged, _result(), restart=1)
    assert (rec.step, rec.cause, rec.attempt, rec.restart_count, rec.failed_nodes, rec.warm, rec.replaced) == (
        6, "node-failure", 1, 1, [1], False, {"1": "spare slot 3"})
    assert rec.origin == "failure_noticed" and rec.notes == []
    assert list(rec.phases) == list(tl.PHASES) == [p for p, _ in rec.phase_rows()]
    secs = [s for _, s in rec.phase_rows()]
    assert secs == [0.0, 0.5, 0.6, 1.2, 6.2, 7.2, 8.2, 8.7, 10.2]
    assert rec.total_s == 10.2
    assert rec.nodes == {"0": {"source": "own-local", "holder": 0, "bytes": 10, "seconds": 0.2,
                               "processes_started_s": 1.0, "imports_done_s": 6.0},
                         "1": {"source": "peer-replica", "holder": 0, "bytes": 12, "seconds": 0.3,
                               "processes_started_s": 1.2, "imports_done_s": 6.2}}
    assert RecoveryRecord.from_ledger(json.loads(json.dumps(rec.as_line()))) == rec


def test_negative_durations_are_clamped_and_noted():
    # survivors_stopped before failure_noticed (the launcher's clock), processes before the
    # launch (another host's clock): no negative duration is written, the notes say what moved
    skewed = {**GOOD, "survivors_stopped": T0 - 2.0}
    merged = tl.merge_summaries([_rank(0, 0, T0 + 0.1, launcher=skewed), _rank(1, 1, T0 + 0.2, launcher=skewed)])
    rec = tl.build_record(merged, _result())
    secs = dict(rec.phase_rows())
    assert secs["survivors_stopped"] == 0.0 and secs["processes_started"] == 0.6  # clamped to launched (0.6)
    assert all(b >= a for a, b in zip([s for s in secs.values()], list(secs.values())[1:]))
    assert any("survivors_stopped was 2.000 s before failure_noticed" in n for n in rec.notes)
    assert any("processes_started was 0.400 s before launched" in n for n in rec.notes)
    assert rec.nodes["0"]["processes_started_s"] == 0.6 and any("node 0" in n for n in rec.notes)
    assert rec.total_s == secs["first_step_done"] > 0


def test_implausible_phase_is_left_unknown():
    stale = {**GOOD, "failure_noticed": T0 - 10 * 86400.0}  # a stale variable: days before the rest
    merged = tl.merge_summaries([_rank(0, 0, T0 + 1.0, launcher=stale)])
    rec = tl.build_record(merged, _result())
    assert rec.origin == "failure_noticed"
    assert rec.phases["survivors_stopped"] is None and rec.total_s is None
    assert any("implausible" in n for n in rec.notes)


def test_restart_without_a_launcher_failure_counts_from_process_start():
    merged = tl.merge_summaries([_rank(0, 0, T0 + 1.0, launcher=None), _rank(1, 1, T0 + 0.5, launcher=None)])
    rec = tl.build_record(merged, _result())
    assert rec.cause == "restart" and rec.origin == "processes_started" and rec.total_s is None
    secs = dict(rec.phase_rows())
    assert secs["failure_noticed"] is None and secs["launched"] is None
    assert secs["processes_started"] == 0.5 and secs["first_step_done"] == 9.5  # from the earliest start
    assert rec.nodes["1"]["processes_started_s"] == 0.0


def test_bad_recovery_env_still_gives_the_rank_phases():
    merged = tl.merge_summaries([_rank(0, 0, T0 + 1.0, launcher="{oops")])
    rec = tl.build_record(merged, _result())
    assert rec.cause == "unknown" and rec.origin == "processes_started" and rec.total_s is None
    assert rec.phases["failure_noticed"] is None and rec.phases_s["first_step_done"] == 9.0
    assert any("TIERCKPT_RECOVERY is not JSON" in n for n in rec.notes)


def test_unknown_phases_stay_unknown():
    merged = tl.merge_summaries([tl.rank_summary(0, 0, {"processes_started": T0 + 1, "restore_done": T0 + 3,
                                                        "first_step_done": T0 + 4},
                                                 tl.launcher_recovery(_env(TIERCKPT_RECOVERY=GOOD)))])
    rec = tl.build_record(merged, None)
    assert rec.phases_s["imports_done"] is None and rec.phases_s["model_built"] is None
    assert rec.total_s == 4.0 and rec.step is None and rec.nodes["0"]["source"] is None


def test_step_done_writes_once_after_a_restore(tmp_path, monkeypatch):
    """The engine's part without a process group: one rank, gather_reduced over no group."""
    import time as _time
    from types import SimpleNamespace

    from tierckpt.history.ledger import Ledger
    from tierckpt.io.storage import Store

    monkeypatch.setenv("TIERCKPT_RECOVERY", json.dumps({**GOOD, "failure_noticed": _time.time() - 3,
                                                         "survivors_stopped": _time.time() - 2.5,
                                                         "launched": _time.time() - 2.4}))
    monkeypatch.setattr(tl, "gather_reduced", lambda obj, group, reduce: reduce([obj]))
    led = Ledger(Store(str(tmp_path)), enabled=True, run_id="r", job="j")
    timeline = tl.RecoveryTimeline(SimpleNamespace(rank=0, node=0), None, led)
    resume = SimpleNamespace(last_result=None, restored_mono=None)
    assert timeline.step_done(resume) is None  # no restore yet: nothing, no collective
    resume.last_result, resume.restored_mono = _result(), _time.monotonic()
    rec = timeline.step_done(resume)
    assert rec is not None and timeline.record is rec and timeline.step_done(resume) is None
    (line,) = Ledger.read(led.store)
    assert line["kind"] == "recovery" and line["cause"] == "node-failure" and 2.4 < line["total_s"] < 10
    assert line["phases_s"]["restore_done"] <= line["phases_s"]["first_step_done"]
    assert os.environ["TIERCKPT_RECOVERY"]  # read, not consumed
