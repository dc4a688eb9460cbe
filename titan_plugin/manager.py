"""``TieredCheckpointManager``: torchtitan's CheckpointManager with tierckpt's tiers.

The trainer keeps calling ``load``, ``maybe_wait_for_staging``, ``save(step, last_step)`` and
``close``. What changes behind them:

- **local tier** (every ``local_interval`` steps): node-local DCP checkpoint + replication to
  the clique peers, written in the background by :class:`tierckpt.engine.TieredCheckpointer`;
- **persistent tier** (every torchtitan ``interval`` steps): a global DCP checkpoint in
  torchtitan's checkpoint folder (``<dump_folder>/<folder>/step-N``, or ``persistent_folder``),
  written in the background over a gloo group with the same ``dcp.save`` call torchtitan's
  ``CheckpointManager.dcp_save`` makes, plus tierckpt's manifest and commit marker;
- both tiers share one staging copy of the flattened state (model, optimizer, lr_scheduler,
  dataloader, train_state); ``save`` returns once it is complete, so no parameter changes
  before its copy is taken and ``maybe_wait_for_staging`` has nothing to wait for;
- ``load`` restores from the best committed source (own local > peer replica > persistent);
  ``checkpoint.load_step`` picks that step from whichever tier holds it: read-only with
  ``checkpoint.load_only``, a rollback in a training run (:mod:`tierckpt.rollback`);
  only steps with a tierckpt commit marker are resume points, so torchtitan's final
  model-only export (``last_save_model_only``) can never be picked up as a full resume state.
  With no committed step anywhere it falls back to torchtitan's own initial-load logic
  (``initial_load_path``, HF assets).
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torchtitan.components.checkpoint import MODEL, CheckpointManager

from tierckpt.cadence import decision_metrics
from tierckpt.config import TierConfig
from tierckpt.engine import TieredCheckpointer
from tierckpt.errors import ConfigError
from tierckpt.dcp_io import crc32_off, digests_under, hashing_writer
from tierckpt.persistent import PersistentIO

log = logging.getLogger(__name__)


class TitanPersistentIO(PersistentIO):
    """Persistent-tier writes as torchtitan makes them (``dcp.save(state_dict,
    checkpoint_id=…)`` in ``CheckpointManager.dcp_save``), over tierckpt's gloo group so the
    background write never shares the trainer's process group; loads use tierckpt's verified
    DCP load (same format)."""

    def save(self, state_dict: dict, url: str, process_group) -> dict:
        """Collective DCP save to ``url`` over ``process_group``; returns the checksums
        hashed while writing (local paths), as :meth:`PersistentIO.save`."""
        if "://" in url:
            dcp.save(state_dict, checkpoint_id=url, process_group=process_group)
            return {}
        writer = hashing_writer(url)
        with crc32_off():
            dcp.save(state_dict, storage_writer=writer, process_group=process_group)
        return digests_under(writer, url)


def tier_config(config: "TieredCheckpointManager.Config", persistent_folder: str) -> TierConfig:
    """The engine's :class:`~tierckpt.config.TierConfig` for a validated ``[checkpoint]`` section.

    Args:
        config: the manager's Config (torchtitan's keys plus the plugin's).
        persistent_folder: the persistent tier's directory or fsspec URL.
    Returns:
        TierConfig with the local tier only when ``local_interval > 0``; ``interval`` is the
        persistent tier's; adaptive tiers get Scheduler options (``gpu_mtbf_s``, seconds;
        ``restart_prior_s``, seconds; ``min_steps``/``max_steps``).
    """
    tiers = ("local", "persistent") if config.local_interval > 0 else ("persistent",)
    sched = {"min_steps": config.min_interval_steps}
    if config.max_interval_steps:
        sched["max_steps"] = config.max_interval_steps
    if config.gpu_mtbf_hours:
        sched["gpu_mtbf_s"] = config.gpu_mtbf_hours * 3600.0
    if config.restart_prior_s:
        sched["restart_prior_s"] = float(config.restart_prior_s)
    tcfg = TierConfig(
        local_root=config.local_root, persistent_root=persistent_folder, tiers=tiers,
        replication_jump=config.replication_jump, replication_factor=config.replication_factor,
        keep_latest_k={"local": config.local_keep_latest_k, "persistent": config.keep_latest_k},
        job_id=config.job_id or None, simulated_ranks_per_node=config.simulated_ranks_per_node,
        intervals={"local": config.local_interval, "persistent": config.interval} if config.local_interval
        else {"persistent": config.interval},
        adaptive=tuple(t for t in config.adaptive if t in tiers), schedule_options=sched,
        local_wait_timeout_s=float(config.local_wait_timeout_s),
    )
    return tcfg


class TieredCheckpointManager(CheckpointManager):
    """torchtitan 0.3 ``CheckpointManager`` subclass with local, replica and persistent tiers.

    Built by the trainer through ``config.checkpoint.build(...)`` (same keyword arguments as
    ``CheckpointManager``). See the module docstring for the behaviour.

    Raises:
        ConfigError: invalid tier settings (names the ``checkpoint.*`` field).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        local_root: str = "/tmp/tierckpt/{job}/node-{node}"
        """Node-local directory template of the local tier; fields {job}, {node}, {hostname}."""

        local_interval: int = 10
        """Steps between local-tier saves (0 disables the local tier)."""

        local_keep_latest_k: int = 2
        """Committed local steps (and replicas per peer) kept per node; 0 keeps all."""

        replication_jump: int = 1
        """J: node n's replicas go to n+J, n+2J, … inside its clique (nvidia-resiliency-ext)."""

        replication_factor: int = 2
        """F: copies of each node's local checkpoint, its own included (1 = no replicas)."""

        persistent_folder: str = ""
        """Persistent tier directory or fsspec URL; empty = torchtitan's checkpoint folder."""

        job_id: str = ""
        """Value of {job} (default SLURM_JOB_ID, else "job")."""

        simulated_ranks_per_node: int = 0
        """> 0 simulates nodes on one machine (node = rank // this); 0 = real topology."""

        adaptive: list[str] = field(default_factory=list)
        """Tiers ("local", "persistent") whose interval is chosen by Young/Daly from measured
        stall time and the MTBF estimate; their interval fields are the starting value."""

        gpu_mtbf_hours: float = 0.0
        """Prior MTBF of one GPU in hours for the adaptive scheduler (0 = Llama 3's:
        16,384 GPUs x 54 days / 419 interruptions)."""

        local_wait_timeout_s: float = 300.0
        """Longest a local save waits for the previous one, seconds (0 = no limit); then that
        step skips the local tier on every rank (a hung node-local disk must not stall training)."""

        restart_prior_s: float = 0.0
        """Restart + restore time R (seconds) the adaptive scheduler assumes until it has seen a
        restore (0 = 300 s). Set it to the launcher's requeue latency plus a restore."""

        min_interval_steps: int = 1
        """Lower bound of adaptive intervals, steps."""

        max_interval_steps: int = 0
        """Upper bound of adaptive intervals, steps (0 = none)."""

        def __post_init__(self) -> None:
            CheckpointManager.Config.__post_init__(self)
            for name in ("local_interval", "local_keep_latest_k", "simulated_ranks_per_node"):
                v = getattr(self, name)
                if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                    raise ConfigError(f"checkpoint.{name}", f"must be an integer >= 0, got {v!r}")
            for name in ("replication_jump", "replication_factor"):
                v = getattr(self, name)
                if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                    raise ConfigError(f"checkpoint.{name}", f"must be an integer >= 1, got {v!r}")
            for t in self.adaptive:
                if t not in ("local", "persistent"):
                    raise ConfigError("checkpoint.adaptive", f"unknown tier {t!r}; allowed: local, persistent")
            if self.gpu_mtbf_hours < 0:
                raise ConfigError("checkpoint.gpu_mtbf_hours", f"must be >= 0 (0 = Llama 3 prior), got {self.gpu_mtbf_hours!r}")
            if isinstance(self.local_wait_timeout_s, bool) or not isinstance(self.local_wait_timeout_s, (int, float)) \
                    or not 0 <= self.local_wait_timeout_s < float("inf"):
                raise ConfigError("checkpoint.local_wait_timeout_s",
                                  f"must be seconds >= 0 (0 = no limit), got {self.local_wait_timeout_s!r}")
            if isinstance(self.restart_prior_s, bool) or not isinstance(self.restart_prior_s, (int, float)) \
                    or not self.restart_prior_s >= 0:
                raise ConfigError("checkpoint.restart_prior_s",
                                  f"must be seconds >= 0 (0 = 300 s default), got {self.restart_prior_s!r}")
            if self.min_interval_steps < 1 or self.max_interval_steps < 0 or (
                    self.max_interval_steps and self.max_interval_steps < self.min_interval_steps):
                raise ConfigError("checkpoint.max_interval_steps",
                                  f"need 1 <= min_interval_steps <= max_interval_steps (0 = unbounded), got "
                                  f"{self.min_interval_steps}, {self.max_interval_steps}")
            if self.local_interval and not self.local_root.strip():
                raise ConfigError("checkpoint.local_root", "a directory template is required when local_interval > 0")

    def __init__(self, config: Config, *, dataloader, model_parts, optimizers, lr_schedulers,
                 states: dict[str, Any], sd_adapter, base_folder: str = "") -> None:
        super().__init__(config, dataloader=dataloader, model_parts=model_parts, optimizers=optimizers,
                         lr_schedulers=lr_schedulers, states=states, sd_adapter=sd_adapter,
                         base_folder=base_folder)
        self.engine: TieredCheckpointer | None = None
        if not self.enable:
            return
        if self.async_mode.value != "disabled":
            log.info("tierckpt: checkpoint.async_mode=%s is superseded: every tier stages once and "
                     "writes in the background", self.async_mode.value)
        self.local_interval = config.local_interval
        self.persistent_folder = config.persistent_folder or self.folder
        tcfg = tier_config(config, self.persistent_folder)
        try:
            self.engine = TieredCheckpointer(tcfg, persistent_io=TitanPersistentIO())
        except ConfigError as e:
            raise ConfigError(f"checkpoint.{e.option}", str(e).split(": ", 1)[-1]) from None
        self.last_restore = None
        self._t_step_end: float | None = None

    # -- save ----------------------------------------------------------------------------------
    def _due_tiers(self, curr_step: int, last_step: bool) -> list[str]:
        tiers = self.engine.due(curr_step)  # fixed or adaptive, the same on every rank
        if curr_step == 1 and self.enable_first_step_checkpoint and "persistent" not in tiers:
            tiers.append("persistent")
        if last_step and not self.last_save_model_only:
            tiers = [t for t in ("local", "persistent") if t in self.engine.cfg.tiers]
        return [t for t in tiers if t in self.engine.cfg.tiers]

    @torch.no_grad()
    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        """Stage once and start the due tiers in the background; returns whether anything
        was saved. At the last step with ``last_save_model_only`` torchtitan's own model-only
        export runs (synchronously, not a resume point)."""
        if self.load_only:
            return False
        now = time.perf_counter()
        if self._t_step_end is not None:  # the trainer calls save() after every step
            self.engine.observe_step(now - self._t_step_end)
        try:
            return self._save_due(curr_step, last_step)
        finally:
            self._log_schedule(curr_step)
            self._t_step_end = time.perf_counter()

    def _log_schedule(self, step: int) -> None:
        """Send new interval decisions to torchtitan's metric logger as
        ``tierckpt/<tier>/{tau_steps,tau_s,delta_s,mtbf_s,restart_s,p}`` (the logger is a no-op
        off the metrics rank)."""
        recs = self.engine.drain_schedule_log()
        if not recs:
            return
        trainer = self.states.get("train_state")
        logger = getattr(getattr(trainer, "metrics_processor", None), "logger", None)
        if logger is None:
            return
        try:
            logger.log(decision_metrics(recs), step)
        except Exception as e:  # metrics must never stop training
            log.warning("tierckpt: could not log schedule metrics: %s", e)

    def _save_due(self, curr_step: int, last_step: bool) -> bool:
        tiers = self._due_tiers(curr_step, last_step)
        if last_step and self.last_save_model_only and "persistent" in tiers:
            tiers.remove("persistent")  # torchtitan's export writes step-N there instead
        saved = False
        if tiers:
            delta = self.engine.save(curr_step, self._flattened_model_states_sd(), tiers=tiers)
            log.info("tierckpt: step %d staged for %s in %.3fs", curr_step, "+".join(tiers), delta)
            saved = True
        if last_step and self.last_save_model_only:
            self.engine.wait()
            self._save_last_step(curr_step)
            saved = True
        return saved

    def _maybe_wait_for_staging(self) -> None:
        """Nothing to wait for: ``save`` returns only once the staging copy is complete."""

    def _wait_for_saving(self) -> None:
        self.engine.wait()

    # -- load ----------------------------------------------------------------------------------
    def _find_load_step(self, folder: str = "") -> int:
        """Only committed persistent steps count (never torn or model-only folders)."""
        steps = self.engine.persistent.committed_steps() if self.engine else []
        return max(steps) if steps else -1

    @torch.no_grad()
    def _load(self, step: int = -1) -> bool:
        """Restore the newest committed step every node can be served from (or ``step``);
        with none anywhere, torchtitan's initial-load path (``initial_load_path``, HF).

        An explicit ``step`` (``checkpoint.load_step``) is read-only with
        ``checkpoint.load_only`` (an evaluation never rewrites history); in a training run it
        is a rollback: the newer steps are superseded once this run commits its first step."""
        t0 = time.perf_counter()
        states = self._states_to_load(model_only=False)
        explicit = step != -1
        res = self.engine.restore(states, step=step if explicit else None,
                                  rollback=explicit and not self.load_only)
        if res is None:
            if step != -1:
                raise FileNotFoundError(f"checkpoint.load_step={step}: no committed checkpoint of that step")
            return super()._load(-1)
        if MODEL in self.states:
            self.states[MODEL].load_state_dict(states)
        self.last_restore = res
        log.info("tierckpt: resumed from step %d (%s) in %.2fs", res.step,
                 ", ".join(f"node {n}: {o.source.kind}" for n, o in res.sources.items()),
                 time.perf_counter() - t0)
        return True

    def _close(self) -> None:
        if self.engine is not None:
            # torchtitan's train.main closes the trainer inside ``except Exception`` on a
            # crash: record that run as unclean so the MTBF estimate counts it.
            exc = sys.exc_info()[1]
            self.engine.close(clean=exc is None, reason=repr(exc) if exc else "")
        super()._close()
