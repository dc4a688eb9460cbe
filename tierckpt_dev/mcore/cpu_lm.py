"""CPU shims for Megatron-LM's training loop (``megatron/training``), on top of
:mod:`tierckpt_dev.mcore.cpu` (which covers megatron-core's models, optimizer and checkpointing).

Applied by ``python -m mcore_plugin.pretrain`` only when there is no accelerator; never on a
GPU machine. Each shim is named, logged once, and says what breaks without it. They are kept
to Megatron-LM's own modules: ``torch.cuda`` is *not* made to claim a GPU process-wide (other
code, e.g. tierckpt's staging, asks ``torch.cuda.is_available()`` to choose pinned memory);
instead the ``torch`` name inside the listed Megatron-LM modules is a view of torch whose
``cuda`` answers as one CPU "device".

``TIERCKPT_MCORE_CPU_SKIP=name,...`` (shared with :mod:`tierckpt_dev.mcore.cpu`) leaves shims out.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import threading
import types

import torch

from tierckpt_dev.mcore.cpu import _NullStream  # one CUDA-stream stand-in for both shim sets

log = logging.getLogger("tierckpt_dev.mcore.cpu_lm")

_lock = threading.Lock()
_applied: list[str] = []

# Megatron-LM modules whose `torch.cuda` calls need the one-CPU-device view (start-up
# checks, device placement of the data iterator's batches, memory reports).
_VIEW_MODULES = (
    "megatron.training.initialize",
    "megatron.training.training",
    "megatron.training.utils",
    "megatron.training.theoretical_memory_usage",
    "megatron.training.models.dist_utils",  # 0.19: DDP wrapping moved here
    # megatron-core 0.19's DDP orders its gradient reduce-scatter on CUDA streams
    # (torch.cuda.current_stream() in start_grad_sync) on every iteration
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.distributed.distributed_data_parallel",
)


class _CudaView(types.ModuleType):
    """``torch.cuda`` as seen by Megatron-LM's training modules on a CPU-only machine: one
    device, no-op synchronisation, null streams (DDP set-up runs "on a side stream"), zero
    memory statistics."""

    def __init__(self):
        super().__init__("torch.cuda")

    def __getattr__(self, name):
        return getattr(torch.cuda, name)

    @staticmethod
    def is_available():
        return True

    @staticmethod
    def device_count():
        return 1

    @staticmethod
    def set_device(device):
        return None

    @staticmethod
    def current_device():
        return 0

    @staticmethod
    def synchronize(device=None):
        return None

    @staticmethod
    def empty_cache():
        return None

    @staticmethod
    def memory_allocated(device=None):
        return 0

    max_memory_allocated = memory_reserved = max_memory_reserved = memory_allocated

    @staticmethod
    def reset_peak_memory_stats(device=None):
        return None

    @staticmethod
    def memory_stats(device=None):
        return {}

    @staticmethod
    def mem_get_info(device=None):
        return (0, 0)

    @staticmethod
    def get_device_name(device=None):
        return "cpu"

    Stream = _NullStream

    @staticmethod
    def current_stream(device=None):
        return _NullStream()

    @staticmethod
    def stream(s):
        return contextlib.nullcontext()


class _TorchView(types.ModuleType):
    """``torch`` with :class:`_CudaView` as its ``cuda`` attribute; everything else is torch."""

    def __init__(self):
        super().__init__("torch")
        self.cuda = _CudaView()

    def __getattr__(self, name):
        return getattr(torch, name)


_TORCH_VIEW: _TorchView | None = None


def _training_modules_cuda_view() -> None:
    """Inside ``megatron.training.{initialize,training,utils,...}`` ``torch.cuda`` reports one
    device and its synchronise/memory calls are no-ops.

    Why: ``initialize_megatron`` asserts ``torch.cuda.is_available()`` ("Megatron requires
    CUDA") and only creates the model-parallel groups when ``torch.cuda.device_count() > 0``;
    the training loop reads ``torch.cuda.max_memory_allocated()`` & co. for its reports. All
    raise or skip set-up on a CPU wheel. Tensors that these modules place with
    ``device="cuda"`` / ``torch.cuda.current_device()`` go to the CPU through
    :mod:`tierckpt_dev.mcore.cpu`'s device shim.
    """
    global _TORCH_VIEW
    _TORCH_VIEW = _TORCH_VIEW or _TorchView()
    for name in _VIEW_MODULES:
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        if getattr(mod, "torch", None) is torch:
            setattr(mod, "torch", _TORCH_VIEW)


def _no_fused_kernel_build() -> None:
    """``megatron.legacy.fused_kernels.load`` (called by ``initialize_megatron`` on every
    rank) does nothing.

    Why: it runs ``$CUDA_HOME/bin/nvcc -V`` to build the legacy fused softmax kernels and
    fails with a TypeError when there is no CUDA toolkit. On CPU the unfused softmax is used
    (``--no-masked-softmax-fusion``), so there is nothing to build.
    """
    try:
        fk = importlib.import_module("megatron.legacy.fused_kernels")
    except ImportError:  # Megatron-LM 0.19 dropped megatron/legacy and this build step
        return
    setattr(fk, "load", lambda args: None)


_SHIMS = (
    ("training_modules_cuda_view", _training_modules_cuda_view),
    ("no_fused_kernel_build", _no_fused_kernel_build),
)


def applied() -> list[str]:
    """Names of the shims applied in this process."""
    return list(_applied)


def apply() -> list[str]:
    """Install the Megatron-LM training-loop shims (idempotent; none with an accelerator).

    Needs ``megatron.training`` importable (the Megatron-LM checkout first on ``sys.path``).

    Returns:
        names applied in this process so far ([] with an accelerator).
    """
    from tierckpt_dev.mcore import cpu

    if cpu.accelerator_present():
        return []
    skip = {s.strip() for s in os.environ.get(cpu.SKIP_ENV, "").split(",") if s.strip()}
    with _lock:
        for name, fn in _SHIMS:
            if name in _applied or name in skip:
                continue
            fn()
            _applied.append(name)
            log.info("tierckpt_dev.mcore.cpu_lm: applied %s", name)
        return list(_applied)
