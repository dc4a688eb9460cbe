"""Recovery through warm node agents (launch/local.py, tierckpt.recovery), end to end with an
engine-API trainer (tests/recovery_trainer.py: FSDP2 over gloo, one rank per simulated node,
local tier + replica every 3 steps, persistent every 6).

Every scenario compares the losses after each restart with an uninterrupted run's, bit for
bit, and asserts the restored step, the restore's per-node sources and the launcher's
bookkeeping (cause, blamed nodes, spares, warm ranks, ``$TIERCKPT_RECOVERY``):

- a node's rank killed → survivors and replacement restart warm (forked, no imports); a second
  failure during that recovery (right after the restore) → a third attempt;
- a node lost for good with spares → a spare takes over its node id and restores its shards
  from the peer's replica (no persistent byte), the world size stays; the spare dies before
  its restore finished → the next spare takes over;
- a node frozen (SIGSTOP of its agent and rank) → found by its silent beacons within the hang
  timeout and replaced by a spare; without a spare its agent is restarted on the same host
  (disk kept); a frozen rank under a live agent is killed and restarted in place; a stalled job
  (a rank stuck, its beacon ticking) is restarted after the progress timeout.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from tests.harness import load_local_launcher

REPO = Path(__file__).resolve().parent.parent
TRAINER = str(REPO / "tests" / "recovery_trainer.py")
STEPS = 12
ENV = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONWARNINGS": "ignore"}
PRELOAD = ["torch", "torch.distributed.checkpoint", "torch.distributed.fsdp", "tierckpt.engine"]


def _local():
    return load_local_launcher()




def _jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def _launcher(base: Path, fail: str = "", **kw):
    lo = _local()
    cmd = [TRAINER, str(base), str(STEPS)] + (["--fail", fail] if fail else [])
    kw.setdefault("max_attempts", 4)
    return lo.LocalLauncher(cmd, nodes=2, log_dir=str(base / "logs"), env=ENV, local_root=str(base / "nvme" / "node-{node}"),
                            preload=PRELOAD, kill_grace_s=2, **kw)


def _run(la, monitor=None) -> list[str]:
    lines: list[str] = []
    rc = la.run(timeout=400, monitor=monitor, log=lines.append)
    assert rc == 0, "\n".join(lines) + "\n" + la.failure_text()
    return lines


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, str]:
    """Losses (float.hex) of an uninterrupted run, by step."""
    base = tmp_path_factory.mktemp("reference")
    _run(_launcher(base))
    got = {r["step"]: r["loss_hex"] for r in _jsonl(base / "losses.jsonl")}
    assert sorted(got) == list(range(1, STEPS + 1))
    return got


def _check_losses(base: Path, reference: dict[int, str], restarts: dict[int, int]) -> None:
    """Each restart ``k`` resumed at ``restarts[k]`` (its first step is that + 1), and every loss
    of every attempt equals the uninterrupted run's."""
    recs = _jsonl(base / "losses.jsonl")
    for r in recs:
        assert r["loss_hex"] == reference[r["step"]], r
    for k, resumed in restarts.items():
        steps = [r["step"] for r in recs if r["restart"] == k]
        assert steps and min(steps) == resumed + 1, (k, steps)
    last = max(restarts)
    assert [r["step"] for r in recs if r["restart"] == last] == list(range(restarts[last] + 1, STEPS + 1))


def _restores(base: Path) -> list[dict]:
    return [r for r in _jsonl(base / "pfs" / "tierckpt-ledger.jsonl") if r["kind"] == "restore"]


def _wait_step(base: Path, step: int, restart: int) -> bool:
    return any(r["step"] >= step and r["restart"] == restart for r in _jsonl(base / "losses.jsonl"))


def test_warm_restart_and_a_failure_during_the_recovery(tmp_path, reference):
    la = _launcher(tmp_path, fail="0:1:7:kill,1:0:restore:kill")
    _run(la)
    a1, a2, a3 = la.attempts
    assert (a1.failed_node, a1.worker_exitcode, a1.cause, a1.failed_nodes) == (1, -9, "node-failure", [1])
    assert (a2.failed_node, a2.worker_exitcode, a2.failed_nodes) == (0, -9, [0])
    assert a3.ok and a1.warm and a2.warm and a3.warm
    assert a1.failure_noticed <= a1.survivors_stopped <= a2.t_start
    _check_losses(tmp_path, reference, {2: 6})
    assert not [r for r in _jsonl(tmp_path / "losses.jsonl") if r["restart"] == 1]  # died right after its restore
    assert [r["step"] for r in _restores(tmp_path)] == [6, 6]
    starts = [s for s in _jsonl(tmp_path / "starts.jsonl") if s["restart"] > 0]
    assert len(starts) == 4 and all(s["warm"] for s in starts), starts  # forked: torch was already imported
    env = [s for s in _jsonl(tmp_path / "recovery-env.jsonl") if s["restart"] == 2]
    assert env, _jsonl(tmp_path / "recovery-env.jsonl")
    rec = json.loads(env[0]["value"])
    assert (rec["attempt"], rec["cause"], rec["failed_nodes"], rec["warm"]) == (2, "node-failure", [0], True)
    assert rec["failure_noticed"] <= rec["survivors_stopped"] <= rec["launched"]


def test_spares_take_over_a_lost_node_even_when_one_dies_while_restoring(tmp_path, reference):
    la = _launcher(tmp_path, spares=2)
    lost: list[tuple[int, float]] = []

    def monitor(launcher, a):
        if a.index == 0 and not lost and _wait_step(tmp_path, 7, 0):
            lost.append((0, time.time()))
            launcher.lose_node(1)  # host and disk gone
        elif a.index == 1 and len(lost) == 1 and launcher.workers(1):
            lost.append((1, time.time()))
            launcher.lose_node(1)  # the first spare dies before its restore finished

    _run(la, monitor)
    a1, a2, a3 = la.attempts
    assert (a1.slots, a2.slots, a3.slots) == ([0, 1], [0, 2], [0, 3])
    assert (a2.replaced, a3.replaced, la.lost, la.spares) == ({1: 2}, {1: 3}, [1, 2], [])
    assert a1.cause == a2.cause == "lost-node" and a3.ok
    node1 = [s for s in _jsonl(tmp_path / "starts.jsonl") if s["node"] == 1]
    assert [s["restart"] for s in node1] == [0, 2]  # the first spare never finished its restore
    restores = _restores(tmp_path)
    assert restores[-1]["step"] == 6 and restores[-1]["persistent_bytes"] == 0, restores
    assert {n: v["source"] for n, v in restores[-1]["sources"].items()} == {"0": "own-local", "1": "peer-replica"}
    assert all(s["warm"] for s in _jsonl(tmp_path / "starts.jsonl"))
    _check_losses(tmp_path, reference, {2: 6})


def _stop_node(launcher, node: int) -> list[int]:
    """SIGSTOP ``node``'s agent and ranks (a frozen host); returns the pids."""
    pids = [launcher.pool.handles[launcher.slots[node]].pid, *launcher.workers(node)]
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    return pids


def test_a_frozen_node_is_replaced_by_a_spare_within_the_hang_timeout(tmp_path, reference):
    la = _launcher(tmp_path, spares=1, hang_timeout_s=4.0)
    stopped: list[float] = []

    def monitor(launcher, a):
        if a.index == 0 and not stopped and _wait_step(tmp_path, 7, 0):
            stopped.append(time.time())
            _stop_node(launcher, 1)

    _run(la, monitor)
    a1, a2 = la.attempts
    assert (a1.cause, a1.failed_nodes, a2.replaced, a2.slots) == ("hang", [1], {1: 2}, [0, 2]), a1.hang_detail
    assert "agent silent" in a1.hang_detail
    assert 3.0 <= a1.failure_noticed - stopped[0] < 4.0 + 3.0  # hang timeout (from the last beat) + a beat or two
    assert a2.t_start - stopped[0] < 15.0
    restores = _restores(tmp_path)
    assert {n: v["source"] for n, v in restores[-1]["sources"].items()} == {"0": "own-local", "1": "peer-replica"}
    _check_losses(tmp_path, reference, {1: 6})


def test_frozen_node_frozen_rank_and_stalled_job_restart_in_place(tmp_path, reference):
    """No spare: a frozen host's agent is restarted on the same slot (disk kept: own-local); a
    rank that froze under a live agent is killed and restarted warm; a rank stuck with its
    beacon ticking stalls the job, restarted after the progress timeout."""
    la = _launcher(tmp_path, fail="1:1:7:stop,2:0:10:stall", hang_timeout_s=4.0, progress_timeout_s=6.0)
    stopped: list[int] = []

    def monitor(launcher, a):
        if a.index == 0 and not stopped and _wait_step(tmp_path, 7, 0):
            stopped.extend(_stop_node(launcher, 1))

    _run(la, monitor)
    a1, a2, a3, a4 = la.attempts
    assert (a1.cause, a1.failed_nodes) == ("hang", [1]) and "agent silent" in a1.hang_detail
    assert (a2.cause, a2.failed_nodes) == ("hang", [1]) and "stopped ticking" in a2.hang_detail
    assert a3.cause == "stall" and a4.ok, a3.hang_detail
    assert a1.slots == a2.slots == a3.slots == a4.slots == [0, 1]
    assert [r["step"] for r in _restores(tmp_path)] == [6, 6, 9]
    for r in _restores(tmp_path):
        assert {v["source"] for v in r["sources"].values()} == {"own-local"}, r
    for pid in stopped:
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]
    _check_losses(tmp_path, reference, {1: 6, 2: 6, 3: 9})
