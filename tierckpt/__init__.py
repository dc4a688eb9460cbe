"""tierckpt: multi-tier checkpointing (node-local, neighbour replicas, persistent) for PyTorch.

The public surface is what this module exports (:data:`__all__`); adapters and users import from
here. Everything else is internal and may change between releases, except the documented
extension points: :class:`PersistentIO` (a framework's hooks into the persistent tier), the
``tierckpt.cli`` entry-point group (extra ``tierckpt`` subcommands), and :mod:`tierckpt.io`
(:mod:`~tierckpt.io.storage`, :mod:`~tierckpt.io.layout`, :mod:`~tierckpt.io.manifest`,
:mod:`~tierckpt.io.dcp_io`, :mod:`~tierckpt.io.planner`) for adapters and tools that read or
write steps in tierckpt's format.

Names resolve lazily (PEP 562), so ``import tierckpt`` and the ``tierckpt`` command do not import
torch.distributed until an engine class is used.

Wings (see docs/architecture.md): :mod:`tierckpt.io` (storage, layout, manifests, DCP glue,
planners, staging), :mod:`tierckpt.tiers` (local tier, persistent tier, replication, transfer,
retention, the shared commit routine), :mod:`tierckpt.dist` (topology, groups, agreement),
:mod:`tierckpt.sched` (Young/Daly intervals, MTBF, simulation), :mod:`tierckpt.history`
(ledger, lineage, rollback), :mod:`tierckpt.cli`.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "TieredCheckpointer": "tierckpt.engine",
    "describe_failure": "tierckpt.tiers.jobs",
    "TierConfig": "tierckpt.config",
    "ScheduleOptions": "tierckpt.config",
    "TIERS": "tierckpt.config",
    "validate_tiers": "tierckpt.config",
    "SaveHandle": "tierckpt.handle",
    "CheckpointRecord": "tierckpt.records",
    "RestoreRecord": "tierckpt.records",
    "RestoreResult": "tierckpt.restore",
    "plan_restore": "tierckpt.restore",
    "read_item": "tierckpt.io.peek",
    "decision_metrics": "tierckpt.sched.cadence",
    "record_metrics": "tierckpt.metrics",
    "restore_metrics": "tierckpt.metrics",
    "result_metrics": "tierckpt.metrics",
    "PersistentIO": "tierckpt.tiers.persistent",
    "Preempted": "tierckpt.preemption",
    "PREEMPTED_EXIT": "tierckpt.preemption",
    "TierckptError": "tierckpt.errors",
    "ConfigError": "tierckpt.errors",
    "VerificationError": "tierckpt.errors",
    "NoCheckpointError": "tierckpt.errors",
    "TierFailedError": "tierckpt.errors",
    "TemplateMismatchError": "tierckpt.errors",
    "accelerator_present": "tierckpt.dist.accel",
    "check_replication": "tierckpt.dist.topology",
    "all_gather": "tierckpt.dist.collectives",
    "run_agreed": "tierckpt.dist.collectives",
    "PeerFailure": "tierckpt.dist.collectives",
    "signal_numbers": "tierckpt.preemption",
    "protect_loader_workers": "tierckpt.loader_signals",
    "preempted_by": "tierckpt.loader_signals",
    "write_dcp": "tierckpt.tiers.persistent",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    mod = _EXPORTS.get(name)
    if mod is None:
        raise AttributeError(f"module 'tierckpt' has no attribute {name!r}")
    value = getattr(importlib.import_module(mod), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
