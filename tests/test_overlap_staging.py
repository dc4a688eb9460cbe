"""Overlapped CPU staging (``TierConfig.cpu_staging = "overlapped"``, tierckpt/io/overlap.py):
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
from tierckpt.io import overlap
from tierckpt.io.staging import StagingPool

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
    t = threading.Timer(0.2, held_copier.set)
    t.start()
    slot = pool.acquire()
    pool.wait_for_staging()
    sd["big"].fill_(9.0)
    staged2 = slot.stage(sd, users=1)  # must not race the first copy into the same buffers
    pool.wait_for_staging()
    assert torch.equal(staged2["big"], torch.full((2 * BIG,), 9.0))
    slot.release()
    pool.close()


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
        # previous save's slow copy
        assert waited > 0.3 and save_delta >= waited and all(x >= waited for x in recorded), r["booked"]
        assert r["save_s"] < 0.4
        for tier, (ok, error) in r["racing"].items():
            assert not ok and "StagingError" in error and "modified in place" in error, (tier, error)
        assert racing not in r["committed"]["local"] and racing not in r["committed"]["persistent"]
        assert racing - 1 in r["committed"]["local"] and racing - 1 in r["committed"]["persistent"]
        assert r["hooks_after_close"] == 0
