"""An engine-API trainer for the recovery tests (tests/test_recovery.py): one rank per
simulated node, run by ``launch/local.py`` (warm node agents or torchrun).

    recovery_trainer.py BASE STEPS [--local-every 3] [--persistent-every 6] [--sleep S]
                        [--fail R:NODE:STEP:HOW,…]

FSDP2 over gloo on a tiny MLP with AdamW; the batch of step s is the same in every run
(rows seeded by s), plus the rank (the ranks' gradients differ), so a resumed run must
reproduce the uninterrupted run's losses bit for bit. Local tier (+ replica) every
``--local-every`` steps, persistent every ``--persistent-every``, ``observe_step`` every step
(the recovery record and the beacon's progress). Rank 0 appends ``{"step", "loss_hex",
"restart"}`` to ``BASE/losses.jsonl``; every rank appends ``{"rank", "node", "restart",
"warm", "start_s", "restored"}`` to ``BASE/starts.jsonl`` once its restore returned
(``warm``: torch was imported before this rank's code ran, i.e. it was forked by a warm
agent; ``start_s``: seconds from ``$TIERCKPT_PROCESS_STARTED`` to that point), and
``{"rank", "restart", "value"}`` of ``$TIERCKPT_RECOVERY`` to ``BASE/recovery-env.jsonl`` when set.

``--fail``: at restart count R (``$TIERCKPT_RESTART_COUNT``), the rank of node NODE does HOW
after step STEP's save — ``kill`` (SIGKILL itself), ``exit`` (status 1), ``stall`` (sleep
forever, its beacon still ticking), ``stop`` (SIGSTOP itself: a frozen process) — or, with
STEP = ``restore``, right after its restore returned (a failure during a recovery).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

WARM = "torch" in sys.modules  # before this script imports anything heavy

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402

from tierckpt import TierConfig, TieredCheckpointer  # noqa: E402


def batch(step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(4, 16, generator=g) + rank


def _fail(plan: dict, restart: int, node: int, when: str) -> None:
    how = plan.get((restart, node, when))
    if how is None:
        return
    sys.stdout.flush()
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif how == "exit":
        os._exit(1)
    elif how == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif how == "stall":
        while True:
            time.sleep(1)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("base")
    ap.add_argument("steps", type=int)
    ap.add_argument("--local-every", type=int, default=3)
    ap.add_argument("--persistent-every", type=int, default=6)
    ap.add_argument("--sleep", type=float, default=0.1)
    ap.add_argument("--fail", default="")
    args = ap.parse_args()
    plan = {}
    for item in filter(None, args.fail.split(",")):
        r, n, s, how = item.split(":")
        plan[(int(r), int(n), s)] = how
    restart = int(os.environ.get("TIERCKPT_RESTART_COUNT", "0"))
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    cfg = TierConfig(local_root=os.path.join(args.base, "nvme", "node-{node}"),
                     persistent_root=os.path.join(args.base, "pfs"), job_id="recovery", replication_factor=2,
                     simulated_ranks_per_node=1, busy_tier_policy="wait")
    eng = TieredCheckpointer(cfg)
    node = eng.topo.node
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def app_state() -> dict:
        msd, osd = get_state_dict(model, opt)
        return {"model": msd, "optim": osd}

    state = app_state()
    res = eng.restore(state)
    start = 0
    if res is not None:
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        start = res.step
    started = float(os.environ.get("TIERCKPT_PROCESS_STARTED", "nan"))
    with open(os.path.join(args.base, "starts.jsonl"), "a") as f:
        f.write(json.dumps({"rank": rank, "node": node, "restart": restart, "warm": WARM, "restored": start,
                            "start_s": time.time() - started}) + "\n")
    if os.environ.get("TIERCKPT_RECOVERY") is not None:
        with open(os.path.join(args.base, "recovery-env.jsonl"), "a") as f:
            f.write(json.dumps({"rank": rank, "restart": restart, "value": os.environ["TIERCKPT_RECOVERY"]}) + "\n")
    _fail(plan, restart, node, "restore")
    t_prev = time.perf_counter()
    for step in range(start + 1, args.steps + 1):
        loss = model(batch(step, rank)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if rank == 0:
            with open(os.path.join(args.base, "losses.jsonl"), "a") as f:
                f.write(json.dumps({"step": step, "loss_hex": loss.item().hex(), "restart": restart}) + "\n")
        time.sleep(args.sleep)
        now = time.perf_counter()
        eng.observe_step(now - t_prev)
        t_prev = now
        tiers = [t for t, every in (("local", args.local_every), ("persistent", args.persistent_every))
                 if step % every == 0]
        if tiers and step < args.steps:
            eng.save(step, app_state(), tiers=tiers)
            eng.wait(step=step)  # committed (and replicated) before a failure is injected
        _fail(plan, restart, node, str(step))
    eng.save(args.steps, app_state(), wait_previous=True)
    eng.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
