"""Rank functions for the multi-process engine tests (run through tests.harness.run_world)."""

from __future__ import annotations

import errno
import os
import shutil

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

from tierckpt.config import ScheduleOptions, TierConfig
from tierckpt.engine import TieredCheckpointer
from tierckpt import PersistentIO

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
    # these scenarios save tiers back to back and expect each save to happen (the blocking
    # behaviour); deferral has its own tests (tests/test_engine_defer.py)
    kw.setdefault("busy_tier_policy", "wait")
    kw.setdefault("local_root", os.path.join(base, "nvme", "node-{node}"))
    return TierConfig(persistent_root=os.path.join(base, "pfs"), job_id="test", **kw)


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
    return {"history": eng.history}  # typed records (tierckpt.records.CheckpointRecord)


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

    from tierckpt.io.dcp_io import HashingFileSystemWriter as FileSystemWriter  # the tiers' writer

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


class Flat(nn.Module):
    """One parameter of ``rows`` × ``cols``: FSDP2 shards dim 0 unevenly across ranks."""

    def __init__(self, rows, cols):
        super().__init__()
        self.w = nn.Parameter(torch.randn(rows, cols))

    def forward(self, idx):
        return self.w[idx].pow(2).sum()


def _flat(rows, cols, seed):
    torch.manual_seed(seed)
    m = Flat(rows, cols)
    fully_shard(m)
    opt = torch.optim.AdamW(m.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(seed)
    m(torch.randint(0, rows, (5,), generator=g)).backward()
    opt.step()
    opt.zero_grad()
    return m, opt


def phase_uneven_every_tier(rank, world, base, rows, cols, factor):
    """Save once, then restore from own-local, from a peer replica (node 1 wiped) and from the
    persistent tier (node 1 and every replica of it wiped), bitwise each time."""
    # 8 KiB transfer chunks: the 32003-row state crosses many chunk boundaries per file
    eng = TieredCheckpointer(make_config(base, replication_factor=factor, transfer_chunk_bytes=8192), node_id=rank)
    model, opt = _flat(rows, cols, seed=1)
    local_rows = model.w.to_local().shape[0]
    eng.save(1, app_state(model, opt))
    eng.wait()
    ref = snapshot(model, opt)
    seen = []
    for wipe in ("none", "node", "node+replicas"):
        eng.wait()  # the replica rebuild after the last restore must not write into a root wiped next
        dist.barrier()
        if rank == 0 and wipe != "none":
            shutil.rmtree(os.path.join(base, "nvme", "node-1"), ignore_errors=True)
            if wipe == "node+replicas":
                for n in range(world):
                    shutil.rmtree(os.path.join(base, "nvme", f"node-{n}", "replicas", "node-1"), ignore_errors=True)
        dist.barrier()
        m2, o2 = _flat(rows, cols, seed=7 + len(seen))
        sd = app_state(m2, o2)
        res = eng.restore(sd)
        apply_state(m2, o2, sd)
        assert_bitwise(snapshot(m2, o2), ref)
        seen.append(res.source_of(1))
        assert res.source_of(0) == "own-local"
    eng.close()
    return {"local_rows": local_rows, "sources_node1": seen}


def phase_bad_input(rank, world, base):
    """Every bad option fails on every rank with a ConfigError naming the option."""
    from tierckpt.errors import ConfigError

    def expect(option, fn):
        try:
            fn()
        except ConfigError as e:
            assert e.option == option and option in str(e), (option, str(e))
            return str(e)
        raise AssertionError(f"no ConfigError for {option}")

    msgs = {}
    msgs["F>nodes"] = expect("replication_factor", lambda: TieredCheckpointer(make_config(base, replication_factor=3), node_id=rank))
    msgs["J*F"] = expect("replication_jump", lambda: TieredCheckpointer(make_config(base, replication_jump=2), node_id=rank))
    msgs["J=0"] = expect("replication_jump", lambda: TieredCheckpointer(make_config(base, replication_jump=0), node_id=rank))
    msgs["keep"] = expect("keep_latest_k.local", lambda: TieredCheckpointer(make_config(base, keep_latest_k={"local": -1}), node_id=rank))
    msgs["tier"] = expect("tiers", lambda: TieredCheckpointer(make_config(base, tiers=("local", "nvme")), node_id=rank))
    blocker = os.path.join(base, "roots", "node-1")
    if rank == 0:
        os.makedirs(os.path.dirname(blocker), exist_ok=True)
        open(blocker, "w").close()  # a file where node 1's directory should be: unwritable even as root
    dist.barrier()
    cfg = make_config(base).replace(local_root=os.path.join(base, "roots", "node-{node}", "nvme"))
    msgs["root"] = expect("local_root", lambda: TieredCheckpointer(cfg, node_id=rank))
    eng = TieredCheckpointer(make_config(base), node_id=rank)
    model, opt = build(seed=0)
    msgs["save-tier"] = expect("tiers", lambda: eng.save(1, app_state(model, opt), tiers=["nvme"]))
    eng.close()
    return msgs


def phase_full_local_disk(rank, world, base):
    """Node 1's local root is a small tmpfs with room at the first save (the RAM-root check at
    the first local save passes), then filled up: its next local save hits ENOSPC, training
    goes on, the persistent tier still saves, and restore serves node 1 from the persistent
    tier, node 0 from its own copy."""
    eng = TieredCheckpointer(make_config(base), node_id=rank)
    model, opt = build(seed=0)
    train_step(model, opt, 1, rank)
    eng.save(1, app_state(model, opt))
    eng.wait()
    if rank == 1:  # the disk fills up (another job, logs, …)
        _fill(os.path.join(base, "nvme", "node-1"))
    dist.barrier()
    train_step(model, opt, 2, rank)
    eng.save(2, app_state(model, opt))
    ref = snapshot(model, opt)
    train_step(model, opt, 3, rank)  # training goes on while the local tier fails
    eng.wait()
    rec = {h.tier: h for h in eng.history if h.step == 2}
    m2, o2 = build(seed=5)
    sd = app_state(m2, o2)
    res = eng.restore(sd)
    apply_state(m2, o2, sd)
    assert_bitwise(snapshot(m2, o2), ref)
    eng.close()
    return {"local": rec["local"], "persistent": rec["persistent"], "step": res.step,
            "sources": {n: res.source_of(n) for n in res.sources}}


def _fill(root: str) -> None:
    """Write zeros into ``root`` until its filesystem is full (ENOSPC; any other error raises)."""
    block = bytes(1 << 16)
    fd = os.open(os.path.join(root, "filler"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        while True:
            os.write(fd, block)
    except OSError as e:
        if e.errno != errno.ENOSPC:
            raise
    finally:
        os.close(fd)


def phase_retention_and_staging(rank, world, base):
    """keep_latest_k per tier, torn-dir cleanup, and staging isolation under a slow writer."""
    import time as _time

    from tierckpt.io.dcp_io import HashingFileSystemWriter as FileSystemWriter  # the tiers' writer

    eng = TieredCheckpointer(make_config(base, keep_latest_k={"local": 2, "persistent": 3}), node_id=rank)
    model, opt = build(seed=0)
    # a torn leftover of an earlier run, older than anything we will commit
    torn = os.path.join(base, "nvme", f"node-{rank}", "local", "step-0")
    os.makedirs(torn, exist_ok=True)
    open(os.path.join(torn, "__0_0.distcp"), "wb").close()
    original = FileSystemWriter.write_data

    def slow_write(self, plan, planner):
        _time.sleep(1.0)  # the trainer changes parameters while this write is pending
        return original(self, plan, planner)

    FileSystemWriter.write_data = slow_write
    train_step(model, opt, 1, rank)
    eng.save(1, app_state(model, opt))
    ref = snapshot(model, opt)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(-3.0)
    eng.wait()
    FileSystemWriter.write_data = original
    m2, o2 = build(seed=9)
    sd = app_state(m2, o2)
    assert eng.restore(sd, step=1).step == 1
    apply_state(m2, o2, sd)
    assert_bitwise(snapshot(m2, o2), ref)  # the values at save(), not the ones written later
    for s in range(2, 6):
        train_step(model, opt, s, rank)
        eng.save(s, app_state(model, opt))
    eng.wait()
    dist.barrier()  # rank 0 purges the shared persistent tier; look after it finished
    root = os.path.join(base, "nvme", f"node-{rank}")
    local = sorted(os.listdir(os.path.join(root, "local")))
    replicas = sorted(os.listdir(os.path.join(root, "replicas", f"node-{1 - rank}")))
    pers = sorted(d for d in os.listdir(os.path.join(base, "pfs")) if d.startswith("step-"))
    eng.close()
    return {"local": local, "replicas": replicas, "persistent": pers}


def phase_adaptive(rank, world, base, clean_end, steps):
    """Train with adaptive intervals; every rank must agree on due() at every step."""
    import time as _time

    cfg = make_config(base, intervals={"local": 3, "persistent": 6}, adaptive=("local", "persistent"),
                      schedule=ScheduleOptions(gpu_mtbf_s=120.0, mtbf_weight=1.0, restart_prior_s=1.0))
    eng = TieredCheckpointer(cfg, node_id=rank)
    model, opt = build(seed=0)
    agreed, saved = [], []
    t_prev = _time.perf_counter()
    for s in range(1, steps + 1):
        train_step(model, opt, s, rank)
        _time.sleep(0.05)  # a step of known, non-trivial length
        now = _time.perf_counter()
        eng.observe_step(now - t_prev)
        tiers = eng.due(s)
        everyone = [None] * world
        dist.all_gather_object(everyone, tiers)
        agreed.append(all(e == tiers for e in everyone))
        if tiers:
            eng.save(s, app_state(model, opt), tiers=tiers)
            saved.append((s, tiers))
        t_prev = _time.perf_counter()
    tau = dict(eng.gate.schedule.cadence.tau)
    eng.wait()
    decisions = [(r["tier"], r["tau_steps"], r["trigger"]) for r in eng.drain_schedule_log()]
    if clean_end:
        eng.close()
    return {"agreed": all(agreed), "saved": saved, "tau": tau, "decisions": decisions}


def phase_rollback(rank, world, base):
    """Save 2, 4, 6. ``restore(step=2)`` is read-only: the next default restore picks 6. A
    rollback to 2 whose run ends before committing anything (a crash) leaves 4 and 6 resume
    points. A rollback to 2 that then commits step 3 supersedes 4 and 6 (local, replica,
    persistent) only from that commit on: the next default restore picks 3, not 6."""
    import json

    from tierckpt.cli import find_steps

    cfg = make_config(base, keep_latest_k={"local": 3, "persistent": 3})
    eng = TieredCheckpointer(cfg, node_id=rank)
    model, opt = build(seed=0)
    for s in (2, 4, 6):
        train_step(model, opt, s, rank)
        eng.save(s, app_state(model, opt))
    eng.wait()

    def committed():
        dist.barrier()
        return sorted({(x.tier, x.step) for x in find_steps(base) if x.committed})

    before = committed()
    out = {"read_only": eng.restore(app_state(model, opt), step=2).step}
    out["after_read_only"] = committed() == before
    out["default_after_read_only"] = eng.restore(app_state(model, opt)).step
    out["rollback_armed"] = eng.restore(app_state(model, opt), step=2, rollback=True).step
    out["after_arm"] = committed() == before
    eng.close(clean=False, reason="crash before the first commit of the new timeline")
    eng = TieredCheckpointer(cfg, node_id=rank)
    out["default_after_crash"] = eng.restore(app_state(model, opt)).step
    assert eng.restore(app_state(model, opt), step=2, rollback=True).step == 2
    train_step(model, opt, 3, rank)
    eng.save(3, app_state(model, opt))
    eng.wait()
    out["committed_after"] = committed()
    out["default_after_commit"] = eng.restore(app_state(model, opt)).step
    eng.close()
    recs = [json.loads(x) for x in open(os.path.join(base, "pfs", "tierckpt-ledger.jsonl"))]
    out["rollbacks"] = [(r["from_step"], r["to_step"], r["trigger"]["step"], sorted(r["superseded"]))
                        for r in recs if r["kind"] == "rollback"]
    return out


def phase_unshared_persistent(rank, world, base):
    """A 'persistent' root that is really per node (a different directory on each rank)."""
    from tierckpt.errors import ConfigError

    cfg = make_config(base).replace(persistent_root=os.path.join(base, f"pfs-private-{rank}"))
    try:
        TieredCheckpointer(cfg, node_id=rank)
    except ConfigError as e:
        return e.option
    return None


def phase_retention_anchor(rank, world, base, factor):
    """Node 1's local saves fail from step 3 on (a dying disk) while node 0's succeed; with
    keep_latest_k = 2 node 0 must still keep step 2, the newest step both nodes committed, so
    the job resumes from the local tier (no persistent step exists at all)."""
    from tierckpt.tiers.local_tier import LocalTier

    eng = TieredCheckpointer(make_config(base, replication_factor=factor, keep_latest_k={"local": 2, "persistent": 2}),
                             node_id=rank)
    original = LocalTier.save

    def dying(self, staged, step, **kw):
        if rank == 1 and step >= 3:
            raise OSError(5, "Input/output error (injected)")
        return original(self, staged, step, **kw)

    LocalTier.save = dying
    model, opt = build(seed=0)
    ref = None
    try:
        for s in range(1, 7):
            train_step(model, opt, s, rank)
            eng.save(s, app_state(model, opt), tiers=["local"])
            if s == 2:
                ref = snapshot(model, opt)
        eng.wait()
    finally:
        LocalTier.save = original
    local = sorted(os.listdir(os.path.join(base, "nvme", f"node-{rank}", "local")))
    m2, o2 = build(seed=3)
    sd = app_state(m2, o2)
    res = eng.restore(sd)
    apply_state(m2, o2, sd)
    assert_bitwise(snapshot(m2, o2), ref)
    eng.close()
    return {"local": local, "anchor": eng.gate.local_anchor, "step": res.step,
            "sources": {n: res.source_of(n) for n in res.sources}, "persistent_bytes": res.persistent_bytes_read}


def phase_hung_local_disk(rank, world, base, limit):
    """Node 1's local save of step 2 hangs (a stuck NVMe) until node 1 has trained past step 4.

    The step-3 save returns after about ``limit`` seconds on every rank with the local tier
    skipped (persistent saved); step 4 skips it again without a second full wait; once the
    disk is back, step 5 saves every tier. Then the step-6 local save hangs past close(), which
    must return after about ``limit``."""
    import time as _time

    from tierckpt.tiers.local_tier import LocalTier

    def release(step):
        return os.path.join(base, f"release-disk-{step}")

    eng = TieredCheckpointer(make_config(base, local_wait_timeout_s=limit), node_id=rank)
    original = LocalTier.save

    def stuck(self, staged, step, **kw):
        if rank == 1 and step in (2, 6):
            while not os.path.exists(release(step)):
                _time.sleep(0.05)
        return original(self, staged, step, **kw)

    LocalTier.save = stuck
    model, opt = build(seed=0)
    blocking = {}
    for s in range(1, 6):
        train_step(model, opt, s, rank)
        t0 = _time.perf_counter()
        eng.save(s, app_state(model, opt))
        blocking[s] = _time.perf_counter() - t0
        if s == 3:  # what Megatron's commit waits for: this step's jobs only, not the stuck one
            t0 = _time.perf_counter()
            waited3 = (eng.wait(step=3), _time.perf_counter() - t0)
        if s == 4:
            if rank == 1:
                open(release(2), "w").close()  # the disk comes back
            eng.jobs.lanes["local"].save.result(timeout=60)  # test only: let the late step-2 job finish
    ref = snapshot(model, opt)
    eng.wait()
    hist = [(h.tier, h.step, h.ok, h.skipped) for h in eng.history]
    m2, o2 = build(seed=3)
    sd = app_state(m2, o2)
    res = eng.restore(sd)
    apply_state(m2, o2, sd)
    assert_bitwise(snapshot(m2, o2), ref)
    train_step(model, opt, 6, rank)
    eng.save(6, app_state(model, opt))
    t0 = _time.perf_counter()
    eng.close()
    close_s = _time.perf_counter() - t0
    # node 0's abandoned job waits for node 1 inside a gloo collective; let both finish before
    # the harness tears the process groups down (exit with a peer still blocked there may
    # abort the process: see docs/design.md, "A hung node-local disk")
    if rank == 1:
        open(release(6), "w").close()
    eng.jobs.lanes["local"].save.result(timeout=60)
    eng.jobs.lanes["local"].worker._thread.join(timeout=60)
    return {"blocking": blocking, "history": hist, "step": res.step, "close_s": close_s, "waited3": waited3,
            "sources": {n: res.source_of(n) for n in res.sources}}


def phase_peek(rank, world, base):
    """tierckpt.restore.peek.read_item: one item of a step from a verified node-local copy, falling over
    corrupt copies to the next copy and the next node; None when no node-local copy is usable."""
    import json as _json

    from torch.distributed.checkpoint import FileSystemReader

    from tierckpt.io import layout
    from tierckpt.restore.peek import read_item

    eng = TieredCheckpointer(make_config(base), node_id=rank)
    model, opt = build(seed=0)
    for s in (1, 2):
        train_step(model, opt, s, rank)
        # node-specific here (unlike a real common state) to show which copy served the read
        eng.save(s, {**app_state(model, opt), "meta": f"step {s} node {rank}".encode()})
    eng.wait()
    out = {"newest": read_item(eng, "meta"), "step1": read_item(eng, "meta", step=1)}
    root = os.path.join(base, "nvme", f"node-{rank}")

    def corrupt(rel):
        d = os.path.join(root, rel)
        md = FileSystemReader(d).read_metadata()
        f = next(i.relative_path for k, i in md.storage_data.items() if k.fqn == "meta")
        with open(os.path.join(d, f), "r+b") as fh:
            b = fh.read(1)
            fh.seek(0)
            fh.write(bytes([b[0] ^ 0xFF]))

    if rank == 0:
        corrupt(layout.local_step(2))  # node 0's own copy: its replica of node 1 serves
    dist.barrier()
    out["own_corrupt"] = read_item(eng, "meta", step=2)
    if rank == 0:
        corrupt(layout.replica_step(1, 2))  # all of node 0's copies: node 1 serves
    dist.barrier()
    out["node0_corrupt"] = read_item(eng, "meta", step=2)
    out["missing_key"] = read_item(eng, "no-such-item", step=2)
    dist.barrier()
    shutil.rmtree(root)  # every local disk lost: only the persistent tier has the step
    dist.barrier()
    out["no_local"] = read_item(eng, "meta")
    eng.close()
    with open(os.path.join(base, "pfs", "tierckpt-ledger.jsonl")) as f:
        out["restores"] = sum(1 for line in f if _json.loads(line).get("kind") == "restore")
    return out


def phase_hung_local_exit(rank, world, base, limit):
    """One node whose local save never returns: close() gives up after ``limit`` and the
    process exits (the stuck job runs on a daemon thread; the harness fails on a hang)."""
    import time as _time

    from tierckpt.tiers.local_tier import LocalTier

    eng = TieredCheckpointer(make_config(base, replication_factor=1, local_wait_timeout_s=limit), node_id=rank)

    def forever(self, staged, step, **kw):
        while True:
            _time.sleep(0.05)

    model, opt = build(seed=0)
    train_step(model, opt, 1, rank)
    LocalTier.save = forever
    eng.save(1, app_state(model, opt))
    t0 = _time.perf_counter()
    eng.close()
    return {"close_s": _time.perf_counter() - t0,
            "persistent": [(h.tier, h.step, h.ok) for h in eng.history]}


# --------------------------------------------------------------------------------- resume contract
class _FailingPersistentIO(PersistentIO):
    """PersistentIO whose saves of ``fail_steps`` hit ENOSPC on every rank (a full shared
    file system), the rest write normally."""

    def __init__(self, fail_steps):
        self.fail_steps = set(fail_steps)

    def to_dcp(self, state_dict, url, process_group):
        import errno

        if int(url.rstrip("/").rsplit("step-", 1)[1]) in self.fail_steps:
            raise OSError(errno.ENOSPC, "No space left on device", url)
        return super().to_dcp(state_dict, url, process_group)


def _run_end(base: str, sub: str) -> dict:
    from tierckpt.history.ledger import Ledger
    from tierckpt.io.storage import Store

    return [r for r in Ledger.read(Store(os.path.join(base, sub, "pfs"))) if r["kind"] == "run_end"][-1]


def phase_background_failure_policy(rank, world, base):
    """A failed persistent save reaches the trainer: the next persistent save raises
    TierFailedError on every rank (once), a clean close raises when the failure was not raised
    yet, ``warn_only`` only records it, and ``run_end`` is clean only with a durable step."""
    from tierckpt.errors import TierFailedError

    model, opt = build(seed=0)
    out = {}
    # (a) failure raised at the tier's next save, once; later saves go on
    b = os.path.join(base, "a")
    eng = TieredCheckpointer(make_config(b), node_id=rank, persistent_io=_FailingPersistentIO({2}))
    for s in (1, 2):
        train_step(model, opt, s, rank)
        h = eng.save(s, app_state(model, opt))
    recs = h.wait(timeout=120)
    out["a_step2"] = {t: (r.ok, r.error) for t, r in recs.items()}
    try:
        eng.save(3, app_state(model, opt))
        out["a_raised"] = None
    except TierFailedError as e:
        out["a_raised"] = (e.tier, e.step, e.cause)
    out["a_retry_tiers"] = list(eng.save(3, app_state(model, opt)).wait(timeout=120))
    eng.close()
    out["a_committed"] = eng.persistent.committed_steps()
    # (b) the last save failed: a clean close raises after closing everything
    b = os.path.join(base, "b")
    eng = TieredCheckpointer(make_config(b), node_id=rank, persistent_io=_FailingPersistentIO({1}))
    eng.save(1, app_state(model, opt))
    try:
        eng.close()
        out["b_raised"] = None
    except TierFailedError as e:
        out["b_raised"] = (e.tier, e.step)
    dist.barrier()
    out["b_run_end"] = _run_end(base, "b")
    # (c) warn_only: recorded, never raised; a later durable step makes the run clean
    b = os.path.join(base, "c")
    eng = TieredCheckpointer(make_config(b, warn_only=("local", "persistent")), node_id=rank,
                             persistent_io=_FailingPersistentIO({1}))
    eng.save(1, app_state(model, opt))
    eng.save(2, app_state(model, opt))
    eng.close()
    dist.barrier()
    out["c_run_end"] = _run_end(base, "c")
    # (d) only local saves in the run: nothing durable, run_end is not clean
    b = os.path.join(base, "d")
    eng = TieredCheckpointer(make_config(b), node_id=rank)
    eng.save(1, app_state(model, opt), tiers=["local"])
    eng.close()
    dist.barrier()
    out["d_run_end"] = _run_end(base, "d")
    # (e) a ledger that cannot be written fails the persistent save (not just a warning)
    b = os.path.join(base, "e")
    eng = TieredCheckpointer(make_config(b), node_id=rank)
    dist.barrier()
    if rank == 0:
        ledger = os.path.join(b, "pfs", "tierckpt-ledger.jsonl")
        os.remove(ledger)
        os.makedirs(ledger)  # appends now fail with IsADirectoryError
    dist.barrier()
    recs = eng.save(1, app_state(model, opt)).wait(timeout=120)
    out["e_persistent"] = (recs["persistent"].ok, recs["persistent"].error)
    try:
        eng.save(2, app_state(model, opt), tiers=["persistent"])
        out["e_raised"] = None
    except TierFailedError as e:
        out["e_raised"] = (e.tier, e.step)
    try:
        eng.close()
        out["e_close"] = None
    except TierFailedError as e:
        out["e_close"] = (e.tier, "run_end" in str(e) and "IsADirectoryError" in str(e))
    return out


def phase_lineage(rank, world, base, pfs, save_steps):
    """One run of the experiment whose persistent root is ``base/<pfs>``, on the shared node-local
    roots ``base/nvme/node-<n>``: restore, then save ``save_steps`` to the local tier only (so
    the state exists nowhere else). Returns what the start left on this node's local root, the
    restored step and the lineage id."""
    from tierckpt.io import layout
    from tierckpt.io.manifest import read_committed
    from tierckpt.io.storage import Store

    def on_disk():
        store = Store(os.path.join(base, "nvme", f"node-{rank}"))
        return {parent: [s for s in (layout.parse_step(n) for n in store.listdir(parent))
                         if s is not None and read_committed(store, f"{parent}/step-{s}")]
                for parent in ("local", f"replicas/node-{1 - rank}")}

    cfg = make_config(base).replace(persistent_root=os.path.join(base, pfs))
    eng = TieredCheckpointer(cfg, node_id=rank)
    dist.barrier()  # every node leader's start-up purge is done
    after_start = on_disk()
    model, opt = build(seed=0)
    res = eng.restore(app_state(model, opt))
    for s in save_steps:
        train_step(model, opt, s, rank)
        eng.save(s, app_state(model, opt), tiers=["local"])
    eng.close()
    dist.barrier()
    return {"after_start": after_start, "restored": None if res is None else res.step,
            "sources": None if res is None else sorted({o.source.kind for o in res.sources.values()}),
            "end": on_disk(), "lineage": eng.lineage}
