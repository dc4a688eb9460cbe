"""Recovery: what a restart costs, measured (issue 31).

The ``recovery`` wing sits between ``restore`` and ``cli`` (docs/architecture.md, wing order):
it reads what the restore did (:class:`tierckpt.restore.RestoreResult`) and writes to the
ledger (:mod:`tierckpt.history`); the ``tierckpt`` command and the engine read it.

- :mod:`tierckpt.recovery.timeline`: the launchers' environment contract
  (``TIERCKPT_PROCESS_STARTED``, ``TIERCKPT_RECOVERY``), the rank-side phase stamps
  (:func:`~tierckpt.recovery.timeline.mark_phase`, the ``init_process_group`` hook) and the
  engine's :class:`~tierckpt.recovery.timeline.RecoveryTimeline`, which writes one ``recovery``
  ledger record (:class:`tierckpt.records.RecoveryRecord`) per run that restored.
"""
