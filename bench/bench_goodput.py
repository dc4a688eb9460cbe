"""Goodput under node failures, side by side (issue 32 §1, ``make bench-goodput``).

The torchtitan demo (llama3 debug model, 2 simulated nodes × 1 CPU rank, FSDP2 over gloo; the
job of ``configs/titan_demo.toml``) trains under seeded Poisson node failures at compressed
MTBFs (``--mtbf``, default 60 and 180 s), for every seed (``--seeds``, ≥ 3 by default) and
every system (``--systems``, :mod:`bench.goodput.systems`): tierckpt adaptive with default
settings, tierckpt at fixed local intervals (a sweep), torchtitan's stock DCP async
checkpointing at a sweep of intervals, and torchft (a row that says why it has no number).

- **Failures** (:mod:`bench.goodput.failures`): the same failure times for every system of a
  (MTBF, seed) cell, counted from each run's first step; a failure SIGKILLs one node's rank and
  deletes that node's local disk; the launcher restarts the job from warm node agents.
- **Each system in its own run**: its own ``LocalLauncher`` run, dump folder, node disks.
  Systems run in alternating order from seed to seed (load drift on this shared machine does
  not always favour the same one); a failure-free, checkpoint-free reference run opens every
  cell and gives its ``t_ref``.
- **Shared storage as on a cluster** (:mod:`bench.goodput.throttle`): the persistent/shared
  folder (``<dump>/checkpoint``: tierckpt's persistent tier, torchtitan's checkpoint folder)
  sits behind one FIFO link of ``--shared-mb-per-s`` (default 200 MB/s) shared by all nodes;
  node-local disks are unthrottled.
- **ETTR and waste** (:mod:`bench.goodput.accounting`): from each run's step log,
  ETTR = final step × t_step / wall time (t_step: the run's own quiet step time); the rest of the wall time split into blocking
  stalls, background slowdown, lost work, restart phases, restore, other.

``--steps 0`` (default) sizes the runs so that failure-free training lasts
``--failures-expected`` MTBFs (of the first cell's ``t_ref``). ``--quick``: one 20 s MTBF,
one seed, four systems, 2 MTBFs of training (a smoke run of the whole path, minutes).
``--record`` appends the tables to ``bench/history/<YYYY-MM>.md`` with a PNG of useful steps
against wall time per system (``bench/history/goodput-<UTC stamp>.png``). Exit status 0 when
the stock and fixed-interval targets passed at every MTBF, 1 otherwise (also when one could not
be checked); the torchft target is reported, not checked, while its row does not run.

Usage::

    .venv/bin/python bench/bench_goodput.py [--mtbf 60,180] [--seeds 1,2,3] [--systems …] [--quick] [--record]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import shutil
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from bench import bench_schedule as bs  # noqa: E402
from bench.bench_engine import history_md  # noqa: E402
from bench.goodput import report, systems as sysmod  # noqa: E402
from bench.goodput.failures import failure_plan  # noqa: E402
from bench.goodput.runner import RunParams, measure_reference, run_system  # noqa: E402

QUICK = {"mtbf": "20", "seeds": "1", "systems": ",".join(sysmod.QUICK_SYSTEMS), "failures_expected": 2.0}


def _floats(opt: str, spec: str) -> list[float]:
    try:
        vals = [float(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{opt} must be comma-separated numbers, got {spec!r}") from None
    if not vals or not all(v > 0 for v in vals):
        raise ValueError(f"{opt} must name at least one value, each > 0, got {spec!r}")
    return vals


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Parse and check the command line (``--quick`` fills in its defaults first).

    Raises:
        SystemExit: a bad option (argparse's message names it and the allowed values).
    """
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mtbf", default="60,180", help="injected MTBFs, seconds of wall time, comma-separated")
    ap.add_argument("--seeds", default="1,2,3", help="seeds of the failure times, comma-separated integers")
    ap.add_argument("--systems", default=",".join(sysmod.DEFAULT_SYSTEMS),
                    help=f"comma-separated; allowed: {', '.join(sysmod.KINDS)}")
    ap.add_argument("--steps", type=int, default=0, help="training steps per run (0 = failures-expected MTBFs)")
    ap.add_argument("--failures-expected", type=float, default=3.0,
                    help="with --steps 0: failure-free training time in MTBFs")
    ap.add_argument("--shared-mb-per-s", type=float, default=200.0,
                    help="bandwidth of the shared folder, MB/s (10^6 B/s), shared by all nodes")
    ap.add_argument("--cap", type=float, default=4.0, help="stop a run after cap × steps × t_ref seconds")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds to the first step (imports included)")
    ap.add_argument("--quick", action="store_true", help="one 20 s MTBF, one seed, four systems, 2 MTBFs")
    ap.add_argument("--out", default=os.path.join(REPO, "outputs", "bench-goodput"), help="output folder")
    ap.add_argument("--record", action="store_true", help="append to bench/history/<YYYY-MM>.md with a PNG")
    ap.add_argument("--from-report", metavar="OUT", default=None,
                    help="no training: the tables of OUT/report.json (an earlier or interrupted campaign, the "
                         "cells it finished); with --record, record them")
    args = ap.parse_args(argv)
    if args.quick:
        given = set(argv if argv is not None else sys.argv[1:])
        for k, v in QUICK.items():
            if "--" + k.replace("_", "-") not in given:
                setattr(args, k, v)
    try:
        args.mtbfs = _floats("--mtbf", args.mtbf)
        args.seed_list = [int(s) for s in args.seeds.split(",") if s.strip()]
        args.system_list = sysmod.parse_systems(args.systems)
        for opt, v in (("--failures-expected", args.failures_expected), ("--shared-mb-per-s", args.shared_mb_per_s),
                       ("--cap", args.cap), ("--timeout", args.timeout)):
            if not v > 0:
                raise ValueError(f"{opt} must be > 0, got {v}")
        if args.steps < 0:
            raise ValueError(f"--steps must be >= 0 (0 = sized from the MTBF), got {args.steps}")
    except ValueError as e:
        ap.error(str(e).replace("invalid literal for int() with base 10", "--seeds must be integers"))
    if not args.seed_list:
        ap.error("--seeds must name at least one integer seed")
    return args


def skipped_row(system, mtbf: float, seed: int, why: str) -> dict:
    return {"system": system.name, "mtbf_s": mtbf, "seed": seed, "skipped": why}


def failure_reason(text: str) -> str:
    """A failed run's row text: the launcher's first line and the rank's last exception line."""
    lines = text.splitlines()
    errs = [ln.strip() for ln in lines if re.match(r"\s*[\w.]+(Error|Exception): ", ln)]
    return "failed: " + lines[0][:200] + (f" — {errs[-1][:300]}" if errs else "") if lines else "failed"


def run_cell(demo, args, mtbf: float, seed: int, k: int, steps: int | None) -> tuple[list[dict], int]:
    """The reference and every system of one (MTBF, seed) cell; returns (rows, steps)."""
    out = os.path.join(args.out, f"mtbf-{mtbf:g}", f"seed-{seed}")
    os.makedirs(out, exist_ok=True)
    p = RunParams(steps=steps or 1, shared_bps=args.shared_mb_per_s * 1e6, cap=args.cap, timeout_s=args.timeout)
    ref = measure_reference(demo, out, p)
    if not steps:
        steps = args.steps or max(20, math.ceil(args.failures_expected * mtbf / ref["t_ref"]))
    p.steps = steps
    print(f"[bench-goodput] MTBF {mtbf:g} s, seed {seed}: t_ref = {ref['t_ref']:.3f} s, {steps} steps", flush=True)
    plan = failure_plan(mtbf, seed)
    rows = []
    order = args.system_list if k % 2 == 0 else args.system_list[::-1]
    for system in order:
        if not system.runnable:
            rows.append(skipped_row(system, mtbf, seed, sysmod.torchft_status()))
            continue
        load = os.getloadavg()[0]
        t0 = time.time()
        try:
            r = run_system(demo, out, system, plan, p, ref["t_ref"])
        except RuntimeError as e:
            print(f"[bench-goodput] {system.name}: {e}", file=sys.stderr, flush=True)
            rows.append(skipped_row(system, mtbf, seed, failure_reason(str(e))))
            continue
        r.update(mtbf_s=mtbf, seed=seed, load_before=load, load_after=os.getloadavg()[0], run_s=time.time() - t0,
                 reference=ref)
        print(f"[bench-goodput] {system.name}: ETTR {r['ettr']:.3f}, {r['failures']} failures, "
              f"wall {r['wall_s']:.0f} s, load {load:.1f}", flush=True)
        rows.append(r)
    order_names = [s.name for s in args.system_list]
    rows.sort(key=lambda r: order_names.index(r["system"]))
    return rows, steps


def load_range(rows: list[dict]) -> str:
    """The 1-minute load averages the runs of ``rows`` started and ended under, as "a – b" ("" if none)."""
    loads = [r[k] for r in rows for k in ("load_before", "load_after") if isinstance(r.get(k), (int, float))]
    return f"{min(loads):.1f} – {max(loads):.1f}" if loads else ""


def setup_text(args, steps: dict, t0: float, loads: tuple[float, float], rows: list[dict] | None = None) -> str:
    """The record's setup paragraph: machine, load, model, failures, storage model, sizes."""
    import platform

    per_run = load_range(rows or [])
    return (f"Machine: {os.cpu_count()} CPUs ({platform.machine()}), shared with other agents: load average "
            f"{loads[0]:.1f} at the start, {loads[1]:.1f} at the end"
            f"{f', {per_run} at the starts and ends of the runs (each run: notes column)' if per_run else ''}; "
            f"the step time moves with that load, so compare ETTRs and ratios within this campaign only "
            f"(every ETTR against its own run's quiet step time). torchtitan demo "
            f"(llama3 debug model), 2 simulated nodes × 1 CPU rank, FSDP2 over gloo, warm node agents "
            f"(launch/local.py). Failures: Poisson, MTBF {', '.join(f'{m:g}' for m in args.mtbfs)} s, seeds "
            f"{args.seeds}, the same times for every system; kill + wiped local disk of one node. Shared folder "
            f"(persistent tier / torchtitan's checkpoint folder) behind one {args.shared_mb_per_s:g} MB/s link "
            f"shared by both nodes (bench/goodput/throttle.py); local disks unthrottled. Steps per run: "
            f"{', '.join(f'{s} at MTBF {m:g} s' for m, s in steps.items())}; cap {args.cap:g} × steps × t_ref. "
            f"ETTR = final step × t_step / wall time (t_step: the run's own quiet step time, ≥ 3 steps past a save; "
            f"the cell's failure-free reference run's when too few); "
            f"waste buckets as shares of the wall time (bench/goodput/accounting.py). Elapsed "
            f"{time.time() - t0:.0f} s.")


def finish(args, argv: list[str] | None, rows: list[dict], setup: str) -> int:
    """Print the tables, ``--record`` them with the plot; the exit status (see the module doc)."""
    text = report.summary_table(rows) + "\n\n" + report.rows_table(rows)
    print(setup + "\n\n" + text)
    if args.record:
        stamp = time.strftime("%Y%m%d-%H%M", time.gmtime())
        png = os.path.join(REPO, "bench", "history", f"goodput-{stamp}.png")
        report.plot(rows, png)
        cmd = "bench/bench_goodput.py " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
        title = f"Goodput under node failures (`make bench-goodput`), {time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC"
        os.makedirs(os.path.dirname(history_md()), exist_ok=True)
        with open(history_md(), "a") as f:
            f.write(report.record_entry(title, cmd.strip(), setup, rows, os.path.basename(png)))
        print(f"recorded to {history_md()} with {png}")
    checked = [v for ver in report.verdict(rows).values() for v in (ver["stock_ok"], ver["fixed_ok"])]
    return 0 if checked and all(v is True for v in checked) else 1


def from_report(args, argv: list[str] | None) -> int:
    """``--from-report OUT``: the tables (and with ``--record`` the entry) of a campaign's report.json."""
    with open(os.path.join(args.from_report, "report.json")) as f:
        rep = json.load(f)
    rows = rep["rows"]
    per_run = load_range(rows)
    setup = rep.get("setup") or (f"From {args.from_report}/report.json ({len(rows)} rows; the campaign's own "
                                 f"arguments: {rep.get('args')}). Machine: {os.cpu_count()} CPUs, shared with "
                                 f"other agents" + (f": load average {per_run} at the starts and ends of the "
                                                    f"runs (notes column)" if per_run else "") +
                                 "; compare ETTRs and ratios within this campaign only.")
    return finish(args, argv, rows, setup)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_report:
        return from_report(args, argv)
    demo = bs._load_demo()
    shutil.rmtree(args.out, ignore_errors=True)
    os.makedirs(args.out)
    t0, load0 = time.time(), os.getloadavg()[0]
    rows: list[dict] = []
    steps: dict[float, int] = {}
    report_json = os.path.join(args.out, "report.json")
    saved_args = {k: v for k, v in vars(args).items() if k != "system_list"}
    for mtbf in args.mtbfs:
        for k, seed in enumerate(args.seed_list):
            cell, steps[mtbf] = run_cell(demo, args, mtbf, seed, k, steps.get(mtbf))
            rows += cell
            with open(report_json, "w") as f:  # kept as it grows
                json.dump({"args": saved_args, "rows": rows}, f, indent=1, default=str)
    setup = setup_text(args, steps, t0, (load0, os.getloadavg()[0]), rows)
    with open(report_json, "w") as f:  # complete: --from-report reuses the setup paragraph
        json.dump({"args": saved_args, "rows": rows, "setup": setup}, f, indent=1, default=str)
    return finish(args, argv, rows, setup)


if __name__ == "__main__":
    sys.exit(main())
