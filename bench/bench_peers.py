"""Peer benchmark: tierckpt against the checkpointing systems users would pick instead.

Two gloo ranks act as two nodes; every system saves the same state per rank (324 tensors: 4
large fp32 tensors holding 3/4 of the bytes, 280 small fp32 ones, 40 int64 scalars; keys
rank-unique) at each size of ``--mib-per-rank`` (default 256 and 1024 MiB).

Systems (main venv unless said otherwise):
- **tierckpt**: ``TieredCheckpointer``, local tier + replication_factor 2 on a node-local dir per
  rank; the persistent tier is off (``tiers=("local",)``; the persistent root holds the ledger
  only). With ``--local-root-base /dev/shm`` a second column puts the local tier in RAM.
- **tierckpt (overlapped)**: the same with ``cpu_staging = "overlapped"``: the large tensors
  are copied by a background thread after ``save()`` returns. The trainer's side is modelled:
  after ``save()`` the rank sleeps ``--overlap-window-ms`` (forward and backward running on an
  accelerator, the host thread idle; default 250 ms), then calls ``wait_for_staging()`` as an
  optimizer step would. Its δ is ``save()`` plus that wait: the time the training thread is
  held, not the time until the copy is complete. ``--overlap-window-ms 0`` is the worst case
  (nothing to overlap with).
- **tierckpt (trainer priority)**: tierckpt with ``background_nice = 0`` and
  ``background_io_class = "none"``: its background threads at the trainer's CPU and I/O priority
  (the default lowers them, :mod:`tierckpt.priority`). Shows in row 4 what the priority buys.
- **DCP sync**: ``dcp.save``.
- **DCP async (thread)**: ``dcp.async_save`` with the thread executor (torchtitan's "async").
- **DCP process+async staging**: ``dcp.async_save`` with the process executor and a persistent
  ``DefaultStager``. CPU adaptation: torchtitan's ``async_with_pinned_mem`` fails on CPU, so the
  stager uses shared memory and async staging without pinned memory and with
  ``use_non_blocking_copy=False``. The state may not change before ``staging_completion``:
  like torchtitan (``maybe_wait_for_staging()`` before ``optimizers.step()``) the rank waits
  for it after the same modelled forward/backward as tierckpt (overlapped); its δ is
  ``async_save()`` plus that wait.
- **NVRx local** (nvidia-resiliency-ext 0.4.1): ``LocalCheckpointManager`` +
  ``CliqueReplicationStrategy`` (J=1, F=2), synchronous saves only (``is_async=False``; its
  whole save blocks). CPU adaptations, patched in the rank processes only: the ``is_cuda``
  assertion of ``BasicTensorAwareStateDict`` is dropped and its CPU copy made a real copy
  (``.to("cpu")`` of a CPU tensor aliases the live tensor), and its ``restore_tensor_device``
  (``.to("cuda")`` after a load) is a no-op; the per-tensor ``.cuda()`` staging
  in ``GroupWrapper.isend_state_dict``/``irecv_state_dict`` is removed; ``torch.cuda.synchronize``
  is a no-op.
- **lm-resiliency 0.2.0**, in the side venv ``.venv-peers`` (``bench/peers_lmr.py``, its own
  spawned gloo ranks and its own memcpy). CPU adaptation: ``pin_memory=False``.

Measured (each sample is the slower rank's; medians over repetitions; systems in ABBA order
across repetitions):
1. blocking time δ ÷ one memcpy (``dst.copy_(src)`` into preallocated tensors) of the same state,
   a memcpy sample taken before each save. The cross-run ratio against lm-resiliency compares
   memcpy-normalised values: (δ_tierckpt / memcpy_main) / (capture_lmr / memcpy_side).
2. restore after losing node 1 and its disk, each repetition in fresh processes and a fresh
   directory (a restart is a fresh process; nothing else holds memory or the disk meanwhile;
   ``run_restores``): the system saves the state once (completed, replicated), rank 1's
   node-local dir is deleted and the page cache of every file dropped (fsync +
   ``POSIX_FADV_DONTNEED``); timed from a barrier until both ranks hold the state (new
   manager/engine included, process start-up excluded). Repetitions in ABBA order over
   tierckpt, NVRx and lm-resiliency's disk restart path (``peers_lmr.py --phases disk`` in
   the side venv): the same run, no normalisation. Against lm-resiliency's RAM path (side
   run, processes alive) memcpy-normalised as in 1. A baseline, the *disk floor*
   (``disk_floor``), is one more "system" in the same ABBA order: tierckpt saves as for its
   restore, the page cache is dropped, and node 0 reads its own copy and node 1's replica —
   the bytes every system must read from that disk — and nothing else; each restore is also
   printed ÷ that floor. Every floor and every restore is the first read of files just
   written (on this VM a second read of a file comes faster than its first, the host caching
   below the guest; read right after a restore and its background writes instead, the floor
   took 1.28× that restore's time at 1 GiB, though the guest had synced). tierckpt
   restores in place into preallocated tensors. NVRx, and lm-resiliency's node 0, return new
   tensors (their copy into a model is not timed); lm-resiliency's node 1 fetches into
   preallocated tensors (its transport receives into its own buffers and copies into them,
   timed).
3. host RSS growth (self + child processes, ``VmRSS``) from after ``--warmup`` more saves to
   after ``--rss-saves`` more saves, each waited to completion. NVRx is left out (its
   synchronous saves are too slow for 50).
4. the training time one save costs a CPU-bound trainer (:mod:`peers_stepcost`: steps of
   ``--overlap-window-ms`` of matmuls + the wait for staging + an in-place update of the whole
   state; run time minus as many undisturbed steps, the save's background work included), for
   tierckpt (both modes, and at the trainer's priority) and DCP process+async staging, ÷ memcpy and
   ÷ DCP process+async staging's cost (the target: ≤ 1.0 with the replica and checksums on).
Every restore is compared bitwise with the saved state (``AssertionError`` otherwise).

Targets (PASS/MISS printed, never an exit status): δ ≤ 1.05× memcpy and ≤ 0.95× lm-resiliency's
capture; restore ≤ 0.8× NVRx and ≤ 0.8× lm-resiliency's disk path.

Usage::

    .venv/bin/python bench/bench_peers.py [--mib-per-rank 256 1024] [--local-root-base /dev/shm]
        [--saves 10] [--restore-reps 5] [--rss-saves 50] [--peers-python .venv-peers/bin/python]
        [--cpu-steps 8] [--cpu-reps 6] [--skip-lmr] [--record]

``--record`` appends machine, command, load average, memory state (free, page cache), method and
tables to bench/history/<YYYY-MM>.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

from bench_engine import REPO, RESULTS_MD, disk, machine, md_table, meminfo_kb, run_ranks  # noqa: E402
from peers_stepcost import step_cost  # noqa: E402
from peers_common import (abba, assert_bitwise, drop_page_cache, gmax, make_state, med, mutate,  # noqa: E402
                          rss_bytes, snapshot, state_bytes)

MiB = 1 << 20
PEERS_PY = os.path.join(REPO, ".venv-peers", "bin", "python")
TARGETS = {"delta_memcpy": 1.05, "delta_lmr": 0.95, "restore_nvrx": 0.8, "restore_lmr_disk": 0.8,
           "save_cost_dcp_process": 1.0}
LMR_DISK = "lm-resiliency disk path (side venv)"
FLOOR = "disk floor"
RAM_TIER = "tierckpt (RAM local root)"
OVERLAP = "tierckpt (overlapped)"
PRIO0 = "tierckpt (trainer priority)"
ADAPTATIONS = [
    "tierckpt: persistent tier off (tiers=('local',), replication_factor=2)",
    "DCP process+async staging: DefaultStager(use_pinned_memory=False, use_shared_memory=True, "
    "use_async_staging=True, use_non_blocking_copy=False) instead of torchtitan's async_with_pinned_mem "
    "(fails on CPU); staging_completion waited after the modelled forward/backward (--overlap-window-ms), "
    "as torchtitan waits before optimizers.step()",
    "NVRx local: is_cuda assertion dropped, CPU copy made a real copy and restore_tensor_device "
    "(.to('cuda') after a load) a no-op (BasicTensorAwareStateDict); "
    ".cuda() staging removed from GroupWrapper.isend/irecv_state_dict; torch.cuda.synchronize no-op; "
    "sync saves only (δ = the whole save)",
    "lm-resiliency: pin_memory=False; driven from its Python API on spawned gloo ranks (its torchrun "
    "entry point is broken); disk path: its manager's load is collective and node 1's disk is empty, so node 0 "
    "serves its flushed rank-1.pt with its TorchDistTransfer (gloo) while loading its own shard, node 1 "
    "fetches into its preallocated tensors and unflattens (peers_lmr.restart_after_loss; the newest flushed "
    "step, as load(mode='latest'), where its documented policy after losing a machine is RECOVERY_VERIFIED)",
]


# ---------------------------------------------------------------------------------------------
# NVRx CPU patches (in the rank process only)
def patch_nvrx_for_cpu() -> None:
    """Let NVRx 0.4.1's local checkpointing run on CPU tensors (see the module docstring)."""
    import torch
    import torch.distributed as dist
    from nvidia_resiliency_ext.checkpointing.local import basic_state_dict as bsd
    from nvidia_resiliency_ext.checkpointing.local.replication import group_utils as gu

    if getattr(bsd.BasicTensorAwareStateDict, "_tierckpt_cpu", False):
        return

    def init(self, state_dict):
        self.state_dict = state_dict
        self._is_hollow = False

    def copy_tensors_to_cpu(self, non_blocking=False):
        # on a GPU this is a device-to-host copy; .to("cpu") of a CPU tensor would alias the
        # live tensor, so the CPU stand-in must clone to keep the semantics of a copy
        bsd.dict_list_map_inplace(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, self.state_dict)

    def isend_state_dict(self, state_dict, dst):
        tensor_data = state_dict.pop_tensors()
        log_data = {"data_sent": sum(t.nbytes for t in tensor_data)}
        self.send_object(state_dict, dst)
        for t in tensor_data:
            dist.send(t, dst, group=self.group)
        state_dict.insert_tensors(tensor_data)
        return log_data

    def irecv_state_dict(self, src):
        hollow = self.recv_object(src)
        hollow.init_tensors()
        for t in hollow.tensors:
            dist.recv(t, src, group=self.group)
        return hollow, {"data_recv": sum(t.nbytes for t in hollow.tensors)}

    bsd.BasicTensorAwareStateDict.__init__ = init
    bsd.BasicTensorAwareStateDict.copy_tensors_to_cpu = copy_tensors_to_cpu
    # a load moves tensors back "to cuda"; on CPU they stay where torch.load put them
    bsd.BasicTensorAwareStateDict.restore_tensor_device = lambda self, non_blocking=True: None
    bsd.BasicTensorAwareStateDict._tierckpt_cpu = True
    gu.GroupWrapper.isend_state_dict = isend_state_dict
    gu.GroupWrapper.irecv_state_dict = irecv_state_dict
    torch.cuda.synchronize = lambda device=None: None


# ---------------------------------------------------------------------------------------------
# systems (rank side). capture() returns the local blocking seconds; complete() finishes the
# background work (untimed); restore_after_loss() returns the local restore seconds.
class Tier:
    """tierckpt, local tier + replica on the other node."""

    def __init__(self, rank, base, label, local_base=None, window_s=None, **overrides):
        from tierckpt.config import TierConfig
        from tierckpt.engine import TieredCheckpointer

        self.rank, self.label, self.window_s = rank, label, window_s
        self.dir = os.path.join(local_base or base, label)
        self.cfg = TierConfig(local_root=os.path.join(self.dir, "node-{node}"),
                              persistent_root=os.path.join(base, label + "-ledger"),
                              tiers=("local",), replication_factor=2, job_id="bench-peers",
                              cpu_staging="blocking" if window_s is None else "overlapped", **overrides)
        self._cls = TieredCheckpointer
        self.eng = TieredCheckpointer(self.cfg, node_id=rank)
        self.handle = None

    def begin(self, sd, step):
        """The save call."""
        self.handle = self.eng.save(step, sd, tiers=["local"])

    def before_update(self):
        """The optimizer step's wait (a no-op when staging is blocking)."""
        self.eng.wait_for_staging()

    def busy(self) -> bool:
        """The last save's background work (write, replica) still runs here."""
        return self.handle is not None and not self.handle.done()

    def capture(self, sd, step):
        t0 = time.perf_counter()
        self.begin(sd, step)
        d = time.perf_counter() - t0
        if self.window_s is not None:  # overlapped: forward/backward, then the optimizer step's wait
            time.sleep(self.window_s)
            t1 = time.perf_counter()
            self.before_update()
            d += time.perf_counter() - t1
        return d

    def complete(self):
        self.eng.wait(bounded=False)

    def restore_after_loss(self, expected, barrier, step):
        import torch

        self.eng.close()
        barrier()
        if self.rank == 1:
            shutil.rmtree(os.path.join(self.dir, "node-1"))
        barrier()
        if self.rank == 0:
            drop_page_cache(self.dir)
        target = {k: torch.zeros_like(v) for k, v in expected.items()}
        barrier()
        t0 = time.perf_counter()
        self.eng = self._cls(self.cfg, node_id=self.rank)
        res = self.eng.restore(target)
        dt = time.perf_counter() - t0
        if res is None or res.step != step:
            raise RuntimeError(f"{self.label}: restored step {None if res is None else res.step}, expected {step}")
        assert_bitwise(expected, target, f"{self.label} (rank {self.rank})")
        self.eng.wait(bounded=False)  # the replica rebuild, before the next measurement
        return dt

    def close(self):
        self.eng.close()


class Dcp:
    """torch.distributed.checkpoint: sync, thread executor, or process executor + stager."""

    def __init__(self, rank, base, mode, window_s=None):
        self.rank, self.mode, self.window_s = rank, mode, window_s
        self.dir = os.path.join(base, f"dcp-{mode}")
        self.fut = None
        self.staging = None
        self.prev: str | None = None
        self.stager = None
        if mode == "process":
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            self.stager = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=True,
                                                       use_async_staging=True, use_non_blocking_copy=False))

    def begin(self, sd, step):
        """The save call: ``dcp.save`` (sync) or ``dcp.async_save`` (thread, process)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        path = os.path.join(self.dir, f"step-{step}")
        if self.mode == "sync":
            dcp.save(sd, checkpoint_id=path)
        elif self.mode == "thread":
            self.fut = dcp.async_save(sd, checkpoint_id=path)
        else:
            resp = dcp.async_save(sd, checkpoint_id=path, async_checkpointer_type=AsyncCheckpointerType.PROCESS,
                                  async_stager=self.stager)
            self.staging, self.fut = resp.staging_completion, resp.upload_completion
        self.cur = path

    def before_update(self):
        """torchtitan's ``maybe_wait_for_staging()`` before ``optimizers.step()``."""
        if self.staging is not None:
            self.staging.result()
            self.staging = None

    def busy(self) -> bool:
        return self.fut is not None and not self.fut.done()

    def capture(self, sd, step):
        t0 = time.perf_counter()
        self.begin(sd, step)
        held = 0.0  # the modelled forward/backward: not blocking time
        if self.window_s and self.staging is not None:
            w0 = time.perf_counter()
            time.sleep(self.window_s)
            held = time.perf_counter() - w0
        self.before_update()
        return time.perf_counter() - t0 - held

    def complete(self):
        import torch.distributed as dist

        if self.fut is not None:
            self.fut.result()
            self.fut = None
        dist.barrier()
        if self.rank == 0 and self.prev:  # keep one step on disk, as retention would
            shutil.rmtree(self.prev, ignore_errors=True)
        self.prev = self.cur

    def close(self):
        if self.stager is not None:
            self.stager.close()


class Nvrx:
    """NVRx LocalCheckpointManager + CliqueReplicationStrategy (J=1, F=2), sync saves."""

    def __init__(self, rank, base):
        patch_nvrx_for_cpu()
        self.rank = rank
        self.dir = os.path.join(base, "nvrx")
        self.mgr = self._manager()

    def _manager(self):
        from nvidia_resiliency_ext.checkpointing.local.ckpt_managers.local_manager import LocalCheckpointManager
        from nvidia_resiliency_ext.checkpointing.local.replication.strategies import CliqueReplicationStrategy

        strat = CliqueReplicationStrategy.from_replication_params(replication_jump=1, replication_factor=2)
        return LocalCheckpointManager(os.path.join(self.dir, f"node-{self.rank}"), session_id="bench",
                                      repl_strategy=strat)

    def capture(self, sd, step):
        from nvidia_resiliency_ext.checkpointing.local.basic_state_dict import BasicTensorAwareStateDict

        t0 = time.perf_counter()
        # a shallow copy: replicate() hollows the dict it is given (tensors → placeholders)
        self.mgr.save(BasicTensorAwareStateDict(dict(sd)), step, is_async=False)
        return time.perf_counter() - t0

    def complete(self):
        pass

    def restore_after_loss(self, expected, barrier, step):
        barrier()
        if self.rank == 1:
            shutil.rmtree(os.path.join(self.dir, "node-1"))
        barrier()
        if self.rank == 0:
            drop_page_cache(self.dir)
        barrier()
        t0 = time.perf_counter()
        self.mgr = self._manager()
        it = self.mgr.find_latest()
        tasd, _ckpt_id = self.mgr.load()
        dt = time.perf_counter() - t0
        if it != step:
            raise RuntimeError(f"NVRx: restored iteration {it}, expected {step}")
        assert_bitwise(expected, tasd.state_dict, f"NVRx local (rank {self.rank})")
        return dt

    def close(self):
        pass


def disk_floor(rank: int, tier_dir: str, barrier) -> float:
    """The disk's part of a node-loss restore, as a baseline: node 0 reads, page cache dropped,
    the bytes any system must read from its disk when node 1 and its disk are lost (its own copy of the
    newest step and node 1's replica of it: tierckpt's files under ``tier_dir``, as many bytes
    as every peer's) — both directories at once, each file mapped after a readahead hint and
    touched page by page; node 1 idle. Called on files just written (see :func:`restore_once`).
    Returns seconds on rank 0, 0.0 elsewhere."""
    import threading

    root = os.path.join(tier_dir, "node-0")
    newest = max(int(n.split("-")[1]) for n in os.listdir(os.path.join(root, "local")) if n.startswith("step-"))
    dirs = [os.path.join(root, "local", f"step-{newest}"), os.path.join(root, "replicas", "node-1", f"step-{newest}")]
    barrier()
    if rank == 0:
        drop_page_cache(tier_dir)
    barrier()
    t0 = time.perf_counter()
    errors: list[BaseException] = []

    def read(d: str) -> None:
        try:
            _read_dir(d)
        except BaseException as e:  # re-raised below: a floor that read nothing is no floor
            errors.append(e)

    if rank == 0:
        threads = [threading.Thread(target=read, args=(d,)) for d in dirs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    dt = time.perf_counter() - t0
    barrier()
    if errors:
        raise errors[0]
    return dt if rank == 0 else 0.0


def _read_dir(d: str) -> int:
    """Read every file of ``d`` through a read-only mapping after ``POSIX_FADV_WILLNEED`` (how
    tierckpt's restore reads), one byte per page; returns the bytes read."""
    import mmap

    import numpy as np

    n = 0
    for f in sorted(os.listdir(d)):
        fd = os.open(os.path.join(d, f), os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            if not size:
                continue
            os.posix_fadvise(fd, 0, size, os.POSIX_FADV_WILLNEED)
            with mmap.mmap(fd, size, prot=mmap.PROT_READ) as m:
                view = np.frombuffer(m, dtype=np.uint8)
                int(view[:: mmap.PAGESIZE].sum())
                del view
            n += size
        finally:
            os.close(fd)
    if not n:
        raise RuntimeError(f"disk floor: nothing to read in {d}")
    return n


# ---------------------------------------------------------------------------------------------
def peers_rank(rank: int, world: int, args: dict) -> dict:
    """Rank side of the main-venv measurement; returns the samples (slower rank of each)."""
    import logging
    import warnings

    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    logging.getLogger("nvidia_resiliency_ext").setLevel(logging.ERROR)
    if args.get("restore_one"):
        return restore_once(rank, args)
    base = args["base"]

    def settle():
        os.sync()
        dist.barrier()

    sd = make_state(rank, args["mib"])
    dst = {k: torch.empty_like(v) for k, v in sd.items()}

    def memcpy() -> float:
        dist.barrier()
        t0 = time.perf_counter()
        for k, v in sd.items():
            dst[k].copy_(v)
        return gmax(time.perf_counter() - t0)

    systems: dict = {"tierckpt": Tier(rank, base, "tierckpt"),
                     OVERLAP: Tier(rank, base, "tierckpt-overlapped", window_s=args["overlap_window_ms"] / 1e3),
                     PRIO0: Tier(rank, base, "tierckpt-trainer-priority", background_nice=0,
                                 background_io_class="none")}
    if args["local_root_base"]:
        systems[RAM_TIER] = Tier(rank, base, "tierckpt-ram", local_base=args["local_root_base"])
    systems.update({"DCP sync": Dcp(rank, base, "sync"), "DCP async (thread)": Dcp(rank, base, "thread"),
                    "DCP process+async staging": Dcp(rank, base, "process", window_s=args["overlap_window_ms"] / 1e3),
                    "NVRx local": Nvrx(rank, base)})
    if args["systems"] is not None:  # `--systems` alone: tierckpt only
        systems = {k: v for k, v in systems.items() if k in args["systems"] or k.startswith("tierckpt")}
    out: dict = {"state_bytes": state_bytes(sd), "n_tensors": len(sd), "systems": list(systems),
                 "overlap_window_ms": args["overlap_window_ms"]}
    step = 1

    def save(name: str) -> float:
        nonlocal step
        mutate(sd, step)
        dist.barrier()
        d = systems[name].capture(sd, step)
        systems[name].complete()
        step += 1
        return gmax(d)

    # 1. blocking time, ABBA over systems; a memcpy sample before each save
    memcpy()
    for name in systems:
        for _ in range(args["warmup"]):
            save(name)
    settle()
    delta: dict = {n: [] for n in systems}
    mems: list = []
    for r, order in enumerate(abba(list(systems), args["saves"])):
        for name in order:
            mems.append(memcpy())
            delta[name].append(save(name))
            settle()
        if rank == 0:
            print(f"[bench-peers] {args['mib']:g} MiB rep {r + 1}/{args['saves']}: "
                  + ", ".join(f"{n} {delta[n][-1] * 1e3:.0f} ms" for n in order), flush=True)
    out.update(delta_s=delta, memcpy_s=mems)

    # 4. the cost of one save to a CPU-bound trainer (bench/peers_stepcost.py)
    cpu_names = [n for n in ("tierckpt", OVERLAP, PRIO0, "DCP process+async staging") if n in systems]
    if args["cpu_steps"]:
        out["stepcost"] = step_cost(systems, cpu_names, sd, reps=args["cpu_reps"], steps=args["cpu_steps"],
                                    window_s=args["overlap_window_ms"] / 1e3, barrier=dist.barrier,
                                    first_step=step)
        step = out["stepcost"]["next_step"]
        if rank == 0:
            print("[bench-peers] CPU-bound step cost: " + ", ".join(
                f"{n} {med(v) * 1e3:.0f} ms" for n, v in out["stepcost"]["cost_s"].items()), flush=True)

    # 3. host RSS growth over rss_saves saves (NVRx's synchronous saves are left out: too slow).
    # (2., the restores, runs in fresh processes per repetition: restore_once)
    rss: dict = {}
    for name in [n for n in systems if not n.startswith("NVRx")]:
        # warm-up again, each system right before its own count: steady-state saves only
        for _ in range(args["warmup"]):
            save(name)
        settle()
        r0 = rss_bytes()
        for _ in range(args["rss_saves"]):
            save(name)
        rss[name] = gmax(float(rss_bytes() - r0))
        if rank == 0:
            print(f"[bench-peers] RSS growth {name}: {rss[name] / MiB:.1f} MiB over {args['rss_saves']} saves",
                  flush=True)
    out["rss_growth_bytes"] = rss
    for s in systems.values():
        s.close()
    return out


def restore_once(rank: int, args: dict) -> dict:
    """Rank side of one restore repetition, in fresh processes (a restart is one): system
    ``args["restore_one"]`` saves the state once (completed, replicated), then node 1's root is
    deleted, the page cache dropped and the restore timed (``restore_after_loss``, checked
    bitwise). For :data:`FLOOR`, tierckpt saves the same way and :func:`disk_floor` reads
    its files instead of a restore (the first read after the write, as every restore is).
    Returns {"restore_s": slower rank's seconds} ({"floor_s": ...} for the floor)."""
    import torch.distributed as dist

    name, base = args["restore_one"], args["base"]
    system: Tier | Nvrx
    if name in ("tierckpt", FLOOR):
        system = Tier(rank, base, "tierckpt")
    elif name == RAM_TIER:
        system = Tier(rank, base, "tierckpt-ram", local_base=args["local_root_base"])
    elif name == "NVRx local":
        system = Nvrx(rank, base)
    else:
        raise ValueError(f"restore_once: no restore for {name!r}")
    sd = make_state(rank, args["mib"])
    mutate(sd, 1)
    dist.barrier()
    system.capture(sd, 1)
    system.complete()
    expected = snapshot(sd)
    os.sync()
    dist.barrier()
    if name == FLOOR:  # the engine closed first, as restore_after_loss closes it
        system.close()
        out = {"floor_s": gmax(disk_floor(rank, system.dir, dist.barrier))}
    else:
        out = {"restore_s": gmax(system.restore_after_loss(expected, dist.barrier, 1))}
    system.close()
    return out


# ---------------------------------------------------------------------------------------------
# driver side
def lmr_skipped(a) -> str | None:
    """Why lm-resiliency is left out of this run (None: it runs)."""
    if a.skip_lmr:
        return "--skip-lmr"
    if not os.path.exists(a.peers_python):
        return (f"side venv absent ({os.path.relpath(a.peers_python, REPO)}; "
                f"create it with scripts/setup_venv_peers.sh or `make bench-peers`)")
    return None


def lmr_cmd(a, mib: float, base: str, phases: str, restore_reps: int) -> list[str]:
    """The side run's command line (``--out`` not included)."""
    return [a.peers_python, os.path.join(HERE, "peers_lmr.py"), "--mib", str(mib), "--saves", str(a.saves),
            "--warmup", str(a.warmup), "--restore-reps", str(restore_reps), "--rss-saves", str(a.rss_saves),
            "--threads", str(a.threads), "--dir", base, "--timeout", str(a.timeout), "--phases", phases]


def run_lmr(a, mib: float, base: str) -> dict:
    """Run bench/peers_lmr.py in the side venv for everything but the disk restart path (one
    run per repetition in :func:`run_restores`' ABBA order); its JSON result, or
    ``{"skipped": reason}``."""
    why = lmr_skipped(a)
    if why:
        return {"skipped": why}
    out = os.path.join(base, f"lmr-{mib:g}.json")
    cmd = lmr_cmd(a, mib, base, "capture,ram,rss", a.restore_reps) + ["--out", out]
    subprocess.run(cmd, check=True, timeout=a.timeout + 60)
    with open(out) as f:
        return json.load(f)


def run_restores(a, mib: float, base: str, ram_base: str | None) -> dict:
    """Measurement 2: restore repetitions in ABBA order over tierckpt (its RAM-root variant with
    ``--local-root-base``), NVRx, lm-resiliency's disk restart path (side venv) and the disk
    floor, each in fresh processes and a fresh directory, one at a time (nothing else holds
    memory or the disk meanwhile). Returns {"restore_s": {system: [s]}, "floor_s": [s],
    "lmr_flush_s": [s]}."""
    names = ["tierckpt", FLOOR] + ([RAM_TIER] if ram_base else [])
    if a.systems is None or "NVRx local" in a.systems:
        names.append("NVRx local")
    if not lmr_skipped(a):
        names.append(LMR_DISK)
    out: dict = {"restore_s": {n: [] for n in names if n != FLOOR}, "floor_s": [], "lmr_flush_s": []}
    for order in abba(names, a.restore_reps):
        for name in order:
            rep = tempfile.mkdtemp(prefix="restore-", dir=base)
            ram_rep = tempfile.mkdtemp(prefix="restore-", dir=ram_base) if ram_base else None
            try:
                if name == LMR_DISK:
                    js = os.path.join(rep, "lmr.json")
                    subprocess.run(lmr_cmd(a, mib, rep, "disk", 1) + ["--out", js], check=True, timeout=a.timeout + 60)
                    with open(js) as f:
                        r = json.load(f)
                    t = r["disk_restore_s"][0]
                    out["lmr_flush_s"].append(r["flush_s"][0])
                else:
                    r, _ = run_ranks(dict(restore_one=name, mib=mib, base=rep, local_root_base=ram_rep,
                                          threads=a.threads), timeout=a.timeout, target=peers_rank)
                    t = r["floor_s"] if name == FLOOR else r["restore_s"]
            finally:
                shutil.rmtree(rep, ignore_errors=True)
                if ram_rep:
                    shutil.rmtree(ram_rep, ignore_errors=True)
            (out["floor_s"] if name == FLOOR else out["restore_s"][name]).append(t)
            print(f"[bench-peers] {mib:g} MiB " + (f"disk floor: {t:.3f} s" if name == FLOOR else
                                                 f"restore {name}: {t:.3f} s (bitwise equal)"), flush=True)
    return out


def summarise(r: dict, lmr: dict) -> dict:
    """Medians and ratios of one size (values in seconds / bytes)."""
    mem = med(r["memcpy_s"])
    s: dict = {"mib": r["state_bytes"] / MiB, "memcpy": mem, "systems": r["systems"],
               "delta": {n: med(v) for n, v in r["delta_s"].items()},
               "restore": {n: med(v) for n, v in r["restore_s"].items()},
               "rss": dict(r["rss_growth_bytes"]), "lmr": None, "window_ms": r.get("overlap_window_ms")}
    s["floor"] = med(r["floor_s"]) if r.get("floor_s") else None
    sc = r.get("stepcost")
    if sc:
        s["stepcost"] = {"cost": {n: med(v) for n, v in sc["cost_s"].items()},
                         "base_step": med([x for v in sc["base_step_s"].values() for x in v]),
                         "steps": {n: med(v) for n, v in sc["steps"].items()},
                         "tail": {n: med(v) for n, v in sc["tail_s"].items()}}
    s["delta_ratio"] = {n: v / mem for n, v in s["delta"].items()}
    s["raw"] = {"delta_s": r["delta_s"], "memcpy_s": r["memcpy_s"], "restore_s": r["restore_s"],
                "lmr": {k: lmr[k] for k in ("capture_s", "replication_s", "memcpy_s", "ram_restore_s")
                        if k in lmr} | {"flush_s": r.get("lmr_flush_s", [])}, "floor_s": r.get("floor_s", []),
                "stepcost": sc}
    if "skipped" not in lmr:
        lm = med(lmr["memcpy_s"])
        s["lmr"] = {"memcpy": lm, "capture": med(lmr["capture_s"]), "replication": med(lmr["replication_s"]),
                    "ram": med(lmr["ram_restore_s"]), "disk": s["restore"].pop(LMR_DISK),
                    "flush": med(r["lmr_flush_s"]), "rss": lmr["rss_growth_bytes"],
                    "versions": lmr.get("versions", {})}
        s["lmr"]["capture_ratio"] = s["lmr"]["capture"] / lm
    else:
        s["lmr_skipped"] = lmr["skipped"]
    return s


def _pf(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def rows(s: dict) -> tuple[list[str], list[list[str]], list[list[str]]]:
    """(header, measurement rows, target rows) of one size."""
    names = list(s["systems"]) + (["lm-resiliency (side venv)"] if s["lmr"] else [])
    head = ["row"] + names
    lm = s["lmr"]

    def col(fn, name):
        try:
            return fn(name)
        except KeyError:
            return "—"

    ms = lambda x: f"{x * 1e3:.0f} ms"  # noqa: E731
    r1 = ["1. blocking δ (median)"] + [col(lambda n: ms(s["delta"][n]), n) for n in s["systems"]]
    r1r = [f"1. δ ÷ memcpy (memcpy {ms(s['memcpy'])})"] + [col(lambda n: f"{s['delta_ratio'][n]:.2f}", n)
                                                            for n in s["systems"]]
    r2 = ["2. restore after losing node 1 + its disk"] + [col(lambda n: f"{s['restore'][n]:.3f} s", n)
                                                          for n in s["systems"]]
    r3 = ["3. host RSS growth over the RSS saves"] + [col(lambda n: f"{s['rss'][n] / MiB:.1f} MiB", n)
                                                     for n in s["systems"]]
    if lm:
        r1.append(f"{ms(lm['capture'])} (capture; replication {ms(lm['replication'])} after)")
        r1r.append(f"{lm['capture_ratio']:.2f} (its memcpy {ms(lm['memcpy'])})")
        r2.append(f"disk path {lm['disk']:.3f} s (same run, ABBA; flush before: {lm['flush']:.3f} s); "
                  f"RAM path, processes alive {lm['ram']:.3f} s")
        r3.append(f"{lm['rss'] / MiB:.1f} MiB")
    meas = [r1, r1r, r2]
    if s.get("floor"):
        fl = s["floor"]
        meas.append([f"2. ÷ disk floor (node 0 reads own copy + node 1's replica, page cache dropped: {fl:.3f} s)"]
                    + [col(lambda n: "—" if "RAM" in n else f"{s['restore'][n] / fl:.2f}", n) for n in s["systems"]]
                    + ([f"disk path {lm['disk'] / fl:.2f}"] if lm else []))
    meas.append(r3)
    sc = s.get("stepcost")
    if sc:
        meas.append([f"4. CPU-bound trainer: training time one save costs (step {ms(sc['base_step'])} "
                     f"without a save)"]
                    + [col(lambda n: f"{ms(sc['cost'][n])} over {sc['steps'][n]:g} steps "
                                     f"(tail {ms(sc['tail'][n])})", n) for n in s["systems"]]
                    + (["—"] if lm else []))
        meas.append(["4. ÷ memcpy"] + [col(lambda n: f"{sc['cost'][n] / s['memcpy']:.2f}", n)
                                       for n in s["systems"]] + (["—"] if lm else []))
    targ = []
    # the overlapped δ holds only given idle host time to copy in: the condition is in the label
    label = {"tierckpt": "tierckpt", OVERLAP: f"tierckpt (overlapped, {s.get('window_ms') or 0:g} ms idle host)"}
    for name in ("tierckpt", OVERLAP):
        x = s["delta_ratio"].get(name)
        if x is not None:
            targ.append([f"δ {label[name]} ÷ memcpy", f"{x:.2f}", f"≤ {TARGETS['delta_memcpy']}",
                         _pf(x <= TARGETS["delta_memcpy"])])
    sc = s.get("stepcost")
    dcpp = "DCP process+async staging"
    if sc and sc["cost"].get(dcpp):
        for name in ("tierckpt", OVERLAP, PRIO0):
            if name in sc["cost"]:
                x = sc["cost"][name] / sc["cost"][dcpp]
                targ.append([f"4. save cost {name} ÷ DCP process executor (replica + checksums on)", f"{x:.2f}",
                             f"≤ {TARGETS['save_cost_dcp_process']}" if name != PRIO0 else "(info)",
                             _pf(x <= TARGETS["save_cost_dcp_process"]) if name != PRIO0 else "—"])
    if "NVRx local" in s["restore"]:
        x = s["restore"]["tierckpt"] / s["restore"]["NVRx local"]
        targ.append(["restore tierckpt ÷ NVRx local", f"{x:.2f}", f"≤ {TARGETS['restore_nvrx']}",
                     _pf(x <= TARGETS["restore_nvrx"])])
    if lm:
        # cross-run ratios: each side normalised by the memcpy measured in its own run
        for name in ("tierckpt", OVERLAP):
            if name in s["delta_ratio"]:
                x = s["delta_ratio"][name] / lm["capture_ratio"]
                targ.append([f"δ {label[name]} ÷ lm-resiliency capture (memcpy-normalised)", f"{x:.2f}",
                             f"≤ {TARGETS['delta_lmr']}", _pf(x <= TARGETS["delta_lmr"])])
        x = s["restore"]["tierckpt"] / lm["disk"]  # same run, interleaved: no normalisation
        targ.append(["restore tierckpt ÷ lm-resiliency disk path (same run, ABBA)", f"{x:.2f}",
                     f"≤ {TARGETS['restore_lmr_disk']}", _pf(x <= TARGETS["restore_lmr_disk"])])
        rt = s["restore"]["tierckpt"] / s["memcpy"]
        x = rt / (lm["ram"] / lm["memcpy"])
        targ.append(["(info) restore tierckpt ÷ lm-resiliency RAM path (memcpy-normalised)", f"{x:.2f}", "—", "—"])
        ram = RAM_TIER
        if ram in s["restore"]:
            x = (s["restore"][ram] / s["memcpy"]) / (lm["ram"] / lm["memcpy"])
            targ.append([f"(info) restore {ram}, node 1 lost ÷ lm-resiliency RAM path, processes alive "
                         "(memcpy-normalised)", f"{x:.2f}", "—", "—"])
    return head, meas, targ


TARGET_HEAD = ["target", "value", "target", "result"]


def print_rich(summaries: list[dict], m: dict, args, elapsed: float) -> None:
    from rich.console import Console
    from rich.table import Table

    c = Console(width=max(160, shutil.get_terminal_size((160, 40)).columns))
    for s in summaries:
        head, meas, targ = rows(s)
        t = Table(title=f"bench-peers — 2 gloo ranks = 2 nodes, {s['mib']:.1f} MiB per rank (324 tensors)",
                  show_lines=True)
        for h in head:
            t.add_column(h)
        for r in meas:
            t.add_row(*r)
        c.print(t)
        tt = Table(title="targets (PASS/MISS; not an exit status)")
        for h in TARGET_HEAD:
            tt.add_column(h)
        for r in targ:
            color = {"PASS": "green", "MISS": "red"}.get(r[-1], "default")
            tt.add_row(*r[:-1], f"[{color}]{r[-1]}[/]")
        c.print(tt)
        if s.get("lmr_skipped"):
            c.print(f"lm-resiliency skipped: {s['lmr_skipped']}")
    c.print(f"{OVERLAP} and DCP process+async staging: δ = the call + the wait for staging after a modelled "
            f"forward/backward of {args.overlap_window_ms:g} ms (--overlap-window-ms)")
    c.print("CPU adaptations of the peers:\n" + "\n".join(f"  - {x}" for x in ADAPTATIONS))
    c.print(f"machine: {m['nproc']} CPUs ({m['cpu']}), {m['mem']}, torch {m['torch']}; "
            f"load average at the end {os.getloadavg()}; {memory_state()}; elapsed {elapsed:.0f} s")


def memory_state() -> str:
    """``MemFree``, ``Cached`` and ``MemAvailable`` from /proc/meminfo, in GiB (one line).

    Recorded at the start and end of a run: with most memory held by the page cache, allocations
    on the restore path reclaim first (measured on this VM: 256 MiB restores 0.79–1.08 s with 15
    GiB cached and 7 GiB free, 0.28–0.51 s after dropping the cache)."""
    kb = meminfo_kb()
    fields = ("MemFree", "Cached", "MemAvailable")
    if not all(k in kb for k in fields):
        return "memory state unknown"
    return ", ".join(f"{k} {kb[k] / (1 << 20):.1f} GiB" for k in fields)


def record(summaries, m, args, cmd, elapsed, dfout, load0, mem0, failed: str | None = None) -> None:
    """Append this run to bench/history/<YYYY-MM>.md; ``failed``: why the sizes after the last summary were
    not measured (a run stopped by an error), written under the command line."""
    when = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    parts = [f"\n## bench-peers {when}\n\n",
             f"Command (from the repo root): `{cmd}`  \n",
             f"Machine: {m['nproc']} CPUs; {m['mem']}; CPU: {m['cpu']}; kernel {m['kernel']}; "
             f"Python {m['python']}; torch {m['torch']}.  \n",
             f"Load average: {load0} at the start, {os.getloadavg()} at the end; elapsed {elapsed:.0f} s.  \n",
             f"Memory: {mem0} at the start; {memory_state()} at the end.  \n",
             *([f"**Incomplete**: only {', '.join('%.0f' % x['mib'] for x in summaries)} MiB measured; the next size "
                f"failed ({failed}).  \n"] if failed else []),
             f"Method: 2 gloo ranks = 2 nodes, 324 tensors per rank (4 large fp32 = 3/4 of the bytes, 280 "
             f"small fp32, 40 int64 scalars); saves {args.saves} per system (ABBA order, {args.warmup} warm-up); "
             f"{OVERLAP} and DCP process+async staging: δ = the call + the wait for staging after a modelled "
             f"forward/backward of {args.overlap_window_ms:g} ms (host thread asleep); "
             f"restore repetitions {args.restore_reps} (ABBA; node 1's dir deleted, page cache of every file "
             f"dropped, timed until both ranks hold the state, checked bitwise), RSS growth over "
             f"{args.rss_saves} saves; "
             + (f"CPU-bound step cost: at least {args.cpu_steps} steps of {args.overlap_window_ms:g} ms of matmuls, "
                f"the wait for staging and an in-place add over the state, with one save at the first and until "
                f"its background work is done, minus as many steps without a save ({args.cpu_reps} samples, ABBA); "
                if args.cpu_steps else "") + "medians of the slower rank. lm-resiliency runs in a side venv: its disk "
             "restart path in the restore ABBA order (each restore repetition in fresh processes; not normalised; "
             "the disk floor is one more repetition in that order); its "
             "capture and RAM path in a separate run, normalised by the memcpy measured in each run. "
             "See bench/bench_peers.py.  \n",
             "CPU adaptations: " + "; ".join(ADAPTATIONS) + ".\n\nBench dir filesystem:\n\n```\n" + dfout + "\n```\n"]
    for s in summaries:
        head, meas, targ = rows(s)
        parts.append(f"\n{s['mib']:.1f} MiB per rank:\n\n" + md_table(head, meas) + "\n\n"
                     + md_table(TARGET_HEAD, targ) + "\n")
        if s.get("lmr_skipped"):
            parts.append(f"\nlm-resiliency skipped: {s['lmr_skipped']}\n")
        raw = json.dumps(s["raw"], default=lambda x: x)
        parts.append(f"\nRaw samples (seconds, slower rank):\n\n```json\n{raw}\n```\n")
    with open(RESULTS_MD, "a") as f:
        f.write("".join(parts))
    print(f"recorded to {RESULTS_MD}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib-per-rank", type=float, nargs="+", default=[256, 1024],
                    help="state sizes per rank in MiB (default 256 1024)")
    ap.add_argument("--saves", type=int, default=10, help="measured saves per system (default 10)")
    ap.add_argument("--warmup", type=int, default=2, help="warm-up saves per system (default 2)")
    ap.add_argument("--restore-reps", type=int, default=5, help="restores per system (default 5)")
    ap.add_argument("--rss-saves", type=int, default=50, help="saves for the RSS growth (default 50)")
    ap.add_argument("--systems", nargs="*", default=None,
                    help="only these peers (tierckpt always runs; none given: tierckpt alone): 'DCP sync', "
                         "'DCP async (thread)', 'DCP process+async staging', 'NVRx local'")
    ap.add_argument("--local-root-base", default=None,
                    help="also run tierckpt with its local root under this dir (e.g. /dev/shm)")
    ap.add_argument("--overlap-window-ms", type=float, default=250.0,
                    help="modelled forward+backward between an overlapped save and the optimizer step's "
                         "wait_for_staging(), ms (default 250; 0 = nothing to overlap with)")
    ap.add_argument("--cpu-steps", type=int, default=8,
                    help="measurement 4, a CPU-bound trainer: at least this many steps of --overlap-window-ms "
                         "of matmuls per sample (default 8; 0 skips it)")
    ap.add_argument("--cpu-reps", type=int, default=6, help="measurement 4: samples per system (default 6)")
    ap.add_argument("--peers-python", default=PEERS_PY, help="side venv interpreter for lm-resiliency")
    ap.add_argument("--skip-lmr", action="store_true", help="leave lm-resiliency out")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    ap.add_argument("--dir", default=None, help="parent of the temp dir (default $TMPDIR or /tmp)")
    ap.add_argument("--record", action="store_true", help="append the results to bench/history/<YYYY-MM>.md")
    ap.add_argument("--json", default=None, help="write the summaries to this JSON file")
    ap.add_argument("--timeout", type=float, default=3000, help="per run, seconds (default 3000)")
    a = ap.parse_args(argv)
    if not a.overlap_window_ms >= 0:
        ap.error(f"--overlap-window-ms must be >= 0, got {a.overlap_window_ms}")
    if a.cpu_steps < 0 or a.cpu_reps < 1:
        ap.error(f"--cpu-steps must be >= 0 and --cpu-reps >= 1, got {a.cpu_steps} and {a.cpu_reps}")
    if a.cpu_steps and not a.overlap_window_ms > 0:
        ap.error("--cpu-steps needs --overlap-window-ms > 0 (the modelled forward/backward per step); "
                 "pass --cpu-steps 0 to skip measurement 4")
    peers = ["DCP sync", "DCP async (thread)", "DCP process+async staging", "NVRx local"]
    if a.systems and not set(a.systems) <= set(peers):
        ap.error(f"--systems {a.systems}: allowed systems are {peers}")
    cmd = " ".join(shlex.quote(x) for x in [os.path.relpath(sys.executable, REPO) if sys.executable.startswith(REPO)
                                            else sys.executable, os.path.relpath(os.path.abspath(__file__), REPO)]
                   + (sys.argv[1:] if argv is None else list(argv)))
    load0, mem0 = os.getloadavg(), memory_state()
    t0 = time.time()
    summaries = []
    base = tempfile.mkdtemp(prefix="tierckpt-peers-", dir=a.dir)
    ram_base = tempfile.mkdtemp(prefix="tierckpt-peers-", dir=a.local_root_base) if a.local_root_base else None
    dfout = disk(base)
    failed = None
    try:
        for mib in a.mib_per_rank:
            print(f"[bench-peers] {mib:g} MiB per rank: lm-resiliency (side venv) first, then the main run",
                  flush=True)
            lmr = run_lmr(a, mib, base)
            args = dict(mib=mib, saves=a.saves, warmup=a.warmup, rss_saves=a.rss_saves,
                        threads=a.threads, base=base, local_root_base=ram_base, systems=a.systems,
                        overlap_window_ms=a.overlap_window_ms, cpu_steps=a.cpu_steps, cpu_reps=a.cpu_reps)
            r0, _r1 = run_ranks(args, timeout=a.timeout, target=peers_rank)
            r0.update(run_restores(a, mib, base, ram_base))
            summaries.append(summarise(r0, lmr))
    except Exception as e:  # noqa: BLE001 - the sizes already measured are still printed and recorded
        if not summaries:
            raise
        failed = f"{type(e).__name__}: {e}"
        print(f"[bench-peers] the {mib:g} MiB run failed ({failed}); printing and recording the sizes "
              "measured before it", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
        if ram_base:
            shutil.rmtree(ram_base, ignore_errors=True)
    elapsed = time.time() - t0
    m = machine()
    print_rich(summaries, m, a, elapsed)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(summaries, f, indent=1)
    if a.record:
        record(summaries, m, a, cmd, elapsed, dfout, load0, mem0, failed)
    return 0 if failed is None else 1


if __name__ == "__main__":
    sys.exit(main())
