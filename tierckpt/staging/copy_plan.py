"""The copy plan: refilling a staging slot's host copy of a state dict in place.

A slot's first save of a state dict structure of plain CPU tensors, DTensors and scalars
allocates the host copy (:func:`allocate_like`: one ``torch.empty_like`` per tensor, the
containers rebuilt) and fills it with the plan; any other structure goes through DCP's
``StateDictStager`` (a deep copy with host storages cached by source storage), and
:class:`CopyPlan` then records, leaf by leaf, where each live value went in that copy. Either
way later saves of the same structure copy every tensor with one ``torch._foreach_copy_`` and
set the immutable scalars, skipping the per-object Python work of the deep copy (most of the
blocking time above one memcpy of the state: bench/RESULTS.md).

A state's leaves are plain tensors, DTensors (their local tensors are copied), immutable
scalars (shared with the live state), and :class:`TensorHolder` objects: framework objects an
adapter exposes to the plan (the Megatron adapter's payload of ``ShardedTensor`` objects). Any
other object leaf makes the structure ineligible: DCP's deep copy runs every save.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Protocol, runtime_checkable

import torch
from torch.distributed.tensor import DTensor

from tierckpt.io import dcp_compat  # noqa: F401  (DTensor's private attributes used here are checked first)

# values a staged copy may share with the live state (never mutated in place)
ATOMIC = (int, float, bool, complex, str, bytes, type(None), torch.dtype, torch.device, torch.Size)
PLAIN = (torch.Tensor, torch.nn.Parameter)  # tensor types the copy plan copies (not ShardedTensor &c.)
_ATOMIC_SET, _PLAIN_SET = frozenset(ATOMIC), frozenset(PLAIN)  # type lookups by hash, not by == per entry
_STRIDED = torch.strided


@runtime_checkable
class TensorHolder(Protocol):
    """An object leaf of a state dict whose tensors the copy plan may refill in place of DCP's
    deep copy of the whole object (an adapter's payload of framework objects).

    The engine stages the first save of a structure with DCP's stager (a deep copy of the
    object) and, from the second save of an equal :meth:`staging_key` on, calls
    :meth:`staging_refresh` on that staged copy with the live object and copies
    :meth:`staging_tensors` of the live object into those of the staged copy.
    """

    def staging_key(self) -> Any:
        """Everything but tensor values that shapes what is written (tensor names, shapes,
        dtypes, devices, framework metadata), compared with ``==`` between saves; ``None``
        when the object cannot take the plan (DCP's deep copy every save)."""

    def staging_tensors(self) -> dict[str, torch.Tensor]:
        """The object's tensors by name (plain CPU tensors or DTensors), the same names in the
        same order for equal keys. The names appear in :class:`~tierckpt.errors.StagingError`."""

    def staging_refresh(self, live: Any) -> None:
        """Called on the staged copy with the live object of a later save of equal key: take
        over its non-tensor state, copying whatever the live side may change later. The
        staged tensors are kept (the plan overwrites their values)."""


def is_holder(x: Any) -> bool:
    """Whether ``x`` implements :class:`TensorHolder` (checked on its type: a runtime Protocol
    ``isinstance`` costs ~1 ms per call)."""
    t = type(x)
    return hasattr(t, "staging_key") and hasattr(t, "staging_tensors") and hasattr(t, "staging_refresh")


def _holder_key(x: Any) -> Any:
    """The :meth:`TensorHolder.staging_key` of ``x``, or None when ``x`` is not a holder."""
    return x.staging_key() if is_holder(x) else None


def walk(obj: Any) -> tuple[list, list]:
    """Flatten a state dict: (signature, leaves). The signature lists each container's kind (dict
    and OrderedDict, as ``get_state_dict`` returns, alike) and keys or length and each leaf's
    kind (tensors: type, dtype, shape, device, DTensor spec; holders: type and key), in walk
    order; ``leaves`` are the leaf values in the same order."""
    sig: list = []
    leaves: list = []
    stack = [obj]
    while stack:
        x = stack.pop()
        t = type(x)
        if t is dict or t is OrderedDict:
            keys = tuple(x)
            sig.append(("d", keys))
            stack.extend(x[k] for k in reversed(keys))
        elif t is list or t is tuple:
            sig.append((t, len(x)))
            stack.extend(reversed(x))
        elif isinstance(x, DTensor):
            sig.append((t, x._spec, x._local_tensor.device))
            leaves.append(x)
        elif t in PLAIN:
            sig.append((t, x.dtype, x.shape, x.device))
            leaves.append(x)
        elif t in ATOMIC:
            sig.append(t)
            leaves.append(x)
        else:
            key = _holder_key(x)
            sig.append(t if key is None else (t, "holder", key))
            leaves.append(x)
    return sig, leaves


def _cpu_pair(live: torch.Tensor, staged: Any) -> torch.Tensor | None:
    """The staged tensor to copy ``live`` into (a DTensor's local tensor), or None when the
    pair cannot take the plan (a device tensor, another tensor subclass, a changed shape)."""
    if not isinstance(staged, torch.Tensor):
        return None
    lt = live._local_tensor if isinstance(live, DTensor) else live
    d = staged._local_tensor if isinstance(staged, DTensor) else staged
    if type(lt) not in PLAIN or type(d) not in PLAIN or lt.device.type != "cpu" \
            or d.device.type != "cpu" or d.shape != lt.shape or d.dtype != lt.dtype:
        return None
    return d


class CopyPlan:
    """Where each leaf of a state dict of one structure goes in a slot's staged copy.

    ``staged`` is the structure DCP's stager built at the last full staging; its containers
    (and holders) are the slot's own, never the caller's, so refilling them in place is safe
    while the slot is not in use. Only CPU tensors take the plan: device tensors need the
    stager's pinned buffers and stream handling.

    ``dsts[j]`` is filled from ``src_of[j] = (leaf position, holder tensor name or None)``;
    ``names[j]`` is its key path (messages).
    """

    def __init__(self, sig: list, staged: dict, dsts: list[torch.Tensor], src_of: list[tuple[int, str | None]],
                 setters: list[tuple[Any, Any, int]], holders: list[tuple[Any, int]], names: list[str] | None):
        self.sig, self.staged, self.dsts = sig, staged, dsts
        self._names = names
        self.src_of = src_of
        self.setters = setters  # (staged container, key, leaf position) of every immutable scalar leaf
        self.holders = holders  # (staged holder, leaf position)

    @classmethod
    def build(cls, sig: list, leaves: list, staged: dict) -> "CopyPlan | None":
        """The plan of ``staged`` (DCP's copy of a state dict whose walk gave ``sig``/``leaves``),
        or None when the plan cannot serve this structure (a device tensor, a tensor subclass
        other than DTensor, an object leaf that is neither an immutable scalar nor a
        :class:`TensorHolder` with a key, a structure the stager changed)."""
        ssig, sleaves = walk(staged)
        if len(sleaves) != len(leaves) or _containers(ssig) != _containers(sig):
            return None
        paths = _paths(staged)
        dsts: list[torch.Tensor] = []
        src_of: list[tuple[int, str | None]] = []
        names: list[str] = []
        holders: list[tuple[Any, int]] = []
        for i, (live, st) in enumerate(zip(leaves, sleaves)):
            if isinstance(live, torch.Tensor):
                d = _cpu_pair(live, st)
                if d is None:
                    return None
                dsts.append(d)
                src_of.append((i, None))
                names.append(paths[i])
            elif type(live) not in ATOMIC:
                if _holder_key(live) is None or type(st) is not type(live):
                    return None  # an object leaf (e.g. a framework object holding tensors): DCP's deep copy
                lt, stt = live.staging_tensors(), st.staging_tensors()
                if list(lt) != list(stt):
                    return None
                for name, x in lt.items():
                    d = _cpu_pair(x, stt[name])
                    if d is None:
                        return None
                    dsts.append(d)
                    src_of.append((i, name))
                    names.append(f"{paths[i]}.{name}")
                holders.append((st, i))
        setters = _setters(staged, len(leaves))
        if setters is None:
            return None
        objects = {i for i, _ in src_of} | {i for _, i in holders}
        setters = [st for st in setters if st[2] not in objects]
        return cls(sig, staged, dsts, src_of, setters, holders, names)

    @property
    def names(self) -> list[str]:
        """Key path of every ``dsts[j]`` (``"optim.state.w.exp_avg"``; messages only, so a plan
        built by :func:`allocate_like` computes them on first use)."""
        if self._names is None:
            paths = _paths(self.staged)
            self._names = [paths[i] if name is None else f"{paths[i]}.{name}" for i, name in self.src_of]
        return self._names

    def refill(self, leaves: list, defer_min_bytes: int | None = None,
               inline: set[int] | frozenset[int] = frozenset()) -> tuple[list, list, list, list] | None:
        """Copy ``leaves`` (same signature as the plan's) into the staged copy, except the
        tensors of at least ``defer_min_bytes`` bytes (None: none deferred) whose position is
        not in ``inline``, returned as ``(dsts, srcs, watched, positions)`` for the caller to
        copy: ``srcs`` the local tensors to read, ``watched`` the tensors as the trainer holds
        them (a DTensor's in-place ops move the DTensor's version counter, not its local
        tensor's: DTensor runs the local op below autograd), ``positions`` their indices in
        ``dsts``. None, with nothing changed, when a value inside a tuple differs (a tuple
        cannot be set in place: the caller restages everything)."""
        for parent, key, i in self.setters:
            if parent is None and key != leaves[i]:
                return None
        for parent, key, i in self.setters:
            if parent is not None:  # atomic values: shared, never mutated
                parent[key] = leaves[i]
        held = {}
        for st, i in self.holders:
            st.staging_refresh(leaves[i])
            held[i] = leaves[i].staging_tensors()
        watched = [leaves[i] if name is None else held[i][name] for i, name in self.src_of]
        srcs = [x._local_tensor if isinstance(x, DTensor) else x for x in watched]
        dsts = self.dsts
        later: tuple[list, list, list, list] = ([], [], [], [])
        if defer_min_bytes is None:
            now = (dsts, srcs)
        else:
            big = [d.nbytes >= defer_min_bytes and j not in inline for j, d in enumerate(dsts)]
            now = ([d for d, b in zip(dsts, big) if not b], [x for x, b in zip(srcs, big) if not b])
            for j, b in enumerate(big):
                if b:
                    for out, x in zip(later, (dsts[j], srcs[j], watched[j], j)):
                        out.append(x)
        if now[0]:
            with torch.no_grad():
                torch._foreach_copy_(*now)
        return later


def allocate_like(obj: Any, sig: list, pin_memory: bool = False) -> "CopyPlan | None":
    """A copy plan over a new, unfilled staged copy of a state dict of plain CPU tensors, CPU
    DTensors and immutable scalars (``sig`` its :func:`walk` signature): the same containers (new
    dicts, OrderedDicts, lists, tuples), an uninitialised host tensor of the same dtype and shape
    for every tensor (``torch.empty_like``: a dense permuted tensor keeps its strides; a
    DTensor's local tensor, wrapped in a DTensor of the same spec), the scalars shared. None
    when a leaf is anything else (a device, sparse or quantized tensor, another tensor
    subclass, an object or :class:`TensorHolder`) or ``obj`` is not a dict: DCP's stager
    copies that state.

    :meth:`CopyPlan.refill` then fills it, so a slot's first save costs what a later one costs
    plus one host allocation per tensor, instead of DCP's per-object deep copy (with 20,000
    small tensors, ~12x the steady save). Each tensor gets its own storage, as from DCP's
    stager: DCP's writer clones a tensor whose storage is larger than itself, so one flat
    buffer of views would cost a copy per byte at every write. Unlike DCP's stager, tensors
    that share a storage (tied weights) get separate host copies: the values written are the
    same, the host copy is larger by the tied tensors.

    Args:
        obj: the state dict (nested dicts, OrderedDicts, lists, tuples).
        sig: ``walk(obj)[0]``.
        pin_memory: page-locked host tensors (a process with CUDA, as DCP's stager pins).
    """
    if type(obj) is not dict and type(obj) is not OrderedDict:
        return None
    b = _Allocation(pin_memory)
    try:
        staged = b.container(obj)
    except _NotPlain:
        return None
    return CopyPlan(sig, staged, b.dsts, b.src_of, b.setters, [], None)


_CONTAINERS = frozenset((dict, OrderedDict, list, tuple))


class _NotPlain(Exception):
    """A leaf :func:`allocate_like` does not allocate (DCP's stager copies the state)."""


class _Allocation:
    """One :func:`allocate_like` pass: containers rebuilt and tensors allocated in :func:`walk`
    order, in one loop per container. With 20,000 small tensors the per-leaf Python work is the
    whole first-save overhead, so leaves are handled inline (no call per leaf) and only the
    rare DTensor takes a method call."""

    def __init__(self, pin_memory: bool):
        self.dsts: list[torch.Tensor] = []
        self.src_of: list[tuple[int, str | None]] = []
        self.setters: list[tuple[Any, Any, int]] = []
        self.n = 0  # leaves seen
        # empty_like keeps a dense permuted tensor's strides, at a third of torch.empty(shape,
        # dtype)'s dispatch cost; a pin_memory keyword costs a third more again, so only with CUDA
        self.empty = (lambda t: torch.empty_like(t, pin_memory=True)) if pin_memory else torch.empty_like

    def container(self, obj: Any) -> Any:
        t = type(obj)
        if t is dict or t is OrderedDict:
            out: Any = t()
            items: Any = obj.items()
        else:
            out = []
            items = enumerate(obj)
        in_tuple = t is tuple
        empty, dsts, src_of, setters = self.empty, self.dsts, self.src_of, self.setters
        for k, v in items:
            tv = type(v)
            if tv in _PLAIN_SET:
                if not v.is_cpu or v.layout is not _STRIDED or v.is_quantized:
                    raise _NotPlain
                d = empty(v)
                dsts.append(d)
                src_of.append((self.n, None))
                self.n += 1
            elif tv in _ATOMIC_SET:
                d = v  # shared; a tuple's item cannot be set later: its plan compares it
                setters.append((None, v, self.n) if in_tuple else (out, k, self.n))
                self.n += 1
            elif tv in _CONTAINERS:
                d = self.container(v)
            elif tv is DTensor:
                d = self.dtensor(v)
            else:
                raise _NotPlain
            if t is dict or t is OrderedDict:
                out[k] = d
            else:
                out.append(d)
        return tuple(out) if in_tuple else out

    def dtensor(self, x: DTensor) -> DTensor:
        lt = x._local_tensor
        if type(lt) not in _PLAIN_SET or not lt.is_cpu or lt.layout is not _STRIDED or lt.is_quantized:
            raise _NotPlain
        d = self.empty(lt)
        self.dsts.append(d)
        self.src_of.append((self.n, None))
        self.n += 1
        return DTensor.from_local(d, x.device_mesh, x.placements, run_check=False, shape=x.shape,
                                  stride=x.stride())


def _paths(obj: Any) -> list[str]:
    """Key path (``"optim.state.w.exp_avg"``, list items by index) of every leaf of a state
    dict, in :func:`walk` order."""
    out: list[str] = []
    stack: list[tuple[str, Any]] = [("", obj)]
    while stack:
        path, x = stack.pop()
        t = type(x)
        if t is dict or t is OrderedDict:
            stack.extend((f"{path}.{k}" if path else str(k), x[k]) for k in reversed(tuple(x)))
        elif t is list or t is tuple:
            stack.extend((f"{path}.{j}" if path else str(j), x[j]) for j in reversed(range(len(x))))
        else:
            out.append(path)
    return out


def _containers(sig: list) -> list:
    """The container entries of a :func:`walk` signature (dict keys, list and tuple lengths)."""
    return [k for k in sig if type(k) is tuple and (k[0] == "d" or k[0] is list or k[0] is tuple)]


def _setters(staged: dict, n: int) -> list[tuple[Any, Any, int]] | None:
    """(container, key, leaf position) for every leaf of ``staged`` in :func:`walk` order; a leaf
    inside a tuple gets (None, its current value, position): it can only be kept, not set."""
    out: list[tuple[Any, Any, int]] = []
    stack: list[tuple[Any, Any, Any]] = [(None, None, staged)]
    while stack:
        parent, key, x = stack.pop()
        t = type(x)
        if t is dict or t is OrderedDict:
            stack.extend((x, k, x[k]) for k in reversed(tuple(x)))
        elif t is list:
            stack.extend((x, j, x[j]) for j in reversed(range(len(x))))
        elif t is tuple:
            stack.extend((None, x[j], x[j]) for j in reversed(range(len(x))))
        else:
            out.append((parent, key, len(out)))
    return out if len(out) == n else None
