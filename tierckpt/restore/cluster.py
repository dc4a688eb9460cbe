"""In-cluster resharded restore: load a step saved by a job of another shape from node-local copies.

Each node's local-tier checkpoint keeps global chunk coordinates, so the surviving nodes' copies
(own steps and replicas) together form one global checkpoint. A restore on a job with fewer or
more nodes, or another rank count, reads it like this (every rank of the job takes part):

1. **Global view.** For every saved node some surviving holder still has a copy of, the holder
   with the lowest id reads that copy's DCP ``.metadata`` (checked against the copy's manifest)
   and the metadata are all-gathered; :func:`merge_metadata` merges them into one DCP
   ``Metadata`` whose chunks each map to the saved nodes that hold them
   (a replicated value is held by every saved node; :mod:`tierckpt.restore.chunkmap`).
2. **Coverage.** While DCP plans, each rank intersects its new local chunks with the merged
   chunks (:class:`ClusterLoadPlanner`, :func:`missing_chunks`: DCP's resharding rule); if
   any rank's state is not fully covered, the attempt fails before any data is read and names
   the missing chunks, and the restore falls back to the persistent tier.
3. **Resharded read.** ``dcp.load`` with :class:`ClusterReader` over the job's ``local_world``
   group. The coordinator sees every rank's read items (DCP's global load plan) and assigns
   each item to the rank's own disk when its node holds a copy of a saved node that has the
   chunk, else to the least-loaded holder node and, on it, to its least-loaded rank. Ranks
   then read local items through DCP's ``FileSystemReader`` and exchange the rest point to
   point over the ``transfer`` group: the sender reads the saved chunk, cuts out exactly the
   region the receiver needs (DCP's ``storage_offsets``/``lengths``), and sends those bytes and
   their xxh3-64; the receiver writes them straight into its tensor and checks the hash. Every
   data file is verified against its copy's manifest (size and xxh3-64) before its first use.
   Only the needed regions move, never whole node checkpoints.
4. **Attribution.** A copy that fails verification, cannot be read, or arrives with a wrong
   hash is reported as ``(saved node, holder)``; the restore marks it bad and plans again (the
   next holder, or the persistent tier when no copy of a needed chunk is left).

Ordering of the exchange: every rank runs its sends on a helper thread and its receives on the
calling thread, each in increasing transfer index; a wait-for chain always ends at the lowest
index, so no set of transfers deadlocks (the argument of :mod:`tierckpt.transport.transfer`).
"""

from __future__ import annotations

import dataclasses
import io
import logging
import pickle
import threading
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import xxhash
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from tierckpt.cluster.collectives import FAILURES, gather_leaders, gather_reduced, union
from tierckpt.cluster.topology import Topology
from tierckpt.errors import ReadTimeout
from tierckpt.io import manifest
from tierckpt.io.bounded import BoundedFileSystem, run_bounded
from tierckpt.io.dcp_compat import _StorageInfo
from tierckpt.io.storage import Store
from tierckpt.restore.chunkmap import ClusterLoadPlanner, MissingChunks, Origins, RankIO, assign_reads, merge_metadata

log = logging.getLogger(__name__)

METADATA_FILE = ".metadata"


class BadCopy(Exception):
    """A node-local copy that cannot serve: ``node`` (saved node) on ``holder``; ``reason``."""

    def __init__(self, node: int, holder: int, reason: str):
        super().__init__(f"copy of node {node} on node {holder}: {reason}")
        self.node, self.holder, self.reason = node, holder, reason


# ------------------------------------------------------------------------------ local copies
class NodeCopies:
    """This node's copies of one step, by saved node, with each data file verified against its
    copy's manifest (size, xxh3-64) once, before its first use.

    Args:
        store: this node's local root (None only with no ``rels``).
        rels: {saved node: directory of this node's copy of it}.
        node: this node's id (the holder named in a :class:`BadCopy`).
        timeout_s: bound of each file's verification (``TierConfig.restore_read_timeout_s``):
            a read without progress for that long makes the copy bad (``ReadTimeout``), and
            the verified bytes the load reads next are in the page cache; the load's own reads
            (:meth:`reader`) are bounded the same way. None: unbounded.
    """

    def __init__(self, store: Store | None, rels: dict[int, str], node: int, timeout_s: float | None = None):
        self._store, self.rels, self.node, self.timeout_s = store, rels, node, timeout_s
        self._entries: dict[int, dict[str, manifest.FileEntry]] = {}
        self._checked: dict[tuple[int, str], str | None] = {}
        self._lock = threading.Lock()  # the sender thread and the reading thread share it

    def check(self, m: int, paths: set[str]) -> None:
        """Verify the data files ``paths`` of saved node ``m``'s copy.

        Raises:
            BadCopy: not committed, a file missing from its manifest, or a size/hash mismatch.
        """
        rel = self.rels[m]
        for p in sorted(paths):
            with self._lock:
                if (m, p) not in self._checked:
                    self._checked[(m, p)] = self._verify(m, rel, p)
                problem = self._checked[(m, p)]
            if problem:
                raise BadCopy(m, self.node, problem)

    @property
    def store(self) -> Store:
        """The local root (only used for saved nodes in ``rels``, which need one)."""
        if self._store is None:
            raise RuntimeError("tierckpt in-cluster restore: a copy was planned on a node without a local root")
        return self._store

    def _verify(self, m: int, rel: str, path: str) -> str | None:
        if m not in self._entries:
            doc = manifest.read_committed(self.store, rel)
            if doc is None:
                return f"{self.store.url_of(rel)} is not committed"
            self._entries[m] = {e.path: e for e in manifest.entries_of(doc)}
        entry = self._entries[m].get(path)
        if entry is None:
            return f"{self.store.url_of(rel)}/{path} is not in its manifest"
        if self.timeout_s is None:
            problems = manifest.verify_files(self.store, rel, [entry])
        else:
            try:
                problems = run_bounded(lambda p: manifest.verify_files(self.store, rel, [entry], p.tick),
                                       self.timeout_s, f"verifying {self.store.url_of(rel)}", name="tierckpt-verify")
            except ReadTimeout as e:
                problems = [f"ReadTimeout: {e}"]
        return "; ".join(problems) or None

    def reader(self, m: int, storage_data: dict) -> FileSystemReader:
        """DCP reader of saved node ``m``'s copy, with ``storage_data`` (storage index → info)."""
        r = FileSystemReader(self.store.path(self.rels[m]))
        r.storage_data = storage_data
        if self.timeout_s is not None:  # verified just before, but a disk can hang in between
            r.fs = BoundedFileSystem(self.timeout_s)
        return r

    def read_metadata(self, m: int) -> bytes:
        """The verified ``.metadata`` bytes of saved node ``m``'s copy (raises :class:`BadCopy`)."""
        self.check(m, {METADATA_FILE})
        try:
            return self.store.read_bytes(f"{self.rels[m]}/{METADATA_FILE}")
        except OSError as e:
            raise BadCopy(m, self.node, f"{type(e).__name__}: {e}") from e


# ---------------------------------------------------------------------------------- reader
class _Capture:
    """The planner half a sender hands DCP's ``FileSystemReader``: each item's region lands in a
    fresh contiguous tensor (or bytes) instead of a state dict."""

    def __init__(self, metadata: Metadata):
        self.metadata = metadata
        self.out: dict[int, Any] = {}

    def resolve_tensor(self, req: ReadItem) -> torch.Tensor:
        md = self.metadata.state_dict_metadata[req.storage_index.fqn]
        assert isinstance(md, TensorStorageMetadata)
        return torch.empty(tuple(req.lengths), dtype=md.properties.dtype)

    def commit_tensor(self, req: ReadItem, tensor: torch.Tensor) -> None:
        self.out[id(req)] = tensor

    def load_bytes(self, req: ReadItem, value: io.BytesIO) -> None:
        self.out[id(req)] = value.read()


def _signed(h: int) -> int:
    return h - (1 << 64) if h >= 1 << 63 else h


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """uint8 view of a contiguous CPU tensor (any dtype, 0-d included)."""
    return t.reshape(-1).view(torch.uint8)


class ClusterReader(StorageReader):
    """DCP ``StorageReader`` over the node-local copies of one step (see the module docstring).

    Args:
        metadata, origins: from :func:`merge_metadata`.
        holders: {saved node: holder nodes with a usable copy}; the same on every rank.
        topo: the job topology.
        copies: this node's copies (:class:`NodeCopies`).
        transfer_group: gloo group of all ranks for the point-to-point exchange; it must not be
            the group ``dcp.load`` runs on, nor one a background thread uses meanwhile.
    Attributes (after ``read_data``):
        bad: ``{(saved node, holder)}`` copies this rank found unusable.
        local_bytes, recv_bytes, sent_bytes: bytes this rank read from its node's disk,
            received, and sent.
    """

    def __init__(self, metadata: Metadata, origins: Origins, holders: dict[int, list[int]], topo: Topology,
                 copies: NodeCopies, transfer_group):
        super().__init__()
        self.metadata, self.origins, self.holders = metadata, origins, holders
        self.topo, self.copies, self.group = topo, copies, transfer_group
        self.bad: set[tuple[int, int]] = set()
        self.local_bytes = self.recv_bytes = self.sent_bytes = 0
        self._sinfo: dict[int, dict[MetadataIndex, _StorageInfo]] = {}
        for idx, alts in origins.items():
            for m, si in alts:
                self._sinfo.setdefault(m, {})[idx] = si

    # -- DCP StorageReader contract ----------------------------------------------------------
    def reset(self, checkpoint_id=None) -> None:
        pass

    def read_metadata(self, *args, **kwargs) -> Metadata:
        return self.metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args, **kwargs) -> None:
        pass

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        rio = assign_reads(plans, self.origins, self.holders, self.topo.node_of_rank, self.metadata)
        return [dataclasses.replace(p, storage_data=r) for p, r in zip(plans, rio)]

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return False

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        rio: RankIO = plan.storage_data
        errors: list[str] = []
        sender = threading.Thread(target=self._serve, args=(rio.send, errors), name="tierckpt-chunk-send", daemon=True)
        sender.start()
        try:
            self._read_local(plan, rio, planner, errors)
            for _, src, entries in rio.recv:
                for pos, m in entries:
                    self._receive(plan.items[pos], src, m, planner, errors)
        finally:
            sender.join()  # a receive never stops early, so every send completes
        if errors:
            raise RuntimeError("in-cluster read failed: " + "; ".join(errors[:4]) + (" …" if len(errors) > 4 else ""))
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    # -- local reads ---------------------------------------------------------------------------
    def _read_local(self, plan: LoadPlan, rio: RankIO, planner: LoadPlanner, errors: list[str]) -> None:
        by_m: dict[int, list[ReadItem]] = {}
        for pos, m in sorted(rio.local.items()):
            by_m.setdefault(m, []).append(plan.items[pos])
        for m, items in sorted(by_m.items()):
            sinfo = self._sinfo[m]
            try:
                self.copies.check(m, {sinfo[i.storage_index].relative_path for i in items})
                self.copies.reader(m, sinfo).read_data(LoadPlan(items), planner).wait()
                self.local_bytes += sum(sinfo[i.storage_index].length for i in items)
            except BadCopy as e:
                self.bad.add((e.node, e.holder))
                errors.append(str(e))
            except FAILURES as e:  # an unreadable file of this copy
                self.bad.add((m, self.topo.node))
                errors.append(f"copy of node {m} on node {self.topo.node}: {type(e).__name__}: {e}")

    # -- exchange --------------------------------------------------------------------------------
    def _serve(self, sends: list, errors: list[str]) -> None:
        """Sender thread: for each transfer, cut every item's region out of this node's copy and
        send ``[status, nbytes, xxh3-64]`` then the bytes (status 1: cannot serve, no bytes)."""
        for _, dst, items in sends:
            gdst = dist.get_group_rank(self.group, dst)
            regions = self._cut(items, errors)
            for m, item in items:
                data = regions.get(id(item))
                try:
                    if data is None:
                        dist.send(torch.tensor([1, 0, 0], dtype=torch.int64), gdst, group=self.group)
                        continue
                    buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8) if isinstance(data, bytes)
                           else _as_bytes(data.contiguous()))
                    digest = xxhash.xxh3_64_intdigest(buf.numpy().data)
                    dist.send(torch.tensor([0, buf.numel(), _signed(digest)], dtype=torch.int64), gdst, group=self.group)
                    if buf.numel():
                        dist.send(buf, gdst, group=self.group)
                    self.sent_bytes += buf.numel()
                except FAILURES as e:  # the receiver side fails and attributes it
                    errors.append(f"send to rank {dst}: {type(e).__name__}: {e}")
                    return

    def _cut(self, items: list[tuple[int, ReadItem]], errors: list[str]) -> dict[int, Any]:
        """{id(item): region tensor or bytes} read from this node's copies; failed copies are left
        out (their items are sent with status 1)."""
        by_m: dict[int, list[ReadItem]] = {}
        for m, item in items:
            by_m.setdefault(m, []).append(item)
        out: dict[int, Any] = {}
        for m, its in by_m.items():
            sinfo = self._sinfo[m]
            cap = _Capture(self.metadata)
            try:
                self.copies.check(m, {sinfo[i.storage_index].relative_path for i in its})
                self.copies.reader(m, sinfo).read_data(LoadPlan(its), cap).wait()  # type: ignore[arg-type]
                out.update(cap.out)
            except BadCopy as e:
                self.bad.add((e.node, e.holder))
                log.warning("tierckpt in-cluster restore: cannot serve %s", e)
            except FAILURES as e:
                self.bad.add((m, self.topo.node))
                log.warning("tierckpt in-cluster restore: cannot read the copy of node %d: %s: %s", m, type(e).__name__, e)
        return out

    def _receive(self, item: ReadItem, src: int, m: int, planner: LoadPlanner, errors: list[str]) -> None:
        """Receive one region from ``src`` into the planner's tensor (or bytes), checking its hash."""
        gsrc = dist.get_group_rank(self.group, src)
        holder = self.topo.node_of_rank[src]
        head = torch.zeros(3, dtype=torch.int64)
        dist.recv(head, gsrc, group=self.group)
        status, nbytes, digest = (int(x) for x in head)
        if status != 0:
            self.bad.add((m, holder))
            errors.append(f"copy of node {m} on node {holder} could not serve {item.storage_index.fqn}")
            return
        target = None
        if item.type != LoadItemType.BYTE_IO:
            target = planner.resolve_tensor(item).detach()
        direct = (target is not None and target.device.type == "cpu" and target.is_contiguous()
                  and target.numel() * target.element_size() == nbytes)
        buf = _as_bytes(target) if direct and target is not None else torch.empty(nbytes, dtype=torch.uint8)
        if nbytes:
            dist.recv(buf, gsrc, group=self.group)
        self.recv_bytes += nbytes
        if _signed(xxhash.xxh3_64_intdigest(buf.numpy().data)) != digest:
            self.bad.add((m, holder))
            errors.append(f"{item.storage_index.fqn} from node {holder}: xxh3-64 mismatch on receipt")
            return
        if target is None:
            planner.load_bytes(item, io.BytesIO(buf.numpy().tobytes()))
            return
        if not direct:
            if target.numel() * target.element_size() != nbytes:
                errors.append(f"{item.storage_index.fqn}: got {nbytes} bytes for a {tuple(target.shape)} "
                              f"{target.dtype} region")
                return
            target.copy_(buf.view(target.dtype).reshape(target.shape))
        planner.commit_tensor(item, target)


# ------------------------------------------------------------------------------ orchestration
@dataclasses.dataclass
class ClusterLoad:
    """One in-cluster load attempt as every rank saw it (identical on all ranks except bytes).

    Attributes:
        ok: every rank loaded its state.
        error: why not (None when ok).
        bad: ``{(saved node, holder)}`` copies found unusable by any rank.
        missing: chunks no usable copy holds (from :func:`missing_chunks`, rank-prefixed).
        saved_nodes: saved nodes the merged view came from.
        bytes: this rank's bytes read from its node's disk plus received.
        seconds: wall time of the attempt.
    """

    ok: bool
    error: str | None = None
    bad: set = dataclasses.field(default_factory=set)
    missing: list[str] = dataclasses.field(default_factory=list)
    saved_nodes: list[int] = dataclasses.field(default_factory=list)
    bytes: int = 0
    seconds: float = 0.0


def cluster_load(state_dict: dict, copies_by_node: dict[int, dict[int, str]], usable: dict[int, list[int]],
                 topo: Topology, store: Store | None, load_group, transfer_group,
                 saved_nodes: int | None = None, read_timeout_s: float | None = None) -> ClusterLoad:
    """Load ``state_dict`` in place from the node-local copies of one step (collective, all ranks).

    Args:
        copies_by_node: {saved node: {holder node: directory}} of the step (the inventory's).
        usable: {saved node: holder nodes, ascending} not marked bad; same on every rank.
        store: this node's local root (None: this node holds nothing).
        saved_nodes: node count of the job that saved the step (names the nodes no copy is
            left of; None: unknown).
        load_group: gloo group of all ranks for ``dcp.load``; ``transfer_group``: another one
            for the chunk exchange.
        read_timeout_s: bound of every file's verification (:class:`NodeCopies`).
    Returns:
        :class:`ClusterLoad` (never raises for a data problem; a failed attempt says why).
    """
    t0 = time.perf_counter()
    mine = {m: by_h[topo.node] for m, by_h in copies_by_node.items()
            if topo.node in by_h and topo.node in usable.get(m, [])}
    copies = NodeCopies(store, mine if store is not None else {}, topo.node, read_timeout_s)
    parts, bad = _gather_metadata(copies, usable, topo, load_group)
    if bad:
        return ClusterLoad(ok=False, error="; ".join(f"copy of node {m} on node {h}: {why}" for (m, h), why in
                                                     sorted(bad.items())), bad=set(bad), seconds=time.perf_counter() - t0)
    lost = sorted(set(range(saved_nodes or 0)) - set(parts))
    try:
        merged, origins = merge_metadata(parts)
    except ValueError as e:  # copies that disagree: not one checkpoint
        return ClusterLoad(ok=False, error=f"the node-local copies do not form one checkpoint: {e}",
                           saved_nodes=sorted(parts), seconds=time.perf_counter() - t0)
    holders = {m: hs for m, hs in usable.items() if m in parts and hs}
    reader = ClusterReader(merged, origins, holders, topo, copies, transfer_group)
    error, missing = None, []
    try:
        dcp.load(state_dict, storage_reader=reader, planner=ClusterLoadPlanner(), process_group=load_group)
    except CheckpointException as e:
        missing = [f"rank {r}: {m}" for r, (exc, _) in sorted(e.failures.items()) if isinstance(exc, MissingChunks)
                   for m in exc.missing]
        error = (f"no node-local copy of saved node(s) {lost} is left; " if lost else "") + (
            f"{len(missing)} chunk(s) of the new shards are in no in-cluster copy" if missing
            else "; ".join(f"rank {r}: {type(exc).__name__}: {exc}" for r, (exc, _) in sorted(e.failures.items()))[:2000])
    except FAILURES as e:
        error = f"{type(e).__name__}: {e}"
    bad_all = gather_reduced(set(reader.bad), load_group, union)
    return ClusterLoad(ok=error is None, error=error, bad=bad_all, missing=missing, saved_nodes=sorted(parts),
                       bytes=reader.local_bytes + reader.recv_bytes, seconds=time.perf_counter() - t0)


def _gather_metadata(copies: NodeCopies, usable: dict[int, list[int]], topo: Topology,
                     group) -> tuple[dict[int, Metadata], dict[tuple[int, int], str]]:
    """All-gather the ``.metadata`` of every saved node that has a usable copy: the node leader of
    its lowest usable holder reads it. Returns ({saved node: Metadata}, {(node, holder): why})."""
    mine: dict[int, bytes] = {}
    failed: dict[tuple[int, int], str] = {}
    if topo.is_node_leader:
        for m, hs in usable.items():
            if hs and hs[0] == topo.node and m in copies.rels:
                try:
                    mine[m] = copies.read_metadata(m)
                except BadCopy as e:
                    failed[(m, topo.node)] = e.reason
    parts: dict[int, Metadata] = {}
    bad: dict[tuple[int, int], str] = {}
    # only node leaders read metadata: leaders exchange (every rank needs the merged view)
    for got, fails in gather_leaders((mine, failed), group, topo.is_node_leader):
        bad.update(fails)
        for m, raw in got.items():
            try:
                parts[m] = pickle.loads(raw)
            except FAILURES as e:  # verified bytes that do not unpickle: the copy was written wrong
                bad[(m, usable[m][0])] = f"{METADATA_FILE} does not load: {type(e).__name__}: {e}"
    return parts, bad
