"""Rollbacks and fallbacks: a run that resumes from an older save starts a new timeline.

``TieredCheckpointer.restore(state, step=N)`` alone is read-only: an evaluation or any other
load-only run never rewrites history. A *training* run that names an older step (torchtitan
``checkpoint.load_step``, Megatron ``--ckpt-step``) asks for a rollback by name
(``restore(state, step=N, rollback=True)``). A restore without a step that could not serve the
newest save (a corrupt or missing copy made it fall back) starts a new timeline too: the newer
saves it passed over, and the other saves' copies of the restored step number, belong to a
timeline this run abandons.

A restore that served the newest save but still found copies of an abandoned timeline
committed (an earlier rollback whose supersede did not complete: a node died between the new
timeline's first commit and its own supersede, a rename failed, a root hung while that restore
listed it) supersedes them the same way (``cause: "leftover"``).

Either way the copies passed over stay resume points until this run commits its first step of
any tier; only then are they superseded (commit marker renamed
``tierckpt.committed.superseded``, data kept), so a crash before the new timeline's first commit
loses nothing. Neither a restart nor retention depends on the supersede having happened: both
order saves by their agreed order (:mod:`tierckpt.history.timeline`), in which the new
timeline's first commit is newer than every copy it passed over, whatever their step numbers.

What is passed over is decided by save identity and agreed order, never by comparing the wall
clocks of different hosts: every copy of a save newer (in agreed order) than the one restored,
of a higher step, or of another save under the restored step, and every copy of a save the
inventory proves abandoned (:func:`tierckpt.history.timeline.abandoned_saves`, whatever its step)
— except the copies this run wrote after the restore (a step number it wrote again). The
supersede only tidies up: restore and retention already ignore an abandoned save by identity.

Each node leader supersedes the copies in its own local root (its steps and the replicas it
holds; bounded by ``restore_read_timeout_s``: a hung disk is a failed rename), global rank 0
the persistent tier, at the first committed record of whichever tier's background thread gets
there first (no collective). Then every tier's thread, at its own first committed record after
the restore (the same record on every rank: a deterministic point), all-gathers what each
process superseded and what failed over that tier's world group; the first such exchange makes
the ``rollback`` ledger record, naming what was actually superseded and what failed. A failed
copy is retried at the next commits (each retry that changes something is a ``retry`` record),
at most :data:`RETRIES` exchanges per tier; what is still committed after that is left to the
next start's restore (``cause: "leftover"``).
"""

from __future__ import annotations

import logging
import threading
from typing import Protocol

from tierckpt.cluster.collectives import all_gather
from tierckpt.history.timeline import LEGACY_ORDER, of_manifest, run_of, save_key, seq_of
from tierckpt.io import layout, manifest
from tierckpt.io.bounded import run_bounded
from tierckpt.io.storage import Store

log = logging.getLogger(__name__)

EXPLICIT, FALLBACK, LEFTOVER = "rollback", "fallback", "leftover"
RETRIES = 3
"""Exchanges per tier after the first while copies failed to be superseded; then the failed
copies are left to the next start."""


class Inventory(Protocol):
    """What a rollback reads of the restore's inventory (:class:`tierckpt.restore.Inventory`,
    the restore wing above this one: history does not import it; fields as documented there)."""

    local: dict[int, set[int]]
    replicas: dict[int, dict[int, set[int]]]
    persistent: set[int]
    dirs: dict[int, set[tuple[int, str]]]
    saves: dict[int, dict[str | None, dict[int, dict[int, str]]]]
    orders: dict[str | None, tuple[int, int]]
    persistent_ids: dict[int, str | None]

    def all_steps(self) -> set[int]: ...

    def abandoned(self) -> dict[str, str | None]: ...


class PendingRollback:
    """A new timeline from ``to_step`` (save ``keep``) armed by a restore, executed at this run's
    first commit.

    Args:
        to_step: the step restored.
        inv: the inventory the restore planned from (every node's view, all-gathered).
        keep: the save restored (its copies of ``to_step`` stay).
        run, first_seq: this run's id and the number of its first ``save()`` call after the
            restore: copies of those saves (the new timeline) are never superseded.
        cause: :data:`EXPLICIT` (a rollback by name), :data:`FALLBACK` (a restore that could
            not serve the newest save) or :data:`LEFTOVER` (it served the newest save, and
            found an abandoned timeline's copies still committed).

    Attributes:
        from_step: the step of the newest save passed over (the abandoned timeline's head), or
            ``to_step`` when none is.
        copies: {holder node: [(step, directory relative to its local root)]} of node-local
            copies passed over; ``persistent``: persistent steps passed over.
    """

    def __init__(self, to_step: int, inv: Inventory, keep: str | None, run: str, first_seq: int = 0,
                 cause: str = EXPLICIT):
        self.to_step, self.keep, self.run, self.first_seq, self.cause = to_step, keep, run, first_seq, cause
        orders = getattr(inv, "orders", {}) or {}
        self._keep_key = save_key(to_step, keep, orders.get(keep, LEGACY_ORDER))
        self._gone = set(inv.abandoned()) - {keep}
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
        heads: list[tuple] = []
        for s in sorted(dirs):
            for h, rel in sorted(dirs[s]):
                sid = ids.get((h, rel), keep)
                order = orders.get(sid, LEGACY_ORDER)
                if self.passed_over(s, sid, order):
                    self.copies.setdefault(h, []).append((s, rel))
                    heads.append(save_key(s, sid, order))
        self.persistent = []
        for s in sorted(inv.persistent):
            sid = inv.persistent_ids.get(s, keep)
            order = orders.get(sid, LEGACY_ORDER)
            if self.passed_over(s, sid, order):
                self.persistent.append(s)
                heads.append(save_key(s, sid, order))
        self.from_step = max(heads)[-1] if heads else to_step

    def passed_over(self, step: int, save_id: str | None, order: tuple[int, int] = LEGACY_ORDER) -> bool:
        """A copy of ``step`` written by ``save_id`` (agreed ``order``) belongs to a timeline this
        run abandons: a save newer than the one restored, a higher step, another save under
        the restored step, or a save the inventory proves abandoned — unless this run wrote it
        after the restore."""
        if save_id is not None and run_of(save_id) == self.run and seq_of(save_id) >= self.first_seq:
            return False
        if save_id in self._gone:
            return True
        if step == self.to_step:
            return save_id != self.keep
        return step > self.to_step or save_key(step, save_id, order) > self._keep_key

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

    def jobs(self, node: int, local_store: Store | None,
             persistent_store: Store | None) -> list[tuple[Store, int, str, str]]:
        """This process's share, as ``(store, step, directory, label)``: ``local_store`` (the node
        leader's local root, else None) and ``persistent_store`` (global rank 0's, else None)."""
        out: list[tuple[Store, int, str, str]] = []
        if local_store is not None:
            out += [(local_store, s, rel, _label(node, rel, s)) for s, rel in self.copies.get(node, ())]
        if persistent_store is not None:
            out += [(persistent_store, s, layout.persistent_step(s), f"persistent/{s}") for s in self.persistent]
        return out

    def supersede_one(self, store: Store, step: int, rel: str) -> bool | None:
        """Supersede one copy when its manifest, read now, still names a save passed over.
        Returns True when superseded now (or found superseded already), None when there is
        nothing to do (gone, or replaced by this run's own copy of the step).

        Raises:
            OSError: the marker could not be renamed.
        """
        doc = manifest.read_committed(store, rel)
        if doc is None:
            return True if manifest.superseded(store, rel) else None
        if not self.passed_over(step, *of_manifest(doc)):
            return None
        return True if manifest.supersede(store, rel, strict=True) else None

    def execute(self, *, node: int, local_store: Store | None, persistent_store: Store | None,
                only: set[str] | None = None, timeout_s: float | None = None) -> tuple[list[str], dict[str, str]]:
        """Supersede this process's share (:meth:`jobs`; ``only``: just these labels, a retry).
        Returns (labels superseded, {label: error} of copies that could not be). A store that
        stops answering for ``timeout_s`` seconds fails its remaining copies (the rename left
        behind on a helper thread; a later retry reads the copy again)."""
        jobs = [j for j in self.jobs(node, local_store, persistent_store) if only is None or j[3] in only]
        done: list[str] = []
        failed: dict[str, str] = {}

        def run(progress=None) -> None:
            for store, s, rel, label in jobs:
                if progress is not None:
                    progress.tick(store.url_of(rel))
                try:
                    if self.supersede_one(store, s, rel):
                        done.append(label)
                except OSError as e:
                    failed[label] = f"{type(e).__name__}: {e}"

        try:
            if timeout_s is None or not jobs:
                run()
            else:
                run_bounded(run, timeout_s, "superseding the copies of an abandoned timeline", name="tierckpt-supersede")
        except OSError as e:  # ReadTimeout: the copies not reached fail
            for _, _, _, label in jobs:
                if label not in done and label not in failed:
                    failed[label] = f"{type(e).__name__}: {e}"
        return list(done), dict(failed)


def _label(holder: int, rel: str, step: int) -> str:
    """``local node-<holder>/<step>`` or ``replica node-<src>@node-<holder>/<step>``."""
    parts = rel.split("/")
    src = layout.parse_node(parts[1]) if len(parts) > 2 and parts[0] == "replicas" else None
    return f"local node-{holder}/{step}" if src is None else f"replica node-{src}@node-{holder}/{step}"


class RollbackTracker:
    """Arms a rollback at restore time, runs it at this run's first commit, records what every
    process superseded, retries what failed (see the module docstring).

    Args:
        journal: the run's :class:`~tierckpt.history.journal.RunJournal` (``rollback`` records).
        node: this rank's node id.
        local_store: the node's local root on its node leader, else None.
        persistent_store: the persistent root on global rank 0, else None.
        tiers: the configured tiers (each one's thread exchanges the outcome once it commits).
        timeout_s: bound of the renames in one store (``restore_read_timeout_s``), None: none.

    Attributes:
        hooks: called with the :class:`PendingRollback` once this process ran its share (and
            again after a retry that superseded more; on a tier's thread): adapters point a
            framework's own "latest" record (Megatron's tracker file) away from superseded steps.
    """

    def __init__(self, journal, node: int, local_store: Store | None, persistent_store: Store | None,
                 tiers: tuple[str, ...] = ("local", "persistent"), timeout_s: float | None = None):
        self.journal, self.node = journal, node
        self.local_store, self.persistent_store = local_store, persistent_store
        self.tiers, self.timeout_s = tuple(tiers), timeout_s
        self.hooks: list = []
        self._pending: PendingRollback | None = None
        self._lock = threading.Lock()
        self._reset()

    def _reset(self) -> None:
        self._ran = False
        self._done: list[str] = []  # this process's copies superseded (cumulative)
        self._failed: dict[str, str] = {}  # this process's copies not superseded yet: {label: error}
        self._lanes: dict[str, int] = {}  # tier: exchanges left before its failed copies are left
        self._recorded: set[str] = set()  # copies named superseded by a record already
        self._records = 0

    @property
    def armed(self) -> bool:
        """A rollback waits for this run's first commit, or for its outcome to be exchanged."""
        return self._pending is not None

    def wants(self, tier: str) -> bool:
        """Whether ``tier``'s next committed record runs :meth:`finish` (the same on every rank:
        armed at a restore, ended by that tier's own exchanges)."""
        with self._lock:
            return self._pending is not None and tier in self._lanes

    def arm(self, step: int, inv: Inventory, keep: str | None, run: str, first_seq: int,
            cause: str = EXPLICIT) -> None:
        """Remember the copies ``inv`` (the restore's inventory) holds that the restored save
        (``step``, save ``keep``) passes over (:meth:`PendingRollback.passed_over`); ``run``,
        ``first_seq``: this run's id and its next ``save()`` number; ``cause``: :data:`EXPLICIT`,
        :data:`FALLBACK` or :data:`LEFTOVER`. Nothing to remember: nothing armed (and an earlier
        armed one that has not run yet is replaced: the newest restore decides the timeline).
        Called on every rank with the lanes drained."""
        rb = PendingRollback(step, inv, keep, run, first_seq, cause)
        with self._lock:
            self._pending = None if rb.empty else rb
            self._reset()
            if not rb.empty:
                self._lanes = {t: RETRIES + 1 for t in self.tiers}
        if rb.empty:
            return
        why = {EXPLICIT: "rollback", FALLBACK: "fallback (the newest save could not be restored)",
               LEFTOVER: "leftovers of an abandoned timeline found committed"}.get(cause, cause)
        log.warning("tierckpt: %s to step %d armed: %d copies of newer or other saves (up to step %d) stay resume "
                    "points until this run commits its first step, then they are superseded", why, step,
                    len(rb.planned()), rb.from_step)

    def finish(self, tier: str, step: int, group=None) -> None:
        """At a committed record of ``tier`` (step ``step``) while :meth:`wants` it: run (or retry)
        this process's share, then exchange every process's outcome over ``group`` (the tier's
        world group, every rank at this same record; None: this process only) and record it.
        Never raises (runs on a tier's thread): failures are warnings and ``failed`` entries."""
        with self._lock:
            rb = self._pending
            if rb is None or tier not in self._lanes:
                return
            if not self._ran or self._failed:
                self._run(rb, tier, step)
            mine = (sorted(self._done), dict(self._failed))
        reports = [mine]
        if group is not None:
            try:
                reports = all_gather(mine, group)
            except Exception as e:  # a peer is gone: what the others did is unknown here
                log.warning("tierckpt: rollback to step %d: could not exchange the supersede outcome: %s",
                            rb.to_step, e)
                reports = [(mine[0], {**mine[1], "other nodes": f"outcome unknown ({type(e).__name__}: {e})"})]
        with self._lock:
            if self._pending is rb:
                self._settle(rb, reports, tier, step)

    def _run(self, rb: PendingRollback, tier: str, step: int) -> None:
        """This process's share (all of it the first time, the failed copies after), the hooks."""
        first = not self._ran
        done, failed = rb.execute(node=self.node, local_store=self.local_store, persistent_store=self.persistent_store,
                                  only=None if first else set(self._failed), timeout_s=self.timeout_s)
        self._ran = True
        self._done += [d for d in done if d not in self._done]
        self._failed = dict(failed)  # a retry runs exactly the copies that had failed
        if done:
            log.warning("tierckpt: %s from step %d to %d at this run's %s commit (%s step %d); superseded (marker "
                        "renamed *.superseded): %s", "rolled back" if rb.cause == EXPLICIT else "new timeline",
                        rb.from_step, rb.to_step, "first" if first else "next", tier, step, ", ".join(done))
        if failed:
            log.warning("tierckpt: rollback to step %d: could not supersede %s; retried at the next commit, else at "
                        "the next start", rb.to_step, "; ".join(f"{k} ({v})" for k, v in sorted(failed.items())))
        if first or done:
            for hook in self.hooks:
                try:
                    hook(rb)
                except Exception as e:
                    log.warning("tierckpt: rollback to step %d: a rollback hook failed: %s", rb.to_step, e)

    def _settle(self, rb: PendingRollback, reports: list, tier: str, step: int) -> None:
        """Merge every process's outcome (the same on every rank), record what is new, and end
        ``tier``'s exchanges once nothing failed or its retries are spent."""
        done = sorted({d for r in reports if r for d in r[0]})
        failed = {k: v for r in reports if r for k, v in r[1].items() if k not in done}
        new = [d for d in done if d not in self._recorded]
        if self._records == 0 or new:
            try:
                self.journal.rollback(rb, tier, step, superseded=new,
                                      failed=[f"{k}: {v}" for k, v in sorted(failed.items())], retry=self._records > 0)
            except Exception as e:
                log.warning("tierckpt: rollback to step %d: could not record it: %s", rb.to_step, e)
            self._records += 1
            self._recorded.update(new)
        self._lanes[tier] -= 1
        if not failed or self._lanes[tier] <= 0:
            if failed:
                log.warning("tierckpt: rollback to step %d: %d copies still not superseded after %d retries; the next "
                            "start's restore supersedes what is still committed", rb.to_step, len(failed), RETRIES)
            del self._lanes[tier]
        if not self._lanes:
            self._pending = None
