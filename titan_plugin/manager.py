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
  dataloader, train_state); on CPU ``save`` returns once it is complete; CUDA tensors are
  copied into pinned host buffers on a side stream and ``maybe_wait_for_staging`` (called by
  torchtitan before ``optimizers.step()``) waits for those copies, as DCP's
  ``async_with_pinned_mem`` does;
- ``load`` restores from the best committed source (own local > peer replica > persistent);
  ``checkpoint.load_step`` picks that step from whichever tier holds it: read-only with
  ``checkpoint.load_only``, a rollback in a training run (:mod:`tierckpt.history.rollback`);
  only steps with a tierckpt commit marker are resume points, so torchtitan's final
  model-only export (``last_save_model_only``) can never be picked up as a full resume state;
- the last step is a planned exit: every tier saves it and training ends only once the
  persistent step is committed (a failure exits non-zero). With ``last_save_model_only`` the
  model-only export goes to ``<folder>/step-N`` as stock torchtitan's; when the persistent
  tier shares that folder, the committed full step-N (fp32) is the export.
  With no committed step anywhere a seed checkpoint (below) is loaded model-only, else
  torchtitan's own initial-load logic runs (``initial_load_path``, HF assets);
- **seed checkpoint** (``create_seed_checkpoint``, one rank, as ``torchtitan.train.main``):
  the unsharded model alone as ``step-0`` of the persistent folder, checksummed in
  ``tierckpt.seed.json`` and without a commit marker, so it is never a resume point, never
  deleted by retention and never loaded with optimizer or dataloader state; the next run
  loads it model-only (as torchtitan loads step 0) until that run commits a step of its own.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torchtitan.components.checkpoint import DATALOADER, MODEL, CheckpointManager

from tierckpt import (ConfigError, Preempted, RestoreResult, SaveHandle, TieredCheckpointer,
                      protect_loader_workers)
from tierckpt.integration import (PeerFailure, RestoreRecord, VerificationError, agree_loader_death, all_gather,
                                  mark_phase, restore_metrics, run_agreed, write_dcp)
from tierckpt.io import layout, manifest
from tierckpt.io.storage import Store
from titan_plugin.config import build_tier_config, check_titan_keys, checkpoint_error
from titan_plugin.dataloader import DataloaderPositions
from titan_plugin.metrics import TierMetrics

log = logging.getLogger(__name__)

SEED_STEP = 0  # torchtitan's seed checkpoint is step 0 of the checkpoint folder
SEED_MANIFEST = "tierckpt.seed.json"  # checksums of a seed; not a commit marker (never a resume point)


_EXPORT_CLASH = ("the last step's model-only export (last_save_in_hf or export_dtype {dtype}) would take "
                 "{folder}/step-N, where the persistent tier commits the run's final full state; set "
                 "checkpoint.persistent_folder to another directory (or last_save_model_only = false, or "
                 "export_dtype = float32 without HF)")


def _same_dir(a: str, b: str) -> bool:
    if "://" in a or "://" in b:
        return a.rstrip("/") == b.rstrip("/")
    return os.path.realpath(a) == os.path.realpath(b)


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

        # -- retention beyond keep_latest_k: the persistent tier's (tierckpt/tiers/keep.py) --
        keep_interval_s: float = 0.0
        """Also keep the first persistent step committed in each window of this many seconds
        (3600: one per hour on the hour; 0 = off): a step to roll back to past a loss spike."""

        keep_every_n_steps: int = 0
        """Also keep the first persistent step saved at or after each multiple of N steps (0 = off)."""

        keep_period: int = 0
        """Keep every persistent step that is a multiple of this forever (Orbax's keep_period; 0 = off)."""

        keep_steps: list[int] = field(default_factory=list)
        """Persistent steps kept forever (milestones). The picks of these rules are recorded in
        the folder's tierckpt-retention.json and kept across restarts and option changes."""
        # -- end of retention keys --

        local_permissions: str = "private"
        """Permissions of everything written under the node-local root, whatever the umask:
        "private" (directories 0700, files 0600) or "group" (0750/0640, the user's group may
        read). The persistent folder follows the umask."""

        background_nice: int = 10
        """Added to the nice value of the plugin's background threads (local write, checksums,
        replication, persistent write): 0..19; 0 = the trainer's priority."""

        background_io_class: str = "best-effort"
        """I/O class of those threads: "best-effort" (lowest level), "idle" or "none"."""

        replication_jump: int = 1
        """J: node n's replicas go to n+J, n+2J, … inside its clique (nvidia-resiliency-ext)."""

        replication_factor: int = 2
        """F: copies of each node's local checkpoint, its own included (1 = no replicas)."""

        persistent_folder: str = ""
        """Persistent tier directory or fsspec URL; empty = torchtitan's checkpoint folder."""

        # -- object stores ----------------------------------------------------------------
        storage_options: dict[str, Any] = field(default_factory=dict)
        """fsspec options of an fsspec-URL persistent_folder (the TOML table
        [checkpoint.storage_options], e.g. endpoint_url, profile; or URL-prefix keys
        "s3://bucket/" mapping to their own table). Empty: s3fs reads AWS_* from the environment."""

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
        """Longest a local save waits for the previous one, seconds (0 = no limit, at most 604800); then that
        step skips the local tier on every rank (a hung node-local disk must not stall training)."""

        restore_read_timeout_s: float = 0.0
        """Longest a restore waits for a read of a source that makes no progress, seconds (a hung
        node-local or shared disk); that source then counts as failed and the restore falls back
        to the next one. 0 = the default, min(60, the collective timeout / 3)."""

        busy_tier_policy: str = "defer"
        """A tier due while its previous save still runs: "defer" (that save is not made, training
        goes on; the tier saves at the first step where the running save finished on every
        rank, and the ledger records the deferral) or "wait" (the persistent tier waits for it,
        the local tier at most local_wait_timeout_s). The last step and a preemption always wait."""

        cpu_staging: str = "blocking"
        """How a save copies CPU tensors: "blocking" (inside save()) or "overlapped" (tensors of
        64 KiB and more copied by a background thread during the next forward/backward;
        torchtitan's maybe_wait_for_staging() before optimizers.step() waits for it; a write
        that raced the copy fails that step's save). CUDA tensors are always overlapped."""

        restart_prior_s: float = 0.0
        """Restart + restore time R (seconds) the adaptive scheduler assumes until it has seen a
        restore (0 = 300 s). Set it to the launcher's requeue latency plus a restore."""

        preemption_signals: list[str] = field(default_factory=lambda: ["SIGTERM", "SIGUSR1"])
        """Signals that mean "save and exit" (Slurm's ``--signal=USR1@90``, the SIGTERM before a
        SIGKILL, which torchrun forwards to its workers): at the next step end every rank saves
        every tier, waits up to ``preemption_grace_s`` and exits with status 75 to be requeued.
        Empty list: signals keep their default action."""

        preemption_grace_s: float = 25.0
        """Seconds the preemption save may take (local tier + replicas first, persistent tier
        with the rest); keep it under the scheduler's kill delay (Slurm KillWait, torchrun 30 s). At most 604800."""

        warn_only_tiers: list[str] = field(default_factory=lambda: ["local"])
        """Tiers whose failed background save is only logged and recorded ("local",
        "persistent"). A failed save of any other tier stops training at that tier's next save,
        or fails the end of training (non-zero exit naming the tier, step and cause)."""

        min_interval_steps: int = 1
        """Lower bound of adaptive intervals, steps."""

        max_interval_steps: int = 0
        """Upper bound of adaptive intervals, steps (0 = none)."""

        def __post_init__(self) -> None:
            """torchtitan's numeric keys by the engine's rules
            (:func:`titan_plugin.config.check_titan_keys`), torchtitan's checks, then the tier keys
            through the engine's own validation (:func:`titan_plugin.config.build_tier_config`:
            ``TierConfig``'s rules, errors named ``checkpoint.<key>``), whether or not
            checkpointing is enabled.

            Raises:
                ConfigError: naming the ``checkpoint.*`` key and its allowed values.
                ValueError: torchtitan's other checks (unnamed; the TOML front end names the key).
            """
            check_titan_keys(self)  # before torchtitan's own checks: `interval = "x"` is a TypeError there
            CheckpointManager.Config.__post_init__(self)
            # torchtitan's folder (never empty, checked above) stands in for an unset persistent_folder
            build_tier_config(self, self.persistent_folder or self.folder)
            if self.last_save_model_only and not self.persistent_folder.strip() and (
                    self.last_save_in_hf or self.export_dtype != "float32"):
                raise ConfigError("checkpoint.persistent_folder", _EXPORT_CLASH.format(dtype=self.export_dtype,
                                                                                        folder=self.folder))

    def __init__(self, config: Config, *, dataloader, model_parts, optimizers, lr_schedulers,
                 states: dict[str, Any], sd_adapter, base_folder: str = "") -> None:
        mark_phase("model_built")  # torchtitan builds the manager after model, optimizers and dataloader
        super().__init__(config, dataloader=dataloader, model_parts=model_parts, optimizers=optimizers,
                         lr_schedulers=lr_schedulers, states=states, sd_adapter=sd_adapter,
                         base_folder=base_folder)
        self.engine: TieredCheckpointer | None = None
        self.positions: DataloaderPositions | None = None
        self.tier_metrics = TierMetrics(self._metric_logger)
        self._metrics_step = 0  # the step of the last save() call: where close() logs what is left
        self.seed_run = bool(config.create_seed_checkpoint)
        if not self.enable:
            return
        self.persistent_folder = config.persistent_folder or self.folder
        self._storage_options = build_tier_config(config, self.persistent_folder).options_for(self.persistent_folder)
        if self.seed_run:
            # one process writing the unsharded model: no local tier, replicas or ledger
            return
        if self.async_mode.value != "disabled":
            log.info("tierckpt: checkpoint.async_mode=%s is superseded: every tier stages once and "
                     "writes in the background", self.async_mode.value)
        self.local_interval = config.local_interval
        # torchtitan's final model-only export goes to <folder>/step-N, where the persistent
        # tier's last (durable) step goes when both folders are one
        self._export_shares_step_dir = _same_dir(self.persistent_folder, self.folder)
        if self.last_save_model_only and self._export_shares_step_dir and (
                config.last_save_in_hf or config.export_dtype != "float32"):
            raise ConfigError("checkpoint.persistent_folder",
                              _EXPORT_CLASH.format(dtype=config.export_dtype, folder=self.folder))
        tcfg = build_tier_config(config, self.persistent_folder)
        try:
            self.engine = TieredCheckpointer(tcfg)
        except ConfigError as e:  # topology and writable roots, checked collectively
            raise checkpoint_error(e) from None
        self.last_restore: RestoreResult | None = None
        self._t_step_end: float | None = None
        self._last_handle: SaveHandle | None = None
        self.positions = self._wrap_dataloader(dataloader)
        # a notice sent to the rank's process group (torchrun, Slurm) must not kill the loader's
        # workers: the step would fail before its preemption save
        protect_loader_workers(dataloader, tcfg.preemption_signals)

    def _wrap_dataloader(self, dataloader) -> DataloaderPositions | None:
        """Put :class:`titan_plugin.dataloader.DataloaderPositions` in place of torchtitan's
        per-DP-rank dataloader state, so a run with another data-parallel degree can resume
        the data where the saved run stopped. Collective (creates a gloo group) when the
        dataloader is a ``ParallelAwareDataloader``; None (torchtitan's state kept) otherwise."""
        from torchtitan.components.dataloader import ParallelAwareDataloader

        if not isinstance(dataloader, ParallelAwareDataloader):
            return None
        trainer_cfg = getattr(self.states.get("train_state"), "config", None)
        path = getattr(getattr(trainer_cfg, "dataloader", None), "dataset_path", None)
        group = dist.new_group(backend="gloo") if dist.is_initialized() else None
        self.states[DATALOADER] = wrapper = DataloaderPositions(dataloader, group, dataset_path=path)
        return wrapper

    def _states_to_save(self) -> dict[str, Any]:
        """The flattened states of a save; gathers every rank's dataloader position first
        (collective: every rank saves at the same step)."""
        if self.positions is not None:
            self.positions.prepare()
        return self._flattened_model_states_sd()

    @property
    def _engine(self) -> TieredCheckpointer:
        """The engine of an enabled manager (what every save and load path runs on).

        Raises:
            RuntimeError: checkpointing is disabled or this is a seed run (no engine).
        """
        if self.engine is None:
            raise RuntimeError("tierckpt: no engine (checkpoint.enable = false or a seed-checkpoint run)")
        return self.engine

    # -- save ----------------------------------------------------------------------------------
    def _due_tiers(self, curr_step: int, last_step: bool) -> list[str]:
        tiers = self._engine.due(curr_step)  # fixed or adaptive, the same on every rank
        if curr_step == 1 and self.enable_first_step_checkpoint and "persistent" not in tiers:
            tiers.append("persistent")
        if last_step:  # a planned exit: every tier, the persistent one included (durable)
            tiers = [t for t in ("local", "persistent") if t in self._engine.cfg.tiers]
        return [t for t in tiers if t in self._engine.cfg.tiers]

    @torch.no_grad()
    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        """Stage once and start the due tiers in the background; returns whether anything
        was saved. At the last step with ``last_save_model_only`` torchtitan's own model-only
        export runs (synchronously, not a resume point)."""
        if self.load_only:
            return False
        if self.seed_run:
            return self._save_seed(curr_step)
        now = time.perf_counter()
        # the trainer calls save() after every step; the first one's time is not known (0), but
        # it ends the recovery timeline after a restore (tierckpt.recovery.timeline)
        self._engine.observe_step(0.0 if self._t_step_end is None else now - self._t_step_end)
        try:
            saved = self._save_due(curr_step, last_step)
            sig = None if last_step else self._engine.preemption_requested()  # agreed on every rank
            if sig is not None:
                raise self._engine.save_for_preemption(curr_step, self._states_to_save(), sig,
                                                      handle=self._last_handle)
            return saved
        finally:
            self._log_metrics(curr_step)
            self._t_step_end = time.perf_counter()

    def _metric_logger(self):
        """torchtitan's metric logger (a no-op one off the metrics rank), None before the
        trainer has built it."""
        trainer = self.states.get("train_state")
        return getattr(getattr(trainer, "metrics_processor", None), "logger", None)

    def _log_metrics(self, step: int) -> None:
        """Send new interval decisions and the tier records finished since the last step to
        the metric logger at ``step`` (:class:`titan_plugin.metrics.TierMetrics`; never waits
        for a background tier)."""
        self._metrics_step = step
        self.tier_metrics.schedule(self._engine.drain_schedule_log(), step)
        self.tier_metrics.poll(step)

    def _save_due(self, curr_step: int, last_step: bool) -> bool:
        tiers = self._due_tiers(curr_step, last_step)
        saved = False
        if tiers:
            # raises TierFailedError when a due tier's previous save failed (not warn-only)
            # the last step is a planned exit: it waits for a running save instead of deferring
            handle = self._last_handle = self._engine.save(curr_step, self._states_to_save(), tiers=tiers,
                                                          wait_previous=last_step)
            log.info("tierckpt: step %d staged for %s in %.3fs", curr_step, "+".join(tiers), handle.blocking_s)
            self.tier_metrics.saved(handle, curr_step)
            saved = True
        if last_step and self.last_save_model_only:
            self._engine.wait()  # a failure raises at close(), after the export's collectives
            if self._export_shares_step_dir:
                # the committed full step-N is a superset of the fp32 model-only export: model-only
                # loads (initial_load_model_only) read just the model keys from it
                log.info("tierckpt: last step %d: the committed full checkpoint %s doubles as "
                         "torchtitan's model-only export", curr_step, self._create_checkpoint_id(curr_step))
            else:
                self._save_last_step(curr_step)
            saved = True
        return saved

    def _save_seed(self, curr_step: int) -> bool:
        """Write the seed checkpoint: the model alone (flattened FQNs, its own dtype) as
        ``step-0`` of the persistent folder, then ``tierckpt.seed.json`` with its files'
        checksums. Unlike torchtitan, never the optimizer or dataloader (they would be a
        1-rank state nobody may resume) and never ``export_dtype``: a seed is a training
        input, and a dtype change would be refused by the verified load.

        Raises:
            ConfigError: not step 0, or the folder already holds committed steps (the next run
                would resume from them and ignore the seed).
        """
        if curr_step != SEED_STEP:
            raise ConfigError("checkpoint.create_seed_checkpoint",
                              f"a seed is step {SEED_STEP} and ends the run; save({curr_step}) was called")
        store = Store(self.persistent_folder, **self._storage_options)
        committed = [s for s in (layout.parse_step(n) for n in store.listdir(""))
                     if s is not None and manifest.read_committed(store, layout.persistent_step(s))]
        if committed:
            raise ConfigError("checkpoint.create_seed_checkpoint",
                              f"{store.url} already holds committed steps {committed}: the next run resumes "
                              "from them and ignores a seed; use a new dump_folder or checkpoint.folder")
        t0 = time.perf_counter()
        rel = layout.persistent_step(SEED_STEP)
        store.makedirs(rel)
        # From here until the new seed is complete, step-0 reads as torn, never as an older
        # seed or as a seed torchtitan wrote (a complete .metadata without checksums).
        store.write_atomic(f"{rel}/{layout.INPROGRESS}", b"tierckpt seed checkpoint in progress\n")
        store.remove(f"{rel}/{SEED_MANIFEST}")
        for p in store.walk_files(rel):
            if p != layout.INPROGRESS:
                store.remove(f"{rel}/{p}")
        states = self.states[MODEL].state_dict()
        group = dist.new_group(backend="gloo") if dist.is_initialized() else None
        digests = write_dcp(states, store.url_of(rel), group)
        entries = []
        for p in manifest.data_files(store, rel):  # a file DCP wrote without hashing it is re-read
            e = manifest.hash_file(store, f"{rel}/{p}") if p not in digests else None
            entries.append(manifest.FileEntry(p, *digests[p]) if e is None else manifest.FileEntry(p, e.size, e.xxh3_64))
        store.fsync_tree(rel)
        # The data is durable: unmark before the manifest, so a complete seed never carries the
        # mark that lets persistent retention delete step-0 as torn.
        store.remove(f"{rel}/{layout.INPROGRESS}")
        store.write_atomic(f"{rel}/{SEED_MANIFEST}", manifest.manifest_bytes(
            entries, tier="seed", step=SEED_STEP, model_only=True, world_size=1, tensors=len(states)))
        log.info("tierckpt: seed checkpoint (model only, %d tensors, %d bytes) written to %s in %.2fs",
                 len(states), sum(e.size for e in entries), store.url_of(rel), time.perf_counter() - t0)
        return True

    def _maybe_wait_for_staging(self) -> None:
        """Wait for the staging copies of the last save (CUDA states are staged on a side
        stream into pinned buffers; CPU states by a background thread with ``cpu_staging =
        "overlapped"``: :meth:`tierckpt.TieredCheckpointer.wait_for_staging`); torchtitan
        calls this right before ``optimizers.step()``. Blocking CPU staging: returns at once."""
        if self.engine is not None:
            self.engine.wait_for_staging()

    def _wait_for_saving(self) -> None:
        """torchtitan's abstract "await ``save_future`` and clear it". This manager's saves never
        set it (they are the engine's, waited for through their handles); should a torchtitan
        path set it, the engine's background work is what it waits for."""
        if self.engine is not None:
            self.engine.wait()
        self.save_future = None

    # -- load ----------------------------------------------------------------------------------
    def _find_load_step(self, folder: str = "") -> int:
        """Only committed persistent steps count (never torn or model-only folders)."""
        steps = self._engine.persistent_steps() if self.engine else []
        return max(steps) if steps else -1

    @torch.no_grad()
    def _load(self, step: int = -1) -> bool:
        """Restore the newest committed step every node can be served from (or ``step``);
        with none anywhere, the seed checkpoint (model only), else torchtitan's initial-load
        path (``initial_load_path``, HF). ``step`` 0 is the seed, as in torchtitan.

        Another explicit ``step`` (``checkpoint.load_step``) is read-only with
        ``checkpoint.load_only`` (an evaluation never rewrites history); in a training run it
        is a rollback: the newer steps are superseded once this run commits its first step.

        Raises:
            ConfigError: ``load_step`` 0 in a training run while committed steps exist.
            FileNotFoundError: ``step`` does not exist.
            VerificationError: the seed is corrupt or incomplete.
        """
        t0 = time.perf_counter()
        if step == SEED_STEP:  # torchtitan: step 0 is the seed, loaded model-only
            newer = [] if self.load_only else sorted(self._engine.inventory().all_steps())
            if newer:  # this run's saves would overwrite and interleave with them
                raise ConfigError("checkpoint.load_step", f"0 is the seed checkpoint, but committed steps {newer} "
                                  "exist: a training run from the seed would write over them; name one of them, "
                                  "use checkpoint.load_only, or train from the seed in a new dump_folder")
            if self._load_seed(t0):
                return True
            raise FileNotFoundError(f"checkpoint.load_step=0: no seed checkpoint (step-0) in "
                                    f"{self._engine.persistent_url()}")
        states = self._states_to_load(model_only=False)
        if self.positions is not None:
            self.positions.loaded = None
        explicit = step != -1
        res = self._engine.restore(states, step=step if explicit else None,
                                  rollback=explicit and not self.load_only)
        if res is None:
            if step != -1:
                raise FileNotFoundError(f"checkpoint.load_step={step}: no committed checkpoint of that step")
            if self._load_seed(t0):
                return True
            return super()._load(-1)
        if MODEL in self.states:
            self.states[MODEL].load_state_dict(states)
        if self.positions is not None and DATALOADER in states:
            # after the restore, not inside it: a policy error must not read as a bad source
            log.info("tierckpt: dataloader positions: %s", self.positions.apply())
        self.last_restore = res
        self.tier_metrics.restored(res)
        log.info("tierckpt: resumed from step %d (%s) in %.2fs", res.step,
                 ", ".join(f"node {n}: {o.source.kind}" for n, o in res.sources.items()),
                 time.perf_counter() - t0)
        return True

    def _load_seed(self, t0: float) -> bool:
        """Load the seed checkpoint (``step-0``), model only, if there is one (collective).

        A tierckpt seed is checksum-verified (files split over the ranks) and loaded with the
        verifying planner; a seed torchtitan itself wrote (DCP ``.metadata``, no tierckpt
        files) is loaded as torchtitan loads it. The optimizer, lr scheduler, dataloader and
        step stay fresh. Rank 0 appends a ``restore`` record with ``step`` 0 and
        ``model_only`` true to the ledger.

        Returns:
            whether a seed was loaded (False: none in the persistent folder).
        Raises:
            VerificationError: the seed is corrupt or incomplete (its creation did not finish).
        """
        eng = self._engine
        store, rel, group = eng.persistent.store, layout.persistent_step(SEED_STEP), eng.groups.local_world
        found = None
        if eng.topo.rank == 0:  # one view of the shared folder for every rank
            found = _find_seed(store, rel)
        kind, doc = all_gather(found, group)[0] or (None, None)
        if kind is None:
            return False
        url = store.url_of(rel)
        if kind == "torn":
            raise VerificationError(f"seed checkpoint {url} is incomplete (its creation did not finish): re-run "
                                    "checkpoint.create_seed_checkpoint, or remove it to start from a fresh init")
        mine = manifest.entries_of(doc)[eng.topo.rank::eng.topo.world_size] if doc else []

        def verify():
            problems = manifest.verify_files(store, rel, mine)
            if problems:
                raise VerificationError("; ".join(problems[:3]))

        try:
            run_agreed(verify, group, f"verify seed {url}")
        except PeerFailure as e:
            raise VerificationError(f"seed checkpoint {url} is corrupt ({e}); re-create it with "
                                    "checkpoint.create_seed_checkpoint, or remove it to start from a fresh init") from e
        states = self.states[MODEL].state_dict()
        if doc is not None:
            read = eng.persistent.load(states, url, group)
        else:
            log.warning("tierckpt: seed %s has no tierckpt checksums (written by torchtitan); loading it unverified", url)
            dcp.load(states, checkpoint_id=url, process_group=group)
            read = 0
        self.states[MODEL].load_state_dict(states)
        secs = time.perf_counter() - t0
        per_rank = all_gather(read, group)
        per_node: dict[int, int] = {}
        for r, b in enumerate(per_rank):
            n = eng.topo.node_of_rank[r]
            per_node[n] = per_node.get(n, 0) + b
        eng.ledger.append(RestoreRecord(
            step=SEED_STEP, model_only=True, seconds=secs, attempts=1, persistent_bytes=sum(per_rank),
            bytes=sum(per_rank), checksummed=doc is not None,
            sources={str(n): {"source": "seed", "holder": None, "bytes": b, "seconds": secs}
                     for n, b in sorted(per_node.items())},
            failures=[]))
        log.info("tierckpt: loaded the seed checkpoint %s (model only; optimizer, dataloader and step fresh) "
                 "in %.2fs", url, secs)
        self.tier_metrics.emit(restore_metrics(SEED_STEP, secs, {n: "seed" for n in per_node}, nbytes=sum(per_rank),
                                               persistent_bytes=sum(per_rank)), SEED_STEP)
        return True

    def save_on_loader_death(self, exc: BaseException, trainer) -> Preempted | None:
        """The preemption save for a step that failed because the notice killed the
        DataLoader's workers while the trainer fetched a batch (:func:`tierckpt.preempted_by`):
        the model and optimizer still hold the last finished step, ``trainer.step - 1``, which
        is saved as a notice at the end of a step would be. Every rank that left the loop on an
        exception calls this: the save runs only when every rank's fetch failed on the notice
        at the same step, agreed within ``collective_timeout_s``
        (:func:`tierckpt.integration.agree_loader_death`; a rank already inside a
        collective must not leave the save hanging). Returns the
        :class:`~tierckpt.Preempted` to raise, or None when ``exc`` is something else (here or
        on another rank), no step finished in this run, or no agreement came in time."""
        if self.engine is None:
            return None
        sig = agree_loader_death(self.engine, exc, trainer.step - 1)
        if sig is None:
            return None
        trainer.step -= 1  # the failed step never ran its optimizer step: train_state says so
        log.warning("tierckpt: %s: the DataLoader's workers died on the notice while step %d fetched its batch; "
                    "saving step %d for the requeue", sig, trainer.step + 1, trainer.step)
        return self._engine.save_for_preemption(trainer.step, self._states_to_save(), sig)

    def _close(self) -> None:
        if self.engine is not None:
            # torchtitan's train.main closes the trainer inside ``except Exception`` on a
            # crash: record that run as unclean so the MTBF estimate counts it.
            exc = sys.exc_info()[1]
            clean = exc is None or isinstance(exc, Preempted)  # a preemption is a planned exit
            try:  # a clean close raises when a background save failed (TierFailedError), except
                # after a preemption: its exit status must stay "requeue me" (the ledger has it)
                self._engine.close(clean=clean, reason=str(exc) if isinstance(exc, Preempted) else repr(exc) if exc else "",
                                   raise_failures=not isinstance(exc, Preempted))
            finally:
                self.tier_metrics.poll(self._metrics_step)  # what finished while close() waited
                super()._close()
            return
        super()._close()


def _find_seed(store: Store, rel: str) -> tuple[str, dict | None] | None:
    """What ``rel`` holds: ("tierckpt", seed manifest), ("torchtitan", None) for a seed
    torchtitan wrote, ("torn", None) for one whose creation did not finish, or None."""
    try:
        doc = json.loads(store.read_bytes(f"{rel}/{SEED_MANIFEST}"))
    except (FileNotFoundError, NotADirectoryError):
        doc = None
    except (ValueError, OSError):
        return ("torn", None)
    if doc is not None:
        if not isinstance(doc, dict) or doc.get("format") != manifest.FORMAT or not doc.get("model_only"):
            return ("torn", None)
        return ("tierckpt", doc)
    if store.exists(f"{rel}/{layout.INPROGRESS}"):
        return ("torn", None)
    if store.exists(f"{rel}/.metadata") and not store.exists(f"{rel}/{layout.MARKER}"):
        return ("torchtitan", None)
    return None
