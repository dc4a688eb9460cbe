"""The recovery timeline end to end on 2 ranks as 2 simulated nodes: a job saves and fails,
node 1 loses its local root, the launcher restarts it with TIERCKPT_RECOVERY and
TIERCKPT_PROCESS_STARTED set, the restore serves node 0 from its own copy and node 1 from the
replica, and the first observe_step after it writes one ``recovery`` record: every phase
present and in order, the per-node sources right, the total from the failure to that step."""

from __future__ import annotations

import json
import shutil
import time

from tests import scenarios_recovery as sr
from tests.harness import run_world
from tierckpt.history.ledger import Ledger
from tierckpt.io.storage import Store
from tierckpt.records import RECOVERY_PHASES, RecoveryRecord, RestoreRecord, parse_records

K = 3


def test_recovery_record_after_a_restart(tmp_path):
    base = str(tmp_path)
    first = run_world(sr.phase_save_then_fail, 2, base, K)
    assert [r.value for r in first] == [None, None]  # no restore, no record
    failure_noticed = time.time()
    shutil.rmtree(tmp_path / "nvme" / "node-1")  # node 1's disk is gone with it
    survivors_stopped = time.time()
    launched = time.time()
    env = {"TIERCKPT_RECOVERY": json.dumps({"attempt": 1, "cause": "node-failure", "failed_nodes": [1],
                                            "failure_noticed": failure_noticed,
                                            "survivors_stopped": survivors_stopped, "launched": launched,
                                            "warm": False, "replaced": {}}),
           "TIERCKPT_PROCESS_STARTED": repr(launched + 0.01), "TIERCKPT_RESTART_COUNT": "1"}
    out = run_world(sr.phase_recover, 2, base, K, env=env)
    assert out[0].value == out[1].value  # every rank built the same record

    recs = parse_records(Ledger.read(Store(str(tmp_path / "pfs"))))
    (rec,) = [r for r in recs if isinstance(r, RecoveryRecord)]
    restore = next(r for r in recs if isinstance(r, RestoreRecord))
    assert recs.index(rec) > recs.index(restore) and rec.run_id == restore.run_id
    assert rec.as_ledger() == out[0].value
    assert (rec.step, rec.cause, rec.attempt, rec.restart_count, rec.failed_nodes, rec.warm) == (
        K, "node-failure", 1, 1, [1], False)
    assert rec.origin == "failure_noticed" and rec.notes == [], rec.notes
    rows = rec.phase_rows()
    assert [p for p, _ in rows] == list(RECOVERY_PHASES)
    secs = [s for _, s in rows]
    assert all(s is not None for s in secs), rows
    assert secs == sorted(secs) and secs[0] == 0.0, rows
    assert rec.phases["failure_noticed"] == round(failure_noticed, 6)
    assert rec.phases["processes_started"] == round(launched + 0.01, 6)  # the launcher's value, not /proc
    assert rec.total_s == rec.phases_s["first_step_done"] > rec.phases_s["restore_done"] > 0
    assert {n: (v["source"], v["holder"]) for n, v in rec.nodes.items()} == {
        "0": ("own-local", 0), "1": ("peer-replica", 0)}
    for n, v in rec.nodes.items():
        assert v["bytes"] == restore.sources[n]["bytes"] > 0
        assert 0 < v["processes_started_s"] <= v["imports_done_s"] <= rec.phases_s["imports_done"]
