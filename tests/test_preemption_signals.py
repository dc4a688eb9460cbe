"""Preemption notices that reach more than the ranks (issue 29 case B): DataLoader worker
processes in a rank's process group, and launchers that die on a watched signal.

- units (one process, its own session): protected loader workers survive a notice to the
  whole process group; unprotected ones die, but their death is not raised in the middle of
  the step and :func:`tierckpt.preempted_by` explains the failed fetch; the start-up check of
  the launcher's signal masks;
- the engine API with ``DataLoader(num_workers=2)`` (tests/loader_trainer.py) under torchrun,
  ``python -m tierckpt.launch`` and ``launch/local.py``: SIGTERM / SIGUSR1 → a committed
  preemption step, a ``preemption`` ledger record, exit 75, resume bitwise;
- torchtitan through ``titan_plugin.train`` with ``--dataloader.num_workers 2``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from tests.harness import free_port, titan_train_cmd

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAINER = os.path.join(ROOT, "tests", "loader_trainer.py")
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH"))
                                                                       if p))


def _ledger(folder: str) -> list[dict]:
    path = os.path.join(folder, "tierckpt-ledger.jsonl")
    return [json.loads(line) for line in open(path) if line.strip()]


def _losses(path: str) -> dict[int, str]:
    out: dict[int, str] = {}
    for line in open(path):
        r = json.loads(line)
        out[r["step"]] = r["loss_hex"]  # a resumed run appends: its value wins
    return out


def _run_script(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=ENV, capture_output=True,
                          text=True, timeout=timeout, start_new_session=True)


# ------------------------------------------------------------------------------------ units
_LOADER = """
    import logging, os, signal, subprocess, sys, time
    import torch
    from torch.utils.data import DataLoader, Dataset
    from tierckpt.preemption import PreemptionWatch
    from tierckpt.loader_signals import defer_loader_deaths, preempted_by, protect_loader_workers
    logging.basicConfig(level=logging.WARNING)

    class Slow(Dataset):
        def __len__(self): return 64
        def __getitem__(self, i):
            time.sleep(0.05)
            return torch.tensor([float(i)])

    watch = PreemptionWatch(("SIGTERM", "SIGUSR1"), on_notice=defer_loader_deaths)
    loader = DataLoader(Slow(), batch_size=2, num_workers=2)
    if PROTECT:
        protect_loader_workers(loader, ("SIGTERM", "SIGUSR1"))
    it = iter(loader)
    print("first", next(it).flatten().tolist(), flush=True)
    # what torchrun does to a rank: its workers are in its group, and the sender is not their
    # parent (torch's workers exit quietly on their parent's SIGTERM, and die on anyone else's)
    subprocess.run(["kill", f"-{int(SIG)}", "--", f"-{os.getpgid(0)}"])
    t = time.time()
    x = 0
    while time.time() - t < 3.0:  # the rest of the step: torch's SIGCHLD check may raise here
        x += 1
    print("step finished", watch.received, flush=True)
    got = 1
    try:
        for b in it:
            got += 1
        print("all batches", got, flush=True)
    except RuntimeError as e:
        print("fetch failed:", preempted_by(e, watch), "|", e, flush=True)
"""


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGUSR1"])
def test_protected_loader_workers_survive_a_notice_to_the_process_group(sig):
    r = _run_script(f"import signal\nPROTECT = True\nSIG = signal.{sig}\n" + textwrap.dedent(_LOADER))
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert f"step finished {sig}" in r.stdout, r.stdout + r.stderr[-3000:]
    assert "all batches 32" in r.stdout, r.stdout + r.stderr[-3000:]  # every batch, from the same workers
    assert "killed by signal" not in r.stderr, r.stderr[-3000:]


def test_unprotected_workers_die_but_the_step_finishes_and_the_failed_fetch_is_explained():
    r = _run_script("import signal\nPROTECT = False\nSIG = signal.SIGTERM\n" + textwrap.dedent(_LOADER))
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    # torch's SIGCHLD check would raise "killed by signal" in the middle of the step
    assert "step finished SIGTERM" in r.stdout, r.stdout + r.stderr[-3000:]
    assert "not raised here" in r.stderr, r.stderr[-3000:]
    assert "fetch failed: SIGTERM | DataLoader worker" in r.stdout, r.stdout + r.stderr[-3000:]


def test_a_protected_loader_still_stops_its_workers_at_exit():
    """The loader's own SIGTERM (``terminate()``, which multiprocessing sends its daemonic
    children at interpreter exit and then joins them) still ends a protected worker: a rank
    that exits with a live iterator (torchtitan's trainer does) must not wait for it forever."""
    code = """
        import time
        import torch
        from torch.utils.data import DataLoader, Dataset
        from tierckpt.loader_signals import protect_loader_workers

        class Endless(Dataset):
            def __len__(self): return 10**6
            def __getitem__(self, i): return torch.tensor([float(i)])

        loader = protect_loader_workers(DataLoader(Endless(), batch_size=2, num_workers=2), ("SIGTERM", "SIGUSR1"))
        it = iter(loader)
        next(it)
        ws = it._workers
        for w in ws:  # what the loader does to a worker that does not stop: SIGTERM from its parent
            w.terminate()
        t = time.time()
        for w in ws:
            w.join(20)
        print("stopped", [w.exitcode for w in ws], round(time.time() - t, 1), flush=True)
        it2 = iter(DataLoader(Endless(), batch_size=2, num_workers=2, worker_init_fn=loader.worker_init_fn))
        next(it2)
        print("exiting with a live iterator", flush=True)
    """
    t0 = time.time()
    r = _run_script(code, timeout=90)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert "stopped [0, 0]" in r.stdout, r.stdout + r.stderr[-3000:]
    assert "exiting with a live iterator" in r.stdout, r.stdout
    assert time.time() - t0 < 60, time.time() - t0


def test_preempted_by_needs_a_notice_and_a_loader_death():
    from tierckpt.loader_signals import is_loader_worker_death, preempted_by

    class W:
        received = None

    death = RuntimeError("DataLoader worker (pid(s) 12, 13) exited unexpectedly")
    assert is_loader_worker_death(death)
    assert is_loader_worker_death(ValueError("wrapped").with_traceback(None)) is False
    chained = RuntimeError("step failed")
    chained.__cause__ = RuntimeError("DataLoader worker (pid 12) is killed by signal: Terminated. ")
    assert is_loader_worker_death(chained)
    w = W()
    assert preempted_by(death, w) is None  # no notice: a real failure
    w.received = "SIGUSR1"
    assert preempted_by(death, w) == "SIGUSR1"
    assert preempted_by(RuntimeError("CUDA error"), w) is None


_CHILD = """
    import logging, sys
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    from tierckpt.preemption import warn_if_launcher_unprotected
    print("bad:", ",".join(warn_if_launcher_unprotected(("SIGTERM", "SIGUSR1"))))
"""


def _child_of(parent_usr1: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    """Run :data:`_CHILD` under a parent that leaves SIGUSR1 at its default (dies on it),
    ignores it or handles it, with ``env`` (the launcher's variables) added to the child's."""
    parent = f"""
        import os, signal, subprocess, sys
        if {parent_usr1!r} == "ignore":
            signal.signal(signal.SIGUSR1, signal.SIG_IGN)
        elif {parent_usr1!r} == "handle":
            signal.signal(signal.SIGUSR1, lambda *a: None)
        signal.signal(signal.SIGTERM, lambda *a: None)
        env = {{k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID",
                                                                "SLURM_STEP_ID", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE",
                                                                "PMIX_RANK", "LOCAL_RANK")}}
        sys.exit(subprocess.call([sys.executable, "-c", {textwrap.dedent(_CHILD)!r}], env={{**env, **{env!r}}}))
    """
    r = _run_script(parent)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


@pytest.mark.parametrize("parent_usr1", ["default", "ignore", "handle"])
def test_startup_warning_when_the_launcher_dies_on_a_watched_signal(parent_usr1):
    r = _child_of(parent_usr1, {"SLURM_JOB_ID": "77"})  # under a launcher (here: a Slurm job's script)
    if parent_usr1 == "default":
        assert "bad: SIGUSR1" in r.stdout, r.stdout
        assert "dies on SIGUSR1" in r.stderr and "python -m tierckpt.launch" in r.stderr, r.stderr
        assert "--signals-to-handle SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 --shutdown-timeout 90" in r.stderr, r.stderr
    else:
        assert "bad: \n" in r.stdout and "dies on" not in r.stderr, (r.stdout, r.stderr)


@pytest.mark.parametrize("env", [{}, {"WORLD_SIZE": "1"}], ids=["no-launcher-env", "world-size-1"])
def test_no_startup_warning_for_a_single_process_without_a_launcher(env):
    """A single rank started from an interactive shell (its parent, like bash, dies on SIGUSR1)
    has no launcher that a notice could kill and orphan it from: no warning."""
    r = _child_of("default", env)
    assert "bad: \n" in r.stdout and "dies on" not in r.stderr and "SIGKILLs" not in r.stderr, (r.stdout, r.stderr)


def test_under_launcher_reads_the_launchers_environment():
    from tierckpt.preemption import under_launcher

    assert not under_launcher({}) and not under_launcher({"WORLD_SIZE": "1", "RANK": "0"})
    for env in ({"WORLD_SIZE": "2"}, {"TORCHELASTIC_RUN_ID": "x"}, {"SLURM_JOB_ID": "1"}, {"OMPI_COMM_WORLD_SIZE": "4"},
                {"PMI_SIZE": "2"}):
        assert under_launcher(env), env


@pytest.fixture
def fake_launcher():
    """Start a sleeping process whose command line is the given one (what the start-up check
    reads from /proc as the rank's parent); yields the starter, stops them afterwards."""
    procs: list[subprocess.Popen] = []

    def start(*argv: str) -> int:
        p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", *argv])
        procs.append(p)
        deadline = time.time() + 10
        while time.time() < deadline:  # until /proc shows the final command line (after exec)
            try:
                if argv[0] in open(f"/proc/{p.pid}/cmdline").read():
                    return p.pid
            except OSError:
                pass
            time.sleep(0.02)
        raise AssertionError("the fake launcher did not start")

    yield start
    for p in procs:
        p.kill()
        p.wait()


TORCHRUN_ENV = {"TORCHELASTIC_RUN_ID": "none", "WORLD_SIZE": "2"}


@pytest.mark.parametrize("argv,env,want", [
    (("torch.distributed.run", "--nproc-per-node", "2", "train.py", "--shutdown-timeout", "500"), {},
     (30, "torchrun's default")),  # an option of the training script is not torchrun's
    (("torch.distributed.run", "--shutdown-timeout", "20", "train.py"), {}, (20, "--shutdown-timeout")),
    (("torch.distributed.run", "--shutdown_timeout=120", "-m", "pkg.train"), {}, (120, "--shutdown-timeout")),
    (("torch.distributed.run", "train.py"), {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "60"},
     (60, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT")),
    (("torch.distributed.run", "train.py"), {"PET_SHUTDOWN_TIMEOUT": "45", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "60"},
     (45, "PET_SHUTDOWN_TIMEOUT")),
    # a TIERCKPT_SHUTDOWN_TIMEOUT the user set for plain torchrun does nothing there: not believed
    (("torch.distributed.run", "train.py"), {"TIERCKPT_SHUTDOWN_TIMEOUT": "90"}, (30, "torchrun's default")),
    # python -m tierckpt.launch: the value it passed to torchrun, which it exports
    (("tierckpt.launch", "--nproc-per-node", "2", "train.py"), {"TIERCKPT_SHUTDOWN_TIMEOUT": "90"},
     (90, "TIERCKPT_SHUTDOWN_TIMEOUT from the launcher")),
])
def test_launcher_shutdown_timeout_as_torchrun_decides_it(fake_launcher, argv, env, want):
    from tierckpt.preemption import launcher_shutdown_timeout

    pid = fake_launcher(*argv)
    assert launcher_shutdown_timeout({**TORCHRUN_ENV, **env}, pid) == want
    assert launcher_shutdown_timeout({"WORLD_SIZE": "2", **env}, pid) is None  # not a torchrun worker


@pytest.mark.parametrize("timeout,grace,warns", [(30, 25.0, True), (40, 25.0, True), (41, 25.0, False),
                                                  (90, 25.0, False), (90, 80.0, True)])
def test_startup_warning_when_torchrun_would_sigkill_a_preemption_save(fake_launcher, caplog, timeout, grace, warns):
    """torchrun SIGKILLs its ranks ``--shutdown-timeout`` seconds after forwarding a notice
    (30 s by default): not above preemption_grace_s + 15 s, the final save may be killed."""
    import logging

    from tierckpt.preemption import warn_if_shutdown_too_short

    pid = fake_launcher("torch.distributed.run", f"--shutdown-timeout={timeout}", "train.py")
    with caplog.at_level(logging.WARNING, logger="tierckpt.preemption"):
        got = warn_if_shutdown_too_short(grace, TORCHRUN_ENV, pid)
    text = caplog.text
    if warns:
        assert got == (timeout, "--shutdown-timeout"), got
        assert f"SIGKILLs the ranks {timeout}s after it forwards a preemption notice" in text, text
        assert f"preemption_grace_s = {grace:g}s + 15s" in text and "python -m tierckpt.launch" in text, text
        assert f"torchrun --shutdown-timeout {max(90, int(grace) + 15 + 30)}" in text, text
    else:
        assert got is None and "SIGKILLs" not in text, text


def test_tierckpt_launch_adds_the_watched_signals_to_torchrun():
    from tierckpt.launch import torchrun_args
    from tierckpt.preemption import torchrun_shutdown_timeout

    # what tierckpt.launch exports to its ranks as TIERCKPT_SHUTDOWN_TIMEOUT: torchrun's value
    assert torchrun_shutdown_timeout(torchrun_args(["t.py"], env={}), env={}) == (90, "--shutdown-timeout")
    assert torchrun_shutdown_timeout(torchrun_args(["--shutdown-timeout=20", "t.py"], env={}), env={})[0] == 20
    elastic = {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "70"}
    assert torchrun_shutdown_timeout(torchrun_args(["t.py"], env=elastic), env=elastic) == (
        70, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT")

    args = torchrun_args(["--nproc-per-node", "2", "train.py"], env={})
    assert args[:4] == ["--signals-to-handle", "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1", "--shutdown-timeout", "90"]
    assert args[4:] == ["--nproc-per-node", "2", "train.py"]
    mine = torchrun_args(["--signals-to-handle=SIGTERM", "--shutdown-timeout", "40", "t.py"],
                         env={"TIERCKPT_PREEMPTION_SIGNALS": "SIGUSR2"})
    assert mine == ["--signals-to-handle=SIGTERM", "--shutdown-timeout", "40", "t.py"]
    assert torchrun_args(["t.py"], env={"TIERCKPT_PREEMPTION_SIGNALS": "USR2"})[1] == \
        "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR2"
    with pytest.raises(ValueError, match="TIERCKPT_PREEMPTION_SIGNALS"):
        torchrun_args(["t.py"], env={"TIERCKPT_PREEMPTION_SIGNALS": "SIGKILL"})
    with pytest.raises(ValueError, match="TIERCKPT_SHUTDOWN_TIMEOUT"):
        torchrun_args(["t.py"], env={"TIERCKPT_SHUTDOWN_TIMEOUT": "soon"})


# ------------------------------------------------------------------- engine API, launchers
def _wait_progress(base: str, proc: subprocess.Popen, step: int, timeout: float = 240, rank: int = 0) -> None:
    """Until ``rank`` finished ``step`` steps (the first local save at step 4 included)."""
    deadline = time.time() + timeout
    path = os.path.join(base, f"progress-{rank}")
    while time.time() < deadline and proc.poll() is None:
        try:
            if int(open(path).read() or 0) >= step:
                return
        except (OSError, ValueError):
            pass
        time.sleep(0.1)
    raise AssertionError(f"rank {rank} did not reach step {step} (exit {proc.poll()})")


def _torchrun(launcher: str, base: str, steps: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", launcher, "--nproc-per-node", "2", "--master-port", str(free_port()),
            TRAINER, base, str(steps), *extra]


def _interrupted(cmd: list[str], base: str, sig: signal.Signals, log_name: str) -> tuple[int, str]:
    """Run ``cmd``; once step 5 is done (a local step 4 committed), send ``sig`` to the
    launcher alone; return its exit status and output."""
    os.makedirs(base, exist_ok=True)
    log = os.path.join(base, log_name)
    with open(log, "w") as f:
        p = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_progress(base, p, 5)
        p.send_signal(sig)
        rc = p.wait(timeout=180)
    finally:
        if p.poll() is None:  # pragma: no cover - a hang: the test fails below
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    return rc, open(log).read()


def _check_preempted_and_resume(base: str, ref: str, sig: str, steps: int = 14) -> int:
    """One ``preemption`` record (both tiers committed); the requeued run (tierckpt.launch)
    restores that step from the local tier and its losses equal the uninterrupted run's."""
    pfs = os.path.join(base, "pfs")
    pre = [r for r in _ledger(pfs) if r["kind"] == "preemption"]
    assert len(pre) == 1 and pre[0]["signal"] == sig, pre
    step = pre[0]["step"]
    assert 5 <= step < steps and pre[0]["committed"] == {"local": True, "persistent": True}, pre
    r = subprocess.run(_torchrun("tierckpt.launch", base, str(steps), "--sleep", "0", "--tag", "resumed"),
                       cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    restores = [x for x in _ledger(pfs) if x["kind"] == "restore"]
    assert [x["step"] for x in restores] == [step], restores
    want, got = _losses(os.path.join(ref, "losses.jsonl")), _losses(os.path.join(base, "losses.jsonl"))
    assert sorted(got) == list(range(1, steps + 1)), sorted(got)
    assert got == want, {s: (want[s], got.get(s)) for s in want if want[s] != got.get(s)}
    return step


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> str:
    """An uninterrupted 14-step run of tests/loader_trainer.py (the losses to match)."""
    ref = str(tmp_path_factory.mktemp("ref"))
    r = subprocess.run(_torchrun("tierckpt.launch", ref, "14", "--sleep", "0"), cwd=ROOT, env=ENV,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return ref


@pytest.mark.parametrize("protect", [True, False], ids=["protected", "unprotected-loader"])
def test_sigterm_to_torchrun_with_loader_workers_saves_and_resumes_bitwise(tmp_path, reference, protect):
    """Plain torchrun forwards SIGTERM to each rank's process group, loader workers included:
    the ranks still save at the agreed step and exit 75 (torchrun itself exits 1, and the
    start-up check warned that it dies on SIGUSR1); the requeue resumes there bitwise.

    The notice lands in the middle of a step (the trainer sleeps there), so both cases take
    the end-of-step path: protected workers survive it; unprotected ones die, and their death
    is deferred ("not raised here") instead of raised mid-step, so the step still ends and its
    check saves. The other path, a fetch that fails because the notice killed the workers
    while the rank waited for its batch, is the next test."""
    base = str(tmp_path)
    rc, out = _interrupted(_torchrun("torch.distributed.run", base, 14, *([] if protect else ["--no-protect"])),
                           base, signal.SIGTERM, "attempt1.log")
    assert rc != 0, out[-3000:]
    assert out.count("exiting with status 75") == 2, out[-4000:]
    assert "is killed by signal" not in out or not protect, out[-4000:]
    # which path ran: the end-of-step check on both ranks, never the fetch failure; the
    # deferral of the workers' death exactly when they died (unprotected)
    assert out.count("loader_trainer: preemption save at the end of step") == 2, out[-4000:]
    assert "failed on the notice: preemption save" not in out, out[-4000:]
    assert ("not raised here; the step goes on to its preemption save" in out) is (not protect), out[-4000:]
    assert "dies on SIGUSR1" in out, out[-4000:]  # plain torchrun does: the start-up warning says so
    # and it SIGKILLs the ranks 30 s after forwarding the notice, within a 60 s grace period
    assert "SIGKILLs the ranks 30s after it forwards a preemption notice (torchrun's default)" in out, out[-4000:]
    _check_preempted_and_resume(base, reference, "SIGTERM")


def test_notice_while_the_ranks_wait_for_a_batch_takes_the_agreed_fetch_failure_path(tmp_path, reference):
    """A real run of the fetch-failure path: the rows of step 7 are slow to load, so once both
    ranks finished step 6 they wait in ``next()`` for that batch; SIGTERM to plain torchrun
    then kills the unprotected loader workers while no step runs. The death is deferred (the
    notice came first), the fetch fails ("exited unexpectedly"), every rank votes through the
    store (``agree_loader_death``), and every rank saves step 6 — the last finished one —
    exits 75, and the requeue resumes there bitwise. Deterministic: the end-of-step check of
    step 6 ran before the notice, and step 7's batch cannot arrive before it."""
    base = str(tmp_path)
    os.makedirs(base, exist_ok=True)
    log = os.path.join(base, "attempt1.log")
    cmd = _torchrun("torch.distributed.run", base, 14, "--no-protect", "--slow-step", "7", "--slow-s", "120")
    with open(log, "w") as f:
        p = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        for rank in (0, 1):
            _wait_progress(base, p, 6, rank=rank)
        time.sleep(0.5)  # both in next(), waiting for step 7's batch
        p.send_signal(signal.SIGTERM)
        rc = p.wait(timeout=180)
    finally:
        if p.poll() is None:  # pragma: no cover - a hang: the test fails below
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    out = open(log).read()
    assert rc != 0, out[-3000:]
    assert out.count("loader_trainer: fetch of step 7 failed on the notice: preemption save of step 6") == 2, \
        out[-4000:]
    assert "preemption save at the end of step" not in out, out[-4000:]
    assert "exited unexpectedly" in out or "is killed by signal" in out, out[-4000:]
    assert out.count("exiting with status 75") == 2, out[-4000:]
    assert _check_preempted_and_resume(base, reference, "SIGTERM") == 6


def test_sigusr1_to_tierckpt_launch_exits_75_and_resumes_bitwise(tmp_path, reference):
    """SIGUSR1 (Slurm's --signal=USR1) to the launcher alone: plain torchrun dies with 138 and
    orphans its ranks; ``python -m tierckpt.launch`` forwards it, the ranks save, it exits 75."""
    base = str(tmp_path)
    rc, out = _interrupted(_torchrun("tierckpt.launch", base, 14), base, signal.SIGUSR1, "attempt1.log")
    assert rc == 75, (rc, out[-4000:])
    assert "every rank of this node saved on a preemption notice" in out, out[-3000:]
    assert "dies on SIGUSR1" not in out and "SIGKILLs the ranks" not in out, out[-3000:]
    _check_preempted_and_resume(base, reference, "SIGUSR1")


@pytest.mark.parametrize("mode", ["warm", "cold"])
def test_sigusr1_to_the_local_launcher_exits_75_without_a_retry(tmp_path, reference, mode):
    """``launch/local.py`` (2 nodes; warm node agents, or ``--cold`` torchruns): SIGUSR1 used to
    kill it with 138 and leave the ranks running; now both nodes save on the forwarded notice,
    nothing is retried, exit 75."""
    base = str(tmp_path)
    logs = os.path.join(base, "logs")
    cmd = [sys.executable, os.path.join(ROOT, "launch", "local.py"), "--nodes", "2", "--max-attempts", "3",
           "--log-dir", logs, *(["--cold"] if mode == "cold" else []), "--", TRAINER, base, "14"]
    rc, out = _interrupted(cmd, base, signal.SIGUSR1, "launcher.log")
    assert rc == 75, (rc, out[-4000:])
    assert "preempted (SIGUSR1): every node saved" in out, out[-3000:]
    assert sorted(n for n in os.listdir(logs) if "attempt" in n) == ["job-attempt1-node0.log",
                                                                      "job-attempt1-node1.log"], os.listdir(logs)
    assert ("node agents ready" in out) == (mode == "warm"), out[-3000:]
    _check_preempted_and_resume(base, reference, "SIGTERM")  # forwarded to the nodes as SIGTERM


# ----------------------------------------------------------------------------------- torchtitan
def test_titan_loader_workers_sigterm_to_torchrun_saves_and_resumes_bitwise(tmp_path):
    """torchtitan with ``--dataloader.num_workers 2`` under plain torchrun: SIGTERM to
    torchrun reaches the loader workers too; the ranks save both tiers at the agreed step and
    exit 75, and the requeued run resumes there with losses bitwise equal to an uninterrupted
    run's (same loader settings)."""
    tmp = str(tmp_path)

    def cmd(dump: str, nvme: str) -> list[str]:
        return [*titan_train_cmd(), "--dump_folder", os.path.join(tmp, dump),
                "--checkpoint.local_root", os.path.join(tmp, nvme, "node-{node}"), "--training.steps", "10",
                "--checkpoint.busy_tier_policy", "wait", "--checkpoint.local_interval", "3",
                "--checkpoint.interval", "6", "--dataloader.num_workers", "2"]

    ref = subprocess.run(cmd("ref", "refnvme"), cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=400)
    assert ref.returncode == 0, ref.stderr[-3000:]
    ckpt = os.path.join(tmp, "run", "checkpoint")
    log = os.path.join(tmp, "attempt1.log")
    with open(log, "w") as f:
        p = subprocess.Popen(cmd("run", "nvme"), cwd=ROOT, env=ENV, stdout=f, stderr=subprocess.STDOUT)
    deadline = time.time() + 300
    while time.time() < deadline and p.poll() is None:  # past the first local checkpoint (step 3)
        try:
            if any(r["kind"] == "checkpoint" and r["ok"] and r["tier"] == "local" for r in _ledger(ckpt)):
                break
        except (OSError, ValueError):
            pass
        time.sleep(0.05)
    assert p.poll() is None, "training ended before the signal"
    p.send_signal(signal.SIGTERM)
    p.wait(timeout=180)
    text = open(log).read()
    assert text.count("exiting with status 75") == 2, text[-4000:]
    assert "is killed by signal" not in text, text[-4000:]
    pre = [r for r in _ledger(ckpt) if r["kind"] == "preemption"]
    assert len(pre) == 1 and pre[0]["signal"] == "SIGTERM", pre
    step = pre[0]["step"]
    assert 3 <= step < 10 and pre[0]["committed"] == {"local": True, "persistent": True}, pre
    ends = [r for r in _ledger(ckpt) if r["kind"] == "run_end"]
    assert ends[-1]["clean"] is True and ends[-1]["durable_step"] == step, ends
    r = subprocess.run(cmd("run", "nvme"), cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stderr[-4000:]
    restores = [x for x in _ledger(ckpt) if x["kind"] == "restore"]
    assert [x["step"] for x in restores] == [step], restores
    assert {v["source"] for v in restores[0]["sources"].values()} == {"own-local"}, restores
    want = _losses(os.path.join(tmp, "ref", "metrics", "losses.jsonl"))
    got = _losses(os.path.join(tmp, "run", "metrics", "losses.jsonl"))
    assert sorted(got) == list(range(1, 11)), sorted(got)
    assert got == want, {s: (want[s], got.get(s)) for s in want if want[s] != got.get(s)}
