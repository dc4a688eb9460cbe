"""Persistent tier: a global DCP checkpoint on shared storage (path or fsspec URL).

The write itself is delegated to a :class:`PersistentIO`, so adapters can route it through
the framework's own DCP path (torchtitan's ``dcp_save``, Megatron's ``torch_dist``); the tier
adds what DCP lacks: per-file xxh3-64 manifest, commit marker, retention and verified load.
"""

from __future__ import annotations

import logging

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

from tierckpt.io import layout, manifest
from tierckpt.io.dcp_io import (
    CountingFileSystemReader,
    CountingFsspecReader,
    crc32_off,
    digests_under,
    hashing_writer,
)
from tierckpt.io.planner import VerifyingLoadPlanner
from tierckpt.io.storage import Store
from tierckpt.tiers.commit import save_step

log = logging.getLogger(__name__)


class PersistentIO:
    """Default DCP save/load of one persistent step. Subclass to route through a framework.

    ``save(state_dict, url, process_group)``: collective DCP save to ``url`` (a directory path
    or fsspec URL). ``load(state_dict, url, process_group) -> int``: collective, in-place DCP
    load with :class:`VerifyingLoadPlanner`; returns bytes this rank read.
    """

    def save(self, state_dict: dict, url: str, process_group) -> dict[str, tuple[int, str]]:
        """Collective DCP save of ``state_dict`` to the directory or URL ``url``.

        Returns:
            {path relative to ``url``: (size, xxh3-64)} of the files this rank hashed while
            writing (local paths); {} when nothing was hashed (files are re-read instead).
        """
        writer = hashing_writer(url) if "://" not in url else FsspecWriter(url, sync_files=True)
        with crc32_off():
            dcp.save(state_dict, storage_writer=writer, process_group=process_group)
        return digests_under(writer, url) if "://" not in url else {}

    def load(self, state_dict: dict, url: str, process_group) -> int:
        """Collective in-place DCP load from ``url``; returns bytes this rank read."""
        reader = CountingFileSystemReader(url) if "://" not in url else CountingFsspecReader(url)
        dcp.load(state_dict, storage_reader=reader, planner=VerifyingLoadPlanner(), process_group=process_group)
        return reader.bytes_read


class PersistentTier:
    """Steps ``<persistent_root>/step-<N>/`` and their commit protocol.

    Args:
        store: the persistent root.
        io: how a step's DCP files are written and read.
        lineage: the job's lineage id, recorded in each step's manifest (informational: a
            persistent step is restorable whatever it records, e.g. after a copy to a new root).
    """

    def __init__(self, store: Store, io: PersistentIO | None = None, lineage: str | None = None):
        self.store = store
        self.io = io or PersistentIO()
        self.lineage = lineage

    def save(self, staged: dict, step: int, group) -> int:
        """Write and commit ``step-<step>`` (collective over ``group``, all ranks of the job).

        Returns:
            bytes of the committed step (same on every rank).
        Raises:
            PeerFailure / CheckpointException when any rank failed; the step stays uncommitted.
        """
        rel = layout.persistent_step(step)
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        return save_step(self.store, rel, lambda: self.io.save(staged, self.store.url_of(rel), group), group,
                         index=rank, count=world, leader=rank == 0, label=f"persistent step {step}",
                         mark_in_progress=True, tier="persistent", step=step, world_size=world,
                         lineage=self.lineage)

    def committed_steps(self) -> list[int]:
        """Committed steps, ascending."""
        out = []
        for name in self.store.listdir(""):
            s = layout.parse_step(name)
            if s is not None and manifest.read_committed(self.store, layout.persistent_step(s)):
                out.append(s)
        return sorted(out)
