"""Check a restore's template against the chosen step before any source is read.

A state dict that does not fit the step (a key the checkpoint lacks, another dtype, another
global shape, a tensor where an object was saved) fails on every source alike: the
verifying planner (:class:`~tierckpt.io.planner.VerifyingLoadPlanner`) and DCP refuse it
inside each load, and the restore would fall back through every source (pulling replicas
over the nodes' own copies on the way) before giving up with one DCP traceback per source.
:func:`check_template` runs before the first attempt instead: each rank reads the DCP
``.metadata`` of its node's first planned source (verified against that copy's manifest; a
few KiB to MiB, no data file), builds the dict DCP's planner would hold (``Stateful`` values
resolved, flattened as the planner flattens, through the persistent tier's
:meth:`~tierckpt.tiers.persistent.PersistentIO.load_template` for a persistent source), and
compares. The ranks agree in one small collective; any mismatch raises
:class:`~tierckpt.errors.TemplateMismatchError` on every rank.

Global shapes are compared (a DTensor's or ShardedTensor's global size, a plain tensor's
size), never local shards, so a resharded restore passes. Keys the checkpoint has and the
template lacks are fine (model-only loads); the reverse is the error, unless the planner
allows partial loads. A node whose metadata cannot be read or verified skips the check (its
attempt then finds the bad copy, with the planner's check as the second line of defence).
"""

from __future__ import annotations

import logging
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from tierckpt.cluster.collectives import FAILURES, gather_leaders, gather_reduced
from tierckpt.cluster.topology import Groups, Topology
from tierckpt.errors import TemplateMismatchError
from tierckpt.io import layout, manifest
from tierckpt.io.bounded import run_bounded
from tierckpt.io.dcp_compat import _flatten_sharded_tensors, flatten_state_dict
from tierckpt.io.planner import VerifyingLoadPlanner
from tierckpt.io.storage import Store
from tierckpt.restore.chunkmap import merge_metadata
from tierckpt.restore.plan import CLUSTER, OWN, PERSISTENT, REPLICA, Inventory, Source

log = logging.getLogger(__name__)

METADATA = ".metadata"
KEEP_RANKS, KEEP_PER_RANK = 4, 8  # what the agreed summary keeps (the message shows a few)


def planner_view(state_dict: dict, planner: VerifyingLoadPlanner) -> dict[str, Any]:
    """The flat dict ``planner`` holds when DCP loads ``state_dict``: ``Stateful`` values
    replaced by their ``state_dict()`` (as ``dcp.load`` does), ShardedTensors and nested
    containers flattened as the planner's flags say. Reads no value and changes nothing in
    ``state_dict`` (DCP's ``set_up_planner`` would materialise meta tensors in place)."""
    sd = {k: (v.state_dict() if isinstance(v, Stateful) else v) for k, v in sorted(state_dict.items())}
    if planner.flatten_sharded_tensors:
        sd = _flatten_sharded_tensors(sd)
    if planner.flatten_state_dict:
        sd, _ = flatten_state_dict(sd)
    return sd


def _kind(obj: Any) -> str:
    return f"tensor {obj.dtype} {tuple(obj.size())}" if isinstance(obj, torch.Tensor) else f"object {type(obj).__name__}"


def mismatches(view: dict[str, Any], metadata: Metadata, planner: VerifyingLoadPlanner,
               all_keys: bool = True) -> list[str]:
    """One line per value of ``view`` (:func:`planner_view`) that ``metadata`` cannot fill,
    ``"<key>: checkpoint <saved> != template <template's>"``, in the view's order:

    - a key not in the checkpoint (unless ``planner.allow_partial_load``, or ``all_keys`` is
      False: ``metadata`` is not known to hold every key of the step);
    - a tensor saved as an object, or the reverse;
    - another dtype;
    - another global shape (unless ``planner.shape_may_differ(key)``).

    DTensors on a mesh this rank is not part of are skipped, as DCP's planner skips them."""
    out = []
    allow_partial = getattr(planner, "allow_partial_load", False)
    for fqn, obj in view.items():
        md = metadata.state_dict_metadata.get(fqn)
        if md is None:
            if all_keys and not allow_partial:
                out.append(f"{fqn}: checkpoint has no such key != template {_kind(obj)}")
            continue
        if isinstance(obj, DTensor) and obj.device_mesh.get_coordinate() is None:
            continue
        if not isinstance(md, TensorStorageMetadata):
            if isinstance(obj, torch.Tensor):
                out.append(f"{fqn}: checkpoint object != template {_kind(obj)}")
            continue
        if not isinstance(obj, torch.Tensor):
            out.append(f"{fqn}: checkpoint tensor {md.properties.dtype} {tuple(md.size)} != template {_kind(obj)}")
            continue
        if md.properties.dtype != obj.dtype:
            out.append(f"{fqn}: checkpoint dtype {md.properties.dtype} != template {obj.dtype}")
        if tuple(md.size) != tuple(obj.size()) and not planner.shape_may_differ(fqn):
            out.append(f"{fqn}: checkpoint shape {tuple(md.size)} != template {tuple(obj.size())}")
    return out


def read_metadata(store: Store, rel: str, timeout_s: float | None = None) -> Metadata:
    """The DCP metadata of the committed step ``rel`` of ``store``, its bytes checked against
    the step's manifest (size, xxh3-64) first; ``timeout_s``: the read runs on a helper thread
    and is abandoned after that many seconds (a hung disk must not hold the restore).

    Raises:
        ValueError: not committed, not in the manifest, or a size/checksum mismatch.
        OSError: unreadable.
        ReadTimeout: the read took longer than ``timeout_s``.
    """
    raw = _bounded_bytes(store, rel, timeout_s)
    return pickle.loads(raw)


def _bounded_bytes(store: Store, rel: str, timeout_s: float | None) -> bytes:
    if not timeout_s:
        return _verified_bytes(store, rel)
    return run_bounded(lambda progress: _verified_bytes(store, rel), timeout_s,
                       f"{store.url_of(rel)}/{METADATA}", name="tierckpt-template-read")


def _verified_bytes(store: Store, rel: str) -> bytes:
    doc = manifest.read_committed(store, rel)
    if doc is None:
        raise ValueError(f"{store.url_of(rel)} is not committed")
    entry = [e for e in manifest.entries_of(doc) if e.path == METADATA]
    if not entry:
        raise ValueError(f"{store.url_of(rel)}/{METADATA} is not in its manifest")
    problems = manifest.verify_files(store, rel, entry)
    if problems:
        raise ValueError("; ".join(problems))
    return store.read_bytes(f"{rel}/{METADATA}")


def _designated(s: int, sources: dict[int, Source], inv: Inventory) -> dict[int, int]:
    """{saved node: holder node whose leader reads that copy's metadata for the others}: a
    replica source's holder; every saved node's lowest holder for an in-cluster read."""
    out = {}
    for n, src in sources.items():
        if src.kind == REPLICA and src.holder is not None:
            out[n] = src.holder
    if any(src.kind == CLUSTER for src in sources.values()):
        for m, by_h in inv.copies.get(s, {}).items():
            if by_h:
                out[m] = min(by_h)
    return out


def _exchange(s: int, need: dict[int, int], inv: Inventory, topo: Topology, groups: Groups,
              store: Store | None, timeout_s: float | None = None) -> dict[int, Metadata]:
    """The metadata of the copies in ``need`` (:func:`_designated`), read by their holders'
    leaders and exchanged among leaders (collective over ``local_world``; same ``need`` on
    every rank). A copy that cannot be read is left out."""
    mine: dict[int, bytes] = {}
    if topo.is_node_leader and store is not None:
        for m, h in need.items():
            rel = inv.holders(m, s).get(h)
            if h != topo.node or rel is None:
                continue
            try:
                mine[m] = _bounded_bytes(store, rel, timeout_s)
            except FAILURES as e:
                log.info("tierckpt restore: template check: cannot read %s/%s: %s", rel, METADATA, e)
    out = {}
    for got in gather_leaders(mine, groups.local_world, topo.is_node_leader):
        for m, raw in got.items():
            try:
                out[m] = pickle.loads(raw)
            except FAILURES:  # a copy written wrong: its attempt will say so
                pass
    return out


def _template(state_dict: dict, s: int, src: Source, groups: Groups, persistent) -> tuple[dict, VerifyingLoadPlanner]:
    """What DCP will load for this rank's node's source and its planner: the persistent tier's
    through :meth:`~tierckpt.tiers.persistent.PersistentIO.load_template` (e.g. Megatron's
    persistent-format template), node-local copies ``state_dict`` itself with the planner
    their loads use (``load_dir``, ``cluster_load``)."""
    if src.kind == PERSISTENT:
        url = persistent.store.url_of(layout.persistent_step(s))
        return persistent.io.load_template(state_dict, url, groups.node)
    return state_dict, VerifyingLoadPlanner()


def _metadata(s: int, src: Source, inv: Inventory, topo: Topology, stores: tuple[Store | None, Any],
              shared: dict[int, Metadata], timeout_s: float | None = None) -> tuple[Metadata, str, bool] | None:
    """(metadata of this rank's node's source, where it was found, whether it holds every key
    of the step), or None when there is none to check against."""
    local, persistent = stores
    node = topo.node
    if src.kind == PERSISTENT:
        return (read_metadata(persistent.store, layout.persistent_step(s), timeout_s),
                f"node {node}'s source, the persistent step", True)
    if src.kind == OWN:
        if local is None:
            return None
        return (read_metadata(local, inv.holders(node, s).get(node, layout.local_step(s)), timeout_s),
                f"node {node}'s own copy", True)
    if src.kind == REPLICA:
        md = shared.get(node)
        return None if md is None else (md, f"node {node}'s replica on node {src.holder}", True)
    if not shared:
        return None
    # a saved node without a readable copy takes its keys along: the restore may still succeed
    # from the persistent tier, so only what the copies hold is checked
    saved = inv.shapes.get(s, (None, None))[0]
    complete = saved is not None and set(range(saved)) <= set(shared)
    return merge_metadata(shared)[0], "the node-local copies, merged for an in-cluster read", complete


def _combine(parts: list) -> tuple[int, list]:
    """``reduce`` of (ranks with mismatches, [(rank, mismatches, count, where)]): the sum and the
    lowest ranks' entries (order-free, so per-node results combine the same way)."""
    ranks = sum(p[0] for p in parts)
    entries = sorted((e for p in parts for e in p[1]), key=lambda e: e[0])[:KEEP_RANKS]
    return ranks, entries


def check_template(state_dict: dict, s: int, sources: dict[int, Source], inv: Inventory, topo: Topology,
                   groups: Groups, local: Store | None, persistent, read_timeout_s: float | None = None) -> None:
    """Check ``state_dict`` against step ``s`` before the restore's first attempt (collective
    over ``groups.local_world``; ``sources``: the first plan, the same on every rank).

    Args:
        local: this node's local root (None without a local tier); ``persistent``: the
            :class:`~tierckpt.tiers.persistent.PersistentTier` or None.
        read_timeout_s: bound of each metadata read (``TierConfig.restore_read_timeout_s``): a
            read that hangs skips the check on that rank (the attempts' own bounded reads then
            fail that source).
    Raises:
        TemplateMismatchError: on every rank, when any rank's template does not fit.
    """
    need = _designated(s, sources, inv)
    shared = _exchange(s, need, inv, topo, groups, local, read_timeout_s) if need else {}
    found: list[str] = []
    where = ""
    try:  # every rank builds its template, whatever its metadata: a Stateful or hook may talk to its peers
        target, planner = _template(state_dict, s, sources[topo.node], groups, persistent)
        view = planner_view(target, planner)
        got = _metadata(s, sources[topo.node], inv, topo, (local, persistent), shared, read_timeout_s)
        if got is not None:
            md, where, complete = got
            found = mismatches(view, md, planner, complete)
    except FAILURES as e:  # cannot check here: the attempt finds what is wrong with the copy
        log.info("tierckpt restore: rank %d skips the template check of step %d: %s: %s", topo.rank, s,
                 type(e).__name__, e)
        found = []
    mine = (1, [(topo.rank, found[:KEEP_PER_RANK], len(found), where)]) if found else (0, [])
    ranks, entries = gather_reduced(mine, groups.local_world, _combine)
    if not ranks:
        return None
    err = TemplateMismatchError(s, [(r, ps, n) for r, ps, n, _ in entries], ranks, entries[0][3])
    raise err
