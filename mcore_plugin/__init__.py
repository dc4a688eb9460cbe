"""Megatron-Core adapter of tierckpt.

- :mod:`mcore_plugin.strategies` — ``MegatronTiers`` and the ``torch_dist`` save/load strategy
  wrappers (local tier + replica + persistent tier);
- :mod:`mcore_plugin.optim_state` — per-parameter Adam ``step`` on torch's AdamW fallback;
- :mod:`mcore_plugin.export` — ``dp_reshardable`` → ``fully_reshardable`` export
  (``tierckpt export-mcore``);
- ``args``, ``install``, ``local_manager``, ``pretrain`` — the Megatron-LM integration
  (``python -m mcore_plugin.pretrain``; without an accelerator it applies the CPU shims of
  the repository's development package :mod:`tierckpt_dev.mcore`, not part of the wheel).

Importing the package imports nothing from Megatron; each module does when imported.
"""
