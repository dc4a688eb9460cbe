"""Nodes, ranks per node, the engine's process groups, and replica peers.

Node ids come, in this order, from:

1. an explicit override: ``node_id`` argument, or env ``TIERCKPT_NODE_ID``, or env
   ``TIERCKPT_RANKS_PER_NODE=k`` (node = rank // k) — used to simulate several nodes on one
   machine;
2. torchrun: ``GROUP_RANK`` (the node rank of torchrun's static rendezvous);
3. Slurm: ``SLURM_NODEID``;
4. otherwise the hostnames of all ranks, gathered at start.

Every rank contributes its label to an all-gather, so all ranks agree on the node map. When
every label is an integer and the labels are exactly 0..N-1, they are the node ids as given:
an id pins a node (the host started with ``TIERCKPT_NODE_ID=1`` reads node 1's root and
replicas, whatever its global ranks). Any other labels (hostnames, gaps such as Slurm node
ids 4 and 7 of a larger allocation) are numbered 0..N-1 in order of their lowest global rank,
and the mapping is logged. Replica placement is by node id, never by global rank number, so
a restart that maps ranks to nodes differently still finds each node's data.

Replica peers (``replication_jump`` J, ``replication_factor`` F) follow nvidia-resiliency-ext's
CliqueReplicationStrategy (the ``--replication-jump/--replication-factor`` flags of
Megatron-LM): nodes are split into blocks of J·F consecutive nodes; inside a block, node n
belongs to the clique ``{b·J·F + (n mod J) + k·J : k = 0..F-1}`` with b = n // (J·F). Each
node's local checkpoint is copied to the other F-1 members of its clique.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
from dataclasses import dataclass, field

import torch.distributed as dist

from tierckpt.cluster.collectives import Tree, register_tree, unregister_tree
from tierckpt.errors import ConfigError

log = logging.getLogger(__name__)


def check_replication(nodes: int, jump: int, factor: int) -> None:
    """Validate J and F for ``nodes`` nodes.

    Raises:
        ConfigError: J < 1, F < 1, F > nodes, or J·F not dividing ``nodes``.
    """
    if jump < 1:
        raise ConfigError("replication_jump", f"must be >= 1, got {jump}")
    if factor < 1:
        raise ConfigError("replication_factor", f"must be >= 1, got {factor}")
    if factor > nodes:
        raise ConfigError(
            "replication_factor",
            f"F={factor} copies need at least {factor} nodes, but the job has {nodes}; allowed: 1..{nodes}",
        )
    if nodes % (jump * factor) != 0:
        ok = [j for j in range(1, nodes + 1) if nodes % (j * factor) == 0]
        raise ConfigError(
            "replication_jump",
            f"replication_jump·replication_factor = {jump}·{factor} = {jump * factor} must divide the "
            f"number of nodes ({nodes}); with replication_factor={factor} allowed replication_jump: {ok}",
        )


def clique(node: int, nodes: int, jump: int, factor: int) -> list[int]:
    """Members of ``node``'s replication clique, ``node`` included, in clique order."""
    block = jump * factor
    b, o = divmod(node, block)
    return [b * block + (o % jump) + k * jump for k in range(factor)]


def peers(node: int, nodes: int, jump: int, factor: int) -> list[int]:
    """Nodes that hold replicas of ``node`` (and whose replicas ``node`` holds)."""
    return [m for m in clique(node, nodes, jump, factor) if m != node]


@dataclass
class Topology:
    """The job's node layout as seen by one rank.

    Attributes:
        rank, world_size: global rank and size of the default process group.
        node: this rank's node id (0..nodes-1).
        node_of_rank: node id of every global rank.
        nodes: number of nodes.
        jump, factor: J and F (validated against ``nodes``).
        source: where the node ids came from (``override``, ``torchrun``, ``slurm``, ``hostname``).
    """

    rank: int
    world_size: int
    node: int
    node_of_rank: list[int]
    jump: int = 1
    factor: int = 1
    source: str = "override"
    hostname: str = field(default_factory=socket.gethostname)

    @property
    def nodes(self) -> int:
        """Number of nodes."""
        return max(self.node_of_rank) + 1

    def ranks_of(self, node: int) -> list[int]:
        """Global ranks on ``node``, ascending."""
        return [r for r, n in enumerate(self.node_of_rank) if n == node]

    @property
    def local_ranks(self) -> list[int]:
        """Global ranks of this rank's node."""
        return self.ranks_of(self.node)

    @property
    def local_rank(self) -> int:
        """Index of this rank among its node's ranks."""
        return self.local_ranks.index(self.rank)

    @property
    def ranks_per_node(self) -> int:
        """Ranks on each node (validated uniform)."""
        return len(self.local_ranks)

    @property
    def is_node_leader(self) -> bool:
        """The node's first rank: coordinator of the node's DCP save and its commit."""
        return self.local_rank == 0

    def is_leader_rank(self, rank: int) -> bool:
        """Whether global ``rank`` is the first rank of its node."""
        return self.ranks_of(self.node_of_rank[rank])[0] == rank

    def peers(self) -> list[int]:
        """Nodes holding replicas of this node's local checkpoint."""
        return peers(self.node, self.nodes, self.jump, self.factor)

    def clique(self) -> list[int]:
        """This node's replication clique, itself included."""
        return clique(self.node, self.nodes, self.jump, self.factor)

    @classmethod
    def build(cls, rank: int, node_ids: list, jump: int, factor: int, source: str) -> "Topology":
        """Construct from every rank's node label (``node_ids[r]`` of global rank r), validating
        J/F and uniform ranks per node.

        Integer labels that are exactly 0..N-1 (in any order over the ranks) are kept as the
        node ids; any other hashable labels are renumbered 0..N-1 in order of their lowest
        global rank (global rank 0 logs the mapping).

        Raises:
            ConfigError: impossible J/F, or nodes with different rank counts.
        """
        node_of_rank = pinned_ids(node_ids)
        if node_of_rank is None:
            relabel: dict = {}
            for n in node_ids:
                relabel.setdefault(n, len(relabel))
            node_of_rank = [relabel[n] for n in node_ids]
            if rank == 0 and any(k != v for k, v in relabel.items()):
                log.info("tierckpt: node labels from %s are not the integers 0..%d: numbered by lowest rank %s",
                         source, len(relabel) - 1, {str(k): v for k, v in relabel.items()})
        nodes = max(node_of_rank) + 1
        counts = {n: node_of_rank.count(n) for n in range(nodes)}
        if len(set(counts.values())) != 1:
            raise ConfigError(
                "topology",
                f"nodes must have the same number of ranks; got ranks per node {counts} (from {source})",
            )
        check_replication(nodes, jump, factor)
        return cls(rank=rank, world_size=len(node_ids), node=node_of_rank[rank],
                   node_of_rank=node_of_rank, jump=jump, factor=factor, source=source)


def pinned_ids(labels: list) -> list[int] | None:
    """``labels`` as node ids when every one is an int (not a bool) and together they are
    exactly {0, …, N-1}; else None (they need renumbering)."""
    if not labels or not all(isinstance(x, int) and not isinstance(x, bool) for x in labels):
        return None
    return list(labels) if set(labels) == set(range(len(set(labels)))) else None


def _local_node_label(rank: int, node_id: int | None, ranks_per_node: int = 0) -> tuple[object, str]:
    if node_id is not None:
        return int(node_id), "override"
    if ranks_per_node > 0:
        return rank // ranks_per_node, "override"
    env = os.environ
    if "TIERCKPT_NODE_ID" in env:
        return int(env["TIERCKPT_NODE_ID"]), "override"
    if "TIERCKPT_RANKS_PER_NODE" in env:
        k = int(env["TIERCKPT_RANKS_PER_NODE"])
        if k < 1:
            raise ConfigError("TIERCKPT_RANKS_PER_NODE", f"must be >= 1, got {k}")
        return rank // k, "override"
    if "GROUP_RANK" in env and "LOCAL_WORLD_SIZE" in env:
        return int(env["GROUP_RANK"]), "torchrun"
    if "SLURM_NODEID" in env:
        return int(env["SLURM_NODEID"]), "slurm"
    return socket.gethostname(), "hostname"


@dataclass
class Groups:
    """The engine's own gloo process groups (never the trainer's NCCL groups).

    Attributes:
        node: this node's ranks; DCP coordinator of the local tier is its first rank.
        local_world: all ranks; used by the local-tier worker (replication, stats) and restore.
        persistent_world: all ranks; used by the persistent-tier worker only, so the two
            background workers never share a group (gloo collectives on one group must not
            interleave across threads).
        control: all ranks; used by the trainer's thread only (agreeing to skip a tier whose
            previous save is still running), never by a background worker.
        local_tree, persistent_tree: the node-leader exchange
            (:class:`~tierckpt.cluster.collectives.Tree`) under ``local_world`` (its node group is
            ``node``: both belong to the local worker and the restore) and under
            ``persistent_world`` (a node group and a leaders group of its own, for the
            persistent worker); registered, so the helpers of
            :mod:`tierckpt.cluster.collectives` route those groups' agreements through them.
            None with one rank per node, where every rank is a leader and flat is the same.
    """

    node: dist.ProcessGroup
    local_world: dist.ProcessGroup
    persistent_world: dist.ProcessGroup
    control: dist.ProcessGroup
    local_tree: Tree | None = None
    persistent_tree: Tree | None = None


def release_groups(*sets: Groups) -> int:
    """Destroy the engine's gloo groups in ``sets`` and drop every reference they hold (not
    collective; call when no job can still use them: :meth:`~tierckpt.engine.TieredCheckpointer.close`
    once every job finished). Returns how many groups were destroyed.

    Why: a gloo group's C++ worker threads keep each finished collective's work (and its
    tensors) until they pick the next one up; the last of those tensors whose Python object
    the trainer already dropped is freed on the gloo thread, which takes the GIL for it. When
    that happens while the interpreter finalises (``close()`` or the exit hook of
    :mod:`tierckpt.exit` just before the process ends), CPython ends the thread with
    ``pthread_exit``, whose unwind crosses a ``noexcept`` frame: SIGABRT, "terminate called
    without an active exception", after every save committed (pytorch/pytorch issue 190489:
    exiting without ``destroy_process_group``). A destroyed group whose last reference is gone
    joins its threads at once, while the interpreter is alive. The trainer's own groups are not
    the engine's to destroy.
    """
    pgs: dict[int, dist.ProcessGroup] = {}
    for gs in sets:
        trees = [t for t in (gs.local_tree, gs.persistent_tree) if t is not None]
        for pg in (gs.node, gs.local_world, gs.persistent_world, gs.control,
                   *(t.node for t in trees), *(t.leaders for t in trees)):
            if pg is not None:
                pgs[id(pg)] = pg
        for pg in (gs.local_world, gs.persistent_world):
            if pg is not None:
                unregister_tree(pg)
        gs.node = gs.local_world = gs.persistent_world = gs.control = None  # type: ignore[assignment]
        gs.local_tree = gs.persistent_tree = None
    destroyed = 0
    for pg in pgs.values():
        try:
            dist.destroy_process_group(pg)
            destroyed += 1
        except (ValueError, AssertionError, RuntimeError):  # gone already: the trainer destroyed every group
            pass
    pgs.clear()
    return destroyed


def discover(jump: int, factor: int, *, node_id: int | None = None, ranks_per_node: int = 0,
             timeout_s: float = 600.0, control_timeout_s: float | None = None) -> tuple[Topology, Groups]:
    """Detect the topology and create the engine's gloo groups (collective: call on every rank).

    Args:
        jump, factor: ``replication_jump`` J and ``replication_factor`` F.
        node_id: explicit node id of this rank (overrides the environment).
        ranks_per_node: > 0 simulates nodes: node = rank // ranks_per_node.
        timeout_s: timeout of the created gloo groups, seconds.
        control_timeout_s: timeout of the control group (default ``timeout_s``); it must
            outlast the longest wait of one rank before it joins (``local_wait_timeout_s``).

    Raises:
        ConfigError: impossible J/F for the detected node count, or uneven nodes.
        RuntimeError: torch.distributed is not initialised.
    """
    if not dist.is_initialized():
        raise RuntimeError("tierckpt needs torch.distributed initialised (init_process_group) first")
    rank, world = dist.get_rank(), dist.get_world_size()
    timeout = datetime.timedelta(seconds=timeout_s)
    local_world = dist.new_group(backend="gloo", timeout=timeout)
    persistent_world = dist.new_group(backend="gloo", timeout=timeout)
    control = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=control_timeout_s or timeout_s))
    label, source = _local_node_label(rank, node_id, ranks_per_node)
    gathered: list = [None] * world
    dist.all_gather_object(gathered, (label, source), group=local_world)
    labels = [g[0] for g in gathered]
    sources = {g[1] for g in gathered}
    topo_error = None
    try:
        topo = Topology.build(rank, labels, jump, factor, source if len(sources) == 1 else "mixed")
    except ConfigError as e:
        topo_error = e
        topo = None
    # Every rank must create every node group in the same order, even when it will raise.
    node_lists: list[list[int]] = []
    seen: dict = {}
    for r, lab in enumerate(labels):
        seen.setdefault(lab, []).append(r)
    node_lists = list(seen.values())
    mine = None
    for ranks in node_lists:
        g = dist.new_group(ranks=ranks, backend="gloo", timeout=timeout)
        if rank in ranks:
            mine = g
    if topo_error is not None:
        raise topo_error
    assert topo is not None and mine is not None
    groups = Groups(node=mine, local_world=local_world, persistent_world=persistent_world, control=control)
    _add_trees(topo, groups, timeout, persistent=True)
    return topo, groups


def _add_trees(topo: Topology, groups: Groups, timeout: datetime.timedelta, *, persistent: bool) -> None:
    """Create and register the leaders groups (and the persistent worker's own node groups)
    of ``groups`` (collective: every rank, same point, same order; nothing with one rank per
    node). Group creation without a global barrier (torch's default) costs the members'
    connections only, so the N node groups cost each rank one connection set."""
    if topo.ranks_per_node == 1:
        return
    leader_ranks = [topo.ranks_of(n)[0] for n in range(topo.nodes)]
    leader = topo.local_ranks[0]

    def leaders_group():
        g = dist.new_group(ranks=leader_ranks, backend="gloo", timeout=timeout)
        return g if topo.is_node_leader else None

    groups.local_tree = Tree(node=groups.node, leaders=leaders_group(), leader=leader, rank=topo.rank)
    register_tree(groups.local_world, groups.local_tree)
    if not persistent:
        return
    mine = None
    for n in range(topo.nodes):
        g = dist.new_group(ranks=topo.ranks_of(n), backend="gloo", timeout=timeout)
        if n == topo.node:
            mine = g
    assert mine is not None  # every rank is on some node
    groups.persistent_tree = Tree(node=mine, leaders=leaders_group(), leader=leader, rank=topo.rank)
    register_tree(groups.persistent_world, groups.persistent_tree)


def new_groups(topo: Topology, timeout_s: float, control: dist.ProcessGroup) -> Groups:
    """A second set of the engine's gloo groups, with the memberships of :func:`discover`'s
    (``control`` is reused as given).

    For work that must not share a group with a collective another thread may be inside:
    a restore while a local-tier job hangs in ``local_world``, and the background rebuild of
    replicas after a restore. Collective: every rank calls it, in the same order relative to
    the other group creations, from the thread that owns the default group.

    Args:
        timeout_s: timeout of the new groups, seconds.
    """
    timeout = datetime.timedelta(seconds=timeout_s)
    local_world = dist.new_group(backend="gloo", timeout=timeout)
    persistent_world = dist.new_group(backend="gloo", timeout=timeout)
    mine = None
    for n in range(topo.nodes):
        ranks = topo.ranks_of(n)
        g = dist.new_group(ranks=ranks, backend="gloo", timeout=timeout)
        if topo.rank in ranks:
            mine = g
    assert mine is not None  # every rank is on some node
    groups = Groups(node=mine, local_world=local_world, persistent_world=persistent_world, control=control)
    # the second set's persistent_world only carries point-to-point chunks: no tree needed
    _add_trees(topo, groups, timeout, persistent=False)
    return groups


class SpareGroups:
    """Second sets of the engine's groups by use (:func:`new_groups`), made on first need:
    ``"restore"`` while a local job is stuck, ``"redundancy"`` for the background rebuild of
    replicas after a restore. :meth:`get` is collective the first time for each use (every
    rank at the same point)."""

    def __init__(self, topo: Topology, timeout_s: float, control: dist.ProcessGroup):
        self._topo, self._timeout_s = topo, timeout_s
        self._control: dist.ProcessGroup | None = control
        self._made: dict[str, Groups] = {}

    def get(self, use: str) -> Groups:
        """The groups of ``use``, created on first call."""
        if use not in self._made:
            if self._control is None:
                raise RuntimeError("tierckpt: the engine is closed (its groups were released)")
            self._made[use] = new_groups(self._topo, self._timeout_s, self._control)
        return self._made[use]

    def release(self) -> list[Groups]:
        """Every set made so far, for :func:`release_groups`; forgets them and the control group
        (the engine closed: no set is made again)."""
        made, self._made, self._control = list(self._made.values()), {}, None
        return made
