"""One :class:`tierckpt.TieredCheckpointer` for Megatron-Core state dicts.

:class:`MegatronTiers` takes the dicts ``dist_checkpointing.save``/``load`` take (ShardedTensor /
ShardedObject leaves plus "common" values such as ``iteration``, ``args``,
``opt_param_scheduler``): ``save(step, state_dict, tiers=…, persistent_state_dict=…)`` stages
once and returns a :class:`tierckpt.SaveHandle`; ``restore(state_dict_fn, step=None)`` loads
from own local > peer replica > persistent. Formats: :mod:`mcore_plugin.convert` and
:mod:`mcore_plugin.persistent_io`.

``state_dict_fn(sharding_type, is_loading) -> dict`` is how callers give both optimizer
formats: it returns the full Megatron state dict (model + optimizer + common) built with
``metadata={"distrib_optim_sharding_type": sharding_type}`` (Megatron-LM:
``generate_state_dict(..., optim_sd_kwargs=dict(metadata=…))``).
"""

from __future__ import annotations

import io
import logging

import torch

from tierckpt import ConfigError, RestoreResult, SaveHandle, TierConfig, TieredCheckpointer
from tierckpt.integration import GenericRecord, all_gather, mark_phase, read_item, validate_tiers

from .convert import (
    COMMON_KEY,
    TOP_KEY,
    Payload,
    RestoreRequest,
    Staged,
    StateDictFn,
    optimizer_format,
    split_state_dict,
)
from .layout import (
    bucket_change,
    bucket_shapes,
    dp_changed,
    layout_change,
    parallel_layout,
    persistent_target,
    restore_persistent_only,
    saved_layout,
)
from .metrics import TierMetrics
from .persistent_io import MegatronPersistentIO

log = logging.getLogger("mcore_plugin.strategies")

LOCAL_OPTIM_FORMAT = "dp_reshardable"
"""Distributed-optimizer format of the local tier (cheap; DP-only resharding)."""

PERSISTENT_OPTIM_FORMAT = "fully_reshardable"
"""Distributed-optimizer format of the persistent tier (any TP/PP/DP on load)."""

OPTIM_FORMATS = ("dp_reshardable", "fully_reshardable", "fully_sharded_model_space")
"""Distributed-optimizer formats the tiers accept (megatron-core's names)."""

_KEEP_HANDLES = 8  # outcome() is asked for the latest saves only


class MegatronTiers:
    """Tiered checkpointing of Megatron-Core state dicts (create on every rank, collectively).

    Creating one installs :mod:`mcore_plugin.optim_state` (per-parameter Adam ``step`` on
    torch's AdamW fallback; a no-op with Apex/TE).

    Args:
        config: :class:`tierckpt.TierConfig` (``intervals`` drive :meth:`due`).
        node_id: explicit node id of this rank (tests/simulation); default from the environment.
        local_optim_format: distributed-optimizer format the local tier is written in
            (default :data:`LOCAL_OPTIM_FORMAT`).
        persistent_optim_format: format of the persistent tier (default
            :data:`PERSISTENT_OPTIM_FORMAT`).

    Attributes:
        engine: the underlying :class:`tierckpt.TieredCheckpointer`.
        last_restore: :class:`tierckpt.RestoreResult` of the last :meth:`restore`.
        last_restore_format: optimizer format of the state the last restore returned.
        last_restore_reason: why the last restore skipped the node-local and replica copies
            (a model-parallel size or the optimizer buckets differ from the step's:
            :mod:`mcore_plugin.layout`), or None.
        metrics: :class:`mcore_plugin.metrics.TierMetrics` of every save and restore.

    Raises:
        ConfigError: invalid tier settings (option named), unknown optimizer format.
    """

    def __init__(self, config: TierConfig, *, node_id: int | None = None,
                 local_optim_format: str = LOCAL_OPTIM_FORMAT,
                 persistent_optim_format: str = PERSISTENT_OPTIM_FORMAT):
        for opt, v in (("local_optim_format", local_optim_format), ("persistent_optim_format", persistent_optim_format)):
            if v not in OPTIM_FORMATS:
                raise ConfigError(opt, f"unknown distributed-optimizer format {v!r}; allowed: {', '.join(OPTIM_FORMATS)}")
        self.local_fmt, self.persistent_fmt = local_optim_format, persistent_optim_format
        from . import optim_state

        optim_state.install()
        self.engine = TieredCheckpointer(config, node_id=node_id, persistent_io=MegatronPersistentIO())
        self.last_restore: RestoreResult | None = None
        self.last_restore_format: str | None = None
        self.last_restore_reason: str | None = None
        self.metrics = TierMetrics()
        self._handles: dict[int, SaveHandle] = {}

    @property
    def tiers(self) -> tuple[str, ...]:
        """Configured tiers."""
        return self.engine.cfg.tiers

    def format_of(self, tier: str) -> str:
        """Distributed-optimizer format ``tier`` is written in."""
        return self.local_fmt if tier == "local" else self.persistent_fmt

    def due(self, step: int) -> list[str]:
        """Tiers due at ``step`` under ``TierConfig.intervals`` (fixed or adaptive, the same
        on every rank); all configured tiers when no intervals are configured."""
        if not self.engine.adaptive:
            return list(self.tiers)
        return self.engine.due(step)

    def observe_step(self, seconds: float) -> None:
        """Report a training step's wall time (seconds; 0: not known) to the adaptive scheduler
        (:meth:`tierckpt.TieredCheckpointer.observe_step`: every rank, every step)."""
        self.engine.observe_step(seconds)

    def checkpoint_dir(self, step: int) -> str:
        """Directory or URL of the persistent tier's ``step`` (``<persistent_root>/step-<N>``),
        a stock torch_dist checkpoint once committed."""
        return self.engine.persistent_url(step)

    def save(self, step: int, state_dict: dict, *, tiers=None,
             persistent_state_dict: dict | None = None) -> SaveHandle:
        """Stage a Megatron state dict and write it to ``tiers`` in the background (collective).

        Args:
            step: training iteration (>= 0).
            state_dict: full Megatron state dict (ShardedBase leaves + common values), as
                given to ``dist_checkpointing.save``; used for the local tier and, unless
                ``persistent_state_dict`` is given, for the persistent tier.
            tiers: subset of the configured tiers (default: :meth:`due`).
            persistent_state_dict: the same state built with the persistent optimizer format.
        Returns:
            :class:`tierckpt.SaveHandle` (``blocking_s``: δ in seconds; the state may change
            once this returns; one future per started tier).
        Raises:
            ConfigError: unknown or unconfigured tier.
            TierFailedError: the previous save of a due tier failed (tiers outside warn_only).
        """
        tiers = self.due(step) if tiers is None else list(validate_tiers(tiers))
        if not tiers:
            return SaveHandle(step, 0.0)
        parts: dict[str, tuple[dict, dict]] = {}
        base = split_state_dict(state_dict)
        for t in tiers:
            parts[t] = split_state_dict(persistent_state_dict) if (
                t == "persistent" and persistent_state_dict is not None) else base
        return self.save_parts(step, parts)

    def save_parts(self, step: int, parts: dict[str, tuple[dict, dict]], *, wait_previous: bool = False) -> SaveHandle:
        """Like :meth:`save` with already split ``{tier: (sharded, common)}``; tiers sharing
        the same parts object are staged once. Returns one handle for the step (δ summed over
        stagings). ``wait_previous``: never defer a tier whose previous save still runs (see
        :meth:`tierckpt.TieredCheckpointer.save`)."""
        groups: list[tuple[tuple, list[str]]] = []
        for t, p in parts.items():
            for g in groups:
                if g[0] is p:
                    g[1].append(t)
                    break
            else:
                groups.append((p, [t]))
        handle = SaveHandle(step, 0.0)
        for (sharded, common), ts in groups:
            fmt = optimizer_format(common)
            if "persistent" in ts and fmt not in (None, "fully_reshardable", "fully_sharded_model_space"):
                log.warning("tierckpt mcore: persistent step %d holds the %s optimizer format; TP/PP "
                            "changes on load need `tierckpt export-mcore`", step, fmt)
            h = self.engine.save(step, {TOP_KEY: Payload(Staged(sharded, common, parallel_layout(sharded)))}, tiers=ts,
                                 wait_previous=wait_previous)
            handle.blocking_s += h.blocking_s
            handle.futures.update(h.futures)
            handle.skipped.update(h.skipped)
        self._handles[step] = handle
        while len(self._handles) > _KEEP_HANDLES:
            self._handles.pop(next(iter(self._handles)))
        self.metrics.saved(handle)
        return handle

    def wait(self, tiers=None, *, step: int | None = None) -> dict[str, bool]:
        """Block until the background writes of ``tiers`` (default all; only those started at
        ``step`` when given) are finished; the local tier at most ``local_wait_timeout_s``
        (see :meth:`tierckpt.TieredCheckpointer.wait`). Returns ``{tier: finished}``."""
        return self.engine.wait(tiers, step=step)

    def outcome(self, step: int, tiers) -> dict[str, bool | None]:
        """{tier: True (committed) | False (failed or skipped) | None (not saved at ``step`` or
        still running)} of one of the last 8 saves, from its :class:`tierckpt.SaveHandle`;
        call after :meth:`wait`."""
        got = self._handles[step].outcome() if step in self._handles else {}
        return {t: got.get(t) for t in tiers}

    def restore(self, state_dict_fn: StateDictFn, step: int | None = None, *,
                part: str = "all", rollback: bool = False) -> dict | None:
        """Load the newest step every node can be served from (or ``step``), collectively.

        ``state_dict_fn(fmt, True)`` builds the template for the source chosen: the local
        format for own-local/peer-replica, the persistent format for persistent. An explicit
        ``step`` is read-only unless ``rollback`` (a training run resuming an older step: see
        :meth:`tierckpt.TieredCheckpointer.restore`).

        Returns:
            the loaded Megatron state dict (common values + loaded tensors, like
            ``dist_checkpointing.load``; pass ``["model"]`` to ``model.load_state_dict`` and
            ``["optimizer"]`` to ``optimizer.load_state_dict``), or None when nothing is
            committed anywhere. ``last_restore`` holds the RestoreResult. ``part="sharded"``
            returns only the loaded sharded part (what a Megatron load strategy returns).
        A job whose DP size differs from the step's reads the node-local copies resharded
        over DP (the engine's in-cluster restore); one whose TP/PP/CP/EP size or optimizer
        buckets differ loads the persistent step instead of any node-local or replica copy
        (:mod:`mcore_plugin.layout`); ``last_restore_reason`` says why.

        Raises:
            NoCheckpointError: checkpoints exist but none could be restored; or the layout
                changed and the persistent tier holds no step to load (the message names it).
        """
        mark_phase("model_built")  # Megatron built model and optimizer before its load (the recovery timeline)
        state_dict_fn, reason = self._layout_changed(state_dict_fn, step)
        self.last_restore_reason = reason
        req = RestoreRequest(state_dict_fn, self.local_fmt, self.persistent_fmt)
        if reason is None:
            res = self.engine.restore({TOP_KEY: req}, step=step, rollback=rollback)
        else:
            res = restore_persistent_only(self.engine, {TOP_KEY: req}, step, rollback)
        self.last_restore = res
        if res is None:
            return None
        self.metrics.restored(res)
        self.last_restore_format = req.optim_format
        return req.sharded_result if part == "sharded" else req.result

    def _layout_changed(self, state_dict_fn: StateDictFn, step: int | None) -> tuple[StateDictFn, str | None]:
        """Whether the node-local copies of the step a restore would choose (or ``step``) can
        be read under this job's parallel layout (collective; :mod:`mcore_plugin.layout`).

        Same layout: yes. DP alone changed: yes when every ``dp_reshardable`` bucket keeps its
        key and global shape on every rank (the engine then reshards over DP from the
        in-cluster copies); checking builds the local-format template, which the returned
        ``state_dict_fn`` hands out on its first call instead of building it again. A
        model-parallel size or a bucket changed: no; the reason is logged once (global rank 0)
        and appended to the ledger as a ``restore_policy`` record.

        Returns:
            ``(state_dict_fn to restore with, reason for loading the persistent step or None)``.
        Raises:
            NoCheckpointError: the copies cannot be read and the persistent tier has no step.
        """
        got = saved_layout(self.engine, TOP_KEY, step)
        if got is None:
            return state_dict_fn, None
        (local_step, saved), now = got, parallel_layout()
        change = layout_change(saved, now, self.local_fmt)
        if change is None and dp_changed(saved, now):
            template = state_dict_fn(self.local_fmt, True)
            mine = bucket_change(saved, bucket_shapes(template), self.local_fmt, now or {})
            change = next((c for c in all_gather(mine, self.engine.groups.local_world) if c), None)
            if change is None:
                if self.engine.topo.rank == 0:
                    log.info("tierckpt mcore: step %d: saved DP=%s, now DP=%s: the %s local tier reshards over DP "
                             "from the in-cluster copies", local_step, saved.get("dp"), now and now.get("dp"),
                             self.local_fmt)
                return _first_call_returns(state_dict_fn, (self.local_fmt, True), template), None
        if change is None:
            return state_dict_fn, None
        target = persistent_target(self.engine, step, change)
        reason = f"{change}; loading the {self.persistent_fmt} persistent step {target}"
        if self.engine.topo.rank == 0:
            log.warning("tierckpt mcore: step %d: %s", local_step, reason)
        self.engine.ledger.append(GenericRecord(name="restore_policy", extra={
            "sources": ["persistent"], "reason": reason, "local_step": local_step, "persistent_step": target,
            "saved_layout": saved, "layout": now}))
        return state_dict_fn, reason

    def read_common(self, step: int | None = None) -> tuple[int, dict] | None:
        """Megatron's common state (``args``, ``iteration``, …) of ``step`` (None: the newest
        step every node can be served from), read from one verified node-local copy instead of
        a full restore (collective; :func:`tierckpt.integration.read_item`). Megatron-LM's first, "rank0"
        load pass needs only this.

        Returns:
            ``(step, common dict)``, or None when no node-local copy could be read (the step is
            only in the persistent tier): run :meth:`restore` with an empty template then.
        """
        got = read_item(self.engine, f"{TOP_KEY}.{COMMON_KEY}", step)  # DCP flattens {"mcore": {...}}
        if got is None:
            return None
        return got[0], torch.load(io.BytesIO(got[1]), weights_only=False)

    def close(self, clean: bool = True, reason: str = "") -> None:
        """Finish background work and record the run's end (see TieredCheckpointer.close)."""
        self.engine.close(clean=clean, reason=reason)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self.close(clean=exc_type is None, reason=repr(exc) if exc else "")


def _first_call_returns(fn: StateDictFn, args: tuple, value: dict) -> StateDictFn:
    """``fn``, except that its first call with ``args`` returns ``value`` (already built)."""
    box = [value]

    def wrapped(*a):
        if a == args and box:
            return box.pop()
        return fn(*a)

    return wrapped
