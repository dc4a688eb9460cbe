"""A local tier in host memory: ``local_root`` on a tmpfs such as ``/dev/shm``.

A tmpfs root survives a process crash and a job restart inside the same boot, not a node
reboot (the neighbour's replica covers that). Every committed byte in it is host memory, so the
engine checks at the first local save that the tier's expected footprint fits the tmpfs:

    footprint(n) = (k + 1) · (S_n + Σ_{m ∈ peers(n)} S_m)        bytes

with ``k = keep_latest_k["local"]``, ``S_n`` the bytes of node n's checkpoint and ``peers(n)``
the F − 1 other members of n's replication clique (F = ``replication_factor``). The ``+ 1`` is
the step being written while the k older ones still exist (retention deletes them only after
the new step commits). With equal nodes this is ``(k + 1) · F · S``. ``k = 0`` (keep all) grows
without bound: only the next step is checked, with a warning.

``S_n`` is estimated from the staged state before anything is written, as DCP's node-local
save stores it: sharded tensors (DTensor/ShardedTensor shards with a non-replicated placement)
once per rank, replicated tensors (plain tensors, fully replicated DTensors) once per node.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import torch

from tierckpt.cluster.collectives import all_gather
from tierckpt.cluster.topology import Topology, peers
from tierckpt.records import CheckpointRecord

log = logging.getLogger(__name__)

#: file system types whose pages are host memory
RAM_FS_TYPES = frozenset({"tmpfs", "ramfs"})


def _unescape_mount(path: str) -> str:
    """``/proc/mounts`` writes space, tab, newline and backslash as octal escapes."""
    for esc, ch in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        path = path.replace(esc, ch)
    return path


def fs_type(path: str, mounts: str = "/proc/mounts") -> str | None:
    """File system type of the mount holding ``path`` (its nearest existing ancestor), from
    ``mounts``: the longest mount point that prefixes the resolved path. None when the table
    cannot be read (not Linux) or no mount matches."""
    p = os.path.realpath(path)
    try:
        with open(mounts) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    best, best_len = None, -1
    for line in lines:
        parts = line.split()
        if len(parts) < 3:
            continue
        mnt = _unescape_mount(parts[1])
        # >=: a later line over the same mount point wins (it is mounted over the earlier one)
        if (p == mnt or p.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= best_len:
            best, best_len = parts[2], len(mnt)
    return best


def is_ram_root(path: str) -> bool:
    """Whether ``path`` lies on a tmpfs/ramfs (host memory)."""
    return fs_type(path) in RAM_FS_TYPES


def free_bytes(path: str) -> int:
    """Bytes an unprivileged writer can still put under ``path`` (``statvfs``: f_bavail ·
    f_frsize). Raises OSError when ``path`` cannot be queried."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def held_bytes(path: str) -> int:
    """Bytes of the regular files under ``path`` (the job's own earlier steps and replicas: the
    tier may reuse that space, since retention deletes them as new steps commit)."""
    total = 0
    for d, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(d, name)).st_size
            except OSError:
                pass  # deleted while walking (retention)
    return total


def state_bytes(state_dict: Any) -> tuple[int, int]:
    """``(sharded, replicated)`` tensor bytes of one rank's state dict (nested dicts/lists):
    DTensor/ShardedTensor local shards with a sharded placement count as sharded; plain tensors
    and fully replicated DTensors as replicated (DCP stores those once per node). Non-tensor
    values (pickled objects) are not counted: they are small next to the tensors."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.tensor import DTensor

    sharded = replicated = 0
    stack = [state_dict]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
        elif isinstance(v, DTensor):
            loc = v.to_local()
            n = loc.numel() * loc.element_size()
            if all(p.is_replicate() for p in v.placements):
                replicated += n
            else:
                sharded += n
        elif isinstance(v, ShardedTensor):
            sharded += sum(s.tensor.numel() * s.tensor.element_size() for s in v.local_shards())
        elif isinstance(v, torch.Tensor):
            replicated += v.numel() * v.element_size()
    return sharded, replicated


@dataclass(frozen=True)
class RankReport:
    """What one rank contributes to the fit check (all-gathered over every rank).

    Attributes:
        node: the rank's node.
        sharded, replicated: :func:`state_bytes` of the rank's state, bytes.
        ram: the node's root is on tmpfs/ramfs (node leader; None on other ranks).
        available: the root's free bytes plus the bytes it already holds (node leader of a RAM
            root; None otherwise or when it could not be measured).
    """

    node: int
    sharded: int
    replicated: int
    ram: bool | None = None
    available: int | None = None


def node_bytes(reports: list[RankReport]) -> dict[int, int]:
    """Estimated checkpoint bytes per node: Σ sharded over its ranks + max replicated."""
    out: dict[int, int] = {}
    for n in sorted({r.node for r in reports}):
        mine = [r for r in reports if r.node == n]
        out[n] = sum(r.sharded for r in mine) + max(r.replicated for r in mine)
    return out


def footprint(node: int, sizes: dict[int, int], keep: int, jump: int, factor: int) -> int:
    """Expected peak bytes of node ``node``'s local root (module docstring's formula); with
    ``keep`` = 0 (keep all) the bytes of one more step."""
    nodes = len(sizes)
    one = sizes[node] + sum(sizes[m] for m in peers(node, nodes, jump, factor))
    return (keep + 1) * one if keep > 0 else one


def too_small(reports: list[RankReport], keep: int, jump: int, factor: int) -> dict[int, tuple[int, int]]:
    """``{node: (footprint, available)}`` of every RAM root whose expected footprint exceeds
    what it can hold (same answer on every rank: a pure function of the gathered reports)."""
    sizes = node_bytes(reports)
    out = {}
    for r in reports:
        if r.ram and r.available is not None:
            need = footprint(r.node, sizes, keep, jump, factor)
            if need > r.available:
                out[r.node] = (need, r.available)
    return out


def describe(short: dict[int, tuple[int, int]], keep: int, factor: int) -> str:
    """The warning for roots that are too small, naming the options that change the footprint."""
    gib = float(1 << 30)
    nodes = ", ".join(f"node {n}: needs {need / gib:.2f} GiB, has {have / gib:.2f} GiB"
                      for n, (need, have) in sorted(short.items()))
    return (f"the local tier's RAM root (tmpfs) is too small for (keep_latest_k.local + 1) x "
            f"(own + replicas) = ({keep} + 1) x {factor} copies of the node's state ({nodes}); the "
            "local tier is off for this run (training and the persistent tier go on). Lower "
            "keep_latest_k.local or replication_factor, enlarge the tmpfs, or point local_root at a disk")


def leader_report(root: str, node: int, sharded: int, replicated: int, is_leader: bool) -> RankReport:
    """This rank's :class:`RankReport`; the node leader measures its root (a root that cannot be
    measured is not judged: a warning, and the local tier proceeds as before)."""
    if not is_leader:
        return RankReport(node, sharded, replicated)
    try:
        ram = is_ram_root(root)
        avail = free_bytes(root) + held_bytes(root) if ram else None
    except OSError as e:
        log.warning("tierckpt: could not measure the free space of local_root %s: %s", root, e)
        return RankReport(node, sharded, replicated)
    return RankReport(node, sharded, replicated, ram=ram, available=avail)


class RamGuard:
    """The local tier's RAM-root guard: at the first local save (the state size is known only
    then) every rank agrees, over the control group, whether each tmpfs/ramfs root can hold
    the local tier's expected footprint. If some cannot, the local tier is off for the rest of
    the run on every rank (replication pairs nodes, so all nodes stop together), with one
    warning and a skipped ``checkpoint`` record per save: filling host memory could get the
    trainer OOM-killed, which a skipped local step never does.

    Args:
        store: the node-local root's :class:`~tierckpt.io.storage.Store`; keep: ``keep_latest_k["local"]``; jump, factor: the
        replication layout; topo: the topology; control: the control group (every rank).
    """

    def __init__(self, store, keep: int, jump: int, factor: int, topo: Topology, control):
        self._store, self._keep, self._jump, self._factor = store, keep, jump, factor
        self._topo, self._control = topo, control
        self._checked = False
        self.off: str | None = None  # why the local tier is off for this run, or None


    def release(self) -> None:
        """Drop the control group (the engine closed and destroys its groups)."""
        self._control = None
    def admit(self, step: int, state_dict: dict) -> CheckpointRecord | None:
        """Whether the local tier saves ``state_dict`` at ``step``: None if it does, else its
        skipped record (not yet in the ledger). Collective over the control group at the first
        call only (every rank calls it at the same local saves)."""
        if self.off is None and not self._checked:
            self._checked = True
            topo = self._topo
            mine = leader_report(self._store.path(""), topo.node, *state_bytes(state_dict), topo.is_node_leader)
            reports = all_gather(mine, self._control)
            short = too_small(reports, self._keep, self._jump, self._factor)
            if short:
                self.off = describe(short, self._keep, self._factor)
                if topo.rank == 0:
                    log.warning("tierckpt: step %d: %s", step, self.off)
            elif self._keep == 0 and topo.is_node_leader and next(r for r in reports if r.node == topo.node).ram:
                log.warning("tierckpt: local_root %s is a RAM root (tmpfs) and keep_latest_k.local = 0 keeps "
                            "every step: host memory use grows with every local save", self._store.url)
        if self.off is None:
            return None
        return CheckpointRecord(tier="local", step=step, ok=False, skipped=True, error=self.off)
