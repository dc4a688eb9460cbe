"""torchtitan adapter of tierckpt.

Submodules:

- ``titan_plugin.cpu``: CPU compatibility patches for torchtitan 0.3.0, applied only when no
  accelerator is present (``apply_cpu_compat``).
- ``titan_plugin.assets``: demo corpus (CPython stdlib docstrings) and a byte-level BPE tokenizer
  trained on it, built once and cached (``ensure_assets``).
- ``titan_plugin.config_registry``: config functions for ``--module titan_plugin --config <fn>``
  (e.g. ``titan_demo``).

This package's ``__init__`` stays light: it imports neither torch nor torchtitan.
"""
