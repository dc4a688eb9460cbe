"""GPU benchmark: the blocking time δ of ``TieredCheckpointer.save`` on CUDA state, and restore.

One prepared run for a GPU machine (made for one H200; ``make bench-gpu``). Each rank holds a
state of CUDA tensors of 1 GiB and then 8 GiB (``--sizes-gib``). Measured per size, the time of
a measurement being the slowest rank's, the value reported the median over ``--saves``
steady-state saves (after one warm-up save that allocates and pins the host buffers):

- **tierckpt**: δ = wall time of ``TieredCheckpointer.save(step, sd, tiers=["local"])`` (CUDA
  tensors enqueued for copy into pinned host buffers on a side stream,
  :mod:`tierckpt.staging.pool`); ``staging_s`` = time of the following ``wait_for_staging()``
  (what a trainer waits before its optimizer step if the copy has not finished by then);
  ``background_s`` until the local step is committed; ``restore_s`` = ``restore()`` of the
  newest step into the CUDA tensors (checked bitwise against the saved values);
- **dcp-sync**: ``dcp.save`` (δ = the whole save) and ``dcp.load``;
- **dcp-async-pinned**: ``dcp.async_save`` with torchtitan's ``async_with_pinned_mem``
  configuration (``DefaultStager(StagingOptions(True, True, True, True))``,
  ``AsyncCheckpointerType.PROCESS``): δ = the ``async_save`` call, ``staging_s`` = waiting for
  ``staging_completion``, restore = ``dcp.load``;
- **nvrx-local**: nvidia-resiliency-ext's ``LocalCheckpointManager`` unpatched, if importable,
  ``save(..., is_async=True)`` + ``AsyncCallsQueue.schedule_async_request`` (δ), then
  finalize; restore = ``find_latest`` + ``load`` + ``restore_tensor_device``.

Target printed: tierckpt's δ ≤ 10 ms at every size. The last line of output is one JSON
summary. ``--cpu-dry-run`` runs everything on CPU tensors at a tiny size (the CPU path of
``save`` copies synchronously, so δ there is a memcpy, not the GPU result) to check the script
end to end on a machine without a GPU.

Usage::

    .venv/bin/python bench/bench_gpu.py [--sizes-gib 1 8] [--ranks 1|2] [--dir /tmp] [--cpu-dry-run]

Two ranks share the one GPU over gloo (NCCL refuses two ranks on one device) and act as two
nodes (replication_factor 2). Everything written under the temp dir is removed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
import traceback

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

GiB = 1 << 30
TARGET_DELTA_S = 0.010


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sync(dev: str) -> None:
    import torch

    if dev == "cuda":
        torch.cuda.synchronize()


def _slowest(x: float) -> float:
    import torch.distributed as dist

    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, x)
    return max(out)


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def make_state(rank: int, nbytes: int, tensors: int, dev: str) -> dict:
    """``tensors`` bf16 tensors of ``nbytes`` in all on ``dev``, keys unique per rank (so DCP
    keeps every rank's tensors), values seeded per rank."""
    import torch

    g = torch.Generator(device=dev).manual_seed(1000 + rank)
    per = max(1, nbytes // tensors // 2)
    return {f"r{rank}.t{i}": torch.randn(per, generator=g, device=dev, dtype=torch.bfloat16) for i in range(tensors)}


def _perturb(sd: dict) -> None:
    """What a training step does to the saved tensors (in place)."""
    import torch

    with torch.no_grad():
        for v in sd.values():
            v.mul_(1.0001)


def _equal(a: dict, b: dict) -> bool:
    import torch

    return all(torch.equal(a[k], b[k]) for k in a)


# -- tierckpt ------------------------------------------------------------------------------------
def bench_tierckpt(rank, world, sd, base, saves, dev) -> dict:
    import torch

    from tierckpt import TierConfig, TieredCheckpointer

    cfg = TierConfig(local_root=os.path.join(base, "local", "node-{node}"), persistent_root=os.path.join(base, "pfs"),
                     tiers=("local",), replication_factor=2 if world > 1 else 1, job_id="bench-gpu",
                     keep_latest_k={"local": 1, "persistent": 1})
    eng = TieredCheckpointer(cfg, node_id=rank)
    deltas, stagings, bgs = [], [], []
    ok = True
    for step in range(saves + 1):
        _perturb(sd)
        _sync(dev)
        t0 = time.perf_counter()
        h = eng.save(step, sd, tiers=["local"])
        delta = time.perf_counter() - t0
        t1 = time.perf_counter()
        eng.wait_for_staging()
        staging = time.perf_counter() - t1
        rec = h.wait()["local"]
        ok = ok and rec.ok
        if step > 0:  # step 0 allocates and pins the host buffers
            deltas.append(_slowest(delta))
            stagings.append(_slowest(staging))
            bgs.append(_slowest(rec.background_s or 0.0))
    ref = {k: v.clone() for k, v in sd.items()}
    with torch.no_grad():
        for v in sd.values():
            v.zero_()
    _sync(dev)
    t0 = time.perf_counter()
    res = eng.restore(sd)
    _sync(dev)
    restore_s = _slowest(time.perf_counter() - t0)
    bitwise = res is not None and res.step == saves and _equal(sd, ref)
    source = res.source_of(eng.topo.node) if res is not None else None
    eng.close()
    return {"delta_s": deltas, "staging_s": stagings, "background_s": bgs, "restore_s": restore_s,
            "restored_step": res.step if res else None, "source": source, "bitwise": bool(_slowest(not bitwise) == 0),
            "ok": bool(ok)}


# -- peers ----------------------------------------------------------------------------------------
def bench_dcp_sync(rank, world, sd, base, saves, dev) -> dict:
    import torch.distributed.checkpoint as dcp

    deltas = []
    for step in range(saves + 1):
        _perturb(sd)
        _sync(dev)
        path = os.path.join(base, "dcp-sync", f"step-{step}")
        t0 = time.perf_counter()
        dcp.save(sd, checkpoint_id=path)
        d = _slowest(time.perf_counter() - t0)
        if step > 0:
            deltas.append(d)
    return {"delta_s": deltas, **_dcp_restore(sd, os.path.join(base, "dcp-sync", f"step-{saves}"), dev)}


def _dcp_restore(sd, path, dev) -> dict:
    import torch
    import torch.distributed.checkpoint as dcp

    ref = {k: v.clone() for k, v in sd.items()}
    with torch.no_grad():
        for v in sd.values():
            v.zero_()
    _sync(dev)
    t0 = time.perf_counter()
    dcp.load(sd, checkpoint_id=path)
    _sync(dev)
    return {"restore_s": _slowest(time.perf_counter() - t0), "bitwise": bool(_slowest(not _equal(sd, ref)) == 0)}


def bench_dcp_async_pinned(rank, world, sd, base, saves, dev) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    # torchtitan 0.3's async_with_pinned_mem (components/checkpointer/dcp.py)
    on_gpu = dev == "cuda"
    stager = DefaultStager(StagingOptions(use_pinned_memory=on_gpu, use_shared_memory=True,
                                          use_async_staging=True, use_non_blocking_copy=on_gpu))
    deltas, stagings = [], []
    try:
        for step in range(saves + 1):
            _perturb(sd)
            _sync(dev)
            path = os.path.join(base, "dcp-async", f"step-{step}")
            t0 = time.perf_counter()
            resp = dcp.async_save(sd, checkpoint_id=path, async_checkpointer_type=AsyncCheckpointerType.PROCESS,
                                  async_stager=stager)
            d = time.perf_counter() - t0
            t1 = time.perf_counter()
            resp.staging_completion.result()  # type: ignore[union-attr]  # with async_stager: an AsyncSaveResponse
            s = time.perf_counter() - t1
            resp.upload_completion.result()  # type: ignore[union-attr]
            d, s = _slowest(d), _slowest(s)
            if step > 0:
                deltas.append(d)
                stagings.append(s)
    finally:
        stager.close()
    return {"delta_s": deltas, "staging_s": stagings,
            **_dcp_restore(sd, os.path.join(base, "dcp-async", f"step-{saves}"), dev)}


def bench_nvrx_local(rank, world, sd, base, saves, dev) -> dict:
    import torch
    from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncCallsQueue
    from nvidia_resiliency_ext.checkpointing.local.basic_state_dict import BasicTensorAwareStateDict
    from nvidia_resiliency_ext.checkpointing.local.ckpt_managers.local_manager import LocalCheckpointManager

    if dev != "cuda":
        return {"skipped": "BasicTensorAwareStateDict needs CUDA tensors"}
    mgr = LocalCheckpointManager(os.path.join(base, "nvrx"))
    queue = AsyncCallsQueue()
    deltas, finals = [], []
    try:
        for step in range(1, saves + 2):  # iterations start at 1 (find_latest returns -1 for none)
            _perturb(sd)
            _sync(dev)
            t0 = time.perf_counter()
            req = mgr.save(BasicTensorAwareStateDict(dict(sd)), step, is_async=True)  # its copy: the dict is mutated
            queue.schedule_async_request(req)
            d = time.perf_counter() - t0
            t1 = time.perf_counter()
            queue.maybe_finalize_async_calls(blocking=True)
            f = time.perf_counter() - t1
            d, f = _slowest(d), _slowest(f)
            if step > 1:
                deltas.append(d)
                finals.append(f)
        ref = {k: v.clone() for k, v in sd.items()}
        _sync(dev)
        t0 = time.perf_counter()
        latest = mgr.find_latest()
        tsd, _ = mgr.load()
        tsd.restore_tensor_device(non_blocking=False)
        with torch.no_grad():
            for k, v in sd.items():
                v.copy_(tsd.state_dict[k])
        _sync(dev)
        restore_s = _slowest(time.perf_counter() - t0)
    finally:
        queue.close()
    return {"delta_s": deltas, "background_s": finals, "restore_s": restore_s, "restored_step": latest,
            "bitwise": bool(_slowest(not _equal(sd, ref)) == 0)}


PEERS = {"tierckpt": bench_tierckpt, "dcp-sync": bench_dcp_sync, "dcp-async-pinned": bench_dcp_async_pinned,
         "nvrx-local": bench_nvrx_local}


# -- driver ---------------------------------------------------------------------------------------
def run_rank(rank: int, world: int, port: int, a: dict, out_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    import torch
    import torch.distributed as dist

    dev = "cpu" if a["cpu_dry_run"] else "cuda"
    if dev == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    t_start = time.monotonic()
    results: dict = {}
    try:
        for size in a["sizes_bytes"]:
            row: dict = {}
            for name in a["peers"]:
                if time.monotonic() - t_start > a["budget_s"]:
                    row[name] = {"skipped": f"time budget of {a['budget_s']:g}s spent"}
                    continue
                base = os.path.join(a["base"], f"{name}-{size}")
                sd = make_state(rank, size, a["tensors"], dev)
                try:
                    row[name] = PEERS[name](rank, world, sd, base, a["saves"], dev)
                except ImportError as e:
                    row[name] = {"skipped": f"not importable: {e}"}
                except Exception as e:  # a peer failing must not hide the others' numbers
                    row[name] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-2000:]}
                del sd
                dist.barrier()
                if rank == 0:
                    shutil.rmtree(base, ignore_errors=True)
                    _report(name, size, row[name])
                if dev == "cuda":
                    torch.cuda.empty_cache()
            results[str(size)] = row
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump(results, f)
    finally:
        dist.destroy_process_group()


def _report(name: str, size: int, r: dict) -> None:
    if "delta_s" not in r:
        print(f"[bench-gpu] {size / GiB:g} GiB {name}: {r.get('skipped') or r.get('error')}", flush=True)
        return
    med = statistics.median(r["delta_s"])  # "delta_s" holds one value per repetition
    extra = ", ".join(f"{k} {_median(v) if isinstance(v, list) else v}" for k, v in r.items()
                      if k not in ("delta_s", "trace"))
    print(f"[bench-gpu] {size / GiB:g} GiB/rank {name}: δ median {med * 1e3:.2f} ms "
          f"(max {max(r['delta_s']) * 1e3:.2f} ms); {extra}", flush=True)


def _summary_of(r: dict) -> dict:
    """One peer's numbers at one size: medians in the JSON, no trace."""
    if not r.get("delta_s"):
        return {k: v for k, v in r.items() if k != "trace"}
    out = {"delta_ms_median": round(statistics.median(r["delta_s"]) * 1e3, 3), "delta_ms_max": round(max(r["delta_s"]) * 1e3, 3)}
    for k, v in r.items():
        if isinstance(v, list) and k != "delta_s" and v:
            out[f"{k}_median"] = round(statistics.median(v), 4)
        elif k in ("restore_s", "bitwise", "source", "ok", "restored_step"):
            out[k] = round(v, 4) if isinstance(v, float) else v
    return out


def summarise(results: dict, a: dict, elapsed: float) -> dict:
    sizes = {f"{int(size) / GiB:g}GiB": {name: _summary_of(r) for name, r in row.items()}
             for size, row in results.items()}
    ours = [v["tierckpt"].get("delta_ms_median") for v in sizes.values() if "tierckpt" in v]
    met = bool(ours) and all(x is not None and x <= TARGET_DELTA_S * 1e3 for x in ours)
    return {"bench": "gpu", "device": a["device_name"], "ranks": a["ranks"], "saves": a["saves"],
            "cpu_dry_run": a["cpu_dry_run"], "target_delta_ms": TARGET_DELTA_S * 1e3,
            "target_met": met, "elapsed_s": round(elapsed, 1), "sizes": sizes}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes-gib", type=float, nargs="+", default=[1.0, 8.0], help="state per rank, GiB (default 1 8)")
    ap.add_argument("--ranks", type=int, choices=(1, 2), default=1, help="ranks on the one GPU (2: two nodes, F=2)")
    ap.add_argument("--tensors", type=int, default=8, help="bf16 tensors in the state (default 8)")
    ap.add_argument("--saves", type=int, default=3, help="measured saves after one warm-up (default 3)")
    ap.add_argument("--peers", nargs="+", default=list(PEERS), choices=list(PEERS), help="what to measure")
    ap.add_argument("--dir", default=None, help="parent of the temp dir (default: $TMPDIR or /tmp)")
    ap.add_argument("--budget-s", type=float, default=360.0,
                    help="skip the measurements not started after this many seconds (default 360)")
    ap.add_argument("--cpu-dry-run", action="store_true", help="CPU tensors at a tiny size (4 MiB): checks the script")
    a = ap.parse_args(argv)
    import torch
    import torch.multiprocessing as mp

    if a.cpu_dry_run:
        sizes, device_name = [4 << 20], "cpu (dry run)"
    else:
        if not torch.cuda.is_available():
            print("bench-gpu: no CUDA device (use --cpu-dry-run to check the script on CPU)", file=sys.stderr)
            return 2
        sizes, device_name = [int(g * GiB) for g in a.sizes_gib], torch.cuda.get_device_name(0)
    base = tempfile.mkdtemp(prefix="tierckpt-bench-gpu-", dir=a.dir)
    out_path = os.path.join(base, "results.json")
    args = {"sizes_bytes": sizes, "tensors": a.tensors, "saves": a.saves, "peers": a.peers, "base": base,
            "budget_s": a.budget_s, "cpu_dry_run": a.cpu_dry_run}
    t0 = time.time()
    print(f"[bench-gpu] {device_name}, {a.ranks} rank(s), sizes {[s / GiB for s in sizes]} GiB/rank, dir {base}",
          flush=True)
    try:
        port = _free_port()
        if a.ranks == 1:
            run_rank(0, 1, port, args, out_path)
        else:
            mp.spawn(run_rank, args=(a.ranks, port, args, out_path), nprocs=a.ranks, join=True)
        with open(out_path) as f:
            results = json.load(f)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    s = summarise(results, {**args, "device_name": device_name, "ranks": a.ranks}, time.time() - t0)
    for size, row in s["sizes"].items():
        d = row.get("tierckpt", {}).get("delta_ms_median")
        print(f"[bench-gpu] target δ ≤ {TARGET_DELTA_S * 1e3:g} ms at {size}: tierckpt δ median "
              f"{d} ms → {'met' if d is not None and d <= TARGET_DELTA_S * 1e3 else 'NOT met'}", flush=True)
    print(json.dumps(s), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
