"""tierckpt: multi-tier checkpointing (node-local, neighbour replicas, persistent) for PyTorch.

The public surface is what this module exports (:data:`__all__`, 16 names): what a training loop
that drives the engine needs, namely the engine and its configuration (:class:`TieredCheckpointer`,
:class:`TierConfig`, :class:`ScheduleOptions`), what its calls return (:class:`SaveHandle`, whose
futures resolve to a :class:`CheckpointRecord`, and :class:`RestoreResult`), preemption
(:class:`Preempted`, :data:`PREEMPTED_EXIT`, :func:`protect_loader_workers`, :func:`preempted_by`),
the persistent-tier extension point (:class:`PersistentIO`), and the errors a loop catches
(:class:`TierckptError` and :class:`ConfigError`, :class:`NoCheckpointError`,
:class:`TemplateMismatchError`, :class:`TierFailedError`; the rest, e.g.
:class:`~tierckpt.errors.VerificationError`, are in :mod:`tierckpt.errors` and derive from
:class:`TierckptError`). What the framework adapters need beyond that (collectives, restore
planning, metric helpers, tier names) is :mod:`tierckpt.integration`; a name that moved there
still resolves from here for one release, with a :class:`DeprecationWarning`.

Everything else is internal and may change between releases, except the documented extension
points: :class:`PersistentIO` (a framework's hooks into the persistent tier), the
``tierckpt.cli`` entry-point group (extra ``tierckpt`` subcommands), and :mod:`tierckpt.io`
(:mod:`~tierckpt.io.storage`, :mod:`~tierckpt.io.layout`, :mod:`~tierckpt.io.manifest`,
:mod:`~tierckpt.io.dcp_io`, :mod:`~tierckpt.io.planner`) for adapters and tools that read or
write steps in tierckpt's format.

Names resolve lazily (PEP 562), so ``import tierckpt`` and the ``tierckpt`` command do not import
torch.distributed until an engine class is used.

Wings (docs/architecture.md, "Wing order"; each imports only the wings before it): base
(errors, validators, records, priors, handle, preemption, loader signals, gcpause, readonly),
:mod:`tierckpt.cluster` (topology, process groups, collectives, accelerator), :mod:`tierckpt.io`
(storage, layout, manifests, DCP glue, planners, bounded reads), :mod:`tierckpt.config`
(:class:`TierConfig`), :mod:`tierckpt.sched` (cadence, Young/Daly intervals, MTBF,
simulation), :mod:`tierckpt.staging` (the state's copy inside ``save()``),
:mod:`tierckpt.transport` (a committed step between nodes), :mod:`tierckpt.history` (ledger,
journal, lineage, rollback, timeline), :mod:`tierckpt.tiers` (what each tier does; the lanes,
jobs and the save gate), :mod:`tierckpt.restore` (plan, read, pull, in-cluster load, peek,
the replica rebuild), :mod:`tierckpt.cli`, and on top the engine, its start and exit, metrics
and :mod:`tierckpt.integration`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tierckpt._lazy import lazy_exports as _lazy_exports

# name -> defining module; resolved on first access (PEP 562)
_EXPORTS = {
    "TieredCheckpointer": "tierckpt.engine",
    "TierConfig": "tierckpt.config",
    "ScheduleOptions": "tierckpt.config",
    "SaveHandle": "tierckpt.handle",
    "CheckpointRecord": "tierckpt.records",
    "RestoreResult": "tierckpt.restore",
    "PersistentIO": "tierckpt.tiers.persistent",
    "Preempted": "tierckpt.preemption",
    "PREEMPTED_EXIT": "tierckpt.preemption",
    "protect_loader_workers": "tierckpt.loader_signals",
    "preempted_by": "tierckpt.loader_signals",
    "TierckptError": "tierckpt.errors",
    "ConfigError": "tierckpt.errors",
    "NoCheckpointError": "tierckpt.errors",
    "TemplateMismatchError": "tierckpt.errors",
    "TierFailedError": "tierckpt.errors",
}

# Public names of earlier releases that moved to tierckpt.integration (adapter plumbing); they
# resolve from here until the next release, with a DeprecationWarning.
_MOVED = {name: "tierckpt.integration" for name in (
    "TIERS", "PeerFailure", "RestoreRecord", "VerificationError", "accelerator_present", "all_gather",
    "check_replication", "decision_metrics", "describe_failure", "plan_restore", "read_item",
    "record_metrics", "restore_metrics", "result_metrics", "run_agreed", "signal_numbers",
    "validate_tiers", "write_dcp")}

if TYPE_CHECKING:  # what mypy and IDEs see; at run time the names resolve lazily
    from tierckpt.config import ScheduleOptions, TierConfig
    from tierckpt.engine import TieredCheckpointer
    from tierckpt.errors import ConfigError, NoCheckpointError, TemplateMismatchError, TierckptError, TierFailedError
    from tierckpt.handle import SaveHandle
    from tierckpt.loader_signals import preempted_by, protect_loader_workers
    from tierckpt.preemption import PREEMPTED_EXIT, Preempted
    from tierckpt.records import CheckpointRecord
    from tierckpt.restore import RestoreResult
    from tierckpt.tiers.persistent import PersistentIO

__all__ = [
    "CheckpointRecord",
    "ConfigError",
    "NoCheckpointError",
    "PREEMPTED_EXIT",
    "PersistentIO",
    "Preempted",
    "RestoreResult",
    "SaveHandle",
    "ScheduleOptions",
    "TemplateMismatchError",
    "TierConfig",
    "TierFailedError",
    "TieredCheckpointer",
    "TierckptError",
    "preempted_by",
    "protect_loader_workers",
]

_getattr, _dir = _lazy_exports(__name__, _EXPORTS, _MOVED, globals())


def __getattr__(name: str) -> object:
    return _getattr(name)


def __dir__() -> list[str]:
    return _dir()
