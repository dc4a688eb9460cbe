"""The launcher's side of the node agents: start them, talk to them, tell a hung node.

:class:`AgentPool` listens on a TCP address (HMAC-authenticated :mod:`multiprocessing.
connection`), starts local agents (``launch/local.py`` simulates nodes on one machine) or
accepts remote ones (``python -m tierckpt.recovery.agent --connect HOST:PORT --slot S`` run
on each node by the cluster's launcher), and keeps one :class:`AgentHandle` per slot: what
the agent said last, the ranks of the attempt it runs, their exit statuses and beacons.

:class:`HangWatch` turns the agents' beats into a verdict (:meth:`HangWatch.check`): a node
whose agent went silent, or one of whose ranks stopped ticking, for ``hang_timeout_s`` is hung
(SIGSTOP, a frozen host, a process stuck in the kernel); a job in which no rank reported a new
step for ``progress_timeout_s`` (once one did) is stalled (a deadlocked collective, a data
loader blocked on a hung disk) and the nodes furthest behind are blamed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import secrets
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge, wait

from tierckpt import clock
from tierckpt.recovery.agent import KEY_ENV

log = logging.getLogger(__name__)

HANDSHAKE_S = 10.0  # seconds a connecting agent gets to complete the HMAC handshake


class PoolError(RuntimeError):
    """The agents could not be started or reached (the message names the slots and where their
    logs are)."""


@dataclass
class AgentHandle:
    """The launcher's view of one agent.

    Attributes:
        slot: the agent's slot.
        proc: the agent's process when this launcher started it (None: a remote agent).
        log: the agent's own log file (local agents).
        conn: the connection (None until it said hello, or after it closed).
        hello: its ``hello`` (pid, host).
        ready: its ``ready`` (preload_s, modules, failed, problems): it can start ranks.
        last_heard: ``time.monotonic()`` of its last message.
        attempt: the attempt it runs ranks of (None: idle).
        pids: those ranks' pids, by local rank.
        warm: whether those ranks were forked warm.
        started_at: UNIX seconds it reported the ranks started.
        statuses: {local rank: exit status} of the ranks that ended.
        ended: the attempt's ``ended`` event (statuses, preempted), once every rank ended.
        beat: its last ``beat``.
        killed_at: UNIX seconds it confirmed a ``kill`` of the attempt.
        dead: the agent is gone (its connection closed or it was terminated).
    """

    slot: int
    proc: subprocess.Popen | None = None
    log: str | None = None
    conn: Connection | None = None
    hello: dict | None = None
    ready: dict | None = None
    last_heard: float = 0.0
    attempt: int | None = None
    pids: list[int] = field(default_factory=list)
    warm: bool = False
    started_at: float | None = None
    statuses: dict[int, int] = field(default_factory=dict)
    ended: dict | None = None
    beat: dict | None = None
    killed_at: float | None = None
    dead: bool = False

    @property
    def pid(self) -> int | None:
        """The agent's pid (from its hello, or the process this launcher started)."""
        if self.hello is not None:
            return int(self.hello["pid"])
        return None if self.proc is None else self.proc.pid

    def running(self, attempt: int) -> bool:
        """Whether ranks of ``attempt`` still run here."""
        return self.attempt == attempt and not self.dead and self.ended is None


class AgentPool:
    """Agents of one job (see the module docstring).

    Args:
        bind: address to listen on (default: the loopback, an ephemeral port).
        advertise: host name agents connect to (default: the bound host).

    Raises:
        OSError: the address cannot be bound.
    """

    def __init__(self, bind: tuple[str, int] = ("127.0.0.1", 0), advertise: str | None = None):
        self.key = secrets.token_bytes(32)
        self._sock = socket.create_server(bind)
        host, port = self._sock.getsockname()[:2]
        self.address = (advertise or host, port)
        self.handles: dict[int, AgentHandle] = {}
        self._incoming: queue.Queue = queue.Queue()
        self._pending: list[Connection] = []
        self._closing = False
        self._acceptor = threading.Thread(target=self._accept, name="tierckpt-agent-accept", daemon=True)
        self._acceptor.start()

    def _accept(self) -> None:
        """Accept connections; each one's HMAC handshake runs on a thread of its own, so a
        client that never answers (or fails it) holds up nobody."""
        while not self._closing:
            try:
                raw, _ = self._sock.accept()
            except OSError:
                if self._closing:
                    return
                continue
            threading.Thread(target=self._handshake, args=(raw,), name="tierckpt-agent-handshake",
                             daemon=True).start()

    def _handshake(self, raw: socket.socket) -> None:
        # a kernel receive timeout, not settimeout(): that would make the descriptor non-blocking
        raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", int(HANDSHAKE_S), 0))
        conn = Connection(raw.detach())
        try:  # what multiprocessing.connection.Listener.accept() does with an authkey
            deliver_challenge(conn, self.key)
            answer_challenge(conn, self.key)
        except (OSError, EOFError, AuthenticationError):
            conn.close()  # a stranger without the key, or one that went away: keep serving the others
            return
        raw2 = socket.socket(fileno=os.dup(conn.fileno()))  # the agent may be quiet for long: no timeout now
        raw2.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", 0, 0))
        raw2.close()
        self._incoming.put(conn)

    @property
    def connect_arg(self) -> str:
        """``HOST:PORT`` for ``--connect``."""
        return f"{self.address[0]}:{self.address[1]}"

    def agent_env(self, env: dict[str, str] | None = None) -> dict[str, str]:
        """``env`` (default: this process's) plus the shared key, for an agent's process."""
        out = dict(os.environ if env is None else env)
        out[KEY_ENV] = self.key.hex()
        return out

    def launch_local(self, slot: int, *, preload: list[str], env: dict[str, str], log_path: str,
                     cwd: str, cold: bool = False, preexec_fn=None) -> AgentHandle:
        """Start the agent of ``slot`` on this machine (a simulated node), in its own session.

        Raises:
            ValueError: ``slot`` already has an agent that is not dead.
        """
        h = self.handles.get(slot)
        if h is not None and not h.dead:
            raise ValueError(f"slot {slot} already has an agent (pid {h.pid})")
        cmd = [sys.executable, "-m", "tierckpt.recovery.agent", "--connect", self.connect_arg, "--slot", str(slot),
               "--preload", ",".join(preload)] + (["--cold"] if cold else [])
        with open(log_path, "ab") as logf:
            proc = subprocess.Popen(cmd, env=self.agent_env(env), cwd=cwd, stdout=logf, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=preexec_fn)
        h = AgentHandle(slot=slot, proc=proc, log=log_path, last_heard=time.monotonic())
        self.handles[slot] = h
        return h

    def wait_ready(self, slots: list[int], timeout: float) -> None:
        """Block until every agent of ``slots`` is ready (connected, modules imported).

        Raises:
            PoolError: an agent exited or did not say hello within ``timeout`` seconds (its
                log's tail is in the message).
        """
        deadline = time.monotonic() + timeout
        while True:
            self.poll(0.05)
            missing = [s for s in slots if self.handles.get(s) is None or self.handles[s].ready is None]
            if not missing:
                return
            for s in missing:
                h = self.handles.get(s)
                if h is not None and h.proc is not None and h.proc.poll() is not None:
                    raise PoolError(f"the agent of slot {s} exited with status {h.proc.returncode} before it was "
                                    f"ready{self._tail(h)}")
            if time.monotonic() > deadline:
                raise PoolError(f"agents of slots {missing} not ready within {timeout:.0f}s"
                                + "".join(self._tail(self.handles[s]) for s in missing if s in self.handles))

    @staticmethod
    def _tail(h: AgentHandle) -> str:
        if not h.log:
            return ""
        try:
            with open(h.log, errors="replace") as f:
                return f"\n--- end of {h.log}:\n" + f.read()[-2000:]
        except OSError:
            return ""

    # -- requests ------------------------------------------------------------------------------
    def _send(self, slot: int, msg: dict) -> bool:
        h = self.handles[slot]
        if h.conn is None or h.dead:
            return False
        try:
            h.conn.send(msg)
            return True
        except (OSError, EOFError, ValueError):
            self._lost(h)
            return False

    def start(self, slot: int, attempt: int, ranks: list[dict], moves: list[tuple[str, str]] | None = None) -> bool:
        """Ask ``slot``'s agent to start ``ranks`` (dicts of RankSpec fields: argv, env, log,
        cwd) as attempt ``attempt``, after renaming ``moves`` (src, dst) on its host; False when
        the agent is unreachable."""
        h = self.handles[slot]
        h.attempt, h.pids, h.statuses, h.ended, h.started_at, h.killed_at = attempt, [], {}, None, None, None
        return self._send(slot, {"op": "start", "attempt": attempt, "ranks": ranks,
                                 "moves": [list(m) for m in moves or ()]})

    def signal(self, slot: int, attempt: int, sig: int) -> bool:
        """Forward ``sig`` to the ranks of ``attempt`` on ``slot``."""
        return self._send(slot, {"op": "signal", "attempt": attempt, "sig": int(sig)})

    def kill(self, slots: list[int], attempt: int, timeout: float = 10.0) -> list[int]:
        """SIGKILL the ranks of ``attempt`` on ``slots`` and wait until each agent confirms;
        returns the slots that did not within ``timeout`` seconds (hung or unreachable
        agents: :meth:`terminate` them)."""
        asked = [s for s in slots if self.handles[s].attempt == attempt and self._send(
            s, {"op": "kill", "attempt": attempt})]
        deadline = time.monotonic() + timeout
        while True:
            self.poll(0.02)
            waiting = [s for s in asked if self.handles[s].killed_at is None and not self.handles[s].dead]
            if not waiting or time.monotonic() > deadline:
                return [s for s in slots if s not in asked or s in waiting]

    def preload(self, slot: int, modules: list[str]) -> bool:
        """Ask an idle agent to import more ``modules`` before it forks the next attempt."""
        return self._send(slot, {"op": "preload", "modules": list(modules)})

    def terminate(self, slot: int) -> None:
        """Kill ``slot``'s agent and its ranks for good (SIGKILL; works on a stopped process)."""
        h = self.handles.get(slot)
        if h is None:
            return
        if h.proc is None:  # a remote agent: its pids are another host's; drop the connection
            self._lost(h)
            return
        for rank_pid in [*h.pids]:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(rank_pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(h.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            h.proc.wait(timeout=10)
        if h.ready is not None and h.ready.get("dir"):  # a killed agent cannot remove its own
            shutil.rmtree(str(h.ready["dir"]), ignore_errors=True)
        self._lost(h)

    def _lost(self, h: AgentHandle) -> None:
        h.dead = True
        if h.conn is not None:
            with contextlib.suppress(OSError):
                h.conn.close()
            h.conn = None

    def close(self) -> None:
        """Tell every agent to exit (it kills its ranks), then kill what is left."""
        for s, h in self.handles.items():
            if not h.dead:
                self._send(s, {"op": "exit"})
        deadline = time.monotonic() + 5.0
        for h in self.handles.values():
            if h.proc is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    h.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            if h.proc is None or h.proc.poll() is None:
                self.terminate(h.slot)
            self._lost(h)
        self._closing = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread (a close alone does not)
        with contextlib.suppress(OSError):
            self._sock.close()

    # -- events --------------------------------------------------------------------------------
    def poll(self, timeout: float = 0.0) -> list[dict]:
        """Take every message the agents sent (waiting at most ``timeout`` seconds for the
        first); returns them in order after updating the handles."""
        while True:
            try:
                self._pending.append(self._incoming.get_nowait())
            except queue.Empty:
                break
        for conn in list(self._pending):
            self._pending_hello(conn)
        conns: dict[Connection, AgentHandle] = {h.conn: h for h in self.handles.values()
                                                if h.conn is not None and not h.dead}
        events: list[dict] = []
        if not conns:
            if timeout:
                time.sleep(timeout)
            return events
        for ready in wait(list(conns), timeout=timeout):
            c = ready if isinstance(ready, Connection) else None
            if c is None:
                continue
            h = conns[c]
            while True:
                try:
                    if not c.poll():
                        break
                    msg = c.recv()
                except (EOFError, OSError):
                    self._lost(h)
                    events.append({"ev": "gone", "slot": h.slot, "t": clock.now()})
                    break
                self._apply(h, msg)
                events.append(msg)
        return events

    def _pending_hello(self, conn: Connection) -> None:
        """Map a new connection to its slot once its ``hello`` arrived (never blocks)."""
        try:
            if not conn.poll(0):
                return
            msg = conn.recv()
        except (EOFError, OSError):
            self._pending.remove(conn)
            return
        self._pending.remove(conn)
        slot = msg.get("slot")
        if msg.get("ev") != "hello" or not isinstance(slot, int):
            conn.close()
            return
        h = self.handles.get(slot)
        if h is None or (h.dead and h.proc is None):
            h = self.handles[slot] = AgentHandle(slot=slot)
        h.conn, h.dead = conn, False
        self._apply(h, msg)

    def _apply(self, h: AgentHandle, msg: dict) -> None:
        h.last_heard = time.monotonic()
        ev = msg.get("ev")
        if ev == "hello":
            h.hello = msg
        elif ev == "ready":
            h.ready = msg
            if msg.get("failed"):
                log.warning("tierckpt: agent of slot %d could not preload %s", h.slot, msg["failed"])
        elif ev == "started" and msg.get("attempt") == h.attempt:
            h.pids, h.warm, h.started_at = list(msg["pids"]), bool(msg["warm"]), float(msg["t"])
            if msg.get("problems"):
                log.warning("tierckpt: slot %d started its ranks cold: %s", h.slot, "; ".join(msg["problems"]))
        elif ev == "exit" and msg.get("attempt") == h.attempt:
            h.statuses[int(msg["local_rank"])] = int(msg["status"])
        elif ev == "ended" and msg.get("attempt") == h.attempt:
            h.ended = msg
        elif ev == "killed" and msg.get("attempt") == h.attempt:
            h.killed_at = float(msg["t"])
        elif ev == "beat":
            h.beat = msg


@dataclass(frozen=True)
class Verdict:
    """What :meth:`HangWatch.check` found.

    Attributes:
        cause: ``"hang"`` (nodes stopped ticking or their agent went silent) or ``"stall"``
            (no rank reported a new step for ``progress_timeout_s``).
        slots: the slots to blame (for a stall: those whose ranks are furthest behind; every
            slot of the attempt when all are at the same step).
        detail: one line for the log.
        silent: the blamed slots whose agent itself went silent (a frozen host: kill the agent
            too); the others' agents still answer.
    """

    cause: str
    slots: tuple[int, ...]
    detail: str
    silent: tuple[int, ...] = ()


class HangWatch:
    """Tells a hung node from a slow one, from the agents' beats (see the module docstring).

    Args:
        hang_timeout_s: seconds without a message from an agent, or without a tick of one of
            its ranks' beacons, after which the node is hung (0 disables; > 0 must exceed a few
            beats: ≥ 2 s).
        progress_timeout_s: seconds without a new step reported by any rank, once one was,
            after which the job is stalled (0 disables).

    Raises:
        ValueError: a negative timeout, or ``hang_timeout_s`` in (0, 2).
    """

    def __init__(self, hang_timeout_s: float, progress_timeout_s: float):
        for name, v in (("hang_timeout_s", hang_timeout_s), ("progress_timeout_s", progress_timeout_s)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or v < 0 or v == float("inf"):
                raise ValueError(f"{name} must be a number of seconds >= 0 (0 disables), got {v!r}")
        if 0 < hang_timeout_s < 2:
            raise ValueError(f"hang_timeout_s must be 0 (off) or >= 2 seconds (agents beat every 0.5 s), "
                             f"got {hang_timeout_s!r}")
        self.hang_timeout_s, self.progress_timeout_s = float(hang_timeout_s), float(progress_timeout_s)
        self._attempt: int | None = None
        self._best = -1
        self._best_at = 0.0

    def check(self, pool: AgentPool, slots: list[int], attempt: int) -> Verdict | None:
        """The verdict for ``attempt`` running on ``slots`` now (None: nothing wrong yet)."""
        now = time.monotonic()
        if attempt != self._attempt:
            self._attempt, self._best, self._best_at = attempt, -1, now
        hung, silent_slots, detail = [], [], []
        steps: dict[int, int] = {}
        for s in slots:
            h = pool.handles[s]
            if not h.running(attempt):
                continue
            silent = now - h.last_heard
            if self.hang_timeout_s and silent > self.hang_timeout_s:
                hung.append(s)
                silent_slots.append(s)
                detail.append(f"slot {s}: agent silent for {silent:.1f}s")
                continue
            ranks = (h.beat or {}).get("ranks", []) if (h.beat or {}).get("attempt") == attempt else []
            frozen = [r for r in ranks if self.hang_timeout_s and r["alive_age_s"] > self.hang_timeout_s]
            if frozen:
                hung.append(s)
                detail.append(f"slot {s}: local rank(s) {[r['local_rank'] for r in frozen]} stopped ticking "
                              f"{max(r['alive_age_s'] for r in frozen):.1f}s ago")
            if ranks:
                steps[s] = min(int(r["step"]) for r in ranks)
        if hung:
            return Verdict("hang", tuple(hung), "; ".join(detail), tuple(silent_slots))
        if not steps:
            return None  # no rank of the attempt runs any more: nothing to blame
        best = max(steps.values(), default=-1)
        if best > self._best:
            self._best, self._best_at = best, now
        if self.progress_timeout_s and self._best >= 0 and now - self._best_at > self.progress_timeout_s:
            low = min(steps.values(), default=-1)
            behind = tuple(s for s, v in steps.items() if v == low) if low < best else tuple(steps)
            return Verdict("stall", behind, f"no new step for {now - self._best_at:.0f}s (last step {self._best}; "
                                            f"slots behind: {list(behind) if low < best else 'none'})")
        return None
