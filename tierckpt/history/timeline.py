"""Save identity: which ``save()`` call wrote a committed copy, and which save is newer.

Every copy of one save — a node's own local step, each of its replicas, a pulled copy, the
persistent step — records the same identity in its manifest (replicas and pulls keep the source
manifest's bytes), so a restore combines only copies of one save (:func:`tierckpt.restore.plan.
plan_restore`), and a rollback or a fallback tells this run's copies from an abandoned
timeline's by identity, never by the wall clock of the host that wrote them
(:mod:`tierckpt.history.rollback`).

Identity fields of a manifest:

- ``save_id``: ``"<run id>.<seq>"`` — the run id every rank of the job agreed at start (the
  ledger's ``run_id``) and the number of the ``save()`` call in that run (every rank calls
  ``save()`` collectively, so every rank counts the same). The tiers of one ``save()`` call
  share it: a local and a persistent copy of step N from two different calls never combine.
- ``save_order``: ``[generation, seq]``, the agreed order of saves. The generation of a run is
  one more than the highest generation recorded by any committed copy the job could see when it
  started (its node-local roots and the persistent tier, all-gathered), so a later run's saves
  order after every save it could have restored, whatever the hosts' clocks say.

- ``descends_from``: what the run that made the save had restored (:class:`Descent`): the
  parent save's ``save_id``, ``save_order`` and ``step``, and ``since``, the order of the run's
  first ``save()`` after that restore; ``null`` for a run that restored nothing (a fresh start)
  or only read an explicit step (a read-only restore).

Copies written before save identities existed record neither: they form one legacy save per
step (identity ``None``), ordered by step among themselves and before every identified save,
which is how they were planned before. Copies written before ``descends_from`` existed prove
nothing about other saves.

**Which saves are abandoned** (:func:`abandoned_saves`): a save ``S`` descending from ``P``
proves every save ``X`` ordered strictly between ``P`` and ``S``'s ``since`` abandoned — the run
that made ``S`` resumed ``P``, so it trained past ``X`` without it (a rollback or a fallback
passed ``X`` over, or ``X`` was not visible). That is a fact of the saves' identities, not of
their commit markers: an abandoned save is never resumed, counted by retention nor named
``durable_step``, whether or not its copies' supersede (:mod:`tierckpt.history.rollback`) has
happened — a node that died before renaming them, a rename that keeps failing, and then no save
of the new timeline servable, still resume the step the new timeline started from. Only a save
that is not itself abandoned proves anything (walked newest first: an abandoned timeline's own
saves cannot abandon the timeline that superseded them).

**Which save is newest** (:func:`save_key`): the save order, never the step number. A restore
without an explicit step resumes the newest save every node can be served from
(:func:`tierckpt.restore.plan.choose`), retention keeps the newest ``keep_latest_k`` saves
(:mod:`tierckpt.tiers.retention`), and ``durable_step`` is the run's last persistent save that
still exists: a timeline abandoned by a rollback or a fallback whose copies are still committed
(a node died before superseding them, a rename failed, a root hung while the restore listed
it) holds higher step numbers but older saves, so it never wins over the new timeline.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Iterable, Mapping

LEGACY_ORDER = (-1, -1)
DESCENT_FIELD = "descends_from"


@dataclass(frozen=True)
class Descent:
    """What a run's saves descend from (the manifest's ``descends_from``; module docstring).

    Attributes:
        parent: the ``save_id`` of the save the run restored (None: a copy without identity).
        parent_order: its ``save_order`` (``LEGACY_ORDER`` for a copy without identity).
        step: its step.
        since: ``(generation, seq)`` of the run's first ``save()`` after that restore.
    """

    parent: str | None
    parent_order: tuple[int, int]
    step: int
    since: tuple[int, int]

    def covers(self, save_id: str | None, order: tuple[int, int]) -> bool:
        """Whether this descent proves save ``save_id`` (``order``) abandoned: an identified save
        ordered strictly between the parent and ``since``."""
        if is_legacy(save_id, order):
            return False
        return tuple(self.parent_order) < tuple(order) < tuple(self.since)

    def manifest_value(self) -> dict:
        """The manifest's ``descends_from`` value."""
        return {"save_id": self.parent, "save_order": list(self.parent_order), "step": self.step,
                "since": list(self.since)}


def descent_of(doc: dict | None) -> Descent | None:
    """The :class:`Descent` a manifest records; None when it records none (``null``, an older
    manifest) or an unreadable value (which then proves nothing)."""
    v = doc.get(DESCENT_FIELD) if isinstance(doc, dict) else None
    if not isinstance(v, dict):
        return None
    try:
        parent = v.get("save_id")
        order = tuple(int(x) for x in v["save_order"])
        since = tuple(int(x) for x in v["since"])
        step = int(v["step"])
    except (KeyError, TypeError, ValueError):
        return None
    if len(order) != 2 or len(since) != 2 or not (parent is None or isinstance(parent, str)):
        return None
    return Descent(parent, (order[0], order[1]), step, (since[0], since[1]))


def abandoned_saves(saves: Mapping[str | None, tuple[tuple[int, int], Descent | None]],
                    proofs: Iterable[Descent] = ()) -> dict[str, str | None]:
    """The abandoned saves among ``saves`` (``{save_id: (order, descent or None)}``, e.g. every
    committed copy a restore or a listing sees), as ``{abandoned save_id: the save_id proving
    it}`` (see the module docstring).

    Saves are walked newest first (:func:`sort_key`); a save is abandoned when a save walked
    before it, itself not abandoned, proves it (:meth:`Descent.covers`). ``proofs``: descents
    known to be live (this run's own: its saves are newer than every save listed), checked
    first; they prove as ``None``. Copies without identity are never abandoned."""
    live: list[tuple[str | None, Descent]] = [(None, d) for d in proofs]
    seen: set[Descent] = {d for _, d in live}
    out: dict[str, str | None] = {}
    for sid, (order, d) in sorted(((k, v) for k, v in saves.items() if k is not None),
                                  key=lambda kv: sort_key(kv[0], kv[1][0]), reverse=True):
        by = [p for p, pd in live if pd.covers(sid, order)]
        if by:
            out[sid] = by[0]
            continue
        if d is not None and d not in seen:
            seen.add(d)
            live.append((sid, d))
    return out


@dataclass(frozen=True)
class SaveIdentity:
    """One ``save()`` call's identity (see the module docstring).

    Attributes:
        run: the run id (12 hex characters, agreed at start).
        generation: the run's generation (>= 0).
        seq: the number of the ``save()`` call in this run (>= 0).
        descent: what this run's saves descend from (recorded as ``descends_from``), None: nothing.
        abandoned: save ids the run's last restore found abandoned (its inventory): retention does
            not count them (not recorded in manifests).
    """

    run: str
    generation: int
    seq: int
    descent: Descent | None = None
    abandoned: frozenset[str] = field(default=frozenset(), compare=False)

    @property
    def save_id(self) -> str:
        """``"<run>.<seq>"``."""
        return f"{self.run}.{self.seq}"

    @property
    def order(self) -> tuple[int, int]:
        """``(generation, seq)``: larger is newer."""
        return (self.generation, self.seq)

    def manifest_fields(self) -> dict:
        """What a tier records in the manifest of a copy of this save."""
        return {"save_id": self.save_id, "save_order": list(self.order),
                DESCENT_FIELD: None if self.descent is None else self.descent.manifest_value()}


def of_manifest(doc: dict | None) -> tuple[str | None, tuple[int, int]]:
    """``(save_id, order)`` recorded by a manifest; ``(None, LEGACY_ORDER)`` when it records none
    (a copy written before save identities) or an unreadable value."""
    if not isinstance(doc, dict):
        return None, LEGACY_ORDER
    sid, order = doc.get("save_id"), doc.get("save_order")
    if not isinstance(sid, str):
        return None, LEGACY_ORDER
    try:
        gen, seq = (int(x) for x in order)  # type: ignore[union-attr]
    except (TypeError, ValueError):
        return sid, LEGACY_ORDER
    return sid, (gen, seq)


def run_of(save_id: str | None) -> str | None:
    """The run id part of a ``save_id`` (None for a legacy copy)."""
    return None if save_id is None else save_id.rsplit(".", 1)[0]


def seq_of(save_id: str | None) -> int:
    """The ``save()`` call number part of a ``save_id`` (-1 for a legacy or malformed id)."""
    try:
        return int(save_id.rsplit(".", 1)[1]) if save_id else -1
    except (IndexError, ValueError):
        return -1


def sort_key(save_id: str | None, order: tuple[int, int]) -> tuple:
    """Sort key of a save, newest last: its order, then its id (a tie only between runs that
    could not see each other's copies; broken the same way on every rank)."""
    return (tuple(order), save_id or "")


def is_legacy(save_id: str | None, order: tuple[int, int]) -> bool:
    """Whether a copy records no usable identity (ordered by its step, before every save that does)."""
    return save_id is None or tuple(order) == LEGACY_ORDER


def save_key(step: int, save_id: str | None, order: tuple[int, int]) -> tuple:
    """Sort key of a copy of ``step`` written by save ``save_id`` (``order``), newest last: legacy
    copies (:func:`is_legacy`) by step, before every identified save; identified saves by their
    agreed order (then id, then step), whatever their step numbers."""
    if is_legacy(save_id, order):
        return (0, step, 0, save_id or "", step)
    return (1, int(order[0]), int(order[1]), save_id or "", step)


def newest_step(saves: dict[int, tuple[str | None, tuple[int, int]]]) -> int | None:
    """The step of the newest save (:func:`save_key`) among ``{step: (save_id, order)}`` (e.g.
    :meth:`tierckpt.tiers.persistent.PersistentTier.committed_saves`); None when empty."""
    if not saves:
        return None
    return max(saves, key=lambda s: save_key(s, *saves[s]))


class Timeline:
    """The saves of this run: hands out one :class:`SaveIdentity` per ``save()`` call.

    Args:
        run: the run id agreed by every rank.
        generation: one more than the newest generation any committed copy recorded at start
            (:func:`tierckpt.startup.agree_generation`), the same on every rank.
    """

    def __init__(self, run: str, generation: int):
        if generation < 0:
            raise ValueError(f"generation must be >= 0, got {generation}")
        self.run, self.generation = run, generation
        self._seq = 0
        self._last: tuple[int, SaveIdentity] | None = None
        self._lock = threading.Lock()
        self.descent: Descent | None = None
        self.abandoned: frozenset[str] = frozenset()

    def for_step(self, step: int) -> SaveIdentity:
        """The identity of a ``save()`` call of ``step`` (every rank calls it once per call).

        Calls for the same step in a row share one identity: adapters write one step's tiers in
        two calls (a preemption save of the tiers that were not due; Megatron's local and
        persistent formats), and those copies are one state. A new step — or any step after
        :meth:`restored` — gets the next number."""
        with self._lock:
            if self._last is not None and self._last[0] == step:
                return self._last[1]
            ident = SaveIdentity(self.run, self.generation, self._seq, self.descent, self.abandoned)
            self._seq += 1
            self._last = (step, ident)
        return ident

    def restored(self, parent: tuple[int, str | None, tuple[int, int]] | None = None,
                 abandoned: Iterable[str] = ()) -> None:
        """The state was replaced by a restore: the next save is a new one even under the step
        number saved last.

        Args:
            parent: ``(step, save_id, order)`` of the save restored when the restore started a
                new timeline (every save of this run from now on descends from it: a
                :class:`Descent` since the next ``save()``); None: a read-only restore (the
                saves prove nothing).
            abandoned: save ids the restore's inventory found abandoned (for retention)."""
        with self._lock:
            self._last = None
            self.descent = None if parent is None else Descent(parent[1], tuple(parent[2]), parent[0],  # type: ignore[arg-type]
                                                               (self.generation, self._seq))
            self.abandoned = frozenset(abandoned)

    @property
    def next_seq(self) -> int:
        """The number the next ``save()`` call of this run gets."""
        with self._lock:
            return self._seq

    def is_mine(self, save_id: str | None) -> bool:
        """Whether a copy recording ``save_id`` was written by this run."""
        return run_of(save_id) == self.run
