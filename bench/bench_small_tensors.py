"""Many small tensors: a slot's first save against a steady one, and a local-tier save's
background work against ``dcp.save`` of the same state, measured in one run.

The state is ``--tensors`` fp32 tensors of 8x8 (half "model", half Adam-like "optim" entries,
plus param groups with a tuple and scalars), the shape of a state with many small parameters
(norms, biases, experts' gates). Two measurements, each a ratio against a baseline taken in
the same process, interleaved (A B A B …) so load drift on this shared machine does not favour
one side; each reports the median over ``--reps``:

1. **first / steady staging** (issue 32 §3: target ≤ 2): ``StagingSlot.stage`` (with the
   garbage collector paused, as ``save()`` stages) of a slot that
   never staged this structure (its host copy is allocated, ``tierckpt.staging.copy_plan.
   allocate_like``) against a slot that did (the copy plan refills it). Beside it, DCP's own
   ``DefaultStager.stage`` of the same state (what the first save cost before ``allocate_like``).
2. **background / dcp.save** (target ≤ 1.0): ``TieredCheckpointer.save(step, sd)`` then
   ``wait()`` on the local tier only (one gloo rank, its own node; DCP write, checksums, fsync,
   commit) against ``dcp.save(sd)`` to a directory on the same filesystem.

Usage::

    .venv/bin/python bench/bench_small_tensors.py [--tensors 2000 20000] [--reps 5] [--record]

``--record`` appends the table to bench/history/<YYYY-MM>.md. Exit status 1 when a target is
missed (the table says which).
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import torch  # noqa: E402

FIRST_TARGET, BACKGROUND_TARGET = 2.0, 1.0


def make_state(n: int) -> dict:
    """``n`` small fp32 tensors (8x8): ``n // 2`` model entries, ``n // 2`` optimizer entries."""
    g = torch.Generator().manual_seed(n)
    half = n // 2
    model = {f"layers.{i}.w": torch.randn(8, 8, generator=g) for i in range(half)}
    optim = {"state": {f"layers.{i}.w": {"exp_avg": torch.randn(8, 8, generator=g)} for i in range(n - half)},
             "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.95), "params": list(model)}]}
    return {"model": model, "optim": optim, "step": 1}


def staging(sd: dict, reps: int) -> dict:
    """Median seconds of a first stage, a steady stage and DCP's stager on ``sd``, interleaved."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    from tierckpt.staging.pool import StagingPool

    from tierckpt.gcpause import collector_paused

    fresh = StagingPool(reps)
    warm = StagingPool(1)
    slot = warm.acquire()
    slot.stage(sd, users=1)
    dcp_stager = DefaultStager(StagingOptions(False, False, False, False))
    out: dict[str, list[float]] = {"first": [], "steady": [], "dcp_stager": []}
    for r in range(reps):
        s = fresh._slots[r]
        # save() stages with the collector paused (tierckpt/tiers/saving.py): so do these
        with collector_paused():
            t = time.perf_counter()
            s.stage(sd, users=1)
            out["first"].append(time.perf_counter() - t)
        with collector_paused():
            t = time.perf_counter()
            slot.stage(sd, users=1)
            out["steady"].append(time.perf_counter() - t)
        if r < 2:  # seconds each at 20,000 tensors: two samples say enough
            t = time.perf_counter()
            dcp_stager.stage(sd)
            out["dcp_stager"].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in out.items()}


def background(sd: dict, reps: int, base: str) -> dict:
    """Median seconds of a local-tier save (save + wait) and of ``dcp.save`` of ``sd``, interleaved."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from tests.harness import free_port
    from tierckpt.config import TierConfig
    from tierckpt.engine import TieredCheckpointer

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    cfg = TierConfig(local_root=os.path.join(base, "local-{node}"), persistent_root=os.path.join(base, "pfs"),
                     tiers=("local",), replication_factor=1, busy_tier_policy="wait", job_id="bench-small",
                     keep_latest_k={"local": 2})
    out: dict[str, list[float]] = {"tierckpt": [], "dcp_save": []}
    with TieredCheckpointer(cfg) as eng:
        eng.save(0, sd)  # the first save allocates the slot: measured above, not here
        eng.wait()
        for r in range(reps):
            t = time.perf_counter()
            eng.save(r + 1, sd)
            eng.wait()
            out["tierckpt"].append(time.perf_counter() - t)
            d = os.path.join(base, f"dcp-{r}")
            t = time.perf_counter()
            dcp.save(sd, checkpoint_id=d)
            out["dcp_save"].append(time.perf_counter() - t)
            shutil.rmtree(d)
    return {k: statistics.median(v) for k, v in out.items()}


def render(rows: list[dict]) -> tuple[str, bool]:
    """A markdown table of ``rows`` and whether every target holds."""
    ok = True
    lines = ["| tensors | first stage s | steady stage s | first / steady | DCP stager s | "
             "local-tier save s | dcp.save s | tierckpt / dcp.save |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        fr = r["first"] / r["steady"]
        br = r["tierckpt"] / r["dcp_save"]
        ok &= fr <= FIRST_TARGET and br <= BACKGROUND_TARGET
        lines.append(f"| {r['n']} | {r['first']:.4f} | {r['steady']:.4f} | {fr:.2f} "
                     f"({'PASS' if fr <= FIRST_TARGET else 'FAIL'} ≤ {FIRST_TARGET}) | {r['dcp_stager']:.3f} | "
                     f"{r['tierckpt']:.2f} | {r['dcp_save']:.2f} | {br:.2f} "
                     f"({'PASS' if br <= BACKGROUND_TARGET else 'FAIL'} ≤ {BACKGROUND_TARGET}) |")
    return "\n".join(lines), ok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tensors", type=int, nargs="+", default=[2000, 20000], help="state sizes (default 2000 20000)")
    ap.add_argument("--reps", type=int, default=5, help="interleaved repetitions per measurement (default 5)")
    ap.add_argument("--dir", default=None, help="parent of the temp dir (default: $TMPDIR or /tmp)")
    ap.add_argument("--record", action="store_true", help="append the table to bench/history/<YYYY-MM>.md")
    args = ap.parse_args(argv)
    if args.reps < 1 or any(n < 2 for n in args.tensors):
        ap.error("--reps must be >= 1 and every --tensors >= 2")
    os.environ.setdefault("TIERCKPT_RANKS_PER_NODE", "1")
    t0 = time.time()
    load0 = os.getloadavg()[0]
    rows = []
    for n in args.tensors:
        sd = make_state(n)
        base = tempfile.mkdtemp(prefix="bench-small-", dir=args.dir)
        try:
            rows.append({"n": n, **staging(sd, args.reps), **background(sd, args.reps, base)})
        finally:
            shutil.rmtree(base, ignore_errors=True)
        print(f"[bench-small] {n} tensors: {rows[-1]}", flush=True)
    table, ok = render(rows)
    note = (f"torch {torch.__version__}, {os.cpu_count()} CPUs, load average {load0:.1f} → "
            f"{os.getloadavg()[0]:.1f}, medians of {args.reps} interleaved repetitions")
    print(table + "\n" + note)
    if args.record:
        cmd = "python bench/bench_small_tensors.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
        path = os.path.join(REPO, "bench", "history", time.strftime("%Y-%m", time.gmtime()) + ".md")
        with open(path, "a") as f:
            f.write(f"\n### Many small tensors (`make bench-small`), {time.strftime('%Y-%m-%d %H:%M', time.gmtime())} "
                    f"UTC\n\n`{cmd.strip()}` ({time.time() - t0:.0f} s)\n\n{table}\n\n{note}\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
