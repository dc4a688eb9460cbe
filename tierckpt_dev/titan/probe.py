"""``python -m tierckpt_dev.titan.probe --dump-restored DIR <titan_plugin.train args>``: torchtitan
training through :mod:`titan_plugin.train`, plus a dump of the state right after every restore.

For demos and tests (not shipped in the wheel): after ``checkpointer.load()`` restored a
checkpoint, every rank takes part in one ``dcp.save`` of what the checkpointer saves at a step
(model, optimizer, lr scheduler, train state; not the dataloader positions), so the saved values
are the global ones after DCP's gather of every shard, to ``DIR/restart-<TIERCKPT_RESTART_COUNT>``, a plain global DCP
checkpoint that ``launch/local_demo.py: compare_final_states`` can compare across runs of
different node counts. Training then goes on unchanged.
"""

from __future__ import annotations

import argparse
import os
import sys

NOT_DUMPED = ("dataloader",)  # per data-parallel layout: differs between node counts by design


def dump_states(manager, path: str) -> None:
    """``dcp.save`` of what the checkpointer saves (model keys flattened at the top, as torchtitan
    writes a step) without :data:`NOT_DUMPED`, to ``path`` (collective over the default group)."""
    import torch.distributed.checkpoint as dcp

    states = {k: v for k, v in manager._flattened_model_states_sd().items() if k not in NOT_DUMPED}
    dcp.save(states, storage_writer=dcp.FileSystemWriter(path, overwrite=True))


def install(dump_dir: str) -> None:
    """Wrap ``TieredCheckpointManager._load`` so that a load that restored a checkpoint dumps
    the state (see the module docstring)."""
    from titan_plugin.manager import TieredCheckpointManager

    original = TieredCheckpointManager._load

    def _load(self, step: int = -1) -> bool:
        loaded = original(self, step)
        if loaded and self.last_restore is not None:
            dump_states(self, os.path.join(dump_dir, f"restart-{os.environ.get('TIERCKPT_RESTART_COUNT', '0')}"))
        return loaded

    TieredCheckpointManager._load = _load  # type: ignore[method-assign]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tierckpt_dev.titan.probe", description=__doc__.split("\n\n")[0])
    ap.add_argument("--dump-restored", required=True, help="directory of the post-restore state dumps")
    args, rest = ap.parse_known_args(argv)
    install(os.path.abspath(args.dump_restored))
    from titan_plugin.train import main as train_main

    return train_main(rest)


if __name__ == "__main__":
    sys.exit(main())
