#!/usr/bin/env python
"""The local launcher: what ``launch/*.sbatch`` do on a cluster, on one machine.

    python launch/local.py --nodes 2 [--nproc-per-node 1] [--max-attempts 3] [--log-dir DIR] \\
        -- -m titan_plugin.train --toml configs/titan_demo.toml [--section.key value …]

Same semantics as the sbatch scripts (see launch/README.md):

- one ``torchrun`` per simulated node (``python -m tierckpt.launch --nnodes N
  --node-rank i --nproc-per-node P --master-addr 127.0.0.1 --master-port PORT
  --max-restarts 0 <command>``) with a static rendezvous; every node's ranks get torchrun's
  GROUP_RANK, which tierckpt takes as the node id;
- a bounded retry loop: when one node's torchrun exits non-zero, the others are stopped
  (SIGTERM, SIGKILL after ``--kill-grace`` seconds; ``srun --kill-on-bad-exit=1``) and the job
  is started again, on a fresh port, up to ``--max-attempts`` times; a worker that exited with
  status 2 (invalid configuration) is not retried;
- ``TIERCKPT_RESTART_COUNT`` = attempts launched before this one (counted across launcher
  runs in ``--state-dir/attempts`` when given), which the engine writes into the ledger's
  ``run_start``; a failed attempt's run has no clean ``run_end`` there;
- ``TIERCKPT_RECOVERY`` for an attempt that follows a failed one (:func:`recovery_info`: the
  JSON object of ``tierckpt/recovery/timeline.py`` with the attempt, the cause, the failed
  node ids, when the failure was noticed, when the survivors were stopped and when the new
  attempt was launched, whether its ranks are warm, the spares that took over); the
  restarted job's ``recovery`` ledger record times its phases from it.

Nothing is requeued (there is no allocation to lose). The command's output goes to one log
per node and attempt (``<log-dir>/<name>-attempt<k>-node<n>.log``). Exit status: 0 when an
attempt succeeded, else the failing node's torchrun status (2 for a configuration error).

**Preemption notice.** Each node runs torchrun through ``python -m tierckpt.launch`` (it
forwards SIGUSR1 as well as SIGTERM to its ranks instead of dying on it, and exits 75 when all
its ranks saved on a notice). SIGTERM or SIGUSR1 to this launcher (:meth:`LocalLauncher.notice`)
is forwarded as SIGTERM to every node's torchrun; the nodes get ``--notice-grace`` seconds to
save and exit, nothing is retried, and the exit status is 75 ("requeue me") when every node
exited 75. A node exiting 75 by itself (the notice reached the ranks directly) starts the same
wait instead of stopping the other nodes.
:class:`LocalLauncher` is the Python API (``launch/local_demo.py`` uses it to kill a node's
training process mid-run).

**Warm processes** (default; ``--cold`` for the torchrun path above). Instead of a torchrun
per node and attempt, the launcher starts one node agent per simulated node for the whole run
(``python -m tierckpt.recovery.agent``; :mod:`tierckpt.recovery`), which imports the trainer's
modules once (``--preload``, default from the command: torch, torchtitan and the plugin for
``-m titan_plugin.train``) and forks each attempt's ranks from that warm interpreter, with the
environment torchrun would give them. A failed attempt's ranks are SIGKILLed at once (their
state is in the tiers; a torn save is never visible) and the next attempt starts within
milliseconds: survivors and replacement pay no interpreter start and no imports. The agents
also watch their ranks' beacons: a node whose ranks stop ticking (SIGSTOP, a frozen host) for
``--hang-timeout`` seconds (default 10) is killed and restarted or replaced, and with
``--progress-timeout`` a job in which no rank reports a new step for that long is restarted.
Nothing in an agent initialises CUDA or NCCL (:mod:`tierckpt.recovery.warm` checks it before
every fork).

**Spare nodes** (``--spares S``): S more agents start idle. When a node is lost for good (or
hangs and is killed), a spare takes over its node id at the next attempt, with an empty local
root: it restores its shards from its peers' replicas, and the job keeps its world size. With
no spare left, ``--min-nodes`` decides as below.

**Losing a node for good** (:meth:`LocalLauncher.lose_node`, ``--lose-node NODE@SECONDS``): its
processes are SIGKILLed and its local root (``--local-root``, a template with ``{node}``) is
deleted. With ``--min-nodes M`` (default ``$TIERCKPT_MIN_NODES``, else every node is needed) the
next attempt runs on the remaining nodes as long as at least M are left, else the job ends
with a message naming the minimum. The survivors keep their order and are renumbered 0..N'-1;
a survivor whose id changes takes its disk along (its local-root directory is renamed to the
new id, as the host's own disk would follow it). A shrunk attempt appends the overrides of
``reconfigure(nodes, nproc_per_node)`` to the command; for ``-m titan_plugin.train`` the CLI
uses :func:`titan_reconfigure` (``python -m titan_plugin.elastic``: data-parallel degree,
replication J/F that fit the new node count).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG_ERROR = 2  # exit status of titan_plugin.train / the mcore launcher on an invalid configuration
PREEMPTED_EXIT = 75  # tierckpt.PREEMPTED_EXIT: the ranks saved on a preemption notice ("requeue me")
MIN_NODES_ENV = "TIERCKPT_MIN_NODES"
if REPO not in sys.path:  # run as a script: the repository's packages (tierckpt.recovery)
    sys.path.insert(0, REPO)

from tierckpt import clock  # noqa: E402 - after the path fix above
from tierckpt.recovery.nodes import RECOVERY_ENV, AgentAttempt  # noqa: E402
from tierckpt.recovery.pool import AgentPool, HangWatch, PoolError  # noqa: E402
from tierckpt.recovery.warm import PROCESS_STARTED_ENV  # noqa: E402


def default_preload(command: list[str]) -> list[str]:
    """Modules a node agent imports before forking ranks of ``command``: what the trainer's
    entry point imports anyway (torch, the framework, the plugin, the engine), never anything
    that initialises CUDA or a process group at import."""
    base = ["torch", "torch.distributed.checkpoint", "tierckpt.engine"]
    if command[:2] == ["-m", "titan_plugin.train"]:
        extra = ["torchtitan.train", "titan_plugin.manager", "titan_plugin.toml"]
        return base + extra + ["tierckpt_dev.titan", "tierckpt_dev.titan.cpu"]
    if command[:2] == ["-m", "mcore_plugin.pretrain"]:
        return base + ["megatron.core", "megatron.training", "mcore_plugin.install"]
    return base


class LaunchError(RuntimeError):
    """The launcher could not finish: a timeout, or a monitor callback raised (every process
    was stopped first)."""


def free_port() -> int:
    """A TCP port nobody listens on right now (the kernel's choice), for MASTER_PORT."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _term_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """torchrun gets SIGTERM when the launcher dies, and stops its workers itself."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def descendants(pid: int) -> list[int]:
    """PIDs of every live descendant of ``pid`` (from /proc; Linux)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(d))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def root_cause_exitcode(log_text: str) -> int | None:
    """The worker exit status in torchrun's failure summary ("Root Cause … exitcode : -9"):
    negative = killed by that signal; None when the text has no summary."""
    i = log_text.rfind("Root Cause")
    m = re.search(r"exitcode\s*:\s*(-?\d+)", log_text[i:]) if i >= 0 else None
    return int(m.group(1)) if m else None


def recovery_info(failed: Attempt, new: Attempt, warm: bool,
                  describe: Callable[[int], str] = lambda s: f"spare slot {s}") -> dict | None:
    """The ``TIERCKPT_RECOVERY`` object of attempt ``new`` after attempt ``failed`` (the contract
    of ``tierckpt/recovery/timeline.py``), or None when ``failed`` did not fail (no failure
    noticed).

    ``cause``: what ``failed`` recorded (``"node-failure"``, ``"lost-node"``, ``"hang"``,
    ``"stall"``); ``failed_nodes``: node ids in ``failed`` (the lost ones, the blamed ones);
    ``replaced``: the spares that took over a node id for ``new``; ``warm``: the ranks are forked
    by warm node agents (which also set ``TIERCKPT_PROCESS_STARTED`` at the fork; torchrun's
    ranks are new processes whose ``/proc`` creation time the engine reads instead); ``describe``
    names a spare's slot (a simulated one here, its host on Slurm)."""
    if failed.failure_noticed is None:
        return None
    nodes = sorted({*(failed.slots.index(s) for s in failed.lost if s in failed.slots), *failed.failed_nodes,
                    *(() if failed.failed_node is None else (failed.failed_node,))})
    return {"attempt": new.index, "cause": failed.cause or ("lost-node" if failed.lost else "node-failure"),
            "failed_nodes": nodes, "failure_noticed": failed.failure_noticed,
            "survivors_stopped": failed.survivors_stopped, "launched": new.t_start, "warm": warm,
            "replaced": {str(n): describe(s) for n, s in sorted(new.replaced.items())}}


def _min_nodes(value: int | None, nodes: int) -> int:
    """``value``, else ``$TIERCKPT_MIN_NODES``, else ``nodes``; checked to be in 1..nodes."""
    src = "min_nodes"
    if value is None and os.environ.get(MIN_NODES_ENV, "").strip():
        src, raw = MIN_NODES_ENV, os.environ[MIN_NODES_ENV].strip()
        if not raw.isdigit():
            raise ValueError(f"{MIN_NODES_ENV}={raw!r}: must be an integer in 1..{nodes} (the nodes of the job)")
        value = int(raw)
    if value is None:
        return nodes
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= nodes:
        raise ValueError(f"{src} must be an integer in 1..{nodes} (the nodes of the job), got {value!r}")
    return value


def titan_reconfigure(command: list[str], log: Callable[[str], None] | None = None) -> Callable[[int, int], list[str]]:
    """A ``reconfigure`` for ``command`` = ``["-m", "titan_plugin.train", "--toml", FILE, …]``:
    runs ``python -m titan_plugin.elastic --nodes N --nproc-per-node P -- <the training args>``
    and returns its overrides (data-parallel degree, replication J/F fitting N nodes); its
    warnings go to ``log`` (default stderr).

    Raises:
        ValueError: ``command`` does not run ``titan_plugin.train``.
    """
    if command[:2] != ["-m", "titan_plugin.train"]:
        raise ValueError(f"titan_reconfigure needs a command starting with -m titan_plugin.train, got {command[:2]}")
    train_args = command[2:]
    say = log or (lambda m: print(m, file=sys.stderr, flush=True))

    def fit(nodes: int, nproc_per_node: int) -> list[str]:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p)
        r = subprocess.run([sys.executable, "-m", "titan_plugin.elastic", "--nodes", str(nodes),
                            "--nproc-per-node", str(nproc_per_node), "--", *train_args],
                           cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        if r.returncode != 0:
            raise LaunchError(r.stderr.strip().splitlines()[-1] if r.stderr.strip() else f"exit {r.returncode}")
        doc = json.loads(r.stdout.strip().splitlines()[-1])
        for w in doc["warnings"]:
            say(f"warning: {w}")
        return list(doc["args"])

    return fit


@dataclass
class Attempt:
    """One start of the job: one torchrun per node.

    Attributes:
        index: 0-based attempt number in this launcher.
        restart_count: the TIERCKPT_RESTART_COUNT it ran with.
        port: its MASTER_PORT.
        procs: one torchrun process per node (index = node rank).
        logs: one log file per node.
        t_start, t_end: UNIX seconds.
        rcs: torchrun exit status per node (None: stopped by the launcher before it ended).
        failed_node: the first node whose torchrun exited non-zero (None: success).
        worker_exitcode: that node's worker status from torchrun's summary (negative: signal).
        nodes: nodes of this attempt (``--nnodes``).
        slots: the simulated host ("slot", its index in the first attempt) of each node.
        extra_args: what ``reconfigure`` appended to the command (shrunk attempts).
        lost: slots lost for good during this attempt.
        notice_at: UNIX seconds of the preemption notice (forwarded, or a node's exit 75), or None.
        preempted: every node exited 75 after saving on the notice.
        warm: its ranks were forked by warm node agents (None: not known yet / cold).
        cause: why it failed: "node-failure" (a rank exited non-zero), "hang" or "stall"
            (:class:`tierckpt.recovery.pool.HangWatch`), "lost-node" (:meth:`LocalLauncher.lose_node`).
        failed_nodes: node ids blamed for the failure.
        failure_noticed, survivors_stopped: UNIX seconds the launcher saw the failure and
            every process of the attempt was gone.
        replaced: {node id: slot} of the spares that took over a node id for this attempt.
        agent: the attempt on the node agents (warm), else None.
        hang_detail: what the hang verdict saw (warm, cause "hang" or "stall").
        restarted_agents: node ids whose agent was killed in this attempt (replaced by a spare,
            or restarted).
        recovery: the ``TIERCKPT_RECOVERY`` object this attempt ran with (None: first attempt).
    """

    index: int
    restart_count: int
    port: int
    procs: list[subprocess.Popen] = field(default_factory=list)
    logs: list[str] = field(default_factory=list)
    t_start: float = 0.0
    t_end: float | None = None
    rcs: list[int | None] = field(default_factory=list)
    failed_node: int | None = None
    worker_exitcode: int | None = None
    nodes: int = 0
    slots: list[int] = field(default_factory=list)
    extra_args: list[str] = field(default_factory=list)
    lost: list[int] = field(default_factory=list)
    notice_at: float | None = None
    preempted: bool = False
    warm: bool | None = None
    cause: str | None = None
    failed_nodes: list[int] = field(default_factory=list)
    failure_noticed: float | None = None
    survivors_stopped: float | None = None
    replaced: dict[int, int] = field(default_factory=dict)
    agent: AgentAttempt | None = None
    hang_detail: str = ""
    restarted_agents: set[int] = field(default_factory=set)
    recovery: dict | None = None

    @property
    def ok(self) -> bool:
        return self.t_end is not None and self.failed_node is None


class LocalLauncher:
    """Run ``command`` as a job of ``nodes`` simulated nodes with retries (see the module doc).

    Args:
        command: what follows torchrun's options: ``["-m", "pkg.mod", args…]`` or
            ``["script.py", args…]``.
        nodes: simulated nodes (torchruns), ≥ 1.
        nproc_per_node: ranks per node, ≥ 1.
        max_attempts: attempts before giving up, ≥ 1.
        log_dir: directory of the per-node logs (created).
        name: prefix of the log files.
        env: extra environment of every node (e.g. OMP_NUM_THREADS).
        state_dir: where the restart counter persists across launcher runs (None: start at 0).
        kill_grace_s: seconds between SIGTERM and SIGKILL when stopping nodes.
        cwd: working directory of the nodes (default: the repository).
        min_nodes: fewest nodes the job may go on with after :meth:`lose_node` (1..nodes;
            None: ``$TIERCKPT_MIN_NODES``, else ``nodes``: a lost node ends the job).
        local_root: the simulated nodes' local-root directory with ``{node}`` (its only field):
            deleted for a lost node, renamed to follow a survivor's new id (None: no disks).
        reconfigure: ``(nodes, nproc_per_node) -> [args]`` appended to the command of an
            attempt with fewer nodes than the first (e.g. :func:`titan_reconfigure`); it may
            raise ValueError or :class:`LaunchError` for a job that cannot fit (then the run
            ends with status 2).
        notice_grace_s: seconds the nodes get to save and exit after a preemption notice
            before they are SIGKILLed (> ``preemption_grace_s`` + one step).
        warm: run the ranks in warm node agents (module docstring); False: one torchrun per
            node and attempt.
        spares: idle nodes (agents, when warm) that take over the id of a node lost for good
            or killed for hanging (≥ 0).
        preload: modules the agents import before forking ranks (None: :func:`default_preload`).
        hang_timeout_s: seconds after which a node whose agent or ranks stopped ticking is
            hung (warm only; 0 disables; else ≥ 2).
        progress_timeout_s: seconds without a new training step on any rank (once one was
            reported) after which the attempt is restarted (warm only; 0, the default, disables:
            set it above the longest evaluation or final save).
        agent_ready_timeout_s: seconds the agents get to start and import (warm only).

    Raises:
        ValueError: a count < 1, ``min_nodes`` outside 1..nodes (or a bad
            ``$TIERCKPT_MIN_NODES``), a ``local_root`` without ``{node}``, an empty command,
            ``spares`` < 0, or a bad timeout.
    """

    def __init__(self, command: list[str], *, nodes: int, nproc_per_node: int = 1, max_attempts: int = 3,
                 log_dir: str, name: str = "job", env: dict[str, str] | None = None,
                 state_dir: str | None = None, kill_grace_s: float = 5.0, cwd: str = REPO,
                 min_nodes: int | None = None, local_root: str | None = None,
                 reconfigure: Callable[[int, int], list[str]] | None = None, notice_grace_s: float = 120.0,
                 warm: bool = True, spares: int = 0, preload: list[str] | None = None,
                 hang_timeout_s: float = 10.0, progress_timeout_s: float = 0.0,
                 agent_ready_timeout_s: float = 600.0):
        for opt, v in (("nodes", nodes), ("nproc_per_node", nproc_per_node), ("max_attempts", max_attempts)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{opt} must be an integer >= 1, got {v!r}")
        if not command:
            raise ValueError("command must not be empty (e.g. ['-m', 'titan_plugin.train', '--toml', FILE])")
        self.min_nodes = _min_nodes(min_nodes, nodes)
        if local_root is not None and "{node}" not in local_root:
            raise ValueError(f"local_root must contain {{node}} (one directory per simulated node), got {local_root!r}")
        self.local_root, self.reconfigure = local_root, reconfigure
        self.initial_nodes = nodes
        self.slots = list(range(nodes))  # simulated host of each node id; survivors keep their order
        self.lost: list[int] = []
        self._dir_id = {s: s for s in self.slots}  # slot -> the node id its local root is named by
        self.command = list(command)
        self.nodes, self.nproc_per_node, self.max_attempts = nodes, nproc_per_node, max_attempts
        self.log_dir, self.name, self.cwd = log_dir, name, cwd
        self.extra_env = dict(env or {})
        self.state_dir = state_dir
        self.kill_grace_s = kill_grace_s
        self.notice_grace_s = notice_grace_s
        self._notice: str | None = None
        self.attempts: list[Attempt] = []
        if isinstance(spares, bool) or not isinstance(spares, int) or spares < 0:
            raise ValueError(f"spares must be an integer >= 0, got {spares!r}")
        self.warm, self.preload = bool(warm), list(preload) if preload is not None else default_preload(command)
        if command[0] == "-m" and len(command) > 1:  # the entry module runs as __main__: a preloaded copy
            self.preload = [m for m in self.preload if m != command[1]]  # would be a second one
        self.spares = list(range(nodes, nodes + spares))  # idle slots, taken in order
        self.watch = HangWatch(hang_timeout_s, progress_timeout_s) if warm else None  # ValueError on bad input
        self.agent_ready_timeout_s = agent_ready_timeout_s
        self.pool: AgentPool | None = None
        self._pending_replace: dict[int, int] = {}  # node id -> spare slot, for the next attempt
        self._fits: dict = {}  # node count -> Future of reconfigure(nodes, nproc_per_node) (_prefit)
        self._moves: dict[int, list[tuple[str, str]]] = {}  # node id -> renames its agent does first (remote hosts)
        os.makedirs(log_dir, exist_ok=True)

    # -- commands ------------------------------------------------------------------------------
    def node_command(self, node: int, port: int) -> list[str]:
        """The command line of ``node``'s torchrun."""
        # tierckpt.launch: torchrun that forwards SIGUSR1 too and exits 75 after a preemption save
        return [sys.executable, "-m", "tierckpt.launch", f"--nnodes={self.nodes}", f"--node-rank={node}",
                f"--nproc-per-node={self.nproc_per_node}", "--master-addr=127.0.0.1", f"--master-port={port}",
                "--max-restarts=0", *self.command]

    def _next_restart_count(self) -> int:
        if self.state_dir is None:
            return len(self.attempts)
        os.makedirs(self.state_dir, exist_ok=True)
        path = os.path.join(self.state_dir, "attempts")
        try:
            with open(path) as f:
                n = int(f.read().strip() or 0)
        except (OSError, ValueError):
            n = 0
        with open(path + ".tmp", "w") as f:
            f.write(f"{n + 1}\n")
        os.replace(path + ".tmp", path)
        return n

    def _start(self, extra_args: list[str]) -> Attempt:
        used = {a.port for a in self.attempts}
        port = free_port()
        while port in used:  # a fresh port per attempt, as on Slurm
            port = free_port()
        a = Attempt(index=len(self.attempts), restart_count=self._next_restart_count(), port=port,
                    nodes=self.nodes, slots=list(self.slots), extra_args=list(extra_args))
        env = dict(os.environ)
        env.pop("TIERCKPT_NODE_ID", None)  # one value cannot be right for every node: use GROUP_RANK
        for k in (RECOVERY_ENV, PROCESS_STARTED_ENV):  # this launcher's own, or none (not an outer job's)
            env.pop(k, None)
        env.update(self.extra_env)
        env["TIERCKPT_RESTART_COUNT"] = str(a.restart_count)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p)
        a.replaced, self._pending_replace = dict(self._pending_replace), {}
        a.t_start = clock.now()
        a.recovery = recovery_info(self.attempts[-1], a, self.warm, self.describe) if self.attempts else None
        if a.recovery is not None:
            env[RECOVERY_ENV] = json.dumps(a.recovery)
        self.attempts.append(a)
        if self.warm:
            env.pop(RECOVERY_ENV, None)  # the agents add it, with the instant they were asked
            return self._start_warm(a, env)
        for node in range(self.nodes):
            path = os.path.join(self.log_dir, f"{self.name}-attempt{a.index + 1}-node{node}.log")
            a.logs.append(path)
            with open(path, "w") as logf:
                a.procs.append(subprocess.Popen(self.node_command(node, port) + a.extra_args, env=env, cwd=self.cwd,
                                                stdout=logf,
                                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                                start_new_session=True, preexec_fn=_term_with_parent))
        a.rcs = [None] * self.nodes
        return a

    def _start_warm(self, a: Attempt, env: dict[str, str]) -> Attempt:
        """Start attempt ``a`` in the node agents (one per slot of this attempt)."""
        assert self.pool is not None
        try:
            self.pool.wait_ready(self.slots, self.agent_ready_timeout_s)  # a restarted agent imports first
        except PoolError as e:
            raise LaunchError(str(e)) from None
        a.logs = [os.path.join(self.log_dir, f"{self.name}-attempt{a.index + 1}-node{n}.log") for n in range(self.nodes)]
        for path in a.logs:
            open(path, "w").close()
        a.agent = AgentAttempt(self.pool, a.index, self.slots, self.nproc_per_node, self.watch)
        a.rcs = [None] * self.nodes
        unreachable = a.agent.start(self.command + a.extra_args, env, master_addr=self.master_addr(), master_port=a.port,
                                    logs=a.logs, cwd=self.cwd, recovery=a.recovery, moves=self._moves)
        self._moves = {}
        for node in unreachable:
            a.rcs[node] = 1
        return a

    def master_addr(self) -> str:
        """The host node 0's rank 0 listens on (simulated nodes: the loopback)."""
        return "127.0.0.1"

    def describe(self, slot: int) -> str:
        """What runs ``slot``, for messages and the recovery record (here: a simulated host)."""
        return f"spare slot {slot}" if slot >= self.initial_nodes else f"simulated host {slot}"

    def _launch_agent(self, slot: int) -> None:
        """Start the node agent of ``slot`` (its log: ``<name>-agent<slot>.log``)."""
        assert self.pool is not None
        env = dict(os.environ)
        env.pop("TIERCKPT_NODE_ID", None)
        env.update(self.extra_env)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p)
        self.pool.launch_local(slot, preload=self.preload, env=env, cwd=self.cwd, preexec_fn=_term_with_parent,
                               log_path=os.path.join(self.log_dir, f"{self.name}-agent{slot}.log"))

    def _ensure_agents(self) -> None:
        """Start the agents of every node and spare, and wait until they imported."""
        if not self.warm or self.pool is not None:
            return
        self.pool = AgentPool()
        slots = [*self.slots, *self.spares]
        for slot in slots:
            self._launch_agent(slot)
        try:
            self.pool.wait_ready(slots, self.agent_ready_timeout_s)
        except PoolError as e:
            raise LaunchError(str(e)) from None

    # -- processes -----------------------------------------------------------------------------
    def workers(self, node: int) -> list[int]:
        """PIDs of the training processes (torchrun's children) of ``node`` in the current attempt."""
        if not self.attempts:
            return []
        if self.attempts[-1].agent is not None:
            return self.attempts[-1].agent.workers(node)
        p = self.attempts[-1].procs[node]
        if p.poll() is not None:
            return []
        kids = []
        for pid in descendants(p.pid):
            with contextlib.suppress(OSError, IndexError, ValueError):
                with open(f"/proc/{pid}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == p.pid:
                        kids.append(pid)
        return kids

    def _stop_nodes(self, a: Attempt) -> None:
        """SIGTERM every running torchrun of ``a`` (it stops its workers), SIGKILL what is left
        after the grace period, the workers included. Warm: SIGKILL every rank through its
        agent; an agent that does not confirm is killed (its node is then hung: replaced by a
        spare, or its agent restarted)."""
        if a.agent is not None:
            if self.pool is None:  # the run ended: its agents, and their ranks, are gone
                return
            for node in a.agent.kill(timeout=max(3.0, self.kill_grace_s)):
                if node not in a.restarted_agents and a.agent.slots[node] not in self.lost:
                    self._agent_died(a, node)  # not a node already lost, replaced or restarted
            if a.survivors_stopped is None:
                a.survivors_stopped = clock.now()
            return
        tree = {i: [p.pid, *descendants(p.pid)] for i, p in enumerate(a.procs) if p.poll() is None}
        for i in tree:
            with contextlib.suppress(ProcessLookupError):
                os.kill(a.procs[i].pid, signal.SIGTERM)
        deadline = time.time() + self.kill_grace_s
        while any(a.procs[i].poll() is None for i in tree) and time.time() < deadline:
            time.sleep(0.05)
        for i, pids in tree.items():
            for pid in [*pids, *descendants(a.procs[i].pid)]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            a.procs[i].wait()
        # workers of nodes that ended by themselves may outlive their torchrun (own sessions)
        for p in a.procs:
            for pid in descendants(p.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)

    def lose_node(self, node: int) -> None:
        """Lose node ``node`` (its id in the current attempt) for good, e.g. from a monitor
        callback: its torchrun and workers are SIGKILLed at once (the attempt then fails as
        with a crash), its local root is deleted, and the next attempts run without it.

        Raises:
            ValueError: ``node`` is not a node id of the current attempt.
        """
        if not isinstance(node, int) or not 0 <= node < self.nodes:
            raise ValueError(f"node must be a node id in 0..{self.nodes - 1}, got {node!r}")
        a = self.attempts[-1] if self.attempts else None
        if self.pool is not None:
            self.pool.terminate(self.slots[node])  # the host is gone: its agent and ranks too
        elif a is not None and a.t_end is None and node < len(a.procs) and a.procs[node].poll() is None:
            for pid in [*descendants(a.procs[node].pid), a.procs[node].pid]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        if a is not None and a.t_end is None:
            a.cause = a.cause or "lost-node"
        if self.spares:
            self._take_spare(node, a)
            return
        slot = self.slots.pop(node)
        self.lost.append(slot)
        if a is not None and a.t_end is None:
            a.lost.append(slot)
        self.nodes = len(self.slots)
        if self.local_root is not None:
            shutil.rmtree(self.local_root.format(node=self._dir_id.pop(slot)), ignore_errors=True)

    def _take_spare(self, node: int, a: Attempt | None) -> None:
        """Node ``node``'s host is lost (its disk with it): the next spare slot takes over its
        id from the next attempt on, with an empty local root."""
        slot, spare = self.slots[node], self.spares.pop(0)
        self.lost.append(slot)
        if a is not None and a.t_end is None:
            a.lost.append(slot)
        self.slots[node] = spare
        self._pending_replace[node] = spare
        if self.local_root is not None:
            shutil.rmtree(self.local_root.format(node=self._dir_id.pop(slot)), ignore_errors=True)
            self._dir_id[spare] = node

    def _agent_died(self, a: Attempt, node: int) -> None:
        """``node``'s agent hung or vanished: kill it; a spare takes the node over (its host is
        out: its disk is not read again), else a fresh agent restarts on the same host, disk
        kept (a reboot), cold."""
        assert self.pool is not None
        slot = self.slots[node]
        self.pool.terminate(slot)
        a.restarted_agents.add(node)
        if node not in a.failed_nodes:
            a.failed_nodes.append(node)
        if self.spares:
            self._take_spare(node, a)
        else:
            self._launch_agent(slot)

    def _relocate_disks(self) -> None:
        """Rename each survivor's local root to its node id of the next attempt (ids only go
        down, in order, so a target is free: it was a lost node's or an earlier survivor's)."""
        if self.local_root is None:
            return
        for new_id, slot in enumerate(self.slots):
            old_id = self._dir_id[slot]
            if old_id != new_id:
                src, dst = self.local_root.format(node=old_id), self.local_root.format(node=new_id)
                if os.path.exists(dst):
                    raise LaunchError(f"cannot move node {old_id}'s local root to {dst}: it exists")
                if os.path.exists(src):
                    os.rename(src, dst)
                self._dir_id[slot] = new_id

    def stop(self) -> None:
        """Stop every process of the current attempt (idempotent)."""
        if self.attempts:
            self._stop_nodes(self.attempts[-1])

    kill_all = stop  # the name local_demo's cleanup calls

    def notice(self, signum: int = signal.SIGTERM) -> None:
        """A preemption notice (safe to call from a signal handler): the running attempt's
        nodes get SIGTERM at the next poll, then ``notice_grace_s`` to save and exit, and the
        run ends without a retry (status 75 when every node saved)."""
        self._notice = signal.Signals(signum).name

    # -- the loop ------------------------------------------------------------------------------
    def run(self, timeout: float | None = None,
            monitor: Callable[["LocalLauncher", Attempt], None] | None = None,
            log: Callable[[str], None] | None = None) -> int:
        """Run attempts until one succeeds, ``max_attempts`` failed, or a configuration error.

        Args:
            timeout: seconds for the whole run (None: no limit).
            monitor: called about every 50 ms with the running attempt (e.g. to inject a
                failure); an exception it raises stops every process and propagates.
            log: receives one line per attempt start and end.

        Returns:
            0, or the exit status of the failed attempt's first failing torchrun (2 when a
            worker reported an invalid configuration); after a node was lost for good with
            fewer than ``min_nodes`` left, that status (1 when it was a signal); 2 when
            ``reconfigure`` says the job cannot fit the nodes left; 75 after a preemption
            notice (:meth:`notice`, or a node exiting 75) when every node saved, else the
            status of the first node that failed (never retried).

        Raises:
            LaunchError: the timeout passed (every process stopped).
        """
        say = log or (lambda s: None)
        deadline = None if timeout is None else time.time() + timeout
        rc = 1
        try:
            self._prefit()
            if self.warm and self.pool is None:
                t0 = time.time()
                self._ensure_agents()
                say(f"{len(self.slots) + len(self.spares)} node agents ready (warm: {', '.join(self.preload)} "
                    f"imported) in {time.time() - t0:.1f} s" + (f"; spare slots {self.spares}" if self.spares else ""))
            while True:
                if self.nodes < self.min_nodes:
                    say(f"giving up: node(s) {self.lost} lost for good, {self.nodes} left, fewer than the minimum "
                        f"{self.min_nodes} (min_nodes / {MIN_NODES_ENV})")
                    return rc if rc > 0 else 1
                try:
                    extra = self._fit(say)
                except (ValueError, LaunchError) as e:
                    say(f"cannot go on with {self.nodes} nodes: {e}")
                    return CONFIG_ERROR
                a = self._start(extra)
                say(f"attempt {a.index + 1}/{self.max_attempts} (restart count {a.restart_count}), "
                    f"{self.nodes} nodes x {self.nproc_per_node} ranks, MASTER_PORT={a.port}")
                rc = self._wait(a, deadline, monitor)
                if a.preempted:
                    say(f"attempt {a.index + 1} preempted ({self._notice or 'a node exited 75'}): every node saved; "
                        f"exit {PREEMPTED_EXIT} (requeue)")
                    return PREEMPTED_EXIT
                if rc == 0:
                    say(f"attempt {a.index + 1} finished")
                    return 0
                if a.notice_at is not None:
                    say(f"attempt {a.index + 1} ended on a preemption notice without every node saving: "
                        f"node {a.failed_node} exited {rc}; not retrying")
                    return rc
                code = a.worker_exitcode
                if a.cause in ("hang", "stall"):
                    say(f"attempt {a.index + 1} failed: {a.cause}: {a.hang_detail}")
                else:
                    say(f"attempt {a.index + 1} failed: node {a.failed_node} exited {rc}"
                        + (f" (worker {'killed by signal ' + str(-code) if code < 0 else 'exit ' + str(code)})"
                           if code is not None else ""))
                if a.lost:
                    say(f"node(s) on {', '.join(self.describe(s) for s in a.lost)} lost for good; "
                        f"{self.nodes} node(s) left")
                for node, spare in self._pending_replace.items():
                    say(f"{self.describe(spare)} takes over node {node} ({len(self.spares)} spare(s) left)")
                if code == CONFIG_ERROR:
                    say("invalid configuration: not retrying")
                    return CONFIG_ERROR
                if a.index + 1 >= self.max_attempts:
                    say(f"giving up after {self.max_attempts} attempts")
                    return rc
        finally:
            self.stop()
            if self.pool is not None:
                self.pool.close()
                self.pool = None

    def _fit(self, say: Callable[[str], None]) -> list[str]:
        """Before an attempt: move the survivors' disks to their ids; the reconfigure
        overrides when the job runs on fewer nodes than it started with."""
        self._relocate_disks()
        if self.nodes == self.initial_nodes or self.reconfigure is None:
            return []
        extra = self._refit(self.nodes)
        say(f"{self.nodes} of {self.initial_nodes} nodes: appending {' '.join(extra) or 'nothing'}")
        return extra

    def _prefit(self) -> None:
        """Work out ``reconfigure`` for every smaller node count the job may go on with, in the
        background from the start (for torchtitan it imports the framework: 10-20 s that a
        shrinking restart would otherwise wait for)."""
        if self.reconfigure is None or self.min_nodes >= self.initial_nodes or self._fits:
            return
        import concurrent.futures

        pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tierckpt-refit")
        for n in range(self.initial_nodes - 1, self.min_nodes - 1, -1):
            self._fits[n] = pool.submit(self.reconfigure, n, self.nproc_per_node)
        pool.shutdown(wait=False)

    def _refit(self, nodes: int) -> list[str]:
        fut = self._fits.get(nodes)
        if fut is not None:
            return list(fut.result())
        assert self.reconfigure is not None
        return list(self.reconfigure(nodes, self.nproc_per_node))

    def _poll_nodes(self, a: Attempt) -> None:
        """Refresh ``a.rcs`` (and, warm, the agents' events and the failing worker's status)."""
        if a.agent is None:
            for i, p in enumerate(a.procs):
                a.rcs[i] = p.poll()
            return
        assert self.pool is not None
        for ev in self.pool.poll(0.0):
            if ev.get("ev") == "notice" and self._notice is None:  # a signal reached an agent itself
                self._notice = signal.Signals(int(ev["sig"])).name
        for i in range(len(a.rcs)):
            if a.rcs[i] is None:
                st = a.agent.status(i)
                a.rcs[i] = st.code
                if st.code not in (None, 0, PREEMPTED_EXIT) and a.worker_exitcode is None:
                    a.worker_exitcode = st.worker_exitcode
        if a.warm is None and a.agent.started():
            a.warm = a.agent.warm()

    def _forward_notice(self, a: Attempt) -> None:
        if a.agent is not None:
            a.agent.signal(signal.SIGTERM)
            return
        for p in a.procs:  # torchrun forwards it to its ranks (tierckpt.launch: SIGUSR1 too)
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGTERM)

    def _failed(self, a: Attempt, node: int, cause: str) -> None:
        """Attempt ``a`` failed at ``node``: note when, stop every process, note when."""
        a.failure_noticed = a.failure_noticed or clock.now()
        a.failed_node = node if a.failed_node is None else a.failed_node
        a.cause = a.cause or cause
        if node not in a.failed_nodes:
            a.failed_nodes.append(node)
        self._stop_nodes(a)  # srun --kill-on-bad-exit=1
        a.t_end = clock.now()
        a.survivors_stopped = a.survivors_stopped or a.t_end
        if a.agent is None:
            with contextlib.suppress(OSError):
                with open(a.logs[a.failed_node], errors="replace") as f:
                    a.worker_exitcode = root_cause_exitcode(f.read()[-20000:])

    def _wait(self, a: Attempt, deadline: float | None, monitor) -> int:
        while True:
            if monitor is not None:
                monitor(self, a)
            self._poll_nodes(a)
            if self._notice is not None and a.notice_at is None:
                a.notice_at = clock.now()
                self._forward_notice(a)
            if a.notice_at is None and PREEMPTED_EXIT in a.rcs:
                a.notice_at = clock.now()  # the notice reached the ranks directly: the others save too
                if a.agent is not None:  # torchrun's nodes hear it from the ranks; agents forward it
                    a.agent.signal(signal.SIGTERM)
            if a.notice_at is not None:
                rc = self._wait_preempted(a)
                if rc is None:
                    time.sleep(0.05)
                    continue
                return rc
            bad = [(i, rc) for i, rc in enumerate(a.rcs) if rc is not None and rc != 0]
            if bad:
                self._failed(a, bad[0][0], "lost-node" if a.lost else "node-failure")
                return a.rcs[bad[0][0]] or 1
            verdict = a.agent.verdict() if a.agent is not None else None
            if verdict is not None:
                self._hung(a, verdict)
                return 1
            if all(rc == 0 for rc in a.rcs):
                a.t_end = clock.now()
                return 0
            if deadline is not None and time.time() > deadline:
                self._stop_nodes(a)
                raise LaunchError(f"{self.name}: not finished within the timeout (attempt {a.index + 1}); "
                                  f"logs: {a.logs}")
            time.sleep(0.05)

    def _hung(self, a: Attempt, verdict) -> None:
        """A hang or stall verdict on attempt ``a``: the blamed nodes failed (an agent that
        itself went silent is killed and its node replaced or its agent restarted)."""
        assert self.pool is not None
        a.failure_noticed = time.time()
        a.cause, a.failed_nodes = verdict.cause, list(verdict.slots)
        a.failed_node = verdict.slots[0]
        a.worker_exitcode = None
        for n in verdict.silent:
            self._agent_died(a, n)
        self._stop_nodes(a)
        for n in a.failed_nodes:
            if a.rcs[n] is None:
                a.rcs[n] = 1
        a.t_end = clock.now()
        a.survivors_stopped = a.survivors_stopped or a.t_end
        a.hang_detail = verdict.detail

    def _wait_preempted(self, a: Attempt) -> int | None:
        """After a notice: None while nodes still run within ``notice_grace_s``; then the
        attempt's status (75 when every node exited 75, ``a.preempted`` set), the stragglers
        SIGKILLed."""
        running = [i for i, rc in enumerate(a.rcs) if rc is None]
        if running and time.time() - (a.notice_at or 0.0) < self.notice_grace_s:
            return None
        if running:
            self._stop_nodes(a)
            for i in running:
                a.rcs[i] = a.procs[i].returncode if a.agent is None else 1
        a.t_end = clock.now()
        a.preempted = all(rc == PREEMPTED_EXIT for rc in a.rcs)
        if a.preempted:
            return PREEMPTED_EXIT
        bad = [i for i, rc in enumerate(a.rcs) if rc not in (0, PREEMPTED_EXIT)]
        if not bad:
            # some nodes finished, the others saved on the notice: requeue (the restart resumes
            # the saved step; a job that had finished everywhere would have exited 0 everywhere)
            a.preempted = not all(rc == 0 for rc in a.rcs)
            return PREEMPTED_EXIT if a.preempted else 0
        a.failed_node = bad[0]
        if a.agent is None:
            with contextlib.suppress(OSError):
                with open(a.logs[a.failed_node], errors="replace") as f:
                    a.worker_exitcode = root_cause_exitcode(f.read()[-20000:])
        return a.rcs[a.failed_node] or 1

    def failure_text(self, a: Attempt | None = None, chars: int = 4000) -> str:
        """The end of the failed node's log of attempt ``a`` (default: the last one)."""
        a = a or self.attempts[-1]
        node = a.failed_node if a.failed_node is not None else 0
        try:
            with open(a.logs[node], errors="replace") as f:
                tail = f.read()[-chars:]
        except OSError:
            tail = ""
        return f"--- {self.name} attempt {a.index + 1} node {node} exited {a.rcs[node]}; end of {a.logs[node]}:\n{tail}"


def _lose_node_monitor(spec: str | None, nodes: int):
    """The monitor of ``--lose-node NODE@SECONDS`` (None without it).

    Raises:
        ValueError: ``spec`` is not NODE@SECONDS with NODE in 0..nodes-1 and SECONDS >= 0.
    """
    if spec is None:
        return None
    m = re.fullmatch(r"(\d+)@(\d+(?:\.\d*)?)", spec.strip())
    if not m or int(m.group(1)) >= nodes:
        raise ValueError(f"--lose-node must be NODE@SECONDS with NODE in 0..{nodes - 1}, got {spec!r}")
    node, after = int(m.group(1)), float(m.group(2))
    done: list[bool] = []

    def monitor(launcher: LocalLauncher, a: Attempt) -> None:
        if not done and a.index == 0 and time.time() - a.t_start >= after:
            done.append(True)
            launcher.lose_node(node)

    return monitor


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="python launch/local.py", description=__doc__.split("\n\n")[0],
                                 usage="%(prog)s [options] -- -m MODULE|SCRIPT [args …]",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--nodes", type=int, default=2, help="simulated nodes (one torchrun each)")
    ap.add_argument("--nproc-per-node", type=int, default=1, help="ranks per node")
    ap.add_argument("--max-attempts", type=int, default=3, help="attempts before giving up")
    ap.add_argument("--log-dir", default=os.path.join(REPO, "outputs", "local-launch"), help="per-node logs")
    ap.add_argument("--name", default="job", help="log file prefix")
    ap.add_argument("--state-dir", default=None, help="keep the restart counter here across launcher runs")
    ap.add_argument("--timeout", type=float, default=None, help="seconds for the whole run")
    ap.add_argument("--kill-grace", type=float, default=5.0, help="seconds between SIGTERM and SIGKILL")
    ap.add_argument("--notice-grace", type=float, default=120.0,
                    help="seconds the nodes get to save and exit after a preemption notice (SIGTERM/SIGUSR1 to "
                         "this launcher, or a node exiting 75)")
    ap.add_argument("--min-nodes", type=int, default=None,
                    help=f"go on with at least this many nodes after one is lost for good (default ${MIN_NODES_ENV}, "
                         "else every node is needed)")
    ap.add_argument("--local-root", default=None,
                    help="the nodes' local-root directory with {node}: deleted for a lost node, renamed for a "
                         "survivor whose id changes")
    ap.add_argument("--cold", action="store_true",
                    help="one torchrun per node and attempt (new interpreters) instead of warm node agents")
    ap.add_argument("--spares", type=int, default=0,
                    help="idle nodes that take over the id of a node lost for good or killed for hanging")
    ap.add_argument("--preload", default=None,
                    help="comma-separated modules the node agents import before forking ranks (default: from the "
                         "command; e.g. torch, torchtitan and the plugin for -m titan_plugin.train)")
    ap.add_argument("--hang-timeout", type=float, default=10.0,
                    help="seconds after which a node whose agent or ranks stopped ticking is killed and restarted or "
                         "replaced (0: off)")
    ap.add_argument("--progress-timeout", type=float, default=0.0,
                    help="seconds without a new training step on any rank after which the attempt is restarted "
                         "(0: off; set it above the longest evaluation or final save)")
    ap.add_argument("--lose-node", default=None, metavar="NODE@SECONDS",
                    help="lose node NODE for good SECONDS after the first attempt starts (a trial of --min-nodes)")
    if "--" not in argv:
        ap.error("separate the training command with --, e.g. -- -m titan_plugin.train --toml FILE")
    i = argv.index("--")
    args, command = ap.parse_args(argv[:i]), argv[i + 1:]
    say = lambda s: print(f"[tierckpt local {time.strftime('%H:%M:%S')}] {s}", file=sys.stderr, flush=True)  # noqa: E731
    try:
        fit = titan_reconfigure(command, say) if command[:2] == ["-m", "titan_plugin.train"] else None
        launcher = LocalLauncher(command, nodes=args.nodes, nproc_per_node=args.nproc_per_node,
                                 max_attempts=args.max_attempts, log_dir=args.log_dir, name=args.name,
                                 state_dir=args.state_dir, kill_grace_s=args.kill_grace, min_nodes=args.min_nodes,
                                 local_root=args.local_root, reconfigure=fit, notice_grace_s=args.notice_grace,
                                 warm=not args.cold, spares=args.spares,
                                 preload=None if args.preload is None else [m for m in args.preload.split(",") if m],
                                 hang_timeout_s=args.hang_timeout, progress_timeout_s=args.progress_timeout)
        monitor = _lose_node_monitor(args.lose_node, args.nodes)
    except ValueError as e:
        ap.error(str(e))

    def on_notice(signum, frame):  # a preemption notice: forwarded, the nodes save, exit 75
        say(f"{signal.Signals(signum).name}: preemption notice, forwarding SIGTERM to every node")
        launcher.notice(signum)

    signal.signal(signal.SIGTERM, on_notice)
    signal.signal(signal.SIGUSR1, on_notice)
    say(f"logs: {args.log_dir}/{args.name}-attempt<k>-node<n>.log")
    try:
        rc = launcher.run(timeout=args.timeout, monitor=monitor, log=say)
    except LaunchError as e:
        say(str(e))
        return 124
    except KeyboardInterrupt:
        say("interrupted")
        return 130
    if rc not in (0, PREEMPTED_EXIT):
        print(launcher.failure_text(), file=sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(main())
