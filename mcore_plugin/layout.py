"""Which parallel layout a local-tier step was written under, and what a restore does when the
job's layout changed since (a node lost for good, the job going on with fewer).

Every local-tier step holds, next to the common state, the Megatron parallel sizes it was
saved with (:data:`LAYOUT_KEY`: ``world_size``, ``tp``, ``pp``, ``cp``, ``ep``, ``dp``).

The local tier stores the distributed optimizer ``dp_reshardable``: each grad-buffer bucket
is one global 1-D tensor per model-parallel rank, and every DP rank's slice a chunk of it at
its global offset. Its shape does not depend on DP, so the format reshards over DP by DCP's
chunk resharding alone (no conversion), but only for the same TP/PP/CP/EP and the same bucket
boundaries. The engine's restore, however, loads each node from that node's own checkpoint
(or its replica): after a DP change no node holds the slices its ranks now own. So a restore
under another layout than the step's skips the node-local and replica sources and loads the
``fully_reshardable`` persistent step (:func:`restore_persistent_only`), saying why once
(global rank 0's log, a ``restore_policy`` ledger record, ``MegatronTiers.last_restore_reason``);
with no persistent step to load it raises :class:`tierckpt.NoCheckpointError` naming the
persistent tier.
"""

from __future__ import annotations

import inspect
import io

import torch

from tierckpt import NoCheckpointError, read_item

LAYOUT_KEY = "tierckpt.layout"
"""Key of the parallel layout inside a local-tier DCP checkpoint (``torch.save`` bytes)."""

DIMS = ("tp", "pp", "cp", "ep", "dp")
"""Parallel sizes compared between the saved and the current layout."""

PERSISTENT_FLAGS = ("the persistent tier (TierConfig.persistent_root with 'persistent' in TierConfig.tiers; "
                    "Megatron-LM: --save with --ckpt-plugin-persistent-interval or --save-interval)")
"""How an error names the persistent tier."""


def parallel_layout() -> dict | None:
    """This job's Megatron parallel sizes: ``{"world_size", "tp", "pp", "cp", "ep", "dp"}``
    (``dp`` without context parallelism, as the distributed optimizer shards), or None when
    Megatron's parallel state is not initialised (no layout is recorded then)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return None
    return {"world_size": dist.get_world_size(), "tp": ps.get_tensor_model_parallel_world_size(),
            "pp": ps.get_pipeline_model_parallel_world_size(), "cp": ps.get_context_parallel_world_size(),
            "ep": ps.get_expert_model_parallel_world_size(), "dp": ps.get_data_parallel_world_size()}


def layout_change(saved: dict | None, now: dict | None, local_fmt: str) -> str | None:
    """What makes a local-tier step saved under ``saved`` unloadable under ``now`` (both as
    :func:`parallel_layout` returns them), e.g. ``"local tier is dp_reshardable: saved DP=4,
    now DP=2"``; None when it loads (same sizes, or either layout unknown)."""
    if not saved or not now:
        return None
    diff = [d for d in DIMS if saved.get(d) is not None and saved.get(d) != now.get(d)]
    if not diff:
        return None
    what = ", ".join(f"saved {d.upper()}={saved[d]}, now {d.upper()}={now[d]}" for d in diff)
    return f"local tier is {local_fmt}: {what}"


def saved_layout(engine, top_key: str, step: int | None) -> tuple[int, dict] | None:
    """``(step, layout)`` of the step a restore would choose (or ``step``), read from one
    verified node-local copy (collective, :func:`tierckpt.read_item`); None when no node-local
    copy holds it or the step was written before layouts were recorded."""
    if engine.local is None:
        return None
    got = read_item(engine, f"{top_key}.{LAYOUT_KEY}", step)
    if got is None:
        return None
    return got[0], torch.load(io.BytesIO(got[1]), weights_only=False)


def persistent_target(engine, step: int | None, change: str) -> int:
    """The persistent step a layout change restores: ``step``, or the newest committed one
    (collective: the engine's agreed inventory). ``change``: :func:`layout_change`'s text.

    Raises:
        NoCheckpointError: the persistent tier holds no such step (names the persistent tier
            and why the node-local copies cannot be used).
    """
    steps = sorted(engine.inventory().persistent)
    if step is not None and step in steps:
        return step
    if step is None and steps:
        return steps[-1]
    want = f"step {step}" if step is not None else "a step"
    raise NoCheckpointError(
        f"{change}, so the node-local and replica copies cannot be loaded; {PERSISTENT_FLAGS} holds no "
        f"committed {want} (committed persistent steps: {steps}). Restart with the saved layout, or configure "
        "the persistent tier so that a layout change has a fully_reshardable step to load")


def restore_persistent_only(engine, state_dict: dict, step: int, rollback: bool):
    """Restore ``step`` from the persistent tier only, skipping every node-local and replica
    source (collective). Returns the engine's :class:`tierckpt.RestoreResult`.

    ASSUMPTION (engine hook requested for issue 12; the engine has none yet):
    ``TieredCheckpointer.restore(state_dict, step, rollback=…, sources=("persistent",))``
    plans over the listed source kinds only, with the full inventory (so a rollback still
    sees the node-local steps). It is used as soon as the engine's ``restore`` takes
    ``sources``. Until then the node-local tier is hidden from the engine's restorer for the
    duration of this call, so its inventory lists persistent steps only (the rest of the
    restore — verification, the ``restore`` ledger record, the scheduler's restart — is the
    engine's own).
    """
    if "sources" in inspect.signature(engine.restore).parameters:
        return engine.restore(state_dict, step=step, rollback=rollback, sources=("persistent",))
    restorer = engine.restorer  # TEMPORARY: not an adapter attribute; remove with the hook
    hidden, restorer.local = restorer.local, None
    try:
        return engine.restore(state_dict, step=step, rollback=rollback)
    finally:
        restorer.local = hidden
