"""Rank functions for the multi-process engine tests (run through tests.harness.run_world)."""

from __future__ import annotations

import os
import shutil

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

from tierckpt.config import TierConfig
from tierckpt.engine import TieredCheckpointer

VOCAB, DIM, HID, SEQ, BATCH = 37, 12, 20, 8, 4  # 37 and 20 do not divide 2, 3 or 4 ranks evenly


class Net(nn.Module):
    """Tiny LM: embedding → MLP → LM head; every FSDP2 shard dimension is uneven."""

    def __init__(self, vocab=VOCAB, dim=DIM, hid=HID):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.up = nn.Linear(dim, hid)
        self.down = nn.Linear(hid, dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, x):
        h = self.emb(x)
        h = h + self.down(F.gelu(self.up(h)))
        return self.head(h)


def build(seed: int):
    torch.manual_seed(seed)
    model = Net()
    for m in (model.up, model.down, model.head):
        fully_shard(m)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return model, opt


def batch(step: int, rank: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return x, torch.roll(x, -1, dims=1)


def train_step(model, opt, step: int, rank: int) -> float:
    x, y = batch(step, rank)
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    loss.backward()
    opt.step()
    opt.zero_grad()
    # the global mean loss, so every rank compares the same number
    t = loss.detach().clone()
    dist.all_reduce(t)
    return t.item()


def app_state(model, opt):
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd, "extra": {"step_counter": torch.tensor(0), "note": "x"}}


def apply_state(model, opt, sd):
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])


def snapshot(model, opt) -> dict:
    """Bitwise copy of this rank's local shards of params and optimizer state."""
    msd, osd = get_state_dict(model, opt)

    def local(v):
        if hasattr(v, "to_local"):
            return v.to_local().clone()
        if isinstance(v, torch.Tensor):
            return v.clone()
        if isinstance(v, dict):
            return {k: local(x) for k, x in v.items()}
        if isinstance(v, list):
            return [local(x) for x in v]
        return v

    return {"model": local(msd), "optim": local(osd)}


def assert_bitwise(a, b, path="state"):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), path
        assert a.dtype == b.dtype and a.shape == b.shape, f"{path}: {a.dtype}{a.shape} vs {b.dtype}{b.shape}"
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), f"{path} differs"
    elif isinstance(a, dict):
        assert set(a) == set(b), f"{path}: keys {set(a) ^ set(b)}"
        for k in a:
            assert_bitwise(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_bitwise(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def make_config(base: str, **kw) -> TierConfig:
    kw.setdefault("replication_factor", 2)
    return TierConfig(local_root=os.path.join(base, "nvme", "node-{node}"),
                      persistent_root=os.path.join(base, "pfs"), job_id="test", **kw)


# ---------------------------------------------------------------------------------------------
def phase_train_and_save(rank, world, base, rpn, k, extra_steps, cfg_kw=None):
    """Train k steps, save all tiers at step k, train ``extra_steps`` more (the uninterrupted
    reference), write the step-k snapshot and reference losses to ``base/ref``."""
    eng = TieredCheckpointer(make_config(base, **(cfg_kw or {})), node_id=rank // rpn)
    model, opt = build(seed=0)
    for s in range(1, k + 1):
        train_step(model, opt, s, rank)
    eng.save(k, app_state(model, opt))
    snap = snapshot(model, opt)
    # change parameters right after save() returns: the checkpoint must hold the step-k values
    params = list(model.parameters())
    originals = [p.detach().clone() for p in params]
    with torch.no_grad():
        for p in params:
            p.add_(1000.0)
    eng.wait()
    with torch.no_grad():
        for p, o in zip(params, originals):
            p.copy_(o)
    losses = [train_step(model, opt, s, rank) for s in range(k + 1, k + 1 + extra_steps)]
    eng.close()
    os.makedirs(os.path.join(base, "ref"), exist_ok=True)
    torch.save({"snap": snap, "losses": losses}, os.path.join(base, "ref", f"rank{rank}.pt"))
    return {"history": eng.history}


def phase_restore_and_check(rank, world, base, rpn, k, extra_steps, cfg_kw=None):
    """Fresh model (other seed) → restore → bitwise equal to the step-k snapshot → the next
    losses equal the uninterrupted run's, bitwise. Returns restore facts for the test."""
    eng = TieredCheckpointer(make_config(base, **(cfg_kw or {})), node_id=rank // rpn)
    model, opt = build(seed=123)
    train_step(model, opt, 999, rank)  # make sure the fresh state differs everywhere
    sd = app_state(model, opt)
    res = eng.restore(sd)
    assert res is not None, "nothing restored"
    apply_state(model, opt, sd)
    ref = torch.load(os.path.join(base, "ref", f"rank{rank}.pt"), weights_only=False)
    assert_bitwise(snapshot(model, opt), ref["snap"])
    losses = [train_step(model, opt, s, rank) for s in range(k + 1, k + 1 + extra_steps)]
    assert losses == ref["losses"], f"losses {losses} != reference {ref['losses']}"
    eng.close()
    return {
        "step": res.step,
        "sources": {n: (o.source.kind, o.source.holder) for n, o in res.sources.items()},
        "persistent_bytes": res.persistent_bytes_read,
        "failures": [(f.node, f.source.kind, f.source.holder, f.step, f.error) for f in res.failures],
        "attempts": res.attempts,
    }


def phase_killed_mid_write(rank, world, base, victim_rank):
    """Save step 2 completely, then start a local save of step 4 during which ``victim_rank``
    SIGKILLs itself with a data file half written."""
    import signal

    from torch.distributed.checkpoint import FileSystemWriter

    eng = TieredCheckpointer(make_config(base), node_id=rank)
    model, opt = build(seed=0)
    for s in (1, 2):
        train_step(model, opt, s, rank)
    eng.save(2, app_state(model, opt))
    eng.wait()
    snap = snapshot(model, opt)
    os.makedirs(os.path.join(base, "ref"), exist_ok=True)
    losses = []
    for s in (3, 4):
        losses.append(train_step(model, opt, s, rank))
    torch.save({"snap": snap, "losses": [], "after": losses}, os.path.join(base, "ref", f"rank{rank}.pt"))
    dist.barrier()
    if rank == victim_rank:
        original = FileSystemWriter.write_data

        def torn_write(self, plan, planner):
            path = os.path.join(str(self.path), f"__{dist.get_rank()}_0.distcp")
            with open(path, "wb") as f:
                f.write(b"\x00" * 4096)
                f.flush()
                os.fsync(f.fileno())
            os.kill(os.getpid(), signal.SIGKILL)
            return original(self, plan, planner)

        FileSystemWriter.write_data = torn_write
    eng.save(4, app_state(model, opt), tiers=["local"])
    eng.wait()
    dist.barrier()  # the survivor waits here for the dead rank until it is killed
    return "unreachable"
