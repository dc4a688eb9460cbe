"""The engine's :class:`~tierckpt.TierConfig` from torchtitan's ``[checkpoint]`` section.

:func:`build_tier_config` is the one place that turns a
``TieredCheckpointManager.Config`` into a ``TierConfig``: the TOML front-end's early check
(:func:`titan_plugin.toml.check_tiers_early`, before any process group exists) and the
manager at start-up both call it, so a bad value fails the same way in both. Errors name the
``checkpoint.*`` key the user wrote, through one table from ``TierConfig`` /
``ScheduleOptions`` field names to those keys (:func:`checkpoint_error`). The section's
``__post_init__`` (:class:`titan_plugin.manager.TieredCheckpointManager.Config`) calls it too,
so every rule is the engine's (:data:`tierckpt.config.RULES`) and written once; only the keys
whose value is not a ``TierConfig`` value (:data:`SECTION_RULES`: 0 for "unset", hours) have
rules of their own.

This module imports neither torch nor torchtitan.
"""

from __future__ import annotations

import dataclasses

from tierckpt import ConfigError, ScheduleOptions, TierConfig
from tierckpt.integration import RULES, SCHEDULE_RULES, Number, non_negative_int, validate_tiers

SECTION_RULES: dict[str, Number] = {
    "local_interval": non_negative_int(unit="steps", note="0 = no local tier"),
    "max_interval_steps": non_negative_int(unit="steps", note="0 = none"),
    "gpu_mtbf_hours": Number(min=0, unit="hours", note="0 = Llama 3's prior"),
    "restart_prior_s": dataclasses.replace(SCHEDULE_RULES["restart_prior_s"], note="0 = 300 s default"),
    # the engine's bound (<= collective_timeout_s / 2) applies to the value it maps to
    "restore_read_timeout_s": Number(min=0, unit="seconds", note="0 = the default"),
    # -- retention: TOML has no None, 0 is "off" --
    "keep_interval_s": Number(min=0, unit="seconds", note="0 = off"),
    "keep_every_n_steps": non_negative_int(unit="steps", note="0 = off"),
    "keep_period": non_negative_int(unit="steps", note="0 = off"),
}
"""Rules of the ``[checkpoint]`` keys that do not map 1:1 onto a ``TierConfig`` /
``ScheduleOptions`` value: TOML has no None, so 0 stands for "unset", and ``gpu_mtbf_hours``
is in hours. Checked in the key's own terms before the mapping, so the message shows the value
the user wrote; every other key is checked by ``TierConfig`` itself."""

TITAN_RULES: dict[str, Number] = {
    "interval": RULES["intervals"],  # the persistent tier's interval
    "keep_latest_k": RULES["keep_latest_k"],  # the persistent tier's retention
    "load_step": Number(integer=True, min=-1, unit="steps", note="-1 = the latest step"),
}
"""Rules of torchtitan's own numeric ``[checkpoint]`` keys (:func:`check_titan_keys`): the
engine's, where the key sets a ``TierConfig`` value."""


def check_titan_keys(ckpt) -> None:
    """torchtitan's own numeric ``[checkpoint]`` keys by :data:`TITAN_RULES`, before torchtitan's
    ``__post_init__`` (which raises ``ValueError`` or ``TypeError`` without the key's name, and
    takes ``True`` as 1): ``checkpoint.interval: must be an integer number of steps >= 1, got -1``.

    Raises:
        ConfigError: named ``checkpoint.<key>``, with the allowed values; also
            ``keep_latest_k = 1``, which torchtitan refuses (the newest step may still be saving).
    """
    for key, rule in TITAN_RULES.items():
        rule(getattr(ckpt, key), f"checkpoint.{key}")
    if ckpt.keep_latest_k == 1:
        raise ConfigError("checkpoint.keep_latest_k", "must be 0 (keep all) or at least 2 (torchtitan keeps "
                          "the newest step, which may still be being saved, and one more), got 1")


# TierConfig / ScheduleOptions field -> [checkpoint] key, where the names differ. A mapping
# entry ("keep_latest_k.local") is looked up first, then its field ("keep_latest_k").
_KEY_OF_FIELD = {
    "persistent_root": "persistent_folder",
    "tiers": "local_interval",
    "keep_latest_k.local": "local_keep_latest_k",
    "keep_latest_k.persistent": "keep_latest_k",
    "intervals.local": "local_interval",
    "intervals.persistent": "interval",
    "intervals": "local_interval",
    "warn_only": "warn_only_tiers",
    "min_steps": "min_interval_steps",
    "max_steps": "max_interval_steps",
    "gpu_mtbf_s": "gpu_mtbf_hours",
}


def checkpoint_error(e: ConfigError) -> ConfigError:
    """``e`` (naming a ``TierConfig``/``ScheduleOptions`` field, or a topology option such as
    ``replication_factor``) renamed to the ``checkpoint.*`` key that sets it, same message."""
    field = e.option
    key = _KEY_OF_FIELD.get(field, _KEY_OF_FIELD.get(field.split(".")[0], field))
    return ConfigError(f"checkpoint.{key}", str(e).removeprefix(f"{field}: "))


def _retention(ckpt, own: dict) -> dict:
    """``TierConfig``'s retention fields from the ``keep_*`` keys (0 = off = None)."""
    return {"keep_interval_s": own["keep_interval_s"] or None, "keep_every_n_steps": own["keep_every_n_steps"] or None,
            "keep_period": own["keep_period"] or None, "keep_steps": ckpt.keep_steps}


def build_tier_config(ckpt, persistent_folder: str) -> TierConfig:
    """The engine's config for a ``[checkpoint]`` section.

    Args:
        ckpt: a ``TieredCheckpointManager.Config`` (torchtitan's keys plus the plugin's).
        persistent_folder: the persistent tier's directory or fsspec URL (``persistent_folder``,
            else torchtitan's checkpoint folder).

    Returns:
        A validated :class:`~tierckpt.TierConfig`: the local tier only when
        ``local_interval > 0``; ``interval`` is the persistent tier's; adaptive and warn-only
        tiers restricted to those tiers; scheduler options ``min_steps`` /
        ``max_steps`` (steps, ``max_interval_steps = 0``: none), ``gpu_mtbf_s`` (seconds, from
        ``gpu_mtbf_hours``; 0 = the scheduler's default) and ``restart_prior_s`` (seconds; 0 =
        the default).

    Raises:
        ConfigError: named ``checkpoint.<key>`` (e.g. ``checkpoint.local_wait_timeout_s``), with
            the allowed values: :data:`SECTION_RULES`, then ``TierConfig``'s own validation.
    """
    try:
        own = {key: rule(getattr(ckpt, key), key) for key, rule in SECTION_RULES.items()}
        tiers = ("local", "persistent") if own["local_interval"] else ("persistent",)
        # unknown tier names fail here, before the tiers that are off are filtered out
        adaptive, warn_only = validate_tiers(ckpt.adaptive, "adaptive"), validate_tiers(ckpt.warn_only_tiers, "warn_only")
        sched = {"min_steps": ckpt.min_interval_steps}
        if own["max_interval_steps"]:
            sched["max_steps"] = own["max_interval_steps"]
        if own["gpu_mtbf_hours"]:
            sched["gpu_mtbf_s"] = own["gpu_mtbf_hours"] * 3600.0
        if own["restart_prior_s"]:
            sched["restart_prior_s"] = own["restart_prior_s"]
        return TierConfig(
            local_root=ckpt.local_root, persistent_root=persistent_folder, tiers=tiers,
            replication_jump=ckpt.replication_jump, replication_factor=ckpt.replication_factor,
            keep_latest_k={"local": ckpt.local_keep_latest_k, "persistent": ckpt.keep_latest_k},
            job_id=ckpt.job_id or None, simulated_ranks_per_node=ckpt.simulated_ranks_per_node,
            intervals={"local": own["local_interval"], "persistent": ckpt.interval} if own["local_interval"]
            else {"persistent": ckpt.interval},
            adaptive=tuple(t for t in adaptive if t in tiers), schedule=ScheduleOptions(**sched),
            local_wait_timeout_s=ckpt.local_wait_timeout_s, busy_tier_policy=ckpt.busy_tier_policy,
            cpu_staging=ckpt.cpu_staging, local_permissions=ckpt.local_permissions,
            background_nice=ckpt.background_nice, background_io_class=ckpt.background_io_class,
            restore_read_timeout_s=own["restore_read_timeout_s"] or None,
            warn_only=tuple(t for t in warn_only if t in tiers),
            preemption_signals=tuple(ckpt.preemption_signals), preemption_grace_s=ckpt.preemption_grace_s,
            **_retention(ckpt, own),
            storage_options=getattr(ckpt, "storage_options", None) or {},  # object stores
        )
    except ConfigError as e:
        raise checkpoint_error(e) from None
