"""launch/*.sbatch on a real Slurm cluster (tests/slurm/cluster.py: munged, slurmctld, slurmd
n1 n2 n3 on this machine, each node with its own hostname and its own "NVMe" at the same path).

Marked ``slurm``: run by ``make test-slurm`` (see conftest.py).

- ``test_launcher_*``: the launcher logic with a stand-in for the Python interpreter (each
  "node" records its command line and environment, and fails when told to), ~2 s per job plus
  10 s per requeue: fresh port per attempt, node ranks and master from Slurm, the restart
  counter across retries and requeues, RequeueExit, no retry after a configuration error,
  giving up after the requeue budget.
- ``test_titan_*``: the real thing — torchtitan's llama3 debug model through
  ``launch/titan.sbatch`` on 2 nodes × 1 CPU rank (FSDP2 over gloo), node 1's training process
  SIGKILLed after a replicated local checkpoint. Once with an in-allocation retry (node 1's
  disk wiped too) and once with a requeue that swaps the failed node for the spare: each time
  the job restores node 1 from its neighbour's replica, finishes, and the ledger shows exactly
  one failure, one restore and a clean end.
- ``test_titan_preemption_*``: a preemption notice to the batch script at a random step; the
  job saves there, is requeued once and resumes at that step with bitwise the losses of an
  uninterrupted run.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.slurm.conftest import REPO

pytestmark = pytest.mark.slurm

TITAN = str(REPO / "launch" / "titan.sbatch")


# ------------------------------------------------------------------------------------- helpers
def submit(cluster, script: str, out: Path, env: dict[str, str], args=(), nodes: int = 2,
           sbatch_args: tuple[str, ...] = ()) -> int:
    e = cluster.env()
    e.update(env)
    r = subprocess.run(["sbatch", "--parsable", "-N", str(nodes), *sbatch_args, "-o", str(out), script, *args],
                       env=e, cwd=str(REPO), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return int(r.stdout.strip().split(";")[0])


def job_info(cluster, jobid: int) -> dict[str, str]:
    r = subprocess.run(["scontrol", "show", "job", "-o", str(jobid)], env=cluster.env(),
                       capture_output=True, text=True)
    return dict(re.findall(r"(\w+)=(\S*)", r.stdout))


def wait_done(cluster, jobid: int, timeout: float, out: Path) -> dict[str, str]:
    deadline = time.time() + timeout
    while time.time() < deadline:
        info = job_info(cluster, jobid)
        if info.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
            return info
        time.sleep(0.5)
    subprocess.run(["scancel", str(jobid)], env=cluster.env())
    pytest.fail(f"job {jobid} not finished after {timeout:.0f}s: {job_info(cluster, jobid)}\n{_tail(out)}")


def _tail(path: Path, n: int = 6000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def events(state: Path) -> list[dict[str, str]]:
    """The launcher's event log: one dict per line (``kind`` + key=value fields)."""
    out = []
    for line in (state / "events").read_text().splitlines():
        parts = line.split(" ", 2)
        rec = {"time": parts[0], "kind": parts[1]}
        rec.update(re.findall(r'(\w+)=("[^"]*"|\S+)', parts[2] if len(parts) > 2 else ""))
        out.append(rec)
    return out


def no_leftovers(cluster, timeout: float = 30.0) -> None:
    """Every job process (batch script, steps, torchrun, workers) is gone."""
    deadline = time.time() + timeout
    while cluster.namespace_pids() and time.time() < deadline:
        time.sleep(0.5)
    left = {p: _cmdline(p) for p in cluster.namespace_pids()}
    assert not left, f"processes left in the nodes' namespaces: {left}"


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


# A stand-in for the Python interpreter: called as `python -m torch.distributed.run <torchrun
# options> -m titan_plugin.train …` on every node. It records what it got and fails as FAKE_FAIL
# says ("<restart count>:<node rank>:<signal|crash|config>", comma-separated), printing the
# failure summary torchrun prints, so the node wrapper classifies it like a real one. Like
# torchrun's rendezvous, every node waits for the others before anything happens.
FAKE = r"""#!/bin/bash
rank=; port=; addr=; nnodes=
for a in "$@"; do case "$a" in
  --node-rank=*) rank=${a#*=} ;; --master-port=*) port=${a#*=} ;; --master-addr=*) addr=${a#*=} ;;
  --nnodes=*) nnodes=${a#*=} ;; esac; done
printf '{"host": "%s", "node_rank": %s, "nnodes": %s, "port": %s, "addr": "%s", "restart_count": %s, "slurm_restart": "%s", "slurm_nodeid": %s, "args": "%s"}\n' \
  "$(hostname)" "$rank" "$nnodes" "$port" "$addr" "$TIERCKPT_RESTART_COUNT" "${SLURM_RESTART_COUNT:-}" "$SLURM_NODEID" "$*" >> "$FAKE_LOG"
# a rendezvous, as torchrun has: no node fails before every node of the attempt has started
for i in $(seq 200); do
  [ "$(grep -c "\"restart_count\": $TIERCKPT_RESTART_COUNT," "$FAKE_LOG")" -ge "$nnodes" ] && break
  sleep 0.1
done
IFS=, read -ra plan <<< "${FAKE_FAIL:-}"
for p in "${plan[@]}"; do
  IFS=: read -r rc r mode <<< "$p"
  if [ "$rc" = "$TIERCKPT_RESTART_COUNT" ] && [ "$r" = "$rank" ]; then
    case "$mode" in signal) code=-9 ;; config) code=2 ;; *) code=1 ;; esac
    printf 'Root Cause (first observed failure):\n[0]:\n  host      : %s\n  exitcode  : %s (pid: 1)\n' "$(hostname)" "$code" >&2
    exit 1
  fi
done
sleep 1
exit 0
"""


@pytest.fixture
def fake(tmp_path, slurm_cluster):
    """(submit function, log reader) running titan.sbatch with the stand-in interpreter."""
    name = tmp_path.name
    shared = Path(slurm_cluster.shared) / name
    shared.mkdir(parents=True)
    py = shared / "fake-python"
    py.write_text(FAKE)
    py.chmod(0o755)
    log = shared / "calls.jsonl"

    def run(env: dict[str, str], timeout: float = 60.0, nodes: int = 2):
        out = shared / "job.out"
        e = {"TIERCKPT_PYTHON": str(py), "FAKE_LOG": str(log), "TIERCKPT_STATE_DIR": str(shared / "state"),
             "TIERCKPT_LOCAL_ROOT": f"{slurm_cluster.nvme}/{name}", **env}
        jobid = submit(slurm_cluster, TITAN, out, e, nodes=nodes)
        info = wait_done(slurm_cluster, jobid, timeout, out)
        calls = [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []
        return info, calls, events(shared / "state"), _tail(out)

    return run


# ------------------------------------------------------------------------ launcher, stand-in
def test_launcher_retries_with_fresh_port_and_restart_count(fake):
    info, calls, ev, out = fake({"FAKE_FAIL": "0:1:signal,1:0:crash", "TIERCKPT_MAX_ATTEMPTS": "3"})
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (info, out)
    assert info["Restarts"] == "0"
    by_attempt: dict[int, list[dict]] = {}
    for c in calls:
        by_attempt.setdefault(c["restart_count"], []).append(c)
    assert sorted(by_attempt) == [0, 1, 2], calls
    ports = []
    for a, cs in sorted(by_attempt.items()):
        assert sorted((c["node_rank"], c["host"]) for c in cs) == [(0, "n1"), (1, "n2")], cs
        assert all(c["node_rank"] == c["slurm_nodeid"] and c["nnodes"] == 2 and c["addr"] == "n1" for c in cs)
        assert len({c["port"] for c in cs}) == 1  # one rendezvous per attempt
        ports.append(cs[0]["port"])
        assert "-m titan_plugin.train --toml" in cs[0]["args"] and "--max-restarts=0" in cs[0]["args"]
        assert re.search(r"--checkpoint\.local_root \S+/test_launcher_retries\w*/node-\{node\}", cs[0]["args"]), cs[0]
    assert len(set(ports)) == 3, ports  # a fresh port per attempt
    ends = [e for e in ev if e["kind"] == "end"]
    assert [e["rc"] != "0" for e in ends] == [True, True, False], ev
    assert ends[0]["failed_nodes"] == "n2"  # killed by a signal: the node is blamed
    assert ends[1]["failed_nodes"] == "-"   # an exception is not the node's fault
    assert not [e for e in ev if e["kind"] == "requeue"]


def test_launcher_requeue_exit_code(fake):
    """TIERCKPT_REQUEUE=exit: the batch script exits 75 and slurmctld (RequeueExit=75) requeues."""
    info, calls, ev, out = fake({"FAKE_FAIL": "0:0:crash", "TIERCKPT_MAX_ATTEMPTS": "1",
                                 "TIERCKPT_REQUEUE": "exit"})
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", (info, out)
    assert sorted({(c["restart_count"], c["slurm_restart"]) for c in calls}) == [(0, ""), (1, "1")], calls
    assert [e["kind"] for e in ev] == ["start", "end", "requeue", "start", "end"], ev
    assert ev[2]["mode"] == "exit" and ev[2]["code"] == "75"


def test_launcher_requeue_excludes_failed_node(fake):
    """scontrol requeue: the node whose worker was killed (n2) is swapped for the spare (n3)."""
    info, calls, ev, out = fake({"FAKE_FAIL": "0:1:signal", "TIERCKPT_MAX_ATTEMPTS": "1"})
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", (info, out)
    assert info["ExcNodeList"] == "n2" and info["NodeList"] == "n[1,3]", info
    second = sorted((c["node_rank"], c["host"]) for c in calls if c["restart_count"] == 1)
    assert second == [(0, "n1"), (1, "n3")], calls
    req = [e for e in ev if e["kind"] == "requeue"]
    assert len(req) == 1 and req[0]["mode"] == "scontrol" and req[0]["exclude"] == "n2", ev


def test_launcher_no_retry_on_config_error(fake):
    info, calls, ev, out = fake({"FAKE_FAIL": "0:0:config"})
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "2:0", (info, out)
    assert {c["restart_count"] for c in calls} == {0}
    assert ev[-1]["kind"] == "give-up" and "configuration" in ev[-1]["reason"]


def test_launcher_gives_up_after_requeue_budget(fake):
    info, calls, ev, out = fake({"FAKE_FAIL": "0:0:crash,1:0:crash", "TIERCKPT_MAX_ATTEMPTS": "2",
                                 "TIERCKPT_MAX_REQUEUES": "0"})
    assert info["JobState"] == "FAILED" and info["Restarts"] == "0", (info, out)
    assert [e["kind"] for e in ev] == ["start", "end", "start", "end", "give-up"], ev


# ------------------------------------------------------------------------------- torchtitan
STEPS, LOCAL_EVERY, KILL_AFTER = 6, 2, 2


def _titan_job(cluster, tmp_path, extra_env: dict[str, str], steps: int = STEPS, local_every: int = LOCAL_EVERY,
               persistent_every: int | None = None, nodes: int = 2, sbatch_args: tuple[str, ...] = ()):
    name = tmp_path.name
    shared = Path(cluster.shared) / name
    run = shared / "run"
    env = {"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "TIERCKPT_PYTHON": sys.executable,
           "TIERCKPT_TOML": str(REPO / "configs" / "titan_demo.toml"),
           "TIERCKPT_LOCAL_ROOT": f"{cluster.nvme}/{name}", "TIERCKPT_DUMP_FOLDER": str(run),
           "TIERCKPT_STATE_DIR": str(shared / "state"), **extra_env}
    # the real topology (torchrun's node rank), not the demo's simulated one
    args = ["--training.steps", str(steps), "--checkpoint.busy_tier_policy", "wait", "--checkpoint.local_interval", str(local_every),
            "--checkpoint.interval", str(persistent_every or steps), "--checkpoint.simulated_ranks_per_node", "0",
            "--checkpoint.job_id", name]
    out = shared / "job.out"
    shared.mkdir(parents=True)
    from tierckpt_dev.titan.assets import ensure_assets

    ensure_assets()  # built once here, not by both ranks
    jobid = submit(cluster, TITAN, out, env, args, nodes=nodes, sbatch_args=sbatch_args)
    return jobid, shared, run, out


def _jsonl(path: Path) -> list[dict]:
    out = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out


def _ppid(p: int) -> int:
    try:
        return int(Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return -1


def _agent_family(cluster, host: str) -> list[int]:
    return [p for p in cluster.namespace_pids(host) if "tierckpt.recovery.agent" in _cmdline(p)
            and not _cmdline(p).startswith("srun")]


def _warm_agent(cluster, host: str) -> list[int]:
    """The node agent on ``host`` (its ranks are forked from it and share its command line:
    the agent is the one whose parent is not an agent)."""
    pids = _agent_family(cluster, host)
    return [p for p in pids if _ppid(p) not in pids]


def _warm_ranks(cluster, host: str) -> list[int]:
    """The training ranks on ``host``: the agent's children (not their DataLoader workers)."""
    agents = _warm_agent(cluster, host)
    return [p for p in _agent_family(cluster, host) if _ppid(p) in agents]


def _kill_node1_after_local_step(cluster, jobid, run: Path, out: Path, node_host: str, wipe: str | None = None,
                                 timeout: float = 240.0, agent: bool = False, warm: bool = False,
                                 freeze: bool = False) -> tuple[int, int]:
    """SIGKILL the training process on ``node_host`` (``agent``: its warm node agent, which takes
    its ranks along: the host is lost) once the local step KILL_AFTER is committed and
    replicated (ledger) and rank 0 logged a later step; optionally wipe a directory (the
    node's disk) right after. ``warm``: the rank is a child of the node's agent. Returns (pid
    killed, last step logged before the kill). ``freeze``: SIGSTOP the warm agent and every
    process it forked instead (a hung host)."""
    ledger, losses = run / "checkpoint" / "tierckpt-ledger.jsonl", run / "metrics" / "losses.jsonl"
    deadline = time.time() + timeout
    while time.time() < deadline:
        if job_info(cluster, jobid).get("JobState") not in ("PENDING", "RUNNING", "CONFIGURING"):
            pytest.fail(f"job ended before the failure point: {job_info(cluster, jobid)}\n{_tail(out)}")
        ck = [r for r in _jsonl(ledger) if r.get("kind") == "checkpoint" and r.get("tier") == "local"
              and r.get("step") == KILL_AFTER]
        steps = [r["step"] for r in _jsonl(losses)]
        if ck and steps and max(steps) > KILL_AFTER:
            assert ck[0]["ok"] and not ck[0].get("replicas_failed"), ck
            victims = _warm_agent(cluster, node_host) if agent else _warm_ranks(cluster, node_host) if warm else [
                p for p in cluster.namespace_pids(node_host)
                if "titan_plugin.train" in _cmdline(p) and "torch.distributed.run" not in _cmdline(p)
                and not _cmdline(p).startswith("bash")]
            if freeze:
                family = _agent_family(cluster, node_host)
                assert len(_warm_agent(cluster, node_host)) == 1 and len(family) >= 2, family
                for p in family:
                    os.kill(p, signal.SIGSTOP)
                return family[0], max(steps)
            assert len(victims) == 1, {p: _cmdline(p) for p in victims}
            os.kill(victims[0], signal.SIGKILL)
            if wipe:
                shutil.rmtree(wipe)
            return victims[0], max(steps)
        time.sleep(0.2)
    pytest.fail(f"local step {KILL_AFTER} not committed within {timeout:.0f}s\n{_tail(out)}")


def _check_ledger_and_losses(run: Path, killed_at: int, restart_counts: list[int]) -> dict:
    from tierckpt.history.ledger import Ledger, summarize
    from tierckpt.io.storage import Store

    recs = Ledger.read(Store(str(run / "checkpoint")))
    s = summarize(recs)
    assert [r["restart_count"] for r in s["runs"]] == restart_counts, s["runs"]
    assert len(s["failures"]) == 1 and s["failures"][0]["run_id"] == s["runs"][0]["run_id"], s["failures"]
    assert s["runs"][-1]["clean"] is True, s["runs"]
    assert len(s["restores"]) == 1, s["restores"]
    rest = s["restores"][0]
    assert rest["run_id"] == s["runs"][1]["run_id"]
    assert rest["step"] in (KILL_AFTER, KILL_AFTER + LOCAL_EVERY) and rest["step"] < killed_at, rest
    assert rest["persistent_bytes"] == 0, rest
    # every step ran, and a step run by both attempts (after the restore) has the same loss bitwise
    by_pid: dict[int, dict[int, str]] = {}
    for r in _jsonl(run / "metrics" / "losses.jsonl"):
        by_pid.setdefault(r["pid"], {})[r["step"]] = r["loss_hex"]
    first, second = list(by_pid.values())
    assert sorted(second) == list(range(rest["step"] + 1, STEPS + 1)), second
    again = sorted(set(first) & set(second))
    assert again and all(first[k] == second[k] for k in again), (first, second)
    ck = {(r["tier"], r["step"]) for r in recs if r["kind"] == "checkpoint" and r.get("ok")}
    assert ("persistent", STEPS) in ck and ("local", STEPS) in ck, ck
    return rest


@pytest.mark.parametrize("agents", ["torchrun", "warm"])
def test_titan_in_allocation_retry_restores_from_replica(slurm_cluster, tmp_path, agents):
    """Node 1's training process is SIGKILLed and its disk wiped; the next attempt, in the same
    allocation, restores node 1 from n1's replica. ``warm``: the node agent on n2 survives and
    forks the new rank from its warm interpreter."""
    t0 = time.time()
    jobid, shared, run, out = _titan_job(slurm_cluster, tmp_path, {"TIERCKPT_MAX_ATTEMPTS": "2",
                                                                   "TIERCKPT_AGENTS": agents})
    # node 1 runs on n2; its disk (everything under the local root) goes with the process
    disk = Path(slurm_cluster.disk("n2")) / tmp_path.name
    pid, killed_at = _kill_node1_after_local_step(slurm_cluster, jobid, run, out, "n2", wipe=str(disk),
                                                  warm=agents == "warm")
    info = wait_done(slurm_cluster, jobid, 300, out)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0" and info["Restarts"] == "0", (info, _tail(out))
    ev = events(shared / "state")
    starts = [e for e in ev if e["kind"] == "start"]
    assert [e["restart_count"] for e in starts] == ["0", "1"] and starts[0]["port"] != starts[1]["port"], ev
    assert [e for e in ev if e["kind"] == "end"][0]["failed_nodes"] == "n2", ev
    rest = _check_ledger_and_losses(run, killed_at, [0, 1])
    assert {n: v["source"] for n, v in rest["sources"].items()} == {"0": "own-local", "1": "peer-replica"}, rest
    if agents == "warm":
        from tierckpt.history.ledger import Ledger, summarize
        from tierckpt.io.storage import Store

        recs = summarize(Ledger.read(Store(str(run / "checkpoint"))))["recoveries"]
        assert len(recs) == 1 and recs[0]["warm"] is True and recs[0]["failed_nodes"] == [1], recs
        assert not recs[0].get("replaced"), recs
    no_leftovers(slurm_cluster)
    print(f"in-allocation retry ({agents}): {time.time() - t0:.1f}s")


def test_titan_requeue_swaps_failed_node_restores_from_replica(slurm_cluster, tmp_path):
    t0 = time.time()
    jobid, shared, run, out = _titan_job(slurm_cluster, tmp_path, {"TIERCKPT_MAX_ATTEMPTS": "1"})
    pid, killed_at = _kill_node1_after_local_step(slurm_cluster, jobid, run, out, "n2")
    info = wait_done(slurm_cluster, jobid, 300, out)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (info, _tail(out))
    assert info["Restarts"] == "1" and info["ExcNodeList"] == "n2" and info["NodeList"] == "n[1,3]", info
    ev = events(shared / "state")
    assert [e["kind"] for e in ev] == ["start", "end", "requeue", "start", "end"], ev
    assert ev[3]["slurm_restart"] == "1" and ev[3]["restart_count"] == "1"
    # node 1 now runs on n3, whose disk never held anything: its state comes from n1's replica
    rest = _check_ledger_and_losses(run, killed_at, [0, 1])
    assert {n: v["source"] for n, v in rest["sources"].items()} == {"0": "own-local", "1": "peer-replica"}, rest
    no_leftovers(slurm_cluster)
    print(f"requeue: {time.time() - t0:.1f}s")


@pytest.mark.parametrize("how", ["lost", "frozen"])
def test_titan_warm_agents_spare_takes_over_node(slurm_cluster, tmp_path, how):
    """TIERCKPT_AGENTS=warm, TIERCKPT_SPARES=1 on 3 nodes. ``lost``: node 1's host (n2) is lost
    with its disk — its agent, and with it its ranks, SIGKILLed, its NVMe wiped. ``frozen``:
    n2's agent and ranks are SIGSTOPped (a hung host: nothing exits) and found by the hang watch
    within TIERCKPT_HANG_TIMEOUT (default 10 s). Inside the same allocation (no requeue) the
    spare n3 takes over node id 1, its ranks forked warm, and restores node 1's shards from
    n1's replica; the job stays at 2 nodes, reads no persistent byte, every step run twice has
    the same loss bitwise, and nothing is left running on n2."""
    t0 = time.time()
    jobid, shared, run, out = _titan_job(slurm_cluster, tmp_path, {"TIERCKPT_MAX_ATTEMPTS": "2",
                                                                   "TIERCKPT_AGENTS": "warm", "TIERCKPT_SPARES": "1"},
                                         nodes=3, sbatch_args=("--no-kill",))
    disk = Path(slurm_cluster.disk("n2")) / tmp_path.name
    if how == "lost":
        pid, killed_at = _kill_node1_after_local_step(slurm_cluster, jobid, run, out, "n2", wipe=str(disk),
                                                      agent=True)
    else:
        pid, killed_at = _kill_node1_after_local_step(slurm_cluster, jobid, run, out, "n2", freeze=True)
        t_frozen = time.time()
    info = wait_done(slurm_cluster, jobid, 300, out)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0" and info["Restarts"] == "0", (info, _tail(out))
    ev = events(shared / "state")
    assert [e["kind"] for e in ev] == ["start", "end", "start", "end"], ev
    assert ev[0]["nodes"] == "n1,n2" and ev[0]["agents"] == "warm" and ev[0]["replaced"] == "-", ev
    assert ev[1]["failed_nodes"] == "n2" and ev[1]["rc"] != "0", ev
    assert ev[1]["cause"] == ("hang" if how == "frozen" else "node-failure"), ev
    if how == "frozen":
        assert int(ev[1]["time"]) - t_frozen < 30, (ev, t_frozen)  # replaced within 30 s (hang timeout 10 s)
    assert ev[2]["nodes"] == "n1,n3" and ev[2]["replaced"] == "1:n3" and ev[2]["restart_count"] == "1", ev
    assert ev[3]["rc"] == "0", ev
    rest = _check_ledger_and_losses(run, killed_at, [0, 1])
    assert {n: v["source"] for n, v in rest["sources"].items()} == {"0": "own-local", "1": "peer-replica"}, rest
    from tierckpt.history.ledger import Ledger, summarize
    from tierckpt.io.storage import Store

    recs = summarize(Ledger.read(Store(str(run / "checkpoint"))))["recoveries"]
    assert len(recs) == 1 and recs[0]["warm"] is True and recs[0]["failed_nodes"] == [1], recs
    assert recs[0]["replaced"] == {"1": "spare n3"}, recs
    assert recs[0]["total_s"] is not None and recs[0]["total_s"] < 60, recs
    assert Path(slurm_cluster.disk("n3"), tmp_path.name, "node-1").is_dir()  # the spare's own disk holds node 1 now
    no_leftovers(slurm_cluster)
    print(f"warm spare ({how}): failure noticed -> first step {recs[0]['total_s']:.2f} s; "
          f"whole test {time.time() - t0:.1f}s")


# ------------------------------------------------------------------------------- preemption
PRE_STEPS, PRE_LOCAL_EVERY = 12, 2


def _reference_losses(tmp_path) -> dict[int, str]:
    """Losses of an uninterrupted run of the same job (2 ranks on this machine, outside Slurm:
    the same world size, seed and data; the node layout only places checkpoints)."""
    from tests.harness import free_port

    ref = tmp_path / "reference"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           "-m", "titan_plugin.train", "--toml", str(REPO / "configs" / "titan_demo.toml"),
           "--dump_folder", str(ref / "run"), "--checkpoint.local_root", str(ref / "nvme" / "node-{node}"),
           "--training.steps", str(PRE_STEPS), "--checkpoint.busy_tier_policy", "wait", "--checkpoint.local_interval", str(PRE_STEPS),
           "--checkpoint.interval", str(PRE_STEPS)]
    r = subprocess.run(cmd, cwd=str(REPO), capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return {x["step"]: x["loss_hex"] for x in _jsonl(ref / "run" / "metrics" / "losses.jsonl")}


@pytest.mark.parametrize("how", ["notice", "scontrol-requeue"])
def test_titan_preemption_saves_requeues_and_resumes_there(slurm_cluster, tmp_path, how):
    """A preemption at a random point between two local checkpoints. ``notice``:
    `#SBATCH --signal=B:USR1@…` as Slurm delivers it (`scancel --batch --signal=USR1`: the batch
    script only); the launcher forwards SIGTERM to the training step and requeues the job itself
    — it does not retry in the allocation. ``scontrol-requeue``: Slurm requeues the job and
    SIGTERMs all of its processes, SIGKILL after KillWait; the launcher leaves the requeue to
    Slurm. Either way every rank saves at the same step S (local + replica, persistent within
    the grace period) and exits 75; the requeued job restores S from the node-local tier (same
    nodes: no persistent read), runs S+1..12, and every loss is bitwise the uninterrupted run's."""
    import random

    t0 = time.time()
    jobid, shared, run, out = _titan_job(slurm_cluster, tmp_path, {"TIERCKPT_MAX_ATTEMPTS": "3"},
                                         steps=PRE_STEPS, local_every=PRE_LOCAL_EVERY, persistent_every=PRE_STEPS)
    after = random.choice(range(PRE_LOCAL_EVERY, PRE_STEPS - 3, PRE_LOCAL_EVERY))  # local step 2, 4, 6 or 8
    ledger, losses = run / "checkpoint" / "tierckpt-ledger.jsonl", run / "metrics" / "losses.jsonl"
    deadline = time.time() + 300
    while True:
        info = job_info(slurm_cluster, jobid)
        assert info.get("JobState") in ("PENDING", "RUNNING", "CONFIGURING"), (info, _tail(out))
        assert time.time() < deadline, f"local step {after} not committed in time\n{_tail(out)}"
        ck = [r for r in _jsonl(ledger) if r.get("kind") == "checkpoint" and r.get("tier") == "local"
              and r.get("step") == after and r.get("ok")]
        logged = [r["step"] for r in _jsonl(losses)]
        if ck and logged and max(logged) > after:
            break
        time.sleep(0.2)
    cmd = ["scancel", "--batch", "--signal=USR1"] if how == "notice" else ["scontrol", "requeue"]
    r = subprocess.run([*cmd, str(jobid)], env=slurm_cluster.env(), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    signalled_after = max(r["step"] for r in _jsonl(losses))
    info = wait_done(slurm_cluster, jobid, 420, out)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0" and info["Restarts"] == "1", (info, _tail(out))
    ev = events(shared / "state")
    sig = "SIGUSR1" if how == "notice" else "SIGTERM"
    then = "requeue" if how == "notice" else "slurm-ends"
    assert [e["kind"] for e in ev] == ["start", "notice", "end", then, "start", "end"], ev
    assert ev[1]["signal"] == sig and ev[2]["preempted"] == sig and ev[4]["slurm_restart"] == "1", ev
    if how == "notice":
        assert ev[3]["mode"] == "scontrol" and ev[3]["exclude"] == "-", ev

    from tierckpt.history.ledger import Ledger, summarize
    from tierckpt.io.storage import Store

    recs = Ledger.read(Store(str(run / "checkpoint")))
    pre = [x for x in recs if x["kind"] == "preemption"]
    assert len(pre) == 1 and pre[0]["signal"] == "SIGTERM", pre
    step = pre[0]["step"]
    assert signalled_after <= step < PRE_STEPS and pre[0]["committed"]["local"] is True, (pre, signalled_after)
    s = summarize(recs)
    assert [x["restart_count"] for x in s["runs"]] == [0, 1], s["runs"]
    assert [x["clean"] for x in s["runs"]] == [True, True] and not s["failures"], s["runs"]  # a planned exit
    ends = [x for x in recs if x["kind"] == "run_end"]
    assert ends[0]["run_id"] == s["runs"][0]["run_id"] and ends[0]["durable_step"] == step, ends
    ok = {(x["tier"], x["step"]) for x in recs if x["kind"] == "checkpoint" and x.get("ok")}
    assert ("local", step) in ok and (("persistent", step) in ok) == pre[0]["committed"]["persistent"], ok
    assert len(s["restores"]) == 1, s["restores"]
    rest = s["restores"][0]
    assert rest["run_id"] == s["runs"][1]["run_id"] and rest["step"] == step, rest
    assert info["NodeList"] == "n[1-2]"  # the same nodes: both come back from their own NVMe
    assert {n: v["source"] for n, v in rest["sources"].items()} == {"0": "own-local", "1": "own-local"}, rest
    assert rest["persistent_bytes"] == 0, rest
    # every step ran once; the first attempt stopped at S, the requeued one went on from S + 1
    by_pid: dict[int, dict[int, str]] = {}
    for x in _jsonl(losses):
        by_pid.setdefault(x["pid"], {})[x["step"]] = x["loss_hex"]
    first, second = list(by_pid.values())
    assert sorted(first) == list(range(1, step + 1)) and sorted(second) == list(range(step + 1, PRE_STEPS + 1)), by_pid
    assert ("persistent", PRE_STEPS) in ok and ("local", PRE_STEPS) in ok, ok
    no_leftovers(slurm_cluster)
    want = _reference_losses(tmp_path)
    got = {**first, **second}
    assert got == want, {k: (want.get(k), got.get(k)) for k in sorted(set(want) | set(got)) if want.get(k) != got.get(k)}
    print(f"preemption after step {signalled_after}, saved at {step}: {time.time() - t0:.1f}s")
