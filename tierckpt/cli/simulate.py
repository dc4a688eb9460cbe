"""``tierckpt simulate``: simulated waste of the fixed, adaptive and oracle interval policies."""

from __future__ import annotations

import argparse

from tierckpt.cli.common import EXIT_OK, CliError, _duration_arg, _print_json, _stdout
from tierckpt.errors import ConfigError
from tierckpt.sched.schedule import DURATION_UNITS, format_duration
from tierckpt.sched.simulate import (
    DEFAULT_DELTA_S,
    DEFAULT_FIXED_INTERVAL_S,
    DEFAULT_MTBF_S,
    DEFAULT_RESTART_S,
    DEFAULT_RUNS,
    DEFAULT_STEP_S,
    DEFAULT_WORK_S,
    SimParams,
    plot,
    simulate,
)


def cmd_simulate(args: argparse.Namespace) -> int:
    """``tierckpt simulate``: waste of the fixed, adaptive and oracle policies."""
    params = SimParams(mtbf_s=args.mtbf, delta_s=args.delta, restart_s=args.restart, work_s=args.work,
                       step_s=args.step_time, seed=args.seed, runs=args.runs,
                       fixed_interval_s=args.fixed_interval, prior_mtbf_s=args.prior_mtbf,
                       prior_weight=args.prior_weight)
    try:
        result = simulate(params)
    except ConfigError as e:
        raise CliError(str(e)) from None
    if args.plot:
        try:
            plot(result, args.plot)
        except OSError as e:
            raise CliError(f"--plot: cannot write {args.plot!r}: {e}") from None
    if args.json:
        _print_json(result)
        return EXIT_OK
    from rich.table import Table

    p = result["params"]
    table = Table(title=f"simulated waste: M = {format_duration(p['mtbf_s'])}, delta = {p['delta_s']:g} s, "
                  f"R = {p['restart_s']:g} s, W = {format_duration(p['work_s'])}, {p['runs']} runs, seed {p['seed']}")
    table.add_column("policy")
    table.add_column("interval", justify="right")
    for col in ("waste", "± sd", "failures", "checkpoints"):
        table.add_column(col, justify="right")
    oracle = result["policies"]["oracle"]["waste"]
    table.add_column("vs oracle", justify="right")
    for name, pol in result["policies"].items():
        table.add_row(name, format_duration(pol["interval_s"]), f"{100 * pol['waste']:.2f} %",
                      f"{100 * pol['waste_sd']:.2f}", f"{pol['failures']:.1f}", f"{pol['checkpoints']:.0f}",
                      f"{pol['waste'] / oracle:.2f}x" if oracle > 0 else "-")
    con = _stdout()
    con.print(table)
    line = (f"Young period {format_duration(result['young_period_s'])}, Daly tau "
            f"{format_duration(result['daly_tau_s'])}")
    if result["model_waste_at_daly"] is not None:
        line += f", model waste at Daly tau {100 * result['model_waste_at_daly']:.2f} %"
    ad = result["policies"]["adaptive"]
    if ad.get("final_mtbf_s"):
        line += (f"; adaptive prior M {format_duration(p['prior_mtbf_s'])}, learned M "
                 f"{format_duration(ad['final_mtbf_s'])}")
    con.print(line)
    if args.plot:
        con.print(f"plot written to {args.plot}")
    return EXIT_OK


def register_cli(subparsers) -> None:
    """Add ``tierckpt simulate`` (see :data:`tierckpt.cli.REGISTRARS`)."""
    units = ", ".join(DURATION_UNITS)
    p = subparsers.add_parser(
        "simulate", help="simulate fixed, adaptive and oracle checkpoint intervals under Poisson failures",
        description="Discrete-event simulation of a job needing --work seconds of useful work under "
        "Poisson failures (MTBF --mtbf), each checkpoint blocking --delta and each failure costing "
        "the work since the last checkpoint plus --restart. Prints each policy's wasted fraction "
        f"(wall - work) / wall. Durations: seconds, or a number with unit {units} (45m, 3.09h, 2d).",
    )
    p.add_argument("--mtbf", type=_duration_arg("--mtbf", positive=True), default=DEFAULT_MTBF_S,
                   metavar="DURATION", help="true MTBF of the failure process (default 54*24/419 h = 3.09 h)")
    p.add_argument("--delta", type=_duration_arg("--delta", positive=False), default=DEFAULT_DELTA_S,
                   metavar="S", help=f"blocking time per checkpoint (default {DEFAULT_DELTA_S:g} s)")
    p.add_argument("--restart", type=_duration_arg("--restart", positive=False), default=DEFAULT_RESTART_S,
                   metavar="S", help=f"restart time per failure (default {DEFAULT_RESTART_S:g} s)")
    p.add_argument("--work", type=_duration_arg("--work", positive=True), default=DEFAULT_WORK_S,
                   metavar="DURATION", help="useful work the job needs (default 30d)")
    p.add_argument("--step-time", type=_duration_arg("--step-time", positive=True), default=DEFAULT_STEP_S,
                   metavar="S", help=f"training step time (default {DEFAULT_STEP_S:g} s)")
    p.add_argument("--seed", type=int, default=0, help="base random seed (default 0)")
    p.add_argument("--runs", type=int, default=DEFAULT_RUNS,
                   help=f"runs (seeds) averaged per policy (default {DEFAULT_RUNS})")
    p.add_argument("--fixed-interval", type=_duration_arg("--fixed-interval", positive=True),
                   default=DEFAULT_FIXED_INTERVAL_S, metavar="S",
                   help=f"the fixed policy's interval (default {DEFAULT_FIXED_INTERVAL_S:g} s)")
    p.add_argument("--prior-mtbf", type=_duration_arg("--prior-mtbf", positive=True), default=None,
                   metavar="DURATION", help="adaptive policy's prior MTBF (default 10 x --mtbf)")
    p.add_argument("--prior-weight", type=float, default=1.0,
                   help="weight of that prior in pseudo-failures (default 1)")
    p.add_argument("--plot", metavar="FILE.png", help="draw waste against interval (matplotlib)")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.set_defaults(func=cmd_simulate)
