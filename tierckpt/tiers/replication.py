"""Neighbour replication of committed local steps (docs/architecture.md, "Save flow").

After every node has tried to commit step N locally, node n's files go to the other members
of its clique (``replication_jump`` J, ``replication_factor`` F, see :mod:`topology`), over
the engine's gloo group, in F−1 rounds: in round k the node at clique position p sends to
position p+k and receives from p−k. Local rank r of the sender streams its share of the files
to local rank r of the receiver, so every rank of a node moves data. Received files land in
``replicas/node-<n>/step-<N>/`` and are committed by the receiving node's leader with the
source's exact manifest, only once every share arrived with matching size and checksum.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch.distributed as dist

from tierckpt.cluster.collectives import all_gather, gather_reduced
from tierckpt.cluster.topology import Topology, clique
from tierckpt.io import layout, manifest
from tierckpt.io.storage import Store
from tierckpt.transport.transfer import Received, Transfer, run_transfers

log = logging.getLogger(__name__)


@dataclass
class ReplicationReport:
    """Outcome on this rank: ``committed`` source nodes whose replica this node now holds,
    ``failed`` {source node: reason}, ``bytes_received`` by this rank, ``seconds``."""

    committed: list[int]
    failed: dict[int, str]
    bytes_received: int
    seconds: float


def plan_replication(topo: Topology, step: int, node_ok: dict[int, bool],
                     pairs: set[tuple[int, int]] | None = None,
                     src_rels: dict[int, str] | None = None) -> list[Transfer]:
    """The transfers every rank runs for step ``step`` (same list on every rank).

    Args:
        node_ok: {node: committed its step}; a node not ok sends nothing.
        pairs: only these (source node, destination node) copies (None: every clique peer of
            every ok node), e.g. the copies a restore left missing.
        src_rels: {source node: directory of its state in its own root} (default
            ``local/step-<step>``; a remapped disk may hold it as a replica of itself).
    """
    out = []
    rpn = topo.ranks_per_node
    for k in range(1, topo.factor):
        for n in range(topo.nodes):
            if not node_ok.get(n):
                continue
            cl = clique(n, topo.nodes, topo.jump, topo.factor)
            dst_node = cl[(cl.index(n) + k) % topo.factor]
            if pairs is not None and (n, dst_node) not in pairs:
                continue
            src_ranks, dst_ranks = topo.ranks_of(n), topo.ranks_of(dst_node)
            for r in range(rpn):
                out.append(Transfer(
                    src_rank=src_ranks[r], dst_rank=dst_ranks[r],
                    src_rel=(src_rels or {}).get(n, layout.local_step(step)), dst_rel=layout.replica_step(n, step),
                    share=(r, rpn), tag=f"replica node-{n}→node-{dst_node} step-{step}",
                ))
    return out


def commit_received(store: Store, topo: Topology, node_group, results: dict[int, Received],
                    transfers: list[Transfer]) -> tuple[list[str], dict[str, str]]:
    """Gather every share a node received to its leader, which commits each complete,
    intact step directory with the source's manifest bytes (collective over ``node_group``).

    Returns:
        (committed destination directories, {destination directory: reason}) on every rank of
        the node; directories are paths relative to the root (each transfer's ``dst_rel``).
    """
    mine = {
        transfers[i].dst_rel: (r.ok, [e.__dict__ for e in r.entries], r.manifest_bytes, r.problems)
        for i, r in results.items()
    }
    gathered = all_gather(mine, node_group)
    outcome: dict[str, str | None] = {}
    if topo.is_node_leader:
        by_dir: dict[str, list] = {}
        for part in gathered:
            for rel, v in part.items():
                by_dir.setdefault(rel, []).append(v)
        for rel, parts in by_dir.items():
            problems = [p for (_, _, _, ps) in parts for p in ps]
            mbytes = next((m for (_, _, m, _) in parts if m is not None), None)
            if problems or mbytes is None:
                outcome[rel] = "; ".join(problems[:3]) or "no manifest received"
                continue
            got = {d["path"]: (d["size"], d["xxh3_64"]) for (_, es, _, _) in parts for d in es}
            want = {e.path: (e.size, e.xxh3_64) for e in manifest.entries_of(_loads(mbytes))}
            if got != want:
                outcome[rel] = f"received {len(got)} of {len(want)} files intact"
                continue
            try:
                store.fsync_tree(rel)
                manifest.commit_bytes(store, rel, mbytes)
                outcome[rel] = None
            except OSError as e:
                outcome[rel] = f"commit failed: {e}"
    outcome = all_gather(outcome, node_group)[0]
    ok = [rel for rel, err in outcome.items() if err is None]
    bad = {rel: err for rel, err in outcome.items() if err is not None}
    return ok, bad


def _and_by_node(parts: list[dict[int, bool]]) -> dict[int, bool]:
    """``reduce`` of ``{node: committed}`` flags: a node committed when all its ranks did."""
    out: dict[int, bool] = {}
    for part in parts:
        for n, ok in part.items():
            out[n] = out.get(n, True) and ok
    return out


def _loads(b: bytes) -> dict:
    import json

    return json.loads(b)


def replicate(store: Store, topo: Topology, world_group, node_group, step: int,
              local_ok: bool, chunk_bytes: int, pairs: set[tuple[int, int]] | None = None,
              src_rels: dict[int, str] | None = None) -> ReplicationReport:
    """Replicate step ``step`` to clique peers (collective over ``world_group`` and
    ``node_group``; every rank calls it, with ``local_ok`` saying whether its node committed).
    ``pairs`` and ``src_rels`` restrict and locate the copies (:func:`plan_replication`; the
    same on every rank). Failures are reported, never raised: a replica that did not arrive
    intact stays uncommitted and restore will not use it.
    """
    t0 = time.perf_counter()
    flags = gather_reduced({topo.node: bool(local_ok)}, world_group, _and_by_node)
    node_ok = {n: flags.get(n, True) for n in range(topo.nodes)}
    transfers = plan_replication(topo, step, node_ok, pairs, src_rels)
    if not transfers:
        return ReplicationReport([], {}, 0, time.perf_counter() - t0)
    incoming = sorted({t.dst_rel for t in transfers if topo.node_of_rank[t.dst_rank] == topo.node})
    if topo.is_node_leader:
        for rel in incoming:  # a stale or torn copy of the same step from an earlier run
            try:
                manifest.uncommit(store, rel)
                store.rmtree(rel)
            except OSError as e:  # the receive will fail and be reported; never skip the barrier
                log.warning("tierckpt: could not clear %s before replication: %s", store.url_of(rel), e)
    dist.barrier(group=node_group)
    results = run_transfers(transfers, topo.rank, store, world_group, chunk_bytes)
    ok, bad = commit_received(store, topo, node_group, results, transfers)
    src_of = {layout.replica_step(n, step): n for n in range(topo.nodes)}
    for rel, err in bad.items():
        log.warning("tierckpt: replica %s not committed on node %d: %s", rel, topo.node, err)
    return ReplicationReport(
        committed=sorted(src_of[r] for r in ok),
        failed={src_of[r]: e for r, e in bad.items()},
        bytes_received=sum(r.nbytes for r in results.values()),
        seconds=time.perf_counter() - t0,
    )
