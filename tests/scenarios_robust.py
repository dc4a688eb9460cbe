"""Rank functions of the robustness tests (tests/test_engine_robust.py): double losses, remapped
disks, failed pulls and a restore while a local write hangs.

The state is :class:`tests.scenarios.Net` under FSDP2 + AdamW plus ``mine``, a plain per-rank
tensor (100 on rank 0, 101 on rank 1, not a DTensor): only the copy of the right node's state
brings it back. Every rank compares its restored shards and ``mine`` bitwise with what it saved
(``mine`` only from a node-local source: DCP's global checkpoint treats a plain tensor as
replicated and keeps one rank's value).
"""

from __future__ import annotations

import os
import shutil
import time

import torch
import torch.distributed as dist

from tests.scenarios import app_state, apply_state, assert_bitwise, build, make_config, snapshot, train_step
from tierckpt.engine import TieredCheckpointer
from tierckpt.errors import NoCheckpointError


def _state(model, opt, rank: int | None) -> dict:
    """The app state plus ``mine`` (100 + rank; -1 for a state about to be restored into)."""
    sd = app_state(model, opt)
    sd["mine"] = torch.tensor([-1 if rank is None else 100 + rank], dtype=torch.int64)
    return sd


def _ref_path(base: str, rank: int) -> str:
    return os.path.join(base, "ref", f"rank{rank}.pt")


def phase_save(rank, world, base, k, cfg_kw):
    """Train ``k`` steps and save every configured tier at step ``k``; the reference is this
    rank's snapshot and ``mine``."""
    eng = TieredCheckpointer(make_config(base, **cfg_kw), node_id=rank)
    model, opt = build(seed=0)
    for s in range(1, k + 1):
        train_step(model, opt, s, rank)
    eng.save(k, _state(model, opt, rank))
    eng.wait()
    eng.close()
    os.makedirs(os.path.join(base, "ref"), exist_ok=True)
    torch.save({"snap": snapshot(model, opt), "mine": 100 + rank}, _ref_path(base, rank))
    return True


def _restore_once(rank, base, cfg_kw) -> dict:
    """A fresh engine and model restore; the state must equal the saved one bitwise. Waits for
    the background rebuild of replicas. Returns what the restore did, or {"error": ...} for a
    NoCheckpointError (any other exception fails the rank)."""
    eng = TieredCheckpointer(make_config(base, **cfg_kw), node_id=rank)
    model, opt = build(seed=123)
    train_step(model, opt, 999, rank)  # every value differs from the saved one
    sd = _state(model, opt, None)
    try:
        res = eng.restore(sd)
    except NoCheckpointError as e:
        eng.close()
        return {"error": str(e)}
    assert res is not None, "nothing restored"
    apply_state(model, opt, sd)
    ref = torch.load(_ref_path(base, rank), weights_only=False)
    assert_bitwise(snapshot(model, opt), ref["snap"])
    if res.source_of(rank) != "persistent":  # the global checkpoint keeps one value of a plain tensor (DCP)
        assert sd["mine"].tolist() == [ref["mine"]], f"rank {rank} got mine={sd['mine'].tolist()}, saved {ref['mine']}"
    red = eng.last_redundancy.result(timeout=120) if eng.last_redundancy is not None else None
    eng.close()
    return {
        "step": res.step,
        "sources": {n: (o.source.kind, o.source.holder) for n, o in res.sources.items()},
        "persistent_bytes": res.persistent_bytes_read,
        "failures": [(f.node, f.source.kind, f.source.holder, f.step, f.error) for f in res.failures],
        "redundancy": None if red is None else red.as_ledger(),
    }


def phase_restore(rank, world, base, cfg_kw, fail_first_receive=False):
    """One restart that restores. ``fail_first_receive``: rank 0's first file receive fails
    after the stream arrived (as a gloo "Pair is not connected" would)."""
    if fail_first_receive and rank == 0:
        from tierckpt.transport import transfer

        real = transfer.recv_step

        def broken(*args, **kwargs):
            transfer.recv_step = real
            real(*args, **kwargs).complete()  # drain the stream: the sender must not block
            raise RuntimeError("[gloo/transport/tcp/pair.cc] Pair is not connected (injected)")

        transfer.recv_step = broken
    return _restore_once(rank, base, cfg_kw)


def phase_two_losses(rank, world, base, cfg_kw):
    """Node 1 was lost before this start: restore (node 1 from node 0's replica), then, before
    any save, node 0 is lost too: the next start must restore in-cluster again."""
    first = _restore_once(rank, base, cfg_kw)
    dist.barrier()
    if rank == 0:
        shutil.rmtree(os.path.join(base, "nvme", "node-0"))
    dist.barrier()
    return {"first": first, "second": _restore_once(rank, base, cfg_kw)}


def phase_restore_while_local_hangs(rank, world, base, limit):
    """Node 1's local write of step 3 hangs (the persistent step 3 and node 0's local step 3
    commit). ``restore()`` must come back after about ``limit`` seconds without node 1's local
    root, bitwise at step 3; then the disk comes back and the run closes normally."""
    from tierckpt.tiers.local_tier import LocalTier

    release = os.path.join(base, "release-disk")
    eng = TieredCheckpointer(make_config(base, local_wait_timeout_s=limit), node_id=rank)
    original = LocalTier.save

    def stuck(self, staged, step, **kw):
        if rank == 1 and step == 3:
            while not os.path.exists(release):
                time.sleep(0.05)
        return original(self, staged, step, **kw)

    LocalTier.save = stuck
    model, opt = build(seed=0)
    for s in (1, 2, 3):
        train_step(model, opt, s, rank)
    eng.save(3, _state(model, opt, rank))
    ref = snapshot(model, opt)
    eng.jobs.lanes["persistent"].save.result(timeout=120)
    m2, o2 = build(seed=3)
    sd = _state(m2, o2, None)
    t0 = time.perf_counter()
    res = eng.restore(sd)
    restore_s = time.perf_counter() - t0
    apply_state(m2, o2, sd)
    assert_bitwise(snapshot(m2, o2), ref)
    if res.source_of(rank) != "persistent":
        assert sd["mine"].tolist() == [100 + rank]
    if rank == 1:
        open(release, "w").close()  # the disk comes back
    eng.jobs.lanes["local"].save.result(timeout=120)  # the late step-3 job finishes on every rank
    LocalTier.save = original
    eng.close()
    return {"step": res.step, "restore_s": restore_s, "persistent_bytes": res.persistent_bytes_read,
            "sources": {n: (o.source.kind, o.source.holder) for n, o in res.sources.items()}}


def phase_read_only_persistent_root(rank, world, base):
    """The persistent root turned read-only (EROFS on every write or delete under it; creating a
    directory that exists is fine, as on Linux): the job
    still starts and restores step 3 from the node-local copies; the next persistent save
    fails as a tier failure, not at start."""
    import errno

    from tierckpt.errors import TierFailedError
    from tierckpt.io.storage import Store

    pfs = os.path.join(base, "pfs")
    real = {n: getattr(Store, n) for n in ("write_atomic", "remove", "rmtree", "makedirs", "open", "rename")}

    def guarded(name):
        def fn(self, *a, **k):
            mode = a[1] if name == "open" and len(a) > 1 else k.get("mode", "rb")
            exists = name == "makedirs" and os.path.isdir(self.path(a[0] if a else k.get("rel", "")))
            if self.root.startswith(pfs) and not exists and (name != "open" or any(c in mode for c in "wa")):
                raise OSError(errno.EROFS, "Read-only file system (injected)", self.root)
            return real[name](self, *a, **k)
        return fn

    for n in real:
        setattr(Store, n, guarded(n))
    out = _restore_once(rank, base, {})
    eng = TieredCheckpointer(make_config(base), node_id=rank)
    model, opt = build(seed=5)
    h = eng.save(4, _state(model, opt, rank), tiers=["persistent"])
    out["persistent_ok"] = h.futures["persistent"].result(timeout=120).ok
    try:
        eng.close()
        out["close"] = "clean"
    except TierFailedError as e:
        out["close"] = f"TierFailedError: {e}"
    return out
