#!/usr/bin/env python
"""The main demo: torchtitan's llama3 debug model loses a node and comes back from its neighbour.

Run ``python launch/local_demo.py`` (or ``make demo``). Every run goes through the local
launcher ``launch/local.py`` — the semantics of ``launch/*.sbatch`` on one machine: one
``torchrun`` per simulated node (2 nodes × 1 rank, static rendezvous on 127.0.0.1), a bounded
retry loop with a fresh port and ``TIERCKPT_RESTART_COUNT`` per attempt. Each rank runs the
unmodified torchtitan trainer through our TOML front-end::

    python -m titan_plugin.train --toml configs/titan_demo.toml --dump_folder … --checkpoint.local_root …

(llama3 debugmodel, FSDP2 over gloo on CPU, tiered checkpoints from ``configs/titan_demo.toml``:
local tier + replica on the other node every ``--local-interval`` steps, persistent tier every
``--persistent-interval`` steps). The scenario:

1. **reference**: the same training (same ``training.steps``, world size, seeds, data,
   OMP_NUM_THREADS=1) without a failure, in its own directories; no local tier, and its only
   checkpoint is the final full save to the persistent tier (to compare the final state);
2. **failure run, attempt 1** (one launcher run with 2 attempts): once the ledger shows the
   committed (and replicated) local checkpoint of step ``--kill-after`` and rank 0 has logged
   a later step, the demo SIGKILLs node ``--victim``'s training process and deletes that
   node's whole local root (its "NVMe" is gone); the launcher sees the node fail and stops the
   survivor (a real job loses its process group; ``srun --kill-on-bad-exit``);
3. **failure run, attempt 2**: the launcher restarts the whole job (fresh processes, fresh
   port, restart count 1); the trainer's ``checkpointer.load()`` restores node 0 from its own
   local tier and node 1 from node 0's replica, without reading a byte of the persistent tier,
   and training runs to the end.

The report (printed, and ``<out>/report.json``) compares every loss logged after the resume
with the reference's loss of the same step, exactly (``float.hex``, from the exact per-step
``metrics/losses.jsonl``), takes the restore sources, persistent bytes and checkpoint timings
from tierckpt's ledger, measures the recovery from the kill to the first post-restore step's
log time, reports the ledger's ``recovery`` record (``recovery_phases``: failure noticed,
survivors stopped, launched, processes started, imports, process groups, model built,
restore, first step; with the demo's kill → failure-noticed gap), and compares the final step's full checkpoints (model, optimizer, lr_scheduler,
dataloader, train_state) of both runs bitwise. Exit status 1 unless
the losses are bitwise equal, node ``--victim`` came back from ``peer-replica`` and 0 persistent
bytes were read (2: the scenario could not run).

Layout of ``<out>`` (default ``outputs/demo``, cleared at the start)::

    reference/                    dump folder of the reference run (metrics/losses.jsonl, …)
    failure/                      dump folder of the failure run:
      checkpoint/                   persistent tier + tierckpt-ledger.jsonl
      nvme/<job>/node-<n>/          local roots (one simulated NVMe per node)
    logs/                         one log per node and attempt (<run>-attempt<k>-node<n>.log)
    report.json

The functions :func:`run_demo` and :func:`clear_out` are used by ``tests/test_titan_demo.py``;
:class:`Job` (ranks started directly, without torchrun) by other tests and benchmarks.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # running as a script puts launch/ on sys.path, not the repo root
    sys.path.insert(0, REPO)

DEFAULT_OUT = os.path.join(REPO, "outputs", "demo")
DEFAULT_TOML = os.path.join(REPO, "configs", "titan_demo.toml")
JOB_ID = "titan-demo"
# What this demo (and a manual run of configs/titan_demo.toml: run/, nvme/) leaves in <out>;
# anything else there makes the launcher refuse to clear the directory. The demo's own local
# roots are under failure/, never the TOML's default nvme/, so a manual run of the TOML at the
# same time cannot hand the demo a stale local checkpoint of the same job id.
OURS = {"reference", "failure", "nvme", "logs", "run", "report.json", "report.json.tmp"}


class DemoError(RuntimeError):
    """The scenario could not run (a rank failed, a timeout); the message says where to look."""


# =============================================================================================
# processes
# =============================================================================================
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """Children get SIGKILL if the launcher dies (Linux), so no rank outlives a killed demo."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass


_LIVE: list = []  # Job and LocalLauncher objects still holding processes (kill_all())

# Every run of the demo gets the same environment: losses are bitwise reproducible only with
# the same thread count.
RUN_ENV = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONWARNINGS": "ignore"}


def local_launcher():
    """``launch/local.py`` as a module (``launch/`` is not a package)."""
    import importlib.util

    name = "tierckpt_local_launcher"
    if name not in sys.modules:  # registered first: its dataclasses look their module up
        spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, "launch", "local.py"))
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


class Job:
    """One attempt of a training job: one ``titan_plugin.train`` process per rank (or ``cmd``),
    started directly, without torchrun (the demo itself uses ``launch/local.py``).

    Ranks are started directly (no torchrun) with the ``env://`` variables torchtitan's
    ``init_distributed`` and ``get_local_device`` read: MASTER_ADDR/MASTER_PORT (fresh port per
    attempt), RANK, WORLD_SIZE, and LOCAL_RANK=0/LOCAL_WORLD_SIZE=1 since every rank is its own
    simulated node. OMP_NUM_THREADS=1 in every run (losses are bitwise reproducible only with
    the same thread count).
    """

    def __init__(self, name: str, *, toml: str = DEFAULT_TOML, overrides: tuple[str, ...] | list[str] = (), world: int,
                 log_dir: str, restart_count: int = 0, cmd: list[str] | None = None,
                 extra_env: dict[str, str] | None = None):
        self.name = name
        self.port = free_port()
        self.procs: list[subprocess.Popen] = []
        self.logs: list[str] = []
        self.cmd = cmd or [sys.executable, "-m", "titan_plugin.train", "--toml", toml, *overrides]
        os.makedirs(log_dir, exist_ok=True)
        _LIVE.append(self)
        self.t_start = time.time()
        for rank in range(world):
            env = dict(os.environ)
            env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(self.port), RANK=str(rank),
                       WORLD_SIZE=str(world), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                       GROUP_RANK=str(rank), ROLE_RANK=str(rank), ROLE_WORLD_SIZE=str(world),
                       TIERCKPT_RESTART_COUNT=str(restart_count), OMP_NUM_THREADS="1",
                       PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore")
            env.update(extra_env or {})
            env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)
            env.pop("TIERCKPT_NODE_ID", None)  # nodes come from simulated_ranks_per_node
            path = os.path.join(log_dir, f"{name}-rank{rank}.log")
            self.logs.append(path)
            with open(path, "w") as logf:
                self.procs.append(subprocess.Popen(self.cmd, env=env, cwd=REPO, stdout=logf,
                                                   stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                                   preexec_fn=_die_with_parent))

    def pid(self, rank: int) -> int:
        return self.procs[rank].pid

    def poll(self) -> list[int | None]:
        return [p.poll() for p in self.procs]

    def wait(self, timeout: float) -> None:
        """Wait for every rank; raises :class:`DemoError` (ranks killed) on failure or timeout."""
        deadline = time.time() + timeout
        while True:
            rcs = self.poll()
            if any(rc not in (None, 0) for rc in rcs):
                self.kill_all()
                raise DemoError(self.failure_text(rcs))
            if all(rc == 0 for rc in rcs):
                self.t_end = time.time()
                return
            if time.time() > deadline:
                self.kill_all()
                raise DemoError(f"{self.name}: ranks did not finish within {timeout:.0f}s; logs: {self.logs}")
            time.sleep(0.1)

    def kill(self, rank: int) -> None:
        p = self.procs[rank]
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGKILL)
        p.wait()

    def kill_all(self) -> None:
        for r in range(len(self.procs)):
            self.kill(r)

    def failure_text(self, rcs: list[int | None]) -> str:
        out = []
        for r, rc in enumerate(rcs):
            if rc not in (None, 0):
                try:
                    with open(self.logs[r], errors="replace") as f:
                        tail = f.read()[-4000:]
                except OSError:
                    tail = ""
                out.append(f"--- {self.name} rank {r} exited {rc}; end of {self.logs[r]}:\n{tail}")
        return "\n".join(out) or f"{self.name}: exit codes {rcs}"


def kill_live_jobs() -> None:
    """SIGKILL every rank process this module started that is still running."""
    while _LIVE:
        _LIVE.pop().kill_all()


# =============================================================================================
# files
# =============================================================================================
def clear_out(out: str, ours: set[str] = OURS) -> None:
    """Delete and recreate ``out``, refusing (ValueError) when it holds files other than
    ``ours`` (what the demo writes: a mistyped --out must not wipe someone's directory)."""
    out = os.path.abspath(out)
    if os.path.exists(out):
        if not os.path.isdir(out):
            raise ValueError(f"--out {out} exists and is not a directory")
        foreign = sorted(set(os.listdir(out)) - ours)
        if foreign:
            raise ValueError(f"refusing to clear {out}: it holds files this demo did not write "
                             f"({', '.join(foreign[:5])}); pick another --out")
        if os.path.realpath(out) in (os.path.realpath(REPO), os.path.expanduser("~"), "/"):
            raise ValueError(f"refusing to clear {out}")
        shutil.rmtree(out)
    os.makedirs(out)


def _jsonl(path: str) -> list[dict]:
    """Records of a JSONL file; a torn last line (writer killed mid-append) is skipped."""
    out = []
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                line = line.strip()
                if line:
                    with contextlib.suppress(ValueError):
                        rec = json.loads(line)
                        if isinstance(rec, dict):
                            out.append(rec)
    except FileNotFoundError:
        pass
    return out


def _write_json(path: str, obj) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


@dataclass
class Paths:
    out: str

    @property
    def reference(self) -> str:
        return os.path.join(self.out, "reference")

    @property
    def failure(self) -> str:
        return os.path.join(self.out, "failure")

    @property
    def logs(self) -> str:
        return os.path.join(self.out, "logs")

    @property
    def local_root_template(self) -> str:
        return os.path.join(self.failure, "nvme", "{job}", "node-{node}")

    def local_root(self, node: int) -> str:
        return self.local_root_template.format(job=JOB_ID, node=node)

    def losses(self, dump: str) -> str:
        return os.path.join(dump, "metrics", "losses.jsonl")

    @property
    def ledger(self) -> str:  # persistent tier = torchtitan's checkpoint folder of the failure run
        return os.path.join(self.failure, "checkpoint", "tierckpt-ledger.jsonl")


# =============================================================================================
# the scenario
# =============================================================================================
@dataclass
class DemoParams:
    steps: int = 30
    kill_after: int = 15          # S: kill once local step S is committed and a later step ran
    local_interval: int = 5
    persistent_interval: int = 15
    victim: int = 1
    nodes: int = 2
    fault: str = "kill"           # "kill": SIGKILL + disk deleted; "stop": SIGSTOP of the node (a frozen host)
    hang_timeout: float = 10.0    # the launcher's --hang-timeout (the "stop" fault is found by it)
    cold: bool = False            # launch/local.py --cold: a torchrun per node and attempt (the baseline)
    toml: str = DEFAULT_TOML
    timeout: float = 600.0        # per attempt, seconds
    extra: list[str] = field(default_factory=list)  # more --section.key value overrides

    def check(self) -> None:
        if self.nodes != 2:
            raise ValueError("the demo runs 2 simulated nodes (replication_factor 2)")
        if not 0 <= self.victim < self.nodes:
            raise ValueError(f"--victim must be a node id in [0, {self.nodes})")
        if self.local_interval <= 0 or self.kill_after % self.local_interval:
            raise ValueError("--kill-after must be a multiple of --local-interval (a local step)")
        if not 0 < self.kill_after < self.steps:
            raise ValueError("need 0 < --kill-after < --steps")
        if self.fault not in ("kill", "stop"):
            raise ValueError(f"--fault must be 'kill' or 'stop', got {self.fault!r}")
        if self.cold and self.fault == "stop":
            raise ValueError("--fault stop needs the node agents' hang detection: not with --cold")

    @property
    def spares(self) -> int:
        """A frozen host is out: a spare node takes over its id (its disk is not read again)."""
        return 1 if self.fault == "stop" else 0


def _overrides(p: DemoParams, paths: Paths, dump: str, failure: bool) -> list[str]:
    """CLI overrides on top of the TOML. The failure run: tiered checkpoints as configured.
    The reference: no local tier and only the final (full) save to the persistent tier, so the
    final model/optimizer state can be compared with the failure run's."""
    ov = ["--dump_folder", dump, "--training.steps", str(p.steps),
          "--checkpoint.enable", "true", "--checkpoint.last_save_model_only", "false",
          "--checkpoint.simulated_ranks_per_node", "1"]
    if failure:
        ov += ["--checkpoint.local_root", paths.local_root_template,
               "--checkpoint.job_id", JOB_ID,
               "--checkpoint.busy_tier_policy", "wait", "--checkpoint.local_interval", str(p.local_interval),
               "--checkpoint.interval", str(p.persistent_interval),
               "--checkpoint.replication_factor", "2"]
    else:
        ov += ["--checkpoint.job_id", JOB_ID + "-reference",
               "--checkpoint.busy_tier_policy", "wait", "--checkpoint.local_interval", "0",
               "--checkpoint.interval", str(p.steps)]
    return ov + list(p.extra)


def compare_final_states(dir_a: str, dir_b: str, exclude: tuple[str, ...] = ()) -> dict:
    """Compare two DCP checkpoints entry by entry (keys starting with one of ``exclude`` left
    out), tensors bitwise (as raw bytes); runs without a process group. Returns
    {"equal", "entries", "differing"}."""
    import tempfile

    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    def flat(d, prefix=""):
        for k, v in d.items():
            if isinstance(v, dict):
                yield from flat(v, f"{prefix}{k}.")
            else:
                yield f"{prefix}{k}", v

    def same(a, b) -> bool:
        if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
                return False
            if a.dtype != b.dtype or a.shape != b.shape:
                return False
            a, b = a.detach().contiguous().reshape(-1), b.detach().contiguous().reshape(-1)
            return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        return type(a) is type(b) and a == b

    with tempfile.TemporaryDirectory() as tmp:
        states = []
        for i, d in enumerate((dir_a, dir_b)):
            dcp_to_torch_save(d, os.path.join(tmp, f"{i}.pt"))
            states.append({k: v for k, v in flat(torch.load(os.path.join(tmp, f"{i}.pt"), weights_only=False))
                           if not (exclude and k.startswith(exclude))})
    a, b = states
    differing = sorted(k for k in set(a) | set(b) if k not in a or k not in b or not same(a[k], b[k]))
    return {"equal": not differing, "entries": len(set(a) | set(b)), "differing": differing}


def _say(con, msg: str) -> None:
    if con is not None:
        con.print(msg)


class _FailureInjector:
    """Monitor of the failure run's launcher (called every ~50 ms): in attempt 1, once the
    ledger shows the committed, replicated local step S and rank 0 logged a later step, SIGKILL
    node ``victim``'s training process and delete its local root. The launcher then stops the
    survivor and starts attempt 2.

    Raises (from the launcher's loop, which stops every process first):
        DemoError: attempt 1 resumed from a stale checkpoint, the local save of step S failed,
            a node ended before the failure point, or it was not reached within the timeout.
    """

    def __init__(self, p: DemoParams, paths: Paths, con):
        self.p, self.paths, self.con = p, paths, con
        self.t_kill: float | None = None
        self.killed_at: int | None = None
        self.ckpt: dict | None = None
        self._next = 0.0

    def __call__(self, launcher, attempt) -> None:
        p, paths = self.p, self.paths
        if attempt.index > 0:
            if self.t_kill is None:
                raise DemoError("a node ended before the failure point\n"
                                + launcher.failure_text(launcher.attempts[0]))
            return
        if self.t_kill is not None or time.time() < self._next:
            return
        self._next = time.time() + 0.02
        if time.time() - attempt.t_start > p.timeout:
            raise DemoError(f"timed out after {p.timeout:.0f}s waiting for local step {p.kill_after} to be "
                            f"committed; logs: {attempt.logs}")
        ledger = _jsonl(paths.ledger)
        stale = next((r for r in ledger if r.get("kind") == "restore"), None)
        if stale is not None:  # attempt 1 must start from scratch, like the reference
            raise DemoError(f"attempt 1 resumed from step {stale.get('step')} ({stale.get('sources')}) instead of "
                            f"starting fresh: is another job writing to {paths.failure}?")
        ckpt = next((r for r in ledger if r.get("kind") == "checkpoint" and r.get("tier") == "local"
                     and r.get("step") == p.kill_after), None)
        if ckpt is None:
            return
        if not ckpt.get("ok", False) or ckpt.get("replicas_failed"):
            raise DemoError(f"local checkpoint of step {p.kill_after} failed: {ckpt}")
        losses_path = paths.losses(paths.failure)
        steps = [r["step"] for r in _jsonl(losses_path)]  # a fresh directory: attempt 1's records only
        victims = launcher.workers(p.victim)
        if not steps or max(steps) <= p.kill_after or not victims:
            return
        self.t_kill = time.time()
        if p.fault == "stop":  # the whole node freezes: its agent and its rank
            agent = launcher.pool.handles[launcher.slots[p.victim]].pid if launcher.pool is not None else None
            for pid in [*victims, *([agent] if agent else [])]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGSTOP)
            self.killed_at = max(r["step"] for r in _jsonl(losses_path))
            self.ckpt = ckpt
            _say(self.con, f"    [red]SIGSTOP node {p.victim}[/] (agent and rank) at step {self.killed_at} (local step "
                           f"{p.kill_after} committed and replicated); {self.t_kill - attempt.t_start:.1f} s after "
                           "start")
            return
        for pid in victims:  # SIGKILL node `victim`'s training process …
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(paths.local_root(p.victim), ignore_errors=True)  # … and its disk
        self.killed_at = max(r["step"] for r in _jsonl(losses_path))
        self.ckpt = ckpt
        _say(self.con, f"    [red]SIGKILL node {p.victim}[/] at step {self.killed_at} (local step {p.kill_after} "
                       f"committed and replicated), deleted {os.path.relpath(paths.local_root(p.victim), REPO)}; "
                       f"{self.t_kill - attempt.t_start:.1f} s after start")


def run_demo(out: str, params: DemoParams | None = None, console=None) -> dict:
    """Run the reference and the failure run in ``out`` (must exist, empty or cleared) and
    write ``<out>/report.json``. Returns the report; ``report["ok"]`` is the verdict.

    Raises:
        DemoError: a rank failed or timed out (every started process is killed first).
    """
    p = params or DemoParams()
    p.check()
    paths = Paths(os.path.abspath(out))
    t_begin = time.time()
    try:
        return _run(p, paths, console, t_begin)
    finally:  # never leave rank processes behind (errors, Ctrl-C)
        kill_live_jobs()


def _run(p: DemoParams, paths: Paths, con, t_begin: float) -> dict:
    from tierckpt_dev.titan.assets import ensure_assets

    t0 = time.time()
    assets = ensure_assets()  # built once and cached (the ranks would otherwise build it)
    t_assets = time.time() - t0
    lo = local_launcher()

    def launch(name: str, overrides: list[str], attempts: int):
        job = lo.LocalLauncher(["-m", "titan_plugin.train", "--toml", p.toml, *overrides], nodes=p.nodes,
                               max_attempts=attempts, log_dir=paths.logs, name=name, env=RUN_ENV,
                               spares=p.spares if name == "failure" else 0, hang_timeout_s=p.hang_timeout,
                               warm=not p.cold,
                               local_root=paths.local_root_template.replace("{job}", JOB_ID)
                               if name == "failure" else None)
        _LIVE.append(job)
        return job

    def launcher_says(line: str) -> None:
        if line.startswith("attempt 2/"):
            _say(con, "[cyan]3/3[/] the launcher restarts the job (fresh processes, fresh port, restart count 1): "
                      "restore and train to the end …")
        _say(con, f"    [dim]launcher: {line}[/]")

    # 1. reference ------------------------------------------------------------------------------
    _say(con, f"[cyan]1/3[/] reference run: {p.steps} steps, no failure …")
    ref = launch("reference", _overrides(p, paths, paths.reference, failure=False), 1)
    try:
        rc = ref.run(timeout=p.timeout)
    except lo.LaunchError as e:
        raise DemoError(str(e)) from None
    if rc != 0:
        raise DemoError(ref.failure_text())
    r0 = ref.attempts[0]
    ref_recs = _jsonl(paths.losses(paths.reference))
    ref_losses = {r["step"]: float.fromhex(r["loss_hex"]) for r in ref_recs}
    if sorted(ref_losses) != list(range(1, p.steps + 1)) or len(ref_recs) != p.steps:
        raise DemoError(f"reference logged steps {[r['step'] for r in ref_recs]}, expected 1..{p.steps}")
    _say(con, f"    done in {r0.t_end - r0.t_start:.1f} s; loss {ref_losses[1]:.4f} → {ref_losses[p.steps]:.4f}")

    # 2.+3. failure run: attempt 1 (killed), attempt 2 (restored) --------------------------------
    _say(con, f"[cyan]2/3[/] failure run with tiered checkpoints; node {p.victim} dies after local "
              f"step {p.kill_after} …")
    fail_ov = _overrides(p, paths, paths.failure, failure=True)
    fail = launch("failure", fail_ov, 2)
    inj = _FailureInjector(p, paths, con)
    try:
        rc = fail.run(timeout=2 * p.timeout, monitor=inj, log=launcher_says)
    except lo.LaunchError as e:
        raise DemoError(str(e)) from None
    if rc != 0 or len(fail.attempts) != 2:
        raise DemoError(f"the failure run did not finish in attempt 2 (exit {rc})\n{fail.failure_text()}")
    a1, a2 = fail.attempts
    t_kill, killed_at = inj.t_kill, inj.killed_at
    fail_recs = _jsonl(paths.losses(paths.failure))
    a1_recs = [r for r in fail_recs if r["time"] < a2.t_start]
    a2_recs = [r for r in fail_recs if r["time"] >= a2.t_start]

    # report ------------------------------------------------------------------------------------
    ledger = _jsonl(paths.ledger)
    run_ids: list[str | None] = []
    for r in ledger:
        if r.get("kind") == "run_start" and r.get("run_id") not in run_ids:
            run_ids.append(r.get("run_id"))
    attempt_of = {rid: i + 1 for i, rid in enumerate(run_ids)}
    saves = [{"tier": r["tier"], "step": r["step"], "blocking_s": r["blocking_s"],
              "background_s": r["background_s"], "bytes": r["bytes"], "ok": r.get("ok", True),
              "attempt": attempt_of.get(r.get("run_id"))}
             for r in ledger if r.get("kind") == "checkpoint"]
    from tierckpt.history.ledger import summarize

    ledger_runs = [{"attempt": attempt_of.get(r["run_id"]), "restart_count": r["restart_count"], "clean": r["clean"]}
                   for r in summarize(ledger)["runs"]]
    phases = recovery_phases(ledger, t_kill)
    restores = [r for r in ledger if r.get("kind") == "restore"]
    restore = restores[-1] if restores else None
    if restore is None:
        raise DemoError(f"attempt 2 recorded no restore in {paths.ledger}; logs: {a2.logs}")
    rstep = int(restore["step"])
    sources = {str(n): v["source"] for n, v in sorted(restore["sources"].items())}
    pbytes = int(restore.get("persistent_bytes", -1))

    after = {r["step"]: float.fromhex(r["loss_hex"]) for r in a2_recs}
    before = {r["step"]: float.fromhex(r["loss_hex"]) for r in a1_recs}
    after_steps = sorted(after)
    mismatches = [s for s in after_steps if ref_losses.get(s) is None or after[s].hex() != ref_losses[s].hex()]
    bitwise_equal = after_steps == list(range(rstep + 1, p.steps + 1)) and not mismatches
    before_equal = all(before[s].hex() == ref_losses[s].hex() for s in before)
    first_after = min(a2_recs, key=lambda r: r["step"]) if a2_recs else None
    recovery = (first_after["time"] - t_kill) if first_after else None
    ok = bool(bitwise_equal and sources.get(str(p.victim)) == "peer-replica" and pbytes == 0)
    try:
        final = compare_final_states(os.path.join(paths.reference, "checkpoint", f"step-{p.steps}"),
                                     os.path.join(paths.failure, "checkpoint", f"step-{p.steps}"))
    except Exception as e:  # an extra: report it, do not fail the demo on it
        final = {"equal": None, "error": f"{type(e).__name__}: {e}"}

    times = sorted(r["time"] for r in a2_recs)
    gaps = [b - a for a, b in zip(times[1:], times[2:])]  # steps after the first one after the resume
    steady = statistics.median(gaps) if gaps else None
    first_s = None
    if phases and phases.get("phases"):
        ph = phases["phases"]
        if ph.get("first_step_done") and ph.get("restore_done"):
            first_s = ph["first_step_done"] - ph["restore_done"]
    report = {
        "ok": ok,
        "fault": p.fault,
        "replaced": {str(n): f"spare slot {s}" for n, s in a2.replaced.items()},
        "warm": a2.warm,
        "bitwise_equal": bitwise_equal,
        "restore_source": sources,
        "persistent_bytes_read_on_restore": pbytes,
        "recovery_seconds": None if recovery is None else round(recovery, 3),
        "first_step_after_restore_s": None if first_s is None else round(first_s, 3),
        "steady_step_s": None if steady is None else round(steady, 3),
        "recovery_phases": phases,
        "saves": saves,
        "ledger_runs": ledger_runs,
        "restored_step": rstep,
        "killed_node": p.victim,
        "killed_at_step": killed_at,
        "kill_after_local_step": p.kill_after,
        "restore_seconds": restore.get("seconds"),
        "restore": {k: restore.get(k) for k in ("step", "seconds", "attempts", "bytes", "persistent_bytes",
                                                 "sources", "failures")},
        "losses_compared": len(after_steps),
        "loss_mismatch_steps": mismatches,
        "losses_before_failure_equal_reference": before_equal,
        "final_state_bitwise_equal": final.get("equal"),
        "final_state_comparison": final,
        "losses": {
            "reference": {str(s): v for s, v in sorted(ref_losses.items())},
            "before_failure": {str(s): v for s, v in sorted(before.items())},
            "after_resume": {str(s): v for s, v in sorted(after.items())},
        },
        "seconds": {
            "assets": round(t_assets, 1),
            "reference_run": round(r0.t_end - r0.t_start, 1),
            "attempt_1_until_kill": round(t_kill - a1.t_start, 1),
            "attempt_2": round(a2.t_end - a2.t_start, 1),
            "wall": round(time.time() - t_begin, 1),
        },
        "config": {
            "model": "torchtitan llama3 debugmodel (tierckpt_dev.titan.config_registry.titan_demo)",
            "toml": os.path.relpath(p.toml, REPO) if p.toml.startswith(REPO) else p.toml,
            "nodes": p.nodes, "ranks_per_node": 1, "steps": p.steps,
            "local_interval": p.local_interval, "persistent_interval": p.persistent_interval,
            "replication_factor": 2, "replication_jump": 1, "job_id": JOB_ID,
            "local_root": paths.local_root_template, "persistent_folder": os.path.dirname(paths.ledger),
            "ledger": paths.ledger, "assets": str(assets.root),
            "launcher": ("launch/local.py --cold: one torchrun per simulated node and attempt" if p.cold else
                         "launch/local.py: one warm node agent per simulated node, each attempt's ranks forked "
                         "from it") + "; fresh port and TIERCKPT_RESTART_COUNT per attempt",
            "reference_cmd": ref.node_command(0, r0.port), "failure_cmd": fail.node_command(0, a1.port),
            "ports": {"attempt_1": a1.port, "attempt_2": a2.port},
            "env": {**RUN_ENV, "WORLD_SIZE": str(p.nodes), "LOCAL_WORLD_SIZE": "1"},
        },
        "logs": {"reference": r0.logs, "attempt_1": a1.logs, "attempt_2": a2.logs},
    }
    _write_json(os.path.join(paths.out, "report.json"), report)
    if con is not None:
        print_report(con, report, paths)
    return report


def recovery_phases(ledger: list[dict], t_kill: float | None) -> dict | None:
    """The ``recovery_phases`` of a report: the last ``recovery`` record of the ledger (the
    restarted attempt's timeline: tierckpt/recovery/timeline.py) as its ledger line, plus
    ``kill_to_failure_noticed_s``, the demo's own kill → the launcher noticing it (seconds;
    None when either is unknown). None when the ledger has no recovery record."""
    from tierckpt.records import RecoveryRecord

    line = next((r for r in reversed(ledger) if r.get("kind") == "recovery"), None)
    if line is None:
        return None
    rec = RecoveryRecord.from_ledger(line)
    noticed = rec.phases.get("failure_noticed") if isinstance(rec, RecoveryRecord) else None
    gap = None if t_kill is None or not isinstance(noticed, (int, float)) else round(noticed - t_kill, 3)
    return {**rec.as_line(), "kill_to_failure_noticed_s": gap}


def print_recovery(con, phases: dict | None) -> None:
    """The recovery's phases (``report["recovery_phases"]``) as a table, with the kill →
    failure-noticed gap; a line saying it is missing when the ledger had no record."""
    if phases is None:
        con.print("[yellow]recovery phases: no recovery record in the ledger[/]")
        return
    from tierckpt.cli.recovery import recovery_view
    from tierckpt.records import RecoveryRecord

    rec = RecoveryRecord.from_ledger({k: v for k, v in phases.items() if k != "kill_to_failure_noticed_s"})
    if isinstance(rec, RecoveryRecord):
        con.print(recovery_view(rec, title="recovery phases (tierckpt ledger)"))
    gap = phases.get("kill_to_failure_noticed_s")
    con.print(f"demo: SIGKILL → failure noticed by the launcher: {'-' if gap is None else f'{gap:.2f}'} s")


def print_report(con, report: dict, paths: Paths) -> None:
    from rich.table import Table

    ok = report["ok"]
    rs = report["restore_source"]
    after = {int(k): v for k, v in report["losses"]["after_resume"].items()}
    ref = {int(k): v for k, v in report["losses"]["reference"].items()}
    t = Table(title="tierckpt demo: torchtitan llama3 debugmodel, 2 simulated nodes", show_header=False)
    t.add_row("failure", f"node {report['killed_node']} SIGKILLed at step {report['killed_at_step']}, "
                         "its local root deleted, job restarted")
    t.add_row("restored step", str(report["restored_step"]))
    t.add_row("restore source", ", ".join(
        f"node {n}: " + (f"[green]{s}[/]" if s != "persistent" else f"[yellow]{s}[/]") for n, s in rs.items()))
    pb = report["persistent_bytes_read_on_restore"]
    t.add_row("persistent bytes read", f"[green]{pb}[/]" if pb == 0 else f"[red]{pb:,}[/]")
    rec = report["recovery_seconds"]
    t.add_row("recovery (kill → first step)", f"{rec:.2f} s (restore itself {report['restore_seconds']:.2f} s)"
              if rec is not None else "-")
    t.add_row("losses after resume", f"{report['losses_compared']} steps, bitwise equal to reference: "
              + ("[green]yes[/]" if report["bitwise_equal"] else f"[red]NO[/] (steps {report['loss_mismatch_steps']})"))
    show = [s for s in (report["restored_step"] + 1, report["restored_step"] + 2, max(after, default=0)) if s in after]
    t.add_row("loss: resumed vs reference", "\n".join(
        f"step {s}: {after[s]!r} " + ("==" if after[s].hex() == ref[s].hex() else "[red]!=[/]") + f" {ref[s]!r}"
        for s in dict.fromkeys(show)))
    t.add_row("losses before failure = reference", "yes" if report["losses_before_failure_equal_reference"] else "[red]no[/]")
    fc = report["final_state_comparison"]
    t.add_row("final state (step %d checkpoints)" % max(ref),
              f"model, optimizer, lr_scheduler, dataloader, train_state: {fc['entries']} entries bitwise equal "
              "to the reference" if fc.get("equal") else f"[red]differs[/]: {fc.get('differing', fc.get('error'))}"[:300])
    sec = report["seconds"]
    t.add_row("wall time", f"{sec['wall']:.0f} s (reference {sec['reference_run']:.0f} s, attempt 1 "
              f"{sec['attempt_1_until_kill']:.0f} s, attempt 2 {sec['attempt_2']:.0f} s)")
    con.print(t)
    print_recovery(con, report.get("recovery_phases"))
    st = Table(title="checkpoints (tierckpt ledger)")
    for c in ("attempt", "tier", "step", "blocking δ (ms)", "background (ms)", "bytes", "ok"):
        st.add_column(c, justify="left" if c == "tier" else "right")
    for s in report["saves"]:
        st.add_row(str(s["attempt"]), s["tier"], str(s["step"]), f"{1000 * s['blocking_s']:.1f}",
                   f"{1000 * s['background_s']:.0f}", f"{s['bytes']:,}", "yes" if s["ok"] else "[red]no[/]")
    con.print(st)
    rel = lambda x: os.path.relpath(x, os.getcwd())  # noqa: E731
    con.print(f"report: {rel(os.path.join(paths.out, 'report.json'))}   logs: {rel(paths.logs)}   "
              f"ledger: tierckpt ledger {rel(os.path.dirname(paths.ledger))}")
    con.print(("[bold green]PASS[/]" if ok else "[bold red]FAIL[/]") + f" in {sec['wall']:.1f} s")


# =============================================================================================
# main
# =============================================================================================
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                                 epilog="Other --section.key VALUE arguments are passed to every run "
                                        "(python -m titan_plugin.train overrides, e.g. --training.seq_len 128).")
    d = DemoParams()
    ap.add_argument("--out", default=DEFAULT_OUT, help="output directory (cleared at start)")
    ap.add_argument("--toml", default=d.toml, help="training config")
    ap.add_argument("--steps", type=int, default=d.steps, help="training.steps of every run")
    ap.add_argument("--kill-after", type=int, default=d.kill_after,
                    help="kill once this local step is committed and a later step has run")
    ap.add_argument("--local-interval", type=int, default=d.local_interval, help="checkpoint.local_interval")
    ap.add_argument("--persistent-interval", type=int, default=d.persistent_interval, help="checkpoint.interval")
    ap.add_argument("--victim", type=int, default=d.victim, help="node to kill")
    ap.add_argument("--fault", choices=("kill", "stop"), default=d.fault,
                    help="kill: SIGKILL the node's rank and delete its disk; stop: SIGSTOP the whole node (agent and "
                         "rank), found by the launcher's hang detection and replaced by a spare node")
    ap.add_argument("--cold", action="store_true",
                    help="run every attempt cold (launch/local.py --cold: a torchrun per node and attempt), the "
                         "baseline of the warm restart")
    ap.add_argument("--hang-timeout", type=float, default=d.hang_timeout,
                    help="the launcher's --hang-timeout (seconds a node may stop ticking)")
    ap.add_argument("--timeout", type=float, default=d.timeout, help="per attempt, seconds")
    args, extra = ap.parse_known_args(argv)
    if any(not a.startswith("--") for a in extra[:1]):
        ap.error(f"unrecognized arguments: {extra}")
    params = DemoParams(steps=args.steps, kill_after=args.kill_after, local_interval=args.local_interval,
                        persistent_interval=args.persistent_interval, victim=args.victim, fault=args.fault,
                        hang_timeout=args.hang_timeout, cold=args.cold,
                        toml=os.path.abspath(args.toml), timeout=args.timeout, extra=extra)
    try:
        params.check()
    except ValueError as e:
        ap.error(str(e))

    import warnings

    from rich.console import Console

    warnings.filterwarnings("ignore", message="The pynvml package is deprecated")
    con = Console()
    out = os.path.abspath(args.out)
    try:
        clear_out(out)
    except ValueError as e:
        con.print(f"[red]{e}[/]")
        return 2
    con.print(f"[bold]tierckpt demo[/]: torchtitan llama3 debugmodel, {params.nodes} simulated nodes × 1 rank "
              f"(FSDP2 over gloo, CPU), {params.steps} steps; local tier + replica every "
              f"{params.local_interval}, persistent every {params.persistent_interval}; node {params.victim} "
              f"dies after local step {params.kill_after}")

    def on_term(signum, frame):  # make `kill <launcher>` clean up its ranks too
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    try:
        report = run_demo(out, params, console=con)
    except DemoError as e:
        from rich.markup import escape

        con.print("[red]demo failed:[/]\n" + escape(str(e)))
        return 2
    except KeyboardInterrupt:
        con.print("[red]interrupted[/]")
        return 130
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
