"""The ``tierckpt`` command: inspect and verify the tiers of a tierckpt checkpoint tree.

Subcommands::

    tierckpt ls <root> [--json] [--lineage ROOT|ID]
                                       every step directory under <root>, by tier and node
    tierckpt verify <root> [--json]    re-hash every committed step; exit 1 if one is corrupt
    tierckpt ledger <root> [--json]    runs, failures, checkpoints, restores and recovery phases of the ledger
    tierckpt interval --delta S --mtbf D   the Young/Daly interval, waste and lost work
    tierckpt simulate [...]            waste of fixed, adaptive and oracle intervals (simulated)

From the ``tierckpt.cli`` entry-point group (installed with the package)::

    tierckpt export-mcore SRC DST      dp_reshardable → fully_reshardable Megatron checkpoint
                                       (mcore_plugin/cli.py)

``<root>`` is a local path or an fsspec URL (``s3://bucket/run``, ``memory://x``). It may be one
node's local root, a directory holding several node roots (``/nvme/job/node-0``,
``/nvme/job/node-1``), a persistent root, a single step directory, or any ancestor of these.
All file access goes through :class:`tierckpt.io.storage.Store`.

Exit codes: 0 success; 1 ``verify`` found a corrupt committed step; 2 bad input (root missing,
no ledger, unreadable URL).

Adding a subcommand: write ``register(subparsers)`` in your module; it calls
``subparsers.add_parser(...)`` and ``parser.set_defaults(func=handler)``, where
``handler(args) -> int`` returns the exit code. Then either call :func:`register_command`
before :func:`main` runs, or — from another distribution — declare it in the entry-point group
``tierckpt.cli`` (:data:`ENTRY_POINT_GROUP`); ``mcore_plugin`` adds ``export-mcore`` that way, so
this package never imports an adapter.

Modules: :mod:`tierckpt.cli.common` (exit codes, output), :mod:`tierckpt.cli.steps` (``ls``,
``verify``, ``ledger``), :mod:`tierckpt.cli.recovery` (a recovery's phases as a table),
:mod:`tierckpt.cli.interval`, :mod:`tierckpt.cli.simulate`.
"""

from __future__ import annotations

import argparse
import logging
from importlib.metadata import entry_points
from typing import Callable

from tierckpt.cli.common import (
    EXIT_CORRUPT,
    EXIT_OK,
    EXIT_USAGE,
    CliError,
    _error,
    human_bytes,
)
from tierckpt.cli.interval import register_cli as _register_interval
from tierckpt.cli.simulate import register_cli as _register_simulate
from tierckpt.cli.steps import (
    _register_ledger,
    _register_ls,
    _register_verify,
    find_steps,
)

__all__ = ["EXIT_CORRUPT", "EXIT_OK", "EXIT_USAGE", "ENTRY_POINT_GROUP", "CliError", "REGISTRARS",
           "build_parser", "find_steps", "human_bytes", "main", "register_command"]

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "tierckpt.cli"
"""Entry-point group of subcommand registrars contributed by other distributions."""

Registrar = Callable[[argparse._SubParsersAction], None]

REGISTRARS: list[Registrar] = [_register_ls, _register_verify, _register_ledger, _register_interval,
                               _register_simulate]
"""Functions that add subcommands; each takes the ``subparsers`` object of the top parser."""


def register_command(fn: Registrar) -> Registrar:
    """Add a subcommand registrar (usable as a decorator); it runs on the next :func:`build_parser`."""
    if fn not in REGISTRARS:
        REGISTRARS.append(fn)
    return fn


def _plugin_registrars() -> list[Registrar]:
    """Registrars declared in :data:`ENTRY_POINT_GROUP`; one that fails to import is skipped with a
    warning (its subcommand is then missing, the others still work)."""
    out = []
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            out.append(ep.load())
        except Exception as e:  # noqa: BLE001 - a broken plugin must not break ls/verify
            log.warning("tierckpt: CLI plugin %s (%s) not loaded: %s", ep.name, ep.value, e)
    return out


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every registered subcommand (built-in, then entry points)."""
    parser = argparse.ArgumentParser(
        prog="tierckpt", description="Inspect, verify and summarise tierckpt checkpoints."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for register in REGISTRARS + [r for r in _plugin_registrars() if r not in REGISTRARS]:
        register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the ``tierckpt`` command line.

    Args:
        argv: arguments without the program name; default ``sys.argv[1:]``.

    Returns:
        the exit code: 0 ok, 1 corruption found by ``verify``, 2 bad input (argparse errors
        included).
    """
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse exits 2 on bad usage, 0 on --help
        return int(e.code) if isinstance(e.code, int) else EXIT_USAGE
    if getattr(args, "storage_options", None):  # --storage-options: for every URL the command opens
        from tierckpt.io.storage import register_options

        register_options("", args.storage_options)
    try:
        return int(args.func(args))
    except CliError as e:
        _error(str(e))
        return EXIT_USAGE
