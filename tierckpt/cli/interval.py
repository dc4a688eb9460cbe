"""``tierckpt interval``: the Young/Daly checkpoint interval for a blocking time and an MTBF."""

from __future__ import annotations

import argparse

from tierckpt.cli.common import EXIT_OK, _duration_arg, _print_json, _stdout
from tierckpt.sched.schedule import DURATION_UNITS, format_duration, interval_report


def cmd_interval(args: argparse.Namespace) -> int:
    """``tierckpt interval``: the Young/Daly interval, waste and lost work for given δ, M, R."""
    rep = interval_report(args.delta, args.mtbf, args.restart)
    if args.json:
        _print_json({k: rep[k] for k in ("tau_s", "compute_s", "waste", "lost_per_failure_s")})
        return EXIT_OK
    from rich.table import Table

    table = Table(title="checkpoint interval (Young 1974 / Daly 2006)")
    table.add_column("quantity")
    table.add_column("seconds", justify="right")
    table.add_column("", justify="right")
    rows = [
        ("blocking time delta", args.delta, format_duration(args.delta)),
        ("MTBF M", args.mtbf, format_duration(args.mtbf)),
        ("restart time R", args.restart, format_duration(args.restart)),
        ("tau: checkpoint interval sqrt(2 delta (M + R))", rep["tau_s"], format_duration(rep["tau_s"])),
        ("training between checkpoints tau - delta", rep["compute_s"], format_duration(rep["compute_s"])),
        ("Young's interval sqrt(2 delta M)", rep["young_period_s"], format_duration(rep["young_period_s"])),
        ("lost per failure tau/2 + R", rep["lost_per_failure_s"], format_duration(rep["lost_per_failure_s"])),
    ]
    for name, s, human in rows:
        table.add_row(name, f"{s:.1f}", human)
    table.add_row("waste delta/tau + tau/2M + R/M", "", f"{100 * rep['waste']:.1f} %")
    if rep["daly_waste"] is not None:
        table.add_row("waste, Daly's complete model", "", f"{100 * rep['daly_waste']:.1f} %")
    con = _stdout()
    con.print(table)
    return EXIT_OK


def register_cli(subparsers) -> None:
    """Add ``tierckpt interval`` (see :data:`tierckpt.cli.REGISTRARS`)."""
    p = subparsers.add_parser(
        "interval", help="optimal checkpoint interval for a blocking time and an MTBF",
        description="Optimum checkpoint interval tau = sqrt(2 delta (M + R)), start to start (Young's "
        "sqrt(2 delta M) when R = 0; Daly 2006: tau - delta seconds of training between checkpoints), "
        "the wasted fraction delta/tau + tau/(2M) + R/M and the expected time lost per failure "
        "tau/2 + R. Durations: a number of seconds or a number with unit "
        + ", ".join(DURATION_UNITS) + " (600s, 45m, 3.09h, 2d).",
    )
    p.add_argument("--delta", required=True, type=_duration_arg("--delta", positive=True), metavar="SECONDS",
                   help="blocking time of one checkpoint")
    p.add_argument("--mtbf", required=True, type=_duration_arg("--mtbf", positive=True), metavar="DURATION",
                   help="mean time between failures of the job (e.g. 3.09h)")
    p.add_argument("--restart", default=0.0, type=_duration_arg("--restart", positive=False), metavar="SECONDS",
                   help="restart + restore time R (default 0)")
    p.add_argument("--json", action="store_true", help="print {tau_s, compute_s, waste, lost_per_failure_s} as JSON (seconds, fraction)")
    p.set_defaults(func=cmd_interval)
