"""Host staging buffers for the background tiers, built on DCP's stager.

A save copies the state dict once into host memory (``DefaultStager`` with
``StagingOptions``: pinned memory when CUDA is present, synchronous copy) and returns; the
tiers then write from that copy while training changes the live tensors. DCP's
``StateDictStager`` keys its cached host storages by the source storage, so the second and
later saves of the same state reuse the same host buffers (no host-memory growth per save;
per-save host allocations are a known source of RSS growth in async checkpointing).

From the second save of the same structure on, a slot skips DCP's per-object deep copy: it
keeps the staged structure of its last save and a :class:`~tierckpt.staging.copy_plan.CopyPlan`
naming, leaf by leaf, where each live value goes, checks that the new state dict has the same
structure (keys, container lengths, each tensor's type, dtype, shape and DTensor spec, each
:class:`~tierckpt.staging.copy_plan.TensorHolder`'s key), and copies every tensor with one
``torch._foreach_copy_`` call (the per-tensor Python work of the deep copy was most of the
blocking time above one memcpy of the state: bench/RESULTS.md). Any difference falls back to
DCP's stager, which rebuilds the plan. CPU tensors only (plain tensors, DTensors' local
tensors, holders' tensors); CUDA states take the path below.

A :class:`StagingPool` holds ``n`` such buffer sets. A set is busy from ``stage()`` until every
tier job that reads it has called :meth:`StagingSlot.release`; :meth:`StagingPool.acquire`
blocks while all sets are busy.

**CUDA tensors** (:func:`staging_mode` = ``"cuda-async"``): the device→host copies into pinned
host buffers are only *enqueued* on a side CUDA stream, after that stream waited for the
trainer's current stream (so they copy the values as of the ``save()`` call), and a CUDA event
is recorded behind them. ``save()`` then returns: δ covers enqueuing, not copying. Two waits
follow from it:

- the background tier jobs call :meth:`StagingSlot.wait_copied` (the event) before reading a
  byte of the staged copy;
- the trainer must call :meth:`tierckpt.TieredCheckpointer.wait_for_staging` before it next
  modifies a saved tensor in place (the optimizer step), exactly as with DCP's
  ``async_save(..., async_stager=DefaultStager(StagingOptions(use_async_staging=True)))``
  where torchtitan's ``async_with_pinned_mem`` mode calls ``maybe_wait_for_staging()`` right
  before ``optimizers.step()``. Forward and backward may run meanwhile: they read the
  parameters and write activations and gradients, which are not being copied.

Each CUDA source tensor is ``record_stream``-ed on the side stream, so the caching allocator
does not hand its memory to another tensor before the copy ran, even when the caller drops its
state dict right after ``save()``.

A state with no CUDA tensor (``"sync"``) is copied synchronously, in ``save()``, by default;
:meth:`StagingSlot.wait_copied` and ``wait_for_staging`` then return at once. With
``StagingPool(overlapped=True)`` (``TierConfig.cpu_staging = "overlapped"``) the large tensors
of a state whose copy plan is known (second save on) are copied by a background thread instead,
under the same wait contract as CUDA staging, with in-place writes detected
(:mod:`tierckpt.staging.overlap`).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Iterator

import torch
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from tierckpt.io.dcp_compat import StateDictStager
from tierckpt.staging.copy_plan import CopyPlan, allocate_like, walk
from tierckpt.staging.overlap import OVERLAP_MIN_BYTES, Copier, PendingCopy

log = logging.getLogger(__name__)

SYNC, CUDA_ASYNC = "sync", "cuda-async"


# top-level value types that are never Stateful: skipped without the Protocol's isinstance
# check, which costs ~11 µs per value (inspect.getattr_static) — 3.7 ms per save of a flat
# 324-tensor state, inside δ
_NOT_STATEFUL = (dict, list, tuple, int, float, bool, str, bytes, type(None))


def resolve_stateful(state_dict: dict[str, Any]) -> dict[str, Any]:
    """Replace top-level :class:`Stateful` values by their ``state_dict()`` (as DCP's save does)."""
    return {k: (v.state_dict() if type(v) not in _NOT_STATEFUL and not isinstance(v, torch.Tensor)
                and isinstance(v, Stateful) else v) for k, v in state_dict.items()}


def _tensors(v: Any) -> Iterator[torch.Tensor]:
    """Every tensor holding data in a (nested dict/list/tuple) state: plain tensors, DTensors'
    local tensors, ShardedTensors' local shards. Not the tensors inside objects, including
    :class:`~tierckpt.staging.copy_plan.TensorHolder` ones: a state whose CUDA tensors are all
    inside objects (the Megatron payload) takes the synchronous path, its copy complete when
    ``save()`` returns — Megatron's training loop calls no ``wait_for_staging()``."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    stack = [v]
    while stack:
        x = stack.pop()
        if isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
        elif isinstance(x, DTensor):
            yield x.to_local()
        elif isinstance(x, ShardedTensor):
            yield from (sh.tensor for sh in x.local_shards())
        elif isinstance(x, torch.Tensor):
            yield x


def staging_mode(state_dict: dict[str, Any], cuda_available: bool | None = None) -> str:
    """``"cuda-async"`` when CUDA is available and the state holds a CUDA tensor (copies
    enqueued on a side stream, see the module docstring), else ``"sync"`` (the blocking copy).
    ``cuda_available`` defaults to ``torch.cuda.is_available()``."""
    if cuda_available is None:
        cuda_available = torch.cuda.is_available()
    if not cuda_available:
        return SYNC
    return CUDA_ASYNC if any(t.is_cuda for t in _tensors(state_dict)) else SYNC


class StagingSlot:
    """One reusable host copy of the state. Thread-safe reference counting.

    Host buffers are pinned (page-locked) when CUDA is available and pageable otherwise (DCP's
    stager ignores ``pin_memory`` without CUDA). ``mode`` is the :func:`staging_mode` of the
    last :meth:`stage`."""

    def __init__(self, pool: "StagingPool", index: int):
        self.pool = pool
        self.index = index
        self.pinned = torch.cuda.is_available()
        self.stager = DefaultStager(
            StagingOptions(
                use_pinned_memory=self.pinned,
                use_shared_memory=False,
                use_async_staging=False,
                use_non_blocking_copy=False,
            )
        )
        self.refs = 0
        self.mode = SYNC
        self._event: Any = None  # torch.cuda.Event behind the last enqueued copies (cuda-async)
        self._stream: Any = None  # the side stream, made on first use
        self._cuda_stager: Any = None  # StateDictStager with pinned buffers, made on first use
        self._plan: CopyPlan | None = None  # how to refill the last "sync" staged copy
        self._refused: list | None = None  # the structure whose plan raised: full copies only
        self._pending: PendingCopy | None = None  # the background copy of the last overlapped stage

    def stage(self, state_dict: dict[str, Any], users: int) -> dict[str, Any]:
        """Copy ``state_dict`` into this slot's host buffers; ``users`` jobs will release it.

        ``"sync"``: the copy is complete on return, except in an overlapped pool, where the
        tensors of at least :data:`~tierckpt.staging.overlap.OVERLAP_MIN_BYTES` may still be copying.
        ``"cuda-async"``: the copies are enqueued. Either way readers call :meth:`check_intact`
        first and the trainer calls :meth:`StagingPool.wait_for_staging` before modifying a
        saved tensor in place."""
        if self._pending is not None:  # the buffers are about to be overwritten
            self._pending.done.wait()
            self._pending = None
        self.refs = users
        self.mode = staging_mode(state_dict)
        if self.mode == CUDA_ASYNC:
            return self._stage_cuda(state_dict)
        self._event = None
        sig: list | None = None
        plan, deferred = self._plan, None
        try:
            sig, leaves = walk(state_dict)
            if plan is not None and plan.sig == sig:
                deferred = plan.refill(leaves, OVERLAP_MIN_BYTES if self.pool.overlapped else None,
                                       self.pool.inline)
        except Exception as e:  # noqa: BLE001 - a holder's key or refresh failed: DCP's full copy below
            self._plan_failed(e)
            self._refused = sig  # a plan for this structure would fail again: none is built for it
            sig, deferred = None, None
        if plan is not None and deferred is not None:
            if deferred[0]:
                self._defer(plan, *deferred)
            return plan.staged
        if sig is not None and sig != self._refused:
            fresh = self._stage_allocated(state_dict, sig, leaves)
            if fresh is not None:
                return fresh
        staged = self.stager.stage(state_dict)
        assert isinstance(staged, dict)  # a synchronous stager returns the copy, never a Future
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        try:
            self._plan = None if sig is None or sig == self._refused else CopyPlan.build(sig, leaves, staged)
        except Exception as e:  # noqa: BLE001 - no plan: DCP's full copy every save, as before it
            self._plan_failed(e)
        return staged

    def _stage_allocated(self, state_dict: dict[str, Any], sig: list, leaves: list) -> dict[str, Any] | None:
        """A first save (or a changed structure) of plain CPU tensors: allocate the host copy
        (:func:`~tierckpt.staging.copy_plan.allocate_like`), build its plan and fill it, all
        synchronously; None when the state is not of that kind (DCP's stager copies it)."""
        plan = allocate_like(state_dict, sig, pin_memory=self.pinned)
        if plan is None or plan.refill(leaves) is None:
            return None
        self._plan = plan
        return plan.staged

    def _plan_failed(self, e: Exception) -> None:
        """Drop the copy plan after ``e`` (raised by a :class:`~tierckpt.staging.copy_plan.TensorHolder`
        or the walk); this save takes DCP's full copy. Warned once per pool: the saves stay
        correct, but pay the full copy's time."""
        self._plan = None
        if not self.pool.plan_warned:
            self.pool.plan_warned = True
            log.warning("tierckpt: staging copy plan failed (%s: %s); this state is deep-copied by DCP's "
                        "stager on every such save instead", type(e).__name__, e)

    def _stage_cuda(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        if self._stream is None:
            self._stream = torch.cuda.Stream()
            self._cuda_stager = StateDictStager(pin_memory=True, share_memory=False)
        stream = self._stream
        # the copies must see every kernel the trainer queued before save(): order after them
        stream.wait_stream(torch.cuda.current_stream())
        for t in _tensors(state_dict):
            if t.is_cuda:
                t.record_stream(stream)
        with torch.cuda.stream(stream):
            staged = self._cuda_stager.stage(state_dict, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        self._event = event
        return staged

    def _defer(self, plan: CopyPlan, dsts: list[torch.Tensor], srcs: list[torch.Tensor],
               watched: list[torch.Tensor], positions: list[int]) -> None:
        """Hand ``dsts[i].copy_(srcs[i])`` to the pool's copy thread, guarded by the version
        counters of ``watched`` and ``srcs`` (synchronously when a tensor has none)."""
        pending = PendingCopy.start(dsts, srcs, watched, [plan.names[j] for j in positions], positions,
                                    self.pool.learn)
        if pending is None:
            with torch.no_grad():
                torch._foreach_copy_(dsts, srcs)
            return
        self._pending = pending
        self.pool._copier.submit(self._pending)
        if not self.pool.announced:  # once per pool: the mode is on and what it defers
            self.pool.announced = True
            if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
                log.info("tierckpt: overlapped staging: %d tensors (%.1f MiB) per save copied in the background, "
                         "waited for before the optimizer step", len(dsts), self._pending.nbytes / 2**20)

    def wait_copied(self) -> None:
        """Block until this slot's staged copy is complete (no-op after a blocking stage)."""
        ev = self._event
        if ev is not None:
            ev.synchronize()
        p = self._pending
        if p is not None:
            p.done.wait()

    def check_intact(self) -> None:
        """Wait for the staged copy; for an overlapped stage, check it is a snapshot of the
        state at ``save()``. Tier jobs call it before reading the copy and before committing.

        Raises:
            StagingError: see :meth:`tierckpt.staging.overlap.PendingCopy.check`.
        """
        self.wait_copied()
        p = self._pending
        if p is not None:
            p.check()

    def seal(self) -> None:
        """Trainer side of an overlapped stage (:meth:`tierckpt.staging.overlap.PendingCopy.seal`)."""
        p = self._pending
        if p is not None:
            p.seal()

    def copied(self) -> bool:
        """Whether the staged copy is complete (never blocks)."""
        ev = self._event
        p = self._pending
        return (ev is None or bool(ev.query())) and (p is None or p.done.is_set())

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
        self._plan = None
        self.stager.close()
        if self._cuda_stager is not None:
            self._cuda_stager.close()


class StagingPool:
    """``n`` reusable staging buffer sets (``n`` = ``TierConfig.staging_buffers``);
    ``overlapped``: CPU tensors are copied in the background (``TierConfig.cpu_staging``)."""

    def __init__(self, n: int, overlapped: bool = False):
        self.overlapped = overlapped
        self.announced = False  # the first background copy was logged
        self.plan_warned = False  # a failed copy plan was logged
        # copy-plan positions of tensors found written between save() and the wait: copied
        # inside save() from then on (same structure, same positions in every slot's plan)
        self.inline: set[int] = set()
        self._copier = Copier()
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

    def learn(self, positions: list[int]) -> None:
        """Copy the tensors at these copy-plan positions inside ``save()`` from now on (they
        were written in place before the trainer waited)."""
        self.inline.update(positions)

    def try_acquire(self) -> StagingSlot | None:
        """A free slot now, or None (never waits)."""
        with self._cv:
            return self._free.pop(0) if self._free else None

    def stage_early(self, state_dict: dict[str, Any]) -> tuple[StagingSlot, dict[str, Any]] | None:
        """(slot, staged) of a copy made before a save's tiers are decided, when a slot is free
        right now and the state is on the host (the copy is then complete on return, or queued
        when overlapped), else None. It overlaps the busy-tier agreement (one all-reduce,
        0.5–8 ms measured under load on 2 cores) with the copy; a save whose every tier is then
        deferred discards it (:meth:`give_back`), a copy of the same cost as any save's."""
        if torch.cuda.is_available():  # a device state's copies are enqueued, not made: decide first
            return None
        slot = self.try_acquire()
        if slot is None:
            return None
        try:
            return slot, slot.stage(state_dict, users=1)
        except BaseException:
            self.give_back(slot)
            raise

    def stage(self, state_dict: dict[str, Any], users: int) -> tuple[StagingSlot, dict[str, Any]]:
        """Copy the state (top-level ``Stateful`` values already resolved, once: a resolved
        value may itself look ``Stateful``) into a free slot (the blocking copy), held for
        ``users`` tier jobs; returns (slot, staged). Waits for a slot to be released."""
        slot = self.acquire()
        try:
            return slot, slot.stage(state_dict, users=users)
        except BaseException:
            self.give_back(slot)
            raise

    @staticmethod
    def give_back(slot: StagingSlot) -> None:
        """Give an unused staging slot back."""
        slot.refs = 1
        slot.release()

    def wait_for_staging(self) -> float:
        """Block until every slot's enqueued device→host copy and background host copy is
        complete, and seal the overlapped ones (trainer thread, before it modifies a saved
        tensor in place); returns the seconds waited (0.0 after blocking stages)."""
        t0 = time.perf_counter()
        for s in self._slots:
            s.wait_copied()
            s.seal()
        return time.perf_counter() - t0

    def close(self) -> None:
        """Free every slot's host buffers and stop the copy thread."""
        for s in self._slots:
            s.wait_copied()  # never free buffers a copy is still writing
            s.close()
        self._copier.close()
