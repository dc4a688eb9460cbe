"""Version-aware hooks that put the tierckpt plugin under an unmodified Megatron-LM.

Megatron-LM's ``megatron/training`` is not a library with extension points for checkpoint
storage, so the plugin replaces a few module-level names it looks up at call time. Which names
depends on the megatron-core version (mcore_plugin/README.md):

========================  =====================================================  ==========================================
hook point                megatron-core 0.16.x                                   megatron-core 0.19.x
========================  =====================================================  ==========================================
save strategy             ``checkpointing.get_default_save_sharded_strategy``    ``checkpointing.TorchDistSaveShardedStrategy``
                          (imported by name; ``strategies/base.py`` exists)      (built directly; ``strategies/base.py`` gone)
load strategy             ``checkpointing.get_default_load_sharded_strategy``    ``checkpointing.TorchDistLoadShardedStrategy``
parser / validation       ``initialize.parse_args`` / ``validate_args``          ``arguments.parse_args`` / ``validate_args``
                          (imported by name in initialize.py)                    (called inside ``parse_and_validate_args``)
========================  =====================================================  ==========================================

Common to both: ``megatron.core.dist_checkpointing.tensor_aware_state_dict.MCoreTensorAwareStateDict``
(Megatron-LM's local-checkpoint path converts the state dict with it; the plugin's holder keeps
the sharded state dict for the local tier), ``training.setup_model_and_optimizer`` (where the
tiers are created and the local manager is put into ``checkpointing_context``),
``training.checkpoint_and_decide_exit`` (which tier is due at each iteration) and
``checkpointing.generate_state_dict`` (recorded, so a tier in another optimizer format can
rebuild the state dict).

:func:`install` checks that every hook point of the detected version exists before changing
anything and raises :class:`UnsupportedMegatronVersion` naming the version and what is missing
otherwise. Hooks do nothing unless ``--ckpt-plugin-enable`` was given, except adding the flags
to the parser. :func:`uninstall` restores every replaced name (tests).
"""

from __future__ import annotations

import importlib
import logging
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from tierckpt.integration import mark_phase

log = logging.getLogger("mcore_plugin.install")

SUPPORTED = ((0, 16), (0, 19))
"""(major, minor) of the megatron-core releases the hooks were written and tested for."""


class UnsupportedMegatronVersion(RuntimeError):
    """The imported megatron-core is not one the hooks know, or a hook point is missing."""


def megatron_core_version() -> tuple[tuple[int, int, int], str]:
    """Version of the ``megatron.core`` that ``import megatron.core`` resolves to now.

    This is the checkout's ``megatron/core`` when a Megatron-LM directory is first on
    ``sys.path`` (as under ``python pretrain_gpt.py``), else the installed wheel, so the hooks
    match the code that will actually run.

    Returns:
        ((major, minor, patch), version string as Megatron reports it).
    Raises:
        UnsupportedMegatronVersion: megatron.core is not importable or has no parsable version.
    """
    try:
        info = importlib.import_module("megatron.core.package_info")
    except ImportError as e:
        raise UnsupportedMegatronVersion(f"megatron-core is not importable: {e}") from None
    text = str(getattr(info, "__version__", ""))
    m = re.match(r"(\d+)\.(\d+)\.(\d+)", text)
    if not m:
        raise UnsupportedMegatronVersion(f"cannot parse megatron-core version {text!r}")
    return (int(m[1]), int(m[2]), int(m[3])), text


@dataclass(frozen=True)
class HookSpec:
    """Where the hooks of one megatron-core minor version go.

    Attributes:
        version: (major, minor).
        save_strategy: name in ``megatron.training.checkpointing`` that yields the torch_dist
            save strategy (a factory function on 0.16, the class on 0.19).
        load_strategy: same for loading.
        parser_modules: ``megatron.training`` modules whose ``parse_args``/``validate_args``
            globals are called during start-up.
        has_strategies_base: whether ``megatron.core.dist_checkpointing.strategies.base`` exists
            (a cross-check of the detected version).
    """

    version: tuple[int, int]
    save_strategy: str
    load_strategy: str
    parser_modules: tuple[str, ...]
    has_strategies_base: bool


HOOK_SPECS: dict[tuple[int, ...], HookSpec] = {
    (0, 16): HookSpec((0, 16), "get_default_save_sharded_strategy", "get_default_load_sharded_strategy",
                      ("megatron.training.arguments", "megatron.training.initialize"), True),
    (0, 19): HookSpec((0, 19), "TorchDistSaveShardedStrategy", "TorchDistLoadShardedStrategy",
                      ("megatron.training.arguments",), False),
}


def hook_spec(version: tuple[int, ...] | None = None) -> HookSpec:
    """The :class:`HookSpec` for ``version`` (default: the imported megatron-core).

    Raises:
        UnsupportedMegatronVersion: a version outside :data:`SUPPORTED`, or a version whose
            ``strategies/base.py`` presence contradicts it.
    """
    text = None
    if version is None:
        version, text = megatron_core_version()
    key = tuple(version[:2])
    spec = HOOK_SPECS.get(key)
    if spec is None:
        raise UnsupportedMegatronVersion(
            f"megatron-core {text or '.'.join(map(str, version))} is not supported by mcore_plugin; "
            f"supported: {', '.join('%d.%d.x' % v for v in SUPPORTED)}")
    if text is not None:
        try:
            importlib.import_module("megatron.core.dist_checkpointing.strategies.base")
            has_base = True
        except ImportError:
            has_base = False
        if has_base != spec.has_strategies_base:
            raise UnsupportedMegatronVersion(
                f"megatron-core reports {text} but dist_checkpointing/strategies/base.py is "
                f"{'present' if has_base else 'missing'}; the installed package looks mixed up")
    return spec


# --------------------------------------------------------------------------------------------
# Runtime state of one training process.


@dataclass
class Runtime:
    """What the hooks share within one process.

    Attributes:
        spec: the installed :class:`HookSpec`.
        tiers: the job's :class:`mcore_plugin.tiers.MegatronTiers` (created collectively in
            ``setup_model_and_optimizer``), or None.
        local_manager: the :class:`mcore_plugin.local_manager.TieredLocalCheckpointManager`.
        save_inputs, load_inputs: the last ``generate_state_dict`` call of a save / a load
            (positional and keyword arguments); ``save_sd_ref`` the dict that save returned.
        regenerate: ``state_dict_fn(fmt, is_loading)`` for the strategies and the local
            manager: the recorded call again with the distributed optimizer in format ``fmt``.
        due: tiers due at the iteration being saved (decided once per iteration).
        local_tier_masked: Megatron's ``non_persistent_ckpt_type`` is kept at None until the
            plugin's local manager is in place (so Megatron does not import nvidia-resiliency-ext).
    """

    spec: HookSpec
    tiers: Any = None
    local_manager: Any = None
    save_inputs: tuple | None = None
    load_inputs: tuple | None = None
    due: list[str] = field(default_factory=list)
    local_tier_masked: bool = False
    save_sd_ref: dict | None = None
    regenerate: Callable[[str, bool], dict] | None = None
    last_step_end: float | None = None
    persistent_saved_step: int | None = None


_runtime: Runtime | None = None
_originals: list[tuple[Any, str, Any]] = []
_lock = threading.Lock()


def runtime() -> Runtime | None:
    """The :class:`Runtime` of this process (None before :func:`install`)."""
    return _runtime


def _replace(obj, name: str, new) -> None:
    _originals.append((obj, name, getattr(obj, name)))
    setattr(obj, name, new)


def _args():
    from megatron.training.global_vars import get_args

    return get_args()


def _plugin_on(args=None) -> bool:
    from mcore_plugin.args import plugin_enabled

    try:
        args = args if args is not None else _args()
    except (ImportError, AssertionError):  # no Megatron-LM, or get_args() before its args exist
        return False
    return args is not None and plugin_enabled(args)


def installed() -> bool:
    """True after :func:`install` (and before :func:`uninstall`)."""
    return _runtime is not None


def install(*, training: bool | None = None) -> Runtime:
    """Install the hooks for the imported megatron-core (idempotent).

    Args:
        training: hook Megatron-LM's ``megatron.training`` too. Default: when importable.
            Without it only the version is checked (the megatron-core wheel alone has no
            training loop to hook; tests call the strategies directly).
    Returns:
        the process's :class:`Runtime`.
    Raises:
        UnsupportedMegatronVersion: unknown version, or a hook point missing in the checkout
            (nothing is changed then).
    """
    global _runtime
    with _lock:
        if _runtime is not None:
            return _runtime
        spec = hook_spec()
        if training is None:
            try:
                importlib.import_module("megatron.training.checkpointing")
                training = True
            except ImportError as e:
                log.info("megatron.training not importable (%s): hooks for the training loop not installed", e)
                training = False
        rt = Runtime(spec=spec)
        if training:
            _check_points(spec)
            _install_training_hooks(rt)
        _runtime = rt
        log.info("mcore_plugin hooks installed for megatron-core %d.%d (training loop: %s)",
                 *spec.version, bool(training))
        return rt


def uninstall() -> None:
    """Restore every name :func:`install` replaced, in reverse order."""
    global _runtime
    with _lock:
        while _originals:
            obj, name, orig = _originals.pop()
            setattr(obj, name, orig)
        _runtime = None


def _check_points(spec: HookSpec) -> None:
    missing = []
    ck = importlib.import_module("megatron.training.checkpointing")
    tr = importlib.import_module("megatron.training.training")
    for name in (spec.save_strategy, spec.load_strategy, "generate_state_dict", "save_checkpoint"):
        if not hasattr(ck, name):
            missing.append(f"megatron.training.checkpointing.{name}")
    for name in ("setup_model_and_optimizer", "checkpoint_and_decide_exit"):
        if not hasattr(tr, name):
            missing.append(f"megatron.training.training.{name}")
    for modname in spec.parser_modules:
        mod = importlib.import_module(modname)
        for name in ("parse_args", "validate_args"):
            if not hasattr(mod, name):
                missing.append(f"{modname}.{name}")
    tasd = importlib.import_module("megatron.core.dist_checkpointing.tensor_aware_state_dict")
    if not hasattr(tasd, "MCoreTensorAwareStateDict"):
        missing.append("megatron.core.dist_checkpointing.tensor_aware_state_dict.MCoreTensorAwareStateDict")
    if missing:
        raise UnsupportedMegatronVersion(
            f"Megatron-LM checkout does not match megatron-core {spec.version[0]}.{spec.version[1]}: "
            f"hook points missing: {', '.join(missing)}")


# --------------------------------------------------------------------------------------------
# Hooks.


def _install_training_hooks(rt: Runtime) -> None:
    """Replace every hook point of ``rt.spec`` (module docstring), one function per point."""
    ck = importlib.import_module("megatron.training.checkpointing")
    tr = importlib.import_module("megatron.training.training")
    _hook_parser(rt)
    _hook_generate_state_dict(rt, ck)
    _hook_strategies(rt, ck)
    _hook_local_path(rt)
    _hook_setup(rt, tr)
    _hook_checkpoint_and_decide_exit(rt, tr)
    _hook_pretrain(rt, tr)


def _hook_parser(rt: Runtime) -> None:
    """The plugin's flags in Megatron's parser; their validation after Megatron's own."""
    from mcore_plugin.args import add_plugin_args

    arguments = importlib.import_module("megatron.training.arguments")
    orig_parse, orig_validate = arguments.parse_args, arguments.validate_args

    def parse_args(extra_args_provider=None, ignore_unknown_args=False):
        def provider(parser):
            parser = add_plugin_args(parser)
            return extra_args_provider(parser) if extra_args_provider is not None else parser

        return orig_parse(provider, ignore_unknown_args)

    def validate_args(args, defaults={}):  # noqa: B006 - Megatron's signature
        from mcore_plugin.args import validate_plugin_args

        masked = None
        if _plugin_on(args) and getattr(args, "non_persistent_ckpt_type", None) == "local":
            # Megatron's validate_args imports nvidia-resiliency-ext for type 'local'; the
            # plugin serves that path itself (and 0.19 runs without nvrx).
            masked, args.non_persistent_ckpt_type = "local", None
        try:
            out = orig_validate(args, defaults)
        finally:
            if masked:
                args.non_persistent_ckpt_type = masked
        settings = validate_plugin_args(args)
        if settings is not None and "local" in settings.tiers:
            # Keep Megatron's own nvrx set-up in pretrain() off; setup_model_and_optimizer
            # puts the plugin's manager in place and turns the type back on.
            args.non_persistent_ckpt_type = None
            rt.local_tier_masked = True
        return out

    for modname in rt.spec.parser_modules:
        mod = importlib.import_module(modname)
        if getattr(mod, "parse_args") is orig_parse:
            _replace(mod, "parse_args", parse_args)
        if getattr(mod, "validate_args") is orig_validate:
            _replace(mod, "validate_args", validate_args)


def _hook_generate_state_dict(rt: Runtime, ck) -> None:
    """Record the inputs of the current save / load (``rt.regenerate`` replays them)."""
    orig_gen = ck.generate_state_dict

    def generate_state_dict(*a, **kw):
        optim_kw = kw.get("optim_sd_kwargs") or {}
        sd = orig_gen(*a, **kw)
        if optim_kw.get("is_loading"):
            rt.load_inputs = (a, kw)
        else:
            rt.save_inputs, rt.save_sd_ref = (a, kw), sd
        return sd

    generate_state_dict.__wrapped__ = orig_gen  # type: ignore[attr-defined]  # inspect.unwrap's link
    _replace(ck, "generate_state_dict", generate_state_dict)
    rt.regenerate = _regenerator(rt, orig_gen)


def _hook_strategies(rt: Runtime, ck) -> None:
    """The torch_dist save/load strategies (the version-specific names) wrapped by the plugin's."""
    orig_save = getattr(ck, rt.spec.save_strategy)
    orig_load = getattr(ck, rt.spec.load_strategy)

    def save_strategy(*a, **kw):
        base = orig_save(*a, **kw)
        if not _plugin_on() or rt.tiers is None:
            return base
        # Megatron reaches this strategy only on its persistent (--save) path: that save
        # always includes the persistent tier (the iterations the plugin schedules, and
        # Megatron's forced saves at the end of training or on a signal), plus the local
        # tier when due at the same step, from one staging per optimizer format.
        from mcore_plugin.strategies import TieredSaveStrategy

        return TieredSaveStrategy(_WithPersistent(rt), base=base, state_dict_fn=rt.regenerate)

    def load_strategy(*a, **kw):
        base = orig_load(*a, **kw)
        if not _plugin_on() or rt.tiers is None:
            return base
        from mcore_plugin import strategies

        # Megatron's own path loads the tracker's step, or --ckpt-step's: only the latter is
        # a step named by the user (a rollback when this run trains on from it)
        return strategies.TieredLoadStrategy(rt.tiers, base=base, state_dict_fn=rt.regenerate,
                                             rollback=explicit_step(_args())[1])

    _replace(ck, rt.spec.save_strategy, save_strategy)
    _replace(ck, rt.spec.load_strategy, load_strategy)


def _hook_local_path(rt: Runtime) -> None:
    """Megatron-LM's local-checkpoint path converts with the plugin's holder while it is on."""
    tasd = importlib.import_module("megatron.core.dist_checkpointing.tensor_aware_state_dict")
    orig_tasd = tasd.MCoreTensorAwareStateDict

    class _Dispatch:
        """``MCoreTensorAwareStateDict`` for Megatron-LM's local path: the plugin's holder with
        the plugin on, Megatron's class (nvrx) otherwise."""

        @staticmethod
        def from_state_dict(*a, **kw):
            if _plugin_on() and rt.local_manager is not None:
                from mcore_plugin.local_manager import LocalStateDictHolder

                return LocalStateDictHolder.from_state_dict(*a, **kw)
            return orig_tasd.from_state_dict(*a, **kw)

    _replace(tasd, "MCoreTensorAwareStateDict", _Dispatch)


def _hook_setup(rt: Runtime, tr) -> None:
    """The tiers are created (collectively) where Megatron-LM sets up model and optimizer."""
    orig_setup = tr.setup_model_and_optimizer

    def setup_model_and_optimizer(*a, **kw):
        args = _args()
        if _plugin_on(args) and rt.tiers is None:
            _create_tiers(rt, args, kw.get("checkpointing_context"))
        return orig_setup(*a, **kw)

    _replace(tr, "setup_model_and_optimizer", setup_model_and_optimizer)


def _hook_checkpoint_and_decide_exit(rt: Runtime, tr) -> None:
    """Each iteration: which tier is due (Megatron's two save paths pointed at it), a durable
    planned exit, step times for the scheduler, metrics to Megatron's writers."""
    orig_decide = tr.checkpoint_and_decide_exit

    def checkpoint_and_decide_exit(model, optimizer, opt_param_scheduler, iteration, *a, **kw):
        args = _args()
        if not _plugin_on(args) or rt.tiers is None:
            return orig_decide(model, optimizer, opt_param_scheduler, iteration, *a, **kw)
        now = time.monotonic()
        # the first iteration's time is not known (0); it still ends the recovery timeline
        rt.tiers.observe_step(0.0 if rt.last_step_end is None else now - rt.last_step_end)
        due = _due_at(rt, args, iteration)
        saved = (args.save_interval, getattr(args, "non_persistent_save_interval", None))
        # Megatron's loop saves when `iteration % interval == 0`: point its two paths at this
        # iteration when a tier is due, away from it otherwise. Persistent due -> Megatron's
        # torch_dist path (the strategy writes every due tier from one staging); local only ->
        # Megatron's non-persistent local path (the plugin's manager).
        away = iteration + 1
        args.save_interval = iteration if "persistent" in due else away
        args.non_persistent_save_interval = iteration if due == ["local"] else None
        try:
            exiting = orig_decide(model, optimizer, opt_param_scheduler, iteration, *a, **kw)
        finally:
            args.save_interval, args.non_persistent_save_interval = saved
        try:
            _durable_exit(rt, tr, args, exiting, model, optimizer, opt_param_scheduler, iteration, a, kw)
            return exiting
        finally:
            _log_schedule(rt, iteration)
            _log_tier_metrics(rt, iteration)
            rt.last_step_end = time.monotonic()

    _replace(tr, "checkpoint_and_decide_exit", checkpoint_and_decide_exit)


def _due_at(rt: Runtime, args, iteration: int) -> list[str]:
    """Tiers due at ``iteration`` (the same answer on every rank), recorded in ``rt.due``."""
    due = list(rt.tiers.due(iteration))
    train_iters = getattr(args, "train_iters", None)
    if train_iters and iteration >= train_iters and "persistent" not in due:
        # The job ends here: its last state goes to the persistent tier. Megatron's own
        # end-of-training save only happens when its --save-interval does not divide the
        # last iteration, which says nothing about adaptive intervals.
        due = [t for t in ("local", "persistent") if t in due or t == "persistent"]
    rt.due = due
    return due


def _hook_pretrain(rt: Runtime, tr) -> None:
    """Close the tiers after a normal end (background writes finish, the ledger records a clean
    run_end). After an exception nothing is closed: a peer may be gone, so waiting on
    replication could hang, and a run without run_end already counts as failed."""
    orig_pretrain = tr.pretrain

    def pretrain(*a, **kw):
        mark_phase("imports_done")  # the script imported everything it needs: pretrain() starts the job
        try:
            out = orig_pretrain(*a, **kw)
        except SystemExit as e:
            if e.code in (None, 0):
                _close(rt, clean=True, reason="sys.exit(0) inside pretrain")
            raise
        _close(rt, clean=True)
        return out

    _replace(tr, "pretrain", pretrain)
    pkg = importlib.import_module("megatron.training")
    if getattr(pkg, "pretrain", None) is orig_pretrain:
        _replace(pkg, "pretrain", pretrain)


def _regenerator(rt: Runtime, orig_gen) -> Callable[[str, bool], dict]:
    def fn(fmt: str, is_loading: bool) -> dict:
        inputs = rt.load_inputs if is_loading else rt.save_inputs
        sd = _regenerate(inputs, fmt, orig_gen)
        ref = None if is_loading else rt.save_sd_ref
        if ref is not None:
            # save_checkpoint adds keys after generate_state_dict (e.g.
            # num_floating_point_operations_so_far): keep the two dicts alike.
            for k, v in ref.items():
                sd.setdefault(k, v)
        return sd

    return fn


def _regenerate(inputs, fmt: str, orig_gen) -> dict:
    """Rebuild the state dict of the recorded ``generate_state_dict`` call with the distributed
    optimizer in format ``fmt`` (``dp_reshardable`` / ``fully_reshardable``)."""
    if inputs is None:
        raise RuntimeError("mcore_plugin: no generate_state_dict call recorded; "
                           f"cannot build the {fmt} state dict")
    a, kw = inputs
    kw = dict(kw)
    for key in ("optim_sd_kwargs", "model_sd_kwargs"):
        sub = dict(kw.get(key) or {})
        md = dict(sub.get("metadata") or {})
        md["distrib_optim_sharding_type"] = fmt
        sub["metadata"] = md
        kw[key] = sub
    return orig_gen(*a, **kw)


def _dp_reshardable_load_without_grad() -> None:
    """Run ``DistributedOptimizer.load_parameter_state_from_dp_reshardable`` under
    ``torch.no_grad()``, as its siblings (``..._from_fs_model_space``, …) already are.

    Why: with fp32 parameters (no --bf16/--fp16) the optimizer's main params are views of the
    model's leaf parameters; the in-place ``copy_`` of the loaded values then raises "a view
    of a leaf Variable that requires grad is being used in an in-place operation" (megatron-core
    0.16.1, any device). The plugin's local tier uses exactly this format.
    """
    import torch
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer as DO

    fn = DO.__dict__.get("load_parameter_state_from_dp_reshardable")
    if fn is None or getattr(fn, "_tierckpt_no_grad", False):
        return
    wrapped = torch.no_grad()(fn)
    wrapped._tierckpt_no_grad = True
    _replace(DO, "load_parameter_state_from_dp_reshardable", wrapped)


class _WithPersistent:
    """The job's tiers as seen by the save strategy on Megatron's persistent path: ``due``
    always includes ``"persistent"``, leaves out a local save this process already made of the
    same step, and is empty for a second persistent save of one step (the same on every rank:
    every rank makes the same calls); everything else is the wrapped :class:`MegatronTiers`'."""

    def __init__(self, rt: Runtime):
        self._rt = rt
        self._tiers = rt.tiers

    def due(self, step: int) -> list[str]:
        due = set(self._tiers.due(step)) | {"persistent"}
        lm = self._rt.local_manager
        if lm is not None and lm.last_saved_step == step:
            # Megatron's final save right after a local save of the same iteration
            due.discard("local")
        if self._rt.persistent_saved_step == step:
            # Megatron's end-of-training save of an iteration the plugin already saved
            due = set()
        last = getattr(self._tiers, "last_restore", None)
        if last is not None and getattr(last, "step", None) == step:
            # A job restored at this very iteration (e.g. requeued after its final save) would
            # rewrite a committed step, and the persistent tier drops the old copy before
            # writing. The state is already in the tiers; last_restore is agreed on all ranks.
            due = set()
        out = [t for t in ("local", "persistent") if t in due and t in self._tiers.tiers]
        if "persistent" in out:
            self._rt.persistent_saved_step = step
        return out

    def __getattr__(self, name):
        return getattr(self._tiers, name)


def _durable_exit(rt: Runtime, tr, args, exiting: bool, model, optimizer, opt_param_scheduler, iteration: int,
                  a: tuple, kw: dict) -> bool:
    """After Megatron's ``checkpoint_and_decide_exit`` returned ``exiting``: a planned exit
    (``--exit-interval``, ``--exit-duration-in-mins``, ``--exit-signal-handler``) right after a
    local-only save leaves the state on node-local disks only, because Megatron counts that save
    as its exit save. Every planned exit must leave a committed persistent step (the requeued job
    may land on fresh nodes), so the persistent tier is written now. The decision is the same on
    every rank (Megatron agreed on ``exiting``; ``persistent_saved_step`` follows the same calls).
    Returns whether it saved."""
    if not (exiting and getattr(args, "save", None) and rt.persistent_saved_step != iteration):
        return False
    log.info("tierckpt: planned exit at iteration %d: writing the persistent tier", iteration)
    _save_persistent_now(tr, model, optimizer, opt_param_scheduler, iteration, a, kw)
    return True


def _save_persistent_now(tr, model, optimizer, opt_param_scheduler, iteration: int, a: tuple, kw: dict) -> None:
    """Megatron's own persistent save of ``iteration`` (``save_checkpoint_and_time``, which
    routes through the plugin's strategy and returns once the step is committed), with the
    remaining ``checkpoint_and_decide_exit`` arguments (``num_floating_point_operations_so_far``,
    ``checkpointing_context``, ``train_data_iterator``; the same in 0.16 and 0.19)."""
    rest = dict(zip(("num_floating_point_operations_so_far", "checkpointing_context", "train_data_iterator"), a))
    rest.update(kw)
    tr.save_checkpoint_and_time(iteration, model, optimizer, opt_param_scheduler,
                                rest["num_floating_point_operations_so_far"], rest["checkpointing_context"],
                                train_data_iterator=rest.get("train_data_iterator"))


def _writers():
    """Megatron-LM's (TensorBoard writer, W&B writer); each None where not configured (they
    exist on the last rank only)."""
    from megatron.training.global_vars import get_tensorboard_writer, get_wandb_writer

    return get_tensorboard_writer(), get_wandb_writer()


def _log_schedule(rt: Runtime, iteration: int) -> None:
    """New interval decisions to Megatron-LM's TensorBoard and W&B writers (the engine hands
    every rank the decisions), as ``tierckpt/<tier>/{tau_steps,tau_s,delta_s,mtbf_s,restart_s,p}``
    at ``iteration``."""
    from tierckpt.integration import decision_metrics

    recs = rt.tiers.engine.drain_schedule_log()
    if not recs:
        return
    try:
        from mcore_plugin import metrics

        metrics.write(decision_metrics(recs), {}, iteration, *_writers())
    except Exception as e:  # metrics must never stop training
        log.warning("tierckpt: could not write schedule metrics: %s", e)


def _log_tier_metrics(rt: Runtime, iteration: int) -> None:
    """Saves' and restores' metrics (:mod:`mcore_plugin.metrics`: δ, background seconds, bytes,
    skipped/failed; restore seconds, sources, persistent bytes) to Megatron-LM's writers at
    ``iteration``. Drained on every rank, never blocking on a running tier."""
    from mcore_plugin import metrics

    scalars, texts = rt.tiers.metrics.drain()
    if not scalars and not texts:
        return
    try:
        metrics.write(scalars, texts, iteration, *_writers())
    except Exception as e:  # metrics must never stop training
        log.warning("tierckpt: could not write save/restore metrics: %s", e)


def explicit_step(args) -> tuple[int | None, bool]:
    """``(step, rollback)`` for Megatron's ``--ckpt-step``: the step (None when not given; 0
    means not given, as in Megatron's own ``if args.ckpt_step``), and whether loading it is a
    rollback, i.e. this run trains on from it (no ``--skip-train``). An evaluation run loads
    it read-only."""
    step = getattr(args, "ckpt_step", None)
    if not step:
        return None, False
    return int(step), not getattr(args, "skip_train", False)


def retrack(engine, save_dir: str, to_step: int) -> None:
    """After a rollback ran: point Megatron's tracker file (``latest_checkpointed_iteration.txt``
    under ``save_dir``) at the persistent step of the newest save still committed (by save order,
    not step number: a copy of the abandoned timeline whose supersede failed never wins), or
    remove it when none is (global rank 0; atomic replace).

    Why: the tracker still names the abandoned timeline's newest persistent step. Megatron
    prefers its ``--load`` path whenever the tracker is newer than the local manager's
    ``find_latest``; a restart after the rollback's first (local) commit would then ask for a
    superseded step and fail on every restart.
    """
    if engine.topo.rank != 0:
        return
    import os

    from megatron.training.checkpointing import get_checkpoint_tracker_filename

    path = get_checkpoint_tracker_filename(save_dir)
    newest = engine.persistent.newest_save_step()  # by save order: an abandoned higher step never wins
    if newest is None:
        if os.path.exists(path):
            os.remove(path)
        return
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(str(newest))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    log.info("tierckpt: Megatron's tracker now names persistent step %d (rollback to %d)", newest, to_step)


def _close(rt: Runtime, clean: bool, reason: str = "") -> None:
    if rt.tiers is not None:
        rt.tiers.close(clean=clean, reason=reason)


def _create_tiers(rt: Runtime, args, checkpointing_context) -> None:
    """Create the job's tiers (collective) and, with a local tier, put the plugin's manager
    where Megatron-LM's local-checkpoint path looks for it."""
    from mcore_plugin.args import tier_config_from_args
    from mcore_plugin.tiers import MegatronTiers

    from mcore_plugin import optim_state

    cfg = tier_config_from_args(args)
    # Torch-AdamW fallback (no Apex/TE): keep each parameter's Adam step across a restore,
    # and let a fresh optimizer build its load template (optim_state's docstring).
    optim_state.install()
    _dp_reshardable_load_without_grad()
    rt.tiers = MegatronTiers(cfg)
    engine = rt.tiers.engine
    engine.add_rollback_hook(lambda rb: retrack(engine, args.save, rb.to_step))
    from mcore_plugin.args import settings_of

    settings = settings_of(args)
    for note in settings.notes if settings is not None else ():
        log.info("mcore_plugin: %s", note)
    if "local" in cfg.tiers:
        from mcore_plugin.local_manager import TieredLocalCheckpointManager

        step, rollback = explicit_step(args)
        rt.local_manager = TieredLocalCheckpointManager(rt.tiers, regenerate=rt.regenerate, step=step,
                                                        rollback=rollback)
        if checkpointing_context is not None:
            checkpointing_context["local_checkpoint_manager"] = rt.local_manager
        if rt.local_tier_masked:
            args.non_persistent_ckpt_type = "local"
            rt.local_tier_masked = False
