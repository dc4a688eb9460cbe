"""Control-plane benchmark: what tierckpt's agreements cost as the job grows (docs/control-plane.md).

The state is tiny (one 64-element fp32 tensor per rank), so what is measured is the control
plane: the collectives that plan and agree, not the bytes of a checkpoint. For every world size
W in ``--worlds`` (default 2 4 8 16 gloo processes on this machine) and every simulated node
size R in ``--rpn`` (default 1 and 2 ranks per node; N = W / R nodes), one job measures:

- **start-up**: ``tierckpt.cluster.topology.discover`` (label all-gather + creation of the
  engine's gloo groups: 3 all-ranks groups, N node groups, and with R > 1 the leaders groups
  and the persistent worker's node groups), then the whole ``TieredCheckpointer(...)``
  construction (discover again + roots, lineage, shared-storage probe, ``run_start``);
- **save agreement**: the records exchange of one local-tier save as the engine runs it now
  (``replicate``'s node flags + ``TierJobs._record``'s stats, both through
  :func:`tierckpt.cluster.collectives.gather_reduced` over ``local_world``, node-leader exchange
  when R > 1), and the same two exchanges as flat ``all_gather_object`` over ``local_world``
  (what the code did before), alternated A B A B in the same run;
- **restore planning**: ``engine.inventory()`` (leaders' listings exchanged) +
  ``plan_restore`` after a local-tier save of step 1, and a whole ``engine.restore()`` of the
  tiny state (inventory, plan, verification, DCP load, outcome agreement, ledger record).

Each sample is the slowest rank's time of one repetition (every repetition starts after a
barrier; the per-rank times are max-reduced outside the timing); the table gives medians.
A least-squares fit of each series against W is made twice — ``a + b·log2 W`` (tree-like:
cost grows with the number of rounds) and ``a + b·W`` (gather-like: every rank receives
W entries, gloo's ring all-gather takes W−1 steps) — the one with the smaller residual is kept
and extrapolated to 16,384 ranks (2,048 nodes × 8 ranks). With only four small W the two fits
are hard to tell apart and the extrapolation is an order of magnitude, not a prediction.

W above the core count oversubscribes the CPU (16 processes on 2 cores): every collective
step waits for the OS to schedule the peer, so the large-W points are pessimistic and
dominated by scheduling; the output says so.

Usage::

    .venv/bin/python bench/bench_control.py [--worlds 2 4 8 16] [--rpn 1 2] [--reps 15] [--record]

``--record`` appends the table and the method to bench/history/<YYYY-MM>.md.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import shlex
import statistics
import sys
import tempfile
import time

BENCH = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH)
for p in (REPO, BENCH):
    if p not in sys.path:
        sys.path.insert(0, p)

from bench_engine import RESULTS_MD, machine, md_table, run_ranks  # noqa: E402

TARGET_W, TARGET_R = 16384, 8  # extrapolation target: 2,048 nodes × 8 ranks


# ------------------------------------------------------------------------------------ rank side
def rank_main(rank: int, world: int, args: dict) -> dict:
    """One job: start-up, save agreement (tree and flat), restore planning; per-repetition
    samples of the slowest rank (seconds)."""
    import torch
    import torch.distributed as dist

    from tierckpt import TierConfig, TieredCheckpointer
    from tierckpt.cluster.collectives import all_gather, gather_reduced
    from tierckpt.cluster.topology import discover
    from tierckpt.restore.plan import plan_restore
    from tierckpt.tiers.jobs import merge_stats
    from tierckpt.tiers.replication import _and_by_node

    rpn, reps, base = args["rpn"], args["reps"], args["dir"]
    nodes = world // rpn

    def slowest(x: float) -> float:
        t = torch.tensor([x], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    def timed(fn) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        return slowest(time.perf_counter() - t0)

    out: dict = {"discover": [], "engine": []}
    factor = 2 if nodes >= 2 else 1
    out["discover"].append(timed(lambda: discover(1, factor, node_id=rank // rpn, timeout_s=120)))
    cfg = TierConfig(local_root=os.path.join(base, "nvme", "node-{node}"), persistent_root=os.path.join(base, "pfs"),
                     job_id="ctl", replication_factor=factor, simulated_ranks_per_node=rpn,
                     collective_timeout_s=120, local_wait_timeout_s=60)
    box: list = []
    out["engine"].append(timed(lambda: box.append(TieredCheckpointer(cfg))))
    eng = box[0]
    topo, world_group = eng.topo, eng.groups.local_world

    def tree_agreement():
        gather_reduced({topo.node: True}, world_group, _and_by_node)
        gather_reduced((rank, True, None, 4096 if topo.is_node_leader else 0, 0.01, 0.002), world_group, merge_stats)

    def flat_agreement():
        all_gather((topo.node, True), world_group)
        all_gather((True, None, 4096 if topo.is_node_leader else 0, 0.01, 0.002), world_group)

    out["save_tree"], out["save_flat"] = [], []
    for _ in range(reps):
        out["save_tree"].append(timed(tree_agreement))
        out["save_flat"].append(timed(flat_agreement))

    # the same values on every rank: DCP saves a plain (non-DTensor) tensor once per save group
    state = {"w": torch.arange(64, dtype=torch.float32)}
    eng.save(1, state, tiers=["local"])
    eng.wait(bounded=False)
    out["plan"] = [timed(lambda: plan_restore(eng.inventory(), topo.nodes, set(), None, world_size=topo.world_size))
                   for _ in range(reps)]
    res: list = []
    out["restore"] = []
    for _ in range(max(3, reps // 3)):
        target = {"w": torch.zeros(64)}
        out["restore"].append(timed(lambda: res.append(eng.restore(target))))
        assert torch.equal(target["w"], state["w"]), "restored state differs"
    out["restore_source"] = res[-1].source_of(topo.node) if res and res[-1] is not None else None
    eng.close()
    return out


# ----------------------------------------------------------------------------------- driver side
def fit(ws: list[int], ys: list[float]) -> dict:
    """Least-squares fits of ``ys`` (seconds) against ``ws``: ``a + b·log2 W`` and ``a + b·W``.
    Returns {"log": (a, b, rms), "lin": (a, b, rms), "best": "log" | "lin"}."""
    def ls(xs):
        n = len(xs)
        mx, my = sum(xs) / n, sum(ys) / n
        sxx = sum((x - mx) ** 2 for x in xs)
        b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
        a = my - b * mx
        rms = math.sqrt(sum((a + b * x - y) ** 2 for x, y in zip(xs, ys)) / n)
        return a, b, rms

    out = {"log": ls([math.log2(w) for w in ws]), "lin": ls([float(w) for w in ws])}
    out["best"] = "log" if out["log"][2] <= out["lin"][2] else "lin"
    return out


def extrapolate(f: dict, w: float) -> float:
    """The better fit's value at ``w`` (the same variable it was fitted on)."""
    a, b, _ = f[f["best"]]
    return a + b * (math.log2(w) if f["best"] == "log" else w)


SERIES = [("discover", "start-up: discover() groups"), ("engine", "start-up: TieredCheckpointer()"),
          ("save_tree", "save agreement (node-leader)"), ("save_flat", "save agreement (flat all_gather)"),
          ("plan", "restore planning (inventory + plan)"), ("restore", "restore() of a tiny state")]


def main(argv=None) -> int:
    """Run the jobs, print the tables (medians in ms, fits, extrapolation); ``--record``."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8, 16])
    ap.add_argument("--rpn", type=int, nargs="+", default=[1, 2], help="simulated ranks per node")
    ap.add_argument("--reps", type=int, default=15, help="repetitions of each agreement measurement")
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temporary one)")
    ap.add_argument("--record", action="store_true", help="append the results to bench/history/<YYYY-MM>.md")
    a = ap.parse_args(argv)
    t0 = time.time()
    cores = os.cpu_count() or 1
    if max(a.worlds) > cores:
        print(f"NOTE: up to {max(a.worlds)} processes on {cores} cores: the CPU is oversubscribed, large-W samples "
              "include OS scheduling of the peers (pessimistic)", flush=True)
    med: dict[tuple[int, int], dict[str, float]] = {}
    for rpn in a.rpn:
        for w in a.worlds:
            if w % rpn or w // rpn < 1:
                continue
            with tempfile.TemporaryDirectory(dir=a.dir) as d:
                t1 = time.time()
                res = run_ranks({"rpn": rpn, "reps": a.reps, "dir": d, "threads": 1}, world=w, timeout=600,
                                target=rank_main)
            r0 = res[0]
            med[(w, rpn)] = {k: statistics.median(r0[k]) for k, _ in SERIES}
            print(f"W={w:2d} R={rpn}: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in med[(w, rpn)].items())
                  + f"  (restore source node 0: {r0['restore_source']}; {time.time() - t1:.0f}s)", flush=True)
    rows, fits = [], []
    for rpn in a.rpn:
        ws = [w for w in a.worlds if (w, rpn) in med]
        for key, label in SERIES:
            ys = [med[(w, rpn)][key] for w in ws]
            rows.append([label, str(rpn)] + [f"{y * 1e3:.1f}" for y in ys])
            if len(ws) >= 3:
                f = fit(ws, ys)
                la, lb, lr = f["log"]
                na, nb, nr = f["lin"]
                fits.append([label, str(rpn), f"{la * 1e3:.1f} + {lb * 1e3:.2f}·log2 W (rms {lr * 1e3:.2f})",
                             f"{na * 1e3:.1f} + {nb * 1e3:.3f}·W (rms {nr * 1e3:.2f})",
                             "log" if f["best"] == "log" else "linear",
                             f"{extrapolate(f, TARGET_W):.3g} s"])
    head = ["measure (median ms, slowest rank)", "R"] + [f"W={w}" for w in a.worlds]
    fhead = ["measure", "R", "fit a + b·log2 W", "fit a + b·W", "better fit", f"at W={TARGET_W} (log/linear in W)"]
    print()
    print(md_table(head, rows))
    print()
    print(md_table(fhead, fits))
    ratios = [f"W={w} R={r}: flat/node-leader {med[(w, r)]['save_flat'] / med[(w, r)]['save_tree']:.2f}"
              for (w, r) in sorted(med) if med[(w, r)]["save_tree"] > 0]
    print("\nsave agreement, flat vs node-leader (same run, alternated): " + "; ".join(ratios))
    elapsed = time.time() - t0
    print(f"elapsed {elapsed:.0f}s")
    if a.record:
        _record(a, head, rows, fhead, fits, ratios, elapsed, argv)
    return 0


def _record(a, head, rows, fhead, fits, ratios, elapsed, argv) -> None:
    m = machine()
    cmd = " ".join(shlex.quote(x) for x in [".venv/bin/python", "bench/bench_control.py"]
                   + (sys.argv[1:] if argv is None else list(argv)))
    when = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    text = (f"\n## Control plane at scale, run {when}\n\nCommand: `{cmd}`; elapsed {elapsed:.0f} s; load average at "
            f"the end {load}. Machine: `nproc` = {m['nproc']}; {m['mem']}; CPU: {m['cpu']}; torch {m['torch']}.\n\n"
            "Method (bench/bench_control.py): one gloo job per (W, R), a tiny state (64 fp32 per rank) so the "
            "control plane is what is timed; each sample is the slowest rank's time of one repetition after a "
            "barrier; medians. Save agreement: replicate's node flags + the save record's stats, through the "
            "node-leader exchange and as flat all_gather_object, alternated in the same job. Restore planning: "
            "inventory() + plan_restore after a local save; restore(): the whole tiny restore. Fits: least squares "
            f"a + b·log2 W and a + b·W, the smaller residual kept, extrapolated to W = {TARGET_W} "
            f"({TARGET_W // TARGET_R} nodes × {TARGET_R}); four small W: an order of magnitude only. "
            f"W > nproc oversubscribes the CPU (pessimistic at large W).\n\n{md_table(head, rows)}\n\n"
            f"{md_table(fhead, fits)}\n\n" + "; ".join(ratios) + "\n")
    with open(RESULTS_MD, "a") as f:
        f.write(text)
    print(f"recorded to {RESULTS_MD}")


if __name__ == "__main__":
    sys.exit(main())
