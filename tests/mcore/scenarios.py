"""Rank functions of the megatron-core tests (run through ``tests.harness.run_world``).

Each rank is one simulated node (``simulated_ranks_per_node=1``) with its own node-local
root under ``<base>/nvme/node-<n>``; the persistent tier is ``<base>/pfs``.
"""

from __future__ import annotations

import math
import os
import shutil

import torch
import torch.distributed as dist

from tests.mcore import model as M

STEP = 3  # the checkpointed iteration
REL = 1e-5  # relative tolerance of losses after a resharding load (float summation order)


def _tiers(base: str, *, local: str | None = "nvme", persistent: str = "pfs", factor: int = 2,
           intervals=None, rpn: int = 1, tiers: tuple[str, ...] | None = None, **cfg_kw):
    from mcore_plugin.strategies import MegatronTiers
    from tierckpt.config import TierConfig

    # saves back to back, each expected to happen: the blocking policy (deferral is tested in
    # tests/test_engine_defer.py)
    kw = dict(persistent_root=os.path.join(base, persistent), job_id="mcore", simulated_ranks_per_node=rpn,
              intervals=intervals, keep_latest_k={"local": 3, "persistent": 3}, busy_tier_policy="wait", **cfg_kw)
    if local is None:
        cfg = TierConfig(tiers=("persistent",), replication_factor=1, **kw)
    else:
        cfg = TierConfig(local_root=os.path.join(base, local, "node-{node}"), replication_factor=factor,
                         **({} if tiers is None else {"tiers": tiers}), **kw)
    return MegatronTiers(cfg)


def _close(a: float, b: float, what: str, rel: float = REL) -> None:
    assert math.isclose(a, b, rel_tol=rel, abs_tol=0.0), f"{what}: {a!r} vs {b!r}"


def _check_common(sd: dict, iteration: int, rng: dict | None) -> None:
    exp = M.common_of(iteration)
    for k, v in exp.items():
        assert sd[k] == v, f"common {k}: {sd[k]!r} != {v!r}"
    if rng is not None:
        got = sd["rng_state"]
        assert got["rank"] == rng["rank"] and torch.equal(got["torch"], rng["torch"]), "rng_state differs"


def _restore_into_fresh(tiers, seed: int, step=None, rng=True):
    model, opt = M.build(seed=seed)
    sd = tiers.restore(M.state_dict_fn(model, opt, 0, rng=rng), step=step)
    assert sd is not None, "nothing restored"
    M.apply_loaded(model, opt, sd)
    return model, opt, sd


def _sources(tiers) -> dict[int, str]:
    return {n: o.source.kind for n, o in tiers.last_restore.sources.items()}


def phase_main(rank: int, world: int, base: str) -> dict:
    """TP1 × DP2 on 2 nodes, then TP2 × DP1 in the same processes.

    1. Train 3 iterations; write a stock ``dp_reshardable`` checkpoint (for the export);
       save iteration 3 through ``dist_checkpointing.save(..., sharded_strategy=
       TieredSaveStrategy)`` asynchronously, scheduled on Megatron's AsyncCallsQueue with the
       spawned persistent worker; train iterations 4 and 5 at once (the reference).
    2. Restore iteration 3 into fresh models from own-local, from a peer replica after
       wiping node 1's root, and from persistent after wiping both roots: parameters and
       optimizer state (main params, exp_avg, exp_avg_sq, each parameter's own step) bitwise,
       common state and RNG equal; the own-local and persistent restores then train 4 and 5
       with losses and state bitwise equal to the reference. Also through Megatron's own
       ``dist_checkpointing.load(..., sharded_strategy=TieredLoadStrategy)``, from own-local
       and (a dp_reshardable checkpoint_dir, fully_reshardable tensors) from persistent.
    3. Per-parameter steps that differ (set on purpose: Megatron's own training keeps them
       equal) survive a local and a persistent round trip.
    4. Export the stock checkpoint; it must equal the persistent tier's fully_reshardable
       iteration 3 tensor for tensor.
    5. TP2 × DP1: the persistent checkpoint and the exported one load; fixed-batch loss equal
       to TP1's within ``REL``; iteration 4 from there matches the reference; save a TP2
       persistent checkpoint for the 1-rank phase.
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    from mcore_plugin import optim_state
    from mcore_plugin.export import export
    from mcore_plugin.strategies import TieredLoadStrategy, TieredSaveStrategy
    from tests.scenarios import assert_bitwise

    out: dict = {}
    M.setup(tp=1)
    model, opt = M.build(seed=0)
    out["train"] = [M.train_step(model, opt, s) for s in range(1, STEP + 1)]
    out["fixed_loss"] = fb3 = M.fixed_batch_loss(model)

    tiers = _tiers(base, intervals={"local": 1, "persistent": STEP})
    assert tiers.due(STEP) == ["local", "persistent"], tiers.due(STEP)
    fn = M.state_dict_fn(model, opt, STEP)
    rng3 = M.rng_payload()
    stock = os.path.join(base, "megatron", "stock_dp_iter_0000003")
    ckdir = os.path.join(base, "megatron", "iter_0000003")
    if rank == 0:
        os.makedirs(stock)
        os.makedirs(ckdir)
    dist.barrier()
    dist_checkpointing.save(fn("dp_reshardable", False), stock)  # what users already have

    strategy = TieredSaveStrategy(tiers, state_dict_fn=fn)
    assert (strategy.backend, strategy.version) == ("torch_dist", 1)
    req = dist_checkpointing.save(fn("dp_reshardable", False), ckdir, sharded_strategy=strategy,
                                  async_sharded_save=True)
    queue = AsyncCallsQueue(persistent=True)  # Megatron's spawned persistent worker
    queue.schedule_async_request(req)
    snap3 = M.snapshot(model, opt)
    out["delta"] = strategy.last_delta
    out["ref"] = ref = [M.train_step(model, opt, s) for s in (STEP + 1, STEP + 2)]  # while it writes
    snap5 = M.snapshot(model, opt)
    queue.maybe_finalize_async_calls(blocking=True)
    queue.close()
    assert tiers.outcome(STEP, ["local", "persistent"]) == {"local": True, "persistent": True}
    assert os.path.exists(os.path.join(ckdir, "metadata.json"))  # Megatron's finalize ran too

    # 0) Megatron-LM's first load pass: only the common state, from one verified local copy
    from mcore_plugin.local_manager import TieredLocalCheckpointManager

    mgr = TieredLocalCheckpointManager(tiers)
    assert mgr.find_latest() == STEP
    handle, _ = mgr.load()
    _check_common(handle.to_state_dict(None), STEP, None)
    assert tiers.last_restore is None and mgr.last_restore is None  # no full restore ran

    # 1) own local
    m, o, sd = _restore_into_fresh(tiers, seed=11)
    assert tiers.last_restore.step == STEP and set(_sources(tiers).values()) == {"own-local"}, _sources(tiers)
    assert tiers.last_restore_format == "dp_reshardable"
    assert_bitwise(snap3, M.snapshot(m, o), "own-local")
    assert M.step_tensors_distinct(o)
    _check_common(sd, STEP, rng3)
    assert [M.train_step(m, o, s) for s in (STEP + 1, STEP + 2)] == ref
    assert_bitwise(snap5, M.snapshot(m, o), "own-local, 2 steps later")

    # 1b) the load strategy through Megatron's own dist_checkpointing.load: common state from
    # Megatron's iter_0000003 (common.pt), tensors from own-local
    m, o = M.build(seed=16)
    tmpl = M.state_dict_fn(m, o, 0)("dp_reshardable", True)
    loader = TieredLoadStrategy(tiers, state_dict_fn=M.state_dict_fn(m, o, 0))
    sd = dist_checkpointing.load(tmpl, ckdir, sharded_strategy=loader)
    M.apply_loaded(m, o, sd)
    assert loader.last_restore.step == STEP and {o_.source.kind for o_ in loader.last_restore.sources.values()} \
        == {"own-local"}
    assert_bitwise(snap3, M.snapshot(m, o), "TieredLoadStrategy")
    _check_common(sd, STEP, rng3)

    # 2) peer replica after node 1 loses its root
    if rank == 1:
        shutil.rmtree(os.path.join(base, "nvme", "node-1"))
    dist.barrier()
    m, o, sd = _restore_into_fresh(tiers, seed=12)
    assert _sources(tiers) == {0: "own-local", 1: "peer-replica"}, _sources(tiers)
    assert tiers.last_restore.persistent_bytes_read == 0
    assert_bitwise(snap3, M.snapshot(m, o), "peer-replica")
    _check_common(sd, STEP, rng3)

    # 3) persistent after both roots are gone; the replica rebuild the last restore started
    # must finish first, or it writes a copy into a root this test has just "lost"
    tiers.wait()
    shutil.rmtree(os.path.join(base, "nvme", f"node-{rank}"))
    dist.barrier()
    m, o, sd = _restore_into_fresh(tiers, seed=13)
    assert set(_sources(tiers).values()) == {"persistent"}, _sources(tiers)
    assert tiers.last_restore_format == "fully_reshardable"
    assert_bitwise(snap3, M.snapshot(m, o), "persistent")
    assert M.step_tensors_distinct(o)
    _check_common(sd, STEP, rng3)
    assert [M.train_step(m, o, s) for s in (STEP + 1, STEP + 2)] == ref
    assert_bitwise(snap5, M.snapshot(m, o), "persistent, 2 steps later")

    # 3b) the load strategy again: checkpoint_dir's common state says dp_reshardable, the
    # only source left holds fully_reshardable tensors (the optimizer is told so)
    m, o = M.build(seed=17)
    loader = TieredLoadStrategy(tiers, state_dict_fn=M.state_dict_fn(m, o, 0))
    sd = dist_checkpointing.load(M.state_dict_fn(m, o, 0)("dp_reshardable", True), ckdir, sharded_strategy=loader)
    M.apply_loaded(m, o, sd)
    assert {o_.source.kind for o_ in loader.last_restore.sources.values()} == {"persistent"}
    assert_bitwise(snap3, M.snapshot(m, o), "TieredLoadStrategy from persistent")
    pdir = os.path.join(base, "pfs", f"step-{STEP}")
    meta = loader.load_sharded_metadata(pdir)  # forwarded to torch_dist's loader
    assert "optimizer.state.exp_avg.embedding.word_embeddings.weight" in meta and \
        set(loader.load_tensors_metadata(pdir)) <= set(meta)

    # 4) per-parameter steps that differ (synthetic), through both tiers
    names = [n for n, _ in m.module.named_parameters()]
    by_param = {p: names.index(n) for n, p in m.module.named_parameters()}
    for inner in M.inner_optimizers(o):
        for p in optim_state.local_params(inner):
            optim_state._state_of(inner, p)["step"] = torch.tensor(float(10 + by_param[p]))
    fn9 = M.state_dict_fn(m, o, 9)
    tiers.save(9, fn9("dp_reshardable", False), tiers=["local", "persistent"],
               persistent_state_dict=fn9("fully_reshardable", False))
    tiers.wait()
    snap9 = M.snapshot(m, o)
    m2, o2, _ = _restore_into_fresh(tiers, seed=14, step=9)
    assert set(_sources(tiers).values()) == {"own-local"}
    assert_bitwise(snap9, M.snapshot(m2, o2), "distinct steps, own-local")
    shutil.rmtree(os.path.join(base, "nvme", f"node-{rank}"))
    dist.barrier()
    m2, o2, _ = _restore_into_fresh(tiers, seed=15, step=9)
    assert set(_sources(tiers).values()) == {"persistent"}
    assert_bitwise(snap9, M.snapshot(m2, o2), "distinct steps, persistent")
    tiers.close()

    # 5) export the stock dp_reshardable checkpoint; compare with the persistent tier's step
    exported = os.path.join(base, "exported")
    if rank == 0:
        rep = export(stock, exported)
        assert (rep.tp, rep.pp) == (1, 1), rep
        a, b = _load_all(exported), _load_all(os.path.join(base, "pfs", f"step-{STEP}"))
        tens = [k for k in b if isinstance(b[k], torch.Tensor)]
        assert tens and set(tens) <= set(a), set(tens) - set(a)
        for k in tens:
            assert torch.equal(a[k], b[k]), f"exported {k} differs from the persistent tier's"
        ca = torch.load(os.path.join(exported, "common.pt"), weights_only=False)
        cb = torch.load(os.path.join(base, "pfs", f"step-{STEP}", "common.pt"), weights_only=False)
        assert ca["optimizer"] == cb["optimizer"], (ca["optimizer"], cb["optimizer"])
    dist.barrier()

    # 6) TP2 × DP1
    M.setup(tp=2)
    tiers2 = _tiers(base, local="nvme-tp2")
    m, o, sd = _restore_into_fresh(tiers2, seed=21, step=STEP, rng=False)
    assert set(_sources(tiers2).values()) == {"persistent"}
    _check_common(sd, STEP, None)
    out["tp2_persistent"] = M.fixed_batch_loss(m)
    _close(out["tp2_persistent"], fb3, "TP1 -> TP2 persistent, fixed-batch loss")
    out["tp2_step4"] = M.train_step(m, o, STEP + 1)
    _close(out["tp2_step4"], ref[0], "TP2 iteration 4 loss", rel=1e-4)
    tiers2.close()

    m, o = M.build(seed=22)
    sd = dist_checkpointing.load(M.state_dict_fn(m, o, 0, rng=False)("fully_reshardable", True), exported)
    M.apply_loaded(m, o, sd)
    out["tp2_exported"] = M.fixed_batch_loss(m)
    _close(out["tp2_exported"], fb3, "TP1 -> TP2 exported, fixed-batch loss")

    # a TP2 persistent checkpoint for the TP2 -> TP1 load of the 1-rank phase
    m, o, _ = _restore_into_fresh(tiers3 := _tiers(base, local=None, persistent="pfs"), seed=23, step=STEP,
                                  rng=False)
    tiers3.close()
    tiers4 = _tiers(base, local=None, persistent="pfs-tp2")
    tiers4.save(STEP, M.state_dict_fn(m, o, STEP, rng=False)("fully_reshardable", False))
    tiers4.close()
    return out


def phase_dp1(rank: int, world: int, base: str, fb3: float, ref4: float) -> dict:
    """One rank (TP1 × DP1): the persistent checkpoint of the 2-rank job (DP2 → DP1), the
    exported one, and the TP2 job's (TP2 → TP1) all load with the fixed-batch loss equal to
    the 2-rank job's within ``REL``; iteration 4 from the persistent one matches too."""
    from megatron.core import dist_checkpointing

    out = {}
    M.setup(tp=1)
    tiers = _tiers(base, local=None, persistent="pfs")
    m, o, sd = _restore_into_fresh(tiers, seed=31, step=STEP, rng=False)
    assert _sources(tiers) == {0: "persistent"}
    _check_common(sd, STEP, None)
    out["dp1_persistent"] = M.fixed_batch_loss(m)
    _close(out["dp1_persistent"], fb3, "DP2 -> DP1 persistent, fixed-batch loss")
    out["dp1_step4"] = M.train_step(m, o, STEP + 1)
    _close(out["dp1_step4"], ref4, "DP1 iteration 4 loss", rel=1e-4)
    tiers.close()

    m, o = M.build(seed=32)
    sd = dist_checkpointing.load(M.state_dict_fn(m, o, 0, rng=False)("fully_reshardable", True),
                                 os.path.join(base, "exported"))
    M.apply_loaded(m, o, sd)
    out["dp1_exported"] = M.fixed_batch_loss(m)
    _close(out["dp1_exported"], fb3, "DP2 -> DP1 exported, fixed-batch loss")

    tiers = _tiers(base, local=None, persistent="pfs-tp2")
    m, o, _ = _restore_into_fresh(tiers, seed=33, step=STEP, rng=False)
    out["tp2_to_tp1"] = M.fixed_batch_loss(m)
    _close(out["tp2_to_tp1"], fb3, "TP2 -> TP1 persistent, fixed-batch loss")
    tiers.close()
    return out


def _load_all(path: str) -> dict:
    """Every tensor (whole) and object of a DCP checkpoint, read in this process."""
    import io

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = FileSystemReader(path).read_metadata()
    sd = {k: torch.empty(tuple(v.size), dtype=v.properties.dtype) if isinstance(v, TensorStorageMetadata)
          else io.BytesIO() for k, v in md.state_dict_metadata.items()}
    dcp.load(sd, storage_reader=FileSystemReader(path), no_dist=True)
    return sd


def _flip_byte(step_dir: str) -> str:
    """Flip one byte in the middle of the largest DCP data file of ``step_dir``; returns its name."""
    name = max((f for f in os.listdir(step_dir) if f.endswith(".distcp")),
               key=lambda f: os.path.getsize(os.path.join(step_dir, f)))
    path = os.path.join(step_dir, name)
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))
    return name


def phase_local_manager_resume_point(rank: int, world: int, base: str) -> dict:
    """Megatron-LM's local-checkpoint load path (``find_latest`` → ``load`` →
    ``to_state_dict(None)`` → ``to_state_dict(template)``, as ``load_checkpoint`` calls it).

    Persistent step 1, local steps 2 and 3 (+ replicas). One byte of node 1's step-3 data file
    and of its replica on node 0 is flipped: two restarts in a row (fresh tiers each) load
    step 2 bitwise, with iteration 2 in the loaded state (what Megatron resumes from), instead
    of failing on the step ``find_latest`` listed. An explicit step (``--ckpt-step 1``):
    ``find_latest`` returns it although newer steps exist, it is served from the persistent
    tier bitwise and no committed step is touched; a step no tier holds names ``--ckpt-step``.
    """
    from mcore_plugin.local_manager import TieredLocalCheckpointManager
    from tests.scenarios import assert_bitwise
    from tierckpt.cli import find_steps
    from tierckpt.errors import NoCheckpointError

    M.setup(tp=1)
    model, opt = M.build(seed=0)
    tiers = _tiers(base)
    snaps = {}
    for s in (1, 2, 3):
        M.train_step(model, opt, s)
        fn = M.state_dict_fn(model, opt, s)
        if s == 1:
            tiers.save(s, fn("fully_reshardable", False), tiers=["persistent"])
        else:
            tiers.save(s, fn("dp_reshardable", False), tiers=["local"])
        snaps[s] = M.snapshot(model, opt)
    tiers.wait()
    tiers.close()
    nvme = os.path.join(base, "nvme")
    if rank == 1:
        _flip_byte(os.path.join(nvme, "node-1", "local", "step-3"))
    else:
        _flip_byte(os.path.join(nvme, "node-0", "replicas", "node-1", "step-3"))
    dist.barrier()

    def megatron_load(step=None):
        t = _tiers(base)
        m, o = M.build(seed=40)
        regen = lambda fmt, is_loading: M.state_dict_fn(m, o, 0)(fmt, True)  # noqa: E731
        mgr = TieredLocalCheckpointManager(t, regenerate=regen, **({} if step is None else {"step": step}))
        found = mgr.find_latest()
        handle, _ = mgr.load()
        common = handle.to_state_dict(None)  # Megatron's first ("rank0") pass
        sd = handle.to_state_dict(M.state_dict_fn(m, o, 0)("dp_reshardable", True))
        M.apply_loaded(m, o, sd)
        res = mgr.last_restore
        out = {"found": found, "iteration": sd["iteration"], "common_iteration": common["iteration"],
               "restored": res.step, "sources": {n: x.source.kind for n, x in res.sources.items()}}
        return t, m, o, out

    out = {}
    for attempt in (1, 2):
        t, m, o, got = megatron_load()
        assert_bitwise(snaps[2], M.snapshot(m, o), f"restart {attempt}")
        t.close()
        out[f"restart{attempt}"] = got

    dist.barrier()
    before = sorted((x.tier, x.node, x.step) for x in find_steps(base) if x.committed)
    t, m, o, got = megatron_load(step=1)
    assert_bitwise(snaps[1], M.snapshot(m, o), "--ckpt-step 1")
    t.close()
    out["explicit"] = got
    dist.barrier()
    out["untouched"] = before == sorted((x.tier, x.node, x.step) for x in find_steps(base) if x.committed)
    t = _tiers(base)
    try:
        TieredLocalCheckpointManager(t, step=7).find_latest()
        out["missing"] = None
    except NoCheckpointError as e:
        out["missing"] = str(e)
    t.close()
    return out


def phase_overlapped_staging(rank: int, world: int, base: str) -> dict:
    """``cpu_staging = "overlapped"`` under megatron-core's DistributedOptimizer (TP1 × DP2):
    train 5 iterations, saving the local tier (dp_reshardable) after each (the engine's global
    step pre-hook runs inside every inner optimizer step); ``deferred`` records the bytes left
    to the copy thread by each save (the payload's ShardedTensors take the copy plan from each
    staging buffer's second save; the threshold is lowered to 1 KiB, the test model's tensors
    being 4 KiB at most). Iteration 3 restores bitwise into a fresh model from its own local
    copy. Returns the facts the test asserts."""
    import tierckpt.staging.pool as staging
    from tests.scenarios import assert_bitwise

    staging.OVERLAP_MIN_BYTES = 1024
    M.setup(tp=1)
    model, opt = M.build(seed=0)
    tiers = _tiers(base, cpu_staging="overlapped")
    waits = []
    wait_for_staging = tiers.engine.wait_for_staging
    tiers.engine.wait_for_staging = lambda: waits.append(1) or wait_for_staging()  # the hook's call, counted
    snaps, deferred = {}, []
    for s in range(1, 6):
        M.train_step(model, opt, s)
        tiers.save(s, M.state_dict_fn(model, opt, s)("dp_reshardable", False), tiers=["local"])
        snaps[s] = M.snapshot(model, opt)
        deferred.append(sum(sl._pending.nbytes for sl in tiers.engine.pool._slots
                            if sl._pending is not None and not sl._pending.sealed))
    tiers.wait()
    ok = {s: tiers.outcome(s, ["local"])["local"] for s in range(1, 6)}
    tiers.close()
    t = _tiers(base, cpu_staging="overlapped")
    m, o, sd = _restore_into_fresh(t, seed=40, step=3)
    assert_bitwise(snaps[3], M.snapshot(m, o), "iteration 3")
    out = {"ok": ok, "deferred": deferred, "iteration": sd["iteration"], "sources": _sources(t),
           "hook_calls": len(waits)}
    t.close()
    return out
