#!/usr/bin/env python
"""The local launcher: what ``launch/*.sbatch`` do on a cluster, on one machine.

    python launch/local.py --nodes 2 [--nproc-per-node 1] [--max-attempts 3] [--log-dir DIR] \\
        -- -m titan_plugin.train --toml configs/titan_demo.toml [--section.key value …]

Same semantics as the sbatch scripts (see launch/README.md):

- one ``torchrun`` per simulated node (``python -m torch.distributed.run --nnodes N
  --node-rank i --nproc-per-node P --master-addr 127.0.0.1 --master-port PORT
  --max-restarts 0 <command>``) with a static rendezvous; every node's ranks get torchrun's
  GROUP_RANK, which tierckpt takes as the node id;
- a bounded retry loop: when one node's torchrun exits non-zero, the others are stopped
  (SIGTERM, SIGKILL after ``--kill-grace`` seconds; ``srun --kill-on-bad-exit=1``) and the job
  is started again, on a fresh port, up to ``--max-attempts`` times; a worker that exited with
  status 2 (invalid configuration) is not retried;
- ``TIERCKPT_RESTART_COUNT`` = attempts launched before this one (counted across launcher
  runs in ``--state-dir/attempts`` when given), which the engine writes into the ledger's
  ``run_start``; a failed attempt's run has no clean ``run_end`` there.

Nothing is requeued (there is no allocation to lose). The command's output goes to one log
per node and attempt (``<log-dir>/<name>-attempt<k>-node<n>.log``). Exit status: 0 when an
attempt succeeded, else the failing node's torchrun status (2 for a configuration error).
:class:`LocalLauncher` is the Python API (``launch/local_demo.py`` uses it to kill a node's
training process mid-run).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG_ERROR = 2  # exit status of titan_plugin.train / the mcore launcher on an invalid configuration


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

    Raises:
        ValueError: a count < 1 or an empty command.
    """

    def __init__(self, command: list[str], *, nodes: int, nproc_per_node: int = 1, max_attempts: int = 3,
                 log_dir: str, name: str = "job", env: dict[str, str] | None = None,
                 state_dir: str | None = None, kill_grace_s: float = 5.0, cwd: str = REPO):
        for opt, v in (("nodes", nodes), ("nproc_per_node", nproc_per_node), ("max_attempts", max_attempts)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{opt} must be an integer >= 1, got {v!r}")
        if not command:
            raise ValueError("command must not be empty (e.g. ['-m', 'titan_plugin.train', '--toml', FILE])")
        self.command = list(command)
        self.nodes, self.nproc_per_node, self.max_attempts = nodes, nproc_per_node, max_attempts
        self.log_dir, self.name, self.cwd = log_dir, name, cwd
        self.extra_env = dict(env or {})
        self.state_dir = state_dir
        self.kill_grace_s = kill_grace_s
        self.attempts: list[Attempt] = []
        os.makedirs(log_dir, exist_ok=True)

    # -- commands ------------------------------------------------------------------------------
    def node_command(self, node: int, port: int) -> list[str]:
        """The command line of ``node``'s torchrun."""
        return [sys.executable, "-m", "torch.distributed.run", f"--nnodes={self.nodes}", f"--node-rank={node}",
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

    def _start(self) -> Attempt:
        used = {a.port for a in self.attempts}
        port = free_port()
        while port in used:  # a fresh port per attempt, as on Slurm
            port = free_port()
        a = Attempt(index=len(self.attempts), restart_count=self._next_restart_count(), port=port)
        env = dict(os.environ)
        env.pop("TIERCKPT_NODE_ID", None)  # one value cannot be right for every node: use GROUP_RANK
        env.update(self.extra_env)
        env["TIERCKPT_RESTART_COUNT"] = str(a.restart_count)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p)
        a.t_start = time.time()
        self.attempts.append(a)
        for node in range(self.nodes):
            path = os.path.join(self.log_dir, f"{self.name}-attempt{a.index + 1}-node{node}.log")
            a.logs.append(path)
            with open(path, "w") as logf:
                a.procs.append(subprocess.Popen(self.node_command(node, port), env=env, cwd=self.cwd, stdout=logf,
                                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                                start_new_session=True, preexec_fn=_term_with_parent))
        a.rcs = [None] * self.nodes
        return a

    # -- processes -----------------------------------------------------------------------------
    def workers(self, node: int) -> list[int]:
        """PIDs of the training processes (torchrun's children) of ``node`` in the current attempt."""
        if not self.attempts:
            return []
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
        after the grace period, the workers included."""
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

    def stop(self) -> None:
        """Stop every process of the current attempt (idempotent)."""
        if self.attempts:
            self._stop_nodes(self.attempts[-1])

    kill_all = stop  # the name local_demo's cleanup calls

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
            worker reported an invalid configuration).

        Raises:
            LaunchError: the timeout passed (every process stopped).
        """
        say = log or (lambda s: None)
        deadline = None if timeout is None else time.time() + timeout
        try:
            while True:
                a = self._start()
                say(f"attempt {a.index + 1}/{self.max_attempts} (restart count {a.restart_count}), "
                    f"{self.nodes} nodes x {self.nproc_per_node} ranks, MASTER_PORT={a.port}")
                rc = self._wait(a, deadline, monitor)
                if rc == 0:
                    say(f"attempt {a.index + 1} finished")
                    return 0
                code = a.worker_exitcode
                say(f"attempt {a.index + 1} failed: node {a.failed_node} exited {rc}"
                    + (f" (worker {'killed by signal ' + str(-code) if code < 0 else 'exit ' + str(code)})"
                       if code is not None else ""))
                if code == CONFIG_ERROR:
                    say("invalid configuration: not retrying")
                    return CONFIG_ERROR
                if a.index + 1 >= self.max_attempts:
                    say(f"giving up after {self.max_attempts} attempts")
                    return rc
        finally:
            self.stop()

    def _wait(self, a: Attempt, deadline: float | None, monitor) -> int:
        while True:
            if monitor is not None:
                monitor(self, a)
            for i, p in enumerate(a.procs):
                a.rcs[i] = p.poll()
            bad = [i for i, rc in enumerate(a.rcs) if rc not in (None, 0)]
            if bad:
                a.failed_node = bad[0]
                self._stop_nodes(a)  # srun --kill-on-bad-exit=1
                a.t_end = time.time()
                with contextlib.suppress(OSError):
                    with open(a.logs[a.failed_node], errors="replace") as f:
                        a.worker_exitcode = root_cause_exitcode(f.read()[-20000:])
                return a.rcs[a.failed_node]
            if all(rc == 0 for rc in a.rcs):
                a.t_end = time.time()
                return 0
            if deadline is not None and time.time() > deadline:
                self._stop_nodes(a)
                raise LaunchError(f"{self.name}: not finished within the timeout (attempt {a.index + 1}); "
                                  f"logs: {a.logs}")
            time.sleep(0.05)

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
    if "--" not in argv:
        ap.error("separate the training command with --, e.g. -- -m titan_plugin.train --toml FILE")
    i = argv.index("--")
    args, command = ap.parse_args(argv[:i]), argv[i + 1:]
    try:
        launcher = LocalLauncher(command, nodes=args.nodes, nproc_per_node=args.nproc_per_node,
                                 max_attempts=args.max_attempts, log_dir=args.log_dir, name=args.name,
                                 state_dir=args.state_dir, kill_grace_s=args.kill_grace)
    except ValueError as e:
        ap.error(str(e))

    def on_term(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    say = lambda s: print(f"[tierckpt local {time.strftime('%H:%M:%S')}] {s}", file=sys.stderr, flush=True)  # noqa: E731
    say(f"logs: {args.log_dir}/{args.name}-attempt<k>-node<n>.log")
    try:
        rc = launcher.run(timeout=args.timeout, log=say)
    except LaunchError as e:
        say(str(e))
        return 124
    except KeyboardInterrupt:
        say("interrupted")
        return 130
    if rc != 0:
        print(launcher.failure_text(), file=sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(main())
