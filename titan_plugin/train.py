"""Entry point: ``python -m titan_plugin.train --toml FILE [--section.key value …]``.

Parses and validates the whole configuration (:mod:`titan_plugin.toml`) before any process
group exists, applies the CPU compatibility patches when no accelerator is present, then runs
torchtitan's trainer exactly as ``torchtitan.train.main`` does. Exit status 2 on a
configuration error (the message names the key and the allowed values); exit status 1 when
a checkpoint tier's save failed (the message names the tier, the step and the cause); exit
status 75 after the final save of a preemption notice (``checkpoint.preemption_signals``).
"""

from __future__ import annotations

import argparse
import sys

from tierckpt.errors import ConfigError, TierFailedError
from tierckpt.preemption import PREEMPTED_EXIT, Preempted


def main(argv: list[str] | None = None) -> int:
    """Run training; returns the process exit status."""
    ap = argparse.ArgumentParser(prog="python -m titan_plugin.train", description=__doc__.split("\n\n")[0])
    ap.add_argument("--toml", help="TOML file with [job] module/config and config overrides")
    args, rest = ap.parse_known_args(argv)
    from titan_plugin.toml import load_config

    try:
        config = load_config(args.toml, rest)
    except (ConfigError, FileNotFoundError) as e:
        print(f"titan_plugin.train: error: {e}", file=sys.stderr)
        return 2
    try:
        run(config)
    except ConfigError as e:  # checks that need the process group (node count, writable roots)
        print(f"titan_plugin.train: error: {e}", file=sys.stderr)
        return 2
    except TierFailedError as e:  # a checkpoint tier failed: the run's progress is not durable
        print(f"titan_plugin.train: error: {e}", file=sys.stderr)
        return 1
    except Preempted as e:  # saved on a preemption notice: ask to be requeued
        print(f"titan_plugin.train: {e}", file=sys.stderr)
        return PREEMPTED_EXIT
    return 0


def run(config) -> None:
    """Build and run torchtitan's trainer for ``config`` (mirrors ``torchtitan.train.main``:
    with ``checkpoint.create_seed_checkpoint`` it only writes the seed checkpoint, step 0).

    Raises:
        ConfigError: a seed run on more than one rank or with checkpointing disabled.
    """
    import torch
    from torchtitan.tools.logging import init_logger, logger

    from titan_plugin.cpu import apply_cpu_compat

    init_logger()
    apply_cpu_compat()
    trainer = None
    try:
        trainer = config.build()
        if config.checkpoint.create_seed_checkpoint:
            world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
            if world != 1 or not config.checkpoint.enable:
                raise ConfigError("checkpoint.create_seed_checkpoint",
                                  f"needs one rank and checkpoint.enable = true (got {world} ranks, "
                                  f"enable = {config.checkpoint.enable})")
            trainer.checkpointer.save(curr_step=0, last_step=True)
            logger.info("Created seed checkpoint")
        else:
            trainer.train()
    except Exception:
        if trainer:
            trainer.close()
        raise
    else:
        trainer.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        logger.info("Process group destroyed")


if __name__ == "__main__":
    sys.exit(main())
