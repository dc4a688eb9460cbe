"""The adaptive scheduler's prior (:mod:`tierckpt.sched.mtbf`): Llama 3's per-GPU MTBF and the
prior's weight. A base module (no tierckpt imports) so that :class:`~tierckpt.config.TierConfig`'s
defaults do not import the scheduler wing above it (docs/architecture.md, wing order)."""

__all__ = ["DEFAULT_GPU_MTBF_S", "DEFAULT_WEIGHT", "LLAMA3_DAYS", "LLAMA3_GPUS", "LLAMA3_INTERRUPTIONS"]

LLAMA3_GPUS = 16384
"""GPUs of the Llama 3 405B pre-training run (Dubey et al. 2024, §3.3.4)."""
LLAMA3_DAYS = 54
"""Length of the Llama 3 snapshot in which interruptions were counted, days."""
LLAMA3_INTERRUPTIONS = 419
"""Unexpected interruptions in that snapshot."""
DEFAULT_GPU_MTBF_S = LLAMA3_GPUS * LLAMA3_DAYS * 86400 / LLAMA3_INTERRUPTIONS
"""Per-GPU MTBF derived from Llama 3, seconds: 16384 · 54 · 86400 / 419 ≈ 1.824e8 s."""
DEFAULT_WEIGHT = 1.0
"""Default prior weight, in pseudo-failures: one observed failure counts as much as the prior."""
