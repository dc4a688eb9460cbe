"""Restore: plan from what the cluster holds, load from the fastest valid source, fall back
together (:mod:`tierckpt.restore.restorer`; the plan in :mod:`tierckpt.restore.plan`; pulls of
peer replicas in :mod:`tierckpt.restore.pull`; the in-cluster resharded read in
:mod:`tierckpt.restore.cluster`)."""

from tierckpt.restore.plan import CLUSTER, OWN, PERSISTENT, REPLICA, Inventory, Source, plan_restore, sources_for
from tierckpt.restore.restorer import NodeOutcome, Restorer, RestoreResult

__all__ = ["CLUSTER", "OWN", "PERSISTENT", "REPLICA", "Inventory", "NodeOutcome", "Restorer", "RestoreResult",
           "Source", "plan_restore", "sources_for"]
