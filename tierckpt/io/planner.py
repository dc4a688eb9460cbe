"""DCP planners for per-node checkpoints and for loads that must never leave a tensor half-set.

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
checkpoint into a bf16 template silently casts in DCP).
"""

from __future__ import annotations

import math

from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
    _validate_global_plan,
    create_default_global_save_plan,
)
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, WriteItemType
from torch.distributed.checkpoint.planner_helpers import _create_chunk_list
from torch.distributed.tensor import DTensor

from tierckpt.errors import TierckptError


class PlanCoverageError(TierckptError, RuntimeError):
    """A save or load plan does not cover what it must (see the module docstring)."""


class NodeLocalSavePlanner(DefaultSavePlanner):
    """DefaultSavePlanner for a per-node checkpoint (global coordinates, node-local coverage).

    Plan caching stays off: a cached plan silently reused after the state's structure changed
    loads or saves the wrong chunks without an error.
    """

    def __init__(self) -> None:
        super().__init__(enable_plan_caching=False)

    def _create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        import dataclasses
        from collections import ChainMap

        deduped = self._dedup_save_plans(all_plans)
        global_plan, metadata = create_default_global_save_plan(deduped)
        if self.flatten_state_dict:
            merged = dict(ChainMap(*[p.planner_data for p in global_plan]))
            metadata = dataclasses.replace(metadata, planner_data=merged)
        errors = [e for e in _validate_global_plan(global_plan, metadata) if "invalid fill" not in e]
        errors += _node_coverage_errors(all_plans, metadata)
        if errors:
            summary = "; ".join(errors)
            raise ValueError(f"Failed to validate node-local plan: {summary[:500]}")
        return global_plan, metadata


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
    """

    def shape_may_differ(self, fqn: str) -> bool:
        """Whether the template's global shape of ``fqn`` may differ from the saved one (the
        restore's template check, :mod:`tierckpt.restore.template`, then skips it). False; a
        framework's planner that reconciles such shapes itself overrides it."""
        return False

    def create_local_plan(self) -> LoadPlan:
        plan = super().create_local_plan()
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
        return plan
