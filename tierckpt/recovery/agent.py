"""The node agent: one long-lived process per node that starts, watches and stops its ranks.

    python -m tierckpt.recovery.agent --connect HOST:PORT (--slot S | --hosts H1,H2,…) [--preload mod,…] [--cold]

(``$TIERCKPT_AGENT_KEY``: the launcher's shared secret, hex.) A launcher
(:class:`tierckpt.recovery.pool.AgentPool`; ``launch/local.py`` starts one agent per simulated
node) keeps one agent per node for the whole allocation, spares included. The agent:

1. connects to the launcher (``hello``: its pid and host), imports the trainer's modules once
   (:func:`tierckpt.recovery.warm.preload`), then says ``ready``;
2. for each attempt (``start``), forks one child per rank from its warm interpreter
   (:func:`tierckpt.recovery.warm.spawn`) — or, when forking is unsafe
   (:func:`~tierckpt.recovery.warm.fork_problems`) or ``--cold`` was given, execs a new
   interpreter per rank as torchrun does — each in its own process group, with a beacon
   (:mod:`tierckpt.recovery.beacon`) and a fresh ``$TIERCKPT_PREEMPTED_DIR``;
3. reports every rank's exit (``exit``: status as :attr:`subprocess.Popen.returncode`, negative
   for a signal) and, every ``BEAT_S``, a ``beat`` with each rank's beacon (seconds since it
   last ticked, the last step reported);
4. forwards ``signal`` requests (a preemption notice) to its ranks' process groups, and ``kill``s
   them (SIGKILL to each group: a failed attempt's survivors hold no state worth a grace
   period — the next attempt restores from the tiers; a torn save is never visible);
5. forwards a preemption signal it receives itself (Slurm signals every task of a step) to its
   ranks and tells the launcher (``notice``);
6. exits when told to (``exit``), when the launcher's connection closes, or on SIGKILL — its
   ranks' process groups are killed first in the first two cases; on SIGKILL each rank dies
   with it (``PR_SET_PDEATHSIG``) and the launcher kills the ranks' groups, their DataLoader
   workers included (:meth:`tierckpt.recovery.pool.AgentPool.terminate`), and removes the
   agent's beacon directory (``ready`` names it).

The protocol is pickled dicts over :mod:`multiprocessing.connection` (HMAC-authenticated with
the key): trusted processes of one job only.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Client, Connection, wait

from tierckpt import clock
from tierckpt.preemption import PREEMPTED_DIR_ENV, PREEMPTED_EXIT, all_local_ranks_preempted
from tierckpt.recovery import beacon, warm

KEY_ENV = "TIERCKPT_AGENT_KEY"
BEAT_S = 0.5  # seconds between two beats sent to the launcher
_NOTICE_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


def _die_with_agent() -> None:  # pragma: no cover - runs in a cold child between fork and exec
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # the agent ignores it; an ignored signal survives exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 - not Linux: the launcher's kill still reaches the group
        pass


@dataclass
class _Rank:
    local_rank: int
    pid: int
    beacon: beacon.BeaconReader | None
    popen: subprocess.Popen | None = None  # cold ranks
    status: int | None = None


@dataclass
class _Attempt:
    index: int
    ranks: list[_Rank] = field(default_factory=list)
    marks: str = ""
    warm: bool = True

    def live(self) -> list[_Rank]:
        return [r for r in self.ranks if r.status is None]


class Agent:
    """One node's agent (see the module docstring).

    Args:
        conn: the authenticated connection to the launcher.
        slot: this agent's slot (the simulated host, or the Slurm node index) in the launcher.
        cold: never fork ranks; exec a new interpreter for each (torchrun's behaviour).
        beacon_dir: where the ranks' beacon files go (default: a temporary directory in
            /dev/shm when it exists).
    """

    def __init__(self, conn: Connection, slot: int, *, cold: bool = False, beacon_dir: str | None = None):
        self.conn, self.slot, self.cold = conn, slot, cold
        base = beacon_dir or ("/dev/shm" if os.path.isdir("/dev/shm") else None)
        self.dir = tempfile.mkdtemp(prefix=f"tierckpt-agent{slot}-", dir=base)
        self.attempt: _Attempt | None = None
        self._notice: int | None = None
        self._next_beat = 0.0

    # -- signals -------------------------------------------------------------------------------
    def install_signals(self) -> None:
        """A preemption signal to the agent is forwarded to its ranks and reported."""
        def on_notice(signum, frame):
            self._notice = signum

        for s in _NOTICE_SIGNALS:
            signal.signal(s, on_notice)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the launcher, which stops us

    # -- ranks ---------------------------------------------------------------------------------
    @staticmethod
    def move(src: str, dst: str) -> str:
        """Rename directory ``src`` to ``dst`` on this host (a survivor's node-local root that
        follows its new node id after a shrink); returns what was done, for the rank log.

        A ``dst`` that exists is another run's or a lost node's leftover on this disk (ids only
        go down, so a survivor never moves into a live one): it is set aside as
        ``<dst>.stale-<UNIX seconds>``, never deleted. No ``src``: nothing to carry.
        """
        if not os.path.isdir(src):
            return f"no {src} to move to {dst}"
        note = ""
        if os.path.lexists(dst):
            aside = f"{dst}.stale-{int(time.time())}"
            os.rename(dst, aside)
            note = f"; {dst} set aside as {aside}"
        os.rename(src, dst)
        return f"moved {src} to {dst}{note}"

    def start(self, msg: dict) -> None:
        """Start the ranks of attempt ``msg["attempt"]`` (``msg["ranks"]``: RankSpec fields),
        after the renames ``msg["moves"]`` (:meth:`move`)."""
        if self.attempt is not None and self.attempt.live():
            self.kill(self.attempt.index, report=False)
        moved = []
        for src, dst in msg.get("moves", ()):
            try:
                moved.append(self.move(src, dst))
            except OSError as e:  # the ranks start anyway: they restore from the replicas
                moved.append(f"could not move {src} to {dst}: {e}")
        if moved and msg.get("ranks"):
            with contextlib.suppress(OSError), open(msg["ranks"][0]["log"], "a") as f:
                f.write("".join(f"[tierckpt agent {self.slot}] {m}\n" for m in moved))
        index = int(msg["attempt"])
        a = _Attempt(index=index, marks=tempfile.mkdtemp(prefix=f"a{index}-marks-", dir=self.dir))
        problems = [] if self.cold else warm.fork_problems()
        a.warm = not self.cold and not problems
        for lr, raw in enumerate(msg["ranks"]):
            path = os.path.join(self.dir, f"a{index}-r{lr}.beacon")
            beacon.create(path)
            env = dict(raw["env"])
            env[beacon.BEACON_ENV] = path
            env[PREEMPTED_DIR_ENV] = a.marks
            spec = warm.RankSpec(argv=tuple(raw["argv"]), env=env, log=raw["log"], cwd=raw["cwd"])
            if a.warm:
                pid, popen = warm.spawn(spec, close_fds=[self.conn.fileno()]), None
            else:
                popen = self._exec(spec)
                pid = popen.pid
            a.ranks.append(_Rank(local_rank=lr, pid=pid, beacon=beacon.BeaconReader(path), popen=popen))
        self.attempt = a
        self._send({"ev": "started", "attempt": index, "pids": [r.pid for r in a.ranks], "warm": a.warm,
                    "problems": problems, "t": clock.now()})

    @staticmethod
    def _exec(spec: warm.RankSpec) -> subprocess.Popen:
        env = dict(spec.env)
        env[warm.PROCESS_STARTED_ENV] = repr(clock.now())
        with open(spec.log, "ab") as log:
            return subprocess.Popen([sys.executable, "-m", "tierckpt.recovery.child", *spec.argv], env=env,
                                    cwd=spec.cwd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True, preexec_fn=_die_with_agent)

    def signal_ranks(self, index: int, sig: int) -> None:
        """Send ``sig`` to every live rank's process group of attempt ``index``."""
        a = self.attempt
        if a is None or a.index != index:
            return
        for r in a.live():
            try:
                os.killpg(r.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass

    def kill(self, index: int, report: bool = True) -> None:
        """SIGKILL attempt ``index``'s ranks (their process groups) and reap them."""
        a = self.attempt
        if a is not None and a.index == index:
            self.signal_ranks(index, signal.SIGKILL)
            deadline = time.monotonic() + 30.0
            while a.live() and time.monotonic() < deadline:
                self.reap()
                if a.live():
                    time.sleep(0.01)
        if report:
            self._send({"ev": "killed", "attempt": index, "t": clock.now()})

    def reap(self) -> None:
        """Collect the exit of every rank that ended; report each, and the attempt's end."""
        a = self.attempt
        if a is None:
            return
        for r in a.live():
            if r.popen is not None:
                code = r.popen.poll()
            else:
                try:
                    pid, status = os.waitpid(r.pid, os.WNOHANG)
                except ChildProcessError:
                    pid, status = r.pid, 255 << 8
                code = os.waitstatus_to_exitcode(status) if pid == r.pid else None
            if code is None:
                continue
            r.status = code
            # the group may keep the rank's children (loader workers) alive: they go with it
            try:
                os.killpg(r.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            self._send({"ev": "exit", "attempt": a.index, "local_rank": r.local_rank, "status": code,
                        "t": clock.now()})
            if not a.live():
                preempted = all_local_ranks_preempted(a.marks)
                self._send({"ev": "ended", "attempt": a.index, "statuses": [x.status for x in a.ranks],
                            "preempted": preempted or all(x.status == PREEMPTED_EXIT for x in a.ranks),
                            "t": clock.now()})

    def beat(self) -> None:
        """Send a ``beat``: per live rank, seconds since its beacon ticked and its last step."""
        a = self.attempt
        ranks = []
        if a is not None:
            for r in a.ranks:
                if r.status is None and r.beacon is not None:
                    b = r.beacon.read()
                    ranks.append({"local_rank": r.local_rank, "alive_age_s": b.alive_age_s, "step": b.step,
                                  "progress_at": b.progress_at})
        self._send({"ev": "beat", "attempt": None if a is None else a.index, "ranks": ranks, "t": clock.now()})

    # -- the loop ------------------------------------------------------------------------------
    def _send(self, msg: dict) -> None:
        msg["slot"] = self.slot
        self.conn.send(msg)

    def handle(self, msg: dict) -> bool:
        """Carry out one request; False for ``exit``."""
        op = msg.get("op")
        if op == "start":
            self.start(msg)
        elif op == "signal":
            self.signal_ranks(int(msg["attempt"]), int(msg["sig"]))
        elif op == "kill":
            self.kill(int(msg["attempt"]))
        elif op == "preload":
            self._send({"ev": "preloaded", **_preloaded(warm.preload(list(msg["modules"])), self.dir)})
        elif op == "exit":
            return False
        return True

    def run(self) -> int:
        """Serve the launcher until ``exit`` or until its connection closes; returns 0."""
        try:
            while True:
                if self._notice is not None:
                    sig, self._notice = self._notice, None
                    if self.attempt is not None:
                        self.signal_ranks(self.attempt.index, signal.SIGTERM)
                    self._send({"ev": "notice", "sig": int(sig), "t": clock.now()})
                if wait([self.conn], timeout=0.05):
                    try:
                        msg = self.conn.recv()
                    except (EOFError, OSError):
                        return 0
                    if not self.handle(msg):
                        return 0
                self.reap()
                if time.monotonic() >= self._next_beat:
                    self._next_beat = time.monotonic() + BEAT_S
                    self.beat()
        except (BrokenPipeError, ConnectionResetError, EOFError):
            return 0
        finally:
            if self.attempt is not None:
                self.signal_ranks(self.attempt.index, signal.SIGKILL)
            shutil.rmtree(self.dir, ignore_errors=True)


def _preloaded(p: warm.Preloaded, folder: str) -> dict:
    return {"preload_s": p.seconds, "modules": p.modules, "failed": p.failed, "problems": warm.fork_problems(),
            "dir": folder}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tierckpt.recovery.agent", description=__doc__.split("\n\n")[0])
    ap.add_argument("--connect", required=True, metavar="HOST:PORT", help="the launcher's address")
    which = ap.add_mutually_exclusive_group(required=True)
    which.add_argument("--slot", type=int, help="this node's slot in the launcher")
    which.add_argument("--hosts", metavar="H1,H2,…",
                       help="the allocation's hosts in slot order: the slot is this host's position "
                            "($SLURMD_NODENAME, else the short host name), as in one srun step over every node")
    ap.add_argument("--preload", default="", help="comma-separated modules to import before forking ranks")
    ap.add_argument("--cold", action="store_true", help="exec every rank (no warm fork)")
    args = ap.parse_args(argv)
    host, _, port = args.connect.rpartition(":")
    key = bytes.fromhex(os.environ.get(KEY_ENV, ""))
    if not host or not port.isdigit() or not key:
        print(f"tierckpt agent: error: --connect HOST:PORT and ${KEY_ENV} (hex) are needed", file=sys.stderr)
        return 2
    slot = args.slot
    if args.hosts is not None:
        me = os.environ.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]
        hosts = [h.strip() for h in args.hosts.split(",")]
        if me not in hosts:
            print(f"tierckpt agent: error: this host ({me}) is not in --hosts {args.hosts}", file=sys.stderr)
            return 2
        slot = hosts.index(me)
    conn = Client((host, int(port)), authkey=key)
    agent = Agent(conn, slot, cold=args.cold)
    agent.install_signals()
    agent._send({"ev": "hello", "pid": os.getpid(), "host": socket.gethostname(), "t": clock.now()})
    names = [] if args.cold else [m.strip() for m in args.preload.split(",") if m.strip()]
    agent._send({"ev": "ready", **_preloaded(warm.preload(names), agent.dir), "t": clock.now()})
    return agent.run()


if __name__ == "__main__":
    sys.exit(main())
