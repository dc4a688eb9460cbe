"""torchtitan adapter of tierckpt.

Submodules:

- ``titan_plugin.manager``: ``TieredCheckpointManager``, torchtitan's ``CheckpointManager`` with
  tierckpt's tiers (``[checkpoint]`` keys in its ``Config``).
- ``titan_plugin.toml``, ``titan_plugin.train``: ``python -m titan_plugin.train --toml FILE``.
- ``titan_plugin.metrics``: exact per-step losses (JSON lines) and tierckpt's save, restore
  and interval metrics for torchtitan's metric logger.

The CPU patches, the demo corpus and tokenizer and the demo's config function are not part of
this package: they are in the repository's development package :mod:`tierckpt_dev.titan`,
which :mod:`titan_plugin.train` imports only on a machine without an accelerator.

This package's ``__init__`` stays light: it imports neither torch nor torchtitan.
"""
