"""Where each tier keeps its steps, and the names of the commit files.

Local root of node n (template expanded)::

    <local_root>/local/step-<N>/                 node n's own DCP checkpoint of step N
    <local_root>/replicas/node-<m>/step-<N>/     a byte copy of node m's local step N
    <local_root>/local/.incoming-step-<N>/       a restore's pull of step N until it committed

Persistent root::

    <persistent_root>/step-<N>/                  global DCP checkpoint of step N
    <persistent_root>/tierckpt-ledger.jsonl      the ledger
    <persistent_root>/tierckpt-lineage.json      the lineage id of its steps (tierckpt.history.lineage)

Each step directory holds DCP's files (``.metadata``, ``__<r>_<i>.distcp``) plus
``tierckpt.manifest.json`` and, once committed, ``tierckpt.committed``.
"""

from __future__ import annotations

import re

MANIFEST = "tierckpt.manifest.json"
MARKER = "tierckpt.committed"
INPROGRESS = "tierckpt.inprogress"  # persistent steps tierckpt started (retention may clean them)
LEDGER = "tierckpt-ledger.jsonl"
LEDGER_DIR = "tierckpt-ledger.d"  # object stores: one object per record (tierckpt/history/ledger.py)
LINEAGE = "tierckpt-lineage.json"
RETENTION = "tierckpt-retention.json"  # why retention keeps each step (tierckpt/tiers/retention.py)
COMMIT_FILES = (MANIFEST, MARKER)

_STEP_RE = re.compile(r"^step-(\d+)$")
_NODE_RE = re.compile(r"^node-(\d+)$")


def step_name(step: int) -> str:
    """Directory name of ``step`` (``step-<N>``, as torchtitan names its folders)."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return f"step-{int(step)}"


def parse_step(name: str) -> int | None:
    """``step-<N>`` → N; anything else → None."""
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m else None


def parse_node(name: str) -> int | None:
    """``node-<n>`` → n; anything else → None."""
    m = _NODE_RE.match(name)
    return int(m.group(1)) if m else None


def local_step(step: int) -> str:
    """Relative path of a node's own step in its local root."""
    return f"local/{step_name(step)}"


INCOMING_PREFIX = ".incoming-"


def incoming_step(step: int) -> str:
    """Relative path, in a node's local root, where a restore pulls the node's step ``step``
    from a peer; renamed to :func:`local_step` once committed (never listed as a step)."""
    return f"local/{INCOMING_PREFIX}{step_name(step)}"


def replica_dir(node: int) -> str:
    """Relative path, in a holder's local root, of all replicas of node ``node``."""
    return f"replicas/node-{int(node)}"


def replica_step(node: int, step: int) -> str:
    """Relative path, in the holder's local root, of node ``node``'s replica of ``step``."""
    return f"{replica_dir(node)}/{step_name(step)}"


def persistent_step(step: int) -> str:
    """Relative path of a step in the persistent root."""
    return step_name(step)
