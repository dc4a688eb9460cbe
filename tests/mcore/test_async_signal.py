"""The async half of ``TieredSaveStrategy``: ``async_fn`` returns once the trainer's tier futures
resolved, wherever Megatron runs it (``mcore_plugin.strategies._Completion``):

- in the trainer (``AsyncRequest.execute_sync``);
- in a forked process (``TemporalAsyncCaller``, Megatron-LM's default);
- in a spawned worker that receives the request through a multiprocessing queue
  (``PersistentAsyncCaller``; the same queue type and pickling, without the CUDA calls its
  own loop makes).

The finalize function is the commit point: a persistent tier that did not commit raises.
"""

from __future__ import annotations

import multiprocessing as mp
import threading
import time
from concurrent.futures import Future

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is not installed")

from megatron.core.dist_checkpointing.core import CheckpointingException  # noqa: E402
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest  # noqa: E402

from mcore_plugin import strategies  # noqa: E402
from tierckpt import CheckpointRecord, SaveHandle  # noqa: E402


class _Tiers:
    """What ``_Completion`` calls: ``wait(tiers, step=)`` blocks on the handle's futures."""

    def __init__(self, handle: SaveHandle):
        self.handle = handle

    def wait(self, tiers, *, step=None):
        return {t: self.handle.futures[t].result(timeout=60) is not None for t in tiers}


def _pending(step: int = 7):
    fut = Future()
    handle = SaveHandle(step, 0.01, {"persistent": fut})
    return handle, fut, strategies._Completion(_Tiers(handle), handle)


def _resolve_later(fut: Future, ok: bool, delay: float = 0.3) -> None:
    rec = CheckpointRecord(tier="persistent", step=7, ok=ok, error=None if ok else "OSError: full")
    threading.Timer(delay, fut.set_result, args=(rec,)).start()


def _spawned_worker(queue, done_q) -> None:
    """A spawned worker like ``PersistentAsyncCaller.async_loop``: requests arrive pickled."""
    item = queue.get()
    item.async_fn(*item.async_fn_args, **item.async_fn_kwargs)
    queue.task_done()
    done_q.put(time.monotonic())


def test_in_process_waits_for_the_futures_then_finalizes():
    handle, fut, done = _pending()
    t0 = time.monotonic()
    _resolve_later(fut, ok=True)
    req = AsyncRequest(strategies.wait_for_tiers, (done.reader, 30.0),
                       [lambda: strategies._finalize(done, handle, ["persistent"], 30.0)])
    req.async_fn(*req.async_fn_args)
    assert fut.done() and time.monotonic() - t0 >= 0.25
    for f in req.finalize_fns:
        f()
    assert done.reader.closed


def test_forked_worker_returns_only_after_the_futures_resolved():
    handle, fut, done = _pending()
    p = mp.get_context("fork").Process(target=strategies.wait_for_tiers, args=(done.reader, 60.0))
    p.start()
    time.sleep(0.5)
    assert p.is_alive(), "async_fn returned before the tiers finished"
    _resolve_later(fut, ok=True, delay=0.0)
    p.join(30)
    assert p.exitcode == 0
    strategies._finalize(done, handle, ["persistent"], 30.0)


def test_spawned_worker_gets_the_request_through_a_queue():
    handle, fut, done = _pending()
    ctx = mp.get_context("spawn")
    queue, done_q = ctx.JoinableQueue(), ctx.Queue()
    worker = ctx.Process(target=_spawned_worker, args=(queue, done_q))
    worker.start()
    try:
        queue.put(AsyncRequest(strategies.wait_for_tiers, (done.reader, 120.0), []))
        time.sleep(1.0)
        assert done_q.empty(), "async_fn returned before the tiers finished"
        t_set = time.monotonic()
        fut.set_result(CheckpointRecord(tier="persistent", step=7, ok=True))
        finished = done_q.get(timeout=120)
        assert finished >= t_set
        worker.join(30)
        assert worker.exitcode == 0
    finally:
        if worker.is_alive():
            worker.kill()
    strategies._finalize(done, handle, ["persistent"], 30.0)


def test_finalize_raises_when_the_persistent_tier_did_not_commit():
    handle, fut, done = _pending()
    _resolve_later(fut, ok=False, delay=0.0)
    strategies.wait_for_tiers(done.reader, 30.0)
    with pytest.raises(CheckpointingException, match="persistent tier of step 7 is not committed"):
        strategies._finalize(done, handle, ["persistent"], 30.0)


def test_async_fn_times_out_instead_of_waiting_forever():
    handle, fut, done = _pending()
    with pytest.raises(TimeoutError):
        strategies.wait_for_tiers(done.reader, 0.2)
    fut.set_result(CheckpointRecord(tier="persistent", step=7, ok=True))
