"""CPU compatibility patches for torchtitan 0.3.0 on torch 2.13 (CPU wheel).

torchtitan assumes an accelerator. On a machine without one it fails long before the first
step. :func:`apply_cpu_compat` installs a small set of named, targeted patches so the unmodified
trainer (``python -m torchtitan.train``) runs llama3 on CPU, 1 rank or several (FSDP2 over
gloo). Rules:

- Applied only when no accelerator is present (``torch.cuda.is_available()`` and
  ``torch.accelerator.is_available()`` both false). On a GPU machine it does nothing at all.
- Each patch is applied at most once per process and logged once on the
  ``tierckpt_dev.titan.cpu`` logger; a second call is a no-op.
- Must run in every rank process before the trainer is built. It is called from our
  entry point and from the config-registry functions (``tierckpt_dev.titan.config_registry``),
  which torchtitan's ``ConfigManager`` calls in each rank before ``Trainer(...)``.
- ``TIERCKPT_CPU_COMPAT_SKIP=name,name`` leaves the named patches out (to check that each one
  is really needed: every patch's docstring says what breaks without it).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import types
import warnings
from collections.abc import Callable

import torch

from tierckpt.integration import accelerator_present  # noqa: F401 - re-exported; apply() decides on it

log = logging.getLogger("tierckpt_dev.titan.cpu")

SKIP_ENV = "TIERCKPT_CPU_COMPAT_SKIP"

_lock = threading.Lock()
_applied: list[str] = []


# ------------------------------------------------------------------------ device module


def _total_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover
        return 1 << 34


def _peak_rss_bytes() -> int:
    try:
        import resource

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # KiB on Linux
    except Exception:  # pragma: no cover
        return 0


def _make_cpu_device_module() -> types.ModuleType:
    """A stand-in for ``torch.cuda`` with the calls torchtitan makes on its device module."""
    import platform

    mod = types.ModuleType("tierckpt_dev.titan.cpu.device_module")
    mod.__doc__ = "CPU stand-in for torchtitan's device module (torch.cuda on GPU machines)."
    name = f"CPU ({platform.processor() or platform.machine()})"

    def is_available() -> bool:
        return True

    def device_count() -> int:
        return 1

    def set_device(device=None) -> None:
        return None

    def current_device() -> int:
        return 0

    def synchronize(device=None) -> None:
        return None

    def get_device_name(device=None) -> str:
        return name

    def get_device_properties(device=None):
        return types.SimpleNamespace(
            name=name,
            total_memory=_total_memory_bytes(),
            multi_processor_count=os.cpu_count() or 1,
        )

    def memory_stats(device=None) -> dict:
        # Peak resident set size of the process stands in for "reserved" and "active" peaks.
        peak = _peak_rss_bytes()
        return {
            "active_bytes.all.peak": peak,
            "reserved_bytes.all.peak": peak,
            "num_alloc_retries": 0,
            "num_ooms": 0,
        }

    def reset_peak_memory_stats(device=None) -> None:
        return None

    def empty_cache() -> None:
        return None

    def memory_allocated(device=None) -> int:
        return 0

    def max_memory_allocated(device=None) -> int:
        return _peak_rss_bytes()

    for fn in (
        is_available, device_count, set_device, current_device, synchronize, get_device_name,
        get_device_properties, memory_stats, reset_peak_memory_stats, empty_cache,
        memory_allocated, max_memory_allocated,
    ):
        setattr(mod, fn.__name__, fn)
    # Anything else (streams, is_initialized, ...) falls through to torch.cpu.
    mod.__getattr__ = lambda attr: getattr(torch.cpu, attr)  # type: ignore[method-assign]  # a module's PEP 562 hook
    return mod


def _patch_device_module() -> None:
    """Point torchtitan's device type/module at the CPU.

    Breaks without it: ``torchtitan.tools.utils`` computes ``device_type =
    _get_available_device_type() or "cuda"`` at import time, so with no accelerator the trainer
    uses ``torch.cuda`` as its device module and dies in ``Trainer.__init__`` on
    ``torch.cuda.set_device`` (``torch._C`` has no ``_cuda_setDevice`` in a CPU wheel); later it
    would also call ``torch.cuda.memory_stats``/``get_device_properties`` (metrics), build
    "cuda" device meshes and pick NCCL.

    Patch: set ``device_type = "cpu"`` and ``device_module`` = a small CPU stand-in
    (current_device/set_device/synchronize/device_count/get_device_name/get_device_properties/
    memory_stats/reset_peak_memory_stats/empty_cache; the rest falls through to ``torch.cpu``)
    in ``torchtitan.tools.utils`` and in every already-imported torchtitan module that copied
    those names (``from torchtitan.tools.utils import device_type, device_module``). Modules
    imported later copy the patched values. With ``device_type == "cpu"`` the trainer picks
    gloo (``Backend.default_device_backend_map["cpu"]``) and CPU device meshes.

    Safe: only applied when no accelerator exists, where the original values are unusable; the
    stand-in's memory numbers (peak RSS) are used only for logging.
    """
    import torchtitan.tools.utils as tt_utils

    cpu_mod = _make_cpu_device_module()
    old_type, old_mod = tt_utils.device_type, tt_utils.device_module
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "torchtitan" or name.startswith("torchtitan.")):
            continue
        d = getattr(module, "__dict__", {})
        if isinstance(d.get("device_type"), str) and d["device_type"] == old_type:
            setattr(module, "device_type", "cpu")  # any torchtitan module that copied the name
        if d.get("device_module") is old_mod:
            setattr(module, "device_module", cpu_mod)
    tt_utils.device_type = "cpu"
    tt_utils.device_module = cpu_mod


# ---------------------------------------------------------------------- flex attention


def _patch_flex_attention() -> None:
    """Run FlexAttention eagerly on CPU, with its backward allowed.

    Breaks without it: torchtitan's ``FlexAttention`` calls a ``torch.compile``-d (inductor)
    ``flex_attention``; on CPU, tracing it hits ``_validate_device`` which raises
    ``NotImplementedError: FlexAttention does not support backward on CPU`` as soon as q/k/v
    require grad (the inductor CPU flex kernel has no backward). Swapping in the eager
    ``flex_attention`` alone is not enough: the eager entry point runs the same check.

    Patch: (1) ``torch.nn.attention.flex_attention._validate_device`` keeps every check except
    the CPU ``requires_grad`` rejection, and keeps that one whenever dynamo is compiling (the
    inductor path really has no CPU backward); (2) ``FlexAttention.compiled_flex_attn`` calls
    torchtitan's own body with the eager ``flex_attention`` in place of the compiled one. The
    eager path evaluates the flex-attention higher-order op with its reference (dense) forward
    and backward, which are device-agnostic. Wrapping the call (instead of assigning
    ``FlexAttention._compiled_flex_attn`` once) survives ``set_determinism``, which re-assigns
    that attribute with a fresh ``torch.compile`` when ``debug.deterministic`` is on.

    Safe: same math (block-causal document mask, same scale), just unfused; it materialises
    the (L x L) score matrix, which at the demo's seq_len 256 is tiny. Also silences torch's
    one-time "flex_attention called without torch.compile()" warning, which is expected here.
    """
    import torch.nn.attention.flex_attention as fa
    from torchtitan.models.common.attention import FlexAttention

    orig_validate = fa._validate_device

    def _validate_device(query, key, value):
        if query.device.type == "cpu" and not torch.compiler.is_dynamo_compiling():
            return None
        return orig_validate(query, key, value)

    _validate_device.__wrapped__ = orig_validate  # type: ignore[attr-defined]
    fa._validate_device = _validate_device

    orig_call = FlexAttention.__dict__["compiled_flex_attn"].__func__
    eager = fa.flex_attention

    def compiled_flex_attn(q, k, v, **kwargs):
        saved = FlexAttention.__dict__.get("_compiled_flex_attn")
        FlexAttention._compiled_flex_attn = eager
        try:
            return orig_call(q, k, v, **kwargs)
        finally:
            FlexAttention._compiled_flex_attn = saved

    compiled_flex_attn.__wrapped__ = orig_call  # type: ignore[attr-defined]
    FlexAttention.compiled_flex_attn = staticmethod(compiled_flex_attn)
    # The eager path is intended here; torch's "called without torch.compile()" advice is noise.
    warnings.filterwarnings(
        "ignore", message=r"flex_attention called without torch\.compile", category=UserWarning
    )


def _patch_block_mask_eager() -> None:
    """Build FlexAttention's block masks eagerly on CPU instead of through ``torch.compile``.

    Breaks without it: nothing fails, but every rank of every launch spends its first step
    (~8 s of CPU on this machine's 2 cores, measured with py-spy: dynamo tracing plus inductor's
    code hash and compile) compiling torchtitan's ``_compiled_create_block_mask`` (a
    module-level ``torch.compile(create_block_mask)``), which the trainer calls for each batch's
    document mask. The test suite and the demo launch torchtitan dozens of times.

    Patch: ``torchtitan.models.common.attention._compiled_create_block_mask`` (looked up by
    ``create_attention_mask`` at each call) becomes the eager ``create_block_mask``.

    Safe: the compiled function is the same Python function, compiled for speed on long
    sequences; the eager one computes the same ``BlockMask`` (same block counts and indices),
    at the demo's seq_len 256 in milliseconds.
    """
    import torchtitan.models.common.attention as attention
    from torch.nn.attention.flex_attention import create_block_mask

    attention._compiled_create_block_mask = create_block_mask


# ------------------------------------------------------------------- dist.set_timeout


def _patch_dist_set_timeout() -> None:
    """Provide ``torch.distributed.set_timeout`` (alias of the private ``_set_pg_timeout``).

    Breaks without it: after the first step the trainer shortens the process-group timeouts
    (``dist_utils.set_pg_timeouts`` → ``torch.distributed.set_timeout(timeout, group)``), which
    this torch 2.13 CPU build does not export: ``AttributeError: module 'torch.distributed'
    has no attribute 'set_timeout'`` at the end of step 1.

    Patch: if (and only if) the attribute is missing, alias it to
    ``torch.distributed.distributed_c10d._set_pg_timeout(timeout, group=None)``, which has the
    same signature and sets the default timeout on the group's gloo (or NCCL) backend.

    Safe: it only adds a missing name; an existing ``set_timeout`` is left untouched.
    """
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    if not hasattr(dist, "set_timeout"):
        dist.set_timeout = distributed_c10d._set_pg_timeout  # type: ignore[attr-defined]  # the name torchtitan calls


# ------------------------------------------------------------- FSDP2 reductions on gloo


def _is_gloo(group) -> bool:
    if group is None:
        return False
    import torch.distributed as dist

    try:
        return "gloo" in str(dist.get_backend(group)).lower()
    except Exception:
        return False


def _patch_fsdp_gloo_sum() -> None:
    """Make FSDP2 reduce gradients with plain SUM on gloo process groups.

    Breaks without it: torchtitan disables FSDP2's own gradient division
    (``set_gradient_divide_factor(1.0)``; it normalises by the global token count itself).
    With a factor that is not the group size, FSDP2 picks ``ReduceOp.PREMUL_SUM(1/factor)`` for
    the reduce-scatter, and gloo rejects it on the first backward with more than one rank:
    ``RuntimeError: Cannot use ReduceOp.PREMUL_SUM with Gloo``.

    Patch: wrap ``torch.distributed.fsdp._fully_shard._fsdp_collectives.
    _get_gradient_divide_factors`` so that, when the reduce-scatter or all-reduce group is a
    gloo group, it runs with ``force_sum_reduction_for_comms=True`` (the same switch FSDP2
    exposes as ``FSDPModule.set_force_sum_reduction_for_comms`` and uses for MTIA). FSDP2 then
    reduces with ``SUM`` and applies the factor as a separate division.

    Safe: for fp32 gradients and factor 1.0 this is exactly the same arithmetic
    (``PREMUL_SUM(1.0)`` == ``SUM``; FSDP2 skips a division by 1); for other factors the
    result differs only by where the division happens. Non-gloo groups are untouched.
    """
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives as coll

    orig = coll._get_gradient_divide_factors

    def _get_gradient_divide_factors(
        reduce_scatter_group,
        all_reduce_group,
        reduce_dtype,
        device_type="",
        factor=None,
        force_sum_reduction_for_comms=False,
    ):
        if _is_gloo(reduce_scatter_group) or _is_gloo(all_reduce_group):
            force_sum_reduction_for_comms = True
        return orig(
            reduce_scatter_group,
            all_reduce_group,
            reduce_dtype,
            device_type,
            factor,
            force_sum_reduction_for_comms,
        )

    _get_gradient_divide_factors.__wrapped__ = orig  # type: ignore[attr-defined]
    coll._get_gradient_divide_factors = _get_gradient_divide_factors


# ------------------------------------------------------------------------- registry

_PATCHES: list[tuple[str, Callable[[], None]]] = [
    ("device_module_cpu", _patch_device_module),
    ("flex_attention_eager_cpu", _patch_flex_attention),
    ("block_mask_eager_cpu", _patch_block_mask_eager),
    ("dist_set_timeout_alias", _patch_dist_set_timeout),
    ("fsdp_gloo_sum_reduction", _patch_fsdp_gloo_sum),
]


def patch_names() -> list[str]:
    return [name for name, _ in _PATCHES]


def applied_patches() -> list[str]:
    return list(_applied)


def apply_cpu_compat(*, force: bool = False) -> list[str]:
    """Apply the CPU patches once per process, only when no accelerator is present.

    Returns the names of the patches applied by this call (empty on a GPU machine or when
    already applied). ``force=True`` applies them even if an accelerator is reported (tests).
    """
    if not force and accelerator_present():
        return []
    skip = {s.strip() for s in os.environ.get(SKIP_ENV, "").split(",") if s.strip()}
    done: list[str] = []
    with _lock:
        for name, fn in _PATCHES:
            if name in _applied or name in skip:
                continue
            fn()
            _applied.append(name)
            done.append(name)
            log.info("applied CPU compatibility patch %s: %s", name, (fn.__doc__ or "").strip().splitlines()[0])
    return done
