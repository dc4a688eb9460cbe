"""Pulls of a restore: a node served by a peer's replica receives its files (docs/architecture.md,
"Restore flow", step 4).

The files land in ``local/.incoming-step-<N>`` of the receiving node's root, are hashed on
receipt and committed there with the source's manifest; only then does the committed copy
replace ``local/step-<N>``. Two phases: :func:`run_pulls` receives every byte into memory
(checksummed) and returns before writing any, so the restore loads from memory;
:func:`commit_pull` then writes, fsyncs and commits (the engine runs it in the background
after a restore that converged; a restore runs it at once before another attempt). A pull
that fails leaves the root as it was, so a failed source never costs a copy another source
could serve. The directory it replaces may be a valid copy
of another node's state (a disk that came back under another node id): that copy is kept,
renamed to ``replicas/node-<m>/step-<N>``, unless a committed copy of node m's step already
sits there.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from tierckpt.cluster.collectives import all_gather
from tierckpt.cluster.topology import Groups, Topology
from tierckpt.io.bounded import run_bounded
from tierckpt.io import layout, manifest
from tierckpt.io.storage import Store
from tierckpt.restore.plan import REPLICA, Inventory, Source
from tierckpt.transport.receive import RECV_BUFFERS
from tierckpt.tiers.replication import commit_received
from tierckpt.tiers.retention import InUse
from tierckpt.transport.transfer import Received, Transfer, start_transfers

log = logging.getLogger(__name__)


@dataclass
class Pulled:
    """One node's outcome of the pulls of an attempt (the same on every rank of the node).

    Attributes:
        step: the step pulled (-1: no pull in this attempt).
        save_id: the save the pulled copy belongs to.
        intact: this node received a pull and every rank's share arrived with matching sizes
            and checksums (agreed over the node); set by :meth:`settle` (:func:`run_pulls`
            calls it unless the pull is still streaming into :attr:`memory`, when it stays
            True until settled).
        ok: the pull is now this node's committed ``local/step-<N>`` (set by :func:`commit_pull`).
        error: why this node's pull failed (None when it succeeded or when it received none).
        nbytes: bytes this rank received.
        memory: {file name: uint8 tensor of its bytes} of the files this rank received
            (verified on receipt; its share plus the memory-only shared files), kept so the load
            reads them from memory; empty unless intact.
        kept: ``(node m, directory)`` where the copy of node m that ``local/step-<N>`` held
            before now is (None: it held no other node's committed copy).
        committed: :func:`commit_pull` ran (whatever its outcome).
        receiving: this node is a destination of the attempt's pulls.
        results, pulls, keys, sender, settled: this rank's receives, the attempt's transfers,
            the keys held against retention, its sending thread (until :meth:`join_sends`),
            and whether :meth:`settle` ran.
    """

    step: int = -1
    save_id: str | None = None
    intact: bool = False
    ok: bool = False
    error: str | None = None
    nbytes: int = 0
    kept: tuple[int, str] | None = None
    memory: dict[str, torch.Tensor] = field(default_factory=dict)
    committed: bool = False
    receiving: bool = False
    results: dict[int, Received] = field(default_factory=dict, repr=False)
    pulls: list[Transfer] = field(default_factory=list, repr=False)
    keys: set[str] = field(default_factory=set, repr=False)
    sender: threading.Thread | None = field(default=None, repr=False)
    settled: bool = True

    def wait_bytes(self, path: str, end: int) -> None:
        """Block until the first ``end`` bytes of ``path`` (a file of :attr:`memory`) arrived
        (see :meth:`~tierckpt.transport.transfer.Received.wait_bytes`)."""
        for r in self.results.values():
            if path in r.memory:
                r.wait_bytes(path, end)
                return

    def settle(self, node_group) -> None:
        """Wait for the rest of this rank's receives, check them, and agree over the node
        (collective over ``node_group``; every rank of the node, once) whether every share
        arrived intact: :attr:`intact` and :attr:`error` the same on every rank. Idempotent."""
        if self.settled:
            return
        self.settled = True
        for r in self.results.values():
            r.complete()
        self.nbytes = sum(r.nbytes for r in self.results.values())
        problems = [p for r in self.results.values() for p in r.problems]
        if any(r.manifest_bytes is None and not r.problems for r in self.results.values()):
            problems.append("no manifest received")
        errs = [p for part in all_gather(problems[:1], node_group) for p in part]
        if self.receiving:
            self.intact, self.error = not errs, "; ".join(errs[:3]) or None
            if not self.intact:
                self.memory = {}

    def join_sends(self) -> None:
        """Wait for this rank's sends (before its next transfer or a collective over the
        transfer group)."""
        th, self.sender = self.sender, None
        if th is not None:
            th.join()


PULL_CHUNK_MIN = 1 << 20  # bytes: the smallest chunk of a pull (gloo's per-message cost stays small)


def pull_chunk_bytes(chunk_bytes: int, memory_bytes: int) -> int:
    """Chunk size of a restore's pulls (bytes, a multiple of 4096): ``chunk_bytes``
    (``TierConfig.transfer_chunk_bytes``), capped so that a pull received to disk (a share above
    ``memory_bytes``, ``TierConfig.restore_memory_bytes``) holds at most
    ``max(memory_bytes, 4 MiB)`` in its :data:`~tierckpt.transport.receive.RECV_BUFFERS` receive
    buffers: the restore's memory bound holds whichever way the share is received. Every rank
    computes the same value from the same configuration (sender and receiver must agree)."""
    cap = max(PULL_CHUNK_MIN, memory_bytes // RECV_BUFFERS // 4096 * 4096)
    return min(chunk_bytes, cap)


def plan_pulls(topo: Topology, inv: Inventory, s: int, sources: dict[int, Source], todo: set[int]) -> list[Transfer]:
    """The transfers of every node of ``todo`` served from a peer replica (same list on every
    rank): local rank r of the holder sends share r to local rank r of the node, into the
    node's :func:`~tierckpt.io.layout.incoming_step`."""
    out = []
    for n in sorted(todo):
        if sources[n].kind != REPLICA:
            continue
        h = sources[n].holder
        assert h is not None  # a replica source always names its holder
        for r in range(topo.ranks_per_node):
            out.append(Transfer(
                src_rank=topo.ranks_of(h)[r], dst_rank=topo.ranks_of(n)[r],
                src_rel=inv.holders(n, s).get(h, layout.replica_step(n, s)), dst_rel=layout.incoming_step(s),
                share=(r, topo.ranks_per_node), tag=f"pull node-{n} step-{s} from node-{h}", shared_files=True,
            ))
    return out


def run_pulls(store: Store, topo: Topology, groups: Groups, in_use: InUse, chunk_bytes: int,
              pulls: list[Transfer], s: int, memory_bytes: int, read_timeout_s: float | None = None) -> Pulled:
    """Receive ``pulls`` into memory (collective over ``groups.local_world`` and ``groups.node``;
    every rank passes the same non-empty list) and agree per node whether they arrived intact
    (here, or through :meth:`Pulled.settle` while they stream).

    ``memory_bytes``: the most a rank receives into memory (``TierConfig.restore_memory_bytes``);
    a larger share is received to disk in chunks of :func:`pull_chunk_bytes`.
    ``read_timeout_s``: a sender's reads of its copy are bounded (``TierConfig.restore_read_timeout_s``,
    see :func:`~tierckpt.transport.transfer.send_step`): a hung read fails the pull, never the restore.
    When every rank of the node keeps its whole share, this returns once the receives are
    posted: :attr:`Pulled.memory` fills as the bytes arrive (:meth:`Pulled.wait_bytes`) and
    :meth:`Pulled.settle` (collective over the node) says whether they were intact; otherwise
    the receives complete and are settled here. The sends of this rank may still run: call
    :meth:`Pulled.join_sends` before the next collective over ``groups.local_world``.
    Returns before the received files are written into
    :func:`~tierckpt.io.layout.incoming_step`; every rank must later call :func:`commit_pull`
    on the result (until then the sources and ``local/step-<s>`` are held against retention).
    Never raises for a transfer problem: it is this node's :attr:`Pulled.error`.
    """
    receiving = any(topo.node_of_rank[t.dst_rank] == topo.node for t in pulls)
    tmp = layout.incoming_step(s)
    if receiving and topo.is_node_leader:
        try:
            _clear(store, tmp)
        except OSError as e:  # the pull will fail and be reported; never skip the barrier
            log.warning("tierckpt restore: cannot clear %s before the pull: %s", store.url_of(tmp), e)
    dist.barrier(group=groups.node)
    keys = {"local:" + t.src_rel for t in pulls if t.src_rank == topo.rank}
    if receiving:  # retention of a late local job must not delete what the swap moves
        keys |= {"local:" + layout.local_step(s)}
    for k in keys:
        in_use.hold(k)
    out = Pulled(step=s, receiving=receiving, pulls=pulls, keys=keys)
    try:
        out.results, out.sender = start_transfers(pulls, topo.rank, store, groups.local_world,
                                                  pull_chunk_bytes(chunk_bytes, memory_bytes), keep=memory_bytes,
                                                  stream=True, read_timeout_s=read_timeout_s)
        kept = all(r.stream is not None for r in out.results.values())
        streaming = all(all_gather(kept, groups.node))
    except BaseException:
        _release(out, in_use)
        raise
    out.settled = False
    if receiving and streaming:  # loaded while it arrives; intact until settle() says otherwise
        out.intact = True
        out.memory = {p: b for r in out.results.values() for p, b in r.memory.items()}
    else:
        out.settle(groups.node)
    return out


def commit_pull(store: Store, topo: Topology, node_group, in_use: InUse, pulled: Pulled,
                read_timeout_s: float | None = None) -> None:
    """Phase two of a pull (collective over ``node_group``, every rank of the node; a no-op for
    a pulled step already committed or no pull): write and fsync what :func:`run_pulls` kept
    in memory, commit the received copy and move it into ``local/step-<N>`` (:func:`swap_in`). Sets
    :attr:`Pulled.ok`, ``error`` and ``kept`` the same on every rank of the node, releases the
    held keys and the received memory. Never raises for a disk problem (it is the error).
    ``read_timeout_s``: the read of what ``local/step-<N>`` held is bounded (:func:`swap_in`)."""
    if pulled.committed or pulled.step < 0:
        return
    pulled.committed = True
    s = pulled.step
    try:
        pulled.join_sends()
        pulled.settle(node_group)
        for r in pulled.results.values():
            r.finish()
        ok, bad = commit_received(store, topo, node_group, pulled.results, pulled.pulls)
        ok_, err, kept = False, pulled.error, None
        if pulled.receiving and topo.is_node_leader:
            if ok:
                try:
                    kept, ok_ = swap_in(store, topo.node, s, read_timeout_s), True
                except OSError as e:  # also ReadTimeout: the old copy's disk hangs; the pull stays incoming
                    err = f"committed pull not moved into {layout.local_step(s)}: {type(e).__name__}: {e}"
            else:
                err = "; ".join(bad.values()) or err or "pull failed"
        pulled.ok, pulled.error, pulled.kept = all_gather((ok_, err, kept), node_group)[0]
    finally:
        _release(pulled, in_use)


def _release(pulled: Pulled, in_use: InUse) -> None:
    """Drop a pull's holds and buffers (its files' writers have finished or are abandoned)."""
    pulled.join_sends()
    for r in pulled.results.values():
        r.finish()
    for k in pulled.keys:
        in_use.drop(k)
    pulled.keys, pulled.results, pulled.memory = set(), {}, {}


def swap_in(store: Store, node: int, s: int, read_timeout_s: float | None = None) -> tuple[int, str] | None:
    """Replace ``local/step-<s>`` by the committed pull in :func:`~tierckpt.io.layout.incoming_step`.

    What ``local/step-<s>`` held is kept when it is another node m's committed copy: renamed to
    ``replicas/node-<m>/step-<s>``, or deleted only when a committed copy of m's step is already
    there (a duplicate). Anything else there (this node's own copy that failed, a torn
    directory) is replaced.

    Returns:
        (m, directory of m's copy now) when ``local/step-<s>`` held node m's copy, else None.
    ``read_timeout_s``: the read of what ``local/step-<s>`` holds is bounded
    (:func:`tierckpt.io.bounded.run_bounded`); None: unbounded.

    Raises:
        OSError: a rename or delete failed; no committed copy was deleted before its
            replacement exists.
        ReadTimeout: what ``local/step-<s>`` holds cannot be read (a hung disk): nothing was
            moved (it may be another node's committed copy, which must not be deleted unread).
    """
    tmp, dst = layout.incoming_step(s), layout.local_step(s)
    if read_timeout_s is None:
        doc = manifest.read_committed(store, dst)
    else:
        doc = run_bounded(lambda progress: manifest.read_committed(store, dst), read_timeout_s,
                          f"reading {store.url_of(dst)}", name="tierckpt-swap")
    owner = doc.get("node") if doc is not None else None
    kept = None
    if isinstance(owner, int) and not isinstance(owner, bool) and owner != node:
        rep = layout.replica_step(owner, s)
        if manifest.read_committed(store, rep) is None:
            _clear(store, rep)
            store.makedirs(layout.replica_dir(owner))
            store.rename(dst, rep)
            log.warning("tierckpt restore: %s held node %d's step %d (a remapped disk): kept as %s",
                        store.url_of(dst), owner, s, rep)
        kept = (owner, rep)
    _clear(store, dst)
    store.rename(tmp, dst)
    return kept


def _clear(store: Store, rel: str) -> None:
    """Delete ``rel`` if it exists, marker first (never seen half-deleted as committed)."""
    if store.exists(rel):
        manifest.uncommit(store, rel)
        store.rmtree(rel)


def record_pulls(inv: Inventory, s: int, received: list[tuple[int, tuple[int, str] | None]],
                 save_id: str | None = None) -> None:
    """Update ``inv`` after the pulls of step ``s`` of save ``save_id``: each ``(node, kept)`` of
    a node whose pull is now its ``local/step-<s>`` (``kept`` as :attr:`Pulled.kept`: another
    node's copy that sat there, moved to its replica directory with its save). Every rank applies
    the same all-gathered list, so later attempts plan from where the copies now are."""
    for h, kept in received:
        rel = layout.local_step(s)
        for by_save in inv.saves.get(s, {}).values():  # local/step-<s> on h now holds only the pull
            for m, by_h in by_save.items():
                if by_h.get(h) == rel:
                    if kept is not None and m == kept[0]:
                        by_h[h] = kept[1]  # the remapped copy moved, with its save
                    else:
                        del by_h[h]
        if s in inv.saves:
            inv.saves[s].setdefault(save_id, {}).setdefault(h, {})[h] = rel
        inv.copies.setdefault(s, {}).setdefault(h, {})[h] = rel
        inv.local.setdefault(h, set()).add(s)
        inv.dirs.setdefault(s, set()).add((h, rel))
        if kept is not None:
            m, mrel = kept
            inv.copies[s].setdefault(m, {})[h] = mrel
            inv.replicas.setdefault(m, {}).setdefault(h, set()).add(s)
            inv.dirs[s].add((h, mrel))
