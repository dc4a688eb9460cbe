"""Which parallel layout a local-tier step was written under, and what a restore does when the
job's layout changed since (a node lost for good, the job going on with fewer).

Every local-tier step holds, next to the common state, the Megatron parallel sizes it was
saved with and the global shapes of its optimizer buckets (:data:`LAYOUT_KEY`:
``world_size``, ``tp``, ``pp``, ``cp``, ``ep``, ``dp``, ``buckets``).

The local tier stores the distributed optimizer ``dp_reshardable``: each grad-buffer bucket
is one global 1-D tensor per model-parallel rank (``dp_group_idx``), and every DP rank's
slice a chunk of it at its global offset. Its global shape does not depend on DP, so a DP
change needs no conversion to ``fully_reshardable``: the engine's in-cluster resharded
restore reads the new slices from the node-local copies by DCP's chunk resharding. Two
changes keep the keys while their contents move, which a chunk coverage check cannot be
relied on to catch (a key whose new shape is smaller is "covered" by the old one's first
elements; the attempt fails only if some other key is missing or larger):

- a model-parallel change (TP/PP/CP/EP): ``dp_group_idx_<k>`` then names another rank's
  buffer;
- moved bucket boundaries (another DDP bucket size; Megatron's default grows with DP above
  40): a bucket's global shape changes.

So a restore first reads the step's layout (:func:`saved_layout`). Either change skips the
node-local and replica sources for the ``fully_reshardable`` persistent step
(:func:`restore_persistent_only`), saying why once (global rank 0's log, a ``restore_policy``
ledger record, ``MegatronTiers.last_restore_reason``); with no persistent step to load it
raises :class:`tierckpt.NoCheckpointError` naming the persistent tier. A DP-only change with
the same buckets is left to the engine (in-cluster, else the persistent tier).
"""

from __future__ import annotations

import io
import re

import torch

from tierckpt import NoCheckpointError
from tierckpt.integration import read_item

LAYOUT_KEY = "tierckpt.layout"
"""Key of the parallel layout inside a local-tier DCP checkpoint (``torch.save`` bytes)."""

MODEL_DIMS = ("tp", "pp", "cp", "ep")
"""Model-parallel sizes: a change of any of them needs the persistent step."""

DIMS = MODEL_DIMS + ("dp",)
"""Parallel sizes compared between the saved and the current layout."""

PERSISTENT_FLAGS = ("the persistent tier (TierConfig.persistent_root with 'persistent' in TierConfig.tiers; "
                    "Megatron-LM: --save with --ckpt-plugin-persistent-interval or --save-interval)")
"""How an error names the persistent tier."""

_BUCKET_RE = re.compile(r"^optimizer\.distributed\.dp_group_idx_\d+\.gbuf_idx_\d+\..*\.bucket_idx_\d+\.\w+$")


def bucket_shapes(state: dict) -> dict[str, tuple[int, ...]]:
    """``{key: global shape}`` of the distributed optimizer's ``dp_reshardable`` bucket tensors
    (``optimizer.distributed.dp_group_idx_<k>.gbuf_idx_<g>.dtype_<d>.bucket_idx_<b>.<state>``)
    in a Megatron state dict or its sharded part; empty for other formats."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    return {t.key: tuple(t.global_shape) for t in nested_values(state)
            if isinstance(t, ShardedTensor) and _BUCKET_RE.match(t.key)}


def parallel_layout(sharded: dict | None = None) -> dict | None:
    """This job's Megatron parallel sizes: ``{"world_size", "tp", "pp", "cp", "ep", "dp"}``
    (``dp`` without context parallelism, as the distributed optimizer shards), plus
    ``"buckets"`` (:func:`bucket_shapes` of ``sharded``) when ``sharded`` is given; None when
    Megatron's parallel state is not initialised (no layout is recorded then)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return None
    out = {"world_size": dist.get_world_size(), "tp": ps.get_tensor_model_parallel_world_size(),
           "pp": ps.get_pipeline_model_parallel_world_size(), "cp": ps.get_context_parallel_world_size(),
           "ep": ps.get_expert_model_parallel_world_size(), "dp": ps.get_data_parallel_world_size()}
    if sharded is not None:
        out["buckets"] = bucket_shapes(sharded)
    return out


def _sizes(saved: dict, now: dict, dims) -> list[str]:
    return [f"saved {d.upper()}={saved[d]}, now {d.upper()}={now.get(d)}" for d in dims
            if saved.get(d) is not None and saved.get(d) != now.get(d)]


def layout_change(saved: dict | None, now: dict | None, local_fmt: str) -> str | None:
    """Why a local-tier step saved under ``saved`` cannot be read from the node-local copies
    under ``now`` (both as :func:`parallel_layout` returns them): a model-parallel size
    differs, e.g. ``"local tier is dp_reshardable: saved TP=1, now TP=2, saved DP=4, now
    DP=1"``. None when only DP differs (see :func:`bucket_change`), nothing differs, or either
    layout is unknown."""
    if not saved or not now or not _sizes(saved, now, MODEL_DIMS):
        return None
    return f"local tier is {local_fmt}: {', '.join(_sizes(saved, now, DIMS))}"


def dp_changed(saved: dict | None, now: dict | None) -> bool:
    """Whether the DP size differs between two known layouts."""
    return bool(saved and now and _sizes(saved, now, ("dp",)))


def _group(key: str) -> str:
    return key.split(".gbuf_idx_", 1)[0]


def bucket_change(saved: dict, now_buckets: dict[str, tuple[int, ...]], local_fmt: str,
                  now: dict) -> str | None:
    """Why a DP change cannot reshard the ``dp_reshardable`` buckets from the node-local copies:
    a bucket key saved or needed by one side only, or a different global shape (the DDP bucket
    boundaries moved: Megatron's default bucket size, ``max(4e7, 1e6 × DP)`` elements, grows
    with DP above 40). None when every bucket keeps its key and global shape. A step saved
    without its bucket shapes counts as changed.

    The step records the buckets of one rank's model-parallel group (``dp_group_idx``; the
    node's ranks write the same item, DCP keeps one): only groups both sides have are compared
    here, and the caller agrees over every rank (every group exists on some rank of the job,
    and every group's buckets follow the same size rule)."""
    before = saved.get("buckets")
    what = f"local tier is {local_fmt}: {', '.join(_sizes(saved, now, DIMS))}"
    if before is None:
        return f"{what}, and the step does not record its optimizer buckets"
    groups = {_group(k) for k in before} & {_group(k) for k in now_buckets}
    keys = {k for k in set(before) | set(now_buckets) if _group(k) in groups}
    for key in sorted(keys):
        a, b = before.get(key), now_buckets.get(key)
        if a != b:
            return f"{what}, and bucket {key} changed (saved global shape {a}, now {b})"
    return None


def saved_layout(engine, top_key: str, step: int | None) -> tuple[int, dict] | None:
    """``(step, layout)`` of the step a restore would choose (or ``step``), read from one
    verified node-local copy (collective, :func:`tierckpt.integration.read_item`); None when no node-local
    copy holds it or the step was written before layouts were recorded."""
    if engine.local is None:
        return None
    got = read_item(engine, f"{top_key}.{LAYOUT_KEY}", step)
    if got is None:
        return None
    return got[0], torch.load(io.BytesIO(got[1]), weights_only=False)


def persistent_target(engine, step: int | None, change: str) -> int:
    """The persistent step a layout change restores: ``step``, or the newest committed save's
    (by save order; collective: the engine's agreed inventory). ``change``: :func:`layout_change`'s text.

    Raises:
        NoCheckpointError: the persistent tier holds no such step (names the persistent tier
            and why the node-local copies cannot be used).
    """
    inv = engine.inventory()
    steps = sorted(inv.persistent)
    if step is not None and step in steps:
        return step
    newest = inv.newest_persistent()  # the newest save by agreed order, not the highest step number
    if step is None and newest is not None:
        return newest
    want = f"step {step}" if step is not None else "a step"
    raise NoCheckpointError(
        f"{change}, so the node-local and replica copies cannot be loaded; {PERSISTENT_FLAGS} holds no "
        f"committed {want} (committed persistent steps: {steps}). Restart with the saved layout, or configure "
        "the persistent tier so that a layout change has a fully_reshardable step to load")


def restore_persistent_only(engine, state_dict: dict, step: int | None, rollback: bool):
    """Restore ``step`` (None: the newest) from the persistent tier only, skipping every
    node-local, replica and in-cluster source (collective; the engine's
    ``restore(..., sources=("persistent",))``, whose inventory stays complete, so a rollback
    still sees the node-local steps). Returns the engine's :class:`tierckpt.RestoreResult`."""
    return engine.restore(state_dict, step=step, rollback=rollback, sources=("persistent",))
