"""Entry point: ``python -m titan_plugin.train --toml FILE [--section.key value …]``.

Parses and validates the whole configuration (:mod:`titan_plugin.toml`) before any process
group exists, applies the CPU compatibility patches when no accelerator is present (they live
in the repository's development package :mod:`tierckpt_dev.titan.cpu`, which the wheel does
not ship), then runs torchtitan's trainer exactly as ``torchtitan.train.main`` does. Exit
status 2 on a configuration error (the message names the key and the allowed values) or when
a machine without an accelerator lacks ``tierckpt_dev``; exit status 1 when
a checkpoint tier's save failed (the message names the tier, the step and the cause); exit
status 75 after the final save of a preemption notice (``checkpoint.preemption_signals``).
"""

from __future__ import annotations

import argparse
import sys

from tierckpt import PREEMPTED_EXIT, ConfigError, Preempted, TierFailedError
from tierckpt.integration import accelerator_present, install_process_group_hook, mark_phase

DEV_PACKAGE = "tierckpt_dev"


class CpuShimsMissing(RuntimeError):
    """No accelerator and no :mod:`tierckpt_dev` to make torchtitan run on the CPU."""


def apply_cpu_shims() -> list[str]:
    """Without an accelerator, apply torchtitan's CPU patches (:mod:`tierckpt_dev.titan.cpu`,
    from a repository checkout); with one, nothing is imported and nothing changes.

    Returns:
        names of the patches applied by this call ([] with an accelerator or when applied before).
    Raises:
        CpuShimsMissing: no accelerator and ``tierckpt_dev`` cannot be imported (the message
            says how to make it importable).
    """
    if accelerator_present():
        return []
    try:
        from tierckpt_dev.titan.cpu import apply_cpu_compat
    except ModuleNotFoundError as e:
        if not e.name or e.name.split(".")[0] != DEV_PACKAGE:
            raise  # tierckpt_dev is there; one of its own imports is missing
        raise CpuShimsMissing(
            f"no accelerator: torchtitan runs on the CPU only with the patches of the development package "
            f"{DEV_PACKAGE} (tierckpt_dev.titan.cpu), which the tierckpt wheel does not ship; run from a "
            "repository checkout with its root on PYTHONPATH (launch/*.py and launch/tierckpt_slurm.sh "
            "set it)") from e
    return apply_cpu_compat()


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
    except CpuShimsMissing as e:
        print(f"titan_plugin.train: error: {e}", file=sys.stderr)
        return 2
    return 0


def run(config) -> None:
    """Build and run torchtitan's trainer for ``config`` (mirrors ``torchtitan.train.main``:
    with ``checkpoint.create_seed_checkpoint`` it only writes the seed checkpoint, step 0).

    Raises:
        ConfigError: a seed run on more than one rank or with checkpointing disabled.
        CpuShimsMissing: no accelerator and no ``tierckpt_dev`` (:func:`apply_cpu_shims`).
    """
    install_process_group_hook()  # the recovery timeline's process_group_up (tierckpt.recovery.timeline)
    import torch
    from torchtitan.tools.logging import init_logger, logger

    init_logger()
    apply_cpu_shims()
    trainer = None
    try:
        mark_phase("imports_done")  # the trainer's imports are done; config.build() starts the job
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
            try:
                trainer.train()
            except Exception as e:  # a notice that killed the loader's workers mid-fetch still saves
                save = getattr(trainer.checkpointer, "save_on_loader_death", None)
                pre = save(e, trainer) if save is not None else None
                if pre is None:
                    raise
                raise pre from e
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
