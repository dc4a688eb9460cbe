"""Preemption notice: a signal (Slurm's ``--signal``, a scheduler's SIGTERM before SIGKILL)
asks the job to make its progress durable and exit within a grace period.

The handler only records the signal (async-signal-safe: no I/O, no collectives). The
trainer's thread asks :meth:`tierckpt.engine.TieredCheckpointer.preemption_requested` once per
step; the ranks agree on it over the control group, so every rank takes the final save at
the same step even when the signal reached them at different steps.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from typing import Any
import time

from tierckpt.errors import ConfigError, TierckptError

log = logging.getLogger(__name__)

#: signals watched by default: SIGTERM (Slurm's and Kubernetes' notice before SIGKILL, and
#: what torchrun forwards to its workers) and SIGUSR1 (``sbatch --signal=USR1@<seconds>``)
DEFAULT_SIGNALS = ("SIGTERM", "SIGUSR1")

#: exit status of a trainer that saved on a preemption notice and wants to be requeued
#: (EX_TEMPFAIL: "try again"; the Slurm launcher's TIERCKPT_REQUEUE_EXIT default as well)
PREEMPTED_EXIT = 75


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
    Raises:
        ConfigError: as :func:`signal_numbers`.
    """

    def __init__(self, signals=DEFAULT_SIGNALS, escalate_after_s: float = 60.0):
        self._nums = signal_numbers(signals)
        self.escalate_after_s = escalate_after_s
        self.received: str | None = None
        self._first_at = 0.0
        self._previous: dict[int, Any] = {}  # what signal.signal returned: a handler, SIG_DFL/SIG_IGN or None
        if threading.current_thread() is not threading.main_thread():
            if self._nums:
                log.warning("tierckpt: not in the main thread: preemption signals are not watched")
            return
        for num in self._nums:
            self._previous[num] = signal.signal(num, self._handler)

    def _handler(self, signum, frame) -> None:
        if self.received is None:
            self.received = signal.Signals(signum).name
            self._first_at = time.monotonic()
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
