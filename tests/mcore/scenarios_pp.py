"""Rank functions of ``tests/mcore/test_mcore_pp.py`` (run through ``tests.harness.run_world``):
the shipped config's TP2 × PP2 layout on 4 gloo ranks, and a DP change.

Node-local roots are ``<base>/nvme/node-<n>``, the persistent tier ``<base>/pfs``.
"""

from __future__ import annotations

import os
import shutil

import torch
import torch.distributed as dist

from tests.mcore import model as M
from tests.mcore.scenarios import _check_common, _load_all, _sources, _tiers

STEP = 3  # the checkpointed iteration
RPN = 2  # TP2 × PP2: 2 simulated nodes of 2 ranks, one pipeline stage (= one TP group) each


def _restore_pp(tiers, seed: int, snap: dict, what: str, rng=None, step=None):
    """Restore into a fresh TP2 × PP2 model and optimizer; assert every tensor bitwise and the
    common state (and ``rng`` when given). Returns (model, optimizer, sources by node)."""
    from tests.scenarios import assert_bitwise

    m, o = M.build(seed=seed)
    sd = tiers.restore(M.state_dict_fn(m, o, 0, rng=rng is not None), step=step)
    assert sd is not None, f"{what}: nothing restored"
    assert tiers.last_restore.step == STEP, (what, tiers.last_restore.step)
    M.apply_loaded(m, o, sd)
    assert_bitwise(snap, M.snapshot(m, o), what)
    assert M.step_tensors_distinct(o), what
    _check_common(sd, STEP, rng)
    return m, o, _sources(tiers)


def _wipe_node(base: str, node: int, rank: int) -> None:
    """Delete node ``node``'s whole local root (its leader does it; every rank waits)."""
    if rank == node * RPN:
        shutil.rmtree(os.path.join(base, "nvme", f"node-{node}"))
    dist.barrier()


def phase_tp2pp2(rank: int, world: int, base: str) -> dict:
    """TP2 × PP2 × DP1 on 4 ranks as 2 simulated nodes (node n = pipeline stage n).

    1. Train 3 iterations through Megatron's 1F1B pipeline schedule; write a stock
       ``dp_reshardable`` torch_dist checkpoint (for the export); save iteration 3 to the
       local tier (+ replica on the other node) and the persistent tier; train iteration 4
       (the reference).
    2. Restore iteration 3 into fresh models from own-local, from a peer replica after node 1
       (the last stage) loses its root, and from persistent after both roots are gone: the
       restored iteration, parameters, main params, exp_avg, exp_avg_sq, each parameter's
       step, common state and RNG equal what was saved, bitwise; from own-local and from
       persistent, iteration 4 then gives the reference's loss and state bitwise.
    3. ``export`` (what ``tierckpt export-mcore`` runs) of the stock checkpoint infers TP=2,
       PP=2, equals the persistent tier's fully_reshardable step tensor for tensor, and loads
       back through ``dist_checkpointing.load`` bitwise.
    """
    from megatron.core import dist_checkpointing

    from mcore_plugin.export import export
    from tests.scenarios import assert_bitwise

    out: dict = {}
    M.setup(tp=2, pp=2)
    model, opt = M.build(seed=0)
    out["train"] = [M.train_step_pp(model, opt, s) for s in range(1, STEP + 1)]
    fn = M.state_dict_fn(model, opt, STEP)
    rng3 = M.rng_payload()
    stock = os.path.join(base, "megatron", "stock_dp_iter_0000003")
    if rank == 0:
        os.makedirs(stock)
    dist.barrier()
    dist_checkpointing.save(fn("dp_reshardable", False), stock)

    tiers = _tiers(base, rpn=RPN)
    tiers.save(STEP, fn("dp_reshardable", False), tiers=["local", "persistent"],
               persistent_state_dict=fn("fully_reshardable", False))
    snap3 = M.snapshot(model, opt)
    out["ref4"] = ref4 = M.train_step_pp(model, opt, STEP + 1)
    snap4 = M.snapshot(model, opt)
    tiers.wait()
    assert tiers.outcome(STEP, ["local", "persistent"]) == {"local": True, "persistent": True}

    m, o, src = _restore_pp(tiers, 11, snap3, "TP2xPP2 own-local", rng=rng3)
    assert src == {0: "own-local", 1: "own-local"} and tiers.last_restore_format == "dp_reshardable", src
    assert M.train_step_pp(m, o, STEP + 1) == ref4
    assert_bitwise(snap4, M.snapshot(m, o), "TP2xPP2 own-local, iteration 4")

    _wipe_node(base, 1, rank)
    _, _, src = _restore_pp(tiers, 12, snap3, "TP2xPP2 peer-replica", rng=rng3)
    assert src == {0: "own-local", 1: "peer-replica"}, src
    assert tiers.last_restore.persistent_bytes_read == 0

    tiers.wait()  # the replica rebuild after the last restore writes into the roots wiped next
    _wipe_node(base, 0, rank)
    _wipe_node(base, 1, rank)
    m, o, src = _restore_pp(tiers, 13, snap3, "TP2xPP2 persistent", rng=rng3)
    assert src == {0: "persistent", 1: "persistent"} and tiers.last_restore_format == "fully_reshardable", src
    assert M.train_step_pp(m, o, STEP + 1) == ref4
    assert_bitwise(snap4, M.snapshot(m, o), "TP2xPP2 persistent, iteration 4")
    tiers.close()

    exported = os.path.join(base, "exported")
    if rank == 0:
        rep = export(stock, exported)
        assert (rep.tp, rep.pp) == (2, 2), rep
        a, b = _load_all(exported), _load_all(os.path.join(base, "pfs", f"step-{STEP}"))
        tens = [k for k in b if isinstance(b[k], torch.Tensor)]
        assert tens and set(tens) <= set(a), set(tens) - set(a)
        for k in tens:
            assert torch.equal(a[k], b[k]), f"exported {k} differs from the persistent tier's"
        out["exported_tensors"] = len(tens)
    dist.barrier()
    m, o = M.build(seed=14)
    sd = dist_checkpointing.load(M.state_dict_fn(m, o, 0)("fully_reshardable", True), exported)
    M.apply_loaded(m, o, sd)
    assert_bitwise(snap3, M.snapshot(m, o), "TP2xPP2 exported, loaded back")
    assert sd["rng_state"]["rank"] == rank and torch.equal(sd["rng_state"]["torch"], rng3["torch"])
    return out


def phase_dp4_save(rank: int, world: int, base: str) -> None:
    """TP1 × DP4 on 4 ranks as 2 nodes of 2: train 3 iterations, then save iteration 3 to the
    local (+ replica) and persistent tiers (``nvme``/``pfs``), and to a local tier alone
    (``nvme-lonly``; its persistent root ``pfs-lonly`` holds no step). Rank 0 writes the saved
    global values to ``saved.pt``: parameters, the optimizer state in model space, the
    fixed-batch loss."""
    M.setup(tp=1)
    model, opt = M.build(seed=0)
    for s in range(1, STEP + 1):
        M.train_step(model, opt, s)
    fn = M.state_dict_fn(model, opt, STEP, rng=False)
    tiers = _tiers(base, rpn=RPN)
    tiers.save(STEP, fn("dp_reshardable", False), tiers=["local", "persistent"],
               persistent_state_dict=fn("fully_reshardable", False))
    tiers.close()
    assert tiers.outcome(STEP, ["local", "persistent"]) == {"local": True, "persistent": True}
    lonly = _tiers(base, local="nvme-lonly", persistent="pfs-lonly", tiers=("local",), rpn=RPN)
    lonly.save(STEP, fn("dp_reshardable", False), tiers=["local"])
    lonly.close()
    assert lonly.outcome(STEP, ["local"]) == {"local": True}
    saved = {"model": {n: p.detach().clone() for n, p in model.module.named_parameters()},
             "optim": M.global_optimizer_state(model, opt), "fixed_loss": M.fixed_batch_loss(model)}
    if rank == 0:
        torch.save(saved, os.path.join(base, "saved.pt"))
    dist.barrier()


def _assert_saved_values(base: str, model, opt, what: str) -> None:
    """Parameters and the model-space optimizer state equal ``saved.pt``'s, bitwise."""
    from tests.scenarios import assert_bitwise

    saved = torch.load(os.path.join(base, "saved.pt"), weights_only=False)
    assert_bitwise(saved["model"], {n: p.detach() for n, p in model.module.named_parameters()}, f"{what} model")
    assert_bitwise(saved["optim"], M.global_optimizer_state(model, opt), f"{what} optimizer")


def _restore_fresh(tiers, seed: int, **build) -> tuple:
    """Restore into a fresh model; returns (model, optimizer, what the test checks)."""
    m, o = M.build(seed=seed, **build)
    sd = tiers.restore(M.state_dict_fn(m, o, 0, rng=False))
    M.apply_loaded(m, o, sd)
    _check_common(sd, STEP, None)
    res = tiers.last_restore
    return m, o, {"reason": tiers.last_restore_reason, "sources": _sources(tiers), "step": res.step,
                  "format": tiers.last_restore_format, "persistent_bytes": res.persistent_bytes_read}


def phase_dp2_restore(rank: int, world: int, base: str) -> dict:
    """2 ranks as 2 nodes of 1 (both nodes of the DP4 job kept, half the ranks).

    1. TP1 × DP2: the dp_reshardable buckets reshard over DP from the in-cluster copies (no
       persistent byte): parameters and optimizer state (model space) bitwise the DP4 job's.
    2. TP1 × DP2 with another DDP bucket size (the buckets' global shapes change): the
       node-local copies are skipped for the persistent step, bitwise; ``restore_policy``
       ledger record.
    3. TP2 × DP1: a model-parallel change, the persistent step (fixed-batch loss within REL).
    4. TP2 with only a local tier: NoCheckpointError naming the persistent tier.
    """
    import json

    from tests.mcore.scenarios import REL, _close
    from tierckpt import NoCheckpointError

    M.setup(tp=1)
    out = {}
    tiers = _tiers(base)
    m, o, out["dp"] = _restore_fresh(tiers, 51)
    _assert_saved_values(base, m, o, "DP4 -> DP2 in-cluster")
    m, o, out["buckets"] = _restore_fresh(tiers, 52, bucket_size=1000)
    _assert_saved_values(base, m, o, "DP4 -> DP2, other buckets, persistent")
    tiers.close()

    M.setup(tp=2)
    tiers = _tiers(base)
    m, o, out["tp"] = _restore_fresh(tiers, 53)
    saved = torch.load(os.path.join(base, "saved.pt"), weights_only=False)
    _close(M.fixed_batch_loss(m), saved["fixed_loss"], "TP1 -> TP2 persistent, fixed-batch loss", rel=REL)
    tiers.close()
    with open(os.path.join(base, "pfs", "tierckpt-ledger.jsonl")) as f:
        out["policy"] = [r for r in map(json.loads, f) if r["kind"] == "restore_policy"]

    lonly = _tiers(base, local="nvme-lonly", persistent="pfs-lonly", tiers=("local",))
    m, o = M.build(seed=54)
    try:
        lonly.restore(M.state_dict_fn(m, o, 0, rng=False))
        out["error"] = None
    except NoCheckpointError as e:
        out["error"] = str(e)
    lonly.close(clean=False)
    return out
