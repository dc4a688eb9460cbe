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
    from tierckpt.staging.pool import StagingPool

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


def _staged(sharded, common):
    from mcore_plugin.convert import Staged

    return Staged(sharded, common, None)


def test_two_leaves_under_one_dotted_path_take_the_full_copy():
    # keys 0 and "0" name the same dotted path: the plan could not tell their tensors apart
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from tierckpt.staging.pool import StagingPool

    x, y = torch.zeros(4), torch.zeros(4)

    def mk():
        return _staged({"opt": {0: ShardedTensor.from_rank_offsets("k0", x, replica_id=0),
                                "0": ShardedTensor.from_rank_offsets("k1", y, replica_id=0)}}, {})

    assert mk().staging_key() is None
    slot = StagingPool(1).acquire()
    slot.stage({"mcore": mk()}, users=1)
    x.fill_(1)
    y.fill_(2)
    s2 = slot.stage({"mcore": mk()}, users=1)["mcore"].sharded["opt"]
    assert torch.equal(s2[0].data, torch.ones(4)) and torch.equal(s2["0"].data, torch.full((4,), 2.0))


def test_a_refresh_that_fails_falls_back_to_the_full_copy(caplog):
    # copy.deepcopy refuses a non-leaf tensor that DCP's stager copies: every save still works
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from tierckpt.staging.pool import StagingPool

    w, p = torch.zeros(4), torch.ones(2, requires_grad=True)

    def mk():
        return _staged({"w": ShardedTensor.from_rank_offsets("w", w, replica_id=0)}, {"loss": p * 2})

    pool = StagingPool(1)
    slot = pool.acquire()
    slot.stage({"mcore": mk()}, users=1)
    for v in (1.0, 2.0, 3.0):
        w.fill_(v)
        got = slot.stage({"mcore": mk()}, users=1)["mcore"]
        assert torch.equal(got.sharded["w"].data, torch.full((4,), v)) and torch.equal(got.common["loss"], p * 2)
        assert slot._plan is None  # not rebuilt for a structure whose refresh failed
    assert sum("copy plan failed" in r.message for r in caplog.records) == 1  # warned once per pool
