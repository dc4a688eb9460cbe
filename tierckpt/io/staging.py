"""Host staging buffers for the background tiers, built on DCP's stager.

A save copies the state dict once into host memory (``DefaultStager`` with
``StagingOptions``: pinned memory when CUDA is present, synchronous copy) and returns; the
tiers then write from that copy while training changes the live tensors. DCP's
``StateDictStager`` keys its cached host storages by the source storage, so the second and
later saves of the same state reuse the same host buffers (no host-memory growth per save;
per-save host allocations are a known source of RSS growth in async checkpointing).

From the second save of the same structure on, a slot skips DCP's per-object deep copy: it
keeps the staged structure of its last save and a :class:`_CopyPlan` naming, leaf by leaf,
where each live value goes, checks that the new state dict has the same structure (keys,
container lengths, each tensor's type, dtype, shape and DTensor spec), and copies every
tensor with one ``torch._foreach_copy_`` call (the per-tensor Python work of the deep copy was
most of the blocking time above one memcpy of the state: bench/RESULTS.md). Any difference
falls back to DCP's stager, which rebuilds the plan.

A :class:`StagingPool` holds ``n`` such buffer sets. A set is busy from ``stage()`` until every
tier job that reads it has called :meth:`StagingSlot.release`; :meth:`StagingPool.acquire`
blocks while all sets are busy.
"""

from __future__ import annotations

import copy
import threading
from typing import Any

import torch
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

# values a staged copy may share with the live state (never mutated in place)
_ATOMIC = (int, float, bool, complex, str, bytes, type(None), torch.dtype, torch.device, torch.Size)


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
        self._plan: _CopyPlan | None = None

    def stage(self, state_dict: dict[str, Any], users: int) -> dict[str, Any]:
        """Copy ``state_dict`` into this slot's host buffers; ``users`` jobs will release it."""
        self.refs = users
        sig, leaves = _walk(state_dict)
        plan = self._plan
        if plan is not None and plan.sig == sig and plan.refill(leaves):
            return plan.staged
        staged = self.stager.stage(state_dict)
        assert isinstance(staged, dict)  # a synchronous stager returns the copy, never a Future
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self._plan = _CopyPlan.build(sig, leaves, staged)
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
        self._plan = None
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


def _walk(obj: Any) -> tuple[list, list]:
    """Flatten a state dict: (signature, leaves). The signature lists each container's kind and
    keys or length and each leaf's kind (tensors: type, dtype, shape, device, DTensor spec), in
    walk order; ``leaves`` are the leaf values in the same order."""
    sig: list = []
    leaves: list = []
    stack = [obj]
    while stack:
        x = stack.pop()
        t = type(x)
        if t is dict:
            keys = tuple(x)
            sig.append(("d", keys))
            stack.extend(x[k] for k in reversed(keys))
        elif t is list or t is tuple:
            sig.append((t, len(x)))
            stack.extend(reversed(x))
        elif isinstance(x, DTensor):
            sig.append((t, x._spec, x._local_tensor.device))
            leaves.append(x)
        elif isinstance(x, torch.Tensor):
            sig.append((t, x.dtype, x.shape, x.device))
            leaves.append(x)
        else:
            sig.append(t)
            leaves.append(x)
    return sig, leaves


class _CopyPlan:
    """Where each leaf of a state dict of one structure goes in a slot's staged copy.

    ``staged`` is the structure DCP's stager built at the last full staging; its containers
    are the slot's own (never the caller's), so refilling them in place is safe while the slot
    is not in use. Only CPU tensors take the fast path: device tensors need the stager's pinned
    buffers and stream handling.
    """

    def __init__(self, sig: list, staged: dict, dsts: list[torch.Tensor], tensor_pos: list[int],
                 setters: list[tuple[Any, Any, int]]):
        self.sig, self.staged, self.dsts = sig, staged, dsts
        self.tensor_pos = tensor_pos  # positions in the leaves list of the tensors, in ``dsts`` order
        self.setters = setters  # (staged container, key, leaf position) of every non-tensor leaf

    @classmethod
    def build(cls, sig: list, leaves: list, staged: dict) -> "_CopyPlan | None":
        """The plan of ``staged`` (DCP's copy of a state dict whose walk gave ``sig``/``leaves``),
        or None when the fast path cannot serve this structure (a device tensor, a structure
        the stager changed, a changeable value inside a tuple)."""
        ssig, sleaves = _walk(staged)
        if len(sleaves) != len(leaves) or _containers(ssig) != _containers(sig):
            return None
        dsts, tensor_pos = [], []
        for i, (live, st) in enumerate(zip(leaves, sleaves)):
            if isinstance(live, torch.Tensor):
                lt = live._local_tensor if isinstance(live, DTensor) else live
                d = st._local_tensor if isinstance(st, DTensor) else st
                if not isinstance(st, torch.Tensor) or lt.device.type != "cpu" or d.device.type != "cpu" \
                        or d.shape != lt.shape or d.dtype != lt.dtype:
                    return None
                dsts.append(d)
                tensor_pos.append(i)
        setters = _setters(staged, len(leaves))
        if setters is None:
            return None
        tensors = set(tensor_pos)
        setters = [st for st in setters if st[2] not in tensors]
        if any(parent is None and type(leaves[i]) not in _ATOMIC for parent, _, i in setters):
            return None  # a value inside a tuple that could change without == seeing it
        return cls(sig, staged, dsts, tensor_pos, setters)

    def refill(self, leaves: list) -> bool:
        """Copy ``leaves`` (same signature as the plan's) into the staged copy. False, with
        nothing changed, when a value inside a tuple differs (a tuple cannot be set in place:
        the caller restages everything)."""
        for parent, key, i in self.setters:
            if parent is None and key != leaves[i]:
                return False
        for parent, key, i in self.setters:
            if parent is not None:
                v = leaves[i]
                parent[key] = v if type(v) in _ATOMIC else copy.deepcopy(v)
        srcs = [leaves[i] for i in self.tensor_pos]
        srcs = [x._local_tensor if isinstance(x, DTensor) else x for x in srcs]
        with torch.no_grad():
            torch._foreach_copy_(self.dsts, srcs)
        return True


def _containers(sig: list) -> list:
    """The container entries of a :func:`_walk` signature (dict keys, list and tuple lengths)."""
    return [k for k in sig if type(k) is tuple and (k[0] == "d" or k[0] is list or k[0] is tuple)]


def _setters(staged: dict, n: int) -> list[tuple[Any, Any, int]] | None:
    """(container, key, leaf position) for every leaf of ``staged`` in :func:`_walk` order; a leaf
    inside a tuple gets (None, its current value, position): it can only be kept, not set."""
    out: list[tuple[Any, Any, int]] = []
    stack: list[tuple[Any, Any, Any]] = [(None, None, staged)]
    while stack:
        parent, key, x = stack.pop()
        t = type(x)
        if t is dict:
            stack.extend((x, k, x[k]) for k in reversed(tuple(x)))
        elif t is list:
            stack.extend((x, j, x[j]) for j in reversed(range(len(x))))
        elif t is tuple:
            stack.extend((None, x[j], x[j]) for j in reversed(range(len(x))))
        else:
            out.append((parent, key, len(out)))
    return out if len(out) == n else None
