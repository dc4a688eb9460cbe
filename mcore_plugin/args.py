"""``--ckpt-plugin-*`` flags for Megatron-LM's argument parser, and their validation.

Megatron-LM builds one ``argparse`` parser in ``megatron.training.arguments.parse_args`` and
accepts an ``extra_args_provider(parser) -> parser``. :func:`add_plugin_args` is such a provider
(``mcore_plugin.install`` chains it in front of the script's own provider), so the flags show up
in ``pretrain_gpt.py --help`` and are parsed with Megatron's own flags.

Mapping onto Megatron-LM's checkpoint paths (both stay Megatron's; the plugin serves them):

- persistent tier = Megatron's ``--save`` directory, written by the ``torch_dist`` save path
  (wrapped by :mod:`mcore_plugin.strategies`: manifest + commit marker, optimizer in
  ``fully_reshardable`` format); its interval is ``--save-interval`` or
  ``--ckpt-plugin-persistent-interval``.
- local tier (+ replicas on peer nodes) = Megatron's ``--non-persistent-ckpt-type local`` path,
  served by :class:`mcore_plugin.local_manager.TieredLocalCheckpointManager` instead of
  nvidia-resiliency-ext's manager; its interval is ``--non-persistent-save-interval`` or
  ``--ckpt-plugin-local-interval``.

:func:`validate_plugin_args` runs after Megatron's own ``validate_args`` (installed by
``mcore_plugin.install``) and fails at start with :class:`tierckpt.errors.ConfigError` whose
``option`` is the offending flag. :func:`tier_config_from_args` turns the validated flags into a
:class:`tierckpt.TierConfig`; the validation itself builds it that way, so the engine's bounds fail
there too, named by flag.
"""

from __future__ import annotations

import argparse
import json
import os
import weakref
from dataclasses import dataclass, field

from tierckpt import ConfigError, ScheduleOptions, TierConfig
from tierckpt.integration import RULES, SCHEDULE_RULES, TIERS, Number, non_negative_seconds, positive_number

PREFIX = "--ckpt-plugin-"
GROUP_TITLE = "tierckpt checkpoint plugin"

# Megatron's own flags the plugin reads or constrains (dest -> flag, for error messages).
_MEGATRON_FLAG = {
    "save": "--save",
    "load": "--load",
    "save_interval": "--save-interval",
    "ckpt_format": "--ckpt-format",
    "non_persistent_ckpt_type": "--non-persistent-ckpt-type",
    "non_persistent_save_interval": "--non-persistent-save-interval",
    "non_persistent_local_ckpt_dir": "--non-persistent-local-ckpt-dir",
    "replication": "--replication",
    "replication_jump": "--replication-jump",
    "replication_factor": "--replication-factor",
    "use_dist_ckpt": "--ckpt-format",
}


# The value rule of every numeric flag: the engine's rule of the field it sets
# (tierckpt.config.RULES), or, where the flag's value is not that field's value (hours; 0 for
# "the default"), the flag's own. The parser applies it to the text (an argparse error naming
# the flag, exit 2) and validate_plugin_args to the value, however it was set (Megatron's
# args_defaults, a script), as a ConfigError naming the flag.
FLAG_RULES: dict[str, Number] = {
    "--ckpt-plugin-replication-jump": RULES["replication_jump"],
    "--ckpt-plugin-replication-factor": RULES["replication_factor"],
    "--ckpt-plugin-local-interval": RULES["intervals"],
    "--ckpt-plugin-persistent-interval": RULES["intervals"],
    "--ckpt-plugin-gpu-mtbf-hours": positive_number(unit="hours"),
    "--ckpt-plugin-restart-prior": SCHEDULE_RULES["restart_prior_s"],
    "--ckpt-plugin-min-interval": SCHEDULE_RULES["min_steps"],
    "--ckpt-plugin-max-interval": SCHEDULE_RULES["max_steps"],
    "--ckpt-plugin-local-keep": RULES["keep_latest_k"],
    "--ckpt-plugin-persistent-keep": RULES["keep_latest_k"],
    "--ckpt-plugin-local-wait-timeout": RULES["local_wait_timeout_s"],
    # 0 = None; the engine's bound (<= collective_timeout_s / 2) applies to the value it maps to
    "--ckpt-plugin-restore-read-timeout": non_negative_seconds(note="0 = the default"),
    "--ckpt-plugin-exit-timeout": RULES["exit_timeout_s"],
    "--ckpt-plugin-simulated-ranks-per-node": RULES["simulated_ranks_per_node"],
    "--ckpt-plugin-background-nice": RULES["background_nice"],
    # -- retention beyond --ckpt-plugin-persistent-keep (_add_retention_args) --
    "--ckpt-plugin-persistent-keep-interval": RULES["keep_interval_s"],
    "--ckpt-plugin-persistent-keep-every": RULES["keep_every_n_steps"],
    "--ckpt-plugin-persistent-keep-period": RULES["keep_period"],
    "--ckpt-plugin-persistent-keep-steps": RULES["keep_steps"],  # each STEP of the list (nargs="+")
}

LIST_FLAGS = frozenset({"--ckpt-plugin-persistent-keep-steps"})
"""Flags of :data:`FLAG_RULES` that take several values (``nargs="+"``): the rule applies to each."""


def _dest(flag: str) -> str:
    return flag.removeprefix("--").replace("-", "_")


def _typed(flag: str):
    """argparse ``type=`` converter of ``flag``: :data:`FLAG_RULES` applied to the text, an
    ``ArgumentTypeError`` (parser error naming the flag) with the rule's message."""
    rule = FLAG_RULES[flag]

    def conv(text: str):
        try:
            return rule.parse(text, flag)
        except ConfigError as e:
            raise argparse.ArgumentTypeError(str(e).removeprefix(f"{flag}: ")) from None

    conv.__name__ = f"{_dest(flag)}_value"  # argparse names it in some messages
    return conv


def _check_flag_values(args: argparse.Namespace) -> None:
    """:data:`FLAG_RULES` on the values in ``args`` (None = not given).

    Raises:
        ConfigError: naming the flag, with the allowed values.
    """
    for flag, rule in FLAG_RULES.items():
        value = getattr(args, _dest(flag), None)
        if value is None:
            continue
        if flag in LIST_FLAGS:
            if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
                raise ConfigError(flag, f"must be a list of {rule.describe()}, got {value!r}")
            setattr(args, _dest(flag), [rule(v, flag) for v in value])
        else:
            setattr(args, _dest(flag), rule(value, flag))


def _add_exit_flag(g) -> None:
    """``--ckpt-plugin-exit-timeout`` (``TierConfig.exit_timeout_s``, :mod:`tierckpt.exit`)."""
    g.add_argument("--ckpt-plugin-exit-timeout",
                   type=_typed("--ckpt-plugin-exit-timeout"), default=None,
                   metavar="SECONDS", help="Longest the process's exit waits for the saves still running when "
                                           "training ends without the plugin's finalize (an exception); then "
                                           "they stay uncommitted and the ledger names them (default 600; at most 604800).")


def _add_background_args(g) -> None:
    """How saves run beside training: a busy tier, CPU staging, background priority
    (``TierConfig.busy_tier_policy``, ``cpu_staging``, ``background_nice``, ``background_io_class``)."""
    g.add_argument("--ckpt-plugin-busy-tier-policy", choices=("defer", "wait"), default=None,
                   help="A tier due while its previous save still runs: defer (default; the plugin's "
                        "local tier skips that iteration and saves at the first one where the running "
                        "save finished on every rank, recorded in the ledger) or wait (the local tier "
                        "waits at most --ckpt-plugin-local-wait-timeout). Megatron's persistent path "
                        "always waits: Megatron records every save it starts as its latest checkpoint.")
    g.add_argument("--ckpt-plugin-cpu-staging", choices=("blocking", "overlapped"), default=None,
                   help="How a save copies a state held in host memory (a CPU run): "
                        "blocking (default; inside the save) or overlapped (ShardedTensors of 64 KiB and more "
                        "copied in the background during the next forward/backward; the optimizer step waits "
                        "for them; a write that races the copy fails that save). CUDA tensors are unaffected.")
    g.add_argument("--ckpt-plugin-background-nice", type=_typed("--ckpt-plugin-background-nice"), default=None,
                   metavar="N", help="Added to the nice value of the plugin's background threads (writes, "
                                     "checksums, replication): 0..19, default 10; 0 = the trainer's priority.")
    g.add_argument("--ckpt-plugin-background-io-class", default=None, metavar="CLASS",
                   help="I/O class of the same threads: best-effort (default, lowest level), idle or none.")


def _add_retention_args(g) -> None:
    """The persistent tier's retention beyond the newest k (``TierConfig.keep_interval_s``,
    ``keep_every_n_steps``, ``keep_period``, ``keep_steps``; :mod:`tierckpt.tiers.keep`)."""
    g.add_argument("--ckpt-plugin-persistent-keep-interval", type=_typed("--ckpt-plugin-persistent-keep-interval"),
                   default=None, metavar="SECONDS",
                   help="Also keep the first persistent step committed in each window of this many seconds "
                        "(3600: one per hour on the hour), to roll back past a loss spike (default: off).")
    g.add_argument("--ckpt-plugin-persistent-keep-every", type=_typed("--ckpt-plugin-persistent-keep-every"),
                   default=None, metavar="STEPS",
                   help="Also keep the first persistent step saved at or after each multiple of STEPS (default: off).")
    g.add_argument("--ckpt-plugin-persistent-keep-period", type=_typed("--ckpt-plugin-persistent-keep-period"),
                   default=None, metavar="STEPS",
                   help="Keep every persistent step that is a multiple of STEPS forever (Orbax's keep_period; "
                        "default: off).")
    g.add_argument("--ckpt-plugin-persistent-keep-steps", type=_typed("--ckpt-plugin-persistent-keep-steps"), nargs="+", default=None, metavar="STEP",
                   help="Persistent steps kept forever (milestones). The picks of these rules are recorded in "
                        "--save's tierckpt-retention.json and kept across restarts and option changes.")


def _retention_settings(args: argparse.Namespace) -> dict:
    """``TierConfig``'s retention keywords from the ``--ckpt-plugin-persistent-keep-*`` flags given."""
    out = {name: getattr(args, _dest(flag), None) for name, flag in (
        ("keep_interval_s", "--ckpt-plugin-persistent-keep-interval"),
        ("keep_every_n_steps", "--ckpt-plugin-persistent-keep-every"),
        ("keep_period", "--ckpt-plugin-persistent-keep-period"),
        ("keep_steps", "--ckpt-plugin-persistent-keep-steps"))}
    return {k: (tuple(v) if k == "keep_steps" else v) for k, v in out.items() if v is not None}


# -- object stores: --ckpt-plugin-storage-options ---------------------------------------------
def _json_object(text: str) -> dict:
    """argparse ``type=`` of ``--ckpt-plugin-storage-options``: a JSON object."""
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r} ({e})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def _add_storage_args(g) -> None:
    """``--ckpt-plugin-storage-options`` (``TierConfig.storage_options``)."""
    g.add_argument("--ckpt-plugin-storage-options", type=_json_object, default=None, metavar="JSON",
                   help="fsspec options of an fsspec-URL --save, as a JSON object (e.g. "
                        "'{\"endpoint_url\": \"http://s3.local:9000\"}'; URL-prefix keys such as \"s3://b/\" map to "
                        "their own object). Default: none; s3fs reads AWS_* from the environment.")


def add_plugin_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``--ckpt-plugin-*`` argument group to ``parser`` and return it.

    Usable as Megatron-LM's ``extra_args_provider``. Every flag defaults to "not given" (None),
    so :func:`validate_plugin_args` can tell an explicit value from Megatron's equivalent flag.
    Type errors (``--ckpt-plugin-local-interval 0``) are argparse errors naming the flag (exit 2).
    """
    g = parser.add_argument_group(GROUP_TITLE, "multi-tier checkpointing (tierckpt); see mcore_plugin/README.md")
    g.add_argument("--ckpt-plugin-enable", action="store_true", default=False,
                   help="Turn the plugin on: --save becomes the persistent tier, "
                        "--non-persistent-ckpt-type local the node-local tier with replicas.")
    g.add_argument("--ckpt-plugin-local-root", default=None, metavar="TEMPLATE",
                   help="Node-local directory template of the local tier, fields {job} {node} "
                        "{hostname} (e.g. /local_nvme/{job}/node-{node}). Default: "
                        "--non-persistent-local-ckpt-dir, taken as node-private.")
    g.add_argument("--ckpt-plugin-local-root-is-node-private", action="store_true", default=False,
                   help="The local root may omit {node}/{hostname}: each node's path is on its own disk.")
    _add_permissions_arg(g)
    g.add_argument("--ckpt-plugin-replication-jump", type=_typed("--ckpt-plugin-replication-jump"),
                   default=None, metavar="J",
                   help="J, counted in nodes: node n's local checkpoint is copied to nodes n+J, n+2J, ... "
                        "(default 1, or Megatron's --replication-jump divided by the ranks per node).")
    g.add_argument("--ckpt-plugin-replication-factor", type=_typed("--ckpt-plugin-replication-factor"),
                   default=None, metavar="F",
                   help="F: copies of each node's local checkpoint, own included; 1 = no replica "
                        "(default 2, or Megatron's --replication-factor with --replication).")
    g.add_argument("--ckpt-plugin-local-interval", type=_typed("--ckpt-plugin-local-interval"),
                   default=None, metavar="STEPS",
                   help="Iterations between local-tier saves (default: --non-persistent-save-interval; "
                        "neither = no local tier). The starting value when the local tier is adaptive.")
    g.add_argument("--ckpt-plugin-persistent-interval", type=_typed("--ckpt-plugin-persistent-interval"),
                   default=None, metavar="STEPS",
                   help="Iterations between persistent-tier saves (default: --save-interval). "
                        "The starting value when the persistent tier is adaptive.")
    g.add_argument("--ckpt-plugin-adaptive", nargs="+", choices=TIERS, default=None, metavar="TIER",
                   help="Tiers whose interval follows Young/Daly from the measured blocking time and "
                        f"the MTBF estimate (choices: {', '.join(TIERS)}).")
    g.add_argument("--ckpt-plugin-warn-only", nargs="+", choices=TIERS, default=None, metavar="TIER",
                   help="Tiers whose failed background save is only logged and recorded in the ledger "
                        "(default: local). A failed save of any other tier stops training at that tier's "
                        "next save or at the end of training.")
    g.add_argument("--ckpt-plugin-gpu-mtbf-hours", type=_typed("--ckpt-plugin-gpu-mtbf-hours"),
                   default=None, metavar="HOURS",
                   help="Prior MTBF of one GPU for the adaptive scheduler (default: Llama 3's).")
    g.add_argument("--ckpt-plugin-restart-prior", type=_typed("--ckpt-plugin-restart-prior"),
                   default=None, metavar="SECONDS",
                   help="Restart + restore seconds (>= 0) the adaptive scheduler assumes until it has "
                        "seen a restore (default 300).")
    g.add_argument("--ckpt-plugin-min-interval", type=_typed("--ckpt-plugin-min-interval"),
                   default=None, metavar="STEPS", help="Lower bound of adaptive intervals (default 1).")
    g.add_argument("--ckpt-plugin-max-interval", type=_typed("--ckpt-plugin-max-interval"),
                   default=None, metavar="STEPS", help="Upper bound of adaptive intervals (default: none).")
    g.add_argument("--ckpt-plugin-local-keep", type=_typed("--ckpt-plugin-local-keep"),
                   default=None, metavar="K", help="Committed local steps kept per node and per replica (default 2).")
    g.add_argument("--ckpt-plugin-local-wait-timeout",
                   type=_typed("--ckpt-plugin-local-wait-timeout"), default=None,
                   metavar="SECONDS", help="Longest a local save waits for the previous one; then that step "
                                           "skips the local tier on every rank (default 300; 0 = no limit; at most 604800).")
    _add_restore_args(g)
    _add_exit_flag(g)
    _add_background_args(g)
    _add_storage_args(g)
    g.add_argument("--ckpt-plugin-persistent-keep",
                   type=_typed("--ckpt-plugin-persistent-keep"),
                   default=None, metavar="K", help="Committed persistent steps kept (default 3).")
    _add_retention_args(g)
    g.add_argument("--ckpt-plugin-job-id", default=None, metavar="ID", help=(
        "Value of {job} in the local root; keep it stable across restarts (default: SLURM_JOB_ID, else 'job')."))
    g.add_argument("--ckpt-plugin-simulated-ranks-per-node", default=None, metavar="N",
                   type=_typed("--ckpt-plugin-simulated-ranks-per-node"),
                   help="Simulate nodes on one machine: node = rank // N (tests, demos).")
    return parser


def _add_permissions_arg(g) -> None:
    """``--ckpt-plugin-local-permissions`` (``TierConfig.local_permissions``)."""
    g.add_argument("--ckpt-plugin-local-permissions", default=None, metavar="SETTING", help=(
        "Modes of all the plugin writes under the local root, whatever the umask: private (default; directories "
        "0700, files 0600) or group (0750/0640, the group may read). --save follows the umask."))


def plugin_enabled(args: argparse.Namespace) -> bool:
    """True when ``--ckpt-plugin-enable`` was given (False when the flags were never added)."""
    return bool(getattr(args, "ckpt_plugin_enable", False))


def _plugin_flags_given(args) -> list[str]:
    given = []
    for name, value in vars(args).items():
        if name.startswith("ckpt_plugin_") and name != "ckpt_plugin_enable":
            if value is not None and value is not False:  # 0 (0 keeps all, ...) is given: 0 == False
                given.append("--" + name.replace("_", "-"))
    return given


def _ranks_per_node() -> int | None:
    for var in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        v = os.environ.get(var, "")
        if v.isdigit() and int(v) > 0:
            return int(v)
    return None


@dataclass
class PluginSettings:
    """What :func:`validate_plugin_args` decided; :func:`settings_of` returns it for ``args``.

    Not stored on ``args`` itself: Megatron saves ``args`` in every checkpoint and reads
    ``common.pt`` back with ``torch.load(weights_only=True)``, which refuses unknown classes.

    Attributes:
        tiers: tiers the plugin writes (``"persistent"`` always; ``"local"`` when a local
            interval exists).
        intervals: ``{tier: steps}``, the fixed interval or the adaptive starting value.
        adaptive: tiers with Young/Daly intervals.
        local_root, local_root_is_node_private: the local-tier template.
        replication_jump, replication_factor: J (nodes) and F.
        keep_latest_k: ``{tier: k}`` (0 keeps all).
        schedule_options: :class:`~tierckpt.ScheduleOptions` keywords (``gpu_mtbf_s`` seconds,
            ``restart_prior_s`` seconds, ``min_steps``, ``max_steps``);
            :func:`tier_config_from_args` builds the options from them.
        notes: human-readable lines about values taken over from Megatron's flags.
        local_wait_timeout_s: seconds a local save waits for the previous one (None = the
            engine's default, 0 = no limit).
        exit_timeout_s: seconds the exit waits for running saves without finalize (None =
            the engine's default; ``TierConfig.exit_timeout_s``).
        warn_only: tiers whose failed saves only warn (``TierConfig.warn_only``).
        busy_tier_policy: ``"defer"`` or ``"wait"`` (``TierConfig.busy_tier_policy``; None =
            the engine's default, defer).
        cpu_staging: ``"blocking"`` or ``"overlapped"`` (``TierConfig.cpu_staging``; None = the
            engine's default, blocking).
        local_permissions: ``"private"`` or ``"group"`` (``TierConfig.local_permissions``; None =
            the engine's default, private).
        restore_read_timeout_s: ``TierConfig.restore_read_timeout_s`` (seconds; None = the
            engine's default).
        background_nice, background_io_class: ``TierConfig``'s fields of those names (None = the
            engine's defaults, 10 and ``"best-effort"``).
        retention: ``TierConfig``'s ``keep_interval_s``, ``keep_every_n_steps``, ``keep_period``
            and ``keep_steps`` keywords, those given (``--ckpt-plugin-persistent-keep-*``).
    """

    tiers: tuple[str, ...]
    intervals: dict[str, int]
    adaptive: tuple[str, ...] = ()
    local_root: str | None = None
    local_root_is_node_private: bool = False
    replication_jump: int = 1
    replication_factor: int = 2
    keep_latest_k: dict[str, int] = field(default_factory=dict)
    job_id: str | None = None
    simulated_ranks_per_node: int = 0
    schedule_options: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    local_wait_timeout_s: float | None = None
    exit_timeout_s: float | None = None
    warn_only: tuple[str, ...] = ("local",)
    busy_tier_policy: str | None = None
    cpu_staging: str | None = None
    local_permissions: str | None = None
    restore_read_timeout_s: float | None = None
    background_nice: int | None = None
    background_io_class: str | None = None
    retention: dict = field(default_factory=dict)


# id(args) -> (weak reference to args, settings); Namespace is not hashable (it defines __eq__)
_SETTINGS: dict[int, tuple[weakref.ref, "PluginSettings"]] = {}


def settings_of(args: argparse.Namespace) -> PluginSettings | None:
    """The :class:`PluginSettings` :func:`validate_plugin_args` made for ``args`` (None with
    the plugin off or before validation)."""
    entry = _SETTINGS.get(id(args))
    return entry[1] if entry is not None and entry[0]() is args else None


def _set_settings(args: argparse.Namespace, settings: PluginSettings | None) -> None:
    for k in [k for k, (ref, _) in _SETTINGS.items() if ref() is None]:
        del _SETTINGS[k]
    if settings is None:
        _SETTINGS.pop(id(args), None)
    else:
        _SETTINGS[id(args)] = (weakref.ref(args), settings)


def _megatron_flag(dest: str) -> str:
    return _MEGATRON_FLAG.get(dest, "--" + dest.replace("_", "-"))


def _agree(args, plugin_dest: str, megatron_dest: str, what: str):
    """The plugin flag's value, else Megatron's; both given and different is an error."""
    mine = getattr(args, plugin_dest, None)
    theirs = getattr(args, megatron_dest, None)
    if mine is not None and theirs not in (None, 0) and mine != theirs:
        raise ConfigError(
            "--" + plugin_dest.replace("_", "-"),
            f"{mine} contradicts {_megatron_flag(megatron_dest)} {theirs} ({what}); give one of them, "
            "or the same value to both",
        )
    return mine if mine is not None else (theirs or None)


def _add_restore_args(g) -> None:
    """The flags of the restore (argument group ``g`` of :func:`add_plugin_args`)."""
    g.add_argument("--ckpt-plugin-restore-read-timeout",
                   type=_typed("--ckpt-plugin-restore-read-timeout"), default=None,
                   metavar="SECONDS", help="Longest a restore waits for a read of a source that makes no progress "
                                           "(a hung disk); that source then counts as failed and the restore "
                                           "falls back to the next one (default min(60, collective timeout / 3)).")


def validate_plugin_args(args: argparse.Namespace) -> PluginSettings | None:
    """Check the plugin flags and their combination with Megatron's own; adjust ``args``.

    Runs after Megatron's ``validate_args`` (so ``use_dist_ckpt`` etc. are derived), before any
    process group exists. With the plugin off, any other ``--ckpt-plugin-*`` flag is an error
    (it would be silently ignored). With it on, the following are required or refused (each
    error names the flag):

    - ``--save`` (the persistent tier's root and the ledger's home) is required;
    - ``--ckpt-format`` must be ``torch_dist`` (the format the strategy wrappers serve);
    - ``--non-persistent-ckpt-type global`` is refused (it bypasses the tiers); ``local`` is
      served by the plugin's local tier;
    - per-tier intervals >= 1; a plugin interval contradicting Megatron's equivalent flag;
      an adaptive tier without a starting interval; ``--ckpt-plugin-min-interval`` >
      ``--ckpt-plugin-max-interval``; min/max/MTBF flags without an adaptive tier;
    - a local tier without a root (``--ckpt-plugin-local-root`` or
      ``--non-persistent-local-ckpt-dir``); local flags (root, keep, replication) without a
      local tier;
    - Megatron's ``--replication-jump`` (counted in ranks) that is not a whole number of nodes;
    - ``--async-save`` together with a local tier: Megatron-LM's local path then expects an
      async request from the local manager, which the plugin does not hand out (its local
      tier already writes in the background after the staging copy);
    - every bound of the engine's config (template fields, keep values, wait timeout, scheduler
      options): :func:`tier_config_from_args` builds it here, as it does at start-up.

    Side effects on ``args`` (so Megatron's own loop calls the plugin at the right iterations):
    ``save_interval`` and ``non_persistent_save_interval`` get the tier intervals,
    ``non_persistent_ckpt_type`` becomes ``"local"`` when the local tier is on, ``load``
    defaults to ``save``; :func:`settings_of` returns the :class:`PluginSettings` for ``args``.

    Returns:
        The settings, or None with the plugin off.

    Raises:
        ConfigError: ``option`` is the offending flag; the message gives the allowed values.
    """
    if not plugin_enabled(args):
        stray = _plugin_flags_given(args)
        if stray:
            raise ConfigError(stray[0], "has no effect without --ckpt-plugin-enable; add --ckpt-plugin-enable "
                                        f"or drop {', '.join(stray)}")
        _set_settings(args, None)
        return None

    _check_flag_values(args)
    _check_megatron_flags(args)
    notes: list[str] = []
    tiers, intervals, adaptive = _tier_intervals(args)
    schedule = _schedule_options(args, adaptive)
    J, F = _replication(args, notes)
    local_root, node_private = _local_tier(args, tiers, intervals, J, F, notes)
    # nvrx's replication is not used with the plugin: our local tier replicates by node.
    if hasattr(args, "replication"):
        args.replication = False

    keep = {t: k for t, k in (("local", args.ckpt_plugin_local_keep), ("persistent", args.ckpt_plugin_persistent_keep))
            if k is not None}

    args.save_interval = intervals["persistent"]
    if not getattr(args, "load", None):
        args.load = args.save
        notes.append("--load defaults to --save (restarts resume from the tiers)")

    settings = PluginSettings(
        tiers=tiers, intervals=intervals, adaptive=adaptive, local_root=local_root,
        local_root_is_node_private=node_private, replication_jump=int(J or 1),
        replication_factor=int(F or 2) if "local" in tiers else 1, keep_latest_k=keep,
        job_id=args.ckpt_plugin_job_id, simulated_ranks_per_node=int(args.ckpt_plugin_simulated_ranks_per_node or 0),
        schedule_options=schedule, notes=notes,
        local_wait_timeout_s=args.ckpt_plugin_local_wait_timeout, exit_timeout_s=args.ckpt_plugin_exit_timeout,
        warn_only=tuple(getattr(args, "ckpt_plugin_warn_only", None) or ("local",)),
        busy_tier_policy=getattr(args, "ckpt_plugin_busy_tier_policy", None),
        cpu_staging=getattr(args, "ckpt_plugin_cpu_staging", None), local_permissions=args.ckpt_plugin_local_permissions,
        restore_read_timeout_s=getattr(args, "ckpt_plugin_restore_read_timeout", None) or None,
        background_nice=getattr(args, "ckpt_plugin_background_nice", None),
        background_io_class=getattr(args, "ckpt_plugin_background_io_class", None), retention=_retention_settings(args),
    )
    tier_config_from_args(args, settings)  # the engine's own bounds, with the flag names users typed
    _set_settings(args, settings)
    return settings


def _check_megatron_flags(args: argparse.Namespace) -> None:
    """Megatron flags the plugin needs or cannot serve (see :func:`validate_plugin_args`)."""
    if not getattr(args, "save", None):
        raise ConfigError("--save", "the plugin needs --save: it is the persistent tier's directory and holds "
                                    "the ledger (a shared filesystem path or fsspec URL)")
    fmt = getattr(args, "ckpt_format", "torch_dist")
    if fmt != "torch_dist":
        raise ConfigError("--ckpt-format", f"the plugin serves the torch_dist format only, got {fmt!r}; "
                                           "use --ckpt-format torch_dist")
    if getattr(args, "use_dist_ckpt", True) is False:
        raise ConfigError("--ckpt-format", "the plugin needs distributed checkpoints (--ckpt-format torch_dist)")
    np_type = getattr(args, "non_persistent_ckpt_type", None)
    if np_type not in (None, "local"):
        raise ConfigError("--non-persistent-ckpt-type",
                          f"{np_type!r} bypasses the tiers; with --ckpt-plugin-enable use 'local' (served by the "
                          "plugin's local tier) or leave it unset")
    if getattr(args, "non_persistent_global_ckpt_dir", None):
        raise ConfigError("--non-persistent-global-ckpt-dir",
                          "global non-persistent checkpoints are not used with --ckpt-plugin-enable; "
                          "the local tier (--ckpt-plugin-local-interval) replaces them")

    if getattr(args, "async_save", False) and (
            np_type == "local" or getattr(args, "ckpt_plugin_local_interval", None)
            or getattr(args, "ckpt_plugin_local_root", None)):
        raise ConfigError("--async-save", "is not supported together with the plugin's local tier (its saves "
                                          "already run in the background after the staging copy); drop "
                                          "--async-save, or drop the local tier (--ckpt-plugin-local-interval, "
                                          "--ckpt-plugin-local-root, --non-persistent-ckpt-type local)")


def _tier_intervals(args: argparse.Namespace) -> tuple[tuple[str, ...], dict[str, int], tuple[str, ...]]:
    """(tiers, ``{tier: steps}``, adaptive tiers) from the plugin's and Megatron's interval flags."""
    # Megatron's --non-persistent-save-interval only counts with type local.
    np_type = getattr(args, "non_persistent_ckpt_type", None)
    np_interval = getattr(args, "non_persistent_save_interval", None) if np_type == "local" else None
    if np_type is None and getattr(args, "non_persistent_save_interval", None) and \
            getattr(args, "ckpt_plugin_local_interval", None) is None:
        raise ConfigError("--non-persistent-save-interval",
                          "needs --non-persistent-ckpt-type local (or use --ckpt-plugin-local-interval)")
    shadow = argparse.Namespace(ckpt_plugin_local_interval=args.ckpt_plugin_local_interval,
                                non_persistent_save_interval=np_interval,
                                ckpt_plugin_persistent_interval=args.ckpt_plugin_persistent_interval,
                                save_interval=getattr(args, "save_interval", None))
    local_iv = _agree(shadow, "ckpt_plugin_local_interval", "non_persistent_save_interval", "local-tier interval")
    pers_iv = _agree(shadow, "ckpt_plugin_persistent_interval", "save_interval", "persistent-tier interval")
    for flag, v in (("--save-interval", getattr(args, "save_interval", None)),
                    ("--non-persistent-save-interval", np_interval)):
        if v is not None and v < 1:
            raise ConfigError(flag, f"must be an integer >= 1 with --ckpt-plugin-enable, got {v}")
    adaptive = tuple(args.ckpt_plugin_adaptive or ())
    if len(set(adaptive)) != len(adaptive):
        raise ConfigError("--ckpt-plugin-adaptive", f"a tier is listed twice in {list(adaptive)}")
    if pers_iv is None:
        raise ConfigError("--save-interval", "the persistent tier needs an interval: --save-interval N or "
                                             "--ckpt-plugin-persistent-interval N (N >= 1; the starting value "
                                             "when the tier is adaptive)")
    if "local" in adaptive and local_iv is None:
        raise ConfigError("--ckpt-plugin-adaptive", "the adaptive local tier needs a starting interval: "
                                                    "--ckpt-plugin-local-interval N (N >= 1)")
    intervals = {"persistent": int(pers_iv)}
    tiers: tuple[str, ...] = ("persistent",)
    if local_iv is not None:
        intervals["local"] = int(local_iv)
        tiers = ("local", "persistent")
    return tiers, intervals, adaptive


def _schedule_options(args: argparse.Namespace, adaptive: tuple[str, ...]) -> dict:
    """:class:`~tierckpt.ScheduleOptions` keywords from the adaptive-scheduler flags (which
    need an adaptive tier)."""
    lo, hi = args.ckpt_plugin_min_interval, args.ckpt_plugin_max_interval
    if lo is not None and hi is not None and lo > hi:
        raise ConfigError("--ckpt-plugin-min-interval",
                          f"{lo} is above --ckpt-plugin-max-interval {hi}; need min <= max")
    if not adaptive:
        for flag, v in (("--ckpt-plugin-min-interval", lo), ("--ckpt-plugin-max-interval", hi),
                        ("--ckpt-plugin-gpu-mtbf-hours", args.ckpt_plugin_gpu_mtbf_hours),
                        ("--ckpt-plugin-restart-prior", args.ckpt_plugin_restart_prior)):
            if v is not None:
                raise ConfigError(flag, "only applies to adaptive tiers; add --ckpt-plugin-adaptive "
                                        f"{{{','.join(TIERS)}}} or drop {flag}")
    schedule: dict = {}
    if lo is not None:
        schedule["min_steps"] = int(lo)
    if hi is not None:
        schedule["max_steps"] = int(hi)
    if args.ckpt_plugin_gpu_mtbf_hours is not None:
        schedule["gpu_mtbf_s"] = float(args.ckpt_plugin_gpu_mtbf_hours) * 3600.0
    if args.ckpt_plugin_restart_prior is not None:
        schedule["restart_prior_s"] = float(args.ckpt_plugin_restart_prior)
    return schedule


def _replication(args: argparse.Namespace, notes: list[str]) -> tuple[int | None, int | None]:
    """(J in nodes, F) from the plugin flags, else from Megatron's ``--replication`` flags
    (None: not given)."""
    J, F = args.ckpt_plugin_replication_jump, args.ckpt_plugin_replication_factor
    if getattr(args, "replication", False):
        if F is not None and F != args.replication_factor:
            raise ConfigError("--ckpt-plugin-replication-factor",
                              f"{F} contradicts --replication-factor {args.replication_factor}; give one of them")
        F = args.replication_factor
        rj = getattr(args, "replication_jump", None)
        if J is None and rj is not None:
            rpn = _ranks_per_node()
            if rpn is None or rj % rpn:
                raise ConfigError("--replication-jump",
                                  f"Megatron counts it in ranks ({rj}); the plugin counts nodes and cannot convert "
                                  f"it ({'ranks per node unknown' if rpn is None else f'{rpn} ranks per node'}): "
                                  "give --ckpt-plugin-replication-jump J (nodes) instead")
            J = rj // rpn
            notes.append(f"--replication-jump {rj} ranks = {J} node(s) ({rpn} ranks per node)")
    return J, F


def _local_tier(args: argparse.Namespace, tiers: tuple[str, ...], intervals: dict[str, int],
                J: int | None, F: int | None, notes: list[str]) -> tuple[str | None, bool]:
    """(local root template, node-private) of the local tier; points Megatron's local path at
    it. Without a local tier, its flags are refused."""
    local_root, node_private = args.ckpt_plugin_local_root, bool(args.ckpt_plugin_local_root_is_node_private)
    if "local" not in tiers:
        for flag, v in (("--ckpt-plugin-local-root", local_root),
                        ("--ckpt-plugin-local-keep", args.ckpt_plugin_local_keep),
                        ("--ckpt-plugin-local-wait-timeout", args.ckpt_plugin_local_wait_timeout),
                        ("--ckpt-plugin-local-permissions", getattr(args, "ckpt_plugin_local_permissions", None)),
                        ("--ckpt-plugin-replication-jump", J), ("--ckpt-plugin-replication-factor", F)):
            if v is not None:
                raise ConfigError(flag, "needs the local tier: add --ckpt-plugin-local-interval N "
                                        "(or --non-persistent-ckpt-type local --non-persistent-save-interval N)")
        return local_root, node_private
    if getattr(args, "dist_ckpt_optim_fully_reshardable", False):
        raise ConfigError("--dist-ckpt-optim-fully-reshardable",
                          "not with the plugin's local tier: Megatron's local path refuses that format, and the "
                          "plugin already writes the persistent tier fully_reshardable; drop the flag")
    if local_root is None:
        mdir = getattr(args, "non_persistent_local_ckpt_dir", None)
        if not mdir:
            raise ConfigError("--ckpt-plugin-local-root",
                              "the local tier needs a node-local directory: --ckpt-plugin-local-root TEMPLATE "
                              "(fields {job} {node} {hostname}) or --non-persistent-local-ckpt-dir DIR")
        local_root = mdir
        if "{" not in mdir:
            node_private = True
        notes.append(f"local root from --non-persistent-local-ckpt-dir: {mdir}")
    args.non_persistent_ckpt_type = "local"
    args.non_persistent_save_interval = intervals["local"]
    if not getattr(args, "non_persistent_local_ckpt_dir", None):
        # Megatron's local path prints this directory; point it at the template.
        args.non_persistent_local_ckpt_dir = local_root
    return local_root, node_private


# TierConfig / ScheduleOptions field -> the flag that sets it. A mapping entry
# ("keep_latest_k.local") is looked up first, then its field ("keep_latest_k").
_FIELD_TO_FLAG = {
    "local_root": "--ckpt-plugin-local-root",
    "persistent_root": "--save",
    "replication_jump": "--ckpt-plugin-replication-jump",
    "replication_factor": "--ckpt-plugin-replication-factor",
    "keep_latest_k.local": "--ckpt-plugin-local-keep",
    "keep_latest_k.persistent": "--ckpt-plugin-persistent-keep",
    "intervals.persistent": "--save-interval",
    "intervals": "--ckpt-plugin-local-interval",
    "adaptive": "--ckpt-plugin-adaptive",
    "job_id": "--ckpt-plugin-job-id",
    "simulated_ranks_per_node": "--ckpt-plugin-simulated-ranks-per-node",
    "local_wait_timeout_s": "--ckpt-plugin-local-wait-timeout",
    "exit_timeout_s": "--ckpt-plugin-exit-timeout",
    "warn_only": "--ckpt-plugin-warn-only",
    "busy_tier_policy": "--ckpt-plugin-busy-tier-policy",
    "cpu_staging": "--ckpt-plugin-cpu-staging",
    "local_permissions": "--ckpt-plugin-local-permissions",
    "restore_read_timeout_s": "--ckpt-plugin-restore-read-timeout",
    "background_nice": "--ckpt-plugin-background-nice",
    "background_io_class": "--ckpt-plugin-background-io-class",
    "keep_interval_s": "--ckpt-plugin-persistent-keep-interval",
    "keep_every_n_steps": "--ckpt-plugin-persistent-keep-every",
    "keep_period": "--ckpt-plugin-persistent-keep-period",
    "keep_steps": "--ckpt-plugin-persistent-keep-steps",
    "storage_options": "--ckpt-plugin-storage-options",
    "min_steps": "--ckpt-plugin-min-interval",
    "max_steps": "--ckpt-plugin-max-interval",
    "gpu_mtbf_s": "--ckpt-plugin-gpu-mtbf-hours",
    "restart_prior_s": "--ckpt-plugin-restart-prior",
}


def _flag_error(e: ConfigError) -> ConfigError:
    """``e`` (naming a TierConfig/ScheduleOptions field) renamed to the flag that sets it."""
    field_name = e.option
    # a mapping entry ("keep_latest_k.local") or a list item ("keep_steps[0]") falls back to its field
    flag = _FIELD_TO_FLAG.get(field_name, _FIELD_TO_FLAG.get(field_name.split(".")[0].split("[")[0], field_name))
    return ConfigError(flag, str(e).removeprefix(f"{field_name}: "))


def tier_config_from_args(args: argparse.Namespace, settings: PluginSettings | None = None) -> TierConfig:
    """The engine's :class:`~tierckpt.TierConfig` for ``args``: the one function that builds it.

    :func:`validate_plugin_args` calls it with the settings it has just decided (so a bad value
    fails before any process group exists); ``mcore_plugin.install`` calls it at start-up with
    the settings :func:`validate_plugin_args` stored for ``args``.

    Args:
        args: Megatron's parsed arguments (``--save`` is the persistent root).
        settings: the decided flags; None = :func:`settings_of` ``args``.

    Raises:
        ConfigError: ``option`` is the flag that sets the bad value (``--ckpt-plugin-local-root``,
            ``--ckpt-plugin-local-wait-timeout``, ...), with the allowed values.
        RuntimeError: the plugin is off or the args were not validated.
    """
    settings = settings_of(args) if settings is None else settings
    if settings is None:
        raise RuntimeError("tier_config_from_args: the plugin is off or validate_plugin_args has not run")
    extra: dict = {} if settings.local_wait_timeout_s is None else {"local_wait_timeout_s": settings.local_wait_timeout_s}
    if settings.exit_timeout_s is not None:
        extra["exit_timeout_s"] = settings.exit_timeout_s
    if settings.busy_tier_policy is not None:
        extra["busy_tier_policy"] = settings.busy_tier_policy
    if settings.cpu_staging is not None:
        extra["cpu_staging"] = settings.cpu_staging
    if settings.local_permissions is not None:
        extra["local_permissions"] = settings.local_permissions
    if settings.restore_read_timeout_s is not None:
        extra["restore_read_timeout_s"] = settings.restore_read_timeout_s
    for name in ("background_nice", "background_io_class"):
        if getattr(settings, name) is not None:
            extra[name] = getattr(settings, name)
    extra.update(settings.retention)
    if getattr(args, "ckpt_plugin_storage_options", None):  # object stores
        extra["storage_options"] = args.ckpt_plugin_storage_options
    try:
        return TierConfig(
            **extra,
            local_root=settings.local_root,
            persistent_root=args.save,
            tiers=settings.tiers,
            replication_jump=settings.replication_jump,
            replication_factor=settings.replication_factor,
            keep_latest_k=settings.keep_latest_k,  # tiers left out keep the engine's defaults
            job_id=settings.job_id,
            local_root_is_node_private=settings.local_root_is_node_private,
            simulated_ranks_per_node=settings.simulated_ranks_per_node,
            intervals=settings.intervals,
            adaptive=settings.adaptive,
            schedule=ScheduleOptions(**settings.schedule_options),
            warn_only=settings.warn_only,
        )
    except ConfigError as e:
        raise _flag_error(e) from None


def read_args_file(path: str) -> list[str]:
    """Arguments of an argument file such as ``configs/mcore_gpt_nvme.args``.

    Format: shell words (``shlex``), any number per line; ``#`` starts a comment that runs
    to the end of the line; blank lines are ignored. ``{job}``-style templates are kept as is.

    Raises:
        OSError: the file cannot be read.
        ValueError: unbalanced quotes (the message names the file and line).
    """
    import shlex

    out: list[str] = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            try:
                out.extend(shlex.split(line, comments=True))
            except ValueError as e:
                raise ValueError(f"{path}:{n}: {e}") from None
    return out


def expand_args_files(argv: list[str]) -> list[str]:
    """Replace every ``@FILE`` in ``argv`` by :func:`read_args_file` of it (not recursive).

    Raises:
        ConfigError: ``@FILE`` does not exist (option ``@FILE``).
    """
    out: list[str] = []
    for a in argv:
        if a.startswith("@") and len(a) > 1:
            path = a[1:]
            if not os.path.isfile(path):
                raise ConfigError(a, f"argument file {path!r} not found")
            out.extend(read_args_file(path))
        else:
            out.append(a)
    return out
