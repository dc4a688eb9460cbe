"""Leaving without close() (tierckpt/exit.py): real rank processes that save step 30 and then
return from main, raise, sys.exit(0) or sys.exit(3) through the interpreter's normal exit (not the
forkserver harness, whose entry point catches and reports); the step is committed in every
tier, restorable bitwise, the exit status is the script's own, nothing aborts, and the
ledger's run_end says what happened."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.exit_script import phase_restore
from tests.harness import ROOT, free_port, run_world


def run_ranks(base: str, mode: str, world: int = 2, timeout: float = 300) -> list[subprocess.CompletedProcess]:
    """Run tests/exit_script.py on ``world`` processes (torchrun's environment, one node per
    rank); their exit statuses and output."""
    port = free_port()
    procs = []
    for r in range(world):
        env = {**os.environ, "PYTHONPATH": ROOT, "PYTHONFAULTHANDLER": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world)}
        procs.append(subprocess.Popen([sys.executable, "-m", "tests.exit_script", base, mode], cwd=ROOT, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    out = []
    try:
        for p in procs:
            text, _ = p.communicate(timeout=timeout)
            out.append(subprocess.CompletedProcess(p.args, p.returncode, text))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return out


def committed(base: str) -> set[str]:
    """Every committed copy of step 30: ``local node-n``, ``replica node-n@node-m``, ``persistent``."""
    found = set()
    for n in (0, 1):
        if os.path.exists(os.path.join(base, "nvme", f"node-{n}", "local", "step-30", "tierckpt.committed")):
            found.add(f"local node-{n}")
        for m in (0, 1):
            if os.path.exists(os.path.join(base, "nvme", f"node-{m}", "replicas", f"node-{n}", "step-30",
                                           "tierckpt.committed")):
                found.add(f"replica node-{n}@node-{m}")
    if os.path.exists(os.path.join(base, "pfs", "step-30", "tierckpt.committed")):
        found.add("persistent")
    return found


@pytest.mark.parametrize("mode,status", [("return", 0), ("sys_exit", 0), ("sys_exit_3", 3), ("raise", 1),
                                         ("raise_one", 1)])
def test_exit_without_close_finishes_the_save(tmp_path, mode, status):
    base = str(tmp_path)
    ranks = run_ranks(base, mode)
    for r, cp in enumerate(ranks):
        assert "terminate called" not in cp.stdout, f"rank {r}:\n{cp.stdout[-4000:]}"
        assert cp.returncode == status, f"rank {r}: exit {cp.returncode}, expected {status}:\n{cp.stdout[-4000:]}"
    assert committed(base) == {"local node-0", "local node-1", "replica node-0@node-1", "replica node-1@node-0",
                               "persistent"}, ranks[0].stdout[-4000:]
    with open(os.path.join(base, "pfs", "tierckpt-ledger.jsonl")) as f:
        lines = [json.loads(x) for x in f if x.strip()]
    first_run = lines[0]["run_id"]
    ends = [x for x in lines if x["kind"] == "run_end" and x["run_id"] == first_run]
    assert len(ends) == 1, lines
    end = ends[0]
    assert end["exit"] == "without close()" and end["durable_step"] == 30 and "unfinished" not in end, end
    # a process that finished its saves and exited 0 is not a failure; one that raised or
    # exited with an error status is (its saves are still finished, above)
    assert end["clean"] is (status == 0), end
    if mode == "raise":
        assert "RuntimeError: trainer failed on rank 0 after save(30)" in end["reason"], end
    if mode == "sys_exit_3":
        assert end["reason"] == "interpreter exit without close(): sys.exit(3)", end
    saves = {(x["tier"], x["step"]) for x in lines if x["kind"] == "checkpoint" and x.get("ok")}
    assert {("local", 30), ("persistent", 30)} <= saves, saves
    res = run_world(phase_restore, 2, base, timeout=300)
    for r in res:
        assert r.value["by_kind"] == {"own-local": (30, ["own-local"]), "peer-replica": (30, ["peer-replica"]),
                                      "persistent": (30, ["persistent"])}, r.value
        assert r.value["default"] == 30, r.value


def test_exit_without_close_names_a_save_it_gave_up_on(tmp_path):
    """The persistent write of step 30 hangs for good: the exit waits exit_timeout_s (5 s), then
    leaves it uncommitted, named in a warning and in run_end.unfinished (not clean); the local
    tier's step 30 is committed and restored; the exit status is still the script's 0."""
    base = str(tmp_path)
    ranks = run_ranks(base, "hung_persistent")
    for r, cp in enumerate(ranks):
        assert "terminate called" not in cp.stdout and cp.returncode == 0, \
            f"rank {r}: {cp.returncode}\n{cp.stdout[-4000:]}"
    assert "left uncommitted: persistent save of step 30 (still running after exit_timeout_s = 5s)" in ranks[0].stdout
    assert committed(base) == {"local node-0", "local node-1", "replica node-0@node-1", "replica node-1@node-0"}
    with open(os.path.join(base, "pfs", "tierckpt-ledger.jsonl")) as f:
        end = [json.loads(x) for x in f if '"run_end"' in x][0]
    assert end["exit"] == "without close()" and end["clean"] is False and end["durable_step"] == 20, end
    assert end["unfinished"] == [{"tier": "persistent", "step": 30, "job": "save",
                                  "error": "still running after exit_timeout_s = 5s"}], end
    assert end["stuck_tiers"] == ["persistent"], end
    res = run_world(phase_restore, 2, base, ("own-local", "peer-replica"), timeout=300)
    for r in res:
        assert r.value["default"] == 30, r.value


def test_exit_without_close_names_every_job_a_lane_holds(tmp_path):
    """The local lane holds two jobs at the exit: the replica rebuild after a restore, hung for
    good, and the local save of step 30 queued behind it (``local_wait_timeout_s = 0``). Both
    are named in run_end.unfinished, in queue order (the old exit hook looked at the last job
    queued only and named the save alone); the persistent step 30 is committed and durable."""
    base = str(tmp_path)
    ranks = run_ranks(base, "hung_rebuild")
    for r, cp in enumerate(ranks):
        assert "terminate called" not in cp.stdout and cp.returncode == 0, \
            f"rank {r}: {cp.returncode}\n{cp.stdout[-4000:]}"
    assert ("left uncommitted: local replica rebuild (still running after exit_timeout_s = 5s); "
            "local save of step 30 (still running after exit_timeout_s = 5s)") in ranks[0].stdout, ranks[0].stdout[-3000:]
    assert "persistent" in committed(base)
    with open(os.path.join(base, "pfs", "tierckpt-ledger.jsonl")) as f:
        end = [json.loads(x) for x in f if '"run_end"' in x][0]
    still = "still running after exit_timeout_s = 5s"
    assert end["unfinished"] == [{"tier": "local", "step": None, "job": "replica rebuild", "error": still},
                                 {"tier": "local", "step": 30, "job": "save", "error": still}], end
    assert end["clean"] is False and end["durable_step"] == 30 and end["stuck_tiers"] == ["local"], end


def test_the_sys_exit_wrapper_notes_the_main_threads_status():
    """``sys.exit`` as tierckpt.exit wraps it: the main thread's status is noted (a thread's
    sys.exit ends only that thread and is not), then the original raises SystemExit;
    ``error_status`` tells 0/None from every other status."""
    import threading

    from tierckpt import exit as ex

    seen: list = []
    wrapped = ex._noting_exit(lambda status=None: seen.append(status) or (_ for _ in ()).throw(SystemExit(status)))
    saved = list(ex._exit_calls)
    try:
        with pytest.raises(SystemExit):
            wrapped(3)
        assert ex._exit_calls == [3] and seen == [3]
        t = threading.Thread(target=lambda: pytest.raises(SystemExit, wrapped, 5))
        t.start()
        t.join()
        assert ex._exit_calls == [3] and seen == [3, 5]
    finally:
        ex._exit_calls[:] = saved
    assert not ex.error_status(None) and not ex.error_status(0)
    assert ex.error_status(3) and ex.error_status("bad config") and ex.error_status(-1)
