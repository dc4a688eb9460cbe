"""Preemption notice: a signal (Slurm's ``--signal``, a scheduler's SIGTERM before SIGKILL)
asks the job to make its progress durable and exit within a grace period.

The handler only records the signal (async-signal-safe: no I/O, no collectives). The
trainer's thread asks :meth:`tierckpt.engine.TieredCheckpointer.preemption_requested` once per
step; the ranks agree on it over the control group, so every rank takes the final save at
the same step even when the signal reached them at different steps.
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import threading
from typing import Any, Callable, Iterable, Protocol
import time

from tierckpt.errors import ConfigError, TierckptError
from tierckpt.handle import SaveHandle
from tierckpt.records import CheckpointRecord

log = logging.getLogger(__name__)

#: signals watched by default: SIGTERM (Slurm's and Kubernetes' notice before SIGKILL, and
#: what torchrun forwards to its workers) and SIGUSR1 (``sbatch --signal=USR1@<seconds>``)
DEFAULT_SIGNALS = ("SIGTERM", "SIGUSR1")

#: exit status of a trainer that saved on a preemption notice and wants to be requeued
#: (EX_TEMPFAIL: "try again"; the Slurm launcher's TIERCKPT_REQUEUE_EXIT default as well)
PREEMPTED_EXIT = 75

#: environment of a rank: the shutdown timeout (seconds) its launcher passed to torchrun, exported
#: by ``python -m tierckpt.launch`` and the Slurm wrapper (and read by tierckpt.launch as its
#: default; see :func:`launcher_shutdown_timeout`)
SHUTDOWN_ENV = "TIERCKPT_SHUTDOWN_TIMEOUT"

#: ``python -m tierckpt.launch``'s torchrun shutdown timeout (seconds) unless told otherwise
DEFAULT_SHUTDOWN_S = 90

#: torchrun's own shutdown timeout (seconds; ``--shutdown-timeout``, else
#: ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``, else this)
TORCHRUN_SHUTDOWN_S = 30

#: seconds a launcher's shutdown window must exceed ``preemption_grace_s`` by: the rest of the
#: training step the notice landed in, and the exit after the save (a start-up check cannot
#: measure the step)
SHUTDOWN_MARGIN_S = 15.0

#: environment variables that say a process runs under a launcher: torchrun's agent, Slurm,
#: MPI launchers (``WORLD_SIZE`` > 1 counts as well)
LAUNCHER_ENV = ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "SLURM_STEP_ID", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE",
                "PMIX_RANK")

#: directory a launcher (``python -m tierckpt.launch``, ``launch/local.py``) gives its ranks:
#: each rank that finished a preemption save leaves ``rank-<RANK>.json`` there, which tells the
#: launcher that its ranks preempted (its exit status is then :data:`PREEMPTED_EXIT`)
PREEMPTED_DIR_ENV = "TIERCKPT_PREEMPTED_DIR"


class Preempted(TierckptError):
    """Raised by an adapter's save hook after the final save of a preemption notice: the
    trainer should close and exit with :data:`PREEMPTED_EXIT`.

    Attributes:
        step: the step saved.
        signal: the signal's name (``"SIGTERM"``).
        committed: ``{tier: committed before the grace period ended}``.
    """

    def __init__(self, step: int, signal_name: str, committed: dict[str, bool]):
        self.step, self.signal, self.committed = step, signal_name, dict(committed)
        durable = ", ".join(t for t, ok in committed.items() if ok) or "no tier"
        super().__init__(f"tierckpt: {signal_name} received: step {step} saved ({durable} committed); "
                         f"exiting with status {PREEMPTED_EXIT} to be requeued")


def signal_numbers(names, option: str = "preemption_signals") -> tuple[int, ...]:
    """Signal numbers of ``names`` (``"SIGTERM"``, ``"USR1"``, ``"SIGUSR1"``).

    Raises:
        ConfigError: an unknown name, or SIGKILL/SIGSTOP (they cannot be caught).
    """
    out = []
    for n in names:
        name = n if str(n).startswith("SIG") else f"SIG{n}"
        num = getattr(signal, str(name), None)
        if not isinstance(num, signal.Signals) or num in (signal.SIGKILL, signal.SIGSTOP):
            raise ConfigError(option, f"{n!r} is not a signal a process can catch; e.g. SIGTERM, SIGUSR1, SIGINT")
        out.append(int(num))
    return tuple(out)


class PreemptionWatch:
    """Records the first of ``signals`` this process receives (main thread only installs). A
    signal arriving ``escalate_after_s`` or more after the first gets the signal's previous
    action (default: the process dies), so a trainer stuck in a collective can still be
    stopped; earlier repeats are duplicates (Slurm signals every process of a step and torchrun
    forwards the same SIGTERM to its workers) and only recorded.

    Args:
        signals: signal names; empty = watch nothing (the framework handles signals itself).
        escalate_after_s: seconds after the first signal from which another one escalates.
        on_notice: called (in the signal handler) when the first notice arrives; the engine
            passes :func:`tierckpt.loader_signals.defer_loader_deaths`, so the same notice
            killing this rank's DataLoader workers does not abort the step before its save.
    Raises:
        ConfigError: as :func:`signal_numbers`.
    """

    def __init__(self, signals=DEFAULT_SIGNALS, escalate_after_s: float = 60.0,
                 on_notice: Callable[[], object] | None = None):
        self._nums = signal_numbers(signals)
        self.escalate_after_s = escalate_after_s
        self.received: str | None = None
        self._first_at = 0.0
        self._previous: dict[int, Any] = {}  # what signal.signal returned: a handler, SIG_DFL/SIG_IGN or None
        if threading.current_thread() is not threading.main_thread():
            if self._nums:
                log.warning("tierckpt: not in the main thread: preemption signals are not watched")
            return
        self._on_notice = on_notice
        for num in self._nums:
            self._previous[num] = signal.signal(num, self._handler)

    def _handler(self, signum, frame) -> None:
        if self.received is None:
            self.received = signal.Signals(signum).name
            self._first_at = time.monotonic()
            # the same notice may kill this rank's DataLoader workers (a signal to the process
            # group): their death must not abort the step before its preemption save
            if self._on_notice is not None:
                self._on_notice()
            return
        if time.monotonic() - self._first_at < self.escalate_after_s:
            return  # the same notice delivered twice (Slurm to every process, torchrun forwarding)
        # the sender insists long after the notice (the trainer is stuck in a collective and
        # never reaches a step end): the signal's previous action, e.g. death by SIGTERM
        prev = self._previous.get(signum, signal.SIG_DFL)
        self.close()
        if callable(prev):
            prev(signum, frame)
        elif prev != signal.SIG_IGN:
            os.kill(os.getpid(), signum)

    def close(self) -> None:
        """Put the previous handlers back (main thread)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for num, prev in self._previous.items():
            try:
                signal.signal(num, prev)
            except (TypeError, ValueError):
                pass
        self._previous.clear()


def mark_preempted(step: int, signal_name: str, committed: dict[str, bool]) -> str | None:
    """Leave ``rank-<RANK>.json`` (``{rank, local_rank, local_world_size, step, signal,
    committed}``) in ``$TIERCKPT_PREEMPTED_DIR`` when a launcher set it: this rank finished
    its preemption save. Returns the path, or None (no directory, or it cannot be written:
    logged, the exit stays a preemption's)."""
    folder = os.environ.get(PREEMPTED_DIR_ENV, "").strip()
    if not folder:
        return None
    env = os.environ
    rank = env.get("RANK", "0")
    doc = {"rank": int(rank), "local_rank": int(env.get("LOCAL_RANK", "0")),
           "local_world_size": int(env.get("LOCAL_WORLD_SIZE", "1")), "step": step, "signal": signal_name,
           "committed": committed}
    path = os.path.join(folder, f"rank-{rank}.json")
    try:
        with open(path + ".tmp", "w") as f:
            json.dump(doc, f)
        os.replace(path + ".tmp", path)
    except OSError as e:
        log.warning("tierckpt: cannot tell the launcher about the preemption save (%s): %s", path, e)
        return None
    return path


def read_preempted(folder: str) -> list[dict]:
    """The marks :func:`mark_preempted` left in ``folder`` (unreadable ones skipped)."""
    out: list[dict] = []
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return out
    for n in names:
        if n.startswith("rank-") and n.endswith(".json"):
            try:
                with open(os.path.join(folder, n)) as f:
                    out.append(json.load(f))
            except (OSError, ValueError):
                pass
    return out


def all_local_ranks_preempted(folder: str) -> bool:
    """Whether every rank of this node (``local_rank`` 0..``local_world_size``-1, as the marks
    say) left a preemption mark in ``folder``."""
    marks = read_preempted(folder)
    if not marks:
        return False
    size = max(int(m.get("local_world_size", 1)) for m in marks)
    return {int(m.get("local_rank", -1)) for m in marks} >= set(range(size))


def _signal_masks(pid: int) -> tuple[int, int, str]:
    """(SigCgt, SigIgn, Name) of ``pid`` from /proc (Linux).

    Raises:
        OSError: no such process or no /proc.
    """
    caught = ignored = 0
    name = "?"
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, val = line.partition(":")
            if key == "SigCgt":
                caught = int(val.strip(), 16)
            elif key == "SigIgn":
                ignored = int(val.strip(), 16)
            elif key == "Name":
                name = val.strip()
    return caught, ignored, name


def unprotected_launcher_signals(signals, pid: int | None = None) -> tuple[list[str], str]:
    """The watched ``signals`` that process ``pid`` (default: this process's parent, the
    launcher: torchrun, a wrapper script) neither catches nor ignores — a notice sent to it
    kills it at once (e.g. SIGUSR1: status 138) and orphans the ranks — and its name.
    ``([], "")`` when /proc cannot tell (not Linux, the parent gone)."""
    pid = os.getppid() if pid is None else pid
    if pid <= 1:
        return [], ""
    try:
        caught, ignored, name = _signal_masks(pid)
    except (OSError, ValueError):
        return [], ""
    out = []
    for num in signal_numbers(signals):
        bit = 1 << (num - 1)
        if not (caught | ignored) & bit:
            out.append(signal.Signals(num).name)
    return out, name


def under_launcher(env=None) -> bool:
    """Whether this process runs under a launcher (:data:`LAUNCHER_ENV`, or ``WORLD_SIZE`` > 1)
    rather than alone from a shell: only then can a launcher that dies on a notice orphan it."""
    env = os.environ if env is None else env
    if any(env.get(k) for k in LAUNCHER_ENV):
        return True
    try:
        return int(env.get("WORLD_SIZE", "1") or 1) > 1
    except ValueError:
        return True


def _cmdline(pid: int) -> list[str] | None:
    """The command line of ``pid`` (Linux /proc), None when it cannot be read."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return None


def _launcher_args(argv: list[str]) -> tuple[str, list[str]] | None:
    """(launcher, its options) of a command line that runs torchrun (``torchrun``, ``python -m
    torch.distributed.run``, ``python -m tierckpt.launch``): the options up to the training
    script, or None for another command."""
    for i, a in enumerate(argv):
        name = ("tierckpt.launch" if a == "tierckpt.launch" else
                "torchrun" if a in ("torch.distributed.run", "torch.distributed.launch")
                or os.path.basename(a) == "torchrun" or a.endswith(os.path.join("distributed", "run.py")) else None)
        if name is None:
            continue
        opts: list[str] = []
        rest = argv[i + 1:]
        for j, o in enumerate(rest):
            if o == "--" or o.endswith(".py") or (j > 0 and rest[j - 1] in ("-m", "--module")):
                break
            opts.append(o)
        return name, opts
    return None


def _option(argv: list[str], *names: str) -> str | None:
    """The value of the first of ``names`` in ``argv`` (``--name V`` or ``--name=V``)."""
    for i, a in enumerate(argv):
        for n in names:
            if a == n and i + 1 < len(argv):
                return argv[i + 1]
            if a.startswith(n + "="):
                return a[len(n) + 1:]
    return None


def _seconds(raw: str | None) -> int | None:
    raw = (raw or "").strip()
    return int(raw) if raw.isdigit() else None


def torchrun_shutdown_timeout(argv: list[str], env=None) -> tuple[int, str]:
    """(seconds, where from) torchrun waits for its ranks after forwarding a signal before it
    SIGKILLs them, for torchrun options ``argv`` and environment ``env``, as torchrun decides
    it: ``--shutdown-timeout``, else ``PET_SHUTDOWN_TIMEOUT``, else
    ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``, else :data:`TORCHRUN_SHUTDOWN_S`."""
    env = os.environ if env is None else env
    v = _seconds(_option(argv, "--shutdown-timeout", "--shutdown_timeout"))
    if v is not None:
        return v, "--shutdown-timeout"
    for key in ("PET_SHUTDOWN_TIMEOUT", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"):
        v = _seconds(env.get(key))
        if v is not None:
            return v, key
    return TORCHRUN_SHUTDOWN_S, "torchrun's default"


def launcher_shutdown_timeout(env=None, pid: int | None = None) -> tuple[int, str] | None:
    """(seconds, where from) this rank's torchrun (its parent ``pid``) waits after forwarding a
    notice before it SIGKILLs the ranks; None when this process is not a torchrun worker
    (no ``TORCHELASTIC_RUN_ID``). The value ``python -m tierckpt.launch`` exported
    (:data:`SHUTDOWN_ENV`) under that launcher, or where the launcher's command line cannot be
    read; under plain torchrun its command line and environment
    (:func:`torchrun_shutdown_timeout`)."""
    env = os.environ if env is None else env
    if not env.get("TORCHELASTIC_RUN_ID"):
        return None
    argv = _cmdline(os.getppid() if pid is None else pid)
    found = _launcher_args(argv) if argv is not None else None
    exported = _seconds(env.get(SHUTDOWN_ENV))
    if exported is not None and (found is None or found[0] == "tierckpt.launch"):
        return exported, f"{SHUTDOWN_ENV} from the launcher"
    return torchrun_shutdown_timeout(found[1] if found else [], env)


def suggested_shutdown_s(grace_s: float) -> int:
    """A torchrun ``--shutdown-timeout`` (seconds) that covers ``grace_s`` with room to spare."""
    return max(DEFAULT_SHUTDOWN_S, math.ceil(grace_s + SHUTDOWN_MARGIN_S) + 30)


def warn_if_shutdown_too_short(grace_s: float, env=None, pid: int | None = None) -> tuple[int, str] | None:
    """Log one warning when this rank's torchrun would SIGKILL it before a preemption save can
    end: its shutdown timeout (:func:`launcher_shutdown_timeout`) not above ``grace_s``
    (``preemption_grace_s``) + :data:`SHUTDOWN_MARGIN_S`. Returns (seconds, where from) when it
    warned, else None."""
    got = launcher_shutdown_timeout(env, pid)
    if got is None or got[0] > grace_s + SHUTDOWN_MARGIN_S:
        return None
    seconds, source = got
    log.warning("tierckpt: the launcher (torchrun, parent pid %d) SIGKILLs the ranks %ds after it forwards a preemption "
                "notice (%s), not more than preemption_grace_s = %gs + %gs for the rest of the step and the exit: "
                "the final save can be killed before the persistent tier commits. Launch with `python -m "
                "tierckpt.launch` (%ds by default, $%s), or pass `torchrun --shutdown-timeout %d` (or set "
                "TORCH_ELASTIC_SHUTDOWN_TIMEOUT=%d for torchrun); or lower preemption_grace_s",
                os.getppid() if pid is None else pid, seconds, source, grace_s, SHUTDOWN_MARGIN_S, DEFAULT_SHUTDOWN_S,
                SHUTDOWN_ENV, suggested_shutdown_s(grace_s), suggested_shutdown_s(grace_s))
    return got


def warn_if_launcher_unprotected(signals, grace_s: float | None = None) -> list[str]:
    """Log one warning when this process's parent dies on a watched signal (see
    :func:`unprotected_launcher_signals`), naming what to set, and one when its torchrun's
    shutdown timeout leaves a preemption save of ``grace_s`` seconds too little time
    (:func:`warn_if_shutdown_too_short`; skipped when ``grace_s`` is None); only on the
    launcher's first rank (``LOCAL_RANK`` 0 or unset), once per launcher, and only under a
    launcher (:func:`under_launcher`: a single process started from a shell has none to be
    orphaned by, so its shell dying on SIGUSR1 is no concern). Returns the signals its parent
    dies on ([] elsewhere)."""
    if not signals or os.environ.get("LOCAL_RANK", "0") != "0":
        return []
    if not under_launcher():
        log.debug("tierckpt: no launcher (a single process): the start-up launcher check is skipped")
        return []
    if grace_s is not None:
        warn_if_shutdown_too_short(grace_s)
    bad, name = unprotected_launcher_signals(signals)
    if bad:
        wanted = ",".join(dict.fromkeys(["SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", *bad]))
        timeout = suggested_shutdown_s(25.0 if grace_s is None else grace_s)
        log.warning("tierckpt: the launcher (parent pid %d, %s) dies on %s, a watched preemption signal: a "
                    "notice sent to it kills it at once and leaves the ranks training without a save. "
                    "Launch with `python -m tierckpt.launch` (torchrun that forwards these and exits 75 when "
                    "the ranks preempted), or `torchrun --signals-to-handle %s --shutdown-timeout %d`, or make the "
                    "launcher trap or ignore %s; or narrow preemption_signals", os.getppid(), name, "/".join(bad),
                    wanted, timeout, "/".join(bad))
    return bad


def requested(signals: tuple[str, ...], watch: PreemptionWatch, control) -> str | None:
    """Whether any rank received one of ``signals`` (``TierConfig.preemption_signals``): the
    signal's name (the same answer on every rank) or None. Collective over ``control`` when
    signals are watched (one 4-byte all-reduce)."""
    import torch
    import torch.distributed as dist

    if not signals:
        return None
    got = watch.received
    idx = signals.index(got) if got in signals else -1
    flag = torch.tensor([idx], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=control)
    idx = int(flag.item())
    return None if idx < 0 else signals[idx]


# -- what the final save needs of the engine: structural types (the engine, its config and its
# journal are in wings above this one, so they are described here, not imported)
class GraceConfig(Protocol):
    """The options :func:`final_save` reads (:class:`tierckpt.config.TierConfig` has them)."""

    @property
    def tiers(self) -> tuple[str, ...]: ...

    @property
    def preemption_grace_s(self) -> float: ...


class RankOf(Protocol):
    """This rank's global rank (:class:`tierckpt.cluster.topology.Topology` has it)."""

    @property
    def rank(self) -> int: ...


class FinalSaveEngine(Protocol):
    """The public part of :class:`tierckpt.engine.TieredCheckpointer` that :func:`final_save` uses."""

    @property
    def cfg(self) -> GraceConfig: ...

    @property
    def topo(self) -> RankOf: ...

    def unraised_failures(self) -> list[CheckpointRecord]: ...

    def save(self, step: int, state_dict: dict, tiers: Iterable[str] | None = None, *,
             raise_failures: bool = True, wait_previous: bool = False) -> SaveHandle: ...


class PreemptionJournal(Protocol):
    """Where the ``preemption`` record goes (:class:`tierckpt.history.journal.RunJournal`)."""

    def preemption(self, step: int, signal: str, committed: dict[str, bool], seconds: float,
                   earlier_failures: list[str]) -> None: ...


def final_save(engine: FinalSaveEngine, journal: PreemptionJournal, step: int, state_dict: dict,
               signal_name: str, handle: SaveHandle | None = None) -> Preempted:
    """The final save of a preemption notice over the engine's public methods (see
    :meth:`tierckpt.engine.TieredCheckpointer.save_for_preemption`; collective): every tier
    at ``step`` (those ``handle`` did not start yet, with ``wait_previous``), the local tier
    waited for first, the persistent tier with what is left of ``preemption_grace_s``
    (seconds); the ``preemption`` ledger record (``journal``) and the marker file for the
    launcher. Returns the :class:`Preempted` to raise."""
    from concurrent.futures import TimeoutError as FuturesTimeout

    cfg, t0 = engine.cfg, time.monotonic()
    earlier = [f"{r.tier} step {r.step}: {r.error}" for r in engine.unraised_failures()]
    # an earlier failed save must not cancel the final one: it is reported, not raised
    if handle is None or handle.step != step:
        handle = engine.save(step, state_dict, raise_failures=False, wait_previous=True)
    else:  # tiers not saved at this step yet (only the local tier was due, or a tier deferred)
        missing = [t for t in cfg.tiers if t not in handle.futures
                   and (t not in handle.skipped or handle.skipped[t].deferred)]
        if missing:
            more = engine.save(step, state_dict, tiers=missing, raise_failures=False, wait_previous=True)
            kept = {t: r for t, r in handle.skipped.items() if t not in missing}
            handle = SaveHandle(step, handle.blocking_s + more.blocking_s, {**handle.futures, **more.futures},
                                {**kept, **more.skipped})
    committed = {t: False for t in cfg.tiers}
    committed.update({t: r.ok for t, r in handle.skipped.items()})
    for t in sorted(handle.futures, key=lambda t: t != "local"):
        left = max(0.0, cfg.preemption_grace_s - (time.monotonic() - t0))
        try:
            committed[t] = handle.futures[t].result(timeout=left).ok
        except FuturesTimeout:
            log.error("tierckpt: preemption: the %s tier did not commit step %d within "
                      "preemption_grace_s = %gs", t, step, cfg.preemption_grace_s)
    journal.preemption(step, signal_name, committed, time.monotonic() - t0, earlier)
    mark_preempted(step, signal_name, committed)  # for a launcher mapping this exit to "requeue me"
    if engine.topo.rank == 0:  # agreed: once per job
        log.warning("tierckpt: %s: step %d saved for the requeue (%s) in %.1fs", signal_name, step,
                    ", ".join(f"{t} {'committed' if ok else 'NOT committed'}" for t, ok in committed.items()),
                    time.monotonic() - t0)
    return Preempted(step, signal_name, committed)
