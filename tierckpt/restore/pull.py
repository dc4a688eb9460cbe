"""Pulls of a restore: a node served by a peer's replica receives its files (docs/architecture.md,
"Restore flow", step 4).

The files land in ``local/.incoming-step-<N>`` of the receiving node's root, are hashed on
receipt and committed there with the source's manifest; only then does the committed copy
replace ``local/step-<N>``. A pull that fails leaves the root as it was, so a failed source
never costs a copy another source could serve. The directory it replaces may be a valid copy
of another node's state (a disk that came back under another node id): that copy is kept,
renamed to ``replicas/node-<m>/step-<N>``, unless a committed copy of node m's step already
sits there.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from tierckpt.dist.collectives import all_gather
from tierckpt.dist.topology import Groups, Topology
from tierckpt.io import layout, manifest
from tierckpt.io.storage import Store
from tierckpt.restore.plan import REPLICA, Inventory, Source
from tierckpt.tiers.replication import commit_received
from tierckpt.tiers.retention import InUse
from tierckpt.tiers.transfer import Transfer, run_transfers

log = logging.getLogger(__name__)


@dataclass
class Pulled:
    """One node's outcome of the pulls of an attempt (the same on every rank of the node).

    Attributes:
        ok: this node received a pull and it is now its committed ``local/step-<N>``.
        error: why this node's pull failed (None when ok or when it received none).
        nbytes: bytes this rank received.
        memory: {file name: uint8 tensor of its bytes} of the files this rank received
            (verified on receipt), kept so the load reads them from memory; empty unless ok.
        kept: ``(node m, directory)`` where the copy of node m that ``local/step-<N>`` held
            before now is (None: it held no other node's committed copy).
    """

    ok: bool = False
    error: str | None = None
    nbytes: int = 0
    kept: tuple[int, str] | None = None
    # {file name in the step directory: bytes} this rank received, kept in memory so the load
    # does not read back what the pull just wrote (this rank's share only; set when ok)
    memory: dict[str, torch.Tensor] = field(default_factory=dict)


def plan_pulls(topo: Topology, inv: Inventory, s: int, sources: dict[int, Source], todo: set[int]) -> list[Transfer]:
    """The transfers of every node of ``todo`` served from a peer replica (same list on every
    rank): local rank r of the holder sends share r to local rank r of the node, into the
    node's :func:`~tierckpt.io.layout.incoming_step`."""
    out = []
    for n in sorted(todo):
        if sources[n].kind != REPLICA:
            continue
        h = sources[n].holder
        assert h is not None  # a replica source always names its holder
        for r in range(topo.ranks_per_node):
            out.append(Transfer(
                src_rank=topo.ranks_of(h)[r], dst_rank=topo.ranks_of(n)[r],
                src_rel=inv.holders(n, s).get(h, layout.replica_step(n, s)), dst_rel=layout.incoming_step(s),
                share=(r, topo.ranks_per_node), tag=f"pull node-{n} step-{s} from node-{h}",
            ))
    return out


def run_pulls(store: Store, topo: Topology, groups: Groups, in_use: InUse, chunk_bytes: int,
              pulls: list[Transfer], s: int) -> Pulled:
    """Run ``pulls`` (collective over ``groups.local_world`` and ``groups.node``; every rank
    passes the same non-empty list) and move each committed pull into place. Never raises for
    a transfer or disk problem: it is this node's :attr:`Pulled.error`."""
    receiving = any(topo.node_of_rank[t.dst_rank] == topo.node for t in pulls)
    tmp = layout.incoming_step(s)
    if receiving and topo.is_node_leader:
        try:
            _clear(store, tmp)
        except OSError as e:  # the pull will fail and be reported; never skip the barrier
            log.warning("tierckpt restore: cannot clear %s before the pull: %s", store.url_of(tmp), e)
    dist.barrier(group=groups.node)
    keys = {"local:" + t.src_rel for t in pulls if t.src_rank == topo.rank}
    if receiving:  # retention of a late local job must not delete what the swap moves
        keys |= {"local:" + layout.local_step(s)}
    for k in keys:
        in_use.hold(k)
    try:
        results = run_transfers(pulls, topo.rank, store, groups.local_world, chunk_bytes, keep=True)
        ok, bad = commit_received(store, topo, groups.node, results, pulls)
        out = Pulled(nbytes=sum(r.nbytes for r in results.values()))
        if receiving and topo.is_node_leader:
            if ok:
                try:
                    out.kept, out.ok = swap_in(store, topo.node, s), True
                except OSError as e:
                    out.error = f"committed pull not moved into {layout.local_step(s)}: {type(e).__name__}: {e}"
            else:
                out.error = "; ".join(bad.values()) or "pull failed"
        out.ok, out.error, out.kept = all_gather((out.ok, out.error, out.kept), groups.node)[0]
        if out.ok:
            out.memory = {p: b for r in results.values() for p, b in r.memory.items()}
    finally:
        for k in keys:
            in_use.drop(k)
    return out


def swap_in(store: Store, node: int, s: int) -> tuple[int, str] | None:
    """Replace ``local/step-<s>`` by the committed pull in :func:`~tierckpt.io.layout.incoming_step`.

    What ``local/step-<s>`` held is kept when it is another node m's committed copy: renamed to
    ``replicas/node-<m>/step-<s>``, or deleted only when a committed copy of m's step is already
    there (a duplicate). Anything else there (this node's own copy that failed, a torn
    directory) is replaced.

    Returns:
        (m, directory of m's copy now) when ``local/step-<s>`` held node m's copy, else None.
    Raises:
        OSError: a rename or delete failed; no committed copy was deleted before its
            replacement exists.
    """
    tmp, dst = layout.incoming_step(s), layout.local_step(s)
    doc = manifest.read_committed(store, dst)
    owner = doc.get("node") if doc is not None else None
    kept = None
    if isinstance(owner, int) and not isinstance(owner, bool) and owner != node:
        rep = layout.replica_step(owner, s)
        if manifest.read_committed(store, rep) is None:
            _clear(store, rep)
            store.makedirs(layout.replica_dir(owner))
            store.rename(dst, rep)
            log.warning("tierckpt restore: %s held node %d's step %d (a remapped disk): kept as %s",
                        store.url_of(dst), owner, s, rep)
        kept = (owner, rep)
    _clear(store, dst)
    store.rename(tmp, dst)
    return kept


def _clear(store: Store, rel: str) -> None:
    """Delete ``rel`` if it exists, marker first (never seen half-deleted as committed)."""
    if store.exists(rel):
        manifest.uncommit(store, rel)
        store.rmtree(rel)


def record_pulls(inv: Inventory, s: int, received: list[tuple[int, tuple[int, str] | None]]) -> None:
    """Update ``inv`` after the pulls of step ``s``: each ``(node, kept)`` of a node whose pull
    is now its ``local/step-<s>`` (``kept`` as :attr:`Pulled.kept`). Every rank applies the same
    all-gathered list, so later attempts plan from where the copies now are."""
    for h, kept in received:
        rel = layout.local_step(s)
        inv.copies.setdefault(s, {}).setdefault(h, {})[h] = rel
        inv.local.setdefault(h, set()).add(s)
        inv.dirs.setdefault(s, set()).add((h, rel))
        if kept is not None:
            m, mrel = kept
            inv.copies[s].setdefault(m, {})[h] = mrel
            inv.replicas.setdefault(m, {}).setdefault(h, set()).add(s)
            inv.dirs[s].add((h, mrel))
