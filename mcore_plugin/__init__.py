"""Megatron-Core adapter of tierckpt.

- :mod:`mcore_plugin.strategies` — the ``torch_dist`` save/load strategy wrappers (and the
  public names of the modules below, re-exported);
- :mod:`mcore_plugin.tiers` — ``MegatronTiers``: local tier + replica + persistent tier for
  Megatron state dicts;
- :mod:`mcore_plugin.convert` — Megatron state dicts ↔ the DCP state dicts the tiers write;
- :mod:`mcore_plugin.persistent_io` — the persistent tier's ``torch_dist`` hooks;
- :mod:`mcore_plugin.metrics` — save/restore metrics for Megatron-LM's TensorBoard/W&B writers;
- :mod:`mcore_plugin.optim_state` — per-parameter Adam ``step`` on torch's AdamW fallback;
- :mod:`mcore_plugin.export` — ``dp_reshardable`` → ``fully_reshardable`` export
  (``tierckpt export-mcore``);
- ``args``, ``install``, ``local_manager``, ``pretrain`` — the Megatron-LM integration
  (``python -m mcore_plugin.pretrain``; without an accelerator it applies the CPU shims of
  the repository's development package :mod:`tierckpt_dev.mcore`, not part of the wheel).

Importing the package imports nothing from Megatron; each module does when imported.
"""
