"""Whether this process has an accelerator (what the adapters' CPU shims decide on)."""

from __future__ import annotations

import torch


def accelerator_present() -> bool:
    """True when torch sees CUDA/ROCm or another ``torch.accelerator`` device; an odd build
    whose ``torch.accelerator.is_available()`` raises counts as none."""
    if torch.cuda.is_available():
        return True
    acc = getattr(torch, "accelerator", None)
    if acc is not None and hasattr(acc, "is_available"):
        try:
            return bool(acc.is_available())
        except Exception:  # pragma: no cover - odd builds
            return False
    return False
