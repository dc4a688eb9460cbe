"""The plugin's local tier behind Megatron-LM's ``--non-persistent-ckpt-type local`` path.

Megatron-LM (``megatron/training/checkpointing.py``, 0.16 and 0.19) drives local
checkpoints through an object in ``checkpointing_context['local_checkpoint_manager']``,
normally nvidia-resiliency-ext's ``LocalCheckpointManager``, and converts state dicts with
``MCoreTensorAwareStateDict``:

- save: ``tasd, cache = MCoreTensorAwareStateDict.from_state_dict(sharded_state_dict, algo=,
  cached_metadata=, parallelization_group=)`` then ``manager.save(tasd, iteration,
  is_async=)`` (an ``AsyncRequest`` or None); ``manager.local_ckpt_dir`` names the directory
  in log lines;
- load: ``manager.find_latest()`` (collective; -1 = none) is compared with the persistent
  tracker's iteration; when not older, ``tasd, name = manager.load()`` and
  ``tasd.to_state_dict(sharded_state_dict, algo=, parallelization_group=)`` gives the loaded
  state dict. Megatron calls this twice: first with ``sharded_state_dict=None`` for the common
  part only (``args``, ``iteration``, …), then with the full template.

:class:`TieredLocalCheckpointManager` implements that interface on
:class:`mcore_plugin.tiers.MegatronTiers` and :class:`LocalStateDictHolder` replaces
``MCoreTensorAwareStateDict`` (``mcore_plugin.install`` routes Megatron's name to it while the
plugin is on). Differences from nvrx's manager, on purpose: data is keyed by node, not by
global rank (a rank↔node remap after a restart still finds it); replicas follow J/F by node;
every file is checksummed; a restore falls back to a peer's replica and then to the
persistent tier, so ``find_latest`` reports the newest step *every node* can be served from
in any tier (Megatron then takes this path whenever it is not older than ``--load``'s
tracker).

Which step is loaded is the engine's restore plan, not ``find_latest``'s number: ``find_latest``
only lists commit markers, and a step whose files fail verification on every copy would
otherwise be pinned on every restart (a crash loop). The load restores the newest step that
passes verification (``restore(step=None)``); Megatron-LM takes the resumed iteration from the
loaded state dict (``state_dict['iteration']`` in ``load_checkpoint``), so it resumes at the
step actually restored. An explicit step (``--ckpt-step``) is returned by ``find_latest`` and
loaded from whichever tier holds it: read-only, or a rollback in a training run.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

log = logging.getLogger("mcore_plugin.local_manager")


class LocalStateDictHolder:
    """Stand-in for ``MCoreTensorAwareStateDict`` on the plugin's local path.

    On save it keeps Megatron's sharded state dict as is (the tiers stage it themselves); on
    load it is the handle :meth:`to_state_dict` restores through.

    Attributes:
        state_dict: the Megatron state dict of a save (None for a load handle).
        manager: the manager of a load handle.
        step: the step a load handle restores (None: the newest verified one).
    """

    def __init__(self, state_dict: dict | None = None, *, manager: "TieredLocalCheckpointManager | None" = None,
                 step: int | None = None):
        self.state_dict = state_dict
        self.manager = manager
        self.step = step

    @classmethod
    def from_state_dict(cls, sharded_state_dict: dict, algo: str = "fully_parallel",
                        parallelization_group=None, cached_metadata=None):
        """Megatron's signature; ``algo``, the group and the cache do not apply (the tiers plan
        per node and dedup inside the node). Returns ``(holder, None)``."""
        return cls(sharded_state_dict), None

    @property
    def is_hollow(self) -> bool:
        return False

    def to_state_dict(self, sharded_state_dict: dict | None = None, algo: str = "atomic",
                      exchange_algo: str = "broadcast", validate_access_integrity: bool = True,
                      parallelization_group=None, strict=None, return_mismatch_keys: bool = False):
        """Restore this handle's step (collective): the explicit step, or (``step`` None) the
        newest step that passes verification.

        Args:
            sharded_state_dict: Megatron's load template; None or empty loads only the common
                part (Megatron's first, rank-0 pass reads ``args`` and ``iteration`` from it).
        Returns:
            the loaded state dict (common values + loaded tensors, like
            ``dist_checkpointing.load``); with ``return_mismatch_keys`` also ``([], [])``.
        Raises:
            RuntimeError: a save holder (no step to restore).
            tierckpt.errors.NoCheckpointError: the step can no longer be served by any tier.
        """
        if self.manager is None:
            raise RuntimeError("LocalStateDictHolder: this holder was made for a save, not a load")
        out = self.manager.restore(self.step, sharded_state_dict or None)
        return (out, [], []) if return_mismatch_keys else out


class TieredLocalCheckpointManager:
    """Megatron-LM's local checkpoint manager interface on the plugin's tiers.

    Args:
        tiers: the job's :class:`mcore_plugin.tiers.MegatronTiers` (local tier on).
        regenerate: ``state_dict_fn(fmt, is_loading)`` rebuilding Megatron's recorded state
            dict in another distributed-optimizer format (``mcore_plugin.install`` records
            ``generate_state_dict``); needed when a restore is served by the persistent tier,
            whose optimizer format differs from the local tier's.
        step: an explicit step to load (Megatron's ``--ckpt-step``) from whichever tier holds
            it; None = the newest verified step.
        rollback: with ``step``, this run trains on from it: the newer steps are superseded
            at its first commit (:mod:`tierckpt.history.rollback`). False = read-only.

    Attributes:
        local_ckpt_dir: this node's local root (Megatron prints it).
        latest_iteration: result of the last :meth:`find_latest` (-1 = none), as nvrx's.
        last_saved_step: iteration of this process's last local save (None before one).
        last_restore: :class:`tierckpt.restore.RestoreResult` of the last full load.
    """

    def __init__(self, tiers: Any, regenerate: Callable[[str, bool], dict] | None = None, *,
                 step: int | None = None, rollback: bool = False):
        self.tiers = tiers
        self.regenerate = regenerate
        self.step = step
        self.rollback = bool(rollback and step is not None)
        eng = tiers.engine
        self.local_ckpt_dir = eng.local.store.url if eng.local is not None else str(eng.cfg.local_root)
        self.latest_iteration = -1
        self.last_restore = None
        self.last_saved_step: int | None = None

    # -- save --------------------------------------------------------------------------------
    def save(self, state_dict: LocalStateDictHolder, iteration: int, is_async: bool = False):
        """Stage ``state_dict`` and write it to the local tier (+ replicas) in the background
        (collective). Returns None: Megatron's local path only logs in its finalize step, and
        the engine commits (manifest, marker, replication) on its own; a later save of the
        tier or a restore waits for it.

        Raises:
            TypeError: ``state_dict`` is not a :class:`LocalStateDictHolder` (the install hook
                was bypassed).
        """
        if not isinstance(state_dict, LocalStateDictHolder) or state_dict.state_dict is None:
            raise TypeError("TieredLocalCheckpointManager.save expects the LocalStateDictHolder made by "
                            "MCoreTensorAwareStateDict.from_state_dict with mcore_plugin installed")
        handle = self.tiers.save(int(iteration), state_dict.state_dict, tiers=["local"])
        delta = handle.blocking_s
        if "local" in handle.futures:  # a deferred save (busy_tier_policy) wrote nothing
            self.last_saved_step = int(iteration)
        self.latest_iteration = -1
        log.info("tierckpt local tier: step %d staged in %.3fs (writing in the background)", iteration, delta)
        return None

    # -- load --------------------------------------------------------------------------------
    def find_latest(self) -> int:
        """Newest step every node can be served from (own local > peer replica > persistent),
        or -1 (collective: gathers every node's committed steps). Waits for background saves.

        Only commit markers are read: :meth:`load` restores the newest step whose files pass
        verification, which may be older (Megatron resumes from the loaded state's
        iteration). With an explicit ``step`` that step, when every node can be served it.

        Raises:
            tierckpt.errors.NoCheckpointError: the explicit step is not committed for every
                node in any tier (names ``--ckpt-step`` and the committed steps).
        """
        from tierckpt.integration import plan_restore

        eng = self.tiers.engine
        eng.wait()
        inv = eng.inventory()
        plan = plan_restore(inv, eng.topo.nodes, set(), self.step)
        if self.step is not None and plan is None:
            from tierckpt import NoCheckpointError

            raise NoCheckpointError(f"--ckpt-step {self.step}: no tier holds that step for every node; committed "
                                    f"steps (any tier, any node): {sorted(inv.all_steps())}")
        self.latest_iteration = plan[0] if plan is not None else -1
        return self.latest_iteration

    def load(self):
        """``(handle, name)``: the handle's ``to_state_dict`` (Megatron calls it right after)
        restores the explicit step, or the newest step that passes verification, not
        necessarily :meth:`find_latest`'s (see the module docstring).

        Raises:
            RuntimeError: :meth:`find_latest` found nothing (Megatron never calls it then).
        """
        if self.latest_iteration < 0:
            raise RuntimeError("TieredLocalCheckpointManager.load: call find_latest() first (no step found)")
        name = f"{self.local_ckpt_dir} (tierckpt step {self.step if self.step is not None else 'newest verified'})"
        return LocalStateDictHolder(manager=self, step=self.step), name

    def restore(self, step: int | None, template: dict | None) -> dict:
        """Restore ``step`` (None: the newest step that passes verification, in any tier) into
        ``template``. Collective.

        ``template`` None: the common part only (Megatron's first pass: ``args`` and the like,
        the same in every step of a run), read from one verified node-local copy of the
        newest committed step when there is one, not a full restore; the full load that
        follows decides the step and the resumed iteration.

        Raises:
            tierckpt.errors.NoCheckpointError: nothing restorable (any more).
        """
        if template is None:
            got = self.tiers.read_common(step)
            if got is not None:
                return got[1]
        local_fmt = self.tiers.format_of("local")

        def fn(fmt: str, is_loading: bool) -> dict:
            if template is None:
                return {}
            if fmt == local_fmt or self.regenerate is None:
                return template
            return self.regenerate(fmt, True)

        # the common-only pass must not arm the rollback: the full load that follows does
        out = self.tiers.restore(fn, step=step, rollback=self.rollback and template is not None)
        if out is None:
            from tierckpt import NoCheckpointError

            raise NoCheckpointError(f"find_latest found step {self.latest_iteration} but nothing is committed now")
        res = self.tiers.last_restore
        if template is not None:
            self.last_restore = res
            if res is not None:
                if res.step != self.latest_iteration and self.tiers.last_restore_reason is not None:
                    log.warning("tierckpt: find_latest listed step %d; restored step %d because the %s "
                                "(Megatron resumes from the loaded iteration)", self.latest_iteration, res.step,
                                self.tiers.last_restore_reason)
                elif res.step != self.latest_iteration:
                    log.warning("tierckpt: find_latest listed step %d but it failed verification on every copy; "
                                "restored step %d (Megatron resumes from the loaded iteration)",
                                self.latest_iteration, res.step)
                self.latest_iteration = res.step
                log.info("tierckpt: restored step %d: %s; persistent bytes read: %d", res.step,
                         {n: res.source_of(n) for n in res.sources}, res.persistent_bytes_read)
        return out
