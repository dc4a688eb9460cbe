"""Values that differ per rank under one key (RNG states, per-rank counters, objects).

DCP treats every value that is neither a DTensor nor a ShardedTensor — a plain tensor
(``WriteItemType.TENSOR``) or an object (``BYTE_IO``) — as replicated: the coordinator keeps
one copy per key, so a rank whose value differed gets another rank's value back, silently.
tierckpt keeps every rank's own value, without changing what a stock DCP loader sees:

Save (:func:`digest_items`, :func:`qualify`, :func:`build_record`): each rank hashes its
non-sharded items (xxh3-64 of dtype, shape and bytes; objects: of the bytes DCP writes) and
sends ``(global rank, {fqn: digest})`` with its plan. For every key whose digests differ
inside the save group, the coordinator adds one write per rank under
``__tierckpt_rank__/<global rank>/<fqn>`` (:func:`qualified`); the plain key keeps DCP's single
deduplicated copy. The metadata's ``planner_data`` gets the save's record
(:data:`RECORD_KEY`): the saving ranks, and per key the digest of the plain copy and the ranks
whose value differs from it — what an in-cluster read needs to find each rank's value among
node-local copies whose save groups were single nodes.

Load (:func:`rank_view`): a rank reads its qualified key when the metadata has it, else the
plain key — refused when the record says the plain copy is not this rank's value (it was lost
with a copy). A rank that did not exist at save time gets the plain key's value, with one
warning naming the keys whose saved values differed.
"""

from __future__ import annotations

import dataclasses
import io
import logging
from typing import Any

import torch
import torch.distributed as dist
import xxhash
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor
from torch.serialization import get_crc32_options, set_crc32_options

from tierckpt.io import dcp_compat  # noqa: F401  (DCP's fields used here are checked first)

log = logging.getLogger(__name__)

PREFIX = "__tierckpt_rank__/"
"""Reserved key prefix of rank-qualified values."""

RECORD_KEY = "__tierckpt_rank__"
"""Key of the save's record in ``Metadata.planner_data``: ``{"world": world size of the job,
"ranks": [global ranks of the save group], "items": {fqn: (plain digest or None, {global
rank: digest} of the ranks whose value differs from the plain copy)}}``. A None plain digest (merged in-cluster views only)
means every rank's value is under its qualified key or nowhere."""


def qualified(rank: int, fqn: str) -> str:
    """The reserved key of global rank ``rank``'s own value of ``fqn``."""
    return f"{PREFIX}{rank}/{fqn}"


def unqualify(fqn: str) -> str:
    """``fqn`` without the rank qualification (unchanged if it has none)."""
    if not fqn.startswith(PREFIX):
        return fqn
    return fqn[len(PREFIX):].split("/", 1)[1]


def global_rank() -> int:
    """This process's rank in the default group (0 without torch.distributed)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def global_world() -> int:
    """The default group's size (1 without torch.distributed)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


@dataclasses.dataclass(frozen=True)
class RankedSavePlan(SavePlan):
    """A ``SavePlan`` carrying the digests of its rank's non-sharded items to the coordinator
    (a dataclass field, so DCP's ``dataclasses.replace`` keeps it through the gather).

    Attributes:
        rank: the global rank that made the plan.
        digests: {fqn: xxh3-64 hex} of its TENSOR and BYTE_IO items.
    """

    rank: int = -1
    digests: dict[str, str] = dataclasses.field(default_factory=dict)


def tensor_digest(t: torch.Tensor) -> str:
    """xxh3-64 hex of a plain tensor's dtype, shape and bytes (copied to host if needed)."""
    h = xxhash.xxh3_64()
    h.update(f"{t.dtype}{tuple(t.shape)}".encode())
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    try:
        h.update(t.contiguous().reshape(-1).view(torch.uint8).numpy().data)
    except (RuntimeError, TypeError):  # sparse, quantized …: hash what torch.save writes
        buf = io.BytesIO()
        torch.save(t, buf)
        h.update(buf.getbuffer())
    return h.hexdigest()


def object_bytes(obj: Any) -> bytes:
    """The bytes DCP writes for an object item (``torch.save``, as ``DefaultSavePlanner``), with
    the zip CRC32 off as in every tierckpt save.

    The CRC option changes the bytes, and torch keeps it per thread (torch 2.13's config
    module): left as found, two ranks could hash the same object differently when one tier's
    thread had it off and another's not. Only this thread's setting is touched.
    """
    buf = io.BytesIO()
    prev = get_crc32_options()
    set_crc32_options(False)
    try:
        torch.save(obj, buf)
    finally:
        set_crc32_options(prev)
    return buf.getvalue()


def digest_items(items: list[WriteItem], lookup, object_cache: dict[str, bytes]) -> dict[str, str]:
    """{fqn: digest} of the non-sharded ``items`` (TENSOR and BYTE_IO); DTensor/ShardedTensor
    chunks (SHARD) are per-rank by construction and skipped.

    Args:
        lookup: ``MetadataIndex -> value`` (the planner's ``lookup_object``).
        object_cache: filled with each object's serialized bytes, so the write reuses them.
    """
    out = {}
    for item in items:
        if item.type == WriteItemType.TENSOR:
            out[item.index.fqn] = tensor_digest(lookup(item.index))
        elif item.type == WriteItemType.BYTE_IO:
            data = object_bytes(lookup(item.index))
            object_cache[item.index.fqn] = data
            out[item.index.fqn] = xxhash.xxh3_64_hexdigest(data)
    return out


def differing(plans: list[SavePlan]) -> set[str]:
    """Keys whose digests differ between the ranks of ``plans`` (the gathered local plans)."""
    seen: dict[str, str] = {}
    out = set()
    for p in plans:
        for fqn, d in getattr(p, "digests", {}).items():
            if seen.setdefault(fqn, d) != d:
                out.add(fqn)
    return out


def qualify(plans: list[SavePlan], keys: set[str]) -> list[SavePlan]:
    """``plans`` with, for each of ``keys`` a plan holds, the item also under the rank's
    qualified key (:func:`qualified`); the plain item stays only in the lowest rank's plan, so
    the plain copy of a key whose values differ is that rank's (what a rank that did not exist
    at save time loads, the same rank for every key)."""
    if not keys:
        return plans
    lowest: dict[str, int] = {}
    for p in plans:
        for it in p.items:
            if it.type != WriteItemType.SHARD and it.index.fqn in keys:
                lowest[it.index.fqn] = min(lowest.get(it.index.fqn, 1 << 62), getattr(p, "rank", -1))
    out = []
    for p in plans:
        rank = getattr(p, "rank", -1)
        items = [it for it in p.items
                 if it.type == WriteItemType.SHARD or it.index.fqn not in keys or lowest[it.index.fqn] == rank]
        extra = [dataclasses.replace(it, index=MetadataIndex(qualified(rank, it.index.fqn), it.index.offset))
                 for it in p.items if it.type != WriteItemType.SHARD and it.index.fqn in keys]
        out.append(dataclasses.replace(p, items=items + extra))
    return out


def build_record(all_plans: list[SavePlan], deduped: list[SavePlan]) -> dict:
    """The save's record (:data:`RECORD_KEY`) from the gathered plans and DCP's deduplicated
    ones (which plan kept each plain key tells whose value the plain copy is)."""
    digests = {getattr(p, "rank", -1): getattr(p, "digests", {}) for p in all_plans}
    items: dict[str, tuple[str | None, dict[int, str]]] = {}
    for p in deduped:
        mine = digests.get(getattr(p, "rank", -1), {})
        for it in p.items:
            fqn = it.index.fqn
            if it.type == WriteItemType.SHARD or fqn.startswith(PREFIX) or fqn not in mine:
                continue
            plain = mine[fqn]
            items[fqn] = (plain, {r: d[fqn] for r, d in digests.items() if fqn in d and d[fqn] != plain})
    return {"world": global_world(), "ranks": sorted(digests), "items": items}


def with_record(metadata: Metadata, record: dict, qualified_keys: list[str]) -> Metadata:
    """``metadata`` whose ``planner_data`` also holds ``record`` and a top-level path for each
    qualified key (DCP's key-filtered loaders look every key up in ``planner_data``)."""
    pd = dict(metadata.planner_data or {})
    pd.update({q: (q,) for q in qualified_keys})
    pd[RECORD_KEY] = record
    return dataclasses.replace(metadata, planner_data=pd)


def record_of(metadata: Metadata) -> dict | None:
    """The save's record in ``metadata`` (None: a checkpoint not written by tierckpt's planners)."""
    pd = metadata.planner_data
    rec = pd.get(RECORD_KEY) if isinstance(pd, dict) else None
    return rec if isinstance(rec, dict) else None


def differs(metadata: Metadata, fqn: str) -> bool:
    """Whether the ranks that saved ``metadata`` had different values of ``fqn``."""
    rec = record_of(metadata)
    item = rec.get("items", {}).get(fqn) if rec else None
    return bool(item and (item[1] or item[0] is None))


class PerRankValueMissing(Exception):
    """This rank's own value of a key is not in the checkpoint (the copy that held it is lost)."""


def rank_view(metadata: Metadata, state_dict: dict, rank: int) -> tuple[Metadata, dict[str, str]]:
    """What global rank ``rank`` loads of each non-sharded key of the flattened ``state_dict``.

    Returns:
        ``(view, redirect)``: ``metadata`` in which each redirected key describes this rank's
        qualified entry (so DCP plans its reads with that entry's size), and
        ``{fqn: qualified key}`` to point the planned reads' storage index at.
    Raises:
        PerRankValueMissing: the rank saved a value of a key that differs from the plain copy
            and its qualified entry is absent, or (in-cluster views) no copy of the rank's node
            is left, so whether its value was the plain one cannot be known.
    """
    sd_md = metadata.state_dict_metadata
    rec = record_of(metadata)
    items = rec.get("items", {}) if rec else {}
    saved_ranks = set(rec.get("ranks", [])) if rec else set()
    world = int(rec.get("world", 0)) if rec else 0
    redirect, missing, foreign = {}, [], []
    for fqn, obj in state_dict.items():
        q = qualified(rank, fqn)
        if q in sd_md:
            redirect[fqn] = q
            continue
        if fqn not in items or isinstance(obj, DTensor):
            continue
        plain, diff = items[fqn]
        if rank in saved_ranks:
            if rank in diff or plain is None:
                missing.append(fqn)
        elif rank < world:  # it saved, but no copy of its node is left
            missing.append(fqn)
        elif diff or plain is None:
            foreign.append(fqn)
    if missing:
        raise PerRankValueMissing(f"rank {rank}'s own value of {missing[:5]} is not in this checkpoint")
    if foreign:
        log.warning("tierckpt: rank %d did not exist when this step was saved; it loads the plain copy "
                    "(one saved rank's value) of the keys whose saved values differed per rank: %s",
                    rank, foreign[:20])
    if not redirect:
        return metadata, {}
    view = dict(sd_md)
    for fqn, q in redirect.items():
        view[fqn] = sd_md[q]
    return dataclasses.replace(metadata, state_dict_metadata=view), redirect


def redirect_plan(plan: LoadPlan, redirect: dict[str, str]) -> LoadPlan:
    """``plan`` with each read of a redirected key taken from its qualified entry (the
    destination stays the plain key, so DCP writes into the rank's own state)."""
    if not redirect:
        return plan
    items = [dataclasses.replace(it, storage_index=MetadataIndex(redirect[it.dest_index.fqn], it.storage_index.offset,
                                                                 it.storage_index.index))
             if it.dest_index.fqn in redirect else it for it in plan.items]
    return dataclasses.replace(plan, items=items)


# ------------------------------------------------------------------- in-cluster merged views
def merge_records(parts: dict[int, Metadata], sd_md: dict, origins: dict) -> dict | None:
    """Merge the records of per-node metadata ``parts`` (in-cluster view) in place of
    ``sd_md``/``origins`` of :func:`tierckpt.restore.chunkmap.merge_metadata`.

    A key whose values differ across the saved nodes gets, for each saved rank without a
    qualified entry in any copy, a qualified entry pointing at a node copy whose plain value
    is that rank's (same digest). Returns the merged record (None: no part has one); ranks
    whose value no copy holds stay without an entry, and ranks of nodes no copy is left of
    out of its ``ranks``, so their load is refused (:func:`rank_view`).
    """
    recs: dict[int, dict] = {}
    for m, md in parts.items():
        rec = record_of(md)
        if rec is not None:
            recs[m] = rec
    if not recs:
        return None
    ranks = sorted({r for rec in recs.values() for r in rec.get("ranks", [])})
    world = max(int(rec.get("world", 0)) for rec in recs.values())
    fqns = {f for rec in recs.values() for f in rec.get("items", {})}
    items: dict[str, tuple[str | None, dict[int, str]]] = {}
    for fqn in sorted(fqns):
        own: dict[int, str] = {}
        plains: dict[int, str] = {}
        for m, rec in recs.items():
            if fqn not in rec.get("items", {}):
                continue
            plain, diff = rec["items"][fqn]
            plains[m] = plain
            for r in rec.get("ranks", []):
                own[r] = diff.get(r, plain)
        values = set(own.values()) | set(plains.values())
        if len(values) <= 1:
            items[fqn] = (next(iter(values), None), {})
            continue
        items[fqn] = (None, own)
        _plain_from_lowest(fqn, own, plains, origins)
        for r, d in own.items():
            q = qualified(r, fqn)
            if q in sd_md:
                continue
            for m in sorted(m for m, p in plains.items() if p == d):
                for idx, si in parts[m].storage_data.items():
                    if idx.fqn == fqn:
                        sd_md.setdefault(q, parts[m].state_dict_metadata[fqn])
                        origins.setdefault(MetadataIndex(q, idx.offset), []).append((m, si))
    return {"world": world, "ranks": ranks, "items": items}


def _plain_from_lowest(fqn: str, own: dict[int, str], plains: dict[int, str], origins: dict) -> None:
    """Keep, as sources of ``fqn``'s plain entry, only the copies holding the lowest saved
    rank's value (a rank new since the save then reads that rank's value of every key, as
    from the persistent tier); unchanged when no copy of it is left."""
    want = own[min(own)]
    nodes = {m for m, p in plains.items() if p == want}
    if not nodes:
        return
    for idx in [i for i in origins if i.fqn == fqn]:
        origins[idx] = [(m, si) for m, si in origins[idx] if m in nodes]
