"""Warm processes: a node agent imports the trainer once and forks every attempt's ranks.

A cold start of a rank costs a new interpreter importing torch and the framework (9-10 s for
torchtitan on the 2-core demo machine, before the first log line) — on every restart, for the
survivors as much as for the replacement. A node agent (:mod:`tierckpt.recovery.agent`)
imports those modules once (:func:`preload`), then forks one child per rank for each attempt
(:func:`spawn`). The child is the rank: it sets the attempt's environment and ``sys.argv`` and
runs the training module or script as ``__main__`` (:func:`run_child`), exactly what
``torchrun`` would exec, minus the imports.

**What must hold at the fork, and why (GPU nodes).** A CUDA context, an NCCL communicator or
a gloo group does not survive ``fork()``: a child that inherits one crashes or hangs on first
use. So the agent never creates them — it only imports — and every rank creates its own after
the fork (torchtitan's ``init_distributed``, Megatron's ``initialize_megatron``), and they die
with it: each attempt builds fresh communicators. :func:`preload` sets
``PYTORCH_NVML_BASED_CUDA_CHECK=1`` first, so a module that calls ``torch.cuda.is_available()``
at import asks NVML instead of initialising the CUDA driver, and :func:`fork_problems` is
checked before every fork: a CUDA context (``torch.cuda.is_initialized()``), an initialised
``torch.distributed``, or a second Python thread (a lock it holds would stay locked in the
child) make the agent start that attempt's ranks cold (a new interpreter) with a warning,
never fork them. Native threads that are fork-aware (jemalloc's ``jemalloc_bg_thd``, which
some imported libraries start) are allowed.
"""

from __future__ import annotations

import importlib
import logging
import os
import runpy
import sys
import threading
import time
import traceback
import warnings
from dataclasses import dataclass, field

from tierckpt import clock
from tierckpt.recovery import beacon

log = logging.getLogger(__name__)

NVML_CHECK_ENV = "PYTORCH_NVML_BASED_CUDA_CHECK"
PROCESS_STARTED_ENV = "TIERCKPT_PROCESS_STARTED"
#: native threads that survive a fork safely (their library re-initialises in the child)
FORK_SAFE_NATIVE_THREADS = ("jemalloc_bg_thd",)


@dataclass
class Preloaded:
    """What :func:`preload` imported.

    Attributes:
        seconds: wall seconds of the imports.
        modules: the names imported.
        failed: ``{name: "ExcType: message"}`` for the names that did not import (the rank
            will meet the same error when it imports them itself).
    """

    seconds: float = 0.0
    modules: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)


def preload(names: list[str]) -> Preloaded:
    """Import ``names`` in this process (the agent), CUDA-safely (see the module docstring).

    A name that fails to import is recorded, not raised: the agent stays usable, and the rank
    reports the error itself with its own traceback.
    """
    os.environ.setdefault(NVML_CHECK_ENV, "1")
    if "torch" not in sys.modules:
        # libgomp starts its pool (N-1 threads) when torch is imported, and a child forked
        # after that hangs in its first parallel region (GNU OpenMP is not fork-safe); each rank
        # sets its own count after the fork instead (:func:`_match_thread_count`)
        os.environ["OMP_NUM_THREADS"] = "1"
    out = Preloaded()
    t0 = time.monotonic()
    for name in names:
        try:
            importlib.import_module(name)
            out.modules.append(name)
        except BaseException as e:  # noqa: BLE001 - a module may raise SystemExit at import
            out.failed[name] = f"{type(e).__name__}: {e}"
    out.seconds = time.monotonic() - t0
    return out


def _native_threads() -> list[str]:
    """Names of this process's threads other than the main one (from /proc; Linux)."""
    try:
        tasks = [t for t in os.listdir("/proc/self/task") if t != str(os.getpid())]
    except OSError:
        return []
    names = []
    for t in tasks:
        try:
            with open(f"/proc/self/task/{t}/comm") as f:
                names.append(f.read().strip())
        except OSError:
            continue
    return names


def fork_problems() -> list[str]:
    """Why forking ranks from this process now would be unsafe ([] when it is safe).

    Checks: no CUDA context (``torch.cuda.is_initialized()``, only when torch was imported), no
    initialised ``torch.distributed`` process group, no Python thread other than the main one,
    no native thread other than the main one and :data:`FORK_SAFE_NATIVE_THREADS`.
    """
    problems = []
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            if torch.cuda.is_initialized():
                problems.append("a CUDA context exists in the agent (torch.cuda.is_initialized())")
        except Exception as e:  # noqa: BLE001 - a broken CUDA module is a reason not to fork
            problems.append(f"torch.cuda cannot be queried ({type(e).__name__}: {e})")
        dist = getattr(torch, "distributed", None)
        try:
            if dist is not None and dist.is_available() and dist.is_initialized():
                problems.append("torch.distributed is initialised in the agent")
        except Exception:  # noqa: BLE001 - no process group API: nothing to inherit
            pass
    others = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    if others:
        problems.append(f"Python threads besides the main one: {others}")
    extra = [n for n in _native_threads() if n not in FORK_SAFE_NATIVE_THREADS]
    if len(extra) > len(others):
        problems.append(f"native threads besides the main one: {extra} (e.g. an OpenMP pool: "
                        f"the agent imports with OMP_NUM_THREADS=1)")
    return problems


@dataclass(frozen=True)
class RankSpec:
    """One rank of one attempt, as the launcher asks the agent to start it.

    Attributes:
        argv: what follows the interpreter: ``["-m", "pkg.mod", args…]`` or
            ``["script.py", args…]`` (torchrun's training command).
        env: the rank's whole environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, …).
        log: file receiving the rank's stdout and stderr (appended).
        cwd: working directory.
    """

    argv: tuple[str, ...]
    env: dict[str, str]
    log: str
    cwd: str


def _die_with_parent() -> None:
    """SIGKILL this rank when the agent dies (Linux ``PR_SET_PDEATHSIG``): a rank never
    outlives the agent that watches it."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
    except Exception:  # noqa: BLE001 - not Linux: the launcher's kill of the group still works
        pass


def _match_thread_count(env: dict[str, str]) -> None:
    """The agent imported torch with one OpenMP thread (:func:`preload`); the rank gets the
    count a cold start would have: its ``OMP_NUM_THREADS``, else OpenMP's default (the CPUs
    this process may run on), through ``torch.set_num_threads`` — the rank's pool is then
    created after the fork, in the rank."""
    torch = sys.modules.get("torch")
    if torch is None:
        return
    raw = env.get("OMP_NUM_THREADS", "").strip()
    want = int(raw) if raw.isdigit() and int(raw) > 0 else len(os.sched_getaffinity(0))
    if torch.get_num_threads() != want:
        torch.set_num_threads(want)


def run_argv(argv: list[str]) -> int:
    """Run ``argv`` (``["-m", module, args…]`` or ``[script, args…]``) as ``__main__`` in this
    process, as ``python <argv>`` would; returns the exit status (``SystemExit``'s code, 1 after
    an uncaught exception, whose traceback goes to stderr).

    Raises:
        ValueError: ``argv`` is empty or ``-m`` has no module.
    """
    if not argv or (argv[0] == "-m" and len(argv) < 2):
        raise ValueError(f"need -m MODULE [args] or SCRIPT [args], got {argv!r}")
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            with warnings.catch_warnings():  # the agent may have imported it: runpy warns, then runs it anyway
                warnings.filterwarnings("ignore", message=r".*found in sys\.modules after import of package",
                                        category=RuntimeWarning)
                runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    except BaseException:  # noqa: BLE001 - the rank's crash is reported like an interpreter's
        traceback.print_exc()
        return 1
    return 0


def child_main(spec: RankSpec) -> int:
    """Run the rank in this (freshly forked or exec'd) process; returns its exit status.

    Puts the rank in a process group of its own (the launcher signals or kills the group, the
    rank's DataLoader workers included), restores default signal dispositions, points stdio at
    ``spec.log``, sets the environment, starts the beacon, runs the module or script as
    ``__main__`` and runs the ``atexit`` handlers (:mod:`tierckpt.exit` finishes a save there)
    — as the interpreter would at a normal exit.
    """
    import atexit
    import signal

    os.setpgid(0, 0)
    _die_with_parent()
    for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP, signal.SIGCHLD):
        signal.signal(s, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a new interpreter
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    fd = os.open(spec.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.close(null)
    os.environ.clear()
    os.environ.update(spec.env)
    os.chdir(spec.cwd)
    if spec.env.get("PYTHONUNBUFFERED"):
        for stream in (sys.stdout, sys.stderr):
            reconfigure = getattr(stream, "reconfigure", None)
            if reconfigure is not None:
                reconfigure(write_through=True)
    _match_thread_count(spec.env)
    beacon.start_from_env()
    code = run_argv(list(spec.argv))
    try:
        atexit._run_exitfuncs()
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed stream at exit
            pass
    return code


def spawn(spec: RankSpec, close_fds: list[int]) -> int:
    """Fork the rank of ``spec`` from this process (warm); returns its pid.

    ``close_fds``: descriptors the child must not keep (the agent's connection to the
    launcher). The caller checks :func:`fork_problems` first.

    Raises:
        OSError: fork failed.
    """
    env = dict(spec.env)
    env[PROCESS_STARTED_ENV] = repr(clock.now())
    spec = RankSpec(argv=spec.argv, env=env, log=spec.log, cwd=spec.cwd)
    for stream in (sys.stdout, sys.stderr):  # nothing buffered in the agent is written twice
        stream.flush()
    pid = os.fork()
    if pid != 0:
        try:  # as a shell does: the group exists once fork returns, before the child ran at all
            os.setpgid(pid, pid)
        except OSError:  # the child got there first, or already exec'd/exited
            pass
    if pid == 0:  # pragma: no cover - runs in the child, whose coverage is not collected
        code = 1
        try:
            for fd in close_fds:
                try:
                    os.close(fd)
                except OSError:
                    pass
            code = child_main(spec)
        finally:
            os._exit(code & 0xFF)  # as the interpreter: sys.exit(-1) is status 255
    return pid
