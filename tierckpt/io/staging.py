"""Host staging buffers for the background tiers, built on DCP's stager.

A save copies the state dict once into host memory (``DefaultStager`` with
``StagingOptions``: pinned memory when CUDA is present, synchronous copy) and returns; the
tiers then write from that copy while training changes the live tensors. DCP's
``StateDictStager`` keys its cached host storages by the source storage, so the second and
later saves of the same state reuse the same host buffers (no host-memory growth per save;
per-save host allocations are a known source of RSS growth in async checkpointing).

A :class:`StagingPool` holds ``n`` such buffer sets. A set is busy from ``stage()`` until every
tier job that reads it has called :meth:`StagingSlot.release`; :meth:`StagingPool.acquire`
blocks while all sets are busy.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.stateful import Stateful


def resolve_stateful(state_dict: dict[str, Any]) -> dict[str, Any]:
    """Replace top-level :class:`Stateful` values by their ``state_dict()`` (as DCP's save does)."""
    return {k: (v.state_dict() if isinstance(v, Stateful) else v) for k, v in state_dict.items()}


class StagingSlot:
    """One reusable host copy of the state. Thread-safe reference counting."""

    def __init__(self, pool: "StagingPool", index: int):
        self.pool = pool
        self.index = index
        use_cuda = torch.cuda.is_available()
        self.stager = DefaultStager(
            StagingOptions(
                use_pinned_memory=use_cuda,
                use_shared_memory=False,
                use_async_staging=False,
                use_non_blocking_copy=False,
            )
        )
        self.refs = 0

    def stage(self, state_dict: dict[str, Any], users: int) -> dict[str, Any]:
        """Copy ``state_dict`` into this slot's host buffers; ``users`` jobs will release it."""
        self.refs = users
        staged = self.stager.stage(state_dict)
        assert isinstance(staged, dict)  # a synchronous stager returns the copy, never a Future
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return staged

    def release(self) -> None:
        """Called once by each job that read the staged copy."""
        with self.pool._cv:
            self.refs -= 1
            if self.refs <= 0:
                self.refs = 0
                self.pool._free.append(self)
                self.pool._cv.notify_all()

    def close(self) -> None:
        """Free the host buffers."""
        self.stager.close()


class StagingPool:
    """``n`` reusable staging buffer sets (``n`` = ``TierConfig.staging_buffers``)."""

    def __init__(self, n: int):
        self._cv = threading.Condition()
        self._slots = [StagingSlot(self, i) for i in range(n)]
        self._free = list(self._slots)

    def acquire(self, timeout_s: float | None = None) -> StagingSlot:
        """A free slot, waiting for tier jobs to release one.

        Raises:
            TimeoutError: no slot became free within ``timeout_s`` seconds.
        """
        with self._cv:
            if not self._cv.wait_for(lambda: bool(self._free), timeout=timeout_s):
                raise TimeoutError("no staging buffer freed in time")
            # Prefer the slot used least recently so a just-released slot's buffers stay warm.
            return self._free.pop(0)

    def close(self) -> None:
        """Free every slot's host buffers."""
        for s in self._slots:
            s.close()
