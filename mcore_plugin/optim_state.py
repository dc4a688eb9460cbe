"""Per-parameter Adam ``step`` for Megatron's DistributedOptimizer on torch's AdamW fallback.

Without Apex or Transformer Engine, megatron-core (0.16 and 0.19) wraps ``torch.optim.AdamW``,
which keeps a ``step`` tensor per parameter. Megatron's checkpoint keeps only one:

- ``DistributedOptimizer.state_dict()`` asserts every parameter has the same ``step`` and
  stores that one value in the param groups (``len(steps) == 1``);
- ``DistributedOptimizer.load_state_dict()`` puts *one* tensor object into every parameter's
  state (``s["step"] = step``), and torch's ``Optimizer.load_state_dict`` keeps that object for
  ``step`` (``_process_value_according_to_param_policy`` returns it as is). The single-tensor
  AdamW then runs ``step_t += 1`` once per parameter on the shared tensor: after one more
  iteration every parameter's step is ``old + n_params``, bias correction changes, and the
  trajectory departs from the uninterrupted run.

:func:`install` patches four DistributedOptimizer methods; their step handling is active only
where Megatron uses torch's optimizer (``distrib_optimizer.HAVE_APEX_OR_TE`` false):

- ``sharded_state_dict`` adds ``tierckpt_param_steps``: per model parameter, its step as a
  one-element ShardedTensor ``optimizer.tierckpt_step.<model key>`` whose global shape is the
  parameter's stacked-layer axes + ``(1,)`` (independent of TP/PP/DP, so it reshards), saved by
  exactly one rank: the first TP chunk of the main model replica whose DP shard holds the
  parameter's first element;
- ``load_state_dict`` runs Megatron's load, then gives every parameter its *own* step tensor
  with the saved value (without saved values, a private copy of the shared one), and drops
  the ``step`` Megatron copies into torch's param groups (torch's AdamW never reads it; it
  would be stale after the next step);
- ``_set_main_param_and_optimizer_states`` accepts state without ``step``: megatron-core's
  ``fully_reshardable`` loader leaves ``step`` out of each parameter's tensors (it "is
  handled separately"), and the copy loop then raises ``KeyError: 'step'`` on every torch
  AdamW state, so a fully_reshardable checkpoint cannot be loaded at all on this path;
- ``load_state_dict`` also honours ``tierckpt_param_state_sharding_type`` (see
  :data:`FORMAT_OVERRIDE_KEY`);
- ``state_dict`` no longer asserts when steps differ (the per-parameter values travel in
  ``tierckpt_param_steps``; the param groups get the largest step) or when the optimizer has
  no state yet (a fresh optimizer about to load a checkpoint: Megatron's
  ``sharded_state_dict(is_loading=True)`` calls ``state_dict()``, whose
  ``assert len(steps) == 1`` fails on the torch fallback).
"""

from __future__ import annotations

import functools
import logging
import threading

import torch

log = logging.getLogger(__name__)

STEP_KEY = "tierckpt_param_steps"
"""Key of the per-parameter steps in DistributedOptimizer's (sharded) state dict."""

FORMAT_OVERRIDE_KEY = "tierckpt_param_state_sharding_type"
"""Set by :class:`mcore_plugin.strategies.TieredLoadStrategy` when the tensors it loaded are in
another format than the checkpoint directory's common state says; ``load_state_dict`` uses it."""

STEP_PREFIX = "optimizer.tierckpt_step."
"""Prefix of the per-parameter step ShardedTensors' keys."""

_lock = threading.Lock()
_installed = False
_step_fix = False


def needed() -> bool:
    """True when megatron-core's DistributedOptimizer wraps torch's Adam (no Apex/TE)."""
    from megatron.core.optimizer import distrib_optimizer as d

    return not getattr(d, "HAVE_APEX_OR_TE", True)


def install(force: bool = False) -> bool:
    """Patch ``DistributedOptimizer`` (idempotent). Returns whether the step fix is active.

    The step fix is active where Megatron uses torch's Adam (:func:`needed`) or with
    ``force`` (tests); the format override (:data:`FORMAT_OVERRIDE_KEY`) always is.
    """
    global _installed, _step_fix
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer as DO

    with _lock:
        _step_fix = _step_fix or force or needed()
        if _installed:
            return _step_fix
        orig_ssd, orig_load, orig_sd = DO.sharded_state_dict, DO.load_state_dict, DO.state_dict
        orig_set = DO._set_main_param_and_optimizer_states

        @functools.wraps(orig_ssd)
        def sharded_state_dict(self, model_sharded_state_dict=None, is_loading=False, *args, **kwargs):
            if model_sharded_state_dict is None:
                model_sharded_state_dict = {}
            sd = orig_ssd(self, model_sharded_state_dict, is_loading, *args, **kwargs)
            if _step_fix and isinstance(sd, dict) and model_sharded_state_dict \
                    and not self.ddp_config.use_megatron_fsdp:
                steps = step_sharded_tensors(self, model_sharded_state_dict, is_loading)
                if steps:
                    sd[STEP_KEY] = steps
            return sd

        @functools.wraps(orig_load)
        def load_state_dict(self, state_dict):
            saved = None
            if isinstance(state_dict, dict) and (STEP_KEY in state_dict or FORMAT_OVERRIDE_KEY in state_dict):
                state_dict = dict(state_dict)
                saved = state_dict.pop(STEP_KEY, None)
                if FORMAT_OVERRIDE_KEY in state_dict:
                    fmt = state_dict.pop(FORMAT_OVERRIDE_KEY)
                    if fmt != state_dict.get("param_state_sharding_type") and fmt == "fully_reshardable" \
                            and isinstance(state_dict.get("param_state"), dict):
                        # the template Megatron was given (another format) left its
                        # non-persistent entries (padding flags, steps) merged into param_state
                        state_dict["param_state"] = {
                            i: {k: v for k, v in d.items() if isinstance(v, torch.Tensor)}
                            for i, d in state_dict["param_state"].items() if isinstance(i, int) and isinstance(d, dict)}
                    state_dict["param_state_sharding_type"] = fmt
            orig_load(self, state_dict)
            if _step_fix and not self.ddp_config.use_megatron_fsdp:
                apply_steps(self, saved)
                # torch's AdamW keeps step per parameter only; the checkpoint's param-group
                # copy of it would sit in the live groups, stale from the next step on
                for g in self.optimizer.param_groups:
                    g.pop("step", None)

        @functools.wraps(orig_sd)
        def state_dict(self):
            if not _step_fix:
                return orig_sd(self)
            with _uniform_steps(self):
                return orig_sd(self)

        @functools.wraps(orig_set)
        def set_states(self, model_param, tensors):
            if _step_fix and "step" not in tensors and not getattr(
                    self.config, "use_precision_aware_optimizer_no_fp8_or_ds_fp8", False):
                cur = _state_of(self, model_param).get("step")
                if cur is not None:  # copy_ onto itself: a no-op; load_state_dict sets it after
                    tensors = {**tensors, "step": cur}
            return orig_set(self, model_param, tensors)

        DO.sharded_state_dict = sharded_state_dict
        DO.load_state_dict = load_state_dict
        DO.state_dict = state_dict
        DO._set_main_param_and_optimizer_states = set_states
        _installed = True
        log.info("mcore_plugin.optim_state: installed (per-parameter Adam step fix %s)",
                 "on" if _step_fix else "off: Apex/TE optimizer")
        return _step_fix


def local_params(opt) -> list:
    """Model parameters with optimizer state on this rank, in a fixed order (gbuf, dtype,
    bucket, param), each once."""
    out, seen = [], set()
    for gbuf_range_maps in opt.gbuf_ranges:
        for range_maps in gbuf_range_maps.values():
            for range_map in range_maps:
                for p in range_map["param_map"]:
                    if id(p) not in seen:
                        seen.add(id(p))
                        out.append(p)
    return out


def _state_of(opt, model_param) -> dict:
    group_index, group_order = opt.model_param_group_index_map[model_param]
    main = opt.optimizer.param_groups[group_index]["params"][group_order]
    return opt.optimizer.state[main]


def step_sharded_tensors(opt, model_sharded_state_dict, is_loading: bool) -> dict:
    """{index in :func:`local_params`: ShardedTensor of that parameter's step} (see module
    docstring for keys, shapes and the single main replica)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
    from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories

    tensors, _ = extract_sharded_tensors_and_factories(model_sharded_state_dict)
    by_param = {}
    for sh in nested_values(tensors):
        by_param[id(sh.data)] = sh
    out = {}
    for i, p in enumerate(local_params(opt)):
        sh = by_param.get(id(p))
        if sh is None:
            raise ValueError(f"model parameter {tuple(p.shape)} is missing from the model sharded state "
                             "dict passed to the optimizer; cannot checkpoint its Adam step")
        chunks = [sh] if isinstance(sh, ShardedTensor) else \
            [x for x in nested_values(sh.build()) if isinstance(x, ShardedTensor)]
        if not chunks:
            continue
        ref = chunks[0]
        n = ref.prepend_axis_num
        first_chunk = any(all(o == 0 for o in c.global_offset[n:]) for c in chunks)
        rid = ref.replica_id
        model_main = all(r == 0 for r in (rid[:-1] if isinstance(rid, tuple) else ()))
        holds_first = opt._get_model_param_range_map(p)["param"].start == 0
        main = first_chunk and model_main and holds_first
        if is_loading:
            data = torch.empty((1,) * (n + 1), dtype=torch.float32)
        else:
            st = _state_of(opt, p).get("step")
            data = torch.full((1,) * (n + 1), float(st) if st is not None else 0.0, dtype=torch.float32)
        key = STEP_PREFIX + (sh.key if isinstance(sh, ShardedTensorFactory) else ref.key)
        out[i] = ShardedTensor.from_rank_offsets(
            key, data, *[(ax, ref.global_offset[ax], ref.global_shape[ax]) for ax in range(n)],
            replica_id=(0 if main else 1),
        )
    return out


def apply_steps(opt, saved: dict | None) -> None:
    """Give every parameter its own ``step`` tensor: the saved value when ``saved`` (loaded
    :func:`step_sharded_tensors`) has it, else a private copy of the current one."""
    params = local_params(opt)
    for i, p in enumerate(params):
        state = _state_of(opt, p)
        cur = state.get("step")
        if saved is not None and i in saved:
            v = saved[i]
            v = v.reshape(-1)[0] if isinstance(v, torch.Tensor) else torch.tensor(float(v))
            state["step"] = v.detach().to(dtype=torch.float32, device="cpu").clone().reshape(())
        elif isinstance(cur, torch.Tensor):
            state["step"] = cur.detach().clone()


class _uniform_steps:
    """Inside: every parameter has a step and all steps are equal to the largest one, so
    Megatron's single-step ``state_dict()`` neither asserts on differing steps nor on a
    fresh optimizer (no state yet: step 0, as torch's AdamW would start); on exit the
    original state entries are put back."""

    def __init__(self, opt):
        self.opt = opt
        self.saved = None
        self.added: list = []

    def __enter__(self):
        if self.opt.ddp_config.use_megatron_fsdp:
            return self
        inner = self.opt.optimizer
        params = [p for g in inner.param_groups for p in g["params"]]
        states = [inner.state[p] for p in params if isinstance(inner.state.get(p, {}).get("step"), torch.Tensor)]
        values = {float(s["step"]) for s in states}
        top = max(values) if values else 0.0
        self.saved = []
        for p in params:
            s = inner.state.get(p)
            if s is None or "step" not in s:
                self.added.append((p, s is None))
                inner.state[p]["step"] = torch.tensor(top, dtype=torch.float32)
            elif len(values) > 1:
                self.saved.append((s, s["step"]))
                s["step"] = torch.tensor(top, dtype=s["step"].dtype)
        return self

    def __exit__(self, *exc):
        for s, t in self.saved or ():
            s["step"] = t
        inner = self.opt.optimizer
        for p, was_absent in self.added:
            if was_absent:
                inner.state.pop(p, None)
            else:
                inner.state[p].pop("step", None)
        return False
