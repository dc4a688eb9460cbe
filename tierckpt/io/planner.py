"""DCP planners for per-node checkpoints and for loads that must never leave a tensor half-set.

:class:`PerRankSavePlanner` — DCP's default save planner, except that a non-sharded value
(plain tensor or object) that differs between ranks under one key is also written once per
rank under a rank-qualified key (:mod:`tierckpt.io.per_rank`); the persistent tier uses it
when its framework hooks bring no planner of their own, the local tier through
:class:`NodeLocalSavePlanner`.

:class:`NodeLocalSavePlanner` — the local tier saves one DCP checkpoint per node over the
node's process group, keeping DTensor/ShardedTensor chunk coordinates global. torch 2.13's
``DefaultSavePlanner`` rejects such a plan once the group has more than one rank, because
the node's chunks do not fill each whole tensor ("invalid fill" in
``default_planner._validate_global_plan``). This planner keeps DCP's bounds and overlap
checks and replaces the fill check by a coverage check against the node's own shards: every
chunk some rank of the node planned to write is in the metadata exactly once.

:class:`VerifyingLoadPlanner` — DCP reads only the intersections of local chunks with saved
chunks; a local chunk the checkpoint does not fully cover would silently keep its old
values. This planner refuses such a plan, and also refuses dtype changes (loading an fp32
checkpoint into a bf16 template silently casts in DCP). Each rank reads its own rank-qualified
entry of a non-sharded key when the checkpoint has one (:func:`tierckpt.io.per_rank.rank_view`).
"""

from __future__ import annotations

import dataclasses
import io
import math
from collections import ChainMap
from typing import Any

from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
    create_default_global_save_plan,
)
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor

from tierckpt.errors import TierckptError
from tierckpt.io import per_rank
from tierckpt.io.dcp_compat import _create_chunk_list, _validate_global_plan


class PlanCoverageError(TierckptError, RuntimeError):
    """A save or load plan does not cover what it must (see the module docstring)."""


class PerRankSavePlanner(DefaultSavePlanner):
    """``DefaultSavePlanner`` that keeps every rank's own value of a non-sharded key.

    Each rank hashes its plain-tensor and object items (xxh3-64, one pass over their bytes per
    save; objects are serialized once and the bytes reused for the write); for every key whose
    digests differ inside the save's process group the coordinator adds one write per rank
    under ``__tierckpt_rank__/<global rank>/<fqn>``, and records the digests in the metadata's
    ``planner_data`` (:mod:`tierckpt.io.per_rank`). The plain key keeps DCP's one copy, so a
    stock ``dcp.load`` reads the checkpoint as before; identical values cost nothing extra.

    Plan caching stays off: a cached plan silently reused after the state's structure changed
    loads or saves the wrong chunks without an error, and the check must run at every save.
    """

    def __init__(self) -> None:
        super().__init__(enable_plan_caching=False)
        self._object_bytes: dict[str, bytes] = {}

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        self._object_bytes = {}
        digests = per_rank.digest_items(plan.items, self.lookup_object, self._object_bytes)
        self.plan = per_rank.RankedSavePlan(plan.items, plan.storage_data, plan.planner_data, plan.usable,
                                            rank=per_rank.global_rank(), digests=digests)
        return self.plan

    def _create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        global_plan, metadata, deduped = self.structure_plan(all_plans)
        return global_plan, self.with_record(metadata, all_plans, deduped)

    def structure_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata, list[SavePlan]]:
        """The validated global plans and metadata of the gathered ``all_plans``, without the
        per-save record (:meth:`with_record`): what depends only on the plans' structure and
        on which keys' values differ per rank (:mod:`tierckpt.io.plan_cache` reuses it).

        Returns:
            ``(global plans, metadata, deduplicated plans)``.
        Raises:
            ValueError: the plans fail DCP's (or the subclass's) validation.
        """
        keys = per_rank.differing(all_plans)
        deduped = self._dedup_save_plans(per_rank.qualify(all_plans, keys))
        global_plan, metadata = create_default_global_save_plan(deduped)
        if self.flatten_state_dict:
            merged = dict(ChainMap(*[p.planner_data for p in global_plan]))
            metadata = dataclasses.replace(metadata, planner_data=merged)
        errors = self._validation_errors(all_plans, global_plan, metadata)
        if errors:
            summary = "; ".join(errors)
            raise ValueError(f"Failed to validate global plan: {summary[:500]}")
        return global_plan, metadata, deduped

    def with_record(self, metadata: Metadata, all_plans: list[SavePlan], deduped: list[SavePlan]) -> Metadata:
        """``metadata`` (of :meth:`structure_plan`) with this save's per-rank record
        (:func:`tierckpt.io.per_rank.build_record`) from the digests of ``all_plans``."""
        qualified = [k for k in metadata.state_dict_metadata if k.startswith(per_rank.PREFIX)]
        return per_rank.with_record(metadata, per_rank.build_record(all_plans, deduped), qualified)

    def _validation_errors(self, all_plans: list[SavePlan], global_plan: list[SavePlan], metadata: Metadata) -> list[str]:
        """DCP's bounds, overlap and fill checks (subclasses adapt them)."""
        return _validate_global_plan(global_plan, metadata)

    def lookup_object(self, index) -> Any:
        return super().lookup_object(dataclasses.replace(index, fqn=per_rank.unqualify(index.fqn))
                                     if index.fqn.startswith(per_rank.PREFIX) else index)

    def transform_object(self, write_item: WriteItem, object: Any):
        if write_item.type == WriteItemType.BYTE_IO:
            data = self._object_bytes.get(per_rank.unqualify(write_item.index.fqn))
            if data is not None:
                return io.BytesIO(data)
        return super().transform_object(write_item, object)


class NodeLocalSavePlanner(PerRankSavePlanner):
    """:class:`PerRankSavePlanner` for a per-node checkpoint (global coordinates, node-local
    coverage)."""

    def _validation_errors(self, all_plans: list[SavePlan], global_plan: list[SavePlan], metadata: Metadata) -> list[str]:
        errors = [e for e in _validate_global_plan(global_plan, metadata) if "invalid fill" not in e]
        return errors + _node_coverage_errors(all_plans, metadata)


def _node_coverage_errors(all_plans: list[SavePlan], metadata: Metadata) -> list[str]:
    """Every shard chunk planned by a rank of the node must appear once in the metadata."""
    planned: dict[str, set] = {}
    for plan in all_plans:
        for item in plan.items:
            if item.type == WriteItemType.SHARD and item.tensor_data is not None:
                c = item.tensor_data.chunk
                planned.setdefault(item.index.fqn, set()).add((tuple(c.offsets), tuple(c.sizes)))
    errors = []
    for fqn, chunks in planned.items():
        md = metadata.state_dict_metadata.get(fqn)
        if not isinstance(md, TensorStorageMetadata):
            errors.append(f"key:{fqn} planned as shards but missing from metadata")
            continue
        saved = [(tuple(c.offsets), tuple(c.sizes)) for c in md.chunks]
        if set(saved) != chunks or len(saved) != len(set(saved)):
            errors.append(f"key:{fqn} node chunks {sorted(chunks)} != metadata chunks {sorted(saved)}")
    return errors


class VerifyingLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner that raises :class:`PlanCoverageError` before any byte is read when

    - a local tensor chunk is not fully covered by the saved chunks (would leave stale values),
    - the saved dtype differs from the target tensor's dtype (would silently cast).

    Coverage: saved chunks are validated non-overlapping at save time, so a local chunk is
    covered iff the volumes of its intersections with saved chunks add up to its own volume.

    Per-rank values: a non-sharded key is read from this rank's qualified entry when the
    checkpoint has one; the plan is refused (:class:`PlanCoverageError`) when the checkpoint's
    record says this rank saved a value of the key that is not in it
    (:func:`tierckpt.io.per_rank.rank_view`).
    """

    def shape_may_differ(self, fqn: str) -> bool:
        """Whether the template's global shape of ``fqn`` may differ from the saved one (the
        restore's template check, :mod:`tierckpt.restore.template`, then skips it). False; a
        framework's planner that reconciles such shapes itself overrides it."""
        return False

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None
        saved = self.metadata
        try:
            self.metadata, redirect = per_rank.rank_view(saved, self.state_dict, per_rank.global_rank())
        except per_rank.PerRankValueMissing as e:
            raise PlanCoverageError(f"checkpoint does not hold this rank's own values: {e}") from e
        try:
            plan = super().create_local_plan()
            self._check(plan)
        finally:
            self.metadata = saved
        return per_rank.redirect_plan(plan, redirect)

    def _check(self, plan: LoadPlan) -> None:
        assert self.metadata is not None
        covered: dict[str, int] = {}
        for item in plan.items:
            covered[item.dest_index.fqn] = covered.get(item.dest_index.fqn, 0) + math.prod(item.lengths)
        problems = []
        for fqn, obj in self.state_dict.items():
            md = self.metadata.state_dict_metadata.get(fqn)
            if not isinstance(md, TensorStorageMetadata):
                continue
            if isinstance(obj, DTensor) and obj.device_mesh.get_coordinate() is None:
                continue
            dtype = getattr(obj, "dtype", None)
            if dtype is not None and md.properties.dtype != dtype:
                problems.append(f"{fqn}: checkpoint dtype {md.properties.dtype} != target {dtype}")
            need = sum(math.prod(c.sizes) for c in _create_chunk_list(obj))
            have = covered.get(fqn, 0)
            if have != need:
                problems.append(f"{fqn}: checkpoint covers {have} of {need} local elements")
        if problems:
            raise PlanCoverageError(
                "checkpoint does not cover this rank's state: " + "; ".join(problems[:5])
                + (" …" if len(problems) > 5 else "")
            )
