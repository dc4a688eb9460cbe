"""launch/slurm_agents.py (TIERCKPT_AGENTS=warm) without a cluster: a stand-in ``srun`` runs each
"host"'s task on this machine with ``SLURMD_NODENAME`` set, so the controller, its agents, the
spare take-over, the shrink with node-local renames and the event records run in ``make test``.
The real-Slurm versions are in tests/slurm/test_slurm_launch.py (``make test-slurm``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import load_script
from tests.test_launch_local import WORKER, _records

REPO = Path(__file__).resolve().parent.parent

# srun OPTIONS PROGRAM ARGS…: one task per host of --nodelist, each with SLURMD_NODENAME, its
# output to --output (%N: the host); waits for every task; SIGTERM ends them.
FAKE_SRUN = r"""
import os, signal, subprocess, sys
args = sys.argv[1:]
opts = {}
while args and args[0].startswith("-"):
    k, _, v = args.pop(0).partition("=")
    opts[k] = v
hosts = opts.get("--nodelist", "").split(",")
with open(os.environ["FAKE_SRUN_LOG"], "a") as f:
    f.write(" ".join(sys.argv[1:]) + "\n")
procs = []
for h in hosts:
    out = opts.get("--output")
    log = open(out.replace("%N", h), "ab") if out else subprocess.DEVNULL
    procs.append(subprocess.Popen(args, env=dict(os.environ, SLURMD_NODENAME=h), stdout=log, stderr=subprocess.STDOUT))
def stop(signum, frame):
    for p in procs:
        p.kill()
signal.signal(signal.SIGTERM, stop)
sys.exit(max(abs(p.wait()) for p in procs))
"""


def _sa():
    return load_script("launch/slurm_agents.py", "tierckpt_slurm_agents")


@pytest.fixture
def srun(tmp_path, monkeypatch) -> Path:
    p = tmp_path / "srun"
    p.write_text(f"#!{sys.executable}\n{FAKE_SRUN}")
    p.chmod(0o755)
    monkeypatch.setenv("FAKE_SRUN_LOG", str(tmp_path / "srun.log"))
    return p


def _events(state: Path) -> list[dict]:
    out = []
    for line in (state / "events").read_text().splitlines():
        t, kind, rest = line.split(" ", 2)
        out.append({"kind": kind, **dict(x.split("=", 1) for x in rest.split())})
    return out


def _kill_agent_of(slot: int, rec: Path):
    """A monitor that SIGKILLs slot ``slot``'s agent (a lost host) once 2 ranks of attempt 0 ran."""
    done = []

    def monitor(launcher, a):
        if a.index == 0 and not done and launcher.pool is not None and len(_records(rec)) >= 2:
            os.kill(launcher.pool.handles[slot].pid, signal.SIGKILL)
            done.append(slot)
    return monitor


def _run(sa, tmp_path: Path, srun: Path, rec: Path, state: Path, **kw):
    """Run a SlurmAgentLauncher of WORKER on hosts h1..h3 that loses slot 1's agent in attempt 0;
    returns it and its log lines (the run must succeed)."""
    la = sa.SlurmAgentLauncher([str(tmp_path / "worker.py"), str(rec)], hosts=["h1", "h2", "h3"], state_dir=str(state),
                               srun=str(srun), log_dir=str(tmp_path / "logs"), max_attempts=2, preload=["json"], **kw)
    lines: list[str] = []
    try:
        assert la.run(timeout=120, monitor=_kill_agent_of(1, rec), log=lines.append) == 0, lines
    finally:
        la.close_steps()
    return la, lines


def test_spare_takes_over_a_lost_hosts_node_id(tmp_path, srun):
    """hosts h1, h2 + spare h3: h2's agent dies (its rank with it); the next attempt runs node 1
    on h3, same world size, master still h1; events and the recovery object name the spare."""
    sa = _sa()
    worker, rec, state = tmp_path / "worker.py", tmp_path / "rec.jsonl", tmp_path / "state"
    worker.write_text(WORKER)
    state.mkdir()
    la, lines = _run(sa, tmp_path, srun, rec, state, spares=1, env={"FAIL": "0/0:hang,0/1:hang"})
    a1, a2 = la.attempts
    assert (a1.slots, a1.failed_nodes, a2.slots, a2.replaced) == ([0, 1], [1], [0, 2], {1: 2}), lines
    second = sorted((r for r in _records(rec) if r["TIERCKPT_RESTART_COUNT"] == "1"), key=lambda r: r["GROUP_RANK"])
    assert [(r["GROUP_RANK"], r["WORLD_SIZE"], r["MASTER_ADDR"]) for r in second] == [("0", "2", "h1"), ("1", "2", "h1")]
    recovery = json.loads(second[0]["TIERCKPT_RECOVERY"])
    assert recovery["replaced"] == {"1": "spare h3"} and recovery["failed_nodes"] == [1] and recovery["warm"] is True
    assert any("spare h3 takes over node 1" in x for x in lines), lines
    ev = _events(state)
    assert [e["kind"] for e in ev] == ["start", "end", "start", "end"], ev
    assert (ev[0]["nodes"], ev[0]["agents"], ev[0]["replaced"]) == ("h1,h2", "warm", "-")
    assert ev[1]["failed_nodes"] == "h2" and ev[1]["cause"] == "node-failure" and ev[1]["rc"] != "0", ev
    assert (ev[2]["nodes"], ev[2]["replaced"], ev[2]["restart_count"], ev[3]["rc"]) == ("h1,h3", "1:h3", "1", "0"), ev
    calls = (tmp_path / "srun.log").read_text().splitlines()
    assert "--kill-on-bad-exit=0 --no-kill --nodes=3 --ntasks=3 --ntasks-per-node=1 --nodelist=h1,h2,h3" in calls[0]
    assert any(c.startswith("--overlap --nodes=1 --ntasks=1 --nodelist=h2") and " kill -KILL -- " in c
               for c in calls), calls  # the lost host's leftovers are killed there
    assert (state / "attempts").read_text().strip() == "2"


def test_without_spare_a_lost_node_is_dropped_and_survivor_roots_renamed(tmp_path, srun):
    """hosts h1, h2, h3, TIERCKPT_MIN_NODES=2, no spare: h2's agent dies; the next attempt runs on
    h1, h3 as nodes 0, 1 and h3's agent renames its node-2 root to node-1 before forking (what it
    finds there — here the lost node's directory on this shared test disk — is set aside)."""
    sa = _sa()
    worker, rec, state, nvme = tmp_path / "worker.py", tmp_path / "rec.jsonl", tmp_path / "state", tmp_path / "nvme"
    worker.write_text(WORKER)
    state.mkdir()
    for n in range(3):
        (nvme / f"node-{n}").mkdir(parents=True)
        (nvme / f"node-{n}" / "host").write_text(f"h{n + 1}")
    asked = []

    def reconfigure(nodes, nproc):
        asked.append(nodes)
        return ["--dp", str(nodes)]

    la, lines = _run(sa, tmp_path, srun, rec, state, min_nodes=2, local_root=str(nvme / "node-{node}"),
                     reconfigure=reconfigure, env={"FAIL": "0/0:hang,0/1:hang,0/2:hang"})
    a1, a2 = la.attempts
    assert (a1.slots, a2.slots, a2.nodes, asked, a2.extra_args) == ([0, 1, 2], [0, 2], 2, [2], ["--dp", "2"]), lines
    second = sorted((r for r in _records(rec) if r["TIERCKPT_RESTART_COUNT"] == "1"), key=lambda r: r["GROUP_RANK"])
    assert [(r["GROUP_RANK"], r["WORLD_SIZE"]) for r in second] == [("0", "2"), ("1", "2")]
    assert (nvme / "node-0" / "host").read_text() == "h1" and (nvme / "node-1" / "host").read_text() == "h3"
    assert not (nvme / "node-2").exists()
    stale = [p for p in nvme.iterdir() if p.name.startswith("node-1.stale-")]
    assert len(stale) == 1 and (stale[0] / "host").read_text() == "h2"  # set aside, never deleted
    assert la.hosts[la.slots[1]] == "h3" and sorted(la.lost) == [1]
    log1 = Path(a2.logs[1]).read_text()
    assert f"moved {nvme}/node-2 to {nvme}/node-1" in log1, log1
    ev = _events(state)
    assert ev[2]["nodes"] == "h1,h3" and ev[1]["failed_nodes"] == "h2", ev


@pytest.mark.parametrize("kw,needle", [
    ({"hosts": []}, "hosts must be distinct Slurm node names"),
    ({"hosts": ["a", "a"]}, "hosts must be distinct Slurm node names"),
    ({"hosts": ["a", "b"], "spares": 2}, "spares must be an integer in 0..1 (TIERCKPT_SPARES"),
    ({"hosts": ["a", "b"], "spares": -1}, "spares must be an integer in 0..1"),
    ({"hosts": ["a", "b"], "local_root": "/nvme/x"}, "local_root must contain {node}"),
    ({"hosts": ["a", "b", "c"], "spares": 1, "min_nodes": 3}, "min_nodes"),
])
def test_bad_options(tmp_path, kw, needle):
    sa = _sa()
    with pytest.raises(ValueError) as e:
        sa.SlurmAgentLauncher(["x.py"], state_dir=str(tmp_path), log_dir=str(tmp_path / "logs"), **kw)
    assert needle in str(e.value), e.value


def test_agent_slot_from_hosts_names_a_missing_host(tmp_path):
    r = subprocess.run([sys.executable, "-m", "tierckpt.recovery.agent", "--connect", "127.0.0.1:9", "--hosts", "a,b"],
                       env=dict(os.environ, TIERCKPT_AGENT_KEY="00", SLURMD_NODENAME="c", PYTHONPATH=str(REPO)),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "this host (c) is not in --hosts a,b" in r.stderr, r.stderr


def test_agent_move_sets_aside_never_deletes(tmp_path):
    from tierckpt.recovery.agent import Agent

    src, dst = tmp_path / "node-2", tmp_path / "node-1"
    src.mkdir()
    (src / "f").write_text("mine")
    dst.mkdir()
    (dst / "f").write_text("leftover")
    msg = Agent.move(str(src), str(dst))
    assert (dst / "f").read_text() == "mine" and not src.exists()
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("node-1.stale-")]
    assert len(aside) == 1 and (aside[0] / "f").read_text() == "leftover" and "set aside" in msg
    assert Agent.move(str(tmp_path / "none"), str(dst)).startswith("no ")
    assert (dst / "f").read_text() == "mine"
