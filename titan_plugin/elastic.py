"""Fit a torchtitan run to fewer (or more) nodes: the overrides a launcher appends.

When a node is lost for good and the job goes on with the remaining nodes
(``TIERCKPT_MIN_NODES``, launch/README.md), the launchers (``launch/local.py``,
``launch/titan.sbatch``) ask this module which ``--section.key value`` overrides make the
configuration valid on the new node count, and append them to the training command (the
command line wins over the TOML and the registry function):

    python -m titan_plugin.elastic --nodes 2 --nproc-per-node 8 -- --toml FILE [--section.key value …]

prints one JSON object ``{"args": [...], "warnings": [...]}`` on stdout (exit 0), or the error
on stderr (exit 2: a configuration that cannot fit; the message names the option). With
``--shell`` the last stdout line is the arguments as shell words (``shlex.join``) and the
warnings go to stderr (what ``launch/titan.sbatch`` reads).

- ``parallelism.data_parallel_shard_degree``: -1 (the shipped configs) already means "every
  rank left over", nothing to do. An explicit value becomes
  ``world / (dp_replicate · cp · tp · pp)``; the other degrees are kept, and a world they do
  not divide is an error naming them.
- ``checkpoint.replication_factor`` F and ``replication_jump`` J: the engine needs F ≤ nodes
  and J·F dividing the node count (nodes as the engine counts them: ranks /
  ``simulated_ranks_per_node`` when that is set). When they do not fit, F is lowered first to
  the largest value some J' ≤ J fits with, then J to the largest that fits (a warning says
  so; F = 1 means no replicas, and then J = 1). Data already replicated stays where it is;
  only the new saves use the new cliques.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from typing import Any

from tierckpt import ConfigError


def clamp_replication(jump: int, factor: int, nodes: int) -> tuple[int, int, str | None]:
    """The (J, F) to use on ``nodes`` nodes, and a warning when they changed.

    Copies first, then spread: the largest F' ≤ min(F, nodes) for which some J' ≤ J has
    J'·F' dividing ``nodes``, with the largest such J'; when no F' ≥ 2 fits, F' = 1 (no
    replicas) and J' = 1.

    Raises:
        ValueError: a value < 1.
    """
    for name, v in (("replication_jump", jump), ("replication_factor", factor), ("nodes", nodes)):
        if v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    if factor <= nodes and nodes % (jump * factor) == 0:
        return jump, factor, None
    j, f = 1, 1
    fits = [(fj, jj) for fj in range(min(factor, nodes), 1, -1) for jj in range(jump, 0, -1) if nodes % (jj * fj) == 0]
    if fits:
        f, j = fits[0]
    what = "no replicas (a lost node then falls back to the persistent tier)" if f == 1 else f"{f} copies"
    return j, f, (f"checkpoint.replication_jump={jump}, replication_factor={factor} do not fit {nodes} nodes "
                  f"(need F <= nodes and J*F dividing the node count): using J={j}, F={f}: {what}")


def fit_parallelism(par: Any, world: int) -> int | None:
    """The ``data_parallel_shard_degree`` to pass on a ``world``-rank job, or None to keep it.

    Args:
        par: torchtitan's ``ParallelismConfig`` (``data_parallel_shard_degree``,
            ``data_parallel_replicate_degree``, ``context_parallel_degree``,
            ``tensor_parallel_degree``, ``pipeline_parallel_degree``).
        world: ranks of the new job.
    Raises:
        ConfigError: the non-sharded degrees do not divide ``world`` (names them).
    """
    rest = {k: getattr(par, k, 1) for k in ("data_parallel_replicate_degree", "context_parallel_degree",
                                              "tensor_parallel_degree", "pipeline_parallel_degree")}
    other = 1
    for v in rest.values():
        other *= v
    if world % other:
        raise ConfigError("parallelism", f"{' * '.join(f'{k}={v}' for k, v in rest.items())} = {other} does not "
                          f"divide the {world} ranks left; change one of them to go on with this many nodes")
    shard = par.data_parallel_shard_degree
    if shard == -1:
        return None
    new = world // other
    return None if new == shard else new


def overrides(config: Any, nodes: int, nproc_per_node: int) -> tuple[list[str], list[str]]:
    """The ``--section.key value`` overrides fitting ``config`` (a torchtitan ``Trainer.Config``
    with a tierckpt ``[checkpoint]``) to ``nodes`` × ``nproc_per_node`` ranks, and warnings.

    Raises:
        ConfigError: the parallel degrees cannot fit (names the option).
    """
    args: list[str] = []
    warnings: list[str] = []
    shard = fit_parallelism(config.parallelism, nodes * nproc_per_node)
    if shard is not None:
        args += ["--parallelism.data_parallel_shard_degree", str(shard)]
        warnings.append(f"parallelism.data_parallel_shard_degree={config.parallelism.data_parallel_shard_degree} "
                        f"-> {shard} for {nodes} nodes x {nproc_per_node} ranks")
    ck = config.checkpoint
    if getattr(ck, "enable", False) and getattr(ck, "local_interval", 0):
        sim = getattr(ck, "simulated_ranks_per_node", 0)
        engine_nodes = nodes * nproc_per_node // sim if sim else nodes
        j, f, warn = clamp_replication(ck.replication_jump, ck.replication_factor, engine_nodes)
        if warn:
            args += ["--checkpoint.replication_jump", str(j), "--checkpoint.replication_factor", str(f)]
            warnings.append(warn)
    return args, warnings


def main(argv: list[str] | None = None) -> int:
    """CLI (see the module docstring); returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="python -m titan_plugin.elastic", description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, required=True, help="nodes of the next attempt")
    ap.add_argument("--nproc-per-node", type=int, required=True, help="ranks per node")
    ap.add_argument("--shell", action="store_true", help="print shell words (warnings on stderr), not JSON")
    split = argv.index("--") if "--" in argv else len(argv)
    args = ap.parse_args(argv[:split])
    train = argv[split + 1:]
    if args.nodes < 1 or args.nproc_per_node < 1:
        ap.error("--nodes and --nproc-per-node must be >= 1")
    tp = argparse.ArgumentParser(add_help=False)
    tp.add_argument("--toml")
    targs, rest = tp.parse_known_args(train)
    from titan_plugin.toml import load_config

    try:
        config = load_config(targs.toml, rest)
        extra, warnings = overrides(config, args.nodes, args.nproc_per_node)
    except (ConfigError, FileNotFoundError) as e:
        print(f"titan_plugin.elastic: error: {e}", file=sys.stderr)
        return 2
    if args.shell:
        for w in warnings:
            print(f"titan_plugin.elastic: warning: {w}", file=sys.stderr)
        print(shlex.join(extra))
    else:
        print(json.dumps({"args": extra, "warnings": warnings}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
