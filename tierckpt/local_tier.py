"""Local tier: one DCP checkpoint per node, in the node-local root, saved over the node group.

Each node's checkpoint keeps global chunk coordinates (DTensor/ShardedTensor offsets), so the
node's ``.metadata`` lists exactly the global chunks the node holds; dedup of replicated
values happens inside the node only. Every node is self-sufficient for a same-topology
restore, and the planning cost grows with ranks per node, not with the world.
"""

from __future__ import annotations

import logging
import time

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from . import layout, lineage, manifest
from .collectives import all_gather, run_agreed
from .dcp_io import crc32_off, digests_under, hashing_writer
from .planner import NodeLocalSavePlanner, VerifyingLoadPlanner
from .storage import Store
from .topology import Topology

log = logging.getLogger(__name__)


def hash_split(store: Store, step_rel: str, files: list[str], index: int, count: int) -> list[manifest.FileEntry]:
    """Checksum this rank's share (``files[index::count]``) of a step's files."""
    return [
        manifest.FileEntry(f, *_hash(store, f"{step_rel}/{f}")) for f in files[index::count]
    ]


def written_entries(store: Store, rel: str, mine: dict[str, tuple[int, str]], index: int, count: int,
                    group) -> list[manifest.FileEntry]:
    """Checksums of a just-saved step: ``mine`` ({relative path: (size, xxh3-64)} hashed by this
    rank while writing), plus a re-read of any file no rank hashed (split ``index::count``
    across the group's ranks). Collective over ``group`` (all-gathers which files were hashed)."""
    hashed = set().union(*all_gather(sorted(mine), group))
    missing = [f for f in manifest.data_files(store, rel) if f not in hashed]
    return [manifest.FileEntry(p, s, h) for p, (s, h) in sorted(mine.items())] + \
        hash_split(store, rel, missing, index, count)


def _hash(store: Store, rel: str) -> tuple[int, str]:
    e = manifest.hash_file(store, rel)
    return e.size, e.xxh3_64


class LocalTier:
    """A node's local-tier directory and its save/verify/load operations.

    Args:
        store: the node's local root (``TierConfig.local_root`` expanded for this node).
        topo: the job topology.
        node_group: gloo group of this node's ranks.
        lineage: the job's lineage id (:mod:`tierckpt.lineage`), recorded in every step it
            commits; committed steps of another lineage are not listed as this job's. None:
            every committed step is listed (no lineage known).
    """

    def __init__(self, store: Store, topo: Topology, node_group: dist.ProcessGroup,
                 lineage: str | None = None):
        self.store = store
        self.topo = topo
        self.group = node_group
        self.lineage = lineage
        self.adopt_unlabelled = False  # steps recording no lineage are this job's (lineage.ensure)

    # -- save ---------------------------------------------------------------------------------
    def save(self, staged: dict, step: int) -> int:
        """Write and commit ``local/step-<step>`` (collective over the node group).

        Returns:
            bytes of the node's committed step (the same on every rank of the node).
        Raises:
            PeerFailure / CheckpointException: any rank of the node failed; the step is left
            uncommitted (invisible to restore and retention) on every rank.
        """
        rel = layout.local_step(step)
        topo = self.topo

        def prepare():
            if topo.is_node_leader:
                manifest.uncommit(self.store, rel)
                self.store.rmtree(rel)
                self.store.makedirs(rel)

        run_agreed(prepare, self.group, f"local step {step}: prepare")
        writer = hashing_writer(self.store.path(rel))
        with crc32_off():
            dcp.save(staged, storage_writer=writer, planner=NodeLocalSavePlanner(), process_group=self.group)
        entries = run_agreed(
            lambda: written_entries(self.store, rel, digests_under(writer, self.store.path(rel)),
                                    topo.local_rank, topo.ranks_per_node, self.group),
            self.group, f"local step {step}: checksum",
        )
        gathered = all_gather(entries, self.group)

        def do_commit():
            if topo.is_node_leader:
                self.store.fsync_tree(rel)  # DCP fsyncs its files; this also covers the dirs
                manifest.commit(
                    self.store, rel, [e for part in gathered for e in part],
                    tier="local", step=step, node=topo.node, ranks=topo.local_ranks,
                    world_size=topo.world_size, nodes=topo.nodes, lineage=self.lineage,
                )

        run_agreed(do_commit, self.group, f"local step {step}: commit")
        return sum(e.size for part in gathered for e in part)

    # -- inventory -----------------------------------------------------------------------------
    def scan(self) -> tuple[list[int], dict[int, list[int]], list[tuple[str, str | None]]]:
        """One pass over the local root's committed steps (each manifest read once).

        Returns:
            ``(own steps ascending, {source node: replica steps ascending}, foreign)`` where
            the first two hold only steps of this tier's lineage and ``foreign`` lists the
            committed steps and replicas of another lineage (or of none) as
            ``(path relative to the root, their lineage id or None)``.
        """
        own: list[int] = []
        reps: dict[int, list[int]] = {}
        foreign: list[tuple[str, str | None]] = []
        dirs = [(None, "local")] + [(n, layout.replica_dir(n)) for n in
                                    (layout.parse_node(x) for x in self.store.listdir("replicas")) if n is not None]
        for n, parent in dirs:
            for name in self.store.listdir(parent):
                s = layout.parse_step(name)
                if s is None:
                    continue
                rel = layout.local_step(s) if n is None else layout.replica_step(n, s)
                doc = manifest.read_committed(self.store, rel)
                if doc is None:
                    continue
                if lineage.is_foreign(doc, self.lineage, self.adopt_unlabelled):
                    foreign.append((rel, lineage.of_manifest(doc)))
                elif n is None:
                    own.append(s)
                else:
                    reps.setdefault(n, []).append(s)
        return sorted(own), {n: sorted(v) for n, v in sorted(reps.items())}, foreign

    def committed_steps(self) -> list[int]:
        """Steps of ``local/`` with a valid commit marker and this tier's lineage, ascending."""
        return self.scan()[0]

    def committed_replicas(self) -> dict[int, list[int]]:
        """Committed replica steps of this tier's lineage held here, per source node:
        {node: [steps ascending]}."""
        return self.scan()[1]


def verify_split(store: Store, rel: str, index: int, count: int) -> list[str]:
    """Verify this rank's share of a committed step's files; returns problems ([] = intact)."""
    doc = manifest.read_committed(store, rel)
    if doc is None:
        return [f"{store.url_of(rel)}: not committed"]
    entries = manifest.entries_of(doc)[index::count]
    return manifest.verify_files(store, rel, entries)


def load_dir(state_dict: dict, path: str, group: dist.ProcessGroup) -> int:
    """DCP-load ``state_dict`` in place from a checkpoint directory over ``group``.

    Uses :class:`VerifyingLoadPlanner`: nothing is read unless the checkpoint covers every
    local chunk with the same dtype. Returns bytes read by this rank.
    """
    from .persistent import CountingFileSystemReader

    reader = CountingFileSystemReader(path)
    t0 = time.perf_counter()
    dcp.load(state_dict, storage_reader=reader, planner=VerifyingLoadPlanner(), process_group=group)
    log.debug("loaded %s in %.3fs", path, time.perf_counter() - t0)
    return reader.bytes_read
