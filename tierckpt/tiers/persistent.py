"""Persistent tier: a global DCP checkpoint on shared storage (path or fsspec URL).

The tier owns the whole write and load of a step: the DCP storage writer (xxh3-64 hashed while
writing on paths, fsspec with fsync on URLs), torch.save's CRC32 off, the collective
``dcp.save``, the framework's side files, the per-file manifest and commit marker
(:func:`tierckpt.tiers.commit.save_step`), retention, and the verified, byte-counted load. A
:class:`PersistentIO` supplies only what a framework must decide (torchtitan needs nothing
beyond the defaults; Megatron-Core converts its ShardedTensors to DCP chunks, plans with its
own planner and adds ``common.pt``/``metadata.json``).
"""

from __future__ import annotations

import logging
from typing import Callable

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import xxhash
from torch.distributed.checkpoint.planner import SavePlanner

from tierckpt.io import layout, manifest
from tierckpt.io.bounded import BoundedFileSystem, run_bounded
from tierckpt.io.dcp_compat import FsspecWriter
from tierckpt.io.dcp_io import (
    CountingFileSystemReader,
    CountingFsspecReader,
    crc32_off,
    digests_under,
    hashing_writer,
)
from tierckpt.io.planner import PerRankSavePlanner, VerifyingLoadPlanner
from tierckpt.history.timeline import Descent, SaveIdentity, descent_of, newest_step, of_manifest
from tierckpt.errors import ReadTimeout
from tierckpt.io.storage import Store
from tierckpt.tiers.commit import save_step

log = logging.getLogger(__name__)

Digests = dict[str, tuple[int, str]]
"""{path relative to the step directory: (size in bytes, xxh3-64 hex)}."""


class PersistentIO:
    """Framework hooks of the persistent tier; the defaults write and read the state dict as
    plain DCP (what torchtitan's ``dcp.save``/``dcp.load`` produce and read).

    Every hook runs on every rank of ``process_group`` (all ranks of the job for a save, the
    ranks of one node for a load), in the tier's background thread for saves. ``url`` is the
    step directory (a path, or an fsspec URL for object stores). Hooks raise to fail the step:
    the tier then leaves it uncommitted on every rank.
    """

    def to_dcp(self, state_dict: dict, url: str, process_group) -> tuple[dict, SavePlanner | None]:
        """What DCP writes for the staged ``state_dict``: ``(state dict, SavePlanner or None
        for :class:`~tierckpt.io.planner.PerRankSavePlanner`, DCP's default planner that also
        keeps each rank's own value of a key whose plain-tensor/object values differ per
        rank)``. Default: the staged dict itself."""
        return state_dict, None

    def side_files(self, state_dict: dict, process_group) -> dict[str, bytes]:
        """Files besides DCP's that this rank contributes to the step: ``{name relative to the
        step directory: content}``; the tier writes them (before DCP's files) and checksums
        them with the rest. Default: none."""
        return {}

    def load_template(self, state_dict: dict, url: str, process_group) -> tuple[dict, VerifyingLoadPlanner]:
        """What DCP loads in place for ``state_dict``: ``(state dict, planner)``. The planner
        must be a :class:`~tierckpt.io.planner.VerifyingLoadPlanner` (or subclass), so nothing
        is read unless the step covers every local chunk with the same dtype. Default:
        ``state_dict`` itself, loaded in place."""
        return state_dict, VerifyingLoadPlanner()

    def after_load(self, state_dict: dict, loaded: dict, url: str, process_group) -> int:
        """Called once DCP filled ``loaded`` (the dict :meth:`load_template` returned): hand
        the values to the framework, read any side file. Returns the bytes this rank read
        besides DCP's reads. Default: 0 (the load was in place)."""
        return 0


def write_dcp(state_dict: dict, url: str, process_group, planner: SavePlanner | None = None,
              storage_options: dict | None = None) -> Digests:
    """Collective DCP save of ``state_dict`` to the step directory or URL ``url``, fsynced, with
    torch.save's zip CRC32 off (:func:`tierckpt.io.dcp_io.crc32_off`), planned by ``planner``
    (None: :class:`~tierckpt.io.planner.PerRankSavePlanner`); ``storage_options``: fsspec's
    options on URLs (:attr:`tierckpt.io.storage.Store.storage_options`).

    Returns:
        checksums of the files this rank hashed while writing (paths only; :data:`Digests`);
        {} on URLs, whose files the commit routine re-reads instead.
    Raises:
        CheckpointException: DCP failed on some rank (every rank raises).
    """
    local = "://" not in url
    writer = hashing_writer(url) if local else FsspecWriter(url, sync_files=True, **(storage_options or {}))
    with crc32_off():
        dcp.save(state_dict, storage_writer=writer, planner=planner or PerRankSavePlanner(),
                 process_group=process_group)
    return digests_under(writer, url) if local else {}


def _write_side_files(store: Store, rel: str, files: dict[str, bytes]) -> Digests:
    """Write each ``{name: content}`` under step ``rel`` of ``store`` (atomically, fsynced on
    paths) and return their checksums (:data:`Digests`), computed from ``content``."""
    out = {}
    for name, data in files.items():
        store.write_atomic(f"{rel}/{name}", data)
        out[name] = (len(data), xxhash.xxh3_64(data).hexdigest())
    return out


class PersistentTier:
    """Steps ``<persistent_root>/step-<N>/`` and their commit protocol.

    Args:
        store: the persistent root.
        io: the framework's hooks (default: plain DCP).
        lineage: the job's lineage id, recorded in each step's manifest (informational: a
            persistent step is restorable whatever it records, e.g. after a copy to a new root).
    """

    def __init__(self, store: Store, io: PersistentIO | None = None, lineage: str | None = None):
        self.store = store
        self.io = io or PersistentIO()
        self.lineage = lineage

    def save(self, staged: dict, step: int, group, before_commit: Callable[[], None] | None = None,
             identity: SaveIdentity | None = None) -> int:
        """Write and commit ``step-<step>`` (collective over ``group``, all ranks of the job);
        ``before_commit`` as in :func:`tierckpt.tiers.commit.save_step`; ``identity``: the save
        this step belongs to, recorded in its manifest (None: none recorded).

        Returns:
            bytes of the committed step (same on every rank).
        Raises:
            PeerFailure / CheckpointException when any rank failed; the step stays uncommitted.
        """
        rel = layout.persistent_step(step)
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        return save_step(self.store, rel, lambda: self._write(staged, rel, group), group,
                         index=rank, count=world, leader=rank == 0, label=f"persistent step {step}",
                         mark_in_progress=True, tier="persistent", step=step, world_size=world,
                         lineage=self.lineage, before_commit=before_commit,
                         **(identity.manifest_fields() if identity is not None else {}))

    def _write(self, staged: dict, rel: str, group) -> Digests:
        url = self.store.url_of(rel)
        digests = _write_side_files(self.store, rel, self.io.side_files(staged, group))
        state_dict, planner = self.io.to_dcp(staged, url, group)
        digests.update(write_dcp(state_dict, url, group, planner, self.store.storage_options))
        return digests

    def load(self, state_dict: dict, url: str, group, read_timeout_s: float | None = None) -> int:
        """Collective (over ``group``) verified DCP load of the step at ``url`` into
        ``state_dict`` through the hooks (:meth:`PersistentIO.load_template`,
        :meth:`PersistentIO.after_load`). ``read_timeout_s`` (paths only): each open and read
        of DCP's is bounded (:class:`~tierckpt.io.bounded.BoundedFileSystem`: ``ReadTimeout``
        inside DCP's ``CheckpointException`` on every rank); None: unbounded.

        Returns:
            bytes this rank read (DCP's byte ranges plus the hooks' side files).
        Raises:
            TypeError: the hook's planner is not a VerifyingLoadPlanner.
            CheckpointException: DCP failed on some rank (e.g. a chunk not covered).
        """
        target, planner = self.io.load_template(state_dict, url, group)
        if not isinstance(planner, VerifyingLoadPlanner):
            raise TypeError(f"{type(self.io).__name__}.load_template must return a VerifyingLoadPlanner, "
                            f"not {type(planner).__name__}")
        reader = (CountingFileSystemReader(url) if "://" not in url
                  else CountingFsspecReader(url, **self.store.storage_options))
        if read_timeout_s is not None and isinstance(reader, CountingFileSystemReader):
            reader.fs = BoundedFileSystem(read_timeout_s)
        dcp.load(target, storage_reader=reader, planner=planner, process_group=group)
        return reader.bytes_read + self.io.after_load(state_dict, target, url, group)

    def committed_steps(self) -> list[int]:
        """Committed steps, ascending."""
        return sorted(self.committed_saves())

    def newest_still_committed(self, steps: list[int], timeout_s: float | None = None,
                               alive: Callable[[dict], bool] | None = None) -> int | None:
        """The newest of ``steps`` (in the order given, last newest: a run's commits in save
        order, whatever the step numbers) whose directory is still committed (each marker read,
        newest first: retention or a rollback may have taken one out since it was committed);
        None when none is. What a run's ``durable_step`` may name: a step that exists (and,
        with ``alive``, whose committed manifest ``alive`` accepts: not an abandoned save).

        ``timeout_s``: the reads are bounded (:func:`tierckpt.io.bounded.run_bounded`, seconds
        without progress): when the persistent root stops answering (a hung shared file
        system), the newest of ``steps`` is returned unverified, with a warning — this run
        committed it, and a close (or an exit) must not wait forever to confirm it. None:
        unbounded."""
        newest_first = list(dict.fromkeys(reversed(steps)))

        def newest(progress=None) -> int | None:
            for s in newest_first:
                if progress is not None:
                    progress.tick(self.store.url_of(layout.persistent_step(s)))
                try:
                    doc = manifest.read_committed(self.store, layout.persistent_step(s))
                    if doc is not None and (alive is None or alive(doc)):
                        return s
                except OSError:
                    continue
            return None

        if timeout_s is None or not steps:
            return newest()
        try:
            return run_bounded(newest, timeout_s, f"confirming the committed steps of {self.store.url}",
                               name="tierckpt-durable")
        except ReadTimeout as e:
            log.warning("tierckpt: %s; naming step %d durable unconfirmed (this run committed it)", e, newest_first[0])
            return newest_first[0]

    def newest_save_step(self) -> int | None:
        """The committed step of the newest save by agreed order (:func:`tierckpt.history.timeline.
        newest_step`: not the highest step number), None when none is committed."""
        return newest_step(self.committed_saves())

    def committed_saves_bounded(self, timeout_s: float) -> dict[int, tuple[str | None, tuple[int, int]]]:
        """:meth:`committed_saves` bounded by ``timeout_s`` seconds without progress (a tick per
        step directory read).

        Raises:
            ReadTimeout: the persistent root stopped answering (a hung shared file system); the
                listing is left behind on its daemon thread.
            OSError, ValueError: as :meth:`committed_saves`.
        """
        return {s: v[:2] for s, v in self.survey_bounded(timeout_s).items()}

    def survey_bounded(self, timeout_s: float) -> dict[int, tuple[str | None, tuple[int, int], Descent | None]]:
        """:meth:`survey` bounded as :meth:`committed_saves_bounded` (same errors)."""
        return run_bounded(self.survey, timeout_s, f"listing the persistent root {self.store.url}",
                           name="tierckpt-list")

    def committed_saves(self, progress=None) -> dict[int, tuple[str | None, tuple[int, int]]]:
        """{committed step: (save_id, order)} (:func:`tierckpt.history.timeline.of_manifest`);
        ``progress`` (:class:`~tierckpt.io.bounded.Progress`): ticked per step directory read."""
        return {s: v[:2] for s, v in self.survey(progress).items()}

    def survey(self, progress=None) -> dict[int, tuple[str | None, tuple[int, int], Descent | None]]:
        """{committed step: (save_id, order, descent)} (:func:`tierckpt.history.timeline.of_manifest`,
        :func:`~tierckpt.history.timeline.descent_of`); ``progress``: as :meth:`committed_saves`."""
        out = {}
        for name in self.store.listdir(""):
            s = layout.parse_step(name)
            if progress is not None:
                progress.tick(self.store.url_of(name))
            doc = manifest.read_committed(self.store, layout.persistent_step(s)) if s is not None else None
            if s is not None and doc is not None:
                out[s] = (*of_manifest(doc), descent_of(doc))
        return out

