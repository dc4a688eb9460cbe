"""lm-resiliency 0.2.0 part of ``bench/bench_peers.py``; runs in the side venv ``.venv-peers``.

lm-resiliency's torchrun rendezvous entry point does not work here, so this module drives its
Python API (``lm_resiliency.checkpointing.InMemoryCheckpointManager``) from its own 2 spawned
gloo ranks (2 simulated nodes, ``replication_jump=1``: rank 0 and rank 1 are peers). It needs
only torch, numpy and lm-resiliency; tierckpt is not installed in that venv.

CPU adaptation: ``pin_memory=False`` (its buffer pool pins only when CUDA is available anyway);
its device copier takes its own CPU branch (``dst.copy_(src)``). Nothing is patched.

Measured per rank, results written as JSON to ``--out`` (slower rank of every sample):
- capture: ``save(sd, step)`` + ``maybe_wait()`` (its host copy; the time the trainer is held),
  each paired with one ``dst.copy_(src)`` memcpy of the same state (ABBA: memcpy first on even
  repetitions, capture first on odd ones); ``finalize_replication()`` (peer exchange done) is
  timed apart and not part of the capture;
- RAM recovery, processes alive: ``load(mode="latest")`` from its in-memory slots;
- disk restart path after losing node 1 and its disk: ``flush_for_restart()`` on both ranks
  (what its SIGTERM handler writes: own + peer slots; untimed, reported), managers closed,
  node 1's disk folder deleted, page cache of every file dropped; timed from a barrier until
  both ranks hold the state: both ranks build a new manager with the same ``run_id``, and node
  0 moves node 1's shard with lm-resiliency's own transport (``TorchDistTransfer``, gloo) while
  it loads its own (:func:`restart_after_loss`);
- host RSS growth over ``--rss-saves`` captures (each followed by ``finalize_replication()``).
``--phases`` runs a subset (``capture,ram,rss,disk``): bench_peers.py runs ``--phases disk
--restore-reps 1`` once per repetition of its restore ABBA order (the disk restart path and
tierckpt's restore in the same minutes), and the rest once, apart.
Every restore is checked bitwise against the saved state.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

from peers_common import (abba, assert_bitwise, drop_page_cache, gmax, make_state, mutate, rss_bytes,  # noqa: E402
                          snapshot, state_bytes)

RUN_ID = "tierckpt-bench-peers"
PHASES = ("capture", "ram", "rss", "disk")


def restart_after_loss(rank: int, node0_dir: str, topo: str, transfer, targets: list | None) -> tuple[dict, int]:
    """Both ranks' state after node 1 and its disk are lost, by lm-resiliency's own parts.

    Its manager's ``load`` cannot serve this case: it is collective and takes the MIN step over
    the ranks' disks, and node 1's disk is empty. lm-resiliency's answer is its shard transport,
    ``TorchDistTransfer`` (gloo send/recv of the flat tensor list on a dedicated pair group,
    64 MiB chunks, CRC-32 computed before sending and checked on arrival, the caller coordinating
    both endpoints), whose result "plugs straight into" ``unflatten``. This is that coordination:

    - node 0 reads the newest step that holds both shards from its flushed folder
      (``DiskSerializer.load(step, rank=1)``: the replica its ``flush_for_restart`` wrote), sends
      the step and the shard's ``FlatStateDictMetadata`` to node 1 (one ``send_object_list``),
      then calls ``serve`` with the tensors while a thread loads its own shard
      (``DiskSerializer.load(step)``; measured faster, unrecorded, than loading it after serving,
      0.40–0.45 vs 0.45–0.52 s at 256 MiB per rank);
    - node 1 calls ``fetch`` into ``targets`` (its model's tensors, allocated before the restore
      as tierckpt's restore targets are; ``fetch`` checks them against the sent manifest), then
      ``unflatten``.

    Nothing reaches node 1's disk (its next ``flush_for_restart`` writes it). Integrity as the
    manager's default config (``verify_integrity=False``): the disk loads skip the CRC; the
    transport's is always on. The newest flushed step is taken, as ``load(mode="latest")`` would;
    lm-resiliency's documented policy after losing a machine is ``RECOVERY_VERIFIED``, which
    without its SCOUT certification has no step (the durable checkpoint then; not measured).
    Its step agreement is skipped: with 2 ranks node 0's choice is that answer.

    Args:
        transfer: ``make_transfer("torch_dist", rank=rank)`` (the caller closes it, untimed).
        targets: node 1's flat tensor list in the state's order (``flatten``); None on node 0.

    Returns:
        (this rank's state dict, the step restored).
    Raises:
        RuntimeError: node 0's folder holds no step with both shards.
    """
    import socket
    import threading

    import torch.distributed as dist
    from lm_resiliency.checkpointing.disk import DiskSerializer
    from lm_resiliency.checkpointing.state_dict import unflatten

    host = socket.gethostname()
    if rank == 0:
        disk = DiskSerializer(node0_dir, rank=0, run_id=RUN_ID, topology_id=topo, namespace=True)
        steps = [s for s in disk.find_steps_on_disk(rank=1) if disk.has_rank(s, 0)]
        if not steps:
            dist.send_object_list([None, None], dst=1)
            raise RuntimeError(f"lm-resiliency: no step with both shards under {node0_dir}")
        step = steps[0]
        meta1, tensors1 = disk.load(step, rank=1)
        dist.send_object_list([step, meta1], dst=1)
        own: dict = {}

        def load_own():
            try:
                own["loaded"] = disk.load(step)
            except BaseException as e:  # re-raised below, on the rank's own thread
                own["error"] = e

        worker = threading.Thread(target=load_own)
        worker.start()
        try:
            transfer.serve(tensors1, f"{RUN_ID}/step-{step}/rank-1", peer_rank=1, peer_host=host)
        finally:
            worker.join()
        del tensors1
        if "error" in own:
            raise own["error"]
        return unflatten(*own["loaded"]), step
    msg: list = [None, None]
    dist.recv_object_list(msg, src=0)
    step, meta1 = msg
    if step is None:
        raise RuntimeError("lm-resiliency: node 0 holds no replica to serve")
    transfer.fetch(targets, f"{RUN_ID}/step-{step}/rank-1", peer_rank=0, peer_host=host)
    return unflatten(meta1, targets), step


def lmr_rank(rank: int, world: int, args: dict) -> dict:
    """One rank of the lm-resiliency measurement (see the module docstring)."""
    import torch
    import torch.distributed as dist
    from lm_resiliency.checkpointing import InMemoryCheckpointManager, InMemoryCkptConfig
    from lm_resiliency.checkpointing.state_dict import flatten
    from lm_resiliency.manager_api import make_transfer

    base = os.path.join(args["base"], "lmr")

    def node_dir(r: int) -> str:
        return os.path.join(base, f"node-{r}")

    def manager():
        return InMemoryCheckpointManager(InMemoryCkptConfig(
            enable=True, interval=1, replication_jump=1, disk_flush_interval=0,
            disk_folder=node_dir(rank), run_id=RUN_ID, pin_memory=False))

    sd = make_state(rank, args["mib"])
    dst = {k: torch.empty_like(v) for k, v in sd.items()}
    out: dict = {"state_bytes": state_bytes(sd), "n_tensors": len(sd)}

    def memcpy() -> float:
        dist.barrier()
        t0 = time.perf_counter()
        for k, v in sd.items():
            dst[k].copy_(v)
        return gmax(time.perf_counter() - t0)

    step = 1
    mgr = manager()

    def capture() -> tuple[float, float]:
        nonlocal step
        mutate(sd, step)
        dist.barrier()
        t0 = time.perf_counter()
        mgr.save(sd, step)
        mgr.maybe_wait()
        d = time.perf_counter() - t0
        t1 = time.perf_counter()
        ok = mgr.finalize_replication()
        r = time.perf_counter() - t1
        if not ok:
            raise RuntimeError(f"lm-resiliency: replication of step {step} did not complete")
        step += 1
        return gmax(d), gmax(r)

    phases = set(args["phases"])
    memcpy()
    for _ in range(args["warmup"]):
        capture()
    caps, reps, mems = [], [], []
    for order in abba(["memcpy", "capture"], args["saves"] if "capture" in phases else 0):
        for what in order:
            if what == "memcpy":
                mems.append(memcpy())
            else:
                d, r = capture()
                caps.append(d)
                reps.append(r)
    out.update(capture_s=caps, replication_s=reps, memcpy_s=mems)
    if rank == 0 and caps:
        print(f"[peers-lmr] {args['mib']:g} MiB: capture {[round(x, 3) for x in caps]} s, "
              f"memcpy {[round(x, 3) for x in mems]} s", flush=True)

    # RAM recovery with processes alive (its in-memory slots)
    ram = []
    for _ in range(args["restore_reps"] if "ram" in phases else 0):
        capture()
        expected = snapshot(sd)
        saved_step = step - 1
        mutate(sd, step + 1000)  # training went on after the save
        dist.barrier()
        t0 = time.perf_counter()
        res = mgr.load(mode="latest")
        dt = time.perf_counter() - t0
        if res is None or res[1] != saved_step:
            raise RuntimeError(f"lm-resiliency RAM load returned {None if res is None else res[1]}, "
                               f"expected step {saved_step}")
        assert_bitwise(expected, res[0], f"lm-resiliency RAM recovery (rank {rank})")
        ram.append(gmax(dt))
        sd.update({k: v.clone() for k, v in expected.items()})
    out["ram_restore_s"] = ram

    # host RSS growth over rss_saves captures
    if "rss" in phases:
        rss0 = rss_bytes()
        for _ in range(args["rss_saves"]):
            capture()
        out["rss_growth_bytes"] = gmax(float(rss_bytes() - rss0))

    # disk restart path after losing node 1 and its disk
    disk, flush = [], []
    for _ in range(args["restore_reps"] if "disk" in phases else 0):
        capture()
        capture()  # own_previous/peer_previous hold a step too, as in training
        expected = snapshot(sd)
        saved_step = step - 1
        dist.barrier()
        t0 = time.perf_counter()
        mgr.flush_for_restart()
        flush.append(gmax(time.perf_counter() - t0))
        topo = mgr.topology_id
        mgr.close()
        del mgr
        dist.barrier()
        if rank == 1:
            shutil.rmtree(node_dir(1), ignore_errors=True)
        dist.barrier()
        if rank == 0:
            drop_page_cache(base)
        # node 1's model tensors exist (and are touched) before the restore, as tierckpt's targets
        targets = flatten({k: torch.zeros_like(v) for k, v in expected.items()})[1] if rank == 1 else None
        dist.barrier()
        t0 = time.perf_counter()
        mgr = manager()
        transfer = make_transfer("torch_dist", rank=rank)
        got, got_step = restart_after_loss(rank, node_dir(0), topo, transfer, targets)
        dt = time.perf_counter() - t0
        transfer.close()
        if got_step != saved_step:
            raise RuntimeError(f"lm-resiliency disk restart returned step {got_step}, expected {saved_step}")
        assert_bitwise(expected, got, f"lm-resiliency disk restart path (rank {rank})")
        disk.append(gmax(dt))
        del got, targets
        # next repetition starts from empty node-local folders (untimed)
        dist.barrier()
        shutil.rmtree(node_dir(rank), ignore_errors=True)
        dist.barrier()
    out.update(disk_restore_s=disk, flush_s=flush)
    if rank == 0 and (ram or disk):
        print(f"[peers-lmr] RAM recovery {[round(x, 3) for x in ram]} s, disk restart path "
              f"{[round(x, 3) for x in disk]} s (bitwise equal)", flush=True)
    mgr.close()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="lm-resiliency part of bench_peers (side venv)")
    ap.add_argument("--mib", type=float, required=True)
    ap.add_argument("--saves", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--restore-reps", type=int, default=3)
    ap.add_argument("--rss-saves", type=int, default=50)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--phases", default=",".join(PHASES),
                    help=f"comma-separated subset of {','.join(PHASES)} (default: all)")
    ap.add_argument("--dir", required=True, help="parent directory for the node-local folders")
    ap.add_argument("--out", required=True, help="JSON result file")
    ap.add_argument("--timeout", type=float, default=1500)
    a = ap.parse_args(argv)
    phases = [x for x in a.phases.split(",") if x]
    if not phases or not set(phases) <= set(PHASES):
        ap.error(f"--phases {a.phases!r}: allowed phases are {','.join(PHASES)}")
    from bench_engine import run_ranks

    args = dict(mib=a.mib, saves=a.saves, warmup=a.warmup, restore_reps=a.restore_reps,
                rss_saves=a.rss_saves, threads=a.threads, base=a.dir, phases=phases)
    try:
        r0, _r1 = run_ranks(args, timeout=a.timeout, target=lmr_rank)
    finally:
        shutil.rmtree(os.path.join(a.dir, "lmr"), ignore_errors=True)
    import torch
    from importlib.metadata import version

    r0["versions"] = {"python": sys.version.split()[0], "torch": torch.__version__,
                      "lm-resiliency": version("lm-resiliency")}
    with open(a.out, "w") as f:
        json.dump(r0, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
