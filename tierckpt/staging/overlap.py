"""Overlapped host staging of CPU tensors (``TierConfig.cpu_staging = "overlapped"``).

The blocking copy of a CPU state is one memcpy of the state inside ``save()``. In most models
forward and backward only *read* the parameters and optimizer states, so that copy can run
while they run, as long as it is complete before the optimizer step writes them (lazy asynchronous
checkpointing: Maurya et al., "DataStates-LLM: Lazy Asynchronous Checkpointing for Large
Language Models", HPDC 2024; on CUDA the same contract as DCP's async staging and
torchtitan's ``async_with_pinned_mem``). ``save()`` then copies only the small tensors
(below :data:`OVERLAP_MIN_BYTES`, where buffers that forward updates in place live: norm
statistics, MoE token counts, FP8 scaling history) and hands the large ones to one copy thread
per :class:`~tierckpt.staging.pool.StagingPool` (``torch._foreach_copy_`` releases the GIL).

The trainer's side of the contract is a wait before the next in-place update
(:meth:`tierckpt.TieredCheckpointer.wait_for_staging`); the engine installs it as a global
``torch.optim`` step pre-hook, so every ``torch.optim.Optimizer`` waits on its own.

Racing writes are detected through autograd version counters (``Tensor._version``, bumped by
every in-place op): each deferred source's (a DTensor's and its local tensor's) is read when
the copy is queued and compared

- right after the copy (:meth:`PendingCopy.run`): a write that finished meanwhile;
- when the trainer waits (:meth:`PendingCopy.seal`, training thread, before the optimizer
  step): a write still running when the copy ended has finished by then;
- in agreed phases before each tier writes and before it commits (:meth:`PendingCopy.check`),
  if the trainer has not waited yet.

A difference fails that step's persistent save and the writing node's local save
(:class:`~tierckpt.errors.StagingError` naming the tensors, recorded like any failed save;
committed steps are untouched), and the pool copies those tensors inside ``save()`` from then
on. Not seen: a write through ``tensor.data`` (a separate version counter; torch's optimizers
write the parameters themselves), a parameter aliased into another buffer and written through
it, a write by another library into the same memory outside torch's ops, and an in-place op
the trainer starts without waiting that is still running both when the copy ends and when a
tier commits (the version moves when an op returns). Such trainers keep the default
``cpu_staging = "blocking"``.
"""

from __future__ import annotations

import queue
import threading
import time
import weakref
from typing import Any, Callable

import torch

from tierckpt.errors import StagingError

OVERLAP_MIN_BYTES = 64 << 10
"""Tensors at least this large (bytes) are copied in the background (64 KiB); smaller ones inside
``save()`` (their per-tensor cost is overhead, not bandwidth, and they include the buffers some
models update in place during forward)."""


def versions(tensors: list[torch.Tensor]) -> list[int] | None:
    """Autograd version counters of ``tensors`` (``Tensor._version``), or None when one has none
    (an inference-mode tensor): such a state is copied inside ``save()``."""
    try:
        return [t._version for t in tensors]
    except RuntimeError:
        return None


class PendingCopy:
    """The background part of one overlapped stage: ``dsts[i].copy_(srcs[i])`` for every i.

    Shapes: ``dsts`` and ``srcs`` are equal-length lists of CPU tensors of equal shape and
    dtype; ``watched[i]`` is the state's value whose local tensor ``srcs[i]`` is (the tensor
    itself, or its DTensor: a DTensor's in-place ops move the DTensor's version counter, a
    write through ``to_local()`` the local tensor's; both are compared); ``names[i]`` its key
    path in the state dict (for messages); ``positions[i]`` its index in the slot's copy plan,
    handed to ``learn`` when a write moved it (the plan then copies it inside ``save()``).
    Build with :meth:`start`.
    """

    def __init__(self, dsts: list[torch.Tensor], srcs: list[torch.Tensor], watched: list[torch.Tensor],
                 start_versions: list[int], names: list[str], positions: list[int],
                 learn: Callable[[list[int]], None] | None = None):
        self.dsts, self.start_versions = dsts, start_versions
        # the live tensors, dropped (None) once sealed
        self.srcs: list[torch.Tensor] | None = srcs
        self.watched: list[torch.Tensor] | None = watched
        self.names, self.positions, self._learn = names, positions, learn
        self.nbytes = sum(d.nbytes for d in dsts)
        self.done = threading.Event()
        self.error: str | None = None
        self.sealed = False
        self._lock = threading.Lock()

    @classmethod
    def start(cls, dsts: list[torch.Tensor], srcs: list[torch.Tensor], watched: list[torch.Tensor],
              names: list[str], positions: list[int],
              learn: Callable[[list[int]], None] | None = None) -> "PendingCopy | None":
        """A copy guarded by the current version counters of ``watched`` and ``srcs``, or None
        when a tensor has none (the caller copies inside ``save()``)."""
        vs = versions(list(watched) + list(srcs))
        return None if vs is None else cls(dsts, srcs, watched, vs, names, positions, learn)

    def _moved(self, when: str) -> None:
        """Set ``error`` when a version moved since the copy was queued."""
        watched, srcs = self.watched, self.srcs
        if watched is None or srcs is None or self.error is not None:
            return
        n = len(watched)
        now = versions(list(watched) + list(srcs)) or []
        moved = sorted({i % n for i, (a, b) in enumerate(zip(now, self.start_versions)) if a != b})
        if not moved:
            return
        shown = ", ".join(self.names[i] for i in moved[:3]) + (", ..." if len(moved) > 3 else "")
        self.error = (f"{len(moved)} saved tensor(s) ({shown}) were modified in place {when}, before the "
                      "overlapped staging copy was waited for: call wait_for_staging() before the optimizer "
                      "step (installed for torch.optim optimizers), or set cpu_staging = \"blocking\"; "
                      "these tensors are copied inside save() from the next save on")
        if self._learn is not None:
            self._learn([self.positions[i] for i in moved])

    def run(self) -> None:
        """The copy (copy thread). Never raises: the outcome is ``error``."""
        try:
            srcs = self.srcs
            assert srcs is not None  # sealing drops them only after the copy ran (seal waits for done)
            with torch.no_grad():
                torch._foreach_copy_(self.dsts, srcs)
            with self._lock:
                self._moved("while they were being copied")
        except Exception as e:  # a failed copy is a failed save, never a dead copy thread
            self.error = f"staging copy failed: {type(e).__name__}: {e}"
        finally:
            self.done.set()

    def seal(self) -> float:
        """Trainer side, before it writes a saved tensor: wait for the copy, compare versions a
        last time and drop the references to the live tensors. Returns seconds waited."""
        t0 = time.perf_counter()
        self.done.wait()
        waited = time.perf_counter() - t0
        with self._lock:
            if not self.sealed:
                self._moved("after save() returned")
                self.sealed, self.srcs, self.watched = True, None, None
        return waited

    def check(self) -> None:
        """Tier side, before writing the staged copy and before committing it: wait for the
        copy; raise when it is not a snapshot of the state at ``save()``.

        Raises:
            StagingError: the copy failed, or a saved tensor was modified in place before the
                copy was sealed (see the module docstring).
        """
        self.done.wait()
        with self._lock:
            if not self.sealed:
                self._moved("after save() returned")
            if self.error is not None:
                raise StagingError(self.error)


class Copier:
    """One daemon thread running :class:`PendingCopy` jobs in submission order."""

    def __init__(self) -> None:
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self, job: PendingCopy) -> None:
        """Queue ``job`` (starts the thread on first use)."""
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="tierckpt-staging-copy", daemon=True)
                self._thread.start()
        self._q.put(job)

    def _loop(self) -> None:
        while True:
            job = self._q.get()
            if job is None:
                return
            job.run()

    def close(self) -> None:
        """Stop the thread after the queued copies ran."""
        with self._lock:
            t, self._thread = self._thread, None
        if t is not None:
            self._q.put(None)
            t.join()



def wait_before_optimizer_steps(engine: Any):
    """Overlapped staging: every ``torch.optim`` optimizer waits for ``engine``'s copies
    (:meth:`~tierckpt.engine.TieredCheckpointer.wait_for_staging`) before it writes the
    parameters and its states. Returns the hook's handle; the hook is removed when the engine
    is collected (an engine never closed must not live on in torch's hook table), and does
    nothing once the engine is closed."""
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    me = weakref.ref(engine)

    def before_step(_opt, _args, _kwargs) -> None:
        eng = me()
        if eng is not None and not eng._closed:
            eng.wait_for_staging()

    handle = register_optimizer_step_pre_hook(before_step)
    weakref.finalize(engine, handle.remove)  # also without close()
    return handle
