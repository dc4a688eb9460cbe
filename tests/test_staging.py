"""Staging of the state into host buffers (tierckpt/staging/pool.py): which path a state takes,
the CPU path (synchronous copy, pageable buffers without CUDA), and on a CUDA device the
asynchronous device→host copies into pinned buffers."""

from __future__ import annotations

import pytest
import torch

from tierckpt.staging import pool as staging
from tierckpt.staging.pool import CUDA_ASYNC, SYNC, StagingPool, staging_mode

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


class _LooksCuda(torch.Tensor):
    """A CPU tensor that reports ``is_cuda``: the decision logic without a GPU."""

    @property
    def is_cuda(self):  # type: ignore[override]
        return True


def _looks_cuda(n: int) -> torch.Tensor:
    return torch.Tensor._make_subclass(_LooksCuda, torch.zeros(n))


def test_staging_mode_decision():
    cpu = {"model": {"w": torch.ones(3)}, "step": 4}
    nested_cuda = {"model": {"w": torch.ones(3)}, "optim": {"state": [{"exp_avg": _looks_cuda(3)}]}}
    assert staging_mode(cpu, cuda_available=True) == SYNC
    assert staging_mode(cpu, cuda_available=False) == SYNC
    assert staging_mode(nested_cuda, cuda_available=True) == CUDA_ASYNC
    assert staging_mode(nested_cuda, cuda_available=False) == SYNC  # no CUDA: never the stream path
    assert staging_mode({}, cuda_available=True) == SYNC
    # tensors inside objects do not count: the Megatron payload on a GPU is copied inside save()
    # (its training loop never calls wait_for_staging before the optimizer step)
    from tests.test_staging_plan import _Holder

    assert staging_mode({"mcore": _Holder({"w": _looks_cuda(3)}, {})}, cuda_available=True) == SYNC


def test_cpu_path_is_a_complete_synchronous_copy(monkeypatch):
    # no CUDA (real or pretended): pageable buffers, the copy done when stage() returns
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    pool = StagingPool(1)
    slot = pool.acquire()
    assert slot.pinned is False
    src = {"model": {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4)}, "meta": {"step": 7}}
    staged = slot.stage(src, users=1)
    assert slot.mode == SYNC and slot.copied()
    src["model"]["w"].add_(100.0)  # the caller changes the live tensor right after stage()
    assert torch.equal(staged["model"]["w"], torch.arange(12, dtype=torch.float32).reshape(3, 4))
    assert not staged["model"]["w"].is_pinned()
    assert staged["meta"] == {"step": 7}
    assert pool.wait_for_staging() >= 0.0
    slot.release()
    again = pool.acquire()
    assert again is slot  # one slot: released and reused
    staged2 = again.stage(src, users=1)
    # the second save reuses the first one's host buffers (no host-memory growth per save)
    assert staged2["model"]["w"].untyped_storage().data_ptr() == staged["model"]["w"].untyped_storage().data_ptr()
    assert torch.equal(staged2["model"]["w"], src["model"]["w"])
    pool.close()


def test_tensors_walks_nested_state():
    from tierckpt.staging.pool import _tensors

    a, b, c = torch.zeros(1), torch.ones(2), torch.full((3,), 2.0)
    got = list(_tensors({"x": a, "y": [b, {"z": (c, 5)}], "s": "text"}))
    assert sorted(t.numel() for t in got) == [1, 2, 3]


@needs_cuda
def test_cuda_staging_is_async_into_pinned_buffers():
    pool = StagingPool(1)
    slot = pool.acquire()
    w = torch.randn(1 << 20, device="cuda")
    ref = w.cpu()
    staged = slot.stage({"w": w, "n": 3}, users=1)
    assert slot.mode == CUDA_ASYNC
    slot.wait_copied()
    assert staged["w"].device.type == "cpu" and staged["w"].is_pinned()
    w.add_(1.0)  # after the wait the trainer may change it
    torch.cuda.synchronize()
    assert torch.equal(staged["w"], ref) and staged["n"] == 3
    slot.release()
    pool.close()


@needs_cuda
def test_cuda_staging_sees_kernels_queued_before_save():
    pool = StagingPool(1)
    slot = pool.acquire()
    w = torch.zeros(1 << 22, device="cuda")
    for _ in range(20):  # queued on the current stream, not finished when stage() is called
        w.add_(1.0)
    staged = slot.stage({"w": w}, users=1)
    pool.wait_for_staging()
    assert torch.equal(staged["w"], torch.full((1 << 22,), 20.0))
    slot.release()
    pool.close()


def test_engine_wait_for_staging_is_exposed():
    # the torchtitan adapter's maybe_wait_for_staging calls it; it must stay public
    from tierckpt.engine import TieredCheckpointer

    assert callable(TieredCheckpointer.wait_for_staging)
    assert staging.StagingPool.wait_for_staging.__doc__
