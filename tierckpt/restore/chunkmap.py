"""The global view of a step's node-local copies, and who reads what (pure logic, no I/O).

:func:`merge_metadata` merges the saved nodes' DCP metadata into one (chunk → saved nodes
holding it); :class:`ClusterLoadPlanner` names every chunk of a rank's new shards no copy holds
(:func:`missing_chunks`) before DCP plans any read; :func:`assign_reads` decides, for every read
item of every rank, the rank's own disk or a holder node and rank. Used by
:mod:`tierckpt.restore.cluster`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem
from torch.distributed.tensor import DTensor

from tierckpt.io import per_rank
from tierckpt.io.dcp_compat import _create_chunk_list, _StorageInfo
from tierckpt.io.planner import VerifyingLoadPlanner

Origins = dict[MetadataIndex, list[tuple[int, _StorageInfo]]]


# ------------------------------------------------------------------------------- global view
def merge_metadata(parts: dict[int, Metadata]) -> tuple[Metadata, Origins]:
    """Merge per-node DCP metadata into one global view.

    Args:
        parts: {saved node: the ``.metadata`` of its node-local checkpoint}.
    Returns:
        ``(metadata, origins)``: DCP ``Metadata`` whose tensors list the union of the nodes'
        chunks (a chunk several nodes saved — a replicated value — once), and
        ``{storage index: [(saved node, storage info in that node's checkpoint)]}``. A plain
        value that differed per rank gets each saved rank's qualified entry, pointing at the
        copy that holds that rank's value (:func:`tierckpt.io.per_rank.merge_records`).
    Raises:
        ValueError: two nodes disagree on a tensor's global size or dtype, or on an item's kind.
    """
    sd_md: dict[str, Any] = {}
    origins: Origins = {}
    planner_data: dict = {}
    version = None
    for m in sorted(parts):
        md = parts[m]
        version = version or getattr(md, "version", None)
        for fqn, tm in md.state_dict_metadata.items():
            cur = sd_md.get(fqn)
            if cur is None:
                sd_md[fqn] = (TensorStorageMetadata(tm.properties, tm.size, list(tm.chunks))
                              if isinstance(tm, TensorStorageMetadata) else tm)
                continue
            if isinstance(tm, TensorStorageMetadata) != isinstance(cur, TensorStorageMetadata):
                raise ValueError(f"{fqn}: saved as a tensor by one node and as bytes by another")
            if isinstance(tm, TensorStorageMetadata):
                if cur.size != tm.size or cur.properties.dtype != tm.properties.dtype:
                    raise ValueError(f"{fqn}: node {m} saved {tuple(tm.size)} {tm.properties.dtype}, another node "
                                     f"{tuple(cur.size)} {cur.properties.dtype}")
                seen = {(tuple(c.offsets), tuple(c.sizes)) for c in cur.chunks}
                cur.chunks.extend(c for c in tm.chunks if (tuple(c.offsets), tuple(c.sizes)) not in seen)
        for idx, si in md.storage_data.items():
            origins.setdefault(idx, []).append((m, si))
        planner_data.update(md.planner_data or {})
    record = per_rank.merge_records(parts, sd_md, origins)
    planner_data.pop(per_rank.RECORD_KEY, None)
    if record is not None:
        planner_data[per_rank.RECORD_KEY] = record
    merged = Metadata(state_dict_metadata=sd_md, planner_data=planner_data, storage_data={})
    if version is not None:
        merged.version = version
    return merged, origins


def missing_chunks(state_dict: dict, metadata: Metadata) -> list[str]:
    """What of a (flattened, as DCP's planner holds it) ``state_dict`` the merged ``metadata``
    does not cover.

    Uses each value's local chunk list (global offsets), so a resharded state is checked
    exactly as DCP will read it. Returns one message per item: a key no copy holds, or a
    local chunk ``offsets``/``sizes`` of which only k of n elements are held.
    """
    out = []
    for fqn, obj in state_dict.items():
        md = metadata.state_dict_metadata.get(fqn)
        if md is None:
            out.append(f"{fqn}: in no in-cluster copy")
            continue
        if not isinstance(md, TensorStorageMetadata) or not isinstance(obj, torch.Tensor):
            continue
        if isinstance(obj, DTensor) and obj.device_mesh.get_coordinate() is None:
            continue
        for chunk in _create_chunk_list(obj):
            need = math.prod(chunk.sizes)
            have = sum(_overlap(chunk, c) for c in md.chunks)
            if have < need:
                out.append(f"{fqn}: chunk offsets={tuple(chunk.offsets)} sizes={tuple(chunk.sizes)}: "
                           f"{have} of {need} elements in-cluster")
    return out


class MissingChunks(Exception):
    """Raised by :class:`ClusterLoadPlanner` before any read: ``missing`` lists what this rank's
    state needs that no usable copy holds (:func:`missing_chunks`)."""

    def __init__(self, missing: list[str]):
        super().__init__(missing)
        self.missing = missing


class ClusterLoadPlanner(VerifyingLoadPlanner):
    """:class:`~tierckpt.io.planner.VerifyingLoadPlanner` that first names every chunk the merged
    in-cluster view lacks (:class:`MissingChunks`), so a fallback can say what was missing."""

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None
        missing = missing_chunks(self.state_dict, self.metadata)
        if missing:
            raise MissingChunks(missing)
        return super().create_local_plan()


def _overlap(a, b) -> int:
    """Elements two chunks (offsets, sizes) share."""
    vol = 1
    for ao, asz, bo, bsz in zip(a.offsets, a.sizes, b.offsets, b.sizes):
        lo, hi = max(ao, bo), min(ao + asz, bo + bsz)
        if hi <= lo:
            return 0
        vol *= hi - lo
    return vol


# ------------------------------------------------------------------------------- assignment
@dataclasses.dataclass
class RankIO:
    """One rank's part of the exchange, attached by the coordinator to its ``LoadPlan``.

    Attributes:
        local: {item position in the rank's plan: saved node whose copy on this node serves it}.
        recv: ``[(transfer index, source rank, [(item position, saved node)])]`` ascending.
        send: ``[(transfer index, destination rank, [(saved node, ReadItem)])]`` ascending.
    """

    local: dict[int, int] = dataclasses.field(default_factory=dict)
    recv: list[tuple[int, int, list[tuple[int, int]]]] = dataclasses.field(default_factory=list)
    send: list[tuple[int, int, list[tuple[int, ReadItem]]]] = dataclasses.field(default_factory=list)


def assign_reads(plans: list[LoadPlan], origins: Origins, holders: dict[int, list[int]],
                 node_of_rank: list[int], metadata: Metadata) -> list[RankIO]:
    """Decide where every read item of every rank comes from (pure; the coordinator runs it).

    Args:
        plans: every rank's DCP load plan, indexed by global rank.
        origins: from :func:`merge_metadata`.
        holders: {saved node: holder nodes with a usable copy, ascending}.
        node_of_rank: node id of every global rank.
    Returns:
        one :class:`RankIO` per rank. An item is read from the rank's own node when it holds
        a copy of a saved node that has the chunk; otherwise from the holder node with the
        fewest bytes assigned so far, and on it the rank with the fewest (ties: lowest id).
    Raises:
        ValueError: an item no usable copy holds (the coverage check runs first, so this is
            a bug, not a missing chunk).
    """
    ranks_of: dict[int, list[int]] = {}
    for r, n in enumerate(node_of_rank):
        ranks_of.setdefault(n, []).append(r)
    out = [RankIO() for _ in plans]
    by_node: dict[int, int] = {}
    by_rank: dict[int, int] = {}
    pairs: dict[tuple[int, int], list[tuple[int, int, ReadItem]]] = {}
    for dst, plan in enumerate(plans):
        node = node_of_rank[dst]
        for pos, item in enumerate(plan.items):
            alts = [(m, si) for m, si in origins.get(item.storage_index, []) if holders.get(m)]
            if not alts:
                raise ValueError(f"no usable in-cluster copy holds {item.storage_index}")
            here = [m for m, _ in alts if node in holders[m]]
            if here:
                out[dst].local[pos] = here[0]
                continue
            nbytes = _item_nbytes(item, alts[0][1], metadata)
            m, h = min(((m, h) for m, _ in alts for h in holders[m]), key=lambda mh: (by_node.get(mh[1], 0), mh[1], mh[0]))
            src = min(ranks_of[h], key=lambda r: (by_rank.get(r, 0), r))
            by_node[h] = by_node.get(h, 0) + nbytes
            by_rank[src] = by_rank.get(src, 0) + nbytes
            pairs.setdefault((src, dst), []).append((pos, m, item))
    for xid, ((src, dst), items) in enumerate(sorted(pairs.items())):
        out[dst].recv.append((xid, src, [(pos, m) for pos, m, _ in items]))
        out[src].send.append((xid, dst, [(m, item) for _, m, item in items]))
    return out


def _item_nbytes(item: ReadItem, si: _StorageInfo, metadata: Metadata) -> int:
    """Bytes an item moves: its region's elements times the dtype size (bytes items: stored size)."""
    md = metadata.state_dict_metadata.get(item.storage_index.fqn)
    if item.type == LoadItemType.BYTE_IO or not isinstance(md, TensorStorageMetadata):
        return si.length
    return math.prod(item.lengths) * torch.empty((), dtype=md.properties.dtype).element_size()
