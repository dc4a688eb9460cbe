"""Shared pieces of the ``tierckpt`` subcommands: exit codes, errors, output helpers."""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import datetime

from rich.console import Console

from tierckpt.errors import ConfigError, TierckptError
from tierckpt.sched.schedule import parse_duration

EXIT_OK = 0
EXIT_CORRUPT = 1
EXIT_USAGE = 2

DEFAULT_MAX_DEPTH = 10
"""How many directory levels below ``<root>`` the step search descends (symlink-loop guard)."""

TIER_ORDER = {"local": 0, "replica": 1, "persistent": 2}


class CliError(TierckptError):
    """Bad input the user can fix (missing root, no ledger); reported on stderr, exit 2."""


# --------------------------------------------------------------------------------------------
# formatting helpers
# --------------------------------------------------------------------------------------------
def human_bytes(n: int | float | None) -> str:
    """Binary-prefixed size, e.g. ``1536`` → ``"1.5 KiB"``; ``None`` → ``"-"``."""
    if n is None:
        return "-"
    n = float(n)
    if abs(n) < 1024:
        return f"{int(n)} B"
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        n /= 1024.0
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.1f} {unit}"
    raise AssertionError("unreachable")


def _fmt_seconds(s: float | None) -> str:
    if s is None:
        return "-"
    return f"{s:.3f}" if abs(s) < 10 else f"{s:.1f}"


def _fmt_time(t: float | None) -> str:
    """UNIX seconds → local ISO-8601 time with UTC offset."""
    if t is None:
        return "-"
    try:
        return datetime.fromtimestamp(float(t)).astimezone().isoformat(timespec="seconds")
    except (TypeError, ValueError, OverflowError, OSError):
        return str(t)


def _short(s: str, n: int = 12) -> str:
    s = str(s)
    return s if len(s) <= n else s[: n - 1] + "…"


def _fmt_sources(sources) -> str:
    """A restore record's per-node ``sources`` as ``node 0: local, node 1: replica@2``."""

    def one(node, v) -> str:
        if isinstance(v, dict):
            tier = v.get("source", v.get("tier", "?"))
            holder = v.get("holder")
            txt = f"{tier}@{holder}" if holder is not None and tier != "persistent" else str(tier)
        else:
            txt = str(v)
        return f"node {node}: {txt}"

    if isinstance(sources, dict):
        def key(k):
            return (0, int(k)) if str(k).isdigit() else (1, str(k))
        return ", ".join(one(k, sources[k]) for k in sorted(sources, key=key))
    if isinstance(sources, list):
        return ", ".join(
            one(v.get("node", i) if isinstance(v, dict) else i, v) for i, v in enumerate(sources)
        )
    return "-" if sources is None else str(sources)


PIPE_WIDTH = 240
"""Console width when stdout is not a terminal and COLUMNS is unset (rich would use 80 and
fold paths); tables still take only the width they need."""


def _silence_stdout() -> None:
    """After a broken pipe (``tierckpt ls | head``): send further output to /dev/null so the
    command still finishes and returns its real exit code (``verify`` keeps its 1)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):
        pass


class _Console(Console):
    def on_broken_pipe(self) -> None:  # rich's default exits with status 1
        self.quiet = True
        _silence_stdout()


def _stdout() -> Console:
    # Created per call so output follows sys.stdout as it is at that moment (pytest capture).
    width = None
    if "COLUMNS" not in os.environ and not sys.stdout.isatty():
        width = PIPE_WIDTH
    # markup off: paths and ledger strings may contain "[...]"; styling uses Text objects.
    return _Console(highlight=False, markup=False, width=width)


def _print_json(obj) -> None:
    try:
        sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")
        sys.stdout.flush()
    except BrokenPipeError:
        _silence_stdout()


def _error(msg: str) -> None:
    print(f"tierckpt: error: {msg}", file=sys.stderr)


def _duration_arg(option: str, *, positive: bool):
    def parse(text: str) -> float:
        try:
            v = parse_duration(text, option)
        except ConfigError as e:  # argparse prefixes "argument --mtbf: " itself
            raise argparse.ArgumentTypeError(str(e).split(": ", 1)[-1]) from None
        if v < 0 or (positive and v == 0):
            raise argparse.ArgumentTypeError(f"must be {'> 0' if positive else '>= 0'}, got {text!r}")
        return v
    return parse
