"""Rollbacks and fallbacks: a run that resumes from an older save starts a new timeline.

``TieredCheckpointer.restore(state, step=N)`` alone is read-only: an evaluation or any other
load-only run never rewrites history. A *training* run that names an older step (torchtitan
``checkpoint.load_step``, Megatron ``--ckpt-step``) asks for a rollback by name
(``restore(state, step=N, rollback=True)``). A restore without a step that could not serve the
newest save (a corrupt or missing copy made it fall back) starts a new timeline too: the newer
saves it passed over, and the other saves' copies of the restored step number, belong to a
timeline this run abandons.

Either way the copies passed over stay resume points until this run commits its first step of
any tier; only then are they superseded (commit marker renamed
``tierckpt.committed.superseded``, data kept), so a crash before the new timeline's first commit
loses nothing, and after it neither a restart nor retention can prefer the abandoned timeline
over the new one (retention counts committed steps only: a corrupt newest step can no longer
make it delete the step just committed).

What is superseded is decided by save identity (:mod:`tierckpt.history.timeline`), never by
comparing the wall clocks of different hosts: a copy is left alone when its manifest names the
save restored or a save this run made after the restore (a step number it wrote again).

Each node leader supersedes the copies in its own local root (its steps and the replicas it
holds), global rank 0 the persistent tier: no collective, so it can run on whichever tier's
background thread records the first commit.
"""

from __future__ import annotations

import logging
import threading
from typing import Protocol

from tierckpt.history.timeline import of_manifest, run_of, seq_of
from tierckpt.io import layout, manifest
from tierckpt.io.storage import Store

log = logging.getLogger(__name__)

EXPLICIT, FALLBACK = "rollback", "fallback"


class Inventory(Protocol):
    """What a rollback reads of the restore's inventory (:class:`tierckpt.restore.Inventory`,
    the restore wing above this one: history does not import it; fields as documented there)."""

    local: dict[int, set[int]]
    replicas: dict[int, dict[int, set[int]]]
    persistent: set[int]
    dirs: dict[int, set[tuple[int, str]]]
    saves: dict[int, dict[str | None, dict[int, dict[int, str]]]]
    persistent_ids: dict[int, str | None]

    def all_steps(self) -> set[int]: ...


class PendingRollback:
    """A new timeline from ``to_step`` (save ``keep``) armed by a restore, executed at this run's
    first commit.

    Args:
        to_step: the step restored.
        inv: the inventory the restore planned from (every node's view, all-gathered).
        keep: the save restored (its copies of ``to_step`` stay).
        run, first_seq: this run's id and the number of its first ``save()`` call after the
            restore: copies of those saves (the new timeline) are never superseded.
        cause: :data:`EXPLICIT` (a rollback by name) or :data:`FALLBACK` (a restore that could
            not serve the newest save).

    Attributes:
        from_step: the newest committed step at the restore (the abandoned timeline's head).
        copies: {holder node: [(step, directory relative to its local root)]} of node-local
            copies passed over; ``persistent``: persistent steps passed over.
    """

    def __init__(self, to_step: int, inv: Inventory, keep: str | None, run: str, first_seq: int = 0,
                 cause: str = EXPLICIT):
        self.to_step, self.keep, self.run, self.first_seq, self.cause = to_step, keep, run, first_seq, cause
        ids = {(h, rel): sid for s, by_save in inv.saves.items() for sid, by_node in by_save.items()
               for by_h in by_node.values() for h, rel in by_h.items()}
        dirs = {s: set(d) for s, d in inv.dirs.items()}
        if not any(dirs.values()):  # an inventory made of local/replicas sets only (no directories)
            for n, steps in inv.local.items():
                for s in steps:
                    dirs.setdefault(s, set()).add((n, layout.local_step(s)))
            for src, by_h in inv.replicas.items():
                for h, steps in by_h.items():
                    for s in steps:
                        dirs.setdefault(s, set()).add((h, layout.replica_step(src, s)))
        self.copies: dict[int, list[tuple[int, str]]] = {}
        for s in sorted(dirs):
            for h, rel in sorted(dirs[s]):
                if self._passed_over(s, ids.get((h, rel), keep)):
                    self.copies.setdefault(h, []).append((s, rel))
        self.persistent = sorted(s for s in inv.persistent if self._passed_over(s, inv.persistent_ids.get(s, keep)))
        newer = [s for s in inv.all_steps() if s > to_step]
        self.from_step = max(newer) if newer else to_step

    def _passed_over(self, step: int, save_id: str | None) -> bool:
        """A copy of ``step`` written by ``save_id`` belongs to a timeline this run abandons."""
        if save_id is not None and run_of(save_id) == self.run and seq_of(save_id) >= self.first_seq:
            return False
        return step > self.to_step or (step == self.to_step and save_id != self.keep)

    @property
    def empty(self) -> bool:
        """Nothing to supersede: the restore served the newest save."""
        return not self.persistent and not any(self.copies.values())

    def planned(self) -> list[str]:
        """Every copy this timeline passes over, as ``persistent/<s>``, ``local node-<n>/<s>``,
        ``replica node-<src>@node-<holder>/<s>``."""
        out = [f"persistent/{s}" for s in self.persistent]
        for h in sorted(self.copies):
            out += [_label(h, rel, s) for s, rel in self.copies[h]]
        return out

    def execute(self, *, node: int, local_store: Store | None, persistent_store: Store | None) -> list[str]:
        """Supersede this process's share: ``local_store`` (the node leader's local root, else
        None) and ``persistent_store`` (global rank 0's, else None). A copy is superseded only
        when its manifest, read now, still names a save passed over (a directory this run wrote
        again under the same step number is left). Returns what it renamed.

        Raises:
            OSError: a store cannot be read or a marker cannot be renamed.
        """
        jobs: list[tuple[Store, int, str, str]] = []
        if local_store is not None:
            jobs += [(local_store, s, rel, _label(node, rel, s)) for s, rel in self.copies.get(node, ())]
        if persistent_store is not None:
            jobs += [(persistent_store, s, layout.persistent_step(s), f"persistent/{s}") for s in self.persistent]
        done = []
        for store, s, rel, label in jobs:
            doc = manifest.read_committed(store, rel)
            if doc is not None and self._passed_over(s, of_manifest(doc)[0]) and manifest.supersede(store, rel):
                done.append(label)
        return done


def _label(holder: int, rel: str, step: int) -> str:
    """``local node-<holder>/<step>`` or ``replica node-<src>@node-<holder>/<step>``."""
    parts = rel.split("/")
    src = layout.parse_node(parts[1]) if len(parts) > 2 and parts[0] == "replicas" else None
    return f"local node-{holder}/{step}" if src is None else f"replica node-{src}@node-{holder}/{step}"


class RollbackTracker:
    """Arms a rollback at restore time and runs it at this run's first commit.

    Args:
        journal: the run's :class:`~tierckpt.history.journal.RunJournal` (``rollback`` record).
        node: this rank's node id.
        local_store: the node's local root on its node leader, else None.
        persistent_store: the persistent root on global rank 0, else None.

    Attributes:
        hooks: called with the :class:`PendingRollback` once it ran (on a tier's thread):
            adapters point a framework's own "latest" record (Megatron's tracker file) away from
            superseded steps.
    """

    def __init__(self, journal, node: int, local_store: Store | None, persistent_store: Store | None):
        self.journal, self.node = journal, node
        self.local_store, self.persistent_store = local_store, persistent_store
        self.hooks: list = []
        self._pending: PendingRollback | None = None
        self._lock = threading.Lock()

    @property
    def armed(self) -> bool:
        """A rollback waits for this run's first commit."""
        return self._pending is not None

    def arm(self, step: int, inv: Inventory, keep: str | None, run: str, first_seq: int,
            cause: str = EXPLICIT) -> None:
        """Remember the copies ``inv`` (the restore's inventory) holds of saves newer than the
        restored one (``step``, save ``keep``) and of other saves under ``step``; ``run``,
        ``first_seq``: this run's id and its next ``save()`` number; ``cause``: :data:`EXPLICIT`
        or :data:`FALLBACK`. Nothing to remember: nothing armed (and an earlier armed one that
        has not run yet is replaced: the newest restore decides the timeline)."""
        rb = PendingRollback(step, inv, keep, run, first_seq, cause)
        with self._lock:
            self._pending = None if rb.empty else rb
        if rb.empty:
            return
        why = "rollback" if cause == EXPLICIT else "fallback (the newest save could not be restored)"
        log.warning("tierckpt: %s to step %d armed: %d newer or other saves' copies (up to step %d) stay resume "
                    "points until this run commits its first step, then they are superseded", why, step,
                    len(rb.planned()), rb.from_step)

    def finish(self, tier: str, step: int) -> None:
        """Run the armed rollback once, at this run's first committed step (``tier``, ``step``).
        Holding the lock to the end keeps the other tier's thread (its retention) waiting until
        the abandoned steps no longer count as the newest. Never raises (runs on a tier's
        thread): failures are warnings."""
        with self._lock:
            rb = self._pending
            if rb is None:
                return
            try:
                gone = rb.execute(node=self.node, local_store=self.local_store,
                                  persistent_store=self.persistent_store)
                if gone:
                    log.warning("tierckpt: rolled back from step %d to %d at this run's first commit (%s step %d); "
                                "superseded (marker renamed *.superseded): %s", rb.from_step, rb.to_step, tier, step,
                                ", ".join(gone))
                for hook in self.hooks:
                    hook(rb)
            except Exception as e:
                log.warning("tierckpt: rollback to step %d: could not supersede newer steps: %s", rb.to_step, e)
            try:
                self.journal.rollback(rb, tier, step)
            except Exception as e:
                log.warning("tierckpt: rollback to step %d: could not record it: %s", rb.to_step, e)
            self._pending = None
