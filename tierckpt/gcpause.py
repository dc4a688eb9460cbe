"""Python's cyclic garbage collector kept out of the training stall and the restore.

A generation-2 collection walks every container object the process tracks: 0.13 s for the
255k objects that importing torch and tierckpt leaves (measured here; seconds for the heap of
a large training process, which is why Megatron-LM offers ``--manual-gc``). The allocations of
a save or a restore (plans, metadata, records) regularly push the collector over its
threshold, and that pass then lands inside the stall δ or the restore. :func:`collector_paused`
disables automatic collection for the duration of such a call; the pass the allocations
would have triggered runs at the next threshold, outside it. Only cycles wait for it:
reference counting frees everything else as usual. A collector the user turned off
(``gc.disable()``, Megatron's manual GC) stays off.
"""

from __future__ import annotations

import contextlib
import functools
import gc
from collections.abc import Callable, Iterator
from typing import TypeVar

F = TypeVar("F", bound=Callable)


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Disable automatic garbage collection inside the block; re-enable it afterwards only if
    it was enabled on entry (nesting is safe; explicit ``gc.collect()`` calls still run)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def paused(fn: F) -> F:
    """Decorator: run ``fn`` inside :func:`collector_paused`."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with collector_paused():
            return fn(*args, **kwargs)
    return wrapper  # type: ignore[return-value]
