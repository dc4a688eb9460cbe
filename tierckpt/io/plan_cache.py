"""A DCP save over a node's group that reuses the last committed save's plan when nothing changed.

``dcp.save`` plans every save from scratch: each rank pickles its whole local plan (one
``WriteItem`` with its ``TensorProperties`` per tensor) to the coordinator, the coordinator
pickles one global plan per rank back, every rank pickles its write results (one per tensor)
to the coordinator, and the coordinator broadcasts the whole ``Metadata``. With 2,000 small
tensors per rank these four exchanges are about 30 % of a save's time (cProfile of
``dcp.save``, bench/bench_small_tensors.py, torch 2.13), for a plan that is the same at every
step of a training run.

:func:`save` runs DCP's own save sequence (planner and storage writer hooks in the order of
torch's ``_save_state_dict``, the same ``_DistWrapper`` phases, so a failure on any rank
raises the same ``CheckpointException`` on every rank), except that against a
:class:`PlanCache` holding the last committed save's plans:

- a rank whose local plan equals the one it sent for that save (same keys, chunks, shapes,
  dtypes, flattening) sends only the cache's token and its per-rank value digests
  (:mod:`tierckpt.io.per_rank`, which must be exchanged at every save since values change);
- the coordinator rebuilds the gathered plans from its copy; when every rank's plan and the set
  of keys whose values differ per rank are unchanged, it reuses its global plans and metadata
  and recomputes only what varies per save: the per-rank record of the metadata's
  ``planner_data`` (value digests) and the storage data of the write results. Otherwise it
  plans in full, as DCP does, from the rebuilt plans;
- a rank whose final plan is the cached one receives only the token, a rank whose write results
  (file names, offsets, lengths) equal the cached ones sends only the token; the coordinator
  writes ``.metadata`` from its copies and broadcasts nothing but the outcome.

The cache is consistent across the group by construction: what a save planned becomes
*pending*, and is promoted (:meth:`PlanCache.promote`) only after the save committed on every
rank (the agreed commit of :func:`tierckpt.tiers.commit.save_step`); any failure, a restore or
another process group drops it (:meth:`PlanCache.drop`). Each exchange carries the token of the
cache it refers to; a coordinator or rank that holds another token raises
:class:`PlanCacheMismatch` on every rank, and :func:`save` then saves again without the cache.

DCP's own ``enable_plan_caching`` is not used: its cache is class-level (one per planner
class in the process, shared by every tier and group), is promoted before the save commits,
and a rank compares only its local plan, so a change on one rank and not another, or two groups
saving with the same planner class, reuse plans that no longer fit.
"""

from __future__ import annotations

import dataclasses
import uuid
import weakref
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult

from tierckpt.errors import TierckptError
from tierckpt.io import per_rank
from tierckpt.io.dcp_compat import _DistWrapper
from tierckpt.io.planner import PerRankSavePlanner


class PlanCacheMismatch(TierckptError, RuntimeError):
    """A rank's cache and the coordinator's refer to different saves (raised on every rank;
    :func:`save` then saves again without the cache)."""


@dataclass
class _Coordinated:
    """The coordinator's copy of one save's plans (group rank order)."""

    local_plans: list[SavePlan]  # as gathered (full), digests included
    differing: frozenset[str]  # keys whose values differed per rank
    deduped: list[SavePlan]  # the deduplicated, rank-qualified plans (whose value each plain key holds)
    central: list[SavePlan]  # the global plans after the writer's prepare_global_plan
    metadata: Metadata  # without the per-save record and storage data
    results: list[list[WriteResult]] | None = None


@dataclass
class _Entry:
    """What one save left on a rank for the next one."""

    token: str
    # weak: the cache must not keep a released group (and its gloo threads) alive after close()
    group: weakref.ref
    local_plan: SavePlan  # this rank's local plan, digests cleared
    final_plan: SavePlan
    results: list[WriteResult] | None = None
    coordinated: _Coordinated | None = None  # the coordinator's only


class PlanCache:
    """The plans of the last save committed on every rank of a group, for :func:`save`.

    One per saving tier and group (never shared between groups or threads). :func:`save`
    fills :attr:`pending`; the caller calls :meth:`promote` once the save committed on every
    rank of the group, and :meth:`drop` on any failure, a restore or a new group.

    Attributes:
        hits: saves whose global plan was reused (counted on every rank, for tests and stats).
    """

    def __init__(self) -> None:
        self.committed: _Entry | None = None
        self.pending: _Entry | None = None
        self.hits = 0

    def promote(self) -> None:
        """Make the last save's plans the cache (call once it committed on every rank)."""
        if self.pending is not None and self.pending.results is not None:
            self.committed, self.pending = self.pending, None

    def drop(self) -> None:
        """Forget every cached and pending plan (the next save plans in full)."""
        self.committed = self.pending = None


@dataclass(frozen=True)
class _Brief:
    """A rank's local plan replaced by a reference to its cached copy."""

    token: str
    digests: dict[str, str]


@dataclass(frozen=True)
class _Full:
    """A rank's whole local plan, and the token of the cache it holds (None: none)."""

    plan: SavePlan
    token: str | None


@dataclass(frozen=True)
class _Central:
    """The coordinator's answer: the token of this save, the rank's global plan (None: the
    rank's cached final plan of save ``base``), the token of the cache the coordinator holds
    (None: none), and whether the whole global plan was reused."""

    token: str
    plan: SavePlan | None
    base: str | None
    reused: bool = False


@dataclass(frozen=True)
class _SameResults:
    """A rank's write results, equal to those of its cached save ``token``."""

    token: str


def _structure(plan: SavePlan) -> SavePlan:
    """``plan`` without the per-save value digests (what must match for a reuse)."""
    return dataclasses.replace(plan, digests={}) if isinstance(plan, per_rank.RankedSavePlan) else plan


def _stateful_to_state_dict(state_dict: dict) -> dict:
    """A shallow copy with ``state_dict()`` of each ``Stateful`` value (as ``dcp.save``)."""
    return {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in state_dict.items()}


def save(state_dict: dict, storage_writer: StorageWriter, planner: PerRankSavePlanner,
         group: dist.ProcessGroup, cache: PlanCache | None) -> None:
    """``dcp.save(state_dict, storage_writer=…, planner=…, process_group=group)``, reusing
    ``cache`` (see the module docstring); collective over ``group``.

    Args:
        planner: a fresh :class:`~tierckpt.io.planner.PerRankSavePlanner` (or subclass).
        cache: the group's cache (None: plan in full and cache nothing). Its ``pending`` entry
            holds this save's plans afterwards; the caller promotes or drops it.
    Raises:
        CheckpointException: any rank failed (the same on every rank), as ``dcp.save``.
    """
    if cache is not None and cache.committed is not None and cache.committed.group() is not group:
        cache.drop()
    state_dict = _stateful_to_state_dict(state_dict)
    try:
        _save(state_dict, storage_writer, planner, group, cache)
    except BaseException as e:  # CheckpointException is a BaseException
        if cache is None:
            raise
        cache.drop()  # on every rank: the exception is the same everywhere
        if not _mismatch(e):
            raise
        planner = type(planner)()
        _save(state_dict, storage_writer, planner, group, cache)


def _mismatch(e: BaseException) -> bool:
    failures = getattr(e, "failures", None)
    if not isinstance(failures, dict):
        return False
    return any(isinstance(f[0] if isinstance(f, tuple) else f, PlanCacheMismatch) for f in failures.values())


def _save(state_dict: dict, writer: Any, planner: PerRankSavePlanner, group: dist.ProcessGroup,
          cache: PlanCache | None) -> None:
    """One attempt of :func:`save` (DCP's phases ``plan`` and ``write``)."""
    distW = _DistWrapper(group, True, 0)
    committed = cache.committed if cache is not None else None
    if cache is not None:
        cache.pending = None
    token = uuid.uuid4().hex
    local_box: list[SavePlan] = []
    coord_box: list[tuple[_Coordinated, Metadata]] = []  # the coordinator's only

    def local_step():
        planner.set_up_planner(state_dict=state_dict, storage_meta=writer.storage_meta(),
                               is_coordinator=distW.is_coordinator)
        writer.set_up_storage_writer(distW.is_coordinator, rank=distW.rank, use_collectives=True)
        plan = writer.prepare_local_plan(planner.create_local_plan())
        local_box.append(plan)
        if committed is not None and _structure(plan) == committed.local_plan:
            return _Brief(committed.token, getattr(plan, "digests", {}))
        return _Full(plan, committed.token if committed is not None else None)

    def global_step(sent: list) -> list[_Central]:
        replies, coordinated, metadata = _global_plans(sent, committed, planner, writer, token)
        coord_box.append((coordinated, metadata))
        return replies

    reply: _Central = distW.reduce_scatter("plan", local_step, global_step)
    mine: list[list[WriteResult]] = []

    def write_step():
        if reply.plan is None:
            if committed is None or reply.base != committed.token:
                raise PlanCacheMismatch("the coordinator sent a cached plan this rank does not hold")
            central_plan = committed.final_plan
        else:
            central_plan = reply.plan
        final = planner.finish_plan(central_plan)
        fut = writer.write_data(final, planner)
        fut.wait()
        results = fut.value()
        mine.append(results)
        if cache is not None:
            cache.pending = _Entry(reply.token, weakref.ref(group), _structure(local_box[0]), final)
        if (committed is not None and committed.results is not None and reply.base == committed.token
                and results == committed.results):
            return _SameResults(committed.token)
        return results

    def finish(all_results: list) -> None:
        coordinated, metadata = coord_box[0]
        full = _full_results(all_results, committed)
        # a fresh Metadata: the writer sets its storage data and version in place
        writer.finish(metadata=dataclasses.replace(metadata), results=full)
        coordinated.results = full

    distW.all_reduce("write", write_step, finish)
    if cache is not None and cache.pending is not None:
        cache.pending.results = mine[0]
        cache.pending.coordinated = coord_box[0][0] if coord_box else None
        cache.hits += int(reply.reused)


def _global_plans(sent: list, committed: _Entry | None, planner: PerRankSavePlanner, writer: Any,
                  token: str) -> tuple[list[_Central], _Coordinated, Metadata]:
    """The coordinator's plan phase: the gathered plans rebuilt from the cache, the global plans
    reused or planned in full, one reply per rank, and this save's metadata (no storage data)."""
    prev = committed.coordinated if committed is not None else None
    held = committed.token if committed is not None else None
    plans: list[SavePlan] = []
    for i, s in enumerate(sent):
        if isinstance(s, _Brief):
            if prev is None or s.token != held or len(prev.local_plans) != len(sent):
                raise PlanCacheMismatch(f"group rank {i} refers to a cached plan the coordinator does not hold")
            plans.append(dataclasses.replace(prev.local_plans[i], digests=s.digests))  # type: ignore[call-arg]
        else:
            plans.append(s.plan)
    differing = frozenset(per_rank.differing(plans))
    reuse = prev is not None and differing == prev.differing and all(isinstance(s, _Brief) for s in sent)
    if reuse:
        assert prev is not None
        deduped, central, base_md = prev.deduped, prev.central, prev.metadata
    else:
        global_plan, base_md, deduped = planner.structure_plan(plans)
        central = writer.prepare_global_plan(global_plan)
    out = []
    for i, c in enumerate(central):
        # the rank holds the committed save's final plan when it holds its token
        holds = prev is not None and _token_of(sent[i]) == held and len(prev.central) == len(central)
        same = holds and (reuse or c == prev.central[i])  # type: ignore[union-attr]
        out.append(_Central(token, None if same else c, held, reuse))
    return (out, _Coordinated(plans, differing, deduped, central, base_md),
            planner.with_record(base_md, plans, deduped))


def _full_results(all_results: list, committed: _Entry | None) -> list[list[WriteResult]]:
    """Every rank's write results, the cached ones in place of :class:`_SameResults`."""
    prev = committed.coordinated if committed is not None else None
    full: list[list[WriteResult]] = []
    for i, r in enumerate(all_results):
        if isinstance(r, _SameResults):
            if prev is None or prev.results is None or committed is None or r.token != committed.token:
                raise PlanCacheMismatch(f"group rank {i} refers to cached write results the coordinator does not hold")
            full.append(prev.results[i])
        else:
            full.append(r)
    return full


def _token_of(sent: _Brief | _Full) -> str | None:
    """The cache token a rank's plan message says it holds."""
    return sent.token
