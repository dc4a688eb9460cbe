"""bench/bench_mcore_staging.py runs at a tiny size and refuses bad input; the Megatron payload
it stages is refilled by the copy plan (its second stage reuses the first one's copy)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bench"))

import bench_mcore_staging as bms  # noqa: E402


def test_runs_and_the_payload_takes_the_plan(capsys):
    from tierckpt.io.staging import StagingPool

    payload, plain = bms.megatron_payload(1)
    assert len(payload.sharded) == 324 and len(plain) == 284
    slot = StagingPool(1).acquire()
    first = slot.stage({"mcore": payload}, users=1)
    next(iter(plain.values())).add_(1.0)
    second = slot.stage({"mcore": payload}, users=1)
    assert second is first  # refilled, not deep-copied again
    k = next(iter(payload.staging_tensors()))
    assert torch.equal(second["mcore"].staging_tensors()[k], payload.staging_tensors()[k])
    assert bms.main(["--mib", "1", "--reps", "1"]) == 0
    out = capsys.readouterr().out
    assert "DCP deep copy" in out and "copy plan, overlapped" in out


@pytest.mark.parametrize("argv", [["--reps", "0"], ["--mib", "0.5"]]
                         + ([["--device", "cuda"]] if not torch.cuda.is_available() else []))
def test_bad_input_is_refused(argv):
    with pytest.raises(SystemExit):
        bms.main(argv)
