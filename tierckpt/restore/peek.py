"""Read one small non-tensor item of a committed step without a full restore.

Frameworks that load in two passes (Megatron-LM reads the common state — ``args``,
``iteration`` — first, then the sharded state) would otherwise run two full restores: every
file verified twice, replicas pulled twice, two ``restore`` ledger records (which would also
halve the restart time R the adaptive scheduler measures). :func:`read_item` reads only the
files that hold the item, from a node-local copy (own step or a replica held for a peer):
the DCP ``.metadata`` and the one data file DCP placed the item in, both checked against the
step's manifest (xxh3-64) before they are used.

The persistent tier is not consulted: its format belongs to the framework. When only the
persistent tier has the step (every node-local copy lost), the caller falls back to a full
restore, which verifies the whole step.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from tierckpt.cluster.collectives import FAILURES
from tierckpt.io import layout, manifest, per_rank
from tierckpt.io.storage import Store
from tierckpt.restore import Inventory, plan_restore

log = logging.getLogger(__name__)


def local_copies(inv: Inventory, node: int, step: int) -> list[str]:
    """Directories (relative to ``node``'s local root) holding ``step``: its own step first,
    then the replicas it holds for peers (any node's copy serves a node-independent item)."""
    out = [layout.local_step(step)] if step in inv.local.get(node, ()) else []
    for src in sorted(inv.replicas):
        if step in inv.replicas[src].get(node, ()):
            out.append(layout.replica_step(src, step))
    return out


def read_from_copy(store: Store, rel: str, key: str) -> Any:
    """The value of ``key`` in the committed DCP checkpoint ``rel`` of ``store``.

    Verifies ``.metadata`` and the data file holding ``key`` against the manifest first.

    Raises:
        FileNotFoundError: the step is not committed.
        KeyError: the checkpoint has no item ``key``.
        ValueError: a checksum or size differs from the manifest (corrupt copy), or the saving
            ranks' values of ``key`` differ (:mod:`tierckpt.io.per_rank`).
        OSError: the files cannot be read.
    """
    m = manifest.read_committed(store, rel)
    if m is None:
        raise FileNotFoundError(f"{store.url_of(rel)} is not committed")
    entries = {e.path: e for e in manifest.entries_of(m)}

    def check(path: str) -> None:
        if path not in entries:
            raise ValueError(f"{store.url_of(rel)}/{path} is not in the manifest")
        problems = manifest.verify_files(store, rel, [entries[path]])
        if problems:
            raise ValueError("; ".join(problems))

    check(".metadata")
    reader = FileSystemReader(store.path(rel))
    md = reader.read_metadata()
    files = {info.relative_path for idx, info in md.storage_data.items() if idx.fqn == key}
    if not files:
        raise KeyError(f"{store.url_of(rel)} has no item {key!r}")
    if per_rank.differs(md, key):
        raise ValueError(f"{store.url_of(rel)}: {key!r} differs per rank (a full restore gives each rank its own)")
    for f in sorted(files):
        check(f)
    sd = {key: b""}
    dcp.load(sd, storage_reader=FileSystemReader(store.path(rel)), no_dist=True)
    return sd[key]


def read_item(engine, key: str, step: int | None = None) -> tuple[int, Any] | None:
    """Read the non-tensor item ``key`` of the step a restore would choose (or ``step``) from
    a node-local copy. Collective over the engine's ``local_world`` group; every rank gets the
    same answer.

    The nodes holding a copy are tried in node order: that node's leader reads and verifies it
    (:func:`read_from_copy`) and broadcasts the value; a corrupt or unreadable copy moves on to
    the next copy, then the next node. The item must be the same in every node's copy (state
    that is not sharded, such as a framework's common state).

    Args:
        engine: the job's :class:`tierckpt.engine.TieredCheckpointer`.
        key: DCP key of the item (a bytes or picklable object, not a tensor).
        step: the step; None = the newest step every node can be served from.
    Returns:
        ``(step, value)``, or None when no node-local copy of that step exists or none could
        be read (the caller then reads the persistent tier or runs a full restore).
    """
    if engine.local is None:
        return None
    t0 = time.perf_counter()
    engine.wait()
    topo, group = engine.topo, engine.groups.local_world
    inv = engine.restorer.inventory()
    plan = plan_restore(inv, topo.nodes, set(), step)
    if plan is None:
        return None
    s = plan[0]
    for node in range(topo.nodes):
        copies = local_copies(inv, node, s)
        if not copies:
            continue
        leader = topo.ranks_of(node)[0]
        box: list = [None]
        if topo.rank == leader:
            errors = []
            for rel in copies:
                try:
                    box[0] = (True, read_from_copy(engine.local.store, rel, key))
                    break
                except FAILURES as e:  # anything: every rank must reach the broadcast below
                    errors.append(f"{rel}: {type(e).__name__}: {e}")
            else:
                box[0] = (False, errors)
        dist.broadcast_object_list(box, src=leader, group=group)
        ok, value = box[0]
        if ok:
            log.info("tierckpt: read %r of step %d from node %d's local disk in %.3fs", key, s, node,
                     time.perf_counter() - t0)
            return s, value
        log.warning("tierckpt: node %d could not read %r of step %d: %s", node, key, s, "; ".join(value))
    return None
