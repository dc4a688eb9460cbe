"""Restores whose source read hangs (a FIFO in place of a step's data file blocks on open, as a
hung NFS/NVMe read blocks): tests/test_restore_hung_read.py."""

from __future__ import annotations

import json
import os
import time

import torch

from tests.scenarios import app_state, apply_state, assert_bitwise, build, make_config, snapshot, train_step
from tierckpt import TieredCheckpointer


def data_files(step_dir: str) -> list[str]:
    """The DCP data files of a step directory."""
    return sorted(n for n in os.listdir(step_dir) if n.endswith(".distcp"))


def hang(path: str) -> None:
    """Replace ``path`` by a FIFO nobody writes: opening it for reading blocks forever."""
    os.remove(path)
    os.mkfifo(path)


def phase_restore_timed(rank, world, base, cfg_kw):
    """Fresh model → restore (timed) → bitwise equal to the saved step-k snapshot and the next
    losses equal the reference run's. Returns the restore's facts and its wall time."""
    eng = TieredCheckpointer(make_config(base, **cfg_kw), node_id=rank)
    model, opt = build(seed=123)
    train_step(model, opt, 999, rank)  # every value differs from the saved one
    sd = app_state(model, opt)
    t0 = time.monotonic()
    res = eng.restore(sd)
    wall = time.monotonic() - t0
    assert res is not None, "nothing restored"
    apply_state(model, opt, sd)
    ref = torch.load(os.path.join(base, "ref", f"rank{rank}.pt"), weights_only=False)
    assert_bitwise(snapshot(model, opt), ref["snap"])
    k = res.step
    losses = [train_step(model, opt, s, rank) for s in range(k + 1, k + 1 + len(ref["losses"]))]
    assert losses == ref["losses"], f"losses {losses} != reference {ref['losses']}"
    if eng.last_redundancy is not None:
        eng.last_redundancy.result(timeout=120)
    eng.close()
    return {
        "step": res.step, "wall": wall, "attempts": res.attempts,
        "sources": {n: (o.source.kind, o.source.holder) for n, o in res.sources.items()},
        "failures": [(f.node, f.source.kind, f.source.holder, f.step, f.error) for f in res.failures],
    }


def ledger_restores(base: str) -> list[dict]:
    """The ``restore`` records of the ledger in the persistent root."""
    with open(os.path.join(base, "pfs", "tierckpt-ledger.jsonl")) as f:
        return [r for r in map(json.loads, f) if r.get("kind") == "restore"]


def phase_send_stalls_mid_stream(rank, world, base, bound):
    """Rank 0 sends a committed step to rank 1 with bounded reads; the read of the second chunk
    of its first file never returns. Returns (seconds until the send/receive ended, and on
    rank 1 the receive's problems and intact files)."""
    import datetime
    import threading

    import torch.distributed as dist

    from tests.test_transfer_failures import CHUNK, _commit_step
    from tierckpt.io.storage import Store
    from tierckpt.transport import bounded_send
    from tierckpt.transport.transfer import Transfer, start_transfers

    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=60))
    store = Store(os.path.join(base, f"node-{rank}"))
    if rank == 0:
        _commit_step(store, "local/step-3")
        touch, calls = bounded_send.touch_share, []

        def hanging(entries, mapped, done):
            calls.append(entries[0].path)
            if calls.count("__0_0.distcp") == 2:
                threading.Event().wait()  # a page that never comes
            return touch(entries, mapped, done)

        bounded_send.touch_share = hanging
    t = Transfer(src_rank=0, dst_rank=1, src_rel="local/step-3", dst_rel="incoming", tag="test")
    dist.barrier(group=group)
    t0 = time.perf_counter()
    got, th = start_transfers([t], rank, store, group, CHUNK, read_timeout_s=bound)
    th.join()
    dt = time.perf_counter() - t0
    dist.barrier(group=group)
    if rank == 0:
        return dt, None, None
    return dt, got[0].problems, sorted(e.path for e in got[0].entries)


def phase_restore_hung_listing(rank, world, base, cfg_kw, node):
    """Node ``node``'s local root stops answering once the engine started: listing it for the
    restore's inventory never returns. The restore must go on without it (bounded), bitwise."""
    import threading

    eng = TieredCheckpointer(make_config(base, **cfg_kw), node_id=rank)
    if rank == node:
        forever = threading.Event()
        eng.local.survey = lambda: forever.wait()  # type: ignore[method-assign]
    model, opt = build(seed=123)
    train_step(model, opt, 999, rank)
    sd = app_state(model, opt)
    t0 = time.monotonic()
    res = eng.restore(sd)
    wall = time.monotonic() - t0
    apply_state(model, opt, sd)
    ref = torch.load(os.path.join(base, "ref", f"rank{rank}.pt"), weights_only=False)
    assert_bitwise(snapshot(model, opt), ref["snap"])
    if eng.last_redundancy is not None:
        eng.last_redundancy.result(timeout=120)
    eng.close()
    return {"step": res.step, "wall": wall, "sources": {n: (o.source.kind, o.source.holder) for n, o in res.sources.items()}}


def phase_two_persistent_steps(rank, world, base, cfg_kw, old, new):
    """Train; save every tier at step ``old`` and at step ``new`` (each waited for), the
    reference for a restore of step ``old``: its snapshot and the losses of the steps after it
    (``old + 1 .. new``, the uninterrupted run's) in ``base/ref``."""
    eng = TieredCheckpointer(make_config(base, **cfg_kw), node_id=rank)
    model, opt = build(seed=0)
    for s in range(1, old + 1):
        train_step(model, opt, s, rank)
    eng.save(old, app_state(model, opt))
    eng.wait(bounded=False)
    snap = snapshot(model, opt)
    losses = [train_step(model, opt, s, rank) for s in range(old + 1, new + 1)]
    eng.save(new, app_state(model, opt))
    eng.wait(bounded=False)
    committed = eng.persistent_steps()
    eng.close()
    os.makedirs(os.path.join(base, "ref"), exist_ok=True)
    torch.save({"snap": snap, "losses": losses}, os.path.join(base, "ref", f"rank{rank}.pt"))
    return committed


def hang_opens(path: str, where: str = "every") -> None:
    """In this process, opens of ``path`` never return: a file on a file system that stopped
    answering, its size still the one the manifest names (a FIFO in its place would be refused
    by the size check before any read). ``where``: ``"every"`` open (``open``/``io.open``,
    ``pathlib.Path.open``: the verification's checksum read comes first), or ``"load"``: only
    ``pathlib.Path.open``, what DCP's reader uses (the checksum read passes, the load hangs)."""
    import builtins
    import io
    import pathlib
    import threading

    hung = os.path.realpath(path)
    real_open, real_path_open = builtins.open, pathlib.Path.open

    def _blocks(file) -> bool:
        return isinstance(file, (str, bytes, os.PathLike)) and os.path.realpath(os.fsdecode(file)) == hung

    def hanging_open(file, *a, **kw):
        if _blocks(file):
            threading.Event().wait()
        return real_open(file, *a, **kw)

    def hanging_path_open(self, *a, **kw):
        if _blocks(self):
            threading.Event().wait()
        return real_path_open(self, *a, **kw)

    if where == "every":
        builtins.open = io.open = hanging_open  # type: ignore[assignment]
    pathlib.Path.open = hanging_path_open  # type: ignore[method-assign]


def phase_restore_timed_hung_file(rank, world, base, cfg_kw, path, where="every"):
    """:func:`phase_restore_timed` with opens of ``path`` hanging (:func:`hang_opens`)."""
    hang_opens(path, where)
    return phase_restore_timed(rank, world, base, cfg_kw)
