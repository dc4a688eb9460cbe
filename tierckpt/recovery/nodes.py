"""One attempt of a job on node agents: what torchrun does per node, with warm processes.

:class:`AgentAttempt` starts every node's ranks of one attempt through the node agents of an
:class:`~tierckpt.recovery.pool.AgentPool` (:mod:`tierckpt.recovery.agent`), gives each rank
the environment torchrun would (:func:`rank_env`), and reports per node what a launcher needs:
the node's status in torchrun's terms (:meth:`AgentAttempt.status`), the failing worker's exit
status, its ranks' pids, and a hang verdict (:class:`~tierckpt.recovery.pool.HangWatch`).
Stopping a failed attempt (:meth:`AgentAttempt.kill`) SIGKILLs every rank at once and keeps
the agents — warm — for the next attempt.

A launcher's policy (retries, lost nodes, spares, shrinking) stays in the launcher
(``launch/local.py``).
"""

from __future__ import annotations

import json
import signal
import uuid
from dataclasses import dataclass

from tierckpt import clock
from tierckpt.preemption import PREEMPTED_EXIT
from tierckpt.recovery.pool import AgentPool, HangWatch, Verdict

RECOVERY_ENV = "TIERCKPT_RECOVERY"
RESTART_COUNT_ENV = "TIERCKPT_RESTART_COUNT"
# torchrun's node status when a worker failed (its "Root Cause" summary has the worker's own)
NODE_FAILED = 1


def rank_env(base: dict[str, str], *, node: int, local_rank: int, nproc_per_node: int, nodes: int,
             master_addr: str, master_port: int, run_id: str) -> dict[str, str]:
    """The environment torchrun (static rendezvous) gives a worker, on top of ``base``:
    RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK (the node id tierckpt reads),
    GROUP_WORLD_SIZE, ROLE_*, MASTER_ADDR/PORT, TORCHELASTIC_* and, as torchrun, OMP_NUM_THREADS=1
    when unset with several ranks per node.

    Raises:
        ValueError: a rank or node outside its range.
    """
    if not (0 <= node < nodes and 0 <= local_rank < nproc_per_node):
        raise ValueError(f"node {node} / local rank {local_rank} outside {nodes} nodes x {nproc_per_node} ranks")
    rank, world = node * nproc_per_node + local_rank, nodes * nproc_per_node
    env = dict(base)
    env.update(RANK=str(rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(world),
               LOCAL_WORLD_SIZE=str(nproc_per_node), GROUP_RANK=str(node), GROUP_WORLD_SIZE=str(nodes),
               ROLE_RANK=str(rank), ROLE_WORLD_SIZE=str(world), ROLE_NAME="default",
               MASTER_ADDR=master_addr, MASTER_PORT=str(master_port),
               TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_MAX_RESTARTS="0", TORCHELASTIC_RUN_ID=run_id,
               TORCHELASTIC_USE_AGENT_STORE="False", TORCH_NCCL_ASYNC_ERROR_HANDLING="1")
    env.pop("TIERCKPT_NODE_ID", None)  # one value cannot be right for every node: GROUP_RANK is
    if nproc_per_node > 1 and "OMP_NUM_THREADS" not in base:
        env["OMP_NUM_THREADS"] = "1"
    return env


@dataclass(frozen=True)
class NodeStatus:
    """A node's state in one attempt.

    Attributes:
        code: None while it runs; else torchrun's status for the node: 0 (every rank 0),
            :data:`~tierckpt.preemption.PREEMPTED_EXIT` (every rank saved on a notice), 1
            (a rank failed, or the agent is gone).
        worker_exitcode: the first failing rank's status (negative: killed by that signal;
None when none failed or the agent itself is gone: no status is known).
    """

    code: int | None
    worker_exitcode: int | None = None


class AgentAttempt:
    """One attempt of the job on ``slots`` (node id → agent slot) of ``pool``.

    Args:
        pool: the agents.
        index: the attempt's number (agents tag their events with it).
        slots: agent slot of each node id.
        nproc_per_node: ranks per node.
        watch: the hang verdicts of this attempt (None: no hang detection).
    """

    def __init__(self, pool: AgentPool, index: int, slots: list[int], nproc_per_node: int,
                 watch: HangWatch | None = None):
        self.pool, self.index, self.slots, self.nproc = pool, index, list(slots), nproc_per_node
        self.watch = watch
        self.run_id = uuid.uuid4().hex[:12]

    def start(self, argv: list[str], base_env: dict[str, str], *, master_addr: str, master_port: int,
              logs: list[str], cwd: str, recovery: dict | None = None,
              moves: dict[int, list[tuple[str, str]]] | None = None) -> list[int]:
        """Ask every node's agent to start its ranks; returns the nodes whose agent could not be
        reached (they count as failed at once).

        ``recovery`` (the launcher's phases of the failure before this attempt) goes to every
        rank as ``$TIERCKPT_RECOVERY`` (JSON; :mod:`tierckpt.recovery.timeline`). ``moves``
        ({node id: [(src, dst)]}) are directory renames a node's agent makes on its own host
        before it starts the ranks: a survivor renumbered after a shrink takes its node-local
        root along (:meth:`tierckpt.recovery.agent.Agent.move`).
        """
        env = dict(base_env)
        if recovery is not None:
            env[RECOVERY_ENV] = json.dumps({**recovery, "launched": clock.now()})
        unreachable = []
        for node, slot in enumerate(self.slots):
            ranks = [{"argv": list(argv), "log": logs[node], "cwd": cwd,
                      "env": rank_env(env, node=node, local_rank=lr, nproc_per_node=self.nproc,
                                      nodes=len(self.slots), master_addr=master_addr, master_port=master_port,
                                      run_id=self.run_id)}
                     for lr in range(self.nproc)]
            if not self.pool.start(slot, self.index, ranks, moves=(moves or {}).get(node, [])):
                unreachable.append(node)
        return unreachable

    def status(self, node: int) -> NodeStatus:
        """``node``'s state now (see :class:`NodeStatus`)."""
        h = self.pool.handles[self.slots[node]]
        if h.attempt != self.index:
            return NodeStatus(NODE_FAILED)
        bad = [c for _, c in sorted(h.statuses.items()) if c not in (0, PREEMPTED_EXIT)]
        if bad:  # torchrun stops the node's other workers when one fails: the node has failed
            return NodeStatus(NODE_FAILED, bad[0])
        if h.ended is not None:
            if h.ended.get("preempted"):
                return NodeStatus(PREEMPTED_EXIT)
            codes = list(h.ended.get("statuses", []))
            if all(c == 0 for c in codes):
                return NodeStatus(0)
            return NodeStatus(PREEMPTED_EXIT if PREEMPTED_EXIT in codes else NODE_FAILED)
        if h.dead:
            return NodeStatus(NODE_FAILED)
        return NodeStatus(None)

    def workers(self, node: int) -> list[int]:
        """PIDs of ``node``'s ranks (empty until its agent reported them started)."""
        h = self.pool.handles[self.slots[node]]
        return list(h.pids) if h.attempt == self.index and h.ended is None else []

    def warm(self) -> bool:
        """Whether every node's ranks were forked warm (known once every agent reported)."""
        return all(self.pool.handles[s].warm for s in self.slots)

    def started(self) -> bool:
        """Whether every agent reported its ranks started."""
        return all(self.pool.handles[s].started_at is not None for s in self.slots)

    def signal(self, sig: int = signal.SIGTERM) -> None:
        """Forward ``sig`` (a preemption notice) to every rank of the attempt."""
        for slot in self.slots:
            self.pool.signal(slot, self.index, sig)

    def kill(self, timeout: float = 10.0) -> list[int]:
        """SIGKILL every rank of the attempt and wait for the agents to confirm; returns the
        nodes whose agent did not (hung or gone: terminate them)."""
        slow = self.pool.kill(self.slots, self.index, timeout)
        return [self.slots.index(s) for s in slow]

    def verdict(self) -> Verdict | None:
        """A hang or stall of this attempt (None: none); its ``slots`` and ``silent`` are node
        ids here."""
        if self.watch is None:
            return None
        v = self.watch.check(self.pool, self.slots, self.index)
        if v is None:
            return None
        return Verdict(v.cause, tuple(self.slots.index(s) for s in v.slots), v.detail,
                       tuple(self.slots.index(s) for s in v.silent))
