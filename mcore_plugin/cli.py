"""``tierckpt export-mcore SRC DST``, contributed to the ``tierckpt`` command through the
``tierckpt.cli`` entry-point group (pyproject.toml); megatron-core is imported only when it runs."""

from __future__ import annotations

import argparse
import importlib.util

from tierckpt.cli import CliError


def register_cli(subparsers) -> None:
    """Add ``tierckpt export-mcore`` to the ``tierckpt`` parser's ``subparsers``."""
    p = subparsers.add_parser(
        "export-mcore", help="convert a dp_reshardable Megatron torch_dist checkpoint to fully_reshardable",
        description="Write DST, a fully_reshardable copy (loads under any TP/PP/DP) of the dp_reshardable "
                    "Megatron-Core torch_dist checkpoint SRC. Single process; needs megatron-core.")
    p.add_argument("src", metavar="SRC", help="dp_reshardable torch_dist checkpoint directory")
    p.add_argument("dst", metavar="DST", help="output directory (must not exist unless --overwrite)")
    p.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=_cmd_export_mcore)


def _cmd_export_mcore(args: argparse.Namespace) -> int:
    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
        raise CliError("export-mcore needs megatron-core, which is not installed "
                       "(pip install 'tierckpt[mcore]' or megatron-core>=0.16)")
    from mcore_plugin.export import run_cli

    return run_cli(args)
