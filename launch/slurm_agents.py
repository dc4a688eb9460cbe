#!/usr/bin/env python
"""Warm node agents on Slurm: what ``launch/*.sbatch`` run with ``TIERCKPT_AGENTS=warm``.

    python launch/slurm_agents.py --hosts n1,n2,n3 --spares 1 --state-dir DIR \\
        [--nproc-per-node P] [--max-attempts A] [--min-nodes M] [--local-root ROOT/node-{node}] \\
        -- -m titan_plugin.train --toml FILE [--section.key value …]

The batch script runs this on the allocation's first host. It is launch/local.py's
:class:`LocalLauncher` (attempts, hang watch, spares, shrink, preemption, the recovery record)
with real hosts instead of simulated ones:

- **one srun step for the whole allocation** starts one node agent per host
  (``srun --nodes=N+S --ntasks-per-node=1 --kill-on-bad-exit=0 --no-kill python -m
  tierckpt.recovery.agent --connect THIS_HOST:PORT --hosts …``); each imports the trainer's
  modules once and forks every attempt's ranks, so a retry pays no interpreter start, no
  imports and no ``srun`` step creation; the agents connect back over TCP, authenticated by a
  per-job key in the environment (never on a command line);
- the first N hosts run the training (node id = position), the last S are **spares**: when a
  node's agent vanishes (its host died, or it was killed after hanging for ``--hang-timeout``
  seconds), the next spare takes over its node id at the next attempt and restores that node's
  shards from its peers' replicas; the world size stays the same;
- with no spare left, a vanished node is dropped when ``--min-nodes`` allows it (the survivors
  are renumbered, each agent renames its host's ``node-<old>`` local root to the new id before
  forking, and ``reconfigure`` refits the command), else its agent is started again on the
  same host (a restarted node keeps its disk); an agent that cannot start there ends the run
  with the host blamed, for the batch script to requeue the job without it;
- every attempt's start and end go to ``--state-dir/events`` in the batch script's format and
  the attempt counter is ``--state-dir/attempts`` (the same files the torchrun path keeps);
  ``--state-dir/warm-blamed`` lists the hosts to exclude after a failed run.

A node failure must not end the job: submit with ``sbatch --no-kill``. Exit status as
:meth:`LocalLauncher.run`: 0, 75 after a preemption notice every node saved on (SIGTERM or
SIGUSR1 to this process), 2 for a configuration error, else the failing node's status.
Nothing here initialises CUDA or NCCL: the agents check before every fork
(:func:`tierckpt.recovery.warm.fork_problems`).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:  # run as a script: launch/ (a namespace package) and tierckpt from the repository
    sys.path.insert(0, _REPO)

from launch import local  # noqa: E402 - after the path fix above

AgentPool, PoolError, LaunchError = local.AgentPool, local.PoolError, local.LaunchError


class SlurmAgentLauncher(local.LocalLauncher):
    """:class:`LocalLauncher` over the hosts of a Slurm allocation (see the module docstring).

    Args:
        command: the training command (what follows torchrun's options).
        hosts: the allocation's hosts in order; the last ``spares`` are spares.
        spares: hosts kept idle to take over a lost node's id (0 ≤ spares < len(hosts)).
        state_dir: the batch script's state directory (events, attempt counter, blamed hosts).
        local_root: the node-local root template with ``{node}`` (renamed on its host when a
            survivor's id changes after a shrink); None: nothing to carry.
        srun: the srun program (tests may pass a wrapper).
        agent_start_timeout_s: seconds a restarted agent gets to connect and import before its
            host is blamed.
        **kw: the remaining :class:`LocalLauncher` options (nproc_per_node, max_attempts,
            min_nodes, reconfigure, hang_timeout_s, progress_timeout_s, notice_grace_s, log_dir…).

    Raises:
        ValueError: no hosts, a host listed twice, ``spares`` outside 0..len(hosts)-1, or a
            :class:`LocalLauncher` option out of range.
    """

    def __init__(self, command: list[str], *, hosts: list[str], spares: int = 0, state_dir: str,
                 local_root: str | None = None, srun: str = "srun", agent_start_timeout_s: float = 180.0, **kw):
        if not hosts or len(set(hosts)) != len(hosts):
            raise ValueError(f"hosts must be distinct Slurm node names, got {hosts!r}")
        if isinstance(spares, bool) or not isinstance(spares, int) or not 0 <= spares < len(hosts):
            raise ValueError(f"spares must be an integer in 0..{len(hosts) - 1} (TIERCKPT_SPARES; the allocation "
                             f"has {len(hosts)} nodes), got {spares!r}")
        if local_root is not None and "{node}" not in local_root:
            raise ValueError(f"local_root must contain {{node}}, got {local_root!r}")
        super().__init__(command, nodes=len(hosts) - spares, spares=spares, warm=True, state_dir=state_dir,
                         local_root=None, **kw)
        self.hosts, self.srun = list(hosts), srun
        self.node_root = local_root
        self.agent_start_timeout_s = agent_start_timeout_s
        self._disk_id = {s: s for s in self.slots}  # slot -> node id its host's local root is named by
        self._steps: list[subprocess.Popen] = []  # srun steps of the agents (the first, then restarts)
        self.blamed: list[str] = []

    # -- agents --------------------------------------------------------------------------------
    def master_addr(self) -> str:
        return self.hosts[self.slots[0]]

    def describe(self, slot: int) -> str:
        return f"spare {self.hosts[slot]}" if slot >= self.initial_nodes else f"host {self.hosts[slot]}"

    def _srun_agents(self, hosts: list[str], log_name: str, extra: list[str]) -> None:
        assert self.pool is not None
        env = dict(os.environ)
        env.pop("TIERCKPT_NODE_ID", None)
        env.update(self.extra_env)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (local.REPO, env.get("PYTHONPATH")) if p)
        cmd = [self.srun, *extra, "--kill-on-bad-exit=0", "--no-kill", f"--nodes={len(hosts)}",
               f"--ntasks={len(hosts)}", "--ntasks-per-node=1", f"--nodelist={','.join(hosts)}",
               f"--output={os.path.join(self.log_dir, log_name)}",
               sys.executable, "-m", "tierckpt.recovery.agent", "--connect", self.pool.connect_arg,
               "--hosts", ",".join(self.hosts), "--preload", ",".join(self.preload)]
        # its own session: a signal to the batch script's group is ours to forward, not srun's
        # (srun answers SIGTERM by killing the agents, and with them the ranks' final save)
        self._steps.append(subprocess.Popen(cmd, env=self.pool.agent_env(env), cwd=self.cwd, stdin=subprocess.DEVNULL,
                                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                                            start_new_session=True))

    def _ensure_agents(self) -> None:
        if self.pool is not None:
            return
        me = os.environ.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]
        self.pool = AgentPool(bind=("0.0.0.0", 0), advertise=me)
        self._srun_agents(self.hosts, f"{self.name}-agent-%N.log", [])
        slots = [*self.slots, *self.spares]
        try:
            self.pool.wait_ready(slots, self.agent_ready_timeout_s)
        except PoolError as e:
            missing = [s for s in slots if self.pool.handles.get(s) is None or self.pool.handles[s].ready is None]
            self.blamed = [self.hosts[s] for s in missing]
            raise LaunchError(f"{e} (hosts {', '.join(self.blamed)}; agent logs: "
                              f"{os.path.join(self.log_dir, self.name + '-agent-<host>.log')})") from None

    def _launch_agent(self, slot: int) -> None:
        """Start ``slot``'s agent again on its host (a step of one task beside the others)."""
        assert self.pool is not None
        self._srun_agents([self.hosts[slot]], f"{self.name}-agent-%N-{len(self._steps)}.log", ["--overlap"])
        try:
            self.pool.wait_ready([slot], self.agent_start_timeout_s)
        except PoolError as e:
            self.blamed.append(self.hosts[slot])
            raise LaunchError(f"the agent of {self.hosts[slot]} did not start again: {e}") from None

    def _agent_died(self, a, node: int) -> None:
        """``node``'s agent hung or vanished: its processes on that host are killed (best
        effort: the host may be gone); a spare takes over its id, else the node is dropped
        when ``min_nodes`` allows it, else its agent is started again on the same host."""
        assert self.pool is not None
        slot = a.slots[node]
        self._kill_remote(slot)
        if self.spares or self.nodes - 1 < self.min_nodes:
            super()._agent_died(a, node)
            return
        self.pool.terminate(slot)
        a.restarted_agents.add(node)
        if node not in a.failed_nodes:
            a.failed_nodes.append(node)
        self.slots.remove(slot)
        self.lost.append(slot)
        a.lost.append(slot)
        self.nodes = len(self.slots)

    def _kill_remote(self, slot: int) -> None:
        """SIGKILL a hung agent and its ranks' process groups on their host (srun with
        ``--overlap``, in the background: a dead host never answers)."""
        h = self.pool.handles.get(slot) if self.pool is not None else None
        if h is None or h.pid is None:  # never connected: nothing of ours runs there
            return
        targets = [str(h.pid), *(f"-{p}" for p in h.pids)]
        with contextlib.suppress(OSError):
            self._steps.append(subprocess.Popen(
                [self.srun, "--overlap", "--nodes=1", "--ntasks=1", f"--nodelist={self.hosts[slot]}",
                 "--kill-on-bad-exit=0", "kill", "-KILL", "--", *targets],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                start_new_session=True))

    def _take_spare(self, node: int, a) -> None:
        super()._take_spare(node, a)
        self._disk_id[self.slots[node]] = node  # the spare's disk: it names its root by this id

    # -- disks ---------------------------------------------------------------------------------
    def _relocate_disks(self) -> None:
        """A survivor whose id changed renames its host's local root (in its agent, before the
        ranks start): no other host can see that disk."""
        for new_id, slot in enumerate(self.slots):
            old_id = self._disk_id.get(slot, new_id)
            if old_id != new_id and self.node_root is not None:
                self._moves.setdefault(new_id, []).append(
                    (self.node_root.format(node=old_id), self.node_root.format(node=new_id)))
            self._disk_id[slot] = new_id

    # -- records -------------------------------------------------------------------------------
    def _event(self, text: str) -> None:
        assert self.state_dir is not None
        with open(os.path.join(self.state_dir, "events"), "a") as f:
            f.write(f"{int(time.time())} {text}\n")

    def _start(self, extra_args: list[str]):
        a = super()._start(extra_args)
        hosts = ",".join(self.hosts[s] for s in a.slots)
        replaced = ",".join(f"{n}:{self.hosts[s]}" for n, s in sorted(a.replaced.items())) or "-"
        self._event(f"start attempt={a.index + 1} restart_count={a.restart_count} port={a.port} nodes={hosts} "
                    f"slurm_restart={os.environ.get('SLURM_RESTART_COUNT', '0')} agents=warm replaced={replaced}")
        return a

    def _wait(self, a, deadline, monitor) -> int:
        rc = super()._wait(a, deadline, monitor)
        failed = ",".join(self.hosts[a.slots[n]] for n in a.failed_nodes) or "-"
        extra = " preempted=notice" if a.preempted else ""
        self._event(f"end attempt={a.index + 1} rc={rc} failed_nodes={failed} cause={a.cause or '-'}{extra}")
        return rc

    def close_steps(self) -> None:
        """End the agents' srun steps (after :meth:`run` told the agents to exit)."""
        deadline = time.time() + 10.0
        for p in self._steps:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=max(0.1, deadline - time.time()))
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGTERM)  # srun: end the step
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(timeout=10)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="python launch/slurm_agents.py", description=__doc__.split("\n\n")[0],
                                 usage="%(prog)s --hosts H1,H2,… --state-dir DIR [options] -- -m MODULE [args …]",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--hosts", required=True, help="the allocation's hosts, comma-separated, in order")
    ap.add_argument("--spares", type=int, default=0, help="the last SPARES hosts are spares (TIERCKPT_SPARES)")
    ap.add_argument("--state-dir", required=True, help="the batch script's state directory")
    ap.add_argument("--nproc-per-node", type=int, default=1, help="ranks per node")
    ap.add_argument("--max-attempts", type=int, default=3, help="attempts in this allocation")
    ap.add_argument("--min-nodes", type=int, default=None, help="fewest nodes to go on with (TIERCKPT_MIN_NODES)")
    ap.add_argument("--local-root", default=None, help="node-local root with {node}")
    ap.add_argument("--hang-timeout", type=float, default=10.0, help="seconds of silence before a node is hung (0: off)")
    ap.add_argument("--progress-timeout", type=float, default=0.0, help="seconds without a new step (0: off)")
    ap.add_argument("--notice-grace", type=float, default=120.0, help="seconds to save and exit after a notice")
    ap.add_argument("--preload", default=None, help="modules the agents import (default: from the command)")
    ap.add_argument("--name", default="warm", help="log file prefix")
    if "--" not in argv:
        ap.error("separate the training command with --, e.g. -- -m titan_plugin.train --toml FILE")
    i = argv.index("--")
    args, command = ap.parse_args(argv[:i]), argv[i + 1:]
    say = lambda s: print(f"[tierckpt warm {time.strftime('%F %T')}] {s}", file=sys.stderr, flush=True)  # noqa: E731
    hosts = [h for h in args.hosts.split(",") if h]
    try:
        fit = local.titan_reconfigure(command, say) if command[:2] == ["-m", "titan_plugin.train"] else None
        launcher = SlurmAgentLauncher(
            command, hosts=hosts, spares=args.spares, state_dir=args.state_dir, local_root=args.local_root,
            nproc_per_node=args.nproc_per_node, max_attempts=args.max_attempts, min_nodes=args.min_nodes,
            reconfigure=fit, hang_timeout_s=args.hang_timeout, progress_timeout_s=args.progress_timeout,
            notice_grace_s=args.notice_grace, name=args.name, log_dir=os.path.join(args.state_dir, "warm"),
            preload=None if args.preload is None else [m for m in args.preload.split(",") if m])
    except ValueError as e:
        ap.error(str(e))

    def on_notice(signum, frame):
        say(f"{signal.Signals(signum).name}: preemption notice, forwarded to every node's ranks")
        launcher.notice(signum)

    signal.signal(signal.SIGTERM, on_notice)
    signal.signal(signal.SIGUSR1, on_notice)
    say(f"{len(hosts) - args.spares} nodes ({','.join(hosts[:len(hosts) - args.spares])}), spares "
        f"{','.join(hosts[len(hosts) - args.spares:]) or '-'}; logs: {launcher.log_dir}")
    try:
        rc = launcher.run(log=say)
    except LaunchError as e:
        say(str(e))
        rc = 1
    finally:
        launcher.close_steps()
    blamed = sorted(set(launcher.blamed) | {launcher.hosts[s] for s in launcher.lost})
    with open(os.path.join(args.state_dir, "warm-blamed"), "w") as f:
        f.write(" ".join(blamed) + "\n")
    if rc not in (0, local.PREEMPTED_EXIT) and launcher.attempts:
        print(launcher.failure_text(), file=sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(main())
