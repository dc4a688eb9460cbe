"""The local tier's plan cache (tierckpt.io.plan_cache): a save whose structure did not change
reuses the last committed save's plans; any change (a new key, a reshaped tensor, a dtype, one
rank's change only, a key whose values start to differ per rank) plans in full; a failed save
drops the cache; a rank or coordinator that lost its cache alone still saves correctly. Every save is restored bitwise on each rank, and a reused save's ``.metadata``
equals what a full plan of the same state writes.

Two gloo ranks on one simulated node, so the node's DCP save has a coordinator and a second
rank (tests/harness.py).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader

from tests.harness import run_world
from tests.scenarios import assert_bitwise
from tierckpt.cluster.topology import Topology
from tierckpt.io import layout
from tierckpt.io.storage import Store
from tierckpt.tiers.local_tier import LocalTier, load_dir


def _state(rank: int, seed: int, *, extra: bool = False, shape=(4, 4), dtype=torch.float32,
           rank1_key: bool = False, shared_differs: bool = False) -> dict:
    g = torch.Generator().manual_seed(seed)
    sd = {
        "model": {f"l{i}.w": torch.randn(*shape, generator=g).to(dtype) for i in range(6)},
        "optim": {"state": {f"l{i}.w": {"exp_avg": torch.randn(3, generator=g)} for i in range(6)},
                  "param_groups": [{"lr": 1e-3 * seed, "betas": (0.9, 0.95)}]},
        # a per-rank value (kept under a rank-qualified key) and a shared one
        "rng": torch.full((5,), float(rank * 100 + seed)),
        "shared": torch.full((2,), float(seed + (rank if shared_differs else 0))),
        "step": seed,
    }
    if extra:
        sd["model"]["new.b"] = torch.randn(7, generator=g)
    if rank1_key and rank == 1:
        sd["only1"] = torch.arange(3.0) + seed
    return sd


def _zeros_like(sd):
    """A template of ``sd``'s structure whose every value differs from the saved one."""
    if isinstance(sd, torch.Tensor):
        return torch.zeros_like(sd) - 1
    if isinstance(sd, dict):
        return {k: _zeros_like(v) for k, v in sd.items()}
    if isinstance(sd, (list, tuple)):
        return type(sd)(_zeros_like(v) for v in sd)
    return type(sd)(-1)


def _restore_check(tier: LocalTier, step: int, sd: dict) -> None:
    target = _zeros_like(sd)
    load_dir(target, tier.store.path(layout.local_step(step)), tier.group)
    assert_bitwise(sd, target)


def _metadata(path: str):
    md = FileSystemReader(path).read_metadata()
    return md.state_dict_metadata, md.planner_data, md.storage_data


def _scenario(rank: int, world: int, base: str) -> dict:
    topo = Topology(rank=rank, world_size=world, node=0, node_of_rank=[0] * world)
    tier = LocalTier(Store(os.path.join(base, "local")), topo, dist.group.WORLD)
    cache = tier.plan_cache
    hits: list[int] = []
    step = 0

    def save(sd, **kw) -> int:
        nonlocal step
        step += 1
        before = cache.hits
        tier.save(sd, step, **kw)
        _restore_check(tier, step, sd)
        hits.append(cache.hits - before)
        return step

    save(_state(rank, 1))                          # first save: nothing cached
    s = save(_state(rank, 2))                      # same structure, new values: reused
    # the reused save wrote what a full plan writes
    fresh = LocalTier(Store(os.path.join(base, "fresh")), topo, dist.group.WORLD)
    fresh.save(_state(rank, 2), s)
    same_md = _metadata(tier.store.path(layout.local_step(s))) == _metadata(fresh.store.path(layout.local_step(s)))
    save(_state(rank, 3, extra=True))              # a new key
    save(_state(rank, 4, extra=True))              # reused again
    save(_state(rank, 5, extra=True, shape=(2, 8)))  # reshaped tensors
    save(_state(rank, 6, extra=True, shape=(2, 8), dtype=torch.bfloat16))  # a dtype change
    save(_state(rank, 7, extra=True, shape=(2, 8), dtype=torch.bfloat16, rank1_key=True))  # rank 1 only
    save(_state(rank, 8, extra=True, shape=(2, 8), dtype=torch.bfloat16, rank1_key=True))  # reused
    save(_state(rank, 9, extra=True, shape=(2, 8), dtype=torch.bfloat16, rank1_key=True,
                shared_differs=True))              # a key's values now differ per rank

    # a save that fails after its write (rank 1's snapshot check): nothing stays cached
    calls = {"n": 0}

    def torn():
        calls["n"] += 1
        if rank == 1 and calls["n"] == 2:
            raise RuntimeError("staged copy torn")

    failed = False
    try:
        tier.save(_state(rank, 10), step + 1, before_commit=torn)
    except RuntimeError as e:  # rank 1: its own error; rank 0: the agreed commit's failure
        failed = rank != 1 or "staged copy torn" in str(e)
    dropped = cache.committed is None and cache.pending is None
    step += 1
    save(_state(rank, 11))                         # planned in full after the failure
    save(_state(rank, 12))                         # reused
    if rank == 0:  # the coordinator lost its cache, rank 1 kept it: saved again in full
        tier.drop_plan_cache()
    save(_state(rank, 13))
    save(_state(rank, 14))                         # reused
    if rank == 1:  # rank 1 lost its cache: it sends its whole plan
        tier.drop_plan_cache()
    save(_state(rank, 15))
    tier.drop_plan_cache()                          # as a restore does
    save(_state(rank, 16))
    return {"hits": hits, "same_md": same_md, "failed": failed, "dropped": dropped}


@pytest.fixture(scope="module")
def outcome(tmp_path_factory):
    base = str(tmp_path_factory.mktemp("plancache"))
    return [r.value for r in run_world(_scenario, 2, base)]


def test_reuse_only_when_nothing_changed(outcome):
    want = [0, 1, 0, 1, 0, 0, 0, 1, 0, 0, 1, 0, 1, 0, 0]
    for o in outcome:
        assert o["hits"] == want, o


def test_reused_save_writes_the_full_plans_metadata(outcome):
    assert all(o["same_md"] for o in outcome), outcome


def test_failed_save_drops_the_cache(outcome):
    assert all(o["failed"] and o["dropped"] for o in outcome), outcome


# -- the hashing writer's small-tensor paths (tierckpt.io.dcp_io) ----------------------------------
def test_tensor_blobs_are_torch_save_bytes():
    import io

    from tierckpt.io.dcp_io import TensorBlobs, crc32_off

    blobs = TensorBlobs()
    plain = [torch.randn(8, 8), torch.tensor(2.5), torch.randn(1, 4), torch.empty_strided((1, 4), (1, 1)).normal_(),
             torch.randn(2, 3).to(torch.bfloat16), torch.arange(6), torch.rand(5) > 0.5,
             torch.randn(2, 2, dtype=torch.complex64)]
    other = [torch.randn(4, 4)[1:], torch.randn(3, 4).t(), torch.zeros(0), torch.randn(3, requires_grad=True)]
    with crc32_off():
        for t in plain + plain:  # the second round reuses the templates
            parts = blobs.parts(t)
            assert parts is not None, (t.shape, t.dtype)
            ref = io.BytesIO()
            torch.save(t, ref)
            assert b"".join(bytes(p) for p in parts) == ref.getvalue(), (t.shape, t.dtype, t.stride())
        assert all(blobs.parts(t) is None for t in other)
    assert blobs.parts(torch.randn(8)) is None  # the CRC32 on: torch.save's bytes differ


@pytest.mark.parametrize("shape", [(8, 8), (512, 512)], ids=["small-reread", "large-in-stream"])
def test_hashing_writer_digests_match_the_files(tmp_path, shape):
    import torch.distributed.checkpoint as dcp
    import xxhash

    from tierckpt.io.dcp_io import crc32_off, digests_under, hashing_writer

    sd = {f"t{i}": torch.randn(*shape) for i in range(4)} | {"obj": {"a": 1}, "view": torch.randn(9, 9)[2:]}
    path = str(tmp_path / "ckpt")
    w = hashing_writer(path)
    with crc32_off():
        dcp.save(sd, storage_writer=w, no_dist=True)
    got = digests_under(w, path)
    assert set(got) == {n for n in os.listdir(path)}
    for name, (size, digest) in got.items():
        data = open(os.path.join(path, name), "rb").read()
        assert (size, digest) == (len(data), xxhash.xxh3_64_hexdigest(data)), name
    back = _zeros_like(sd)
    dcp.load(back, checkpoint_id=path, no_dist=True)
    assert_bitwise(sd, back)
