"""The save sequence every tier shares: prepare → write → checksum → commit.

One routine (:func:`save_step`) for the local tier (over a node's ranks, into the node-local
root) and the persistent tier (over all ranks, into the shared root); each phase after the
write is agreed over the group (:func:`tierckpt.cluster.collectives.run_agreed`), so a failure on
any rank leaves the step uncommitted — invisible to restore and retention — on every rank. The
commit protocol itself (manifest, then marker) is :mod:`tierckpt.io.manifest`.
"""

from __future__ import annotations

from typing import Callable

from tierckpt.cluster.collectives import all_gather, gather_reduced, run_agreed, union
from tierckpt.io import layout, manifest
from tierckpt.io.storage import Store


def hash_split(store: Store, step_rel: str, files: list[str], index: int, count: int) -> list[manifest.FileEntry]:
    """Checksum this rank's share (``files[index::count]``) of a step's files (re-read from disk)."""
    out = []
    for f in files[index::count]:
        e = manifest.hash_file(store, f"{step_rel}/{f}")
        out.append(manifest.FileEntry(f, e.size, e.xxh3_64))
    return out


def written_entries(store: Store, rel: str, mine: dict[str, tuple[int, str]], index: int, count: int,
                    group) -> list[manifest.FileEntry]:
    """Checksums of a just-saved step: ``mine`` ({relative path: (size bytes, xxh3-64)} hashed by
    this rank while writing), plus a re-read of any file no rank hashed (split ``index::count``
    across the group's ranks). Collective over ``group`` (all-gathers which files were hashed)."""
    hashed = gather_reduced(set(mine), group, union)
    missing = [f for f in manifest.data_files(store, rel) if f not in hashed]
    return [manifest.FileEntry(p, s, h) for p, (s, h) in sorted(mine.items())] + \
        hash_split(store, rel, missing, index, count)


def save_step(store: Store, rel: str, write: Callable[[], dict[str, tuple[int, str]]], group, *,
              index: int, count: int, leader: bool, label: str, mark_in_progress: bool = False,
              before_commit: Callable[[], None] | None = None, **manifest_fields) -> int:
    """Write and commit one step directory ``rel`` of ``store``; collective over ``group``.

    Args:
        write: the tier's DCP save of the step (collective); returns the digests its writer
            computed, {path relative to ``rel``: (size bytes, xxh3-64)} ({} if none).
        index, count: this rank's position among the ``count`` ranks that share re-hashing.
        leader: the one rank of ``group`` that prepares and commits the directory.
        label: names the step in agreement errors (``"local step 7"``).
        mark_in_progress: write :data:`tierckpt.io.layout.INPROGRESS` at prepare time (shared
            roots, so ``tierckpt ls`` shows a save in flight).
        before_commit: run on every rank in an agreed phase of its own before the write and
            again after it (overlapped staging's snapshot check,
            :meth:`tierckpt.staging.pool.StagingSlot.check_intact`); raising on any rank leaves
            the step unwritten or uncommitted on every rank of ``group``.
        manifest_fields: recorded in the manifest (:func:`tierckpt.io.manifest.commit`).

    Returns:
        bytes of the committed step (the same on every rank).
    Raises:
        PeerFailure / CheckpointException: some rank failed; the step stays uncommitted everywhere.
    """
    def prepare():
        if leader:
            manifest.uncommit(store, rel)
            store.rmtree(rel)
            store.makedirs(rel)
            if mark_in_progress:
                with store.open(f"{rel}/{layout.INPROGRESS}", "wb") as f:
                    f.write(b"tierckpt persistent save in progress\n")

    if before_commit is not None:  # a copy already known to be torn is not written
        run_agreed(before_commit, group, f"{label}: staged copy")
    run_agreed(prepare, group, f"{label}: prepare")
    mine = write() or {}
    if before_commit is not None:  # its own phase: a rank that fails it must not skip a collective
        run_agreed(before_commit, group, f"{label}: staged copy")
    entries = run_agreed(lambda: written_entries(store, rel, mine, index, count, group), group,
                         f"{label}: checksum")
    gathered = [e for part in all_gather(entries, group) for e in part]

    def do_commit():
        if leader:
            store.fsync_tree(rel)  # DCP fsyncs its files; this also covers the directories
            manifest.commit(store, rel, gathered, **manifest_fields)

    run_agreed(do_commit, group, f"{label}: commit")
    return sum(e.size for e in gathered)
