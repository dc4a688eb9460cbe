"""launch/local.py, the local launcher (Slurm semantics on one machine), with a small worker
instead of a trainer: one torchrun per simulated node, a fresh port and TIERCKPT_RESTART_COUNT
per attempt (persisted in --state-dir across launcher runs), a killed node's peers stopped and
the job retried, no retry after a configuration error (exit status 2), nothing left running.
The full torchtitan run through it is ``make demo`` / tests/test_titan_demo.py.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from tests.harness import load_local_launcher

REPO = Path(__file__).resolve().parent.parent

WORKER = r"""
import json, os, signal, sys, time
rec = {k: os.environ.get(k) for k in ("RANK", "GROUP_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                                      "MASTER_PORT", "TIERCKPT_RESTART_COUNT", "TIERCKPT_NODE_ID",
                                      "TIERCKPT_RECOVERY", "TIERCKPT_PROCESS_STARTED")}
rec["pid"] = os.getpid()
rec["argv"] = sys.argv[2:]
with open(sys.argv[1], "a") as f:
    f.write(json.dumps(rec) + "\n")
plan = dict(x.split(":", 1) for x in os.environ.get("FAIL", "").split(",") if x)
mode = plan.get(f"{rec['TIERCKPT_RESTART_COUNT']}/{rec['GROUP_RANK']}")
if mode == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
if mode == "config":  # once every rank of the attempt has recorded itself (a loaded machine starts them late)
    deadline = time.time() + 60
    while time.time() < deadline:
        with open(sys.argv[1]) as f:
            mine = [json.loads(x) for x in f if x.strip()]
        if sum(r["TIERCKPT_RESTART_COUNT"] == rec["TIERCKPT_RESTART_COUNT"] for r in mine) >= int(rec["WORLD_SIZE"]):
            break
        time.sleep(0.05)
    sys.exit(2)
time.sleep(300 if mode == "hang" else 0.5)
"""


def _local():
    return load_local_launcher()




@pytest.fixture(params=["warm", "cold"])
def warm(request) -> bool:
    """Both ways of running a node: warm node agents (default) and one torchrun per attempt."""
    return request.param == "warm"


def _records(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_retry_restart_count_and_config_error(tmp_path, monkeypatch, warm):
    lo = _local()
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    rec, state = tmp_path / "rec.jsonl", tmp_path / "state"
    monkeypatch.setenv("TIERCKPT_NODE_ID", "7")  # must not reach the nodes: GROUP_RANK is the node
    monkeypatch.setenv("TIERCKPT_RECOVERY", "{}")  # nor an outer job's recovery variables
    monkeypatch.setenv("TIERCKPT_PROCESS_STARTED", "1.0")
    lines: list[str] = []

    # run 1: node 1's worker is SIGKILLed in the first attempt; the second attempt succeeds
    l1 = lo.LocalLauncher([str(worker), str(rec)], nodes=2, max_attempts=3, log_dir=str(tmp_path / "logs"),
                          name="one", env={"FAIL": "0/1:kill"}, state_dir=str(state), warm=warm)
    assert l1.run(timeout=240, log=lines.append) == 0, lines
    a1, a2 = l1.attempts
    assert (a1.failed_node, a1.worker_exitcode, a1.ok) == (1, -9, False)
    assert a2.ok and a1.port != a2.port
    recs = _records(rec)
    assert sorted((r["TIERCKPT_RESTART_COUNT"], r["GROUP_RANK"], r["RANK"]) for r in recs) == [
        ("0", "0", "0"), ("0", "1", "1"), ("1", "0", "0"), ("1", "1", "1")]
    for r in recs:
        assert r["WORLD_SIZE"] == "2" and r["LOCAL_WORLD_SIZE"] == "1" and r["MASTER_ADDR"] == "127.0.0.1"
        assert r["MASTER_PORT"] == str((a1, a2)[int(r["TIERCKPT_RESTART_COUNT"])].port)
        assert r["TIERCKPT_NODE_ID"] is None
        if warm:  # the agent's fork time; torchrun's ranks: none (their /proc start time is right)
            assert abs(float(r["TIERCKPT_PROCESS_STARTED"]) - time.time()) < 240
        else:
            assert r["TIERCKPT_PROCESS_STARTED"] is None
        assert (r["TIERCKPT_RECOVERY"] is None) == (r["TIERCKPT_RESTART_COUNT"] == "0")
    assert (tmp_path / "logs" / "one-attempt2-node1.log").exists()
    # the second attempt's processes learn what they recover from (tierckpt/recovery/timeline.py)
    recovery = [json.loads(r["TIERCKPT_RECOVERY"]) for r in recs if r["TIERCKPT_RESTART_COUNT"] == "1"]
    assert recovery[0] == recovery[1]
    rv = recovery[0]
    assert {k: v for k, v in rv.items() if k != "launched"} == {k: v for k, v in a2.recovery.items() if k != "launched"}
    assert (rv["attempt"], rv["cause"], rv["failed_nodes"], rv["warm"]) == (1, "node-failure", [1], warm)
    assert a1.t_start < rv["failure_noticed"] <= rv["survivors_stopped"] <= a2.t_start <= rv["launched"]
    assert (rv["failure_noticed"], rv["survivors_stopped"]) == (a1.failure_noticed, a1.survivors_stopped)

    # run 2 (same state dir: restart count 2): node 0 reports a configuration error while node 1
    # hangs; no retry, exit status 2, the hanging worker is stopped
    rec.unlink()
    l2 = lo.LocalLauncher([str(worker), str(rec)], nodes=2, max_attempts=3, log_dir=str(tmp_path / "logs"),
                          name="two", env={"FAIL": "2/0:config,2/1:hang"}, state_dir=str(state), kill_grace_s=2,
                          warm=warm)
    t0 = time.time()
    assert l2.run(timeout=240, log=lines.append) == 2, lines
    assert len(l2.attempts) == 1 and l2.attempts[0].worker_exitcode == 2
    recs = _records(rec)
    assert {r["TIERCKPT_RESTART_COUNT"] for r in recs} == {"2"}
    hung = [r["pid"] for r in recs if r["GROUP_RANK"] == "1"]
    assert hung and not _alive(hung[0]), "the hanging worker must be stopped"
    assert time.time() - t0 < 120
    assert all(p.poll() is not None for p in l2.attempts[0].procs)
    assert (state / "attempts").read_text().strip() == "3"


def _wait_records(path: Path, n: int, restart_count: str) -> bool:
    return sum(r["TIERCKPT_RESTART_COUNT"] == restart_count for r in _records(path)) >= n


def test_lose_node_continues_on_fewer_nodes(tmp_path, monkeypatch, warm):
    """3 simulated nodes, TIERCKPT_MIN_NODES=2: node 1 is lost for good while every node runs;
    the next attempt runs on 2 nodes (torchrun --nnodes=2, WORLD_SIZE 2, node ids 0 and 1),
    with the reconfigure overrides appended; node 1's disk is gone and old node 2's disk
    follows it to id 1."""
    lo = _local()
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    rec, nvme = tmp_path / "rec.jsonl", tmp_path / "nvme"
    for n in range(3):
        (nvme / f"node-{n}").mkdir(parents=True)
        (nvme / f"node-{n}" / "host").write_text(f"slot {n}")
    monkeypatch.setenv("TIERCKPT_MIN_NODES", "2")
    asked: list[tuple[int, int]] = []

    def reconfigure(nodes: int, nproc: int) -> list[str]:
        asked.append((nodes, nproc))
        return ["--parallelism.data_parallel_shard_degree", str(nodes * nproc)]

    def monitor(launcher, a):
        if a.index == 0 and not a.lost and _wait_records(rec, 3, "0"):
            launcher.lose_node(1)

    lines: list[str] = []
    la = lo.LocalLauncher([str(worker), str(rec)], nodes=3, max_attempts=3, log_dir=str(tmp_path / "logs"),
                          env={"FAIL": "0/0:hang,0/1:hang,0/2:hang"}, local_root=str(nvme / "node-{node}"),
                          reconfigure=reconfigure, kill_grace_s=2, warm=warm)
    assert la.min_nodes == 2
    assert la.run(timeout=240, monitor=monitor, log=lines.append) == 0, lines
    a1, a2 = la.attempts
    assert (a1.nodes, a1.slots, a1.lost, a1.failed_node, a1.worker_exitcode) == (3, [0, 1, 2], [1], 1, None)
    assert (a2.nodes, a2.slots, a2.ok) == (2, [0, 2], True)
    assert asked == [(2, 1)] and a1.extra_args == [] and a2.extra_args == ["--parallelism.data_parallel_shard_degree", "2"]
    second = sorted((r for r in _records(rec) if r["TIERCKPT_RESTART_COUNT"] == "1"), key=lambda r: r["GROUP_RANK"])
    assert [(r["GROUP_RANK"], r["RANK"], r["WORLD_SIZE"]) for r in second] == [("0", "0", "2"), ("1", "1", "2")]
    assert all(r["argv"] == ["--parallelism.data_parallel_shard_degree", "2"] for r in second)
    assert la.node_command(1, a2.port)[3] == "--nnodes=2"
    assert sorted(p.name for p in nvme.iterdir()) == ["node-0", "node-1"]
    assert [(nvme / f"node-{n}" / "host").read_text() for n in (0, 1)] == ["slot 0", "slot 2"]
    assert any("lost for good; 2 node(s) left" in x for x in lines), lines
    assert (a2.recovery["cause"], a2.recovery["failed_nodes"], a2.recovery["attempt"]) == ("lost-node", [1], 1)
    assert all(json.loads(r["TIERCKPT_RECOVERY"])["failed_nodes"] == [1] for r in second)


def test_lose_node_below_minimum_gives_up(tmp_path, warm):
    lo = _local()
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    rec = tmp_path / "rec.jsonl"
    lines: list[str] = []

    def monitor(launcher, a):
        if a.index == 0 and not a.lost and _wait_records(rec, 2, "0"):
            launcher.lose_node(0)

    la = lo.LocalLauncher([str(worker), str(rec)], nodes=2, max_attempts=3, log_dir=str(tmp_path / "logs"),
                          env={"FAIL": "0/0:hang,0/1:hang"}, min_nodes=2, kill_grace_s=2, warm=warm)
    rc = la.run(timeout=240, monitor=monitor, log=lines.append)
    assert rc != 0 and len(la.attempts) == 1 and la.lost == [0], lines
    assert lines[-1] == "giving up: node(s) [0] lost for good, 1 left, fewer than the minimum 2 (min_nodes / TIERCKPT_MIN_NODES)"
    with pytest.raises(ValueError, match="node must be a node id in 0..0"):
        la.lose_node(1)


def test_min_nodes_errors(tmp_path, monkeypatch):
    lo = _local()
    kw = dict(nodes=3, log_dir=str(tmp_path))
    with pytest.raises(ValueError, match=r"min_nodes must be an integer in 1..3 \(the nodes of the job\), got 4"):
        lo.LocalLauncher(["x.py"], min_nodes=4, **kw)
    with pytest.raises(ValueError, match="local_root must contain {node}"):
        lo.LocalLauncher(["x.py"], local_root=str(tmp_path / "nvme"), **kw)
    monkeypatch.setenv("TIERCKPT_MIN_NODES", "two")
    with pytest.raises(ValueError, match="TIERCKPT_MIN_NODES='two': must be an integer in 1..3"):
        lo.LocalLauncher(["x.py"], **kw)
    monkeypatch.delenv("TIERCKPT_MIN_NODES")
    assert lo.LocalLauncher(["x.py"], **kw).min_nodes == 3  # default: every node is needed
    with pytest.raises(ValueError, match="--lose-node must be NODE@SECONDS with NODE in 0..2"):
        lo._lose_node_monitor("3@1", 3)
    with pytest.raises(ValueError, match="needs a command starting with -m titan_plugin.train"):
        lo.titan_reconfigure(["x.py"])


def test_cli_errors(capsys):
    lo = _local()
    for argv, needle in ((["--nodes", "2"], "separate the training command with --"),
                         (["--nodes", "0", "--", "x.py"], "nodes must be an integer >= 1"),
                         (["--", ], "command must not be empty")):
        try:
            lo.main(argv)
        except SystemExit as e:
            assert e.code == 2
        else:
            raise AssertionError(f"{argv} was accepted")
        assert needle in capsys.readouterr().err


def test_root_cause_exitcode():
    lo = _local()
    text = ("Failures:\n[1]:\n  exitcode  : -15 (pid: 9)\nRoot Cause (first observed failure):\n[0]:\n"
            "  host      : n2\n  rank      : 1 (local_rank: 0)\n  exitcode  : -9 (pid: 123)\n")
    assert lo.root_cause_exitcode(text) == -9
    assert lo.root_cause_exitcode("Root Cause (first observed failure):\n  exitcode  : 2 (pid: 1)") == 2
    assert lo.root_cause_exitcode("no summary") is None
    assert os.path.basename(lo.REPO) == REPO.name
