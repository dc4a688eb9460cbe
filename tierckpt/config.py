"""User-facing configuration of the tiered checkpoint engine.

:class:`TierConfig` and its :class:`ScheduleOptions` are frozen dataclasses, validated and
normalised in ``__post_init__``: building one raises :class:`ConfigError` naming the field and
the values it accepts, so every rank rejects a bad config the same way before the engine runs
any collective. ``dataclasses.replace`` (:meth:`TierConfig.replace`) validates the copy again.
Mapping fields are :class:`FrozenDict`, so a config cannot be changed through them either.
Every numeric field has one rule (:data:`RULES`, :data:`SCHEDULE_RULES`, built from
:mod:`tierckpt.validators`), which the torchtitan and Megatron front ends apply to the keys and
flags that set it.
Topology-dependent checks (``replication_factor`` against the node count) run when the
topology is known, in :mod:`tierckpt.cluster.topology`.
"""

from __future__ import annotations

import dataclasses
import os
import string
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tierckpt.errors import ConfigError
from tierckpt.io.perms import modes_of
from tierckpt.preemption import signal_numbers
from tierckpt.priority import IO_CLASSES, BackgroundPriority
from tierckpt.priors import DEFAULT_GPU_MTBF_S, DEFAULT_WEIGHT
from tierckpt.validators import (Number, boolean, choice, fraction, non_negative_int, non_negative_seconds, optional,
                                 positive_int, positive_number, positive_seconds)

TIERS = ("local", "persistent")
"""Tiers a save can target. Replication is part of the local tier (F>1), not a tier of its own."""

CPU_STAGING_MODES = ("blocking", "overlapped")
"""Values of ``TierConfig.cpu_staging``: how ``save()`` copies a state's CPU tensors."""

BUSY_TIER_POLICIES = ("defer", "wait")
"""Values of ``TierConfig.busy_tier_policy``: what a save does with a tier whose previous save
still runs."""

MAX_WAIT_S = 7 * 86400.0
"""Upper bound of every wait option, seconds (a week; threading.TIMEOUT_MAX and timedelta's range are
far above, so a valid wait never overflows)."""
DEFAULT_KEEP_LATEST_K = {"local": 2, "persistent": 3}
TEMPLATE_FIELDS = ("job", "node", "hostname")

DEFAULT_RESTART_PRIOR_S = 300.0
"""R assumed until a restart is observed, seconds (relaunch + restore)."""
DEFAULT_PERSISTENT_SHARE = 0.1
"""Prior share p of failures that only the persistent tier can serve."""
DEFAULT_PERSISTENT_SHARE_WEIGHT = 10.0
"""Strength of that prior, in pseudo-restores (Beta(1, 9) with the defaults)."""
DEFAULT_EMA_ALPHA = 0.3
"""Weight of the newest sample in the moving averages of δ, C and the step time."""

STEPS = positive_int(unit="steps")
SECONDS = non_negative_seconds()

RULES: dict[str, Number] = {
    "replication_jump": positive_int(),
    "replication_factor": positive_int(),
    "keep_latest_k": non_negative_int(note="0 keeps all"),  # per tier
    # -- retention beyond the newest k: the persistent tier's (tierckpt/tiers/keep.py) --
    "keep_interval_s": optional(positive_seconds(), "off"),
    "keep_every_n_steps": optional(positive_int(unit="steps"), "off"),
    "keep_period": optional(positive_int(unit="steps"), "off"),
    "keep_steps": non_negative_int(unit="steps"),  # each listed step
    # -- end of retention rules --
    "transfer_chunk_bytes": Number(integer=True, min=4096, unit="bytes", multiple_of=4096,
                                   note="O_DIRECT alignment"),
    "restore_memory_bytes": non_negative_int(unit="bytes", note="0 = restore from disk"),
    "staging_buffers": positive_int(),
    "collective_timeout_s": positive_seconds(max=MAX_WAIT_S),
    # at most collective_timeout_s / 2, applied with that value (TierConfig docs)
    "restore_read_timeout_s": optional(positive_seconds(), "min(60, collective_timeout_s / 3)"),
    "local_wait_timeout_s": non_negative_seconds(max=MAX_WAIT_S, note="0 = wait without limit"),
    "exit_timeout_s": non_negative_seconds(max=MAX_WAIT_S, note="0 = do not wait"),
    "simulated_ranks_per_node": non_negative_int(note="0 = real topology"),
    "intervals": STEPS,  # per tier
    "preemption_grace_s": positive_seconds(max=MAX_WAIT_S),
    "background_nice": Number(integer=True, min=0, max=19, note="0 = the trainer's priority"),
}
"""The rule of every numeric :class:`TierConfig` field (:mod:`tierckpt.validators`): the one
place its bound is written. The adapters check the TOML keys and ``--ckpt-plugin-*`` flags that
set these fields with the same rules."""

SCHEDULE_RULES: dict[str, Number] = {
    "gpu_mtbf_s": positive_seconds(),
    "mtbf_weight": positive_number(unit="pseudo-failures"),
    "restart_prior_s": SECONDS,
    "delta_prior_s": SECONDS,  # per tier
    "persistent_share": fraction(),
    "persistent_share_weight": positive_number(unit="pseudo-restores"),
    "ema_alpha": fraction(),
    "min_s": SECONDS, "max_s": SECONDS,  # per tier
    "min_steps": STEPS, "max_steps": STEPS,  # per tier
}
"""The rule of every numeric :class:`ScheduleOptions` field, as :data:`RULES`."""


def validate_tiers(tiers, option: str = "tiers") -> tuple[str, ...]:
    """Return ``tiers`` as a tuple after checking every name is one of :data:`TIERS`.

    Raises:
        ConfigError: an unknown tier name, or an empty selection.
    """
    if isinstance(tiers, str):
        tiers = (tiers,)
    out = tuple(tiers)
    for t in out:
        if t not in TIERS:
            raise ConfigError(option, f"unknown tier {t!r}; allowed: {', '.join(TIERS)}")
    if len(set(out)) != len(out):
        raise ConfigError(option, f"tier listed twice in {list(out)}")
    return out


class FrozenDict(dict):
    """A ``dict`` that refuses changes: the mapping fields of the frozen configs.

    Still a dict (JSON-serialisable, equal to a plain dict with the same items), picklable,
    and hashable when its values are.

    Raises:
        TypeError: on any mutation (``d[k] = v``, ``update``, ``pop``, ...).
    """

    def _refuse(self, *args, **kw):
        raise TypeError("a frozen config's mapping is read-only; build a new config "
                        "(dataclasses.replace / TierConfig.replace)")

    __setitem__ = __delitem__ = __ior__ = clear = pop = popitem = setdefault = update = _refuse

    def __hash__(self) -> int:  # type: ignore[override]  # read-only, so hashable unlike dict
        return hash(frozenset(self.items()))

    def __reduce__(self):
        # pickle and copy would otherwise refill the new object through the refused __setitem__
        return type(self), (dict(self),)


class _KnownFields:
    """An unknown keyword is a :class:`ConfigError` naming it and the allowed names, not a
    ``TypeError``: a typo in a config read from a file fails like any other bad value."""

    _prefix = ""
    _what = "field"

    def __new__(cls, *args, **kw):
        allowed = [f.name for f in dataclasses.fields(cls) if f.init]
        for name in kw:
            if name not in allowed:
                raise ConfigError(f"{cls._prefix}{name}", f"unknown {cls._what}; allowed: {', '.join(allowed)}")
        return super().__new__(cls)


def per_tier(value, option: str, *, integer: bool | None = None, rule: Number | None = None):
    """Check a per-tier value: None (unset), one value for every tier, or ``{tier: value}``.

    Values follow ``rule``; without one, steps (``integer``: integers >= 1) or seconds (finite
    numbers >= 0, returned as float).

    Returns:
        None, the single value, or a :class:`FrozenDict` ``{tier: value}`` without the tiers
        mapped to None.

    Raises:
        ConfigError: naming ``option`` (``option.tier`` for a value of the mapping form), for a
            tier not in :data:`TIERS` or a value out of range.
    """
    check = rule or (STEPS if integer else SECONDS)
    if value is None:
        return None
    if not isinstance(value, Mapping):
        return check(value, option)
    out = {}
    for tier, v in value.items():
        if tier not in TIERS:
            raise ConfigError(option, f"unknown tier {tier!r}; allowed: {', '.join(TIERS)}")
        if v is not None:
            out[tier] = check(v, f"{option}.{tier}")
    return FrozenDict(out)


def expand_per_tier(value, tiers: tuple[str, ...]) -> dict:
    """A :func:`per_tier` result as ``{tier: value}``; a single value applies to every tier of ``tiers``."""
    if value is None:
        return {}
    if isinstance(value, Mapping):
        return dict(value)
    return {t: value for t in tiers}


@dataclass(frozen=True, kw_only=True)
class ScheduleOptions(_KnownFields):
    """Options of the adaptive interval scheduler (:class:`tierckpt.sched.schedule.Scheduler`).

    Per-tier options (``delta_prior_s``, ``min_s``, ``max_s``, ``min_steps``, ``max_steps``)
    take one value for every scheduled tier or a ``{tier: value}`` mapping over :data:`TIERS`
    (a tier left out, or mapped to None, has no bound / keeps the default); see
    :func:`per_tier` for the normalised form.

    Attributes:
        gpu_mtbf_s: prior MTBF of one GPU (one rank on CPU), seconds, > 0; the job's prior is
            this over the GPU count (default: Llama 3's, :data:`tierckpt.priors.DEFAULT_GPU_MTBF_S`).
        mtbf_weight: strength of that prior, pseudo-failures, > 0.
        restart_prior_s: restart time R assumed until one is observed, seconds, >= 0.
        delta_prior_s: blocking time δ per tier until one is measured, seconds, >= 0 (None:
            :data:`tierckpt.sched.schedule.DEFAULT_DELTA_PRIOR_S`).
        persistent_share: prior mean of the share p of failures only the persistent tier can
            serve, in (0, 1].
        persistent_share_weight: strength of that prior, pseudo-restores, > 0.
        ema_alpha: weight of the newest sample in the moving averages, in (0, 1].
        min_s, max_s: bounds on the interval, seconds >= 0 (``min_s`` <= ``max_s`` per tier).
        min_steps, max_steps: bounds on the interval, steps >= 1 (``min_steps`` <= ``max_steps``).
        interference: count the slowdown of steps overlapping a tier's background work in its
            δ; False = blocking time only.

    Raises:
        ConfigError: naming the option (``min_s.local`` for a value of the mapping form) and its
            allowed values; an unknown option name as ``schedule.<name>``, with the allowed names.
    """

    _prefix = "schedule."
    _what = "scheduler option"

    gpu_mtbf_s: float = DEFAULT_GPU_MTBF_S
    mtbf_weight: float = DEFAULT_WEIGHT
    restart_prior_s: float = DEFAULT_RESTART_PRIOR_S
    delta_prior_s: float | Mapping[str, float] | None = None
    persistent_share: float = DEFAULT_PERSISTENT_SHARE
    persistent_share_weight: float = DEFAULT_PERSISTENT_SHARE_WEIGHT
    ema_alpha: float = DEFAULT_EMA_ALPHA
    min_s: float | Mapping[str, float] | None = None
    max_s: float | Mapping[str, float] | None = None
    min_steps: int | Mapping[str, int] | None = None
    max_steps: int | Mapping[str, int] | None = None
    interference: bool = True

    def __post_init__(self) -> None:
        def put(name, value):
            object.__setattr__(self, name, value)

        for name in ("gpu_mtbf_s", "mtbf_weight", "restart_prior_s", "persistent_share", "persistent_share_weight",
                     "ema_alpha"):
            put(name, SCHEDULE_RULES[name](getattr(self, name), name))
        put("delta_prior_s", per_tier(self.delta_prior_s, "delta_prior_s", rule=SCHEDULE_RULES["delta_prior_s"]))
        for lo_name, hi_name in (("min_s", "max_s"), ("min_steps", "max_steps")):
            put(lo_name, per_tier(getattr(self, lo_name), lo_name, rule=SCHEDULE_RULES[lo_name]))
            put(hi_name, per_tier(getattr(self, hi_name), hi_name, rule=SCHEDULE_RULES[hi_name]))
            lo, hi = expand_per_tier(getattr(self, lo_name), TIERS), expand_per_tier(getattr(self, hi_name), TIERS)
            for t in TIERS:
                if t in lo and t in hi and lo[t] > hi[t]:
                    raise ConfigError(lo_name, f"{lo_name} ({lo[t]}) of tier {t!r} exceeds {hi_name} ({hi[t]}); "
                                      f"allowed: {lo_name} <= {hi_name}")
        boolean(self.interference, "interference")


@dataclass(frozen=True)
class TierConfig(_KnownFields):
    """Configuration of a :class:`tierckpt.engine.TieredCheckpointer` (frozen; validated when built).

    Attributes:
        local_root: template of each node's local-tier directory, e.g.
            ``/local_nvme/{job}/node-{node}``. Fields: ``{job}`` (``job_id``), ``{node}`` (node id,
            0..nodes-1), ``{hostname}``. Must contain ``{node}`` unless nodes are real hosts
            with private disks (``local_root_is_node_private=True``).
        persistent_root: shared directory or fsspec URL (``s3://bucket/run``) of the persistent
            tier; also holds the ledger.
        tiers: tiers this engine writes (subset of :data:`TIERS`).
        replication_jump: J; node n's replicas live on the other members of its clique
            {b·J·F + (n mod J) + k·J}, as in nvidia-resiliency-ext's CliqueReplicationStrategy.
        replication_factor: F; copies of each node's local checkpoint, own included (1 = none).
        keep_latest_k: committed steps kept per tier (0 = keep all). Defaults: local 2,
            persistent 3; a mapping giving some tiers keeps the defaults of the others.
            The local tier keeps its newest k and the local anchor only: node-local disks hold
            a few steps, and a rollback point or a milestone must outlive the node.
        keep_interval_s: persistent tier: also keep the first step committed in each window
            of this many seconds (> 0; e.g. 3600: one per hour on the hour), None: off.
        keep_every_n_steps: persistent tier: also keep the first step saved at or after each
            multiple of N steps (N, 2N, ...; N >= 1), None: off.
        keep_period: persistent tier: keep every step that is a multiple of this forever
            (>= 1; Orbax's keep_period), None: off.
        keep_steps: persistent tier: steps kept forever (milestones, >= 0). The picks of these
            rules are recorded in the root's ``tierckpt-retention.json`` and honoured at every
            later pass, restarts and option changes included; the step a run restored from is
            kept for the whole run (:mod:`tierckpt.tiers.keep`).
        job_id: substituted for ``{job}``; default SLURM_JOB_ID (stable across requeues), else
            ``"job"``. torchrun's TORCHELASTIC_RUN_ID is not used: ``--standalone`` makes it
            random per launch, which would hide the previous launch's local checkpoints.
        transfer_chunk_bytes: largest piece of a file held in memory while replicating (bytes):
            a receiving rank holds 4 chunk buffers (2 sending from a non-local store) while a
            transfer runs, unmapped when it ends.
        restore_memory_bytes: largest share of a node-local step one rank holds in memory during
            a restore (bytes, default 32 GiB; 0 = none): the rank's share of its own copy, read
            and checksummed in one pass while the pulls run, and a pulled replica, received into
            memory and loaded from it while it is written to disk. A larger own share is verified
            and loaded from disk; a larger pull, or one whose buffers the allocator refuses
            (logged), is committed to disk before it is loaded, received in chunks of
            ``min(transfer_chunk_bytes, max(restore_memory_bytes / 4, 1 MiB))`` so its buffers
            stay within the bound (docs/design.md, "Host memory").
        staging_buffers: host copies of the state kept for overlapping saves (>=1).
        cpu_staging: how ``save()`` copies CPU tensors into a staging buffer. ``"blocking"``
            (default): inside ``save()``; the caller may modify the state at once.
            ``"overlapped"``: once a staging buffer has held a state of the same structure (from
            the second save into each buffer on), tensors of at least 64 KiB are
            copied by a background thread while forward and backward run, and the trainer calls
            ``wait_for_staging()`` before its next in-place write (installed for every
            ``torch.optim`` optimizer as a global step pre-hook); a copy that raced a write is
            detected through the tensors' version counters and fails that step's save
            (:mod:`tierckpt.staging.overlap`). CUDA tensors are always copied asynchronously (a side
            stream, the same wait, no version checks).
        collective_timeout_s: timeout of the engine's own gloo groups (seconds, in (0,
            :data:`MAX_WAIT_S`]: a week at most).
        restore_read_timeout_s: longest a restore waits for a read of a source that makes no
            progress (seconds without a byte or a file opened: a hung NFS/NVMe read), for the
            reads of a node's own copy, of a persistent step being verified, and of a replica
            a peer sends. Such a source then counts as failed, like a corrupt one (agreed by
            every rank, ``timed out`` in the ledger's restore failures) and the restore falls
            back to the next source; the stuck read is left behind on a daemon thread whose
            late result is discarded. None (default): ``min(60, collective_timeout_s / 3)``.
            At most ``collective_timeout_s / 2``: the peers of a rank that gives up wait for it
            in a collective for the bound plus the rest of the attempt.
        local_wait_timeout_s: longest a local-tier save waits for the previous one (seconds; 0 =
            no limit, at most 7 days). When the previous local save is still running on some rank after this
            (a hung or very slow node-local disk), every rank skips the local tier at this step
            with a warning and a ledger record; training and the persistent tier go on.
        exit_timeout_s: longest the interpreter's exit waits for the background saves still
            running when a script ends without ``close()`` (returns from main, raises, calls
            ``sys.exit``; seconds, 0 = do not wait, at most 7 days; :mod:`tierckpt.exit`). A save
            not finished by then is left uncommitted and named in a warning and in the ledger's
            ``run_end`` (``unfinished``).
        busy_tier_policy: what ``save()`` does with a due tier whose previous save is still
            running on some rank: ``"defer"`` (default) or ``"wait"``, for every tier or as
            ``{tier: policy}`` (tiers left out: ``"defer"``). ``"defer"``: that tier's save is
            not made now and training goes on without waiting; the decision is one all-reduce
            of 4 bytes per tier over the control group (the same on every rank); a ``checkpoint`` record with ``skipped`` and ``deferred`` names the
            running step (``SaveHandle.skipped``, the ledger, a warning from rank 0). With
            ``intervals``, the tier is then due again at the first step where that save has
            finished on every rank (:meth:`TieredCheckpointer.due`); without, the caller's next
            save of the tier. ``"wait"``: the persistent tier waits without bound, the local
            tier at most ``local_wait_timeout_s`` and is then skipped. Planned exits
            (``save(..., wait_previous=True)``, ``save_for_preemption``) always wait.
        local_root_is_node_private: the template may omit ``{node}`` because each node's path
            is on its own disk.
        local_permissions: permission bits of everything tierckpt writes under a node-local
            root (own steps, replicas, restore pulls, the root when tierckpt creates it),
            set exactly whatever the umask: ``"private"`` (default; directories 0700, files
            0600: the job's user only) or ``"group"`` (0750 / 0640: the user's group may read).
            The persistent tier is not affected (the umask and default ACLs decide there).
        background_nice: added to the nice value of tierckpt's background threads (the tiers'
            workers and the replication threads they start; 0..19, default 10; 0 = the trainer's
            priority): under CFS a nice-10 thread competing for a core gets about 1/9 of a
            nice-0 thread's share (:mod:`tierckpt.priority`). The thread calling ``save()`` and
            the overlapped staging copy keep the trainer's priority.
        background_io_class: I/O class of the same threads: ``"best-effort"`` (default, level 7,
            the lowest of the class), ``"idle"`` (only when the disk is otherwise idle: a trainer
            reading continuously may starve a save) or ``"none"`` (unchanged). Honoured by the
            BFQ and CFQ I/O schedulers only.
        simulated_ranks_per_node: > 0 simulates nodes on one machine: node = rank // this
            (tests and demos); 0 derives nodes from the environment (torchrun, Slurm, hostname).
        intervals: ``{tier: steps}`` between saves, for :meth:`TieredCheckpointer.due`; for an
            adaptive tier, the interval used until the scheduler knows the step time. None: the
            caller decides when to save.
        adaptive: tiers whose interval comes from Young/Daly with measured δ and the MTBF
            estimate (:mod:`tierckpt.sched.schedule`); each must be in ``intervals``.
        schedule: the adaptive scheduler's :class:`ScheduleOptions`.
        warn_only: tiers whose failed background save is only logged and recorded. A failed
            save of any other tier raises :class:`~tierckpt.errors.TierFailedError` at that
            tier's next ``save()`` and at a clean ``close()``. Default ``("local",)``: a
            node-local failure degrades to the persistent tier, a persistent failure stops
            the job before more work depends on it.
        preemption_signals: signals that mean "save and exit" (e.g. ``("SIGTERM", "SIGUSR1")``);
            the engine records them and :meth:`TieredCheckpointer.preemption_requested` reports
            them, agreed over every rank. Empty (default): not watched, the process keeps the
            signals' previous handlers (a framework with its own handler, or plain SIGTERM death).
        preemption_grace_s: seconds the final save of a preemption notice may take before the
            trainer exits anyway: the local tier (+ replicas) is waited for first, the persistent
            tier with what is left (Slurm's KillWait and torchrun's shutdown default to 30 s);
            in (0, :data:`MAX_WAIT_S`].
        storage_options: fsspec options of the persistent root when it is a URL (passed to
            ``fsspec.core.url_to_fs``, e.g. s3fs's ``endpoint_url``, ``key``, ``secret``,
            ``profile``, ``client_kwargs``): a mapping of options for every URL, and/or entries
            whose key is a URL prefix (``"s3://bucket-b/"``) mapping to the options of the URLs
            under it (:meth:`options_for`). Default: none, so s3fs takes credentials and endpoint
            from the environment (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
            ``AWS_ENDPOINT_URL``, ``AWS_PROFILE``, ...) as for any boto client.

    Numeric fields follow :data:`RULES` (``bool``, NaN, ±inf and strings are refused).
    Sequences are normalised to tuples and mappings to :class:`FrozenDict`.

    Raises:
        ConfigError: naming the first invalid field (``keep_latest_k.local``,
            ``intervals.persistent``, ... for a mapping entry) and its allowed values; an
            unknown field name, with the allowed names.
    """

    _what = "TierConfig field"

    local_root: str | None = None
    persistent_root: str | None = None
    tiers: tuple[str, ...] = TIERS
    replication_jump: int = 1
    replication_factor: int = 2
    keep_latest_k: Mapping[str, int] = field(default_factory=lambda: FrozenDict(DEFAULT_KEEP_LATEST_K))
    # -- retention beyond the newest k (persistent tier; tierckpt/tiers/keep.py) --
    keep_interval_s: float | None = None
    keep_every_n_steps: int | None = None
    keep_period: int | None = None
    keep_steps: tuple[int, ...] = ()
    # -- end of retention fields --
    job_id: str | None = None
    transfer_chunk_bytes: int = 64 << 20
    restore_memory_bytes: int = 32 << 30
    staging_buffers: int = 2
    cpu_staging: str = "blocking"
    collective_timeout_s: float = 600.0
    restore_read_timeout_s: float | None = None  # None: min(60, collective_timeout_s / 3)
    local_wait_timeout_s: float = 300.0  # MAX_WAIT_S at most
    exit_timeout_s: float = 600.0  # MAX_WAIT_S at most
    busy_tier_policy: str | Mapping[str, str] = "defer"
    local_root_is_node_private: bool = False
    local_permissions: str = "private"
    simulated_ranks_per_node: int = 0
    intervals: Mapping[str, int] | None = None
    adaptive: tuple[str, ...] = ()
    schedule: ScheduleOptions = field(default_factory=ScheduleOptions)
    warn_only: tuple[str, ...] = ("local",)
    preemption_signals: tuple[str, ...] = ()
    preemption_grace_s: float = 25.0
    background_nice: int = 10
    background_io_class: str = "best-effort"
    # -- object stores --------------------------------------------------------------------
    storage_options: Mapping[str, Any] = field(default_factory=FrozenDict)

    def __post_init__(self) -> None:
        self._check_tiers_and_roots()
        self._check_retention_and_transfer()
        self._check_cadence()
        self._check_preemption()
        self._check_resources()
        self._check_busy_policy()
        self._put("storage_options", check_storage_options(self.storage_options))

    @property
    def background_priority(self) -> BackgroundPriority:
        """The priority of the background threads (:mod:`tierckpt.priority`)."""
        return BackgroundPriority(self.background_nice, self.background_io_class)

    @property
    def read_timeout_s(self) -> float:
        """The restore's read bound in seconds: ``restore_read_timeout_s``, or its default
        ``min(60, collective_timeout_s / 3)`` when None."""
        r = self.restore_read_timeout_s
        return float(r) if r is not None else min(60.0, self.collective_timeout_s / 3)

    def _put(self, name: str, value) -> None:
        object.__setattr__(self, name, value)

    def _check_tiers_and_roots(self) -> None:
        self._put("tiers", validate_tiers(self.tiers))
        if not self.tiers:
            raise ConfigError("tiers", f"at least one tier is required; allowed: {', '.join(TIERS)}")
        if "local" in self.tiers:
            _check_template(self.local_root, self.local_root_is_node_private)
        modes_of(self.local_permissions)  # raises naming local_permissions and the allowed values
        boolean(self.local_root_is_node_private, "local_root_is_node_private")
        if not self.persistent_root:
            raise ConfigError(
                "persistent_root",
                "a shared directory or fsspec URL is required (it holds the persistent tier "
                "and the ledger)",
            )
        self._check("replication_jump", "replication_factor")

    def _check(self, *names: str) -> None:
        """Check and normalise the plain numeric fields ``names`` with their :data:`RULES`."""
        for name in names:
            self._put(name, RULES[name](getattr(self, name), name))

    def _check_retention_and_transfer(self) -> None:
        if not isinstance(self.keep_latest_k, Mapping):
            raise ConfigError("keep_latest_k", f"must be a mapping tier -> {RULES['keep_latest_k'].describe()}, "
                                               f"got {self.keep_latest_k!r}")
        keep = dict(DEFAULT_KEEP_LATEST_K)
        for tier, k in self.keep_latest_k.items():
            if tier not in TIERS:
                raise ConfigError(
                    "keep_latest_k", f"unknown tier {tier!r}; allowed: {', '.join(TIERS)}"
                )
            keep[tier] = RULES["keep_latest_k"](k, f"keep_latest_k.{tier}")
        self._put("keep_latest_k", FrozenDict(keep))
        self._check_keep_rules()
        self._check("transfer_chunk_bytes", "restore_memory_bytes")

    def _check_keep_rules(self) -> None:
        """The persistent tier's rules beyond the newest k (:mod:`tierckpt.tiers.keep`)."""
        self._check("keep_interval_s", "keep_every_n_steps", "keep_period")
        steps = self.keep_steps
        if isinstance(steps, (str, bytes, Mapping)) or not hasattr(steps, "__iter__"):
            raise ConfigError("keep_steps", f"must be a list of steps ({RULES['keep_steps'].describe()}), "
                                            f"got {steps!r}")
        self._put("keep_steps", tuple(sorted({RULES["keep_steps"](s, f"keep_steps[{i}]")
                                              for i, s in enumerate(steps)})))

    def _check_cadence(self) -> None:
        if self.intervals is not None:
            if not isinstance(self.intervals, Mapping):
                raise ConfigError("intervals", f"must be a mapping tier -> steps, got {self.intervals!r}")
            out = {}
            for tier, n in self.intervals.items():
                if tier not in self.tiers:
                    raise ConfigError("intervals", f"tier {tier!r} is not configured; configured: {', '.join(self.tiers)}")
                out[tier] = RULES["intervals"](n, f"intervals.{tier}")
            self._put("intervals", FrozenDict(out))
        self._put("adaptive", validate_tiers(self.adaptive, "adaptive"))
        self._put("warn_only", validate_tiers(self.warn_only, "warn_only"))
        for tier in self.adaptive:
            if not self.intervals or tier not in self.intervals:
                raise ConfigError("adaptive", f"tier {tier!r} needs an initial interval in intervals.{tier}")
        if not isinstance(self.schedule, ScheduleOptions):
            raise ConfigError("schedule", f"must be a ScheduleOptions (tierckpt.ScheduleOptions(min_steps=..., ...)), "
                                          f"got {self.schedule!r}")

    def _check_preemption(self) -> None:
        self._put("preemption_signals", tuple(self.preemption_signals))
        signal_numbers(self.preemption_signals)
        self._check("preemption_grace_s")

    def _check_resources(self) -> None:
        self._check("simulated_ranks_per_node", "staging_buffers", "collective_timeout_s", "local_wait_timeout_s",
                    "exit_timeout_s", "background_nice")
        choice(self.cpu_staging, "cpu_staging", CPU_STAGING_MODES)
        choice(self.background_io_class, "background_io_class", IO_CLASSES)
        half = self.collective_timeout_s / 2
        rule = RULES["restore_read_timeout_s"].with_max(half, f"collective_timeout_s / 2 = {half:g}")
        self._put("restore_read_timeout_s", rule(self.restore_read_timeout_s, "restore_read_timeout_s"))
        if self.local_wait_timeout_s and "local" in self.tiers and self.staging_buffers < 2:
            raise ConfigError("staging_buffers", "must be >= 2 with a local tier and local_wait_timeout_s > 0: "
                              "a stuck local save keeps its buffer, the other tiers need another "
                              f"(got {self.staging_buffers}; or set local_wait_timeout_s = 0)")

    def _check_busy_policy(self) -> None:
        value, allowed = self.busy_tier_policy, " or ".join(repr(p) for p in BUSY_TIER_POLICIES)
        if isinstance(value, str):
            value = {t: value for t in TIERS}
        if not isinstance(value, Mapping):
            raise ConfigError("busy_tier_policy", f"must be {allowed}, or a mapping tier -> policy; got {value!r}")
        out = {t: "defer" for t in TIERS}
        for tier, policy in value.items():
            if tier not in TIERS:
                raise ConfigError("busy_tier_policy", f"unknown tier {tier!r}; allowed: {', '.join(TIERS)}")
            out[tier] = choice(policy, "busy_tier_policy" if isinstance(self.busy_tier_policy, str)
                               else f"busy_tier_policy.{tier}", BUSY_TIER_POLICIES)
        self._put("busy_tier_policy", FrozenDict(out))

    def busy_policy(self, tier: str) -> str:
        """``busy_tier_policy`` of ``tier``: ``"defer"`` or ``"wait"``."""
        policy = self.busy_tier_policy
        return policy if isinstance(policy, str) else policy.get(tier, "defer")

    def resolved_job_id(self) -> str:
        """The ``{job}`` value: ``job_id``, else SLURM_JOB_ID, else ``"job"``."""
        return self.job_id or os.environ.get("SLURM_JOB_ID") or "job"

    def local_root_for(self, node: int, hostname: str | None = None) -> str:
        """Expand ``local_root`` for ``node`` (see the class docstring for the fields)."""
        import socket

        assert self.local_root is not None
        return self.local_root.format(
            job=self.resolved_job_id(), node=node, hostname=hostname or socket.gethostname()
        )

    def options_for(self, url: str) -> dict:
        """The fsspec options of ``url`` (:func:`options_for`)."""
        return options_for(self.storage_options, url)

    def replace(self, **kw) -> "TierConfig":
        """A copy with fields replaced, validated like a new config.

        Raises:
            ConfigError: as the constructor.
        """
        return dataclasses.replace(self, **kw)


# -- object stores: storage_options ---------------------------------------------------------
def check_storage_options(value, option: str = "storage_options") -> FrozenDict:
    """``TierConfig.storage_options`` normalised: nested mappings frozen (:class:`FrozenDict`),
    lists as tuples, so the config stays hashable.

    Raises:
        ConfigError: naming ``option`` when it is not a mapping with string keys, or when a URL
            prefix key (one holding ``://``) does not map to a mapping of options.
    """
    if value is None:
        return FrozenDict()
    if not isinstance(value, Mapping):
        raise ConfigError(option, f"must be a mapping of fsspec options (e.g. {{\"endpoint_url\": \"http://...\"}}), "
                                  f"got {value!r}")
    for key, v in value.items():
        if not isinstance(key, str):
            raise ConfigError(option, f"option names must be strings, got {key!r}")
        if "://" in key and not isinstance(v, Mapping):
            raise ConfigError(f"{option}.{key}", f"a URL prefix maps to a mapping of options, got {v!r}")
    return _freeze(value)


def _freeze(v):
    if isinstance(v, Mapping):
        return FrozenDict({k: _freeze(x) for k, x in v.items()})
    if isinstance(v, (list, tuple)):
        return tuple(_freeze(x) for x in v)
    return v


def _thaw(v):
    if isinstance(v, Mapping):
        return {k: _thaw(x) for k, x in v.items()}
    if isinstance(v, tuple):
        return [_thaw(x) for x in v]
    return v


def options_for(storage_options: Mapping[str, Any], url: str) -> dict:
    """The fsspec options of ``url``: the plain entries of ``storage_options`` (keys without
    ``://``), updated with the options of the longest URL-prefix key ``url`` starts with. A
    fresh plain dict (nested mappings as dicts, tuples as lists): fsspec may change it.

    Example: ``{"anon": False, "s3://b/": {"endpoint_url": "http://x"}}`` gives
    ``s3://b/run`` ``{"anon": False, "endpoint_url": "http://x"}``, ``s3://c/run``
    ``{"anon": False}``."""
    out = {k: _thaw(v) for k, v in storage_options.items() if "://" not in k}
    prefixes = sorted((k for k in storage_options if "://" in k and url.startswith(k)), key=len)
    if prefixes:
        out.update(_thaw(storage_options[prefixes[-1]]))
    return out


def _check_template(template: str | None, node_private: bool) -> None:
    if not template:
        raise ConfigError("local_root", "a directory template is required when the local tier is on")
    try:
        names = {f for _, f, _, _ in string.Formatter().parse(template) if f is not None}
    except ValueError as e:
        raise ConfigError("local_root", f"malformed template {template!r}: {e}") from None
    unknown = names - set(TEMPLATE_FIELDS)
    if unknown:
        raise ConfigError(
            "local_root",
            f"unknown field(s) {sorted(unknown)} in {template!r}; allowed: "
            + ", ".join("{" + f + "}" for f in TEMPLATE_FIELDS),
        )
    if "node" not in names and "hostname" not in names and not node_private:
        raise ConfigError(
            "local_root",
            f"{template!r} must contain {{node}} (or {{hostname}}) so nodes sharing a filesystem "
            "get separate directories; set local_root_is_node_private=True if each node's path is "
            "on its own disk",
        )
