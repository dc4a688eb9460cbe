"""Development and demo helpers of the tierckpt repository; not part of the ``tierckpt`` wheel.

- :mod:`tierckpt_dev.titan`: torchtitan on a machine without an accelerator: CPU compatibility
  patches (:mod:`~tierckpt_dev.titan.cpu`), the demo corpus and tokenizer
  (:mod:`~tierckpt_dev.titan.assets`) and the demo's config function
  (``--module tierckpt_dev.titan --config titan_demo``, :mod:`~tierckpt_dev.titan.config_registry`).
- :mod:`tierckpt_dev.mcore`: CPU shims for megatron-core (:mod:`~tierckpt_dev.mcore.cpu`) and
  Megatron-LM's training loop (:mod:`~tierckpt_dev.mcore.cpu_lm`).

Importable from a checkout: the repository root on ``sys.path`` (``python -m`` from the root,
pytest, ``launch/*.py`` and ``launch/tierckpt_slurm.sh``, which put it on ``PYTHONPATH``). The
adapters import it only on a machine without an accelerator, so a GPU installation of the
wheel never needs it. This ``__init__`` imports nothing (no torch, no torchtitan).
"""
