"""A private Slurm cluster on one machine: munged, slurmctld and several slurmd ("nodes").

Used by ``tests/slurm/`` (the real tests of ``launch/*.sbatch``) and by hand::

    python -m tests.slurm.cluster start /tmp/slurm      # prints the SLURM_CONF to export
    SLURM_CONF=/tmp/slurm/etc/slurm.conf sbatch -N2 launch/titan.sbatch …
    python -m tests.slurm.cluster stop /tmp/slurm

Needs root and Debian's ``slurm-wlm`` + ``munge`` (``scripts/setup_slurm.sh``). Nothing outside
``root`` is changed: no system service is started, /etc/hosts and /etc/slurm stay untouched.

- **munged** runs in the foreground with its own socket, key, PID, log and seed files under
  ``<root>/munge`` (mode 0755: munged refuses a socket directory others may write to).
- **slurmctld** and one **slurmd per node** (``slurmd -N <name>``; Debian's build supports
  several slurmd per host) run in the foreground (``-D``), each slurmd on its own port.
- Each slurmd runs in private mount and UTS namespaces (``unshare -m -u``): its hostname is the
  node name, ``/etc/hosts`` is a bind-mounted copy that resolves every node name to
  127.0.0.1, and ``<root>/nvme`` is a bind mount of ``<root>/disks/<node>`` — the node's own
  "NVMe", at the same path on every node, as on a real cluster. Jobs inherit the namespaces.
- ``AuthInfo=…,cred_expire=N`` (default 10 s): Slurm holds a requeued job for cred_expire + 1
  seconds, 120 s by default; a short value lets a requeue test finish quickly.

:meth:`SlurmCluster.stop` ends every daemon by the PID it started, and before that every
process left in a node's mount namespace (job scripts, slurmstepd), identified by the
namespace's inode, never by name.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "squeue", "unshare", "mungekey")


class ClusterError(RuntimeError):
    """The cluster could not be started or did not become ready; the message has the log tail."""


def missing_tools() -> list[str]:
    """Programs the cluster needs that are not installed (empty list when it can run)."""
    return [t for t in DAEMONS if shutil.which(t) is None and not os.path.exists(f"/usr/sbin/{t}")]


def _which(tool: str) -> str:
    return shutil.which(tool) or f"/usr/sbin/{tool}"


def _free_ports(n: int) -> list[int]:
    socks, ports = [], []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
            ports.append(s.getsockname()[1])
    finally:
        for s in socks:
            s.close()
    return ports


def _tail(path: str, n: int = 3000) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-n:]
    except OSError:
        return ""


@dataclass
class SlurmCluster:
    """A private cluster under ``root`` (created; must be on a local filesystem).

    Args:
        root: directory for configuration, state, spool, logs and the nodes' disks.
        nodes: node names (each gets its own slurmd, port, hostname and disk).
        cpus: CPUs announced per node (jobs are not bound to CPUs: task/none).
        cred_expire: job credential lifetime in seconds (Slurm's minimum is 5); a requeued
            job becomes eligible again cred_expire + 1 s after the requeue.
        requeue_exit: exit status of a batch script that makes slurmctld requeue the job
            (``RequeueExit``), as an admin would configure for ``launch/*.sbatch``.
        kill_wait: seconds between the SIGTERM and the SIGKILL of a job Slurm ends
            (``KillWait``; Slurm's default 30): the time a preempted or requeued job's final save
            gets, which on 2 busy CPU cores is one training step plus the save, more than 5 s.
    """

    root: str
    nodes: tuple[str, ...] = ("n1", "n2")
    cpus: int = 2
    cred_expire: int = 10
    requeue_exit: int = 75
    kill_wait: int = 30
    pids: dict[str, int] = field(default_factory=dict)

    # -- paths -----------------------------------------------------------------------------
    @property
    def conf(self) -> str:
        """Path of slurm.conf; clients need ``SLURM_CONF`` set to it (see :meth:`env`)."""
        return os.path.join(self.root, "etc", "slurm.conf")

    @property
    def munge_socket(self) -> str:
        return os.path.join(self.root, "munge", "munge.socket.2")

    @property
    def nvme(self) -> str:
        """Path at which every node sees its own disk (``<root>/disks/<node>`` bind-mounted)."""
        return os.path.join(self.root, "nvme")

    def disk(self, node: str) -> str:
        """The directory behind ``nvme`` on ``node`` (visible from outside the cluster)."""
        return os.path.join(self.root, "disks", node)

    @property
    def shared(self) -> str:
        """A directory every node and the test see at the same path ("shared storage")."""
        return os.path.join(self.root, "shared")

    def log(self, name: str) -> str:
        return os.path.join(self.root, "log", f"{name}.log")

    def env(self) -> dict[str, str]:
        """The environment for client commands (sbatch, scontrol, squeue)."""
        e = dict(os.environ)
        e["SLURM_CONF"] = self.conf
        return e

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self, timeout: float = 30.0) -> "SlurmCluster":
        """Write the configuration and start munged, slurmctld and the slurmds; return once
        every node is idle.

        Raises:
            ClusterError: a tool is missing, a daemon died, or nodes are not idle in time
                (everything started is stopped first).
        """
        miss = missing_tools()
        if miss:
            raise ClusterError(f"missing programs: {', '.join(miss)} (run scripts/setup_slurm.sh)")
        if os.geteuid() != 0:
            raise ClusterError("the private cluster needs root (slurmd, mount namespaces)")
        try:
            self._write_files()
            self._start_munged()
            self._start_slurmctld()
            for n in self.nodes:
                self._start_slurmd(n)
            self._wait_idle(timeout)
        except BaseException:
            self.stop()
            raise
        self._save_state()
        return self

    def _write_files(self) -> None:
        for d in ("etc", "munge", "state", "spool", "run", "log", "nvme", "shared", "disks"):
            os.makedirs(os.path.join(self.root, d), exist_ok=True)
        for n in self.nodes:
            os.makedirs(self.disk(n), exist_ok=True)
            os.makedirs(os.path.join(self.root, "spool", n), exist_ok=True)
        os.chmod(self.root, 0o755)
        os.chmod(os.path.join(self.root, "munge"), 0o755)
        key = os.path.join(self.root, "munge", "munge.key")
        if not os.path.exists(key):
            subprocess.run([_which("mungekey"), "--create", f"--keyfile={key}"], check=True,
                           capture_output=True)
        os.chmod(key, 0o600)
        with open("/etc/hosts") as f:
            hosts = f.read()
        with open(os.path.join(self.root, "etc", "hosts"), "w") as f:
            f.write(hosts.rstrip("\n") + "\n# tierckpt private Slurm cluster\n127.0.0.1 " + " ".join(self.nodes) + "\n")
        ports = _free_ports(1 + len(self.nodes))
        self.ctld_port, self.node_ports = ports[0], dict(zip(self.nodes, ports[1:]))
        r = self.root
        lines = [
            "# written by tests/slurm/cluster.py: a private test cluster on one machine",
            "ClusterName=tierckpt",
            f"SlurmctldHost={socket.gethostname()}(127.0.0.1)",
            f"SlurmctldPort={self.ctld_port}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket},cred_expire={int(self.cred_expire)}",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"StateSaveLocation={r}/state",
            f"SlurmdSpoolDir={r}/spool/%n",
            f"SlurmctldPidFile={r}/run/slurmctld.pid",
            f"SlurmdPidFile={r}/run/slurmd-%n.pid",
            f"SlurmctldLogFile={r}/log/slurmctld.log",
            f"SlurmdLogFile={r}/log/slurmd-%n.log",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "SwitchType=switch/none",
            "MpiDefault=none",
            "MailProg=/bin/true",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "SchedulerType=sched/backfill",
            # the main scheduler's periodic pass starts a requeued job once its begin time passed
            "SchedulerParameters=sched_interval=1,bf_interval=1,sched_min_interval=100000",
            "ReturnToService=2",
            "JobRequeue=1",
            f"RequeueExit={int(self.requeue_exit)}",
            "MinJobAge=3600",
            f"KillWait={int(self.kill_wait)}",
            "InactiveLimit=0",
            "MessageTimeout=20",
            "SlurmdTimeout=300",
        ]
        for n in self.nodes:
            lines.append(f"NodeName={n} NodeHostname={n} NodeAddr=127.0.0.1 Port={self.node_ports[n]} "
                         f"CPUs={self.cpus} RealMemory=1024 State=UNKNOWN")
        lines.append(f"PartitionName=test Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE State=UP")
        with open(self.conf, "w") as f:
            f.write("\n".join(lines) + "\n")

    def _popen(self, name: str, cmd: list[str]) -> subprocess.Popen:
        out = open(self.log(f"{name}.stdout"), "ab")
        try:
            p = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 start_new_session=True, env=self.env())
        finally:
            out.close()
        self.pids[name] = p.pid
        self._procs = getattr(self, "_procs", {})
        self._procs[name] = p
        return p

    def _check_alive(self, name: str) -> None:
        p = self._procs[name]
        if p.poll() is not None:
            raise ClusterError(f"{name} exited with status {p.returncode}:\n{_tail(self.log(name + '.stdout'))}\n"
                               f"{_tail(self.log(name.split('-')[0] if name.startswith('slurmd-') else name))}"
                               f"{_tail(self.log(name))}")

    def _start_munged(self) -> None:
        d = os.path.join(self.root, "munge")
        self._popen("munged", [_which("munged"), "--foreground", "--force", f"--socket={self.munge_socket}",
                               f"--key-file={d}/munge.key", f"--pid-file={d}/munged.pid",
                               f"--log-file={self.log('munged')}", f"--seed-file={d}/munged.seed",
                               "--num-threads=2"])
        deadline = time.time() + 10
        while not os.path.exists(self.munge_socket):
            self._check_alive("munged")
            if time.time() > deadline:
                raise ClusterError(f"munged created no socket in 10 s:\n{_tail(self.log('munged'))}")
            time.sleep(0.02)

    def _start_slurmctld(self) -> None:
        # -i: ignore state a previous cluster in the same root may have left
        self._popen("slurmctld", [_which("slurmctld"), "-D", "-i", "-f", self.conf])

    def _start_slurmd(self, node: str) -> None:
        # unshare without --fork execs in place, so the PID we hold is slurmd's own.
        inner = (f'hostname {node} && mount --bind "$1" /etc/hosts && mount --bind "$2" "$3" '
                 f'&& exec "$4" -D -N {node} -f "$5"')
        self._popen(f"slurmd-{node}", [_which("unshare"), "--mount", "--uts", "--propagation", "private",
                                       "/bin/sh", "-c", inner, "sh", os.path.join(self.root, "etc", "hosts"),
                                       self.disk(node), self.nvme, _which("slurmd"), self.conf])

    def _wait_idle(self, timeout: float) -> None:
        deadline = time.time() + timeout
        last = ""
        while time.time() < deadline:
            for name in self._procs:
                self._check_alive(name)
            r = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True, text=True, env=self.env())
            last = (r.stdout + r.stderr).strip()
            states = dict(line.split()[:2] for line in r.stdout.splitlines() if len(line.split()) >= 2)
            if r.returncode == 0 and all(states.get(n) == "idle" for n in self.nodes):
                return
            time.sleep(0.1)
        raise ClusterError(f"nodes not idle after {timeout:.0f}s: {last}\n{_tail(self.log('slurmctld'))}")

    def _save_state(self) -> None:
        with open(os.path.join(self.root, "run", "cluster.json"), "w") as f:
            json.dump({"pids": self.pids, "nodes": list(self.nodes), "conf": self.conf}, f)

    def namespace_pids(self, node: str | None = None) -> list[int]:
        """PIDs of processes in the nodes' mount namespaces (of ``node`` only, if given) other
        than the slurmds — jobs, slurmstepd —, found by the namespace inode of each slurmd we
        started."""
        ns = set()
        for name, pid in self.pids.items():
            if name.startswith("slurmd-") and (node is None or name == f"slurmd-{node}"):
                try:
                    ns.add(os.readlink(f"/proc/{pid}/ns/mnt"))
                except OSError:
                    pass
        out = []
        if not ns:
            return out
        daemon_pids = set(self.pids.values())
        for d in os.listdir("/proc"):
            if d.isdigit() and int(d) not in daemon_pids:
                try:
                    if os.readlink(f"/proc/{d}/ns/mnt") in ns:
                        out.append(int(d))
                except OSError:
                    pass
        return out

    def stop(self) -> None:
        """Stop everything this cluster started, by PID: leftover job processes in the nodes'
        namespaces (SIGKILL), then slurmds, slurmctld and munged (SIGTERM, SIGKILL after 10 s)."""
        for pid in self.namespace_pids():
            _kill(pid, signal.SIGKILL)
        order = [n for n in self.pids if n.startswith("slurmd-")] + ["slurmctld", "munged"]
        for name in order:
            pid = self.pids.get(name)
            if pid is not None:
                _kill(pid, signal.SIGTERM)
        for name in order:
            pid = self.pids.pop(name, None)
            if pid is None:
                continue
            p = getattr(self, "_procs", {}).get(name)
            deadline = time.time() + 10
            while _alive(pid, p) and time.time() < deadline:
                time.sleep(0.05)
            if _alive(pid, p):
                _kill(pid, signal.SIGKILL)
                if p is not None:
                    p.wait()
        with_file = os.path.join(self.root, "run", "cluster.json")
        if os.path.exists(with_file):
            os.remove(with_file)

    @classmethod
    def attach(cls, root: str) -> "SlurmCluster":
        """The cluster started (by another process) under ``root``, for :meth:`stop`."""
        with open(os.path.join(root, "run", "cluster.json")) as f:
            st = json.load(f)
        return cls(root=root, nodes=tuple(st["nodes"]), pids={k: int(v) for k, v in st["pids"].items()})


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _alive(pid: int, p: subprocess.Popen | None) -> bool:
    if p is not None:
        return p.poll() is None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie of a parent that is gone counts as ended
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.slurm.cluster", description=__doc__.split("\n\n")[0])
    ap.add_argument("action", choices=["start", "stop"])
    ap.add_argument("root", help="cluster directory (created)")
    ap.add_argument("--nodes", default="n1,n2", help="comma-separated node names")
    ap.add_argument("--cred-expire", type=int, default=10, help="credential lifetime, seconds")
    args = ap.parse_args(argv)
    root = os.path.abspath(args.root)
    if args.action == "start":
        c = SlurmCluster(root, nodes=tuple(args.nodes.split(",")), cred_expire=args.cred_expire)
        try:
            c.start()
        except ClusterError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        # the daemons were started in their own sessions and keep running after we exit
        print(f"export SLURM_CONF={c.conf}")
        return 0
    SlurmCluster.attach(root).stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
