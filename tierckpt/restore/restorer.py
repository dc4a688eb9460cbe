"""Restore from the fastest valid source, with agreed fallback (docs/architecture.md, "Restore flow").

1. Every node leader lists the committed copies of its local root (own steps and the replicas
   it holds, each by the node its manifest names, with the saved job's shape); global rank 0
   lists the persistent tier. The lists are all-gathered (:class:`~tierckpt.restore.plan.Inventory`).
2. :func:`~tierckpt.restore.plan.choose` picks the newest save every node can be served
   from: for a step saved by a job of this shape, per node the first usable source in the order
   own local > peer replica > persistent; for a step saved by a job of another shape (nodes
   lost for good, nodes added, another rank count), an in-cluster resharded read, else the
   persistent tier.
3. A node served from a peer replica pulls the files into its own root first (checksummed on
   receipt, committed with the source manifest; :mod:`tierckpt.restore.pull`): into a
   temporary directory that replaces ``local/step-<N>`` only once committed, keeping a copy of
   another node's state found there. A transfer error is a failed pull, like a bad checksum.
4. Every other chosen per-node source is checksum-verified (files split across the node's
   ranks) before DCP reads a byte; the load uses :class:`~tierckpt.io.planner.VerifyingLoadPlanner`
   over the node group. An in-cluster read (:mod:`tierckpt.restore.cluster`) merges the
   copies' metadata, checks that they cover every rank's new shards, and reads each needed
   region from the rank's own disk or from a holder node, verified.
5. Outcomes are all-gathered. A failed (node, source, step) — or a failed in-cluster copy — is
   marked bad and the plan is recomputed (possibly an older step for everyone) until every
   node loaded the same step.

A restore may run on another set of groups than the engine's usual ones and without some
nodes' local roots (``unavailable``): the engine does that while a local-tier job is stuck
in them (:meth:`tierckpt.engine.TieredCheckpointer.restore`).

Every decision is logged (step, tier, source node, bytes, seconds) and, on global rank 0,
appended to the ledger.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field

from tierckpt.cluster.collectives import FAILURES, agree, all_gather, gather_leaders, gather_reduced, run_agreed
from tierckpt.cluster.topology import Groups, Topology
from tierckpt.errors import NoCheckpointError, ReadTimeout, TierUnreachableError, VerificationError
from tierckpt.history import lineage
from tierckpt.io import layout
from tierckpt.restore.cluster import ClusterLoad, cluster_load
from tierckpt.restore.plan import (
    ALL_NODES,
    CLUSTER,
    KINDS,
    OWN,
    PERSISTENT,
    REPLICA,
    Inventory,
    Source,
    choose,
)
from tierckpt.io.bounded import run_bounded
from tierckpt.io.memory_read import OwnRead
from tierckpt.restore.template import check_template
from tierckpt.restore.pull import Pulled, commit_pull, plan_pulls, record_pulls, run_pulls
from tierckpt.tiers.local_tier import LocalTier, load_dir, verify_split
from tierckpt.tiers.persistent import PersistentTier
from tierckpt.tiers.retention import InUse

log = logging.getLogger(__name__)


@dataclass
class NodeOutcome:
    """One node's result of one restore attempt."""

    node: int
    step: int
    source: Source
    ok: bool
    error: str | None = None
    bytes: int = 0
    seconds: float = 0.0
    persistent_bytes: int = 0
    save_id: str | None = None  # the save loaded (set once ok)


def _holds(loaded: dict[int, NodeOutcome], node: int, step: int, save_id: str | None) -> bool:
    """Whether ``node`` already loaded ``step`` of save ``save_id`` in an earlier round."""
    o = loaded.get(node)
    return o is not None and o.step == step and o.save_id == save_id


@dataclass
class RestoreResult:
    """What a restore did.

    Attributes:
        step: restored step.
        sources: {node: NodeOutcome of the attempt that succeeded}.
        attempts: restore rounds run (1 = no fallback needed).
        failures: NodeOutcomes of sources that failed and were skipped.
        seconds: wall time of the whole restore (seconds).
        persistent_bytes_read: bytes read from the persistent tier by all ranks.
        resharded: ``{"from": {"nodes", "world_size"}, "to": {...}}`` when the step was saved by
            a job of another shape, else None.
        missing: chunks an in-cluster attempt found in no usable copy (why it fell back), as
            ``"rank r: <key>: chunk offsets=… sizes=…: k of n elements in-cluster"``.
        save_id: the save every node's state came from (:mod:`tierckpt.history.timeline`;
            None: copies that record no identity).
        abandoned: ``[{"step", "save_id", "by"}]``: saves newer than the one restored whose copies
            are still committed but that a later save (``by``, None: this run's own) proves
            abandoned (:meth:`~tierckpt.restore.plan.Inventory.abandoned`): never tried.
    """

    step: int
    sources: dict[int, NodeOutcome]
    attempts: int
    failures: list[NodeOutcome]
    seconds: float
    persistent_bytes_read: int
    resharded: dict | None = None
    missing: list[str] = field(default_factory=list)
    save_id: str | None = None
    abandoned: list[dict] = field(default_factory=list)

    def source_of(self, node: int) -> str:
        """Source kind node ``node`` was restored from (own-local | peer-replica | persistent)."""
        return self.sources[node].source.kind


class Restorer:
    """Runs a restore over the engine's groups. All ranks call :meth:`restore` together."""

    def __init__(self, topo: Topology, groups: Groups, local: LocalTier | None,
                 persistent: PersistentTier | None, in_use: InUse, chunk_bytes: int, memory_bytes: int = 32 << 30,
                 read_timeout_s: float = 60.0):
        self.topo, self.groups, self._groups = topo, groups, groups
        self.local, self.persistent = local, persistent
        self.in_use = in_use
        self.chunk_bytes = chunk_bytes
        self.memory_bytes = memory_bytes  # TierConfig.restore_memory_bytes
        self.read_timeout_s = read_timeout_s  # TierConfig.read_timeout_s: every read of a source is bounded
        self.pending: list[Pulled] = []  # pulls received, loaded, not yet committed
        self._foreign_logged: set = set()  # (node, rel, lineage) already reported
        self.last_inventory = Inventory()  # what the last restore planned from (pulls included)
        self.view = self.last_inventory  # the copies of the save the current attempt reads
        self.view_save: str | None = None
        self.last_bad: set = set()  # the sources the last restore found bad

    # -- inventory -----------------------------------------------------------------------------
    def inventory(self, unavailable: frozenset | set = frozenset()) -> Inventory:
        """All-gather the committed steps of every node and of the persistent tier (collective
        over the restore's ``local_world``).

        Node-local steps and replicas of another lineage than the local tier's are left out
        (global rank 0 logs them, once per process). The nodes in ``unavailable`` do not list
        their root at all (a stuck local job holds it) and are recorded as such."""
        mine = None
        if self.topo.is_node_leader and self.local is not None and self.topo.node not in unavailable:
            try:  # bounded: a hung node-local disk is a node with nothing local, not a hung restore
                local = self.local
                copies, other = run_bounded(lambda progress: local.survey(), self.read_timeout_s,
                                            f"listing {local.store.url}", name="tierckpt-survey")
                # what each save descends from, once per save (every copy of a save records the same)
                descents = {c.save_id: c.descent for c in copies if c.descent is not None}
                mine = (self.topo.node, [(c.step, c.node, c.rel, c.nodes, c.world_size, c.replica_of, c.save_id,
                                          c.order) for c in copies], other, descents)
            except OSError as e:  # a dead or hung local disk (ReadTimeout): this node has nothing local
                log.warning("tierckpt restore: cannot list node %d's local root: %s", self.topo.node, e)
        pers, pers_error = None, None
        if self.topo.rank == 0 and self.persistent is not None:
            try:  # bounded: a hung shared file system must not hold the restore (nor its peers) forever
                pers = self.persistent.survey_bounded(self.read_timeout_s)
            except ReadTimeout as e:
                pers_error = f"{type(e).__name__}: {e}"
                log.warning("tierckpt restore: cannot list the persistent tier: %s", e)
            except (OSError, ValueError) as e:
                log.warning("tierckpt restore: cannot list the persistent tier: %s", e)
        # only node leaders list (rank 0, a leader, adds the persistent steps): leaders exchange
        gathered = gather_leaders((mine, pers, pers_error), self.groups.local_world, self.topo.is_node_leader)
        inv = Inventory(unavailable=set(unavailable), persistent_error=gathered[0][2])
        for ps, (psid, porder, pdescent) in (gathered[0][1] or {}).items():
            inv.add_persistent(ps, psid, porder, pdescent)
        foreign = []
        for m, _, _ in gathered:
            if m is None:
                continue
            holder, copies, other, descents = m
            inv.local.setdefault(holder, set())
            for step, node, rel, nodes, world, replica_of, sid, order in copies:
                if replica_of is None:
                    inv.local[holder].add(step)
                else:
                    inv.replicas.setdefault(replica_of, {}).setdefault(holder, set()).add(step)
                shape = (nodes, world) if nodes is not None and world is not None else None
                if node >= 0:
                    inv.add_copy(step, node, holder, rel, sid, order, shape, descents.get(sid))
                elif shape is not None:
                    inv.shapes.setdefault(step, shape)
                inv.dirs.setdefault(step, set()).add((holder, rel))
            foreign += [(holder, rel, lid) for rel, lid in other]
        new = [f for f in foreign if f not in self._foreign_logged]
        if new and self.topo.rank == 0:
            log.warning("tierckpt restore: ignoring node-local steps of another lineage than this job's (%s): %s",
                        lineage.label(self.local.lineage if self.local else None),
                        "; ".join(f"node {n} {rel} (lineage {lineage.label(lid)})" for n, rel, lid in new))
        self._foreign_logged.update(new)
        return inv

    # -- restore -------------------------------------------------------------------------------
    def restore(self, state_dict: dict, step: int | None = None, kinds: tuple[str, ...] = KINDS, *,
                groups: Groups | None = None, unavailable: frozenset | set = frozenset(),
                defer_commit: bool = False) -> RestoreResult | None:
        """Load ``state_dict`` in place from the best source (see the module docstring), using
        only the source ``kinds`` given (default: all).

        Args:
            groups: run on these groups instead of the engine's (same memberships).
            unavailable: nodes whose local root is neither read nor written (see
                :attr:`~tierckpt.restore.plan.Inventory.unavailable`).
            defer_commit: leave the pulls of the round that converged in :attr:`pending` (their
                files not yet written) for the caller's :meth:`commit_pending`, e.g. in the
                background; otherwise they are committed before this returns.
        Returns:
            RestoreResult, or None when no committed checkpoint exists anywhere (fresh start).
        Raises:
            NoCheckpointError: checkpoints exist but no step could be restored on every node
                (or ``step`` was requested and cannot be served).
            TemplateMismatchError: ``state_dict`` does not fit the step (key, dtype, global
                shape); raised before any source is read (:mod:`tierckpt.restore.template`).
        """
        self.groups = groups or self._groups
        try:
            res = self._restore(state_dict, step, kinds, unavailable)
            if not defer_commit:
                self.commit_pending()
            return res
        finally:
            self.groups = self._groups

    def _restore(self, state_dict: dict, step: int | None, kinds: tuple[str, ...],
                 unavailable: frozenset | set) -> RestoreResult | None:
        """The attempts of :meth:`restore`, each planned from the outcomes of the previous ones."""
        t0 = time.perf_counter()
        topo = self.topo
        self._persistent_bytes = 0
        inv = self.last_inventory = self.inventory(unavailable)
        bad: set = set()
        self.last_bad = bad
        if not inv.all_steps():
            self._raise_if_unlisted(inv, kinds)  # a hung persistent root is not an empty one
            if topo.rank == 0:
                log.info("tierckpt restore: no committed checkpoint in any tier; starting fresh")
            return None
        loaded: dict[int, NodeOutcome] = {}
        failures: list[NodeOutcome] = []
        missing: list[str] = []
        copies = sum(len(by_h) for by_node in inv.copies.values() for by_h in by_node.values())
        copies += sum(len(by_h) for by_save in inv.saves.values() for by_node in by_save.values()
                      for by_h in by_node.values())
        saves = sum(len(inv.save_ids(s)) for s in inv.all_steps())
        max_attempts = 2 + 4 * (saves * (topo.factor + 1)) + copies
        first = choose(inv, topo.nodes, bad, step, world_size=topo.world_size, kinds=kinds)
        if first is not None:  # a template that cannot load fails every source alike: refuse it now
            check_template(state_dict, first.step, first.sources, first.view, topo, self.groups,
                           self.local.store if self.local is not None else None, self.persistent,
                           self.read_timeout_s)
        for attempt in range(1, max_attempts + 1):
            self.commit_pending()  # the previous round's pulls, before this round plans from them
            choice = choose(inv, topo.nodes, bad, step, world_size=topo.world_size, kinds=kinds)
            if choice is None:
                self._raise_if_unlisted(inv, kinds)
                raise NoCheckpointError(_no_checkpoint_message(step, inv, failures))
            s, sources, sid = choice.step, choice.sources, choice.save_id
            self.view, self.view_save = choice.view, sid  # only copies of one save are read, never two runs' mixed
            cluster = all(src.kind == CLUSTER for src in sources.values())
            todo = {n for n in range(topo.nodes) if cluster or not _holds(loaded, n, s, sid)}
            if topo.rank == 0:
                log.info("tierckpt restore attempt %d: step %d (save %s), sources %s", attempt, s, sid,
                         "in-cluster (resharded read of the node-local copies)" if cluster else
                         {n: (sources[n].kind, sources[n].holder) for n in sorted(todo)})
            if cluster:
                outcome, cl = self._cluster_attempt(state_dict, s, choice.view, bad)
                if not cl.ok:
                    bad |= {(m, CLUSTER, h, s) for m, h in cl.bad} or {(ALL_NODES, CLUSTER, None, s)}
                    missing = cl.missing or missing
                    if cl.missing and topo.rank == 0:
                        log.warning("tierckpt restore: chunks of step %d in no in-cluster copy: %s%s", s,
                                    "; ".join(cl.missing[:5]), " …" if len(cl.missing) > 5 else "")
            else:
                outcome = self._attempt(state_dict, s, sources, todo)
            self._collect(outcome, loaded, failures, bad, sid)
            if all(_holds(loaded, n, s, sid) for n in range(topo.nodes)):
                pbytes = gather_reduced(self._persistent_bytes, self.groups.local_world, sum)
                res = RestoreResult(step=s, sources=dict(sorted(loaded.items())), attempts=attempt,
                                    failures=failures, seconds=time.perf_counter() - t0,
                                    persistent_bytes_read=pbytes, resharded=self._reshape(choice.view, s),
                                    missing=missing, save_id=sid, abandoned=_skipped(inv, s, sid))
                _log_result(res, topo)
                return res
        self.commit_pending()
        raise NoCheckpointError(f"restore did not converge after {max_attempts} attempts")

    def _raise_if_unlisted(self, inv: Inventory, kinds: tuple[str, ...]) -> None:
        """Raise :class:`~tierckpt.errors.TierUnreachableError` (every rank: ``inv`` is the
        same everywhere) when the persistent tier could not be listed in time and nothing else
        is left to restore from; a fresh start would discard what it holds."""
        if inv.persistent_error is not None and PERSISTENT in kinds and self.persistent is not None:
            raise TierUnreachableError("persistent", self.persistent.store.url, inv.persistent_error)

    def _collect(self, outcome, loaded: dict[int, NodeOutcome], failures: list[NodeOutcome], bad: set,
                 save_id: str | None) -> None:
        """All-gather one attempt's node outcomes (of save ``save_id``) into ``loaded`` /
        ``failures`` / ``bad``."""
        # a node's ranks agreed on its outcome already (over the node group): leaders exchange
        for o in gather_leaders(outcome, self.groups.local_world, self.topo.is_node_leader):
            if o is None or not self.topo.is_leader_rank(o[0]):
                continue
            no = o[1]
            if no.ok:
                no.save_id = save_id
                loaded[no.node] = no
                continue
            failures.append(no)
            bad.add((no.node, no.source.kind, no.source.holder, no.step))
            loaded.pop(no.node, None)
            if self.topo.rank != 0:  # every rank gathered it; say it once
                continue
            if no.source.kind != CLUSTER:
                log.warning("tierckpt restore: node %d step %d from %s (node %s) failed: %s",
                            no.node, no.step, no.source.kind, no.source.holder, no.error)
            elif no.node == 0:
                log.warning("tierckpt restore: in-cluster read of step %d failed: %s", no.step, no.error)

    def _reshape(self, inv: Inventory, s: int) -> dict | None:
        """The ``resharded`` field of a result: saved and current shape, when they differ."""
        if not inv.resharded(s, self.topo.nodes, self.topo.world_size):
            return None
        nodes, world = inv.shapes[s]
        return {"from": {"nodes": nodes, "world_size": world},
                "to": {"nodes": self.topo.nodes, "world_size": self.topo.world_size}}

    def _cluster_attempt(self, state_dict: dict, s: int, inv: Inventory, bad: set) -> tuple[tuple, ClusterLoad]:
        """Every rank reads step ``s`` from the node-local copies (:mod:`tierckpt.restore.cluster`);
        returns (this rank's (global rank, NodeOutcome), the attempt)."""
        topo = self.topo
        by_node = inv.copies.get(s, {})
        usable = {m: sorted(h for h in by_h if (m, CLUSTER, h, s) not in bad) for m, by_h in sorted(by_node.items())}
        keys = ["local:" + by_h[topo.node] for by_h in by_node.values() if topo.node in by_h]
        for k in keys:  # retention must not delete a copy while it is read
            self.in_use.hold(k)
        try:
            cl = cluster_load(state_dict, by_node, usable, topo, self.local.store if self.local else None,
                              self.groups.local_world, self.groups.persistent_world,
                              saved_nodes=inv.shapes.get(s, (None, None))[0], read_timeout_s=self.read_timeout_s)
        finally:
            for k in keys:
                self.in_use.drop(k)
        out = NodeOutcome(node=topo.node, step=s, source=Source(CLUSTER, None), ok=cl.ok, error=cl.error,
                          seconds=cl.seconds)
        out.bytes = sum(all_gather(cl.bytes, self.groups.node))
        return (topo.rank, out), cl

    def _local(self) -> LocalTier:
        """The local tier; only called for sources that exist only when it is configured."""
        if self.local is None:
            raise RuntimeError("tierckpt restore: a node-local source was planned without a local tier")
        return self.local

    def _persistent(self) -> PersistentTier:
        """The persistent tier; only called for persistent sources."""
        if self.persistent is None:
            raise RuntimeError("tierckpt restore: a persistent source was planned without a persistent tier")
        return self.persistent

    def _attempt(self, state_dict: dict, s: int, sources: dict[int, Source], todo: set[int]):
        """Run one round; returns (global rank, NodeOutcome for this node) or None.

        A node restoring its own copy maps and checksums its share on a helper thread
        (:class:`~tierckpt.io.memory_read.OwnRead`) while the round's sends run, and loads from
        the mappings meanwhile (:meth:`_load_own`); a node
        served by a replica loads the pulled bytes from memory as they arrive (written to disk
        and committed later: :meth:`commit_pending`)."""
        pulled = self._pull(s, sources, todo)  # first: its sends queue their disk reads ahead of ours
        if pulled.step >= 0:
            pulled.save_id = self.view_save
            self.pending.append(pulled)
        own = self._own_read(s, sources, todo)
        try:
            return self._load_node(state_dict, s, sources, todo, pulled, own)
        finally:
            if own is not None:
                own.join()  # never leave the reader running into the next round
            pulled.join_sends()  # a node sending a replica loaded its own state meanwhile
            pulled.memory = {}  # the pulled bytes are in the state now (or of no use)

    def _own_read(self, s: int, sources: dict[int, Source], todo: set[int]) -> OwnRead | None:
        """Start reading this rank's share of the node's own copy of ``s`` when that is its source."""
        node = self.topo.node
        if node not in todo or sources[node].kind != OWN or self.memory_bytes <= 0:
            return None
        rel = self.view.holders(node, s).get(node, layout.local_step(s))
        own = OwnRead(self._local().store, rel, self.topo.local_rank, self.topo.ranks_per_node, self.memory_bytes,
                      self.read_timeout_s)
        return own if own.started else None

    def _load_node(self, state_dict: dict, s: int, sources: dict[int, Source], todo: set[int], pulled: Pulled,
                   own: OwnRead | None):
        """Verify and load this node's source of the round (see :meth:`_attempt`)."""
        topo, node = self.topo, self.topo.node
        src = sources[node]
        t0 = time.perf_counter()
        if node not in todo:
            return None
        out = NodeOutcome(node=node, step=s, source=src, ok=False)
        if src.kind == REPLICA and not pulled.intact:
            out.error = pulled.error or "pull failed"
            out.seconds = time.perf_counter() - t0
            return (topo.rank, out)
        if src.kind == OWN:  # local/step-N, or a copy of itself a remapped disk holds as a replica
            key_rel = self.view.holders(node, s).get(node, layout.local_step(s))
        else:
            key_rel = layout.local_step(s) if src.kind != PERSISTENT else layout.persistent_step(s)
        key = ("persistent:" if src.kind == PERSISTENT else "local:") + key_rel
        self.in_use.hold(key)
        try:
            if src.kind == OWN:
                store, rel = self._local().store, key_rel
            elif src.kind == REPLICA:
                store, rel = self._local().store, layout.local_step(s)  # pulled into own local
            else:
                store, rel = self._persistent().store, layout.persistent_step(s)
            group = self.groups.node
            # Every node restoring the same persistent step (the usual case after losing
            # several nodes) reads the same files: hash them once, split over all ranks, not
            # once per node. Same condition on every rank: sources and todo are agreed.
            everyone_persistent = len(todo) == topo.nodes and all(sources[n].kind == PERSISTENT for n in todo)
            if everyone_persistent:
                v_group, v_index, v_count = self.groups.local_world, topo.rank, topo.world_size
            else:
                v_group, v_index, v_count = group, topo.local_rank, topo.ranks_per_node

            def verify():
                if src.kind == REPLICA:
                    return  # every byte was checksummed on receipt
                problems = verify_split(store, rel, v_index, v_count, self.read_timeout_s)
                if problems:
                    raise VerificationError("; ".join(problems[:3]))

            if src.kind == OWN:
                read = self._load_own(state_dict, store, rel, group, own)
            else:
                run_agreed(verify, v_group, f"verify {store.url_of(rel)}")
                if src.kind == PERSISTENT:
                    read = self._persistent().load(state_dict, store.url_of(rel), group, self.read_timeout_s)
                    out.persistent_bytes = read
                else:
                    read = self._load_pulled(state_dict, pulled, group)
            out.bytes = read + pulled.nbytes
            out.ok = True
        except FAILURES as e:  # any verification or load failure → next source, agreed by all
            out.error = f"{type(e).__name__}: {e}"
        finally:
            self.in_use.drop(key)
        out.seconds = time.perf_counter() - t0
        self._persistent_bytes += out.persistent_bytes
        # the node's ranks agree on ok (DCP and run_agreed already raised on all of them)
        parts = all_gather((out.ok, out.bytes, out.persistent_bytes), self.groups.node)
        out.bytes = sum(p[1] for p in parts)
        out.persistent_bytes = sum(p[2] for p in parts)
        if not all(p[0] for p in parts):
            out.ok = False
            out.error = out.error or "another rank of the node failed"
        return (topo.rank, out)

    def _load_own(self, state_dict: dict, store, rel: str, group, own: OwnRead | None) -> int:
        """Load this node's own copy ``rel`` (every rank of the node; collective over ``group``):
        with an :class:`~tierckpt.io.memory_read.OwnRead`, from its mappings while their
        checksums run, the copy agreed intact only afterwards (one pass over the disk: the
        load does not wait for the hash); without one, this rank's share is checksummed from
        disk first and a copy found bad is not decoded on any rank (this rank's load fails
        in DCP's metadata step, which fails it on every rank of the node). Whatever happens
        on whichever rank, every rank runs the same collectives in the same order — DCP's
        load, then one agreement — so a failure on one rank alone (a disk error while
        hashing, a ``Stateful`` refusing its state after DCP's last collective) cannot leave
        the node's ranks in different collectives. Returns bytes read; raises
        :class:`~tierckpt.cluster.collectives.PeerFailure` naming the cause on every rank of the
        node when any rank failed (→ next source).

        The reads of this rank's share and of ``.metadata`` are bounded by
        ``restore_read_timeout_s`` (:mod:`tierckpt.io.bounded`): the checksum pass runs on a
        helper thread, and the load decodes only pages that thread has read
        (:meth:`~tierckpt.io.memory_read.OwnRead.wait`); a read that makes no progress fails this
        rank with ``ReadTimeout`` through the same path as a bad checksum. What the load reads
        from disk besides (with several ranks per node, a replicated plain value that DCP wrote
        into another rank's file) is bounded the same way (:class:`~tierckpt.io.bounded.BoundedFile`)."""
        topo = self.topo
        problems: list[str] = []
        memory = None
        if own is None:
            try:
                problems = verify_split(store, rel, topo.local_rank, topo.ranks_per_node, self.read_timeout_s)
            except FAILURES as e:
                problems = [f"{store.url_of(rel)}: unreadable ({type(e).__name__}: {e})"]
        else:
            try:
                memory = own.mapped()
            except ReadTimeout as e:  # not even mapped (a file that blocks on open)
                problems = [f"ReadTimeout: {e}"]
        err: BaseException | None = None
        read = 0
        try:
            if problems:  # nothing in memory, strict: reading .metadata fails the load on every rank
                with contextlib.suppress(*FAILURES):
                    load_dir(state_dict, store.path(rel), group, strict=True)
                raise VerificationError("; ".join(problems[:3]))
            read = load_dir(state_dict, store.path(rel), group, memory=memory,
                            wait=own.wait if own is not None else None, read_timeout_s=self.read_timeout_s)
            found = own.result()[1] if own is not None else []
            if found:
                raise VerificationError("; ".join(found[:3]))
        except FAILURES as e:  # exchanged by agree(), raised on every rank
            err = e
        agree(err, group, f"load and verify {store.url_of(rel)}")
        return read

    def _load_pulled(self, state_dict: dict, pulled: Pulled, group) -> int:
        """Load a pull of this node (every rank of it): from memory as the bytes arrive, when
        every rank holds its share there, then agree that they arrived intact (else the load
        is void: this source failed); otherwise, or when the load asks for a file not in
        memory (a layout whose ranks read others' files), commit the pull first and load the
        committed copy. Raises what the load raises (→ next source)."""
        store, s = self._local().store, pulled.step
        memory = pulled.memory
        if memory:
            try:
                read = load_dir(state_dict, store.path(layout.incoming_step(s)), group, memory=memory, strict=True,
                                wait=pulled.wait_bytes)
            except FAILURES as e:  # DCP raised on every rank of the node: all of them fall back
                log.info("tierckpt restore: node %d: loading step %d from memory failed (%s: %s); "
                         "committing the pull and loading from disk", self.topo.node, s, type(e).__name__, e)
            else:
                pulled.settle(group)
                if not pulled.intact:
                    raise VerificationError(f"loaded from a pull that did not arrive intact: {pulled.error}")
                return read
            pulled.settle(group)
            memory = pulled.memory
        commit_pull(store, self.topo, group, self.in_use, pulled, self.read_timeout_s)
        if not pulled.ok:
            raise VerificationError(pulled.error or "pull not committed")
        # what this rank received is still read from memory (the same bytes, checksummed)
        return load_dir(state_dict, store.path(layout.local_step(s)), group, memory=memory,
                        read_timeout_s=self.read_timeout_s)

    def _pull(self, s: int, sources: dict[int, Source], todo: set[int]) -> Pulled:
        """Receive this round's pulls (collective over the restore's groups when any exist);
        the commit is :meth:`commit_pending`'s."""
        pulls = plan_pulls(self.topo, self.view, s, sources, todo)
        if not pulls:
            return Pulled()
        return run_pulls(self._local().store, self.topo, self.groups, self.in_use, self.chunk_bytes, pulls, s,
                         self.memory_bytes, self.read_timeout_s)

    def commit_pending(self, groups: Groups | None = None) -> None:
        """Commit the pulls the last restore received (collective: every rank, the same
        restore's pulls; over ``groups``, default the restore's): each node waits for its
        writes, commits and swaps in its copy (:func:`~tierckpt.restore.pull.commit_pull`), and
        every rank records where the copies now are in :attr:`last_inventory`. A pull that
        does not commit is logged: the node's state was loaded from memory, and its own copy
        comes back at the next local save. Never raises for a disk problem."""
        groups = groups or self.groups
        pending, self.pending = self.pending, []
        for pulled in pending:
            commit_pull(self._local().store, self.topo, groups.node, self.in_use, pulled, self.read_timeout_s)
            if pulled.receiving and pulled.intact and not pulled.ok and self.topo.is_node_leader:
                log.warning("tierckpt restore: node %d's pulled copy of step %d was not committed: %s; "
                            "its own copy comes back at the next local save", self.topo.node, pulled.step,
                            pulled.error)
            mine = (self.topo.node, pulled.kept) if pulled.ok and self.topo.is_node_leader else None
            got = gather_leaders(mine, groups.local_world, self.topo.is_node_leader)
            record_pulls(self.last_inventory, pulled.step, [m for m in got if m], pulled.save_id)


def _skipped(inv: Inventory, step: int, save_id: str | None) -> list[dict]:
    """The ``abandoned`` field of a result: the abandoned saves newer than the one restored."""
    key = inv.key(step, save_id)
    return [{"step": s, "save_id": sid, "by": by} for s, sid, by in inv.abandoned_saves() if inv.key(s, sid) > key]


def _no_checkpoint_message(step: int | None, inv: Inventory, failures: list[NodeOutcome]) -> str:
    """Why nothing could be restored, most frequent cause first (the same error on every
    source, e.g. a state that cannot load on this topology, reads as one line)."""
    causes: dict[str, list[str]] = {}
    for f in failures:
        causes.setdefault(f.error or "unknown error", []).append(
            f"node {f.node} step {f.step} {f.source.kind}" + (f"@{f.source.holder}" if f.source.holder is not None else ""))
    lines = [f"{len(w)}x {cause}  [{', '.join(w[:3])}{', …' if len(w) > 3 else ''}]"
             for cause, w in sorted(causes.items(), key=lambda kv: -len(kv[1]))]
    want = f"step {step}" if step is not None else "any step"
    gone = inv.abandoned_saves()
    if gone:
        lines.append("abandoned saves, never restored (a later save resumed an older one): "
                     + ", ".join(f"step {s} (save {sid}, abandoned by save {by or 'of this run'})" for s, sid, by in gone))
    return (f"no source could restore {want} on every node (committed steps seen: "
            f"{sorted(inv.all_steps())}); causes:\n  " + "\n  ".join(lines or ["no source holds it"]))


def _log_result(res: RestoreResult, topo: Topology) -> None:
    """Each node leader logs its own node's source; global rank 0 logs the summary (one line per
    restore, not one per node on every rank)."""
    mine = res.sources.get(topo.node)
    if topo.is_node_leader and mine is not None:
        log.info("tierckpt restore: node %d step %d from %s (holder %s): %d bytes in %.3fs",
                 topo.node, mine.step, mine.source.kind, mine.source.holder, mine.bytes, mine.seconds)
    if topo.rank == 0:
        kinds: dict[str, int] = {}
        for o in res.sources.values():
            kinds[o.source.kind] = kinds.get(o.source.kind, 0) + 1
        log.info("tierckpt restore: step %d on %d nodes in %.3fs (%s), %d persistent bytes read, %d attempt(s)",
                 res.step, len(res.sources), res.seconds, ", ".join(f"{k}: {v}" for k, v in sorted(kinds.items())),
                 res.persistent_bytes_read, res.attempts)
        if res.abandoned:
            log.warning("tierckpt restore: skipped abandoned saves newer than the one restored (still committed, but a "
                        "later save resumed an older one): %s", ", ".join(
                            f"step {a['step']} (save {a['save_id']}, abandoned by save {a['by'] or 'of this run'})"
                            for a in res.abandoned))
