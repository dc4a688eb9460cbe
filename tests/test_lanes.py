"""One lane per tier (tierckpt/tiers/lanes.py), without processes: what a lane holds, in queue
order, and which finished jobs did not commit (what the exit hook names in
``run_end.unfinished``)."""

from __future__ import annotations

import threading

from tierckpt.records import CheckpointRecord, RedundancyRecord
from tierckpt.tiers.lanes import REBUILD, SAVE, Lane, LaneJob


def test_a_lane_holds_every_unfinished_job_in_queue_order():
    lane = Lane("local")
    gate = threading.Event()
    try:
        rebuild = lane.submit_rebuild(gate.wait)  # blocks the FIFO worker until released
        save = lane.submit_save(30, lambda: CheckpointRecord(tier="local", step=30, ok=True))
        assert lane.tail is save and lane.save is save and lane.step == 30
        assert lane.running_step() == 30
        assert [(j.kind, j.step) for j in lane.held()] == [(REBUILD, None), (SAVE, 30)]
        assert not lane.wait_tail(0.2) and lane.overdue is save  # outlived a full wait
        assert not lane.wait_tail(60.0)  # only polled now: returns at once
    finally:
        gate.set()
    assert lane.wait_tail(None) and rebuild.done()
    assert lane.held() == [] and lane.latest_record().ok
    lane.shutdown(wait=True)


def test_failures_of_finished_jobs():
    lane = Lane("local")
    jobs = [
        lane.submit_save(1, lambda: CheckpointRecord(tier="local", step=1, ok=False, error="ENOSPC")),
        lane.submit_rebuild(lambda: RedundancyRecord(step=1, ok=False, missing=[1], error="node 0→node 1: reset")),
        lane.submit_rebuild(lambda: RedundancyRecord(step=1, ok=False, missing=[1], reason="no copy to send")),
        lane.submit_rebuild(lambda: None),  # nothing was missing
        lane.submit_save(2, lambda: (_ for _ in ()).throw(RuntimeError("worker died"))),
    ]
    assert lane.wait_tail(60.0) and all(f.done() for f in jobs)
    # a save's record that failed names its error; a save whose job raised reads as a failed
    # record; a rebuild fails only when a copy or the agreement failed (its record's error)
    assert LaneJob(SAVE, 2, jobs[4]).failure() == "the job never ran: RuntimeError: worker died"
    assert LaneJob(SAVE, 1, jobs[0]).failure() == "ENOSPC"
    assert LaneJob(REBUILD, None, jobs[1]).failure() == "node 0→node 1: reset"
    assert LaneJob(REBUILD, None, jobs[2]).failure() is None  # incomplete, not failed
    assert LaneJob(REBUILD, None, jobs[3]).failure() is None
    lane.shutdown(wait=True)
