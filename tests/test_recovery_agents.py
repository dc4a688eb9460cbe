"""The mechanics of warm node agents (tierckpt.recovery: beacon, warm, agent, child, pool, nodes),
each on its own and fast; the launcher's end-to-end scenarios are tests/test_warm_recovery.py
and tests/test_launch_local.py.

- beacon: zeroed file, ticking thread of a real process (stops when it is SIGSTOPped), step
  reports, best-effort failures;
- warm: fork_problems (clean after ``import torch``; a thread, a CUDA context, a process group,
  an OpenMP pool), preload (CUDA-safe environment, failed imports recorded), the rank's thread
  count, run_argv (``-m``/script as ``__main__``, exit statuses like an interpreter's);
- real agents through AgentPool: per-rank statuses over consecutive attempts, NodeStatus, signal
  and kill of the ranks' process groups, warm vs cold ranks, the cold fallback, an agent
  SIGKILLed or SIGSTOPped, close(), strangers without the key;
- HangWatch verdicts on fake handles with a fake clock; rank_env; AgentAttempt.start's env.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import types
from multiprocessing.connection import Client
from pathlib import Path

import pytest

from tierckpt.preemption import PREEMPTED_EXIT
from tierckpt.recovery import beacon, nodes, warm
from tierckpt.recovery import pool as pool_mod
from tierckpt.recovery.nodes import AgentAttempt, NodeStatus, rank_env
from tierckpt.recovery.pool import AgentHandle, AgentPool, HangWatch, Verdict

REPO = Path(__file__).resolve().parent.parent
PY = sys.executable

pytestmark = pytest.mark.timeout(120)


# -- helpers -----------------------------------------------------------------------------------
def _alive(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rpartition(")")[2].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")


def _wait_gone(pids, timeout: float = 10.0) -> list[int]:
    """The pids still alive after ``timeout`` seconds ([] when all went)."""
    deadline = time.monotonic() + timeout
    left = list(pids)
    while left and time.monotonic() < deadline:
        left = [p for p in left if _alive(p)]
        if left:
            time.sleep(0.02)
    return left


def _sub_env(**extra) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in (beacon.BEACON_ENV, warm.NVML_CHECK_ENV)}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def _py(code: str, *, env: dict[str, str] | None = None, timeout: float = 60.0, cwd=None) -> str:
    """Run ``code`` in a new interpreter; returns its stdout (asserts status 0)."""
    p = subprocess.run([PY, "-c", code], env=env or _sub_env(), capture_output=True, text=True, timeout=timeout,
                       cwd=cwd)
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout


# -- 1. beacon ---------------------------------------------------------------------------------
BEACON_RANK = r"""
import json, os, sys, threading, time
from tierckpt.recovery import beacon
first = beacon.start_from_env(interval_s=0.05)
again = beacon.start_from_env(interval_s=0.05)
t0 = time.time()
beacon.report_progress(int(sys.argv[1]))
print(json.dumps({"first": first, "again": again, "t0": t0, "t1": time.time(), "pid": os.getpid(),
                  "threads": sum(t.name == "tierckpt-beacon" for t in threading.enumerate())}), flush=True)
while True:
    time.sleep(0.05)
"""


def _max_age(reader: beacon.BeaconReader, seconds: float) -> tuple[float, set[int]]:
    """Read for ``seconds``: the largest alive_age_s seen and the alive values seen."""
    end, worst, seen = time.monotonic() + seconds, 0.0, set()
    while time.monotonic() < end:
        s = reader.read()
        worst = max(worst, s.alive_age_s)
        seen.add(s.alive)
        time.sleep(0.01)
    return worst, seen


def test_beacon_zeros_ticks_progress_and_stop(tmp_path):
    path = str(tmp_path / "r0.beacon")
    beacon.create(path)
    assert os.path.getsize(path) == beacon.SIZE == 32
    reader = beacon.BeaconReader(path)
    s = reader.read()
    assert (s.alive, s.step, s.progress_at) == (0, -1, 0.0)
    assert beacon.struct.unpack_from("<Q", reader.map, 24)[0] == 0  # no pid yet
    time.sleep(0.3)
    assert reader.read().alive_age_s >= 0.3  # counted from the reader's creation until a first tick
    proc = subprocess.Popen([PY, "-c", BEACON_RANK, "42"], env=_sub_env(**{beacon.BEACON_ENV: path}),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        info = json.loads(proc.stdout.readline())
        assert info["first"] is True and info["again"] is True
        assert info["threads"] == 1  # idempotent: one ticking thread
        deadline = time.monotonic() + 10
        while reader.read().alive < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        s = reader.read()
        assert s.alive >= 3
        assert s.step == 42
        assert info["t0"] <= s.progress_at <= info["t1"]
        assert beacon.struct.unpack_from("<Q", reader.map, 24)[0] == proc.pid
        worst, seen = _max_age(reader, 0.5)
        assert worst < 0.5 and len(seen) >= 3, (worst, seen)  # it ticks while the process runs
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            _max_age(reader, 0.1)  # the tick of the stop's moment, if any
            worst, seen = _max_age(reader, 1.0)
            assert len(seen) == 1 and worst >= 0.9, (worst, seen)  # a stopped process ticks no more
            assert reader.read().step == 42
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        deadline = time.monotonic() + 5
        while reader.read().alive_age_s > 0.3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert reader.read().alive_age_s <= 0.3  # ticks again once continued
    finally:
        proc.kill()
        proc.wait()
        reader.close()


def test_beacon_without_env_is_off(tmp_path, monkeypatch):
    monkeypatch.setattr(beacon, "_mine", None)
    path = str(tmp_path / "b")
    beacon.create(path)
    reader = beacon.BeaconReader(path)
    monkeypatch.delenv(beacon.BEACON_ENV, raising=False)
    assert beacon.start_from_env() is False
    monkeypatch.setenv(beacon.BEACON_ENV, "   ")
    assert beacon.start_from_env() is False
    beacon.report_progress(9)  # no beacon: a no-op
    assert beacon._mine is None
    assert reader.read().step == -1
    assert not [t for t in threading.enumerate() if t.name == "tierckpt-beacon"]
    reader.close()


@pytest.mark.parametrize("kind", ["missing", "empty", "directory"])
def test_beacon_unmappable_warns(tmp_path, monkeypatch, caplog, kind):
    monkeypatch.setattr(beacon, "_mine", None)
    path = tmp_path / "x.beacon"
    if kind == "empty":
        path.write_bytes(b"")
    elif kind == "directory":
        path.mkdir()
    monkeypatch.setenv(beacon.BEACON_ENV, str(path))
    with caplog.at_level(logging.WARNING, logger="tierckpt.recovery.beacon"):
        assert beacon.start_from_env() is False
    assert beacon._mine is None
    msgs = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(msgs) == 1 and "cannot map the beacon" in msgs[0] and str(path) in msgs[0], msgs
    beacon.report_progress(3)  # still a no-op
    assert beacon._mine is None


# -- 2. warm: fork_problems, preload, thread count ----------------------------------------------
TORCH_PROBE = r"""
import json, os, threading
import torch, torch.distributed
from tierckpt.recovery import warm
out = {"clean": warm.fork_problems(), "aff": len(os.sched_getaffinity(0)), "n0": torch.get_num_threads()}
real = torch.cuda.is_initialized
torch.cuda.is_initialized = lambda: True
out["cuda"] = warm.fork_problems()
def broken():
    raise RuntimeError("no driver")
torch.cuda.is_initialized = broken
out["cuda_broken"] = warm.fork_problems()
torch.cuda.is_initialized = real
real = torch.distributed.is_initialized
torch.distributed.is_initialized = lambda: True
out["dist"] = warm.fork_problems()
torch.distributed.is_initialized = real
out["clean_again"] = warm.fork_problems()
a = out["aff"]
counts = []
for omp in (str(a + 1), "0", str(a + 2), None, "x"):
    warm._match_thread_count({} if omp is None else {"OMP_NUM_THREADS": omp})
    counts.append(torch.get_num_threads())
out["counts"] = counts
x = torch.randn(1500, 1500)
(x @ x).sum()  # an OpenMP pool of a + 2 threads now exists
out["omp_pool"] = warm.fork_problems()
print(json.dumps(out))
"""


def test_fork_problems_and_thread_count_with_torch():
    pytest.importorskip("torch")
    out = json.loads(_py(TORCH_PROBE, env=_sub_env(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")).splitlines()[-1])
    assert out["clean"] == [] and out["clean_again"] == []
    assert out["n0"] == 1
    assert len(out["cuda"]) == 1 and "CUDA" in out["cuda"][0]
    assert len(out["cuda_broken"]) == 1 and "RuntimeError: no driver" in out["cuda_broken"][0]
    assert out["dist"] == ["torch.distributed is initialised in the agent"]
    a = out["aff"]
    assert out["counts"] == [a + 1, a, a + 2, a, a]
    assert len(out["omp_pool"]) == 1 and out["omp_pool"][0].startswith("native threads besides the main one")


def test_fork_problems_names_a_python_thread():
    stop = threading.Event()
    t = threading.Thread(target=stop.wait, name="tierckpt-test-holder", daemon=True)
    t.start()
    try:
        named = [p for p in warm.fork_problems() if "tierckpt-test-holder" in p]
        assert len(named) == 1 and named[0].startswith("Python threads besides the main one")
    finally:
        stop.set()
        t.join()
    assert not [p for p in warm.fork_problems() if "tierckpt-test-holder" in p]


def _fake_torch(threads: int = 1):
    calls: list[int] = []
    state = {"n": threads}

    def set_num_threads(n):
        calls.append(n)
        state["n"] = n

    return types.SimpleNamespace(get_num_threads=lambda: state["n"], set_num_threads=set_num_threads), calls


def test_fork_problems_with_fake_torch(monkeypatch):
    fake, _ = _fake_torch()
    fake.cuda = types.SimpleNamespace(is_initialized=lambda: True)
    fake.distributed = types.SimpleNamespace(is_available=lambda: True, is_initialized=lambda: True)
    monkeypatch.setitem(sys.modules, "torch", fake)
    got = warm.fork_problems()
    assert "a CUDA context exists in the agent (torch.cuda.is_initialized())" in got
    assert "torch.distributed is initialised in the agent" in got
    fake.cuda.is_initialized = lambda: False
    fake.distributed.is_initialized = lambda: False
    assert not [p for p in warm.fork_problems() if "CUDA" in p or "torch.distributed" in p]


def test_match_thread_count(monkeypatch):
    aff = len(os.sched_getaffinity(0))
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    warm._match_thread_count({"OMP_NUM_THREADS": "3"})  # no torch: nothing to do, no error
    fake, calls = _fake_torch(threads=1)
    monkeypatch.setitem(sys.modules, "torch", fake)
    warm._match_thread_count({"OMP_NUM_THREADS": " 7 "})
    assert calls == [7]
    for raw in (None, "", "0", "-2", "four"):
        warm._match_thread_count({} if raw is None else {"OMP_NUM_THREADS": raw})
        assert fake.get_num_threads() == aff, raw
    calls.clear()
    warm._match_thread_count({})
    assert calls == []  # already right: not set again


PRELOAD_PROBE = r"""
import json, os, sys
sys.path.insert(0, sys.argv[1])
from tierckpt.recovery import warm
before = {"torch": "torch" in sys.modules}
p = warm.preload(["tierckpt_t_probe", "tierckpt_t_no_such_module", "tierckpt_t_exits", "json"])
import tierckpt_t_probe
print(json.dumps({"before": before, "modules": p.modules, "failed": p.failed, "seen": tierckpt_t_probe.SEEN,
                  "seconds": p.seconds, "omp": os.environ.get("OMP_NUM_THREADS"),
                  "nvml": os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK")}))
"""


def test_preload_subprocess_sets_env_and_records_failures(tmp_path):
    (tmp_path / "tierckpt_t_probe.py").write_text(
        "import os\nSEEN = {k: os.environ.get(k) for k in ('PYTORCH_NVML_BASED_CUDA_CHECK', 'OMP_NUM_THREADS')}\n")
    (tmp_path / "tierckpt_t_exits.py").write_text("raise SystemExit(4)\n")
    code = PRELOAD_PROBE.replace("sys.argv[1]", repr(str(tmp_path)))
    out = json.loads(_py(code, env=_sub_env(OMP_NUM_THREADS="4")).splitlines()[-1])
    assert out["before"] == {"torch": False}
    assert out["seen"] == {"PYTORCH_NVML_BASED_CUDA_CHECK": "1", "OMP_NUM_THREADS": "1"}
    assert (out["omp"], out["nvml"]) == ("1", "1")
    assert out["modules"] == ["tierckpt_t_probe", "json"]
    assert set(out["failed"]) == {"tierckpt_t_no_such_module", "tierckpt_t_exits"}
    assert out["failed"]["tierckpt_t_no_such_module"] == "ModuleNotFoundError: No module named 'tierckpt_t_no_such_module'"
    assert out["failed"]["tierckpt_t_exits"] == "SystemExit: 4"
    assert out["seconds"] >= 0.0


def test_preload_keeps_env_when_torch_already_imported(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", types.ModuleType("torch"))
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    monkeypatch.setenv(warm.NVML_CHECK_ENV, "0")
    p = warm.preload(["json"])
    assert p.modules == ["json"] and p.failed == {}
    assert os.environ["OMP_NUM_THREADS"] == "4"  # too late to matter: torch's pool is the one it has
    assert os.environ[warm.NVML_CHECK_ENV] == "0"  # the user's choice is kept (setdefault)


# -- 3. warm.run_argv ----------------------------------------------------------------------------
RUN_TARGET = r"""
import json, sys
import tierckpt_t_sibling
out, what = sys.argv[1], sys.argv[2]
with open(out, "w") as f:
    json.dump({"name": __name__, "argv": sys.argv, "sibling": tierckpt_t_sibling.VALUE}, f)
if what == "exit3":
    raise SystemExit(3)
if what == "exit0":
    sys.exit(0)
if what == "exitnone":
    sys.exit()
if what == "exitmsg":
    sys.exit("fatal: the data set is gone")
if what == "raise":
    raise RuntimeError("boom-xyz")
"""


@pytest.fixture
def run_dir(tmp_path, monkeypatch):
    d = tmp_path / "pkgdir"
    d.mkdir()
    (d / "tierckpt_t_target.py").write_text(RUN_TARGET)
    (d / "tierckpt_t_sibling.py").write_text("VALUE = 17\n")
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    for m in ("tierckpt_t_target", "tierckpt_t_sibling"):
        monkeypatch.delitem(sys.modules, m, raising=False)
    return d


def test_run_argv_script_as_main(run_dir, tmp_path, monkeypatch):
    out = tmp_path / "o.json"
    script = str(run_dir / "tierckpt_t_target.py")
    assert warm.run_argv([script, str(out), "ok"]) == 0
    got = json.loads(out.read_text())
    # the script's folder is on sys.path (its sibling imported), as `python script.py` has it
    assert got == {"name": "__main__", "argv": [script, str(out), "ok"], "sibling": 17}


def test_run_argv_module_as_main(run_dir, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(run_dir))
    out = tmp_path / "o.json"
    assert warm.run_argv(["-m", "tierckpt_t_target", str(out), "ok"]) == 0
    got = json.loads(out.read_text())
    assert got["name"] == "__main__" and got["sibling"] == 17
    # argv[0] is the module's file, as with `python -m`
    assert got["argv"] == [str(run_dir / "tierckpt_t_target.py"), str(out), "ok"]


@pytest.mark.parametrize("what,code,stderr", [
    ("exit3", 3, None), ("exit0", 0, None), ("exitnone", 0, None),
    ("exitmsg", 1, "fatal: the data set is gone\n"), ("raise", 1, "RuntimeError: boom-xyz"),
])
def test_run_argv_exit_statuses(run_dir, tmp_path, capsys, what, code, stderr):
    out = tmp_path / "o.json"
    assert warm.run_argv([str(run_dir / "tierckpt_t_target.py"), str(out), what]) == code
    assert json.loads(out.read_text())["argv"][2] == what  # it did run
    err = capsys.readouterr().err
    if stderr is None:
        assert err == ""
    elif what == "exitmsg":
        assert err == stderr
    else:
        assert err.startswith("Traceback (most recent call last):") and stderr in err and "tierckpt_t_target.py" in err


@pytest.mark.parametrize("argv", [[], ["-m"]])
def test_run_argv_bad(argv):
    with pytest.raises(ValueError, match="need -m MODULE"):
        warm.run_argv(argv)


def test_child_main_usage(capsys):
    from tierckpt.recovery import child

    assert child.main([]) == 2
    assert child.main(["-m"]) == 2
    assert "usage: python -m tierckpt.recovery.child" in capsys.readouterr().err


# -- 4. agents and the pool, end to end ---------------------------------------------------------
RANK = r"""
import sys
PRELOADED = {m: m in sys.modules for m in ("json", "tierckpt_t_marker", "tierckpt_t_threader")}
import json, os, signal, subprocess, time
from tierckpt.preemption import mark_preempted
from tierckpt.recovery import beacon
out_dir, actions = sys.argv[1], sys.argv[2].split(",")
lr, rank = int(os.environ["LOCAL_RANK"]), int(os.environ["RANK"])
act = actions[lr]
info = {"pid": os.getpid(), "ppid": os.getppid(), "pgid": os.getpgid(0), "argv": sys.argv, "name": __name__,
        "preloaded": PRELOADED, "env": dict(os.environ), "sigint": str(signal.getsignal(signal.SIGINT)),
        "cmdline": open("/proc/self/cmdline").read().split("\0")[:-1], "t": time.time()}
CHILD = '''
import os, signal, sys, time
def on_term(s, f):
    open(os.path.join(sys.argv[1], "child-term-" + sys.argv[2]), "w").close()
    os._exit(0)
signal.signal(signal.SIGTERM, on_term)
open(os.path.join(sys.argv[1], "child-ready-" + sys.argv[2]), "w").close()
while True:
    time.sleep(0.05)
'''
if act in ("term", "hold"):
    info["child"] = subprocess.Popen([sys.executable, "-c", CHILD, out_dir, str(rank)]).pid
    while not os.path.exists(os.path.join(out_dir, f"child-ready-{rank}")):
        time.sleep(0.01)
if act == "term":
    def on_term(s, f):
        sys.exit(PREEMPTED)
    PREEMPTED = 75
    signal.signal(signal.SIGTERM, on_term)
with open(os.path.join(out_dir, f"info-{rank}.json.tmp"), "w") as f:
    json.dump(info, f)
os.replace(os.path.join(out_dir, f"info-{rank}.json.tmp"), os.path.join(out_dir, f"info-{rank}.json"))
if act == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
elif act == "mark":
    mark_preempted(7, "SIGTERM", {"local": True})
elif act in ("term", "hold"):
    beacon.report_progress(10 + lr)
    while True:
        time.sleep(0.02)
else:
    sys.exit(int(act))
"""


class Agents:
    """A pool, its agents and everything they started, cleaned up at the end."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.pool = AgentPool()
        self.script = str(tmp / "rank.py")
        Path(self.script).write_text(RANK)
        self.env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": f"{REPO}{os.pathsep}{tmp}",
                    "PYTHONUNBUFFERED": "1", "PYTHONWARNINGS": "ignore", "HOME": str(tmp)}
        self.pids: list[int] = []  # ranks and their children
        self.dirs: list[str] = []  # the agents' beacon directories
        self.conns: list = []  # connections a test opened itself

    def launch(self, slot: int, *, preload=("json",), cold=False, ready=True) -> AgentHandle:
        h = self.pool.launch_local(slot, preload=list(preload), env=self.env, log_path=str(self.tmp / f"agent{slot}.log"),
                                   cwd=str(self.tmp), cold=cold)
        if ready:
            self.pool.wait_ready([slot], timeout=30)
        return h

    def until(self, cond, timeout: float = 20.0, what: str = "") -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > deadline:
                logs = "".join(AgentPool._tail(h) for h in self.pool.handles.values())
                raise AssertionError(f"timed out waiting for {what or cond}{logs}")
            self.pool.poll(0.02)

    def attempt(self, index: int, slots: list[int], actions: list[str], *,
                recovery=None) -> tuple[AgentAttempt, Path]:
        """Start attempt ``index`` on ``slots`` (node id -> slot); ``actions[local rank]`` (the same
        on every node: one argv per attempt). Returns it and the folder its ranks write
        ``info-<RANK>.json`` to."""
        a = AgentAttempt(self.pool, index, slots, len(actions))
        out = self.tmp / f"a{index}"
        out.mkdir()
        argv = [self.script, str(out), ",".join(actions)]
        logs = [str(self.tmp / f"a{index}-n{n}.log") for n in range(len(slots))]
        assert a.start(argv, self.env, master_addr="127.0.0.1", master_port=29500, logs=logs, cwd=str(self.tmp),
                       recovery=recovery) == []
        self.until(a.started, what=f"attempt {index} started")
        for s in slots:
            self.pids += self.pool.handles[s].pids
        return a, out

    def info(self, folder: Path, rank: int, timeout: float = 20.0) -> dict:
        p = folder / f"info-{rank}.json"
        self.until(p.exists, timeout, what=str(p))
        got = json.loads(p.read_text())
        self.pids.append(got["pid"])
        if "child" in got:
            self.pids.append(got["child"])
        if got["env"].get(beacon.BEACON_ENV):
            self.dirs.append(os.path.dirname(got["env"][beacon.BEACON_ENV]))
        return got

    def close(self) -> None:
        try:
            self.pool.close()
        finally:
            for pid in self.pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            for d in self.dirs:
                shutil.rmtree(d, ignore_errors=True)
            for c in self.conns:
                with contextlib.suppress(OSError):
                    c.close()


@pytest.fixture
def agents(tmp_path):
    a = Agents(tmp_path)
    try:
        yield a
    finally:
        a.close()


def _ended(agents: Agents, a: AgentAttempt, node: int = 0) -> dict:
    h = agents.pool.handles[a.slots[node]]
    agents.until(lambda: h.ended is not None, what=f"attempt {a.index} ended")
    return h.ended


def test_agent_attempts_in_a_row_statuses(agents):
    h = agents.launch(0)
    assert h.ready["modules"] == ["json"] and h.ready["failed"] == {} and h.ready["problems"] == []
    assert h.hello["pid"] == h.proc.pid
    with pytest.raises(ValueError, match="slot 0 already has an agent"):
        agents.pool.launch_local(0, preload=[], env=agents.env, log_path=str(agents.tmp / "x.log"), cwd=str(agents.tmp))
    cases = [  # actions, statuses, preempted flag, NodeStatus
        (["0", "3", "kill"], [0, 3, -9], False, NodeStatus(1, 3)),
        (["kill", "0"], [-9, 0], False, NodeStatus(1, -9)),
        (["0", "0"], [0, 0], False, NodeStatus(0)),
        (["75", "75"], [75, 75], True, NodeStatus(PREEMPTED_EXIT)),
        (["mark", "mark"], [0, 0], True, NodeStatus(PREEMPTED_EXIT)),
        (["mark", "0"], [0, 0], False, NodeStatus(0)),  # only one rank of two saved on a notice
    ]
    agent_pid = h.proc.pid
    for i, (actions, statuses, preempted, status) in enumerate(cases, start=1):
        a, out = agents.attempt(i, [0], actions)
        ended = _ended(agents, a)
        assert ended["attempt"] == i and ended["statuses"] == statuses, (actions, ended)
        assert ended["preempted"] is preempted, (actions, ended)
        assert h.statuses == dict(enumerate(statuses))
        assert a.status(0) == status, actions
        assert a.workers(0) == []  # ended
        assert a.warm() is True and h.warm is True
        for lr in range(len(actions)):
            got = agents.info(out, lr)
            assert got["ppid"] == agent_pid and got["pgid"] == got["pid"]  # forked, own process group
            assert got["env"]["LOCAL_RANK"] == str(lr) and got["env"]["RANK"] == str(lr)
            assert got["env"]["LOCAL_WORLD_SIZE"] == str(len(actions))
        if "mark" in actions:
            marks = agents.info(out, 0)["env"]["TIERCKPT_PREEMPTED_DIR"]
            assert os.path.basename(marks).startswith(f"a{i}-marks-")  # a fresh folder per attempt
            assert sorted(os.listdir(marks)) == [f"rank-{lr}.json" for lr, x in enumerate(actions) if x == "mark"]
    assert agents.pool.handles[0].proc.poll() is None  # one agent served every attempt
    assert _wait_gone(agents.pids) == []


def test_rank_is_forked_warm(agents, tmp_path):
    (tmp_path / "tierckpt_t_marker.py").write_text("X = 1\n")
    h = agents.launch(0, preload=["json", "tierckpt_t_marker"])
    t0 = time.time()
    a, out = agents.attempt(1, [0], ["0"], recovery={"cause": "test", "failed_nodes": [1]})
    _ended(agents, a)
    got = agents.info(out, 0)
    assert got["preloaded"] == {"json": True, "tierckpt_t_marker": True, "tierckpt_t_threader": False}
    assert got["name"] == "__main__" and got["argv"][0] == agents.script
    assert got["cmdline"][1:3] == ["-m", "tierckpt.recovery.agent"]  # no exec: the agent's image
    assert got["ppid"] == h.proc.pid
    assert t0 <= float(got["env"][warm.PROCESS_STARTED_ENV]) <= got["t"]
    rec = json.loads(got["env"][nodes.RECOVERY_ENV])
    assert rec["cause"] == "test" and rec["failed_nodes"] == [1] and t0 <= rec["launched"] <= got["t"]
    assert got["env"][beacon.BEACON_ENV].endswith("a1-r0.beacon")
    assert got["sigint"] == str(signal.default_int_handler)  # as in a new interpreter
    assert a.status(0) == NodeStatus(0) and h.warm is True


def test_rank_is_cold_with_cold_agent(agents, tmp_path):
    (tmp_path / "tierckpt_t_marker.py").write_text("X = 1\n")
    h = agents.launch(0, preload=["json", "tierckpt_t_marker"], cold=True)
    assert h.ready["modules"] == []  # a cold agent imports nothing
    t0 = time.time()
    a, out = agents.attempt(1, [0], ["0", "3"])
    assert _ended(agents, a)["statuses"] == [0, 3]
    assert h.warm is False and a.warm() is False
    for lr in (0, 1):
        got = agents.info(out, lr)
        assert got["preloaded"] == {"json": False, "tierckpt_t_marker": False, "tierckpt_t_threader": False}
        assert got["cmdline"][1:3] == ["-m", "tierckpt.recovery.child"]
        assert got["ppid"] == h.proc.pid and got["pgid"] == got["pid"]
        assert t0 <= float(got["env"][warm.PROCESS_STARTED_ENV]) <= got["t"]
        assert nodes.RECOVERY_ENV not in got["env"]
    assert a.status(0) == NodeStatus(1, 3)


def test_cold_rank_sigint_like_a_new_interpreter(agents):
    agents.launch(0, cold=True)
    a, out = agents.attempt(1, [0], ["0"])
    _ended(agents, a)
    assert agents.info(out, 0)["sigint"] == str(signal.default_int_handler)


@pytest.mark.parametrize("cold", [
    pytest.param(False, id="warm"),
    pytest.param(True, id="cold"),
])
def test_negative_exit_code_like_an_interpreter(agents, cold):
    agents.launch(0, cold=cold)
    a, out = agents.attempt(1, [0], ["-1", "256"])
    assert _ended(agents, a)["statuses"] == [255, 0]  # what `python -c "import sys; sys.exit(-1)"` gives


def test_fork_falls_back_to_cold(agents, tmp_path, caplog):
    (tmp_path / "tierckpt_t_threader.py").write_text(
        "import threading, time\n"
        "threading.Thread(target=time.sleep, args=(3600,), name='tierckpt-t-stray', daemon=True).start()\n")
    with caplog.at_level(logging.WARNING, logger="tierckpt.recovery.pool"):
        h = agents.launch(0, preload=["json", "tierckpt_t_threader", "tierckpt_t_missing_mod"])
        assert h.ready["modules"] == ["json", "tierckpt_t_threader"]
        assert list(h.ready["failed"]) == ["tierckpt_t_missing_mod"]
        assert any("tierckpt-t-stray" in p for p in h.ready["problems"])
        a, out = agents.attempt(1, [0], ["0", "0"])
        assert _ended(agents, a)["statuses"] == [0, 0]
    assert h.warm is False and a.warm() is False
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("could not preload" in m and "tierckpt_t_missing_mod" in m for m in warnings), warnings
    assert any("slot 0 started its ranks cold" in m and "tierckpt-t-stray" in m for m in warnings), warnings
    for lr in (0, 1):
        got = agents.info(out, lr)
        assert got["cmdline"][1:3] == ["-m", "tierckpt.recovery.child"]
        assert got["preloaded"] == {"json": False, "tierckpt_t_marker": False, "tierckpt_t_threader": False}
    assert a.status(0) == NodeStatus(0)


def test_signal_reaches_the_rank_group(agents):
    agents.launch(0)
    a, out = agents.attempt(1, [0], ["term"])
    got = agents.info(out, 0)
    assert a.status(0) == NodeStatus(None) and a.workers(0) == [got["pid"]]
    assert agents.pool.signal(0, 1, signal.SIGTERM) is True
    ended = _ended(agents, a)
    assert ended["statuses"] == [PREEMPTED_EXIT] and ended["preempted"] is True
    assert a.status(0) == NodeStatus(PREEMPTED_EXIT)
    assert (out / "child-term-0").exists()  # the rank's own child got it: the group was signalled
    assert _wait_gone([got["pid"], got["child"]]) == []


def test_kill_ranks_and_their_children(agents):
    h = agents.launch(0)
    a, out = agents.attempt(1, [0], ["hold", "hold"])
    infos = [agents.info(out, lr) for lr in (0, 1)]
    assert sorted(a.workers(0)) == sorted(i["pid"] for i in infos)
    assert all(_alive(i["child"]) for i in infos)
    agents.until(lambda: h.beat is not None and h.beat["attempt"] == 1 and len(h.beat["ranks"]) == 2
                 and all(r["step"] >= 0 for r in h.beat["ranks"]), what="beats with steps")
    assert {r["local_rank"]: r["step"] for r in h.beat["ranks"]} == {0: 10, 1: 11}
    assert a.kill() == []
    assert h.killed_at is not None
    assert h.statuses == {0: -9, 1: -9}
    assert a.status(0) == NodeStatus(1, -9)
    assert _wait_gone([p for i in infos for p in (i["pid"], i["child"])]) == []
    assert not (out / "child-term-0").exists()  # SIGKILL, no grace
    assert h.proc.poll() is None  # the agent stays, warm, for the next attempt
    a2, out2 = agents.attempt(2, [0], ["0"])
    assert _ended(agents, a2)["statuses"] == [0]


def test_frozen_rank_found_by_hangwatch(agents):
    agents.launch(0)
    a, out = agents.attempt(1, [0], ["hold", "hold"])
    a.watch = HangWatch(2, 0)
    infos = [agents.info(out, lr) for lr in (0, 1)]
    h = agents.pool.handles[0]
    agents.until(lambda: h.beat and h.beat["attempt"] == 1 and len(h.beat["ranks"]) == 2, what="beats")
    assert a.verdict() is None
    os.kill(infos[1]["pid"], signal.SIGSTOP)
    try:
        agents.until(lambda: a.verdict() is not None, timeout=15, what="a hang verdict")
        v = a.verdict()
        assert v.cause == "hang" and v.slots == (0,) and v.silent == ()
        assert "local rank(s) [1] stopped ticking" in v.detail
    finally:
        os.kill(infos[1]["pid"], signal.SIGCONT)
    assert a.kill() == []


@pytest.mark.parametrize("cold", [False, True], ids=["warm", "cold"])
def test_agent_sigkill_takes_its_ranks(agents, cold):
    h = agents.launch(0, cold=cold)
    a, out = agents.attempt(1, [0], ["hold"])
    got = agents.info(out, 0)
    os.kill(h.proc.pid, signal.SIGKILL)
    agents.until(lambda: h.dead, what="the agent's handle dead")
    assert _wait_gone([got["pid"]]) == []  # PR_SET_PDEATHSIG
    assert a.status(0) == NodeStatus(1)  # the agent is gone: no worker status known
    assert h.statuses == {}
    agents.pool.terminate(0)  # what a launcher does with a lost node: the rank's group goes too
    assert _wait_gone([got["child"]]) == []
    assert h.proc.returncode == -signal.SIGKILL


def test_terminate_a_stopped_agent(agents):
    h = agents.launch(0)
    a, out = agents.attempt(1, [0], ["hold"])
    got = agents.info(out, 0)
    os.kill(h.proc.pid, signal.SIGSTOP)
    t0 = time.monotonic()
    agents.pool.terminate(0)
    assert time.monotonic() - t0 < 5
    assert h.proc.returncode == -signal.SIGKILL and h.dead and h.conn is None
    assert _wait_gone([h.proc.pid, got["pid"], got["child"]]) == []
    assert a.status(0) == NodeStatus(1)
    assert agents.pool.start(0, 2, []) is False  # unreachable now


def test_close_leaves_nothing(agents):
    hs = [agents.launch(s) for s in (0, 1)]
    a, out = agents.attempt(1, [0, 1], ["hold"])
    infos = [agents.info(out, r) for r in (0, 1)]  # RANK r on node r, LOCAL_RANK 0 on both
    assert [(i["env"]["GROUP_RANK"], i["env"]["LOCAL_RANK"]) for i in infos] == [("0", "0"), ("1", "0")]
    assert [i["ppid"] for i in infos] == [h.proc.pid for h in hs]
    pids = [p for i in infos for p in (i["pid"], i["child"])]
    assert all(_alive(p) for p in pids)
    dirs = {os.path.dirname(i["env"][beacon.BEACON_ENV]) for i in infos}
    assert len(dirs) == 2 and all(os.path.isdir(d) for d in dirs)
    agents.pool.close()
    assert [h.proc.returncode for h in hs] == [0, 0]  # they exited when told, not killed
    assert all(h.dead for h in hs)
    assert _wait_gone(pids) == []
    assert not [d for d in dirs if os.path.exists(d)]  # each agent removed its beacon folder


def test_close_stops_listening():
    p = AgentPool()
    time.sleep(0.2)  # its thread waits in accept()
    p.close()
    with pytest.raises(ConnectionRefusedError):
        Client(p.address, authkey=p.key).close()  # an agent connecting to a pool that was closed
    p._acceptor.join(2)
    assert not p._acceptor.is_alive()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_stranger_cannot_connect_and_agents_keep_working(agents):
    h = agents.launch(0)
    with pytest.raises(Exception) as e:  # multiprocessing.AuthenticationError
        Client(agents.pool.address, authkey=b"not the key")
    assert type(e.value).__name__ == "AuthenticationError"
    a, out = agents.attempt(1, [0], ["3"])  # the agent connected before is served as before
    assert _ended(agents, a)["statuses"] == [3]
    assert sorted(agents.pool.handles) == [0] and not h.dead


def _wrong_key(address):
    with contextlib.suppress(Exception):
        Client(address, authkey=b"not the key")


def _reads_then_closes(address):
    with socket.create_connection(address, timeout=5) as s:
        s.recv(100)  # the challenge; then EOF instead of an answer


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
@pytest.mark.parametrize("stranger", [_wrong_key, _reads_then_closes], ids=["wrong-key", "eof"])
def test_pool_accepts_agents_after_a_stranger(agents, stranger):
    stranger(agents.pool.address)
    time.sleep(0.2)
    agents.launch(1, ready=False)
    agents.pool.wait_ready([1], timeout=4)  # ready within ~0.3 s otherwise
    assert agents.pool.handles[1].ready["modules"] == ["json"]


def test_close_does_not_kill_a_local_pid_named_by_a_remote_agent(agents):
    bystander = subprocess.Popen([PY, "-c", "import time; time.sleep(60)"])
    agents.pids.append(bystander.pid)
    try:
        c = Client(agents.pool.address, authkey=agents.pool.key)  # a remote agent on another host
        agents.conns.append(c)
        c.send({"ev": "hello", "slot": 5, "pid": bystander.pid, "host": "some-other-node", "t": time.time()})
        c.send({"ev": "ready", "slot": 5, "preload_s": 0.0, "modules": [], "failed": {}, "problems": []})
        agents.pool.wait_ready([5], timeout=10)
        assert agents.pool.handles[5].proc is None and agents.pool.handles[5].pid == bystander.pid
        agents.pool.close()
        time.sleep(0.2)
        assert bystander.poll() is None, f"the local process {bystander.pid} was killed"
    finally:
        bystander.kill()
        bystander.wait()


SLOW_CHILD_AGENT = r"""
import os, signal, sys, tempfile, time
from tierckpt.recovery import agent as ag, warm
class Conn:
    def __init__(self):
        self.r, self.w = os.pipe()
    def send(self, m):
        pass
    def fileno(self):
        return self.r
orig = warm.child_main
def late(spec):
    time.sleep(0.5)  # the child is scheduled late after the fork (a loaded node)
    return orig(spec)
warm.child_main = late
a = ag.Agent(Conn(), 0, beacon_dir=sys.argv[2])
a.start({"attempt": 1, "ranks": [{"argv": [sys.argv[1]], "env": dict(os.environ), "log": sys.argv[2] + "/r.log",
                                  "cwd": sys.argv[2]}]})
pid = a.attempt.ranks[0].pid
a.signal_ranks(1, signal.SIGKILL)  # what Agent.kill sends first, right after the start
time.sleep(1.5)
alive = os.waitpid(pid, os.WNOHANG) == (0, 0)
if alive:
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
print("ALIVE" if alive else "GONE")
"""


def test_group_signal_right_after_a_warm_fork(tmp_path):
    (tmp_path / "sleeper.py").write_text("import time\ntime.sleep(30)\n")
    out = _py(SLOW_CHILD_AGENT.replace("sys.argv[1]", repr(str(tmp_path / "sleeper.py")))
              .replace("sys.argv[2]", repr(str(tmp_path))), timeout=30)
    assert out.split()[-1] == "GONE"


# -- 5. HangWatch ------------------------------------------------------------------------------
@pytest.mark.parametrize("hang,progress,name", [
    (-1, 0, "hang_timeout_s"), (0, -0.5, "progress_timeout_s"), (math.nan, 0, "hang_timeout_s"),
    (0, math.nan, "progress_timeout_s"), (math.inf, 0, "hang_timeout_s"), (0, math.inf, "progress_timeout_s"),
    (True, 0, "hang_timeout_s"), (0, False, "progress_timeout_s"), ("5", 0, "hang_timeout_s"),
    (0, None, "progress_timeout_s"), (1.5, 0, "hang_timeout_s"), (0.001, 10, "hang_timeout_s"),
])
def test_hangwatch_rejects(hang, progress, name):
    with pytest.raises(ValueError, match=name):
        HangWatch(hang, progress)


@pytest.mark.parametrize("hang,progress", [(0, 0), (2, 0), (2.0, 0.5), (30, 600)])
def test_hangwatch_accepts(hang, progress):
    w = HangWatch(hang, progress)
    assert (w.hang_timeout_s, w.progress_timeout_s) == (float(hang), float(progress))


class Clock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(pool_mod, "time", types.SimpleNamespace(monotonic=c, time=time.time, sleep=time.sleep))
    return c


def _beat(attempt, steps, ages=None):
    ages = ages or [0.1] * len(steps)
    return {"ev": "beat", "attempt": attempt, "t": 0.0,
            "ranks": [{"local_rank": i, "alive_age_s": a, "step": s, "progress_at": 0.0}
                      for i, (s, a) in enumerate(zip(steps, ages))]}


def _fake_pool(clock, n=2, attempt=1, steps=(-1,)):
    return types.SimpleNamespace(handles={s: AgentHandle(slot=s, attempt=attempt, last_heard=clock.t,
                                                         beat=_beat(attempt, list(steps))) for s in range(n)})


def test_hangwatch_silent_agent(clock):
    p = _fake_pool(clock, n=3)
    w = HangWatch(10, 0)
    assert w.check(p, [0, 1, 2], 1) is None
    clock.t += 10
    p.handles[0].last_heard = p.handles[2].last_heard = clock.t
    assert w.check(p, [0, 1, 2], 1) is None  # exactly the timeout: not yet
    clock.t += 0.5
    v = w.check(p, [0, 1, 2], 1)
    assert (v.cause, v.slots, v.silent) == ("hang", (1,), (1,))
    assert "slot 1: agent silent for 10.5s" in v.detail
    assert w.check(p, [0, 2], 1) is None  # only the slots asked about


def test_hangwatch_frozen_rank_and_silent_agent(clock):
    p = _fake_pool(clock, n=3)
    p.handles[0].beat = _beat(1, [4, 4], ages=[0.2, 12.5])
    w = HangWatch(10, 0)
    v = w.check(p, [0, 1, 2], 1)
    assert (v.cause, v.slots, v.silent) == ("hang", (0,), ())  # its agent answers: kill the ranks only
    assert "slot 0: local rank(s) [1] stopped ticking 12.5s ago" == v.detail
    clock.t += 11
    p.handles[0].last_heard = p.handles[1].last_heard = clock.t
    v = w.check(p, [0, 1, 2], 1)
    assert (v.slots, v.silent) == ((0, 2), (2,))


def test_hangwatch_ignores_what_does_not_run_this_attempt(clock):
    p = _fake_pool(clock, n=4)
    p.handles[0].beat = _beat(0, [3], ages=[99.0])  # a beat of the previous attempt
    p.handles[1].attempt = 0  # runs another attempt
    p.handles[2].ended = {"ev": "ended", "attempt": 1, "statuses": [0], "preempted": False}
    p.handles[3].dead = True
    for h in list(p.handles.values())[1:]:
        h.last_heard = clock.t - 1000
    assert HangWatch(10, 0).check(p, [0, 1, 2, 3], 1) is None
    assert HangWatch(0, 0).check(_fake_pool(Clock(clock.t + 1e6)), [0, 1], 1) is None  # 0: off


def test_hangwatch_progress_stall(clock):
    p = _fake_pool(clock)
    w = HangWatch(0, 30)
    assert w.check(p, [0, 1], 1) is None
    clock.t += 500
    assert w.check(p, [0, 1], 1) is None  # no step yet (restoring, compiling): not armed
    p.handles[0].beat, p.handles[1].beat = _beat(1, [5, 6]), _beat(1, [3, 9])  # a node counts as its slowest rank
    assert w.check(p, [0, 1], 1) is None
    clock.t += 30
    assert w.check(p, [0, 1], 1) is None
    clock.t += 1
    v = w.check(p, [0, 1], 1)
    assert (v.cause, v.slots, v.silent) == ("stall", (1,), ())
    assert "last step 5" in v.detail and "slots behind: [1]" in v.detail
    p.handles[1].beat = _beat(1, [5, 5])  # caught up: no new best step, every node is blamed
    v = w.check(p, [0, 1], 1)
    assert (v.cause, v.slots) == ("stall", (0, 1)) and "slots behind: none" in v.detail
    p.handles[0].beat = _beat(1, [6, 6])  # a new step: the clock starts again
    assert w.check(p, [0, 1], 1) is None
    clock.t += 31
    assert w.check(p, [0, 1], 1).slots == (1,)
    assert HangWatch(0, 0).check(p, [0, 1], 1) is None  # 0: off


def test_hangwatch_new_attempt_resets_progress(clock):
    p = _fake_pool(clock, steps=(5,))
    w = HangWatch(0, 30)
    assert w.check(p, [0, 1], 1) is None
    clock.t += 29
    for h in p.handles.values():  # attempt 2 restored step 5 and is at it again
        h.attempt, h.beat = 2, _beat(2, [5])
    assert w.check(p, [0, 1], 2) is None
    clock.t += 29  # 58 s after attempt 1's last step, 29 s into attempt 2
    assert w.check(p, [0, 1], 2) is None
    clock.t += 2
    assert w.check(p, [0, 1], 2).slots == (0, 1)
    for h in p.handles.values():  # attempt 3 still restoring: not armed
        h.attempt, h.beat = 3, _beat(3, [-1])
    clock.t += 1000
    assert w.check(p, [0, 1], 3) is None


def test_attempt_verdict_maps_slots_to_nodes(clock):
    p = types.SimpleNamespace(handles={s: AgentHandle(slot=s, attempt=4, last_heard=clock.t) for s in (3, 8)})
    a = AgentAttempt(p, 4, [8, 3], 1, watch=HangWatch(5, 0))
    assert a.verdict() is None
    p.handles[3].last_heard -= 6
    assert a.verdict() == Verdict("hang", (1,), "slot 3: agent silent for 6.0s", (1,))
    assert AgentAttempt(p, 4, [8, 3], 1).verdict() is None  # no watch


# -- 6. rank_env and AgentAttempt ---------------------------------------------------------------
def test_rank_env_two_by_two():
    base = {"PATH": "/bin", "TIERCKPT_NODE_ID": "7", "KEEP": "x"}
    got = {(n, lr): rank_env(base, node=n, local_rank=lr, nproc_per_node=2, nodes=2, master_addr="10.0.0.1",
                             master_port=29400, run_id="rid") for n in (0, 1) for lr in (0, 1)}
    assert base == {"PATH": "/bin", "TIERCKPT_NODE_ID": "7", "KEEP": "x"}  # not modified
    for (n, lr), e in got.items():
        rank = n * 2 + lr
        assert {k: e[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                                  "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR",
                                  "MASTER_PORT", "TORCHELASTIC_RUN_ID", "OMP_NUM_THREADS", "PATH", "KEEP")} == {
            "RANK": str(rank), "LOCAL_RANK": str(lr), "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2",
            "GROUP_RANK": str(n), "GROUP_WORLD_SIZE": "2", "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": "4",
            "ROLE_NAME": "default", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29400", "TORCHELASTIC_RUN_ID": "rid",
            "OMP_NUM_THREADS": "1", "PATH": "/bin", "KEEP": "x"}
        assert "TIERCKPT_NODE_ID" not in e
    assert sorted(e["RANK"] for e in got.values()) == ["0", "1", "2", "3"]


def test_rank_env_omp_and_ranges():
    kw = dict(master_addr="h", master_port=1, run_id="r")
    assert rank_env({"OMP_NUM_THREADS": "4"}, node=0, local_rank=1, nproc_per_node=2, nodes=1, **kw)["OMP_NUM_THREADS"] == "4"
    assert "OMP_NUM_THREADS" not in rank_env({}, node=1, local_rank=0, nproc_per_node=1, nodes=2, **kw)
    assert rank_env({}, node=0, local_rank=0, nproc_per_node=3, nodes=1, **kw)["OMP_NUM_THREADS"] == "1"
    for node, lr in ((2, 0), (-1, 0), (0, 2), (0, -1)):
        with pytest.raises(ValueError, match="outside 2 nodes x 2 ranks"):
            rank_env({}, node=node, local_rank=lr, nproc_per_node=2, nodes=2, **kw)


class RecordingPool:
    def __init__(self, unreachable=()):
        self.calls: list[tuple[int, int, list[dict]]] = []
        self.unreachable = set(unreachable)
        self.handles: dict[int, AgentHandle] = {}
        self.moves: dict[int, list] = {}

    def start(self, slot, attempt, ranks, moves=None):
        self.calls.append((slot, attempt, ranks))
        self.moves[slot] = list(moves or [])
        return slot not in self.unreachable


def test_attempt_start_env_and_recovery():
    p = RecordingPool(unreachable={9})
    base = {"PATH": "/bin"}
    a = AgentAttempt(p, 3, [4, 9], 2)
    t0 = time.time()
    assert a.start(["-m", "train", "--x"], base, master_addr="m", master_port=5, logs=["l0", "l1"], cwd="/w",
                   recovery={"cause": "rank_exit", "failed_nodes": [1]}, moves={1: [("/n/node-2", "/n/node-1")]}) == [1]
    t1 = time.time()
    assert p.moves == {4: [], 9: [("/n/node-2", "/n/node-1")]}  # node id 1 runs on slot 9: its renames go there
    assert base == {"PATH": "/bin"}
    assert [(s, i, len(r)) for s, i, r in p.calls] == [(4, 3, 2), (9, 3, 2)]
    ranks = [r for _, _, rs in p.calls for r in rs]
    assert [r["env"]["RANK"] for r in ranks] == ["0", "1", "2", "3"]
    assert [r["log"] for r in ranks] == ["l0", "l0", "l1", "l1"]
    assert all(r["argv"] == ["-m", "train", "--x"] and r["cwd"] == "/w" for r in ranks)
    assert len({r["env"]["TORCHELASTIC_RUN_ID"] for r in ranks}) == 1
    recs = [json.loads(r["env"][nodes.RECOVERY_ENV]) for r in ranks]
    assert all(x == recs[0] for x in recs)
    assert recs[0]["cause"] == "rank_exit" and recs[0]["failed_nodes"] == [1] and t0 <= recs[0]["launched"] <= t1
    p2 = RecordingPool()
    assert AgentAttempt(p2, 1, [0], 1).start(["s.py"], base, master_addr="m", master_port=5, logs=["l"], cwd="/w") == []
    assert nodes.RECOVERY_ENV not in p2.calls[0][2][0]["env"]


def test_attempt_status_from_handles():
    p = types.SimpleNamespace(handles={0: AgentHandle(slot=0, attempt=2)})
    a = AgentAttempt(p, 2, [0], 2)
    h = p.handles[0]
    assert a.status(0) == NodeStatus(None)
    h.statuses = {1: 0}
    assert a.status(0) == NodeStatus(None)  # one rank of two ended well: still running
    h.statuses = {1: -15, 0: 2}
    assert a.status(0) == NodeStatus(1, 2)  # the lowest local rank that failed, before the node ended
    h.statuses, h.ended = {0: 0, 1: 0}, {"statuses": [0, 0], "preempted": False}
    assert a.status(0) == NodeStatus(0)
    h.statuses, h.ended = {0: 0, 1: 75}, {"statuses": [0, 75], "preempted": False}
    assert a.status(0) == NodeStatus(PREEMPTED_EXIT)
    h.statuses, h.ended = {0: 0, 1: 0}, {"statuses": [0, 0], "preempted": True}
    assert a.status(0) == NodeStatus(PREEMPTED_EXIT)
    h.statuses, h.ended, h.dead = {0: 0}, None, True
    assert a.status(0) == NodeStatus(1)
    h.attempt, h.dead = 3, False
    assert a.status(0) == NodeStatus(1)  # the agent runs another attempt: this one is over there
    assert a.workers(0) == []
