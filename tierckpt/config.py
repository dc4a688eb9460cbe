"""User-facing configuration of the tiered checkpoint engine.

Every field is validated in :meth:`TierConfig.validate`, which raises :class:`ConfigError`
naming the field and the values it accepts. Topology-dependent checks (``replication_factor``
against the node count) run when the topology is known, in :mod:`tierckpt.dist.topology`.
"""

from __future__ import annotations

import dataclasses
import os
import string
from dataclasses import dataclass, field

from tierckpt.errors import ConfigError

TIERS = ("local", "persistent")
"""Tiers a save can target. Replication is part of the local tier (F>1), not a tier of its own."""

MAX_WAIT_S = 7 * 86400.0  # local_wait_timeout_s bound (threading.TIMEOUT_MAX is far above)
DEFAULT_KEEP_LATEST_K = {"local": 2, "persistent": 3}
TEMPLATE_FIELDS = ("job", "node", "hostname")


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


@dataclass
class TierConfig:
    """Configuration of a :class:`tierckpt.engine.TieredCheckpointer`.

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
            persistent 3.
        job_id: substituted for ``{job}``; default SLURM_JOB_ID (stable across requeues), else
            ``"job"``. torchrun's TORCHELASTIC_RUN_ID is not used: ``--standalone`` makes it
            random per launch, which would hide the previous launch's local checkpoints.
        transfer_chunk_bytes: largest piece of a file held in memory while replicating (bytes).
        staging_buffers: host copies of the state kept for overlapping saves (>=1).
        collective_timeout_s: timeout of the engine's own gloo groups (seconds).
        local_wait_timeout_s: longest a local-tier save waits for the previous one (seconds; 0 =
            no limit). When the previous local save is still running on some rank after this
            (a hung or very slow node-local disk), every rank skips the local tier at this step
            with a warning and a ledger record; training and the persistent tier go on.
        local_root_is_node_private: the template may omit ``{node}`` because each node's path
            is on its own disk.
        simulated_ranks_per_node: > 0 simulates nodes on one machine: node = rank // this
            (tests and demos); 0 derives nodes from the environment (torchrun, Slurm, hostname).
        intervals: ``{tier: steps}`` between saves, for :meth:`TieredCheckpointer.due`; for an
            adaptive tier, the interval used until the scheduler knows the step time. None: the
            caller decides when to save.
        adaptive: tiers whose interval comes from Young/Daly with measured δ and the MTBF
            estimate (:mod:`tierckpt.sched.schedule`); each must be in ``intervals``.
        schedule_options: extra :class:`tierckpt.sched.schedule.Scheduler` arguments (``gpu_mtbf_s``,
            ``mtbf_weight``, ``min_steps``, ``max_steps``, ``min_s``, ``max_s``,
            ``restart_prior_s``, ``persistent_share``).
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
            tier with what is left (Slurm's KillWait and torchrun's shutdown default to 30 s).
    """

    local_root: str | None = None
    persistent_root: str | None = None
    tiers: tuple[str, ...] = TIERS
    replication_jump: int = 1
    replication_factor: int = 2
    keep_latest_k: dict[str, int] = field(default_factory=lambda: dict(DEFAULT_KEEP_LATEST_K))
    job_id: str | None = None
    transfer_chunk_bytes: int = 64 << 20
    staging_buffers: int = 2
    collective_timeout_s: float = 600.0
    local_wait_timeout_s: float = 300.0  # MAX_WAIT_S at most
    local_root_is_node_private: bool = False
    simulated_ranks_per_node: int = 0
    intervals: dict[str, int] | None = None
    adaptive: tuple[str, ...] = ()
    schedule_options: dict = field(default_factory=dict)
    warn_only: tuple[str, ...] = ("local",)
    preemption_signals: tuple[str, ...] = ()
    preemption_grace_s: float = 25.0

    def validate(self) -> "TierConfig":
        """Check every field; return ``self`` with normalised values.

        Raises:
            ConfigError: naming the first invalid field and its allowed values.
        """
        self.tiers = validate_tiers(self.tiers)
        if not self.tiers:
            raise ConfigError("tiers", f"at least one tier is required; allowed: {', '.join(TIERS)}")
        if "local" in self.tiers:
            _check_template(self.local_root, self.local_root_is_node_private)
        if not self.persistent_root:
            raise ConfigError(
                "persistent_root",
                "a shared directory or fsspec URL is required (it holds the persistent tier "
                "and the ledger)",
            )
        for name in ("replication_jump", "replication_factor"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(name, f"must be an integer >= 1, got {v!r}")
        keep = dict(DEFAULT_KEEP_LATEST_K)
        for tier, k in dict(self.keep_latest_k).items():
            if tier not in TIERS:
                raise ConfigError(
                    "keep_latest_k", f"unknown tier {tier!r}; allowed: {', '.join(TIERS)}"
                )
            if isinstance(k, bool) or not isinstance(k, int) or k < 0:
                raise ConfigError(
                    f"keep_latest_k.{tier}", f"must be an integer >= 0 (0 keeps all), got {k!r}"
                )
            keep[tier] = k
        self.keep_latest_k = keep
        if not isinstance(self.transfer_chunk_bytes, int) or self.transfer_chunk_bytes < 4096 \
                or self.transfer_chunk_bytes % 4096:
            raise ConfigError(
                "transfer_chunk_bytes",
                f"must be a positive multiple of 4096 bytes (O_DIRECT alignment), got {self.transfer_chunk_bytes!r}",
            )
        if self.intervals is not None:
            if not isinstance(self.intervals, dict):
                raise ConfigError("intervals", f"must be a mapping tier -> steps, got {self.intervals!r}")
            for tier, n in self.intervals.items():
                if tier not in self.tiers:
                    raise ConfigError("intervals", f"tier {tier!r} is not configured; configured: {', '.join(self.tiers)}")
                if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                    raise ConfigError(f"intervals.{tier}", f"must be an integer number of steps >= 1, got {n!r}")
        self.adaptive = validate_tiers(self.adaptive, "adaptive")
        self.warn_only = validate_tiers(self.warn_only, "warn_only")
        from tierckpt.preemption import signal_numbers

        self.preemption_signals = tuple(self.preemption_signals)
        signal_numbers(self.preemption_signals)
        g = self.preemption_grace_s
        if isinstance(g, bool) or not isinstance(g, (int, float)) or not 0 < g < float("inf"):
            raise ConfigError("preemption_grace_s", f"must be seconds > 0, got {g!r}")
        for tier in self.adaptive:
            if not self.intervals or tier not in self.intervals:
                raise ConfigError("adaptive", f"tier {tier!r} needs an initial interval in intervals.{tier}")
        if not isinstance(self.schedule_options, dict):
            raise ConfigError("schedule_options", f"must be a mapping, got {self.schedule_options!r}")
        if isinstance(self.simulated_ranks_per_node, bool) or not isinstance(self.simulated_ranks_per_node, int) \
                or self.simulated_ranks_per_node < 0:
            raise ConfigError("simulated_ranks_per_node",
                              f"must be an integer >= 0 (0 = real topology), got {self.simulated_ranks_per_node!r}")
        if not isinstance(self.staging_buffers, int) or self.staging_buffers < 1:
            raise ConfigError("staging_buffers", f"must be an integer >= 1, got {self.staging_buffers!r}")
        if not (isinstance(self.collective_timeout_s, (int, float)) and self.collective_timeout_s > 0):
            raise ConfigError(
                "collective_timeout_s", f"must be a positive number of seconds, got {self.collective_timeout_s!r}"
            )
        w = self.local_wait_timeout_s
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not 0 <= w <= MAX_WAIT_S:
            raise ConfigError("local_wait_timeout_s",
                              f"must be seconds in [0, {MAX_WAIT_S:g}] (0 = wait without limit), got {w!r}")
        if w and "local" in self.tiers and self.staging_buffers < 2:
            raise ConfigError("staging_buffers", "must be >= 2 with a local tier and local_wait_timeout_s > 0: "
                              "a stuck local save keeps its buffer, the other tiers need another "
                              f"(got {self.staging_buffers}; or set local_wait_timeout_s = 0)")
        return self

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

    def replace(self, **kw) -> "TierConfig":
        """A copy with fields replaced (not validated until :meth:`validate`)."""
        return dataclasses.replace(self, **kw)


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
