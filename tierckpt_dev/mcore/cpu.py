"""CPU shims for megatron-core (tests and demos on machines without an accelerator).

Public API (stable):

- :func:`apply` — install every shim once per process; returns the names applied. A no-op
  (returns ``[]``) when an accelerator is present, so it is safe to call unconditionally.
- :func:`applied` — names applied in this process so far.
- :func:`accelerator_present` — what :func:`apply` decides on.

``TIERCKPT_MCORE_CPU_SKIP=name,name`` leaves the named shims out (to check that each one is
needed: every shim's docstring says what breaks without it). Shims also apply inside
Megatron's async checkpoint workers: the forked ones inherit them, the spawned persistent
worker runs :func:`apply` first (see ``async_worker``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading

import torch

from tierckpt.integration import accelerator_present  # noqa: F401 - re-exported; apply() decides on it

log = logging.getLogger("tierckpt_dev.mcore.cpu")

SKIP_ENV = "TIERCKPT_MCORE_CPU_SKIP"

_lock = threading.Lock()
_applied: list[str] = []


def applied() -> list[str]:
    """Names of the shims applied in this process."""
    return list(_applied)


def apply() -> list[str]:
    """Install the CPU shims (idempotent; nothing at all when an accelerator is present).

    Returns:
        names of the shims applied by this process so far ([] with an accelerator).
    """
    if accelerator_present():
        return []
    with _lock:
        skip = _skipped()
        for name, fn in _SHIMS:
            if name in _applied or name in skip:
                continue
            fn()
            _applied.append(name)
            log.info("tierckpt_dev.mcore.cpu: applied %s", name)
        return list(_applied)


def _skipped() -> set[str]:
    return {s.strip() for s in os.environ.get(SKIP_ENV, "").split(",") if s.strip()}


def _is_cuda_device(dev) -> bool:
    if isinstance(dev, bool):
        return False
    if isinstance(dev, int):
        return True  # an int device means cuda:<n> to torch
    if isinstance(dev, str):
        return dev.split(":", 1)[0] == "cuda"
    if isinstance(dev, torch.device):
        return dev.type == "cuda"
    return False


class _CudaToCpuMode(torch.overrides.TorchFunctionMode):
    """Rewrites CUDA device arguments to CPU for every torch call (see :func:`_cuda_device_to_cpu`)."""

    _TO = {torch.Tensor.to}
    _CUDA = {torch.Tensor.cuda}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self._CUDA:
            return args[0]
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs = dict(kwargs, device="cpu")
        if func in self._TO and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


_MODE: _CudaToCpuMode | None = None


def _cuda_device_to_cpu() -> None:
    """``device="cuda"`` / ``device=torch.cuda.current_device()`` / ``.cuda()`` / ``.to("cuda")``
    become CPU: a TorchFunctionMode entered for the rest of the process (main thread).

    Why: megatron-core allocates on the GPU by name all over DDP, the distributed optimizer,
    the grad scaler and clip_grads (``torch.zeros(1, device='cuda')``,
    ``torch.empty(n, device=torch.cuda.current_device())``); each raises "Torch not compiled
    with CUDA enabled" on a CPU wheel.
    """
    global _MODE
    _MODE = _CudaToCpuMode()
    _MODE.__enter__()


def _cuda_runtime_calls() -> None:
    """``torch.cuda.synchronize``/``set_device``/``empty_cache`` become no-ops and
    ``torch.cuda.current_device()`` returns 0 (mapped to CPU by :func:`_cuda_device_to_cpu`).

    Why: megatron-core's dist_checkpointing calls ``torch.cuda.synchronize()`` before every
    torch_dist write and ``torch.cuda.current_device()`` to place the tensors of its
    async-save agreement all-reduce; DDP and parallel_state synchronize too. Each initialises
    CUDA and raises on a CPU wheel. Likewise ``torch.cuda.Stream``/``current_stream()``/
    ``stream(s)`` become null streams: megatron-core 0.19's DDP orders its gradient
    reduce-scatter on CUDA streams (``start_grad_sync``) on every iteration.
    """
    torch.cuda.synchronize = lambda device=None: None
    torch.cuda.set_device = lambda device: None
    torch.cuda.empty_cache = lambda: None
    torch.cuda.current_device = lambda: 0
    # null stand-ins, not torch.cuda types: mypy's view of the patched names does not apply
    torch.cuda.Stream = _NullStream  # type: ignore[misc, assignment]
    torch.cuda.current_stream = lambda device=None: _NullStream()  # type: ignore[assignment, return-value]
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()  # type: ignore[assignment, misc]


class _NullStream:
    """A CUDA stream stand-in: work on the CPU is already ordered, so waits are no-ops."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other):
        return None

    def wait_event(self, event):
        return None

    def record_event(self, event=None):
        return event

    def synchronize(self):
        return None

    def query(self):
        return True


def _cuda_rng_tracker() -> None:
    """Megatron's CUDA RNG tracker (``model_parallel_cuda_manual_seed``,
    ``get_cuda_rng_tracker().fork()``) keeps and swaps *CPU* generator states, and
    ``torch.cuda.get_rng_state``/``set_rng_state`` read/write the CPU generator.

    Why: the tracker seeds and forks ``torch.cuda``'s generator (tensor-parallel init and
    dropout); without CUDA ``torch.cuda.get_rng_state()`` raises. On CPU the ops it guards draw
    from the CPU generator, so swapping that state keeps the tracker's meaning (each named
    stream is independent and reproducible). Megatron-LM saves ``torch.cuda.get_rng_state()``
    in its rng checkpoint entry; it then holds the CPU state, which round-trips.
    """
    from megatron.core.tensor_parallel import random as mrandom

    def get_state(device="cuda", clone=False, graph_safe=False):
        s = torch.get_rng_state()
        return s.clone() if clone else s

    def set_state(new_state, device=-1, graph_safe=False):
        torch.set_rng_state(new_state)

    mrandom._get_cuda_rng_state = get_state
    mrandom._set_cuda_rng_state = set_state

    def add(self, name, seed):
        if seed in self.seeds_:
            raise Exception("seed {} already exists".format(seed))
        self.seeds_.add(seed)
        if name in self.states_:
            raise Exception("cuda rng state {} already exists".format(name))
        orig = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(orig)

    @contextlib.contextmanager
    def fork(self, name=mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
        # Megatron's fork also warns when the CPU state changes inside the context, which on
        # CPU is every dropout: the named stream *is* the CPU generator here.
        if name not in self.states_:
            raise Exception("cuda rng state {} is not added".format(name))
        orig = torch.get_rng_state()
        prev_name = getattr(self, "_current_state_name", None)
        torch.set_rng_state(self.states_[name])
        if prev_name is not None:
            self._current_state_name = name
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)
            if prev_name is not None:
                self._current_state_name = prev_name

    mrandom.CudaRNGStatesTracker.add = add
    mrandom.CudaRNGStatesTracker.fork = fork
    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    torch.cuda.set_rng_state = lambda new_state, device="cuda": torch.set_rng_state(new_state)
    torch.cuda.get_rng_state_all = lambda: [torch.get_rng_state()]
    torch.cuda.set_rng_state_all = lambda states: torch.set_rng_state(states[0])  # type: ignore[assignment, index]  # one CPU "device"


_TYPE_NAMES = {torch.float32: "torch.cuda.FloatTensor", torch.float16: "torch.cuda.HalfTensor",
               torch.bfloat16: "torch.cuda.BFloat16Tensor", torch.float64: "torch.cuda.DoubleTensor"}


def _tensor_type_names() -> None:
    """``Tensor.type()`` without arguments names CPU float tensors as CUDA tensors
    (``torch.cuda.FloatTensor``, ``…HalfTensor``, ``…BFloat16Tensor``).

    Why: the Float16/Distributed optimizers sort parameters by
    ``param.type() == 'torch.cuda.FloatTensor'`` (and HalfTensor/BFloat16Tensor) and raise
    "Wrapped parameters must be one of torch.cuda.FloatTensor, …" for anything else, i.e. for
    every CPU parameter. ``Tensor.type(dtype)`` (a conversion) is unchanged.
    """
    orig = torch.Tensor.type

    def type_(self, dtype=None, non_blocking=False, **kw):
        if dtype is None and not kw and self.device.type == "cpu" and self.dtype in _TYPE_NAMES:
            return _TYPE_NAMES[self.dtype]
        return orig(self, dtype, non_blocking, **kw) if dtype is not None else orig(self)

    type_._tierckpt_orig = orig  # type: ignore[attr-defined]  # the unpatched method, to undo the patch
    torch.Tensor.type = type_  # type: ignore[method-assign]


def _async_worker_shims() -> None:
    """Megatron's spawned persistent async-checkpoint worker
    (``PersistentAsyncCaller.async_loop``) applies these shims first.

    Why: ``--async-save`` with a persistent worker spawns a fresh interpreter that calls
    ``torch.cuda.set_device(rank % torch.cuda.device_count())`` (ZeroDivisionError without a
    GPU) and then runs the save with none of the shims of the training process. Forked
    workers (``TemporalAsyncCaller``, FileSystemWriterAsync's) inherit them already.
    """
    from megatron.core.dist_checkpointing.strategies import async_utils

    caller = getattr(async_utils, "PersistentAsyncCaller", None)
    if caller is None or getattr(caller.async_loop, "_tierckpt_shim", False):
        return
    global _ORIG_ASYNC_LOOP
    _ORIG_ASYNC_LOOP = caller.__dict__["async_loop"].__func__
    caller.async_loop = staticmethod(async_worker)


_ORIG_ASYNC_LOOP = None


def async_worker(*args, **kwargs):
    """Entry point of Megatron's spawned persistent async worker with the CPU shims applied
    (installed as ``PersistentAsyncCaller.async_loop`` by :func:`apply`; importable by name
    so a spawned interpreter finds it)."""
    apply()
    if not accelerator_present():
        # A dedicated worker process: its one "device" is the CPU.
        torch.cuda.device_count = lambda: 1
    fn = _ORIG_ASYNC_LOOP
    if fn is None:  # shims skipped or an accelerator: the class still has the original
        from megatron.core.dist_checkpointing.strategies import async_utils

        fn = async_utils.PersistentAsyncCaller.__dict__["async_loop"].__func__
    return fn(*args, **kwargs)


async_worker._tierckpt_shim = True  # type: ignore[attr-defined]  # marks the shim (checked before patching)

_SHIMS = (
    ("cuda_device_to_cpu", _cuda_device_to_cpu),
    ("cuda_runtime_calls", _cuda_runtime_calls),
    ("cuda_rng_tracker", _cuda_rng_tracker),
    ("tensor_type_names", _tensor_type_names),
    ("async_worker", _async_worker_shims),
)
