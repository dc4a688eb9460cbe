"""Rank functions: save identity, fallbacks as new timelines, rollbacks without clocks (issue 28 A).

Each phase is one run of the job (one engine on every rank: rank r is node r); the tests chain
phases with the harness, so a restart is a new process and a new run id, as on a cluster.
Timeline A trains on batches ``step``; timeline B on batches ``step + 500``, so the two runs'
states at one step number differ everywhere.
"""

from __future__ import annotations

import json
import os
import shutil

import torch

from tests.scenarios import app_state, apply_state, assert_bitwise, build, make_config, snapshot, train_step
from tierckpt.engine import TieredCheckpointer

B_OFFSET = 500


def corrupt_step_dir(path: str) -> int:
    """Flip one byte in the middle of every DCP data file of a step directory; returns files hit."""
    hit = 0
    for name in sorted(os.listdir(path)):
        if not name.endswith(".distcp"):
            continue
        p = os.path.join(path, name)
        with open(p, "r+b") as f:
            size = os.path.getsize(p)
            f.seek(size // 2)
            b = f.read(1)
            f.seek(size // 2)
            f.write(bytes([b[0] ^ 0xFF]))
        hit += 1
    return hit


def ledger(base: str) -> list[dict]:
    """Every record of the job's ledger, in order."""
    with open(os.path.join(base, "pfs", "tierckpt-ledger.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def _save_ref(base: str, tag: str, rank: int, model, opt) -> None:
    os.makedirs(os.path.join(base, "ref"), exist_ok=True)
    torch.save(snapshot(model, opt), os.path.join(base, "ref", f"{tag}-rank{rank}.pt"))


def _ref(base: str, tag: str, rank: int) -> dict:
    return torch.load(os.path.join(base, "ref", f"{tag}-rank{rank}.pt"), weights_only=False)


def _restore_fresh(eng, rank: int, **kw):
    """Restore into a model that differs from every saved state; returns (result, model, opt)."""
    model, opt = build(seed=123)
    train_step(model, opt, 999, rank)
    sd = app_state(model, opt)
    res = eng.restore(sd, **kw)
    if res is not None:
        apply_state(model, opt, sd)
    return res, model, opt


def phase_timeline_a(rank, world, base, steps, cfg_kw=None):
    """Timeline A: train and save every tier at each of ``steps``; reference snapshots
    ``A<step>``. ``cfg_kw['clock_skew_rank']``: that rank's commit markers are written with a
    wall clock one hour ahead (a host whose clock is off)."""
    cfg_kw = dict(cfg_kw or {})
    skew_rank = cfg_kw.pop("clock_skew_rank", None)
    if skew_rank == rank:
        import time as real_time

        import tierckpt.io.manifest as manifest_mod

        class _Skewed:
            def __getattr__(self, name):
                return getattr(real_time, name)

            @staticmethod
            def time():
                return real_time.time() + 3600.0

        manifest_mod.time = _Skewed()  # type: ignore[assignment]
    eng = TieredCheckpointer(make_config(base, **cfg_kw), node_id=rank)
    model, opt = build(seed=0)
    done = 0
    for s in steps:
        for t in range(done + 1, s + 1):
            train_step(model, opt, t, rank)
        done = s
        eng.save(s, app_state(model, opt))
        eng.wait()
        _save_ref(base, f"A{s}", rank, model, opt)
    eng.close()
    return [h.step for h in eng.history if h.ok]


def phase_fallback_then_unreplicated_save(rank, world, base):
    """Case A.1, run 2: restore falls back to 10 (node 1's step 20 is corrupt everywhere),
    train 11–20 on other batches (timeline B) and save 20 local-only while replication fails."""
    import tierckpt.tiers.jobs as jobs

    def no_replication(*a, **kw):
        raise OSError("injected: replication link down")

    jobs.replicate = no_replication  # type: ignore[assignment]
    eng = TieredCheckpointer(make_config(base), node_id=rank)
    res, model, opt = _restore_fresh(eng, rank)
    assert res is not None
    assert_bitwise(snapshot(model, opt), _ref(base, "A10", rank))
    for t in range(res.step + 1, 21):
        train_step(model, opt, t + B_OFFSET, rank)
    eng.save(20, app_state(model, opt), tiers=("local",))
    eng.wait()
    _save_ref(base, "B20", rank, model, opt)
    eng.close()
    return {"step": res.step, "attempts": res.attempts,
            "local20": [(h.tier, h.ok, h.replicas_failed) for h in eng.history]}


def _matches(snap: dict, ref: dict) -> bool:
    try:
        assert_bitwise(snap, ref)
    except AssertionError:
        return False
    return True


def phase_restore_only(rank, world, base, cfg_kw=None, tags=()):
    """A restart that restores (no step) and reports what it got, with ``matches``: the reference
    snapshots among ``tags`` this rank's restored state equals bitwise."""
    eng = TieredCheckpointer(make_config(base, **(cfg_kw or {})), node_id=rank)
    res, model, opt = _restore_fresh(eng, rank)
    eng.close(clean=False, reason="test: restore only")
    if res is None:
        return {"step": None}
    snap = snapshot(model, opt)
    return {"step": res.step, "attempts": res.attempts, "save_id": res.save_id,
            "sources": {n: o.source.kind for n, o in res.sources.items()},
            "matches": [t for t in tags if _matches(snap, _ref(base, t, rank))]}


def phase_fallback_then_save(rank, world, base, cfg_kw, save_step, tiers=None):
    """Case A.2, run 2: restore (falls back), then save ``save_step`` on ``tiers`` (default:
    all), wait, close; reference ``R<save_step>``."""
    eng = TieredCheckpointer(make_config(base, **cfg_kw), node_id=rank)
    res, model, opt = _restore_fresh(eng, rank)
    assert res is not None
    restored = res.step
    for t in range(restored + 1, save_step + 1):
        train_step(model, opt, t + B_OFFSET, rank)
    eng.save(save_step, app_state(model, opt), tiers=tiers)
    eng.wait()
    _save_ref(base, f"R{save_step}", rank, model, opt)
    eng.close()
    return {"restored": restored, "attempts": res.attempts}


def phase_rollback_then_commit(rank, world, base, to_step, new_step):
    """Case A.3, run 2 (every host's clock right): explicit rollback to ``to_step``, train and
    save ``new_step`` (every tier), then the job fails (an unclean end)."""
    eng = TieredCheckpointer(make_config(base), node_id=rank)
    res, model, opt = _restore_fresh(eng, rank, step=to_step, rollback=True)
    assert res is not None and res.step == to_step
    for t in range(to_step + 1, new_step + 1):
        train_step(model, opt, t + B_OFFSET, rank)
    eng.save(new_step, app_state(model, opt))
    eng.wait()
    _save_ref(base, f"R{new_step}", rank, model, opt)
    eng.close(clean=False, reason="test: the new timeline's run fails")
    return {"restored": res.step}


def wipe_local_root(base: str, node: int) -> None:
    """A node lost with its disk: its node-local root is gone."""
    shutil.rmtree(os.path.join(base, "nvme", f"node-{node}"), ignore_errors=True)


def phase_split_tiers(rank, world, base):
    """One step's tiers written by two ``save()`` calls (as a preemption save of the tiers that
    were not due, or Megatron's two formats, do), then a later save of another step."""
    eng = TieredCheckpointer(make_config(base), node_id=rank)
    model, opt = build(seed=0)
    for t in range(1, 6):
        train_step(model, opt, t, rank)
    eng.save(5, app_state(model, opt), tiers=("local",))
    eng.save(5, app_state(model, opt), tiers=("persistent",))
    eng.wait()
    _save_ref(base, "A5", rank, model, opt)
    eng.close()


def phase_restore_then_save(rank, world, base, new_step):
    """A restart: restore (no step), train and save ``new_step`` (every tier), close."""
    eng = TieredCheckpointer(make_config(base), node_id=rank)
    res, model, opt = _restore_fresh(eng, rank)
    out = {"step": res.step, "attempts": res.attempts, "sources": {n: o.source.kind for n, o in res.sources.items()}}
    for t in range(res.step + 1, new_step + 1):
        train_step(model, opt, t, rank)
    eng.save(new_step, app_state(model, opt))
    eng.wait()
    eng.close()
    return out


def _fail_supersede(times: int | None):
    """Make this process's renames of commit markers to ``*.superseded`` fail with EIO (``times``
    calls, None: every call): a node whose supersede of an abandoned timeline fails."""
    import errno

    import tierckpt.io.manifest as manifest_mod

    real = manifest_mod.supersede
    left = [times]

    def failing(store, step_rel, strict=False):
        if left[0] is None or left[0] > 0:
            if left[0] is not None:
                left[0] -= 1
            raise OSError(errno.EIO, "injected: rename failed", step_rel)
        return real(store, step_rel, strict)

    manifest_mod.supersede = failing  # type: ignore[assignment]


def phase_rollback_failing_supersede(rank, world, base, to_step, saves, victim, times, cfg_kw=None):
    """An explicit rollback to ``to_step`` whose supersede fails on rank ``victim`` (``times``
    renames, None: all; ``victim`` None: nowhere); then saves ``saves`` ([(step, tiers)]) on
    timeline B, references ``R<step>``; the run ends uncleanly."""
    if rank == victim:
        _fail_supersede(times)
    eng = TieredCheckpointer(make_config(base, **(cfg_kw or {})), node_id=rank)
    res, model, opt = _restore_fresh(eng, rank, step=to_step, rollback=True)
    assert res is not None and res.step == to_step
    assert_bitwise(snapshot(model, opt), _ref(base, f"A{to_step}", rank))
    done = to_step
    for s, tiers in saves:
        for t in range(done + 1, s + 1):
            train_step(model, opt, t + B_OFFSET, rank)
        done = s
        eng.save(s, app_state(model, opt), tiers=tiers)
        eng.wait()
        _save_ref(base, f"R{s}", rank, model, opt)
    eng.close(clean=False, reason="test: the new timeline's run fails")
    return {"restored": res.step}


def phase_restore_then_save_tagged(rank, world, base, new_step, tags=(), cfg_kw=None):
    """A restart: restore (no step), report what it got (as :func:`phase_restore_only`), train
    ``new_step`` on timeline B's batches, save every tier (reference ``R<new_step>``), close."""
    eng = TieredCheckpointer(make_config(base, **(cfg_kw or {})), node_id=rank)
    res, model, opt = _restore_fresh(eng, rank)
    assert res is not None
    snap = snapshot(model, opt)
    out = {"step": res.step, "attempts": res.attempts, "save_id": res.save_id,
           "sources": {n: o.source.kind for n, o in res.sources.items()},
           "matches": [t for t in tags if _matches(snap, _ref(base, t, rank))]}
    for t in range(res.step + 1, new_step + 1):
        train_step(model, opt, t + B_OFFSET, rank)
    eng.save(new_step, app_state(model, opt))
    eng.wait()
    _save_ref(base, f"R{new_step}", rank, model, opt)
    eng.close()
    return out


def save_id_of(base: str, rel: str) -> str:
    """The ``save_id`` the manifest of step directory ``rel`` (under ``base``) records."""
    with open(os.path.join(base, rel, "tierckpt.manifest.json")) as f:
        return json.load(f)["save_id"]
