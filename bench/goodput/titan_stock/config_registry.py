"""``--module bench.goodput.titan_stock --config titan_demo_stock``: the torchtitan demo
(``tierckpt_dev.titan.config_registry.titan_demo``: llama3 debug model, FSDP2 over gloo on CPU,
the same data, seed and per-step metrics JSONL) with torchtitan's **stock** checkpointer,
``torchtitan.components.checkpointer.CheckpointManager`` — DCP to ``<dump_folder>/checkpoint``
(the shared folder) with ``async_mode="async"`` (DCP ``async_save`` in a thread), what a
torchtitan user runs without tierckpt. The interval comes from ``--checkpoint.interval``.

Run with ``python -m torchtitan.train --module bench.goodput.titan_stock --config
titan_demo_stock …`` (the CPU patches are applied by ``titan_demo`` itself).
"""

from __future__ import annotations

from torchtitan.components.checkpointer import CheckpointManager
from torchtitan.trainer import Trainer

from tierckpt_dev.titan.config_registry import titan_demo as _titan_demo

__all__ = ["titan_demo_stock"]


def titan_demo_stock() -> Trainer.Config:
    """The demo with torchtitan's own DCP checkpointer, async, every 20 steps by default."""
    cfg = _titan_demo()
    cfg.checkpoint = CheckpointManager.Config(enable=True, folder="checkpoint", interval=20, async_mode="async",
                                              last_save_model_only=False, keep_latest_k=3)
    return cfg
