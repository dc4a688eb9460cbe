"""Local tier: one DCP checkpoint per node, in the node-local root, saved over the node group.

Each node's checkpoint keeps global chunk coordinates (DTensor/ShardedTensor offsets), so the
node's ``.metadata`` lists exactly the global chunks the node holds; dedup of replicated
values happens inside the node only. Every node is self-sufficient for a same-topology
restore, and the planning cost grows with ranks per node, not with the world.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from tierckpt.cluster.topology import Topology
from tierckpt.history import lineage
from tierckpt.history.timeline import LEGACY_ORDER, Descent, SaveIdentity, descent_of, of_manifest
from tierckpt.io import layout, manifest, plan_cache
from tierckpt.io.bounded import Progress, run_bounded
from tierckpt.io.dcp_io import (
    CountingFileSystemReader,
    crc32_off,
    digests_under,
    hashing_writer,
)
from tierckpt.io.memory_read import MemoryReader
from tierckpt.io.plan_cache import PlanCache
from tierckpt.io.planner import NodeLocalSavePlanner, VerifyingLoadPlanner
from tierckpt.io.storage import Store
from tierckpt.tiers.commit import save_step

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Copy:
    """One committed node-local copy of a saved node's state, as a local root holds it.

    Attributes:
        step: the step.
        node: the node whose state it is, in the job that saved it (the manifest's ``node``).
        rel: its directory relative to the local root (``local/step-N`` or
            ``replicas/node-m/step-N``).
        nodes, world_size: node count and world size of the job that saved it (None when the
            manifest does not say).
        replica_of: the node of its ``replicas/node-m`` directory; None when it sits in ``local/``.
        save_id, order: the identity of the save that wrote it (:mod:`tierckpt.history.timeline`;
            None and ``LEGACY_ORDER`` for a copy that records none).
        descent: what that save descends from (its ``descends_from``), None when none recorded.
    """

    step: int
    node: int
    rel: str
    nodes: int | None
    world_size: int | None
    replica_of: int | None
    save_id: str | None = None
    order: tuple[int, int] = LEGACY_ORDER
    descent: Descent | None = None


def _node_id(v) -> int:
    """A manifest's node id; -1 when it has none (such a copy serves no node)."""
    n = _int_or(v)
    return -1 if n is None else n


def _int_or(v, default: int | None = None) -> int | None:
    try:
        return int(v)
    except (TypeError, ValueError):
        return default


class LocalTier:
    """A node's local-tier directory and its save/verify/load operations.

    Args:
        store: the node's local root (``TierConfig.local_root`` expanded for this node).
        topo: the job topology.
        node_group: gloo group of this node's ranks.
        lineage: the job's lineage id (:mod:`tierckpt.history.lineage`), recorded in every step it
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
        self.plan_cache = PlanCache()  # the last committed save's DCP plans (tierckpt.io.plan_cache)

    def drop_plan_cache(self) -> None:
        """Plan the next save in full (after a restore: the state may be rebuilt differently)."""
        self.plan_cache.drop()

    # -- save ---------------------------------------------------------------------------------
    def save(self, staged: dict, step: int, before_commit: Callable[[], None] | None = None,
             identity: SaveIdentity | None = None) -> int:
        """Write and commit ``local/step-<step>`` (collective over the node group);
        ``before_commit`` as in :func:`tierckpt.tiers.commit.save_step`; ``identity``: the save
        this copy belongs to, recorded in its manifest (None: none recorded).

        Returns:
            bytes of the node's committed step (the same on every rank of the node).
        Raises:
            PeerFailure / CheckpointException: any rank of the node failed; the step is left
            uncommitted (invisible to restore and retention) on every rank.
        """
        rel = layout.local_step(step)
        topo = self.topo

        def write() -> dict[str, tuple[int, str]]:
            writer = hashing_writer(self.store.path(rel), self.store.modes, self.store.root)
            with crc32_off():
                plan_cache.save(staged, writer, NodeLocalSavePlanner(), self.group, self.plan_cache)
            return digests_under(writer, self.store.path(rel))

        try:
            nbytes = save_step(self.store, rel, write, self.group, index=topo.local_rank, count=topo.ranks_per_node,
                               leader=topo.is_node_leader, label=f"local step {step}", tier="local", step=step,
                               node=topo.node, ranks=topo.local_ranks, world_size=topo.world_size, nodes=topo.nodes,
                               lineage=self.lineage, before_commit=before_commit,
                               **(identity.manifest_fields() if identity is not None else {}))
        except BaseException:  # agreed over the group: every rank drops it
            self.plan_cache.drop()
            raise
        self.plan_cache.promote()  # committed on every rank of the node (save_step's agreed commit)
        return nbytes

    # -- inventory -----------------------------------------------------------------------------
    def survey(self) -> tuple[list[Copy], list[tuple[str, str | None]]]:
        """One pass over the local root's committed steps (each manifest read once).

        Returns:
            ``(copies, foreign)``: ``copies`` are the committed steps of this tier's lineage,
            own (``local/``) and replicas, each naming the node whose state it holds as its
            manifest records it (a disk that came back under another node id holds another
            node's state in ``local/``); ``foreign`` lists the committed steps and replicas of
            another lineage (or of none) as ``(path relative to the root, lineage id or None)``.
        """
        copies: list[Copy] = []
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
                    continue
                owner = doc.get("node", n if n is not None else (self.topo.node if self.topo else None))
                sid, order = of_manifest(doc)
                copies.append(Copy(step=s, node=_node_id(owner), rel=rel, nodes=_int_or(doc.get("nodes")),
                                   world_size=_int_or(doc.get("world_size")), replica_of=n, save_id=sid,
                                   order=order, descent=descent_of(doc)))
        return copies, foreign

    def scan(self) -> tuple[list[int], dict[int, list[int]], list[tuple[str, str | None]]]:
        """Committed steps by directory: ``(steps in local/ ascending, {replica directory's
        node: steps ascending}, foreign)`` (see :meth:`survey`; here ``local/`` counts whatever
        node's state it holds)."""
        copies, foreign = self.survey()
        own = sorted(c.step for c in copies if c.replica_of is None)
        reps: dict[int, list[int]] = {}
        for c in copies:
            if c.replica_of is not None:
                reps.setdefault(c.replica_of, []).append(c.step)
        return own, {n: sorted(v) for n, v in sorted(reps.items())}, foreign

    def committed_steps(self) -> list[int]:
        """Steps of ``local/`` with a valid commit marker and this tier's lineage, ascending."""
        return self.scan()[0]

    def committed_replicas(self) -> dict[int, list[int]]:
        """Committed replica steps of this tier's lineage held here, per source node:
        {node: [steps ascending]}."""
        return self.scan()[1]


def verify_split(store: Store, rel: str, index: int, count: int, timeout_s: float | None = None) -> list[str]:
    """Verify this rank's share of a committed step's files; returns problems ([] = intact).

    ``timeout_s``: read on a helper thread, bounded (:func:`tierckpt.io.bounded.run_bounded`):
    raises :class:`~tierckpt.errors.ReadTimeout` after that many seconds without progress
    (a file that blocks on open or read). None: on this thread, unbounded."""
    def verify(progress: Progress | None) -> list[str]:
        doc = manifest.read_committed(store, rel)
        if doc is None:
            return [f"{store.url_of(rel)}: not committed"]
        entries = manifest.split_share(manifest.entries_of(doc), index, count)
        return manifest.verify_files(store, rel, entries, progress.tick if progress is not None else None)

    if timeout_s is None:
        return verify(None)
    return run_bounded(verify, timeout_s, f"verifying {store.url_of(rel)}", name="tierckpt-verify")


def load_dir(state_dict: dict, path: str, group: dist.ProcessGroup,
             memory: dict[str, torch.Tensor] | None = None, strict: bool = False,
             wait: Callable[[str, int], None] | None = None, read_timeout_s: float | None = None) -> int:
    """DCP-load ``state_dict`` in place from a checkpoint directory over ``group``.

    Uses :class:`VerifyingLoadPlanner`: nothing is read unless the checkpoint covers every
    local chunk with the same dtype. ``memory``: {file name in ``path``: uint8 tensor of its
    bytes} of files already in memory and verified (a pull's share, or this rank's share of
    its own copy), loaded from there without a disk read or an intermediate copy
    (:class:`~tierckpt.io.memory_read.MemoryReader`); ``strict``: read nothing from disk
    (:class:`~tierckpt.io.memory_read.NotInMemoryError` inside DCP's ``CheckpointException``);
    ``wait(name, end)``: called before bytes ``:end`` of a file in memory are used (a pull
    still arriving); ``read_timeout_s``: every read from disk (files not in ``memory``: with
    several ranks per node, a replicated value DCP wrote into another rank's file) is bounded
    (:class:`~tierckpt.io.bounded.BoundedFile`, ``ReadTimeout`` inside DCP's
    ``CheckpointException`` on every rank). Returns bytes read by this rank.
    """
    bounded = read_timeout_s is not None
    reader = (MemoryReader(path, memory or {}, strict, wait, read_timeout_s) if memory or strict or bounded
              else CountingFileSystemReader(path))
    t0 = time.perf_counter()
    dcp.load(state_dict, storage_reader=reader, planner=VerifyingLoadPlanner(), process_group=group)
    log.debug("loaded %s in %.3fs", path, time.perf_counter() - t0)
    return reader.bytes_read
