"""Explicit rollback of a training run to an older committed step.

``TieredCheckpointer.restore(state, step=N)`` alone is read-only: an evaluation or any other
load-only run never rewrites history. A *training* run that names an older step (torchtitan
``checkpoint.load_step``, Megatron ``--ckpt-step``) asks for a rollback by name
(``restore(state, step=N, rollback=True)``). The committed steps newer than N that the restore
saw stay resume points until this run commits its first step of any tier; only then are they
superseded (commit marker renamed ``tierckpt.committed.superseded``, data kept), so a crash
before the new timeline's first commit loses nothing, and after it neither a restart nor
retention can prefer the abandoned timeline over the new one.

Each node leader supersedes the copies in its own local root (its steps and the replicas it
holds), global rank 0 the persistent tier: no collective, so it can run on whichever tier's
background thread records the first commit.
"""

from __future__ import annotations

import json
import logging
import threading
from typing import Callable

from tierckpt.io import layout, manifest
from tierckpt.io.storage import Store
from tierckpt.restore import Inventory

log = logging.getLogger(__name__)


class PendingRollback:
    """A rollback to ``to_step`` armed by a restore, executed at this run's first commit.

    Args:
        to_step: the step restored.
        inv: the inventory the restore planned from (every node's view, all-gathered).
        armed_at: ``time.time()`` of this process at the restore; a marker committed after it
            belongs to this run's new timeline and is never superseded.

    Attributes:
        from_step: the newest committed step at the restore (the abandoned timeline's head).
    """

    def __init__(self, to_step: int, inv: Inventory, armed_at: float):
        self.to_step = to_step
        self.armed_at = armed_at
        self.local = {n: sorted(s for s in steps if s > to_step) for n, steps in inv.local.items()}
        self.replicas = {src: {h: sorted(s for s in steps if s > to_step) for h, steps in by_h.items()}
                         for src, by_h in inv.replicas.items()}
        self.persistent = sorted(s for s in inv.persistent if s > to_step)
        newer = [s for s in inv.all_steps() if s > to_step]
        self.from_step = max(newer) if newer else to_step

    @property
    def empty(self) -> bool:
        """Nothing newer than ``to_step`` was committed anywhere."""
        return self.from_step == self.to_step

    def planned(self, exclude: dict[str, set[int]]) -> list[str]:
        """Every copy this rollback supersedes over the whole job, as ``persistent/<s>``,
        ``local node-<n>/<s>``, ``replica node-<src>@node-<holder>/<s>``; steps this run wrote
        itself (``exclude``: {"local" | "persistent": steps}) left out."""
        out = [f"persistent/{s}" for s in self.persistent if s not in exclude.get("persistent", ())]
        for n in sorted(self.local):
            out += [f"local node-{n}/{s}" for s in self.local[n] if s not in exclude.get("local", ())]
        for src in sorted(self.replicas):
            for h in sorted(self.replicas[src]):
                out += [f"replica node-{src}@node-{h}/{s}" for s in self.replicas[src][h]
                        if s not in exclude.get("local", ())]
        return out

    def execute(self, *, node: int, local_store: Store | None, persistent_store: Store | None,
                exclude: dict[str, set[int]]) -> list[str]:
        """Supersede this process's share: ``local_store`` (the node leader's local root, else
        None) and ``persistent_store`` (global rank 0's, else None). Returns what it renamed.

        Raises:
            OSError: a store cannot be read or a marker cannot be renamed.
        """
        done = []
        jobs: list[tuple[Store, str, str]] = []
        if local_store is not None:
            jobs += [(local_store, layout.local_step(s), f"local node-{node}/{s}")
                     for s in self.local.get(node, ()) if s not in exclude.get("local", ())]
            for src, by_h in sorted(self.replicas.items()):
                jobs += [(local_store, layout.replica_step(src, s), f"replica node-{src}@node-{node}/{s}")
                         for s in by_h.get(node, ()) if s not in exclude.get("local", ())]
        if persistent_store is not None:
            jobs += [(persistent_store, layout.persistent_step(s), f"persistent/{s}")
                     for s in self.persistent if s not in exclude.get("persistent", ())]
        for store, rel, label in jobs:
            if _committed_before(store, rel, self.armed_at) and manifest.supersede(store, rel):
                done.append(label)
        return done


def _committed_before(store: Store, rel: str, t: float) -> bool:
    """``rel`` is still committed by a marker written before ``t`` (not a copy this run wrote
    again under the same step number)."""
    try:
        marker = json.loads(store.read_bytes(f"{rel}/{layout.MARKER}"))
    except (FileNotFoundError, NotADirectoryError, ValueError):
        return False
    return isinstance(marker, dict) and float(marker.get("committed_at", 0.0)) < t


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

    def arm(self, step: int, inv: Inventory, now: float) -> None:
        """Remember the steps newer than ``step`` in ``inv`` (the restore's inventory)."""
        rb = PendingRollback(step, inv, now)
        if rb.empty:
            return
        with self._lock:
            self._pending = rb
        log.warning("tierckpt: rollback to step %d armed: the newer steps up to %d stay resume points "
                    "until this run commits its first step, then they are superseded", step, rb.from_step)

    def finish(self, tier: str, step: int, mine: Callable[[], dict[str, set[int]]]) -> None:
        """Run the armed rollback once, at this run's first committed step (``tier``, ``step``).
        ``mine()`` gives this run's own steps per tier (committed or being written), never
        superseded. Holding the lock to the end keeps the other tier's thread (its retention)
        waiting until the abandoned steps no longer count as the newest. Never raises (runs on
        a tier's thread): failures are warnings."""
        with self._lock:
            rb = self._pending
            if rb is None:
                return
            exclude = mine()
            try:
                gone = rb.execute(node=self.node, local_store=self.local_store,
                                  persistent_store=self.persistent_store, exclude=exclude)
                if gone:
                    log.warning("tierckpt: rolled back from step %d to %d at this run's first commit (%s step %d); "
                                "superseded (marker renamed *.superseded): %s", rb.from_step, rb.to_step, tier, step,
                                ", ".join(gone))
                for hook in self.hooks:
                    hook(rb)
            except Exception as e:
                log.warning("tierckpt: rollback to step %d: could not supersede newer steps: %s", rb.to_step, e)
            try:
                self.journal.rollback(rb, tier, step, exclude)
            except Exception as e:
                log.warning("tierckpt: rollback to step %d: could not record it: %s", rb.to_step, e)
            self._pending = None
