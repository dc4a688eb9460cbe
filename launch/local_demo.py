#!/usr/bin/env python
"""Local launcher and demo of tierckpt: lose a node, come back from its neighbour's replica.

Run ``python launch/local_demo.py`` (or ``make demo``). On one machine it starts 2 rank
processes as 2 simulated nodes (one rank per node, gloo), each training a small FSDP2
(``fully_shard``) byte-level transformer with AdamW on real text that ships with Python (the
source code of a few standard-library modules). tierckpt writes the local tier every
``--local-every`` steps (replicated to the other node, F=2) and the persistent tier every
``--persistent-every`` steps.

The scenario:

1. reference: the same training, same seeds and batches, no checkpointing and no failure;
2. attempt 1: training with tiered checkpoints; once node 1 reaches ``--kill-step`` (and its
   latest local step is replicated on node 0), the launcher SIGKILLs node 1, deletes node 1's
   whole local root (its "NVMe" is gone), then kills the survivor too (a real job loses its
   process group);
3. attempt 2: the whole job restarts (fresh processes, fresh port); every rank calls
   ``TieredCheckpointer.restore``; node 0 loads its own local step, node 1 pulls its files
   back from node 0's replica; no byte is read from the persistent tier; training runs to the
   end.

The launcher then checks that the losses after the resume are bitwise equal to the
reference's, prints a short report and writes ``outputs/demo/report.json``. Exit status 1 if
the losses differ, node 1 did not restore from ``peer-replica``, or persistent bytes were read.

Interim main job: the torchtitan plugin (issue 3) replaces the model with torchtitan's llama3
debug model and this launcher's worker with ``titan_plugin.train``.

Worker mode (used by the launcher): ``local_demo.py --worker --mode {reference,train} --out DIR``
with MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE/TIERCKPT_NODE_ID in the environment.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # running as a script puts launch/ on sys.path, not the repo root
    sys.path.insert(0, REPO)

DEFAULT_OUT = os.path.join(REPO, "outputs", "demo")
CORPUS_MODULES = ("argparse", "textwrap", "difflib", "heapq", "string", "fractions", "calendar")

# model / data shape (byte-level tokens)
VOCAB, DIM, LAYERS, HEADS, SEQ, BATCH = 256, 128, 4, 4, 128, 8


# =============================================================================================
# worker
# =============================================================================================
def corpus_bytes() -> bytes:
    """Real text shipped with Python: the source of a few standard-library modules."""
    import importlib
    import inspect

    parts = []
    for name in CORPUS_MODULES:
        parts.append(inspect.getsource(importlib.import_module(name)))
    return "\n".join(parts).encode("utf-8")


def _build_model(seed: int):
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.distributed.fsdp import fully_shard

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
            self.qkv, self.proj = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
            self.up, self.down = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

        def forward(self, x):
            b, t, c = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, HEADS, c // HEADS).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(a.transpose(1, 2).reshape(b, t, c))
            return x + self.down(F.gelu(self.up(self.ln2(x))))

    class TinyLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = nn.Embedding(VOCAB, DIM)
            self.pos = nn.Embedding(SEQ, DIM)
            self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
            self.ln_f = nn.LayerNorm(DIM)
            self.head = nn.Linear(DIM, VOCAB, bias=False)

        def forward(self, idx):
            h = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
            for blk in self.blocks:
                h = blk(h)
            return self.head(self.ln_f(h))

    torch.manual_seed(seed)
    model = TinyLM()
    for blk in model.blocks:
        fully_shard(blk)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    return model, opt


def _lr(step: int, total: int, peak: float = 3e-3, warmup: int = 5) -> float:
    """Warmup + cosine; a pure function of the step, so it needs no checkpointed state."""
    import math

    if step <= warmup:
        return peak * step / warmup
    frac = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def _batch(data, step: int, rank: int):
    """Deterministic (inputs, targets) of ``rank`` at ``step``: random windows of the corpus."""
    import torch

    g = torch.Generator().manual_seed(1_000_003 * step + rank)
    starts = torch.randint(0, data.numel() - SEQ - 1, (BATCH,), generator=g)
    x = torch.stack([data[s:s + SEQ] for s in starts.tolist()])
    y = torch.stack([data[s + 1:s + SEQ + 1] for s in starts.tolist()])
    return x, y


def _state_digest(model, opt) -> str:
    """sha256 of this rank's local shards of model and optimizer state (bitwise fingerprint)."""
    import torch
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    h = hashlib.sha256()

    def visit(prefix, v):
        if hasattr(v, "to_local"):
            v = v.to_local()
        if isinstance(v, torch.Tensor):
            h.update(prefix.encode())
            h.update(v.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(v, dict):
            for k in sorted(v, key=str):
                visit(f"{prefix}.{k}", v[k])
        elif isinstance(v, (list, tuple)):
            for i, x in enumerate(v):
                visit(f"{prefix}[{i}]", x)
        else:
            h.update(f"{prefix}={v!r}".encode())

    visit("model", msd)
    visit("optim", osd)
    return h.hexdigest()


def _write_json(path: str, obj) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)


def tier_config(out: str):
    from tierckpt.config import TierConfig

    return TierConfig(
        local_root=os.path.join(out, "nvme", "node-{node}"),
        persistent_root=os.path.join(out, "pfs"),
        replication_jump=1,
        replication_factor=2,
        keep_latest_k={"local": 2, "persistent": 2},
        job_id="demo",
    )


def worker(args) -> int:
    import logging

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                        format=f"%(asctime)s [rank{rank}] %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("demo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # env://: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE
    data = torch.frombuffer(bytearray(corpus_bytes()), dtype=torch.uint8).long()
    model, opt = _build_model(seed=1234)
    step_t = torch.zeros((), dtype=torch.int64)  # trainer state, checkpointed with the model

    def app_state():
        msd, osd = get_state_dict(model, opt)
        return {"model": msd, "optim": osd, "train": {"step": step_t}}

    # Building the state dict initialises AdamW's state (torch's get_state_dict does a
    # zero-lr step on an empty optimizer); both modes do it here so they train identically.
    state = app_state()
    status_path = os.path.join(args.status_dir, f"rank{rank}.json")
    status = {"rank": rank, "node": int(os.environ.get("TIERCKPT_NODE_ID", rank)), "pid": os.getpid(),
              "mode": args.mode, "step": 0, "losses": {}, "restore": None, "first_step_time": None,
              "saves": []}
    eng = None
    start = 0
    if args.mode == "train":
        from tierckpt.engine import TieredCheckpointer

        eng = TieredCheckpointer(tier_config(args.out))  # node id from TIERCKPT_NODE_ID
        res = eng.restore(state)
        if res is not None:
            set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
            start = int(step_t.item())
            assert start == res.step, (start, res.step)
            status["restore"] = {
                "step": res.step, "seconds": res.seconds, "attempts": res.attempts,
                "persistent_bytes_read": res.persistent_bytes_read,
                "sources": {str(n): {"source": o.source.kind, "holder": o.source.holder, "bytes": o.bytes,
                                     "seconds": o.seconds} for n, o in res.sources.items()},
                "failures": [{"node": f.node, "source": f.source.kind, "step": f.step, "error": f.error}
                             for f in res.failures],
            }
            log.info("restored step %d: %s", res.step, status["restore"]["sources"])
        else:
            log.info("no checkpoint: starting from step 0")
    _write_json(status_path, status)

    for step in range(start + 1, args.steps + 1):
        for g in opt.param_groups:
            g["lr"] = _lr(step, args.steps)
        x, y = _batch(data, step, rank)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t = loss.detach().clone()
        dist.all_reduce(t)  # global mean over ranks: the same number on every rank
        gl = t.item() / world
        step_t.fill_(step)
        status["step"] = step
        status["losses"][str(step)] = gl
        if status["first_step_time"] is None:
            status["first_step_time"] = time.time()
        if eng is not None:
            tiers = [t for t, every in (("local", args.local_every), ("persistent", args.persistent_every))
                     if every > 0 and step % every == 0]
            if tiers:
                delta = eng.save(step, app_state(), tiers=tiers)
                status["saves"].append({"step": step, "tiers": tiers, "blocking_s": delta})
        _write_json(status_path, status)
        if args.step_sleep:
            time.sleep(args.step_sleep)
        if step % 5 == 0 or step == args.steps:
            log.info("step %d loss %.6f", step, gl)
    if eng is not None:
        eng.close(clean=True)
    status["final_state_sha256"] = _state_digest(model, opt)
    status["done"] = True
    _write_json(status_path, status)
    dist.barrier()
    dist.destroy_process_group()
    return 0


# =============================================================================================
# launcher
# =============================================================================================
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_JOBS: list["Job"] = []


class Job:
    """The rank processes of one job attempt (one rank per simulated node)."""

    def __init__(self, name: str, args, mode: str, restart_count: int):
        _JOBS.append(self)
        self.name = name
        self.status_dir = os.path.join(args.out, "status", name)
        os.makedirs(self.status_dir, exist_ok=True)
        os.makedirs(os.path.join(args.out, "logs"), exist_ok=True)
        port = free_port()
        self.procs: list[subprocess.Popen] = []
        self.logs: list[str] = []
        for rank in range(args.nodes):
            env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                       WORLD_SIZE=str(args.nodes), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                       TIERCKPT_NODE_ID=str(rank), TIERCKPT_RESTART_COUNT=str(restart_count),
                       OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore")
            log_path = os.path.join(args.out, "logs", f"{name}-rank{rank}.log")
            self.logs.append(log_path)
            cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--mode", mode,
                   "--out", args.out, "--status-dir", self.status_dir, "--steps", str(args.steps),
                   "--local-every", str(args.local_every), "--persistent-every", str(args.persistent_every),
                   "--step-sleep", str(args.step_sleep)]
            with open(log_path, "w") as logf:
                self.procs.append(subprocess.Popen(cmd, env=env, stdout=logf, stderr=subprocess.STDOUT,
                                                   cwd=REPO))

    def status(self, rank: int) -> dict | None:
        try:
            with open(os.path.join(self.status_dir, f"rank{rank}.json")) as f:
                return json.load(f)
        except (OSError, ValueError):
            return None

    def wait(self, timeout: float) -> list[int]:
        deadline = time.time() + timeout
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                self.kill_all()
                raise RuntimeError(f"{self.name}: ranks did not finish within {timeout:.0f}s; logs: {self.logs}")
        return [p.returncode for p in self.procs]

    def kill(self, rank: int) -> None:
        p = self.procs[rank]
        if p.poll() is None:
            os.kill(p.pid, signal.SIGKILL)

    def kill_all(self) -> None:
        for r in range(len(self.procs)):
            self.kill(r)
        for p in self.procs:
            p.wait()

    def failed(self, rcs: list[int]) -> str:
        out = []
        for r, rc in enumerate(rcs):
            if rc != 0:
                with open(self.logs[r]) as f:
                    tail = f.read()[-3000:]
                out.append(f"--- {self.name} rank {r} exited {rc}; last lines of {self.logs[r]}:\n{tail}")
        return "\n".join(out)


def launcher(args) -> int:
    from rich.console import Console
    from rich.table import Table

    con = Console()
    out = args.out
    ours = {"logs", "status", "nvme", "pfs", "report.json", "report.json.tmp"}
    if os.path.isdir(out) and set(os.listdir(out)) - ours:
        con.print(f"[red]refusing to clear {out}: it holds files this demo did not write "
                  f"({sorted(set(os.listdir(out)) - ours)[:5]}); pick another --out[/]")
        return 2
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    t_begin = time.time()
    local_root = lambda n: os.path.join(out, "nvme", f"node-{n}")  # noqa: E731
    victim = args.victim
    con.print(f"[bold]tierckpt demo[/]: {args.nodes} simulated nodes × 1 rank (gloo), FSDP2 byte-level LM, "
              f"{args.steps} steps; local tier every {args.local_every} (F=2), persistent every "
              f"{args.persistent_every}; kill node {victim} at step {args.kill_step}")

    # 1. reference ---------------------------------------------------------------------------
    con.print("[cyan]1/3[/] reference run (no checkpointing, no failure) …")
    ref = Job("reference", args, "reference", 0)
    rcs = ref.wait(args.timeout)
    if any(rcs):
        con.print(ref.failed(rcs))
        return 2
    ref_status = [ref.status(r) for r in range(args.nodes)]

    # 2. attempt 1: train, then lose node `victim` ----------------------------------------------
    con.print("[cyan]2/3[/] training with tiered checkpoints; waiting for the failure point …")
    job = Job("attempt-1", args, "train", 0)
    last_local = (args.kill_step // args.local_every) * args.local_every
    need = os.path.join(local_root((victim + 1) % args.nodes), "replicas", f"node-{victim}",
                        f"step-{last_local}", "tierckpt.committed")
    deadline = time.time() + args.timeout
    killed_at = None
    while time.time() < deadline:
        st = job.status(victim)
        if any(p.poll() is not None for p in job.procs):
            rcs = [p.poll() for p in job.procs]
            job.kill_all()
            con.print(f"[red]a rank ended before the failure point (exit codes {rcs})[/]")
            con.print(job.failed([p.returncode for p in job.procs]))
            return 2
        if st and st["step"] >= args.kill_step and (last_local == 0 or os.path.exists(need)):
            t_kill = time.time()
            job.kill(victim)
            job.procs[victim].wait()
            killed_at = job.status(victim)["step"]
            shutil.rmtree(local_root(victim))  # the node's disk is gone with it
            job.kill_all()  # the job loses its process group: the survivor goes down too
            break
        time.sleep(0.01)
    else:
        job.kill_all()
        con.print(f"[red]timed out waiting for node {victim} to reach step {args.kill_step}[/]")
        return 2
    attempt1 = [job.status(r) for r in range(args.nodes)]
    con.print(f"    [red]SIGKILL node {victim}[/] at step {killed_at}, wiped {local_root(victim)}, "
              "killed the survivor; restarting the job …")

    # 3. attempt 2: restart, restore, finish -------------------------------------------------
    con.print("[cyan]3/3[/] restart: restore and train to the end …")
    job2 = Job("attempt-2", args, "train", 1)
    rcs = job2.wait(args.timeout)
    if any(rcs):
        con.print(job2.failed(rcs))
        return 2
    attempt2 = [job2.status(r) for r in range(args.nodes)]

    # report ---------------------------------------------------------------------------------
    from tierckpt.ledger import Ledger
    from tierckpt.storage import Store

    ledger = Ledger.read(Store(os.path.join(out, "pfs")))
    saves = [{"tier": r["tier"], "step": r["step"], "blocking_s": r["blocking_s"],
              "background_s": r["background_s"], "bytes": r["bytes"], "ok": r.get("ok", True),
              "run_id": r.get("run_id")}
             for r in ledger if r["kind"] == "checkpoint"]
    restore = attempt2[0]["restore"]
    if restore is None:
        con.print("[red]attempt 2 did not restore anything[/]")
        return 1
    rstep = restore["step"]
    ref_losses = {int(k): v for k, v in ref_status[0]["losses"].items()}
    resumed = {int(k): v for k, v in attempt2[0]["losses"].items()}
    before = {int(k): v for k, v in attempt1[0]["losses"].items()}
    after_steps = sorted(resumed)
    bitwise_equal = (after_steps == list(range(rstep + 1, args.steps + 1))
                     and all(resumed[s] == ref_losses[s] for s in after_steps))
    before_equal = all(before[s] == ref_losses[s] for s in before)
    final_equal = all(attempt2[r]["final_state_sha256"] == ref_status[r]["final_state_sha256"]
                      for r in range(args.nodes))
    sources = {n: v["source"] for n, v in restore["sources"].items()}
    pbytes = int(restore["persistent_bytes_read"])
    recovery = min(s["first_step_time"] for s in attempt2) - t_kill
    report = {
        "bitwise_equal": bitwise_equal,
        "restore_source": sources,
        "persistent_bytes_read_on_restore": pbytes,
        "recovery_seconds": round(recovery, 3),
        "saves": saves,
        "restored_step": rstep,
        "killed_node": victim,
        "killed_at_step": killed_at,
        "restore": restore,
        "restore_seconds": restore["seconds"],
        "losses_compared": len(after_steps),
        "losses_before_failure_equal_reference": before_equal,
        "final_state_bitwise_equal": final_equal,
        "losses": {"reference": ref_losses, "before_failure": before, "after_resume": resumed},
        "config": {"nodes": args.nodes, "ranks_per_node": 1, "steps": args.steps,
                   "local_every": args.local_every, "persistent_every": args.persistent_every,
                   "kill_step": args.kill_step, "replication_factor": 2, "replication_jump": 1,
                   "local_root": os.path.join(out, "nvme", "node-{node}"),
                   "persistent_root": os.path.join(out, "pfs"),
                   "model": {"vocab": VOCAB, "dim": DIM, "layers": LAYERS, "heads": HEADS,
                             "seq": SEQ, "batch_per_rank": BATCH},
                   "corpus": [f"python stdlib: {m}" for m in CORPUS_MODULES]},
        "wall_seconds": round(time.time() - t_begin, 1),
    }
    _write_json(os.path.join(out, "report.json"), report)

    ok = bitwise_equal and sources.get(str(victim)) == "peer-replica" and pbytes == 0
    t = Table(title="tierckpt demo", show_header=False)
    t.add_row("failure", f"node {victim} SIGKILLed at step {killed_at}, its local root deleted, job restarted")
    t.add_row("restored step", str(rstep))
    t.add_row("restore source", ", ".join(f"node {n}: {s}" for n, s in sorted(sources.items())))
    t.add_row("persistent bytes read", str(pbytes))
    t.add_row("recovery (kill → first step)", f"{recovery:.2f} s (restore itself {restore['seconds']:.2f} s)")
    t.add_row("losses after resume", f"{len(after_steps)} steps, bitwise equal to reference: "
              + ("[green]yes[/]" if bitwise_equal else "[red]NO[/]"))
    show = [s for s in (rstep + 1, rstep + 2, args.steps) if s in resumed]
    t.add_row("loss: resumed / reference", "\n".join(
        f"step {s}: {resumed[s]!r} / {ref_losses[s]!r}" for s in show))
    t.add_row("final model+optimizer state", "bitwise equal to reference" if final_equal else "[red]differs[/]")
    con.print(t)
    st = Table(title="checkpoints (ledger)")
    for c in ("tier", "step", "blocking δ (ms)", "background (ms)", "bytes", "ok"):
        st.add_column(c, justify="right" if c not in ("tier",) else "left")
    for s in saves:
        st.add_row(s["tier"], str(s["step"]), f"{1000 * s['blocking_s']:.1f}", f"{1000 * s['background_s']:.0f}",
                   f"{s['bytes']:,}", "yes" if s["ok"] else "[red]no[/]")
    con.print(st)
    con.print(f"report: {os.path.relpath(os.path.join(out, 'report.json'), os.getcwd())}   "
              f"(inspect: tierckpt ls {os.path.relpath(out, os.getcwd())}; "
              f"tierckpt ledger {os.path.relpath(os.path.join(out, 'pfs'), os.getcwd())})")
    con.print(("[bold green]PASS[/]" if ok else "[bold red]FAIL[/]") + f" in {time.time() - t_begin:.1f} s")
    return 0 if ok else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=DEFAULT_OUT, help="output directory (cleared at start)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--local-every", type=int, default=5)
    p.add_argument("--persistent-every", type=int, default=20)
    p.add_argument("--kill-step", type=int, default=27)
    p.add_argument("--victim", type=int, default=1, help="node to kill")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--step-sleep", type=float, default=0.0, help="extra seconds per step (pacing)")
    p.add_argument("--timeout", type=float, default=300.0, help="per-attempt timeout, seconds")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", choices=("reference", "train"), help=argparse.SUPPRESS)
    p.add_argument("--status-dir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.out = os.path.abspath(args.out)
    if args.worker:
        return worker(args)
    if not (0 < args.kill_step < args.steps) or args.local_every <= 0 or args.kill_step < args.local_every:
        p.error("need 0 < --local-every <= --kill-step < --steps")
    if not 0 <= args.victim < args.nodes:
        p.error("--victim must be a node id")
    try:
        return launcher(args)
    finally:  # never leave rank processes behind (Ctrl-C, errors)
        for job in _JOBS:
            job.kill_all()


if __name__ == "__main__":
    sys.exit(main())
