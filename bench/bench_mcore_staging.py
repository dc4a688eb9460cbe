"""Blocking time of staging a Megatron payload: DCP's deep copy against tierckpt's copy plan.

The Megatron adapter hands the engine one object (``mcore_plugin.convert.Staged``: a sharded
state dict of ``ShardedTensor``/``ShardedObject`` objects plus the common state). Its first
stage into a staging buffer is DCP's deep copy of the object; from the second on, the copy plan
refills the buffer (``tierckpt.staging.copy_plan.TensorHolder``). One process, no process group:
the state is bench_peers' 324 tensors per rank (4 large fp32 with 3/4 of the bytes, 280 small,
40 int64 scalars) as ShardedTensors with global offsets on a DP-sharded axis (the scalars as
ShardedObjects holding small lists, as Megatron's per-bucket numel metadata), plus a common
state like Megatron-LM's (iteration, args, RNG state).

Prints, per size, the median staging time of each path and ÷ one memcpy of the tensors
(``dst.copy_(src)`` into preallocated tensors), measured in the same run, ABBA order:
- ``DCP deep copy``: DCP's stager into a staging slot whose host storages it has cached (the
  path every save took before the plan);
- ``copy plan``: the same slot every save (its second stage on);
- ``copy plan, overlapped``: ``cpu_staging = "overlapped"``: the time ``stage()`` holds the
  caller (the large tensors are copied afterwards, by a background thread).

With ``--device cuda`` (``make bench-gpu``) the ShardedTensors live on the GPU. The payload
is then copied into pinned buffers inside ``stage()`` (DCP's stager, synchronised: Megatron's
training loop calls no ``wait_for_staging()``, so the enqueued device→host path is not used
for it); the rows are the time ``stage()`` holds the caller and the time until the copy is
complete, ÷ one synchronous device→host copy of the tensors into preallocated pinned memory.

Usage::

    .venv/bin/python bench/bench_mcore_staging.py [--mib 64 256] [--reps 9] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)


def megatron_payload(mib: float, device: str = "cpu"):
    """``(Staged payload, plain {key: tensor} of the same tensors)`` of about ``mib`` MiB, the
    tensors on ``device``."""
    import torch
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
    from peers_common import make_state

    from mcore_plugin.convert import Staged

    sd = {k: v.to(device) for k, v in make_state(0, mib).items()}
    sharded: dict = {}
    for k, v in sd.items():
        name = k.split(".", 1)[1]
        if v.dim() == 0:  # like Megatron's per-bucket numel lists: small Python objects
            sharded[name] = ShardedObject(f"obj.{name}", [int(v)] * 4, (1,), (0,), replica_id=0)
        else:  # rank 0 of a DP group of 8 holding the first of 8 chunks of the global tensor
            sharded[name] = ShardedTensor.from_rank_offsets(f"w.{name}", v, (0, 0, 8), replica_id=0)
    common = {"iteration": 100, "args": argparse.Namespace(lr=1e-4, seq_length=4096, micro_batch_size=1),
              "rng_state": [{"random_rng_state": list(range(625)), "torch_rng_state": torch.get_rng_state()}],
              "checkpoint_version": 3.0}
    return Staged(sharded, common, None), {k: v for k, v in sd.items() if v.dim() > 0}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=float, nargs="+", default=[64, 256], help="payload sizes in MiB (default 64 256)")
    ap.add_argument("--reps", type=int, default=9, help="measured stages per path (default 9)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the tensors live (default cpu)")
    a = ap.parse_args(argv)
    if a.reps < 1 or any(m < 1 for m in a.mib):
        ap.error(f"--reps must be >= 1 and every --mib >= 1, got {a.reps} and {a.mib}")
    import torch
    from rich.console import Console

    if a.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here")
    torch.set_num_threads(1)
    c = Console()
    for mib in a.mib:
        if a.device == "cuda":
            c.print(cuda_rows(mib, a.reps))
        else:
            c.print(cpu_rows(mib, a.reps))
    return 0


def cuda_rows(mib: float, reps: int):
    """The table of one size with the tensors on the GPU."""
    import torch
    from rich.table import Table

    from tierckpt.staging.pool import StagingPool

    payload, plain = megatron_payload(mib, "cuda")
    dst = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=True) for k, v in plain.items()}
    state = {"mcore": payload}
    pool = StagingPool(2)
    held, total, d2h = [], [], []
    for r in range(reps + 2):  # two warm-ups: each slot allocates its pinned buffers once
        torch.cuda.synchronize()
        t = time.perf_counter()
        for k, v in plain.items():
            dst[k].copy_(v)
        torch.cuda.synchronize()
        m = time.perf_counter() - t
        s = pool.acquire()
        t = time.perf_counter()
        s.stage(state, users=1)
        h = time.perf_counter() - t
        pool.wait_for_staging()
        done = time.perf_counter() - t
        s.release()
        if r >= 2:
            held.append(h)
            total.append(done)
            d2h.append(m)
    pool.close()
    m = statistics.median(d2h)
    tab = Table(title=f"Megatron payload staging on CUDA, {mib:g} MiB, {len(payload.sharded)} sharded objects "
                      f"(synchronous device→host copy {m * 1e3:.1f} ms)")
    for col in ("measure", "median", "÷ device→host copy"):
        tab.add_column(col)
    for n, v in (("stage() holds the caller (δ)", held), ("until the copy is complete", total)):
        x = statistics.median(v)
        tab.add_row(n, f"{x * 1e3:.1f} ms", f"{x / m:.2f}")
    return tab


def cpu_rows(mib: float, reps: int):
    """The table of one size with the tensors in host memory (three paths, ABBA)."""
    import torch
    from rich.table import Table

    from tierckpt.staging.pool import StagingPool

    payload, plain = megatron_payload(mib)
    dst = {k: torch.empty_like(v) for k, v in plain.items()}
    state = {"mcore": payload}
    blocking, overlapped, legacy = StagingPool(1), StagingPool(1, overlapped=True), StagingPool(1)
    for pool in (blocking, overlapped, legacy):  # the first stage builds each pool's plan
        s = pool.acquire()
        s.stage(state, users=1)
        s.release()
        pool.wait_for_staging()

    def memcpy() -> None:
        for k, v in plain.items():
            dst[k].copy_(v)

    def dcp_copy() -> None:
        s = legacy.acquire()
        s._plan = None  # as before the plan: DCP's stager, its host storages cached
        t = time.perf_counter()
        s.stage(state, users=1)
        times["DCP deep copy"].append(time.perf_counter() - t)
        s.release()

    def plan(pool, name):
        def run() -> None:
            s = pool.acquire()
            t = time.perf_counter()
            staged = s.stage(state, users=1)
            times[name].append(time.perf_counter() - t)
            assert staged["mcore"] is not payload
            pool.wait_for_staging()
            s.check_intact()
            s.release()
        return run

    systems = {"DCP deep copy": dcp_copy, "copy plan": plan(blocking, "copy plan"),
               "copy plan, overlapped": plan(overlapped, "copy plan, overlapped")}
    times: dict = {n: [] for n in systems}
    mem: list = []
    names = list(systems)
    for r in range(reps):
        for n in (names if r % 2 == 0 else names[::-1]):
            t = time.perf_counter()
            memcpy()
            mem.append(time.perf_counter() - t)
            systems[n]()
    m = statistics.median(mem)
    tab = Table(title=f"Megatron payload staging, {mib:g} MiB, {len(payload.sharded)} sharded objects "
                      f"(memcpy of the tensors {m * 1e3:.1f} ms)")
    for col in ("path", "median", "÷ memcpy"):
        tab.add_column(col)
    for n, v in times.items():
        x = statistics.median(v)
        tab.add_row(n, f"{x * 1e3:.1f} ms", f"{x / m:.2f}")
    for pool in (blocking, overlapped, legacy):
        pool.close()
    return tab


if __name__ == "__main__":
    sys.exit(main())
