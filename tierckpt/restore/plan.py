"""What the cluster holds, and which source serves each node (pure logic, no I/O).

Sources of one step, in preference order:

- **own-local**: the node's own disk holds its saved state (``local/step-N``, or a replica of
  itself a disk that came back under another node id holds);
- **peer-replica**: a clique peer holds a byte copy; the node pulls it (same topology only);
- **in-cluster**: the job's topology differs from the one that saved the step (nodes lost for
  good, nodes added, another rank count): every rank reads the chunks its new shards need
  from the node-local copies, wherever they are (:mod:`tierckpt.restore.cluster`);
- **persistent**: the shared tier (any topology, DCP resharding).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from tierckpt.cluster.topology import peers
from tierckpt.history.timeline import LEGACY_ORDER, Descent, abandoned_saves, save_key, sort_key
from tierckpt.io import layout

OWN, REPLICA, CLUSTER, PERSISTENT = "own-local", "peer-replica", "in-cluster", "persistent"
ALL_NODES = -1  # ``bad`` key node of a failed in-cluster attempt (it serves every node at once)


@dataclass(frozen=True)
class Source:
    """Where one node's state comes from: ``kind`` (own-local | peer-replica | in-cluster |
    persistent) and ``holder`` (the node whose disk has it; None for in-cluster and persistent)."""

    kind: str
    holder: int | None


@dataclass
class Inventory:
    """Committed steps visible to the job.

    Attributes:
        local: {node: steps in its own ``local/``} (by directory, whatever node's state they hold).
        replicas: {replica directory's node: {holder node: steps}}.
        persistent: steps of the persistent tier.
        copies: {step: {saved node: {holder node: directory relative to the holder's local root}}}
            — by the node each manifest records, which is what restore plans from. Derived from
            ``local``/``replicas`` when not given.
        shapes: {step: (nodes, world size) of the job that saved it}, from the manifests.
        unavailable: nodes whose local root restore must neither read nor write (a local-tier
            job is stuck in it): they hold no listed copy and receive no pull.
        dirs: {step: {(holder node, directory)}} of every committed copy, also the ones
            ``copies`` does not name (a second copy of the same node on one holder).
        saves: {step: {save id: {saved node: {holder node: directory}}}}: ``copies`` split by
            the save that wrote each copy (:mod:`tierckpt.history.timeline`; ``None``: copies that
            record no identity). Empty for an inventory built from ``local``/``replicas`` only:
            every copy then counts as one save.
        orders: {save id: (generation, seq)} of every save in ``saves`` or ``persistent_ids``.
        persistent_ids: {persistent step: save id of its copy}.
        save_shapes: {(step, save id): (nodes, world size)} of the job that made that save.
        descents: {save id: :class:`~tierckpt.history.timeline.Descent`} of every save whose
            copies record what it descends from: which saves are abandoned (:meth:`abandoned`).
        persistent_error: why the persistent tier could not be listed (e.g. a hung shared
            file system: ``ReadTimeout``), or None; the restore does not start fresh then.
    """

    local: dict[int, set[int]] = field(default_factory=dict)
    replicas: dict[int, dict[int, set[int]]] = field(default_factory=dict)
    persistent: set[int] = field(default_factory=set)
    copies: dict[int, dict[int, dict[int, str]]] = field(default_factory=dict)
    shapes: dict[int, tuple[int, int]] = field(default_factory=dict)
    unavailable: set[int] = field(default_factory=set)
    dirs: dict[int, set[tuple[int, str]]] = field(default_factory=dict)
    saves: dict[int, dict[str | None, dict[int, dict[int, str]]]] = field(default_factory=dict)
    orders: dict[str | None, tuple[int, int]] = field(default_factory=dict)
    persistent_ids: dict[int, str | None] = field(default_factory=dict)
    save_shapes: dict[tuple[int, str | None], tuple[int, int]] = field(default_factory=dict)
    descents: dict[str | None, Descent] = field(default_factory=dict)
    persistent_error: str | None = None

    def __post_init__(self) -> None:
        if self.copies:
            return
        for n, steps in self.local.items():
            for s in steps:
                self.copies.setdefault(s, {}).setdefault(n, {})[n] = layout.local_step(s)
        for m, by_holder in self.replicas.items():
            for h, steps in by_holder.items():
                for s in steps:
                    self.copies.setdefault(s, {}).setdefault(m, {})[h] = layout.replica_step(m, s)

    def add_copy(self, step: int, node: int, holder: int, rel: str, save_id: str | None = None,
                 order: tuple[int, int] = LEGACY_ORDER, shape: tuple[int, int] | None = None,
                 descent: Descent | None = None) -> None:
        """Record one committed node-local copy of saved node ``node``'s ``step``, held by
        ``holder`` under ``rel``, written by save ``save_id`` (``order``; ``shape``: (nodes,
        world size) of the job that saved it; ``descent``: what the save descends from)."""
        self.copies.setdefault(step, {}).setdefault(node, {}).setdefault(holder, rel)
        self.saves.setdefault(step, {}).setdefault(save_id, {}).setdefault(node, {}).setdefault(holder, rel)
        self.orders.setdefault(save_id, tuple(order))  # type: ignore[arg-type]
        if descent is not None and save_id is not None:
            self.descents.setdefault(save_id, descent)
        if shape is not None:
            self.shapes.setdefault(step, shape)
            self.save_shapes.setdefault((step, save_id), shape)

    def add_persistent(self, step: int, save_id: str | None = None, order: tuple[int, int] = LEGACY_ORDER,
                       descent: Descent | None = None) -> None:
        """Record the committed persistent copy of ``step`` (written by save ``save_id``)."""
        self.persistent.add(step)
        self.persistent_ids[step] = save_id
        self.orders.setdefault(save_id, tuple(order))  # type: ignore[arg-type]
        if descent is not None and save_id is not None:
            self.descents.setdefault(save_id, descent)

    def abandoned(self) -> dict[str, str | None]:
        """{save id: the save id proving it abandoned} of every save holding committed copies
        that a later save, itself not abandoned, proves abandoned
        (:func:`tierckpt.history.timeline.abandoned_saves`: the saves ordered between the save a
        run restored and that run's first save). Restore never resumes them (not even by
        explicit step), retention does not count them, whatever their commit markers say."""
        return abandoned_saves({sid: (order, self.descents.get(sid)) for sid, order in self.orders.items()})

    def abandoned_saves(self) -> list[tuple[int, str, str | None]]:
        """``(step, save id, proving save id)`` of every abandoned save's committed copies,
        newest first (by agreed order)."""
        gone = self.abandoned()
        pairs = [(s, sid) for s in self.all_steps() for sid in self._ids(s) if sid in gone]
        return [(s, sid, gone[sid]) for s, sid in sorted(pairs, key=lambda p: self.key(*p), reverse=True)]

    def _ids(self, step: int) -> set[str | None]:
        ids = set(self.saves.get(step, {}))
        if step in self.persistent:
            ids.add(self.persistent_ids.get(step))
        return ids

    def save_ids(self, step: int, gone: dict | set | None = None) -> list[str | None]:
        """The saves that hold copies of ``step``, newest first (by agreed order, never by
        time), abandoned saves left out (``gone``: :meth:`abandoned`, when already computed);
        ``[None]`` for an inventory without save identities."""
        ids = self._ids(step)
        if not ids:
            return [None]
        gone = self.abandoned() if gone is None else gone
        return sorted((i for i in ids if i not in gone), key=lambda i: sort_key(i, self.orders.get(i, LEGACY_ORDER)),
                      reverse=True)

    def key(self, step: int, save_id: str | None) -> tuple:
        """The agreed order of save ``save_id``'s copies of ``step`` (:func:`tierckpt.history.
        timeline.save_key`: legacy copies by step, before every identified save)."""
        return save_key(step, save_id, self.orders.get(save_id, LEGACY_ORDER))

    def saves_newest_first(self) -> list[tuple[int, str | None]]:
        """Every (step, save id) holding a committed copy, newest save first by agreed order —
        not by step number: an abandoned timeline's higher steps come after the new timeline's
        saves (:mod:`tierckpt.history.timeline`) — and an abandoned save (:meth:`abandoned`)
        not at all."""
        gone = self.abandoned()
        pairs = [(s, sid) for s in self.all_steps() for sid in self.save_ids(s, gone)]
        return sorted(pairs, key=lambda p: self.key(*p), reverse=True)

    def newest_save(self) -> tuple[int, str | None] | None:
        """(step, save id) of the newest save (by agreed order) holding any committed copy,
        None when empty."""
        pairs = self.saves_newest_first()
        return pairs[0] if pairs else None

    def newest_persistent(self) -> int | None:
        """The persistent step of the newest save (by agreed order) that is not abandoned, None
        without one."""
        gone = self.abandoned()
        steps = sorted((s for s in self.persistent if self.persistent_ids.get(s) not in gone),
                       key=lambda s: self.key(s, self.persistent_ids.get(s)))
        return steps[-1] if steps else None

    def view(self, step: int, save_id: str | None) -> Inventory:
        """This inventory with only the copies of ``step`` that save ``save_id`` wrote (the
        other steps unchanged): what a plan that combines copies of one save may use."""
        if step not in self.saves and step not in self.persistent_ids:
            return self  # no identities recorded for this step: one save, as before
        persistent = set(self.persistent)
        if self.persistent_ids.get(step, None) != save_id:
            persistent.discard(step)
        shapes = dict(self.shapes)
        shape = self.save_shapes.get((step, save_id))
        if shape is not None:
            shapes[step] = shape
        return dataclasses.replace(self, copies={**self.copies, step: self.saves.get(step, {}).get(save_id, {})},
                                   persistent=persistent, shapes=shapes)

    def all_steps(self) -> set[int]:
        """Every step committed anywhere (any tier, any node)."""
        return set(self.persistent) | {s for s, by_node in self.copies.items() if by_node}

    def holders(self, node: int, step: int) -> dict[int, str]:
        """{holder node: directory} of every node-local copy of saved node ``node``'s ``step``."""
        return self.copies.get(step, {}).get(node, {})

    def resharded(self, step: int, nodes: int, world_size: int | None) -> bool:
        """Whether ``step`` was saved by a job of another shape than (``nodes``, ``world_size``)
        (False when unknown: only the persistent tier holds it, or no world size given)."""
        shape = self.shapes.get(step)
        if shape is None or world_size is None:
            return False
        return shape != (nodes, world_size)


def sources_for(inv: Inventory, node: int, step: int, bad: set) -> list[Source]:
    """Usable per-node sources of ``node``'s state at ``step`` in preference order."""
    out = []
    holders = inv.holders(node, step)
    if node in holders and (node, OWN, node, step) not in bad:
        out.append(Source(OWN, node))
    for h in sorted(holders):
        # a pull writes into the node's own root: not into one a stuck local job holds
        if h != node and node not in inv.unavailable and (node, REPLICA, h, step) not in bad:
            out.append(Source(REPLICA, h))
    if step in inv.persistent and (node, PERSISTENT, None, step) not in bad:
        out.append(Source(PERSISTENT, None))
    return out


def cluster_viable(inv: Inventory, step: int, bad: set) -> bool:
    """Whether an in-cluster read of ``step`` is worth trying: it has not failed as a whole and
    some copy not marked bad is left (chunk coverage is checked by the attempt itself)."""
    if (ALL_NODES, CLUSTER, None, step) in bad:
        return False
    return any((m, CLUSTER, h, step) not in bad for m, by_h in inv.copies.get(step, {}).items() for h in by_h)


KINDS = (OWN, REPLICA, CLUSTER, PERSISTENT)


@dataclass(frozen=True)
class Choice:
    """What :func:`choose` picked: ``step``, ``sources`` ({node: Source}), ``save_id`` (the one
    save every source holds a copy of) and ``view`` (the inventory restricted to that save's
    copies of ``step``: the holders a restore reads from)."""

    step: int
    sources: dict[int, Source]
    save_id: str | None
    view: Inventory


def choose(inv: Inventory, nodes: int, bad: set, step: int | None = None,
           world_size: int | None = None, kinds: tuple[str, ...] = KINDS) -> Choice | None:
    """Newest save (of exactly ``step`` when given) that every node can be served from, using
    only copies of that one save.

    Saves are tried newest first by agreed order (:meth:`Inventory.saves_newest_first`, never by
    step number or time: an abandoned timeline's higher steps whose copies are still committed
    come after the new timeline's saves; legacy copies without identity by step, before them);
    with ``step``, the saves holding copies of it, newest first. A save a later save proves
    abandoned (:meth:`Inventory.abandoned`) is never a candidate, with or without ``step``. Copies of two saves under one
    step number (a fallback's new timeline next to the old one's leftovers) are never combined. A save of the
    same shape as this job is planned per node (own-local > peer-replica > persistent). When the
    shape differs, or some node has no per-node source left (e.g. a parallelism change at the
    same world size made every per-node source fail its coverage check), every node reads it
    in-cluster; else (or once that failed) every node reads the persistent tier.

    Args:
        inv: what the cluster holds.
        nodes: nodes of this job.
        bad: {(node, kind, holder, step)} sources that already failed; an in-cluster copy
            that failed is ``(saved node, "in-cluster", holder, step)``, a failed in-cluster
            attempt as a whole ``(ALL_NODES, "in-cluster", None, step)``.
        step: plan exactly this step.
        world_size: ranks of this job (None: shapes are not compared, per-node plans only).
        kinds: the source kinds the plan may use (default: all of :data:`KINDS`).
    Returns:
        the :class:`Choice`, or None when no save is servable.
    Raises:
        ValueError: an unknown source kind.
    """
    unknown = set(kinds) - set(KINDS)
    if unknown:
        raise ValueError(f"unknown restore source kind(s) {sorted(unknown)}; allowed: {list(KINDS)}")
    candidates = [(step, sid) for sid in inv.save_ids(step)] if step is not None else inv.saves_newest_first()
    for s, sid in candidates:
        v = inv.view(s, sid)
        sources = _plan_one(v, s, nodes, bad, world_size, kinds)
        if sources is not None:
            return Choice(s, sources, sid, v)
    return None


def _plan_one(v: Inventory, s: int, nodes: int, bad: set, world_size: int | None,
              kinds: tuple[str, ...]) -> dict[int, Source] | None:
    """Sources of every node for step ``s`` of the one-save view ``v``, None if not servable."""
    if not v.resharded(s, nodes, world_size):
        per_node = {n: [x for x in sources_for(v, n, s, bad) if x.kind in kinds] for n in range(nodes)}
        if all(per_node.values()):
            return {n: srcs[0] for n, srcs in per_node.items()}
    if CLUSTER in kinds and world_size is not None and cluster_viable(v, s, bad):
        return {n: Source(CLUSTER, None) for n in range(nodes)}
    if PERSISTENT in kinds and s in v.persistent and all((n, PERSISTENT, None, s) not in bad for n in range(nodes)):
        return {n: Source(PERSISTENT, None) for n in range(nodes)}
    return None


def plan_restore(inv: Inventory, nodes: int, bad: set, step: int | None = None,
                 world_size: int | None = None, kinds: tuple[str, ...] = KINDS
                 ) -> tuple[int, dict[int, Source]] | None:
    """:func:`choose` as ``(step, {node: Source})``, or None when no step is servable (the
    holders of the chosen save: ``choose(...).view``)."""
    c = choose(inv, nodes, bad, step, world_size, kinds)
    return None if c is None else (c.step, c.sources)


def missing_replicas(inv: Inventory, step: int, nodes: int, jump: int, factor: int, bad: set | frozenset = frozenset()
                     ) -> tuple[dict[tuple[int, int], str], list[int]]:
    """Which copies of ``step`` the cliques lack (copies counted by the node their manifest
    names, so a remapped disk's copies count where they are).

    Args:
        inv: what the cluster holds (after the restore's pulls).
        nodes, jump, factor: the job's node count, J and F.
        bad: the restore's failed sources (as :func:`plan_restore`'s): a copy that failed is
            no copy.
    Returns:
        ``({(node, peer): node's directory of its own state}, missing)``: the copies a node can
        send to a clique peer that holds none, and the nodes whose missing copies cannot be
        sent now (the node holds no good copy of its own state, or the peer's replica
        directory already holds a committed copy — of another node, or one that failed —
        which a rebuild never overwrites: a copy is only ever replaced by a committed one).
    """
    pairs: dict[tuple[int, int], str] = {}
    missing: set[int] = set()
    taken = {(h, rel) for by_h in inv.copies.get(step, {}).values() for h, rel in by_h.items()}
    taken |= inv.dirs.get(step, set())
    for n in range(nodes):
        holders = {h: rel for h, rel in inv.holders(n, step).items()
                   if not {(n, OWN, h, step), (n, REPLICA, h, step), (n, CLUSTER, h, step)} & bad}
        lacking = [p for p in peers(n, nodes, jump, factor) if p not in holders]
        if n not in holders:
            missing.add(n)
            continue
        for p in lacking:
            if (p, layout.replica_step(n, step)) in taken:
                missing.add(n)
            else:
                pairs[(n, p)] = holders[n]
    return pairs, sorted(missing)
