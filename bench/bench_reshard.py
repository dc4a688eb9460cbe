"""Resharded restore benchmark: in-cluster (node-local copies) vs the persistent tier, same step, same run.

A job of ``--save-nodes`` gloo ranks (one per simulated node, ``replication_factor`` 2) saves a
sharded state — ``--tensors`` fp32 DTensors sharded on dim 0 over all ranks, ``--mib-per-rank``
MiB per rank, rows that do not divide evenly — to the local tier (with replicas) and to the
persistent tier at one step. The last node is then lost for good (its local root deleted), and
a job of one node fewer restores that step, alternately (ABBA, ``--reps`` of each):

- **in-cluster**: the engine as configured (local + persistent tiers): every rank reads the
  chunks its new shards need from its node's copies or from a holder node
  (tierckpt.restore.cluster); the run fails if a single persistent byte is read;
- **persistent**: the same engine with only the persistent tier configured (the local copies
  are not consulted): DCP's resharded read of the global checkpoint.

Before every restore the page cache of every checkpoint file (local roots and persistent root)
is dropped with ``posix_fadvise(POSIX_FADV_DONTNEED)``, so both read from the disk. Every
restored shard is compared bitwise with its expected values (a function of the global index).
The time of a restore is ``RestoreResult.seconds`` of the slower rank; the reported value is
the median. The persistent root sits on the same disk as the local roots here, so the ratio is
a lower bound on the gain over a parallel file system.

Usage::

    .venv/bin/python bench/bench_reshard.py [--mib-per-rank 256] [--save-nodes 4] [--reps 2] [--record]

``--record`` appends the results to bench/history/<YYYY-MM>.md.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shlex
import shutil
import statistics
import sys
import tempfile
import time

BENCH = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH)
for p in (REPO, BENCH):
    if p not in sys.path:
        sys.path.insert(0, p)

from bench_engine import RESULTS_MD, disk, machine, md_table, run_ranks  # noqa: E402

MiB = 1 << 20
STEP = 7
TARGET = 1.0  # in-cluster must at least not be slower than the persistent tier on the same disk


# ------------------------------------------------------------------------------------ rank side
def _shapes(args: dict) -> list[tuple[int, int]]:
    """Global (rows, cols) of each tensor: rows not divisible by 2, 3 or 4 ranks."""
    cols = 1024
    per_tensor = args["mib_per_rank"] * MiB * args["save_nodes"] // args["tensors"]
    rows = max(7, per_tensor // (4 * cols))
    rows += (1 - rows % 2) + (0 if rows % 3 else 1)  # odd, and not a multiple of 3
    return [(rows + 2 * i, cols) for i in range(args["tensors"])]


def _values(i: int, row0: int, rows: int, cols: int):
    """The expected values of tensor ``i``'s rows [row0, row0 + rows): a function of the global index."""
    import torch

    idx = torch.arange(row0 * cols, (row0 + rows) * cols, dtype=torch.int64)
    return ((idx * 2654435761 + i) % 1000003).to(torch.float32).reshape(rows, cols)


def _state(world: int, rank: int, args: dict, fill: bool) -> dict:
    """{name: DTensor sharded on dim 0 over all ranks} (torch.chunk's split: ceil(rows / world))."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for i, (rows, cols) in enumerate(_shapes(args)):
        per = -(-rows // world)
        r0, r1 = min(rows, rank * per), min(rows, (rank + 1) * per)
        local = _values(i, r0, r1 - r0, cols) if fill else torch.full((r1 - r0, cols), -1.0)
        out[f"layer{i}.weight"] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                                                     shape=torch.Size((rows, cols)), stride=(cols, 1))
    return out


def _config(base: str, tiers: tuple[str, ...], factor: int = 1):
    from tierckpt.config import TierConfig

    return TierConfig(local_root=os.path.join(base, "nvme", "node-{node}"), persistent_root=os.path.join(base, "pfs"),
                      tiers=tiers, replication_factor=factor, job_id="bench-reshard")


def rank_save(rank: int, world: int, args: dict) -> dict:
    """Save every tier of step STEP on ``world`` nodes."""
    from tierckpt.engine import TieredCheckpointer

    eng = TieredCheckpointer(_config(args["base"], ("local", "persistent"), factor=2), node_id=rank)
    h = eng.save(STEP, _state(world, rank, args, fill=True))
    h.wait()
    eng.close()
    return {"ok": True}


def _drop_cache(root: str) -> None:
    for d, _, files in os.walk(root):
        for f in files:
            try:
                fd = os.open(os.path.join(d, f), os.O_RDONLY)
            except OSError:
                continue
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def rank_restore(rank: int, world: int, args: dict) -> dict:
    """Restore step STEP with the engine configured for ``args["mode"]``; check every value."""
    import torch
    import torch.distributed as dist

    from tierckpt.cluster.collectives import all_gather
    from tierckpt.engine import TieredCheckpointer

    tiers = ("local", "persistent") if args["mode"] == "in-cluster" else ("persistent",)
    eng = TieredCheckpointer(_config(args["base"], tiers), node_id=rank)
    sd = _state(world, rank, args, fill=False)
    if rank == 0:
        _drop_cache(args["base"])
    dist.barrier()
    res = eng.restore(sd)
    assert res is not None and res.step == STEP, res
    kinds = {o.source.kind for o in res.sources.values()}
    assert kinds == {args["mode"]}, f"restored from {kinds}, wanted {args['mode']}"
    if args["mode"] == "in-cluster":
        assert res.persistent_bytes_read == 0, res.persistent_bytes_read
    for i, (name, t) in enumerate(sorted(sd.items(), key=lambda kv: int(kv[0][5:].split(".")[0]))):
        rows, cols = t.shape
        per = -(-rows // world)
        r0 = min(rows, rank * per)
        assert torch.equal(t.to_local(), _values(i, r0, t.to_local().shape[0], cols)), f"{name} differs"
    secs = max(all_gather(res.seconds, dist.group.WORLD))
    eng.close()
    return {"seconds": secs, "persistent_bytes": res.persistent_bytes_read,
            "bytes": sum(o.bytes for o in res.sources.values())}


# ------------------------------------------------------------------------------------- driver
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib-per-rank", type=int, default=256, help="state per saving rank, MiB (default 256)")
    ap.add_argument("--save-nodes", type=int, default=4, help="nodes of the saving job (default 4); restore on one fewer")
    ap.add_argument("--tensors", type=int, default=4, help="sharded fp32 tensors (default 4)")
    ap.add_argument("--reps", type=int, default=2, help="restores of each kind, ABBA order (default 2)")
    ap.add_argument("--dir", default=None, help="parent of the temp dir (default: $TMPDIR or /tmp)")
    ap.add_argument("--record", action="store_true", help="append the results to bench/history/<YYYY-MM>.md")
    ap.add_argument("--timeout", type=float, default=900, help="per-job timeout, seconds (default 900)")
    a = ap.parse_args(argv)
    if a.save_nodes < 3:
        ap.error("--save-nodes must be >= 3 (the restoring job has one node fewer and replication_factor 2 "
                 "needs an even node count on the saving side)")
    base = tempfile.mkdtemp(prefix="tierckpt-bench-reshard-", dir=a.dir)
    args = dict(mib_per_rank=a.mib_per_rank, save_nodes=a.save_nodes, tensors=a.tensors, base=base, threads=1)
    t0 = time.time()
    samples: dict[str, list[float]] = {"in-cluster": [], "persistent": []}
    try:
        print(f"bench dir {base}: saving on {a.save_nodes} nodes, {a.mib_per_rank} MiB per rank", flush=True)
        run_ranks(args, world=a.save_nodes, timeout=a.timeout, target=rank_save)
        shutil.rmtree(os.path.join(base, "nvme", f"node-{a.save_nodes - 1}"))  # the lost node
        order = ("ABBA" * a.reps)[: 2 * a.reps]
        for j, which in enumerate(order):
            mode = "in-cluster" if which == "A" else "persistent"
            out = run_ranks({**args, "mode": mode}, world=a.save_nodes - 1, timeout=a.timeout, target=rank_restore)
            samples[mode].append(out[0]["seconds"])
            print(f"[bench] restore {j + 1}/{len(order)} {mode}: {out[0]['seconds']:.2f} s", flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    ic, pf = statistics.median(samples["in-cluster"]), statistics.median(samples["persistent"])
    rows = [[f"{a.save_nodes} → {a.save_nodes - 1} nodes, {a.mib_per_rank} MiB per saving rank",
             f"{ic:.2f} s", f"{pf:.2f} s", f"{ic / pf:.2f}", f"≤ {TARGET:.2f}", "PASS" if ic / pf <= TARGET else "FAIL"]]
    head = ["resharded restore", "in-cluster (median)", "persistent (median)", "in-cluster / persistent", "target", "result"]
    print(md_table(head, rows))
    if a.record:
        _record(a, head, rows, samples, time.time() - t0, argv)
    return 0


def _record(a, head, rows, samples, elapsed, argv) -> None:
    m = machine()
    cmd = " ".join(shlex.quote(x) for x in [".venv/bin/python", "bench/bench_reshard.py"]
                   + (sys.argv[1:] if argv is None else list(argv)))
    when = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    text = (f"\n## Resharded restore, run {when}\n\nCommand: `{cmd}`; elapsed {elapsed:.0f} s; load average at the "
            f"end {load} (other jobs on the machine slow the CPU-bound in-cluster path more than the persistent "
            f"read). Machine: "
            f"`nproc` = {m['nproc']}; {m['mem']}; CPU: {m['cpu']}; torch {m['torch']}. Page cache of every "
            f"checkpoint file dropped before each restore; persistent root on the same disk (a lower bound on "
            f"the gain).\n\n{md_table(head, rows)}\n\nSamples (s, slower rank): `{samples}`  \n"
            f"Bench dir filesystem:\n```\n{disk(a.dir or tempfile.gettempdir())}\n```\n")
    with open(RESULTS_MD, "a") as f:
        f.write(text)
    print(f"recorded to {RESULTS_MD}")


if __name__ == "__main__":
    sys.exit(main())
