"""Overlapped CPU staging (``TierConfig.cpu_staging = "overlapped"``, tierckpt/staging/overlap.py):
large tensors copied by a background thread after ``save()`` returns, small ones inside it;
the copy is a snapshot of the state at ``save()`` as long as the trainer waits before writing,
and a write that races the copy fails that step's save on every tier (never committed). The
engine test trains an FSDP2 model on 2 gloo ranks as 2 nodes, the optimizer waiting through
the global step pre-hook, and restores the last intact step bitwise."""

from __future__ import annotations

import threading

import pytest
import torch

from tests import scenarios_overlap as so
from tests.harness import run_world
from tierckpt.config import TierConfig
from tierckpt.errors import ConfigError, StagingError
from tierckpt.staging import overlap
from tierckpt.staging.pool import StagingPool

BIG = overlap.OVERLAP_MIN_BYTES // 4  # float32 elements of a tensor that is deferred


def _state(x: float = 0.0) -> dict:
    return {"big": torch.full((2 * BIG,), x), "small": torch.full((8,), x), "step": int(x)}


def _stage_twice(pool: StagingPool, sd: dict):
    """The first stage of a structure builds the copy plan (blocking, DCP's stager); the second
    uses it (overlapped). Returns (slot, staged) of the second."""
    slot = pool.acquire()
    slot.stage(sd, users=1)
    slot.release()
    slot = pool.acquire()
    return slot, slot.stage(sd, users=1)


@pytest.fixture
def held_copier(monkeypatch):
    """Hold the copy thread until the test releases it (the copy is then surely still pending)."""
    gate = threading.Event()
    run = overlap.PendingCopy.run

    def gated(self):
        gate.wait(30)
        run(self)

    monkeypatch.setattr(overlap.PendingCopy, "run", gated)
    return gate


def test_large_tensors_copied_after_stage_small_ones_inside(held_copier):
    pool = StagingPool(1, overlapped=True)
    sd = _state(1.0)
    slot, staged = _stage_twice(pool, sd)
    assert slot._pending is not None and slot._pending.nbytes == sd["big"].nbytes
    assert not slot.copied()  # the large copy waits on the held thread: stage() did not make it
    # the small tensor and the scalar were copied inside stage(): a write now does not reach them
    sd["small"].add_(5.0)
    assert torch.equal(staged["small"], torch.full((8,), 1.0)) and staged["step"] == 1
    held_copier.set()
    assert pool.wait_for_staging() >= 0.0
    assert slot.copied() and slot._pending.sealed
    assert torch.equal(staged["big"], torch.full((2 * BIG,), 1.0))
    sd["big"].add_(7.0)  # after the wait: the trainer's optimizer step
    slot.check_intact()  # sealed before the write: still a snapshot
    assert torch.equal(staged["big"], torch.full((2 * BIG,), 1.0))
    slot.release()
    pool.close()


def test_a_write_before_the_wait_fails_the_check(held_copier):
    pool = StagingPool(1, overlapped=True)
    sd = _state(2.0)
    slot, _ = _stage_twice(pool, sd)
    sd["big"].mul_(3.0)  # the trainer writes before waiting; the copy has not started
    held_copier.set()
    with pytest.raises(StagingError, match=r"modified in place while they were being copied.*wait_for_staging"):
        slot.check_intact()
    pool.wait_for_staging()  # sealing keeps the verdict
    with pytest.raises(StagingError):
        slot.check_intact()
    slot.release()
    pool.close()


def test_a_write_after_the_copy_but_before_any_wait_fails_too():
    # the copy finished, then the trainer wrote without waiting: the copy may be intact, but a
    # write that started during the copy looks the same, so the save is refused
    pool = StagingPool(1, overlapped=True)
    sd = _state(3.0)
    slot, staged = _stage_twice(pool, sd)
    slot.wait_copied()
    assert torch.equal(staged["big"], torch.full((2 * BIG,), 3.0))
    sd["big"].add_(1.0)
    with pytest.raises(StagingError, match="after save"):
        slot.check_intact()
    slot.release()
    pool.close()


def test_restaging_a_slot_waits_for_its_previous_copy(held_copier):
    pool = StagingPool(1, overlapped=True)
    sd = _state(4.0)
    slot, staged = _stage_twice(pool, sd)
    slot.release()  # e.g. every tier deferred: the slot is free while its copy is pending
    slot = pool.acquire()
    out = {}
    t = threading.Thread(target=lambda: out.update(staged=slot.stage(_state(9.0), users=1)))
    t.start()
    t.join(0.3)
    assert t.is_alive()  # a new stage into the same buffers waits for the pending copy
    held_copier.set()
    t.join(30)
    pool.wait_for_staging()
    assert torch.equal(out["staged"]["big"], torch.full((2 * BIG,), 9.0))
    slot.release()
    pool.close()


def test_a_written_tensor_is_copied_inside_stage_from_then_on(held_copier):
    pool = StagingPool(1, overlapped=True)
    sd = {"a": torch.full((2 * BIG,), 1.0), "b": torch.full((2 * BIG,), 2.0)}
    slot, _ = _stage_twice(pool, sd)
    assert slot._pending.names == ["a", "b"]
    sd["b"].add_(1.0)  # a buffer the model writes between save() and the optimizer step
    held_copier.set()
    with pytest.raises(StagingError, match=r"\(b\) were modified in place.*copied inside save\(\) from the next"):
        slot.check_intact()
    slot.release()
    slot = pool.acquire()
    staged = slot.stage(sd, users=1)
    assert slot._pending.names == ["a"]  # "b" was copied inside stage()
    sd["b"].add_(1.0)
    slot.check_intact()
    assert torch.equal(staged["b"], torch.full((2 * BIG,), 3.0))
    slot.release()
    pool.close()


def test_a_failed_copy_fails_the_check(monkeypatch):
    pool = StagingPool(1, overlapped=True)
    sd = _state(7.0)
    slot = pool.acquire()
    slot.stage(sd, users=1)
    slot.release()

    def broken(dsts, srcs):
        raise RuntimeError("injected copy failure")

    monkeypatch.setattr(overlap.torch, "_foreach_copy_", broken)
    slot = pool.acquire()
    sd["big"].fill_(8.0)
    sd["small"].fill_(8.0)
    # the plan's copy of the small tensors fails inside stage(): that save takes DCP's full copy
    staged = slot.stage(sd, users=1)
    monkeypatch.undo()
    assert slot._pending is None and pool.plan_warned
    assert torch.equal(staged["big"], sd["big"]) and torch.equal(staged["small"], sd["small"])
    slot.release()
    pool.close()
    # only the background copy fails: the small tensors copy, the large one raises in the thread
    pool = StagingPool(1, overlapped=True)
    slot, _ = _stage_twice(pool, {"big": torch.full((2 * BIG,), 1.0)})
    pool.wait_for_staging()  # that copy ran as usual before the copy thread's run is replaced
    slot.release()
    gate = threading.Event()
    run = overlap.PendingCopy.run

    def failing_run(self):
        gate.wait(30)
        with monkeypatch.context() as m:
            m.setattr(overlap.torch, "_foreach_copy_", broken)
            run(self)

    monkeypatch.setattr(overlap.PendingCopy, "run", failing_run)
    slot = pool.acquire()
    slot.stage({"big": torch.full((2 * BIG,), 2.0)}, users=1)
    gate.set()
    with pytest.raises(StagingError, match="staging copy failed: RuntimeError: injected copy failure"):
        slot.check_intact()
    slot.release()
    pool.close()


def test_dtensor_writes_through_the_local_tensor_are_seen(held_copier):
    # DTensor in-place ops move the DTensor's counter; a write through to_local() only the
    # local tensor's: both are watched
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from tests.harness import free_port

    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    w = distribute_tensor(torch.full((2 * BIG,), 1.0), mesh, [Shard(0)])
    pool = StagingPool(1, overlapped=True)
    slot, _ = _stage_twice(pool, {"w": w})
    w.to_local().add_(1.0)
    held_copier.set()
    try:
        with pytest.raises(StagingError, match=r"\(w\) were modified"):
            slot.check_intact()
        slot.release()
        pool.close()
    finally:
        if owned:
            dist.destroy_process_group()  # the other tests of this process expect none


def test_inference_tensors_are_copied_inside_stage():
    with torch.inference_mode():
        sd = _state(5.0)  # inference tensors have no version counter to guard a later copy
    pool = StagingPool(1, overlapped=True)
    slot, staged = _stage_twice(pool, sd)
    assert slot._pending is None and slot.copied()
    assert torch.equal(staged["big"], torch.full((2 * BIG,), 5.0))
    slot.release()
    pool.close()


def test_blocking_pool_copies_everything_inside_stage():
    pool = StagingPool(1)
    slot, staged = _stage_twice(pool, _state(6.0))
    assert slot._pending is None and slot.copied()
    slot.release()
    pool.close()


def test_cpu_staging_option_is_checked(tmp_path):
    with pytest.raises(ConfigError, match=r"cpu_staging: must be 'blocking' or 'overlapped', got 'async'"):
        TierConfig(persistent_root=str(tmp_path), tiers=("persistent",), cpu_staging="async")
    assert TierConfig(persistent_root=str(tmp_path), tiers=("persistent",)).cpu_staging == "blocking"


def test_overlapped_training_restores_the_last_intact_step(tmp_path):
    racing = 5
    out = [r.value for r in run_world(so.phase_overlapped_training, 2, str(tmp_path), racing)]
    for r in out:
        assert r["restored"] == racing - 1  # the raced step is on no tier; values checked bitwise in the rank
        assert set(r["kind"].values()) == {"own-local"}
        # each of the 2 staging slots builds its copy plan at its first save, then defers
        assert r["deferred"][:2] == [0, 0] and all(r["deferred"][2:])
        assert all(r["sealed_by_optimizer"])  # each optimizer step waited for the last save's copies
        assert not r["copied_at_return"]  # save() did not wait for the held copy ...
        save_delta, waited, recorded = r["booked"]
        # ... but its δ (handle and every tier's record) includes the trainer's wait for the
        # previous save's held copy
        assert waited > 0.35 and save_delta >= waited and all(x >= waited for x in recorded), r["booked"]
        for tier, (ok, error) in r["racing"].items():
            assert not ok and "StagingError" in error and "modified in place" in error, (tier, error)
        assert racing not in r["committed"]["local"] and racing not in r["committed"]["persistent"]
        assert racing - 1 in r["committed"]["local"] and racing - 1 in r["committed"]["persistent"]
        assert r["hooks_after_close"] == 0


def test_a_race_on_one_rank_fails_in_agreed_phases(tmp_path):
    out = [r.value for r in run_world(so.phase_one_rank_races, 2, str(tmp_path), timeout=240)]
    # the agreed records: step 4 is on no tier of every node ...
    assert [r["outcome"] for r in out] == [{"local": False, "persistent": False}] * 2
    # ... node 0's own copy was intact and committed, node 1's was refused
    assert 4 in out[0]["committed"]["local"] and 4 not in out[1]["committed"]["local"]
    assert all(4 not in r["committed"]["persistent"] for r in out)
    assert [r["restored"] for r in out] == [3, 3]


def test_holder_tensors_are_deferred_and_named_in_a_race(held_copier):
    from tests.test_staging_plan import _Holder

    pool = StagingPool(1, overlapped=True)
    sd = {"payload": _Holder({"decoder.w": torch.full((2 * BIG,), 1.0), "decoder.norm": torch.ones(8)}, {})}
    slot, staged = _stage_twice(pool, sd)
    assert slot._pending is not None and slot._pending.nbytes == 2 * BIG * 4  # the large one only
    sd["payload"].tensors["decoder.w"].add_(1.0)  # written before the trainer waited
    held_copier.set()
    with pytest.raises(StagingError, match=r"payload\.decoder\.w"):
        slot.check_intact()
    slot.release()
    pool.close()
    assert pool.inline  # copied inside stage() from then on
