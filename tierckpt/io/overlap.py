"""Overlapped host staging of CPU tensors (``TierConfig.cpu_staging = "overlapped"``).

The blocking copy of a CPU state is one memcpy of the state inside ``save()``. Forward and
backward only *read* the parameters and optimizer states, so that copy can run while they run,
as long as it is complete before the optimizer step writes them (lazy asynchronous
checkpointing: Maurya et al., "DataStates-LLM: Lazy Asynchronous Checkpointing for Large
Language Models", HPDC 2024; on CUDA the same contract as DCP's async staging and
torchtitan's ``async_with_pinned_mem``). ``save()`` then copies only the small tensors
(below :data:`OVERLAP_MIN_BYTES`, where buffers that forward updates in place live: norm
statistics, MoE token counts, FP8 scaling history) and hands the large ones to one copy thread
per :class:`~tierckpt.io.staging.StagingPool` (``torch._foreach_copy_`` releases the GIL).

The trainer's side of the contract is a wait before the next in-place update
(:meth:`tierckpt.TieredCheckpointer.wait_for_staging`); the engine installs it as a global
``torch.optim`` step pre-hook, so every ``torch.optim.Optimizer`` waits on its own.

A copy that raced a write is never committed. Each deferred source's autograd version counter
(``Tensor._version``, bumped by every in-place op) is read when the copy is queued and
compared

- right after the copy (:meth:`PendingCopy.run`): a write that finished meanwhile;
- when the trainer waits (:meth:`PendingCopy.seal`, training thread, before the optimizer
  step): a write still running when the copy ended has finished by then;
- before each tier commits (:meth:`PendingCopy.check`), if the trainer has not waited yet.

Any difference fails the save of that step on every tier (:class:`~tierckpt.errors.StagingError`,
recorded like any failed save; committed steps are untouched). Not seen: a write through
``tensor.data`` (a separate version counter; torch's optimizers write the parameters
themselves), a write by another library into the same memory outside torch's ops, and an
in-place op the trainer starts without waiting that is still running both when the copy ends
and when a tier commits (the version moves when an op returns). Such trainers keep the default
``cpu_staging = "blocking"``.
"""

from __future__ import annotations

import queue
import threading
import time

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
    itself, or its DTensor: a DTensor's in-place ops move the DTensor's version counter, not
    the local tensor's), ``start_versions`` their version counters when the copy was queued.
    """

    def __init__(self, dsts: list[torch.Tensor], srcs: list[torch.Tensor], watched: list[torch.Tensor],
                 start_versions: list[int]):
        self.dsts, self.srcs, self.watched, self.start = dsts, srcs, watched, start_versions
        self.nbytes = sum(d.nbytes for d in dsts)
        self.done = threading.Event()
        self.error: str | None = None
        self.sealed = False
        self._lock = threading.Lock()

    def _moved(self, when: str) -> None:
        """Set ``error`` when a source's version moved since the copy was queued."""
        watched = self.watched
        if watched is None or self.error is not None:
            return
        moved = [i for i, (s, v) in enumerate(zip(watched, self.start)) if s._version != v]
        if moved:
            s = watched[moved[0]]
            self.error = (f"{len(moved)} saved tensor(s) (first: shape {tuple(s.shape)}, {s.dtype}) were modified "
                          f"in place {when}, before the overlapped staging copy was waited for: call "
                          "wait_for_staging() before the optimizer step (installed for torch.optim optimizers), "
                          "or set cpu_staging = \"blocking\"")

    def run(self) -> None:
        """The copy (copy thread). Never raises: the outcome is ``error``."""
        try:
            with torch.no_grad():
                torch._foreach_copy_(self.dsts, self.srcs)
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
        """Tier side, before reading the staged copy and before committing it: wait for the
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

