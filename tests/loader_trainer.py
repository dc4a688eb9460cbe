"""An engine-API trainer with a multi-process DataLoader, for the preemption-signal tests
(tests/test_preemption_signals.py): run one process per rank under torchrun,
``python -m tierckpt.launch`` or ``launch/local.py``.

    loader_trainer.py BASE STEPS [--workers 2] [--no-protect] [--sleep S] [--tag NAME]
                      [--slow-step N --slow-s S]

Each rank is one simulated node (``simulated_ranks_per_node = 1``): FSDP2 over gloo on a tiny
MLP, AdamW, batches from a DataLoader over a deterministic map-style dataset (batch of step s
= rows 4(s-1)..4s-1, so a resumed run reads the same batches). The local tier (+ replica)
saves every 4 steps, both tiers on a preemption notice (SIGTERM, SIGUSR1). Rank 0 appends
``{"step", "loss_hex", "tag"}`` to ``BASE/losses.jsonl`` and every rank touches
``BASE/progress-<rank>`` with the step after each step. Exit 75 after a preemption save.

Which path took the preemption save is printed (stderr) so the tests can tell: ``preemption
save at the end of step N`` (the end-of-step check; a loader-worker death on the notice was
deferred, not raised mid-step) or ``fetch of step N failed on the notice: preemption save of
step N-1`` (the notice killed the workers while the rank waited for the batch; the ranks agreed
through :func:`tierckpt.integration.agree_loader_death`). ``--slow-step N --slow-s S``: every
row of step N takes S seconds to load, so a notice sent once step N-1 is done lands while
every rank waits in ``next()`` for that batch: the fetch-failure path, deterministically.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, Dataset

from tierckpt import PREEMPTED_EXIT, TierConfig, TieredCheckpointer, protect_loader_workers
from tierckpt.integration import agree_loader_death

BATCH = 4


class Rows(Dataset):
    """Row i: 16 values drawn from a generator seeded with i (the same in every process); the
    rows of step ``slow_step`` take ``slow_s`` seconds each."""

    def __init__(self, start: int, n: int, slow_step: int = 0, slow_s: float = 0.0):
        self.start, self.n, self.slow_step, self.slow_s = start, n, slow_step, slow_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if (self.start + i) // BATCH + 1 == self.slow_step:
            time.sleep(self.slow_s)
        g = torch.Generator().manual_seed(self.start + i)
        return torch.randn(16, generator=g)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("base")
    ap.add_argument("steps", type=int)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--no-protect", action="store_true")
    ap.add_argument("--sleep", type=float, default=0.3)
    ap.add_argument("--tag", default="run")
    ap.add_argument("--slow-step", type=int, default=0)
    ap.add_argument("--slow-s", type=float, default=0.0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    cfg = TierConfig(local_root=os.path.join(args.base, "nvme", "node-{node}"),
                     persistent_root=os.path.join(args.base, "pfs"), job_id="loader", replication_factor=2,
                     simulated_ranks_per_node=1, busy_tier_policy="wait",
                     preemption_signals=("SIGTERM", "SIGUSR1"), preemption_grace_s=60.0)
    eng = TieredCheckpointer(cfg)
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
    # every rank reads the same rows; rank r adds r so the ranks' gradients differ
    loader = DataLoader(Rows(start * BATCH, (args.steps - start) * BATCH, args.slow_step, args.slow_s),
                        batch_size=BATCH, num_workers=args.workers)
    if not args.no_protect:
        protect_loader_workers(loader, cfg.preemption_signals)
    batches = iter(loader)
    for step in range(start + 1, args.steps + 1):
        try:
            x = next(batches)
        except RuntimeError as e:  # the notice killed the loader's workers while we waited for data?
            # agreed: only when every rank's fetch failed on the notice at this step (the save
            # is collective; a rank already training would pair it with its own collectives)
            sig = agree_loader_death(eng, e, step - 1)
            if sig is None:
                raise
            print(f"loader_trainer: fetch of step {step} failed on the notice: preemption save of step {step - 1}",
                  file=sys.stderr, flush=True)
            print(eng.save_for_preemption(step - 1, app_state(), sig), file=sys.stderr, flush=True)
            eng.close(raise_failures=False)
            return PREEMPTED_EXIT
        x = x + rank
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if rank == 0:
            with open(os.path.join(args.base, "losses.jsonl"), "a") as f:
                f.write(json.dumps({"step": step, "loss_hex": loss.item().hex(), "tag": args.tag}) + "\n")
        time.sleep(args.sleep)  # a notice lands mid-step
        handle = eng.save(step, app_state(), tiers=["local"]) if step % 4 == 0 else None
        sig = eng.preemption_requested()
        if sig is not None:
            print(f"loader_trainer: preemption save at the end of step {step}", file=sys.stderr, flush=True)
            print(eng.save_for_preemption(step, app_state(), sig, handle=handle), file=sys.stderr, flush=True)
            eng.close(raise_failures=False)
            return PREEMPTED_EXIT
        with open(os.path.join(args.base, f"progress-{rank}"), "w") as f:
            f.write(str(step))
    eng.save(args.steps, app_state(), wait_previous=True)
    eng.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
