"""What framework adapters (``titan_plugin``, ``mcore_plugin``, a user's own) need from tierckpt
beyond the user-facing :mod:`tierckpt` surface: the plumbing an adapter builds on.

- collectives over the engine's gloo group: :func:`all_gather`, :func:`run_agreed` (a call
  every rank runs, failing on all ranks together) and its :class:`PeerFailure`;
- topology and environment: :func:`check_replication` (a replication factor/jump that fits the
  node count), :func:`accelerator_present`, :func:`signal_numbers` (validated preemption signal
  names);
- the persistent tier and restore: :func:`write_dcp` (the persistent tier's DCP write),
  :func:`read_item` (one small item of a committed step), :func:`plan_restore` (which step and
  source a restore would use), :data:`TIERS`, :func:`validate_tiers`;
- metrics for a framework's logger: :func:`record_metrics`, :func:`restore_metrics`,
  :func:`result_metrics`, :func:`decision_metrics`, :func:`describe_failure`;
- what an adapter writes or raises itself: :class:`RestoreRecord` (a restore's ledger record),
  :class:`GenericRecord` (a ledger line of the adapter's own kind), :class:`VerificationError`;
- the recovery timeline's phase stamps (:mod:`tierckpt.recovery.timeline`): :func:`mark_phase`
  (``imports_done``, ``model_built``) and :func:`install_process_group_hook`
  (``process_group_up``), from the adapter's entry point;
- the agreed decision to save after a preemption notice killed the DataLoader's workers
  mid-fetch (engine-API trainers too): :func:`agree_loader_death`;
- option rules, for a front end that checks its own keys or flags with the engine's bounds and
  names them as the user wrote them: :data:`RULES` and :data:`SCHEDULE_RULES` (the rule of every
  numeric ``TierConfig`` / ``ScheduleOptions`` field), :class:`Number` (one rule) and the
  builders :func:`non_negative_int`, :func:`non_negative_seconds`, :func:`positive_number`
  (:mod:`tierckpt.validators`).

The framework adapters import tierckpt only through :mod:`tierckpt`, this module and the
documented extension points (:mod:`tierckpt.io` and its modules, :mod:`tierckpt.cli`); the
shape check ``adapter imports`` of ``make lint`` enforces it.

Names resolve lazily (PEP 562), as in :mod:`tierckpt`: importing this module does not import
torch.distributed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tierckpt._lazy import lazy_exports as _lazy_exports

# name -> defining module; resolved on first access (PEP 562)
_EXPORTS = {
    "all_gather": "tierckpt.cluster.collectives",
    "run_agreed": "tierckpt.cluster.collectives",
    "PeerFailure": "tierckpt.cluster.collectives",
    "check_replication": "tierckpt.cluster.topology",
    "accelerator_present": "tierckpt.cluster.accel",
    "signal_numbers": "tierckpt.preemption",
    "write_dcp": "tierckpt.tiers.persistent",
    "read_item": "tierckpt.restore.peek",
    "plan_restore": "tierckpt.restore",
    "TIERS": "tierckpt.config",
    "validate_tiers": "tierckpt.config",
    "record_metrics": "tierckpt.metrics",
    "restore_metrics": "tierckpt.metrics",
    "result_metrics": "tierckpt.metrics",
    "decision_metrics": "tierckpt.sched.cadence",
    "describe_failure": "tierckpt.tiers.jobs",
    "RestoreRecord": "tierckpt.records",
    "GenericRecord": "tierckpt.records",
    "VerificationError": "tierckpt.errors",
    "mark_phase": "tierckpt.recovery.timeline",
    "install_process_group_hook": "tierckpt.recovery.timeline",
    "RULES": "tierckpt.config",
    "SCHEDULE_RULES": "tierckpt.config",
    "Number": "tierckpt.validators",
    "non_negative_int": "tierckpt.validators",
    "non_negative_seconds": "tierckpt.validators",
    "positive_number": "tierckpt.validators",
    "agree_loader_death": "tierckpt.loader_signals",
}

if TYPE_CHECKING:  # what mypy and IDEs see; at run time the names resolve lazily
    from tierckpt.config import RULES, SCHEDULE_RULES, TIERS, validate_tiers
    from tierckpt.cluster.accel import accelerator_present
    from tierckpt.cluster.collectives import PeerFailure, all_gather, run_agreed
    from tierckpt.cluster.topology import check_replication
    from tierckpt.errors import VerificationError
    from tierckpt.loader_signals import agree_loader_death
    from tierckpt.restore.peek import read_item
    from tierckpt.metrics import record_metrics, restore_metrics, result_metrics
    from tierckpt.preemption import signal_numbers
    from tierckpt.records import GenericRecord, RestoreRecord
    from tierckpt.recovery.timeline import install_process_group_hook, mark_phase
    from tierckpt.restore import plan_restore
    from tierckpt.sched.cadence import decision_metrics
    from tierckpt.tiers.jobs import describe_failure
    from tierckpt.tiers.persistent import write_dcp
    from tierckpt.validators import Number, non_negative_int, non_negative_seconds, positive_number

__all__ = [
    "GenericRecord",
    "Number",
    "PeerFailure",
    "RULES",
    "RestoreRecord",
    "SCHEDULE_RULES",
    "TIERS",
    "VerificationError",
    "accelerator_present",
    "agree_loader_death",
    "all_gather",
    "check_replication",
    "decision_metrics",
    "describe_failure",
    "install_process_group_hook",
    "mark_phase",
    "non_negative_int",
    "non_negative_seconds",
    "plan_restore",
    "positive_number",
    "read_item",
    "record_metrics",
    "restore_metrics",
    "result_metrics",
    "run_agreed",
    "signal_numbers",
    "validate_tiers",
    "write_dcp",
]

_getattr, _dir = _lazy_exports(__name__, _EXPORTS, None, globals())


def __getattr__(name: str) -> object:
    return _getattr(name)


def __dir__() -> list[str]:
    return _dir()
