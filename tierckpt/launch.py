"""``python -m tierckpt.launch [torchrun options] (-m MODULE | SCRIPT) [args …]``: torchrun
that survives a preemption notice and says "requeue me".

Plain torchrun handles SIGTERM, SIGINT, SIGHUP and SIGQUIT only: a SIGUSR1 (Slurm's
``--signal=USR1@…``, which tierckpt watches by default) kills it at once with status 138,
and its ranks train on, orphaned, without saving; after a SIGTERM it exits 1 even when every
rank saved on the notice. This wrapper runs torchrun (``torch.distributed.run``, in this
process, same options) with:

- ``--signals-to-handle`` = torchrun's four + the watched signals (``$TIERCKPT_PREEMPTION_SIGNALS``,
  comma-separated, default ``SIGTERM,SIGUSR1``), so a notice to torchrun is forwarded to every
  rank's process group (the ranks' DataLoader workers ignore it, :mod:`tierckpt.loader_signals`)
  instead of killing torchrun;
- ``--shutdown-timeout`` = ``$TIERCKPT_SHUTDOWN_TIMEOUT`` (default 90 s) unless given: how long
  torchrun waits for its ranks after forwarding a notice before it SIGKILLs them; it must exceed
  ``preemption_grace_s`` (25 s by default) plus one training step. The value torchrun ends up
  with (this option, a ``--shutdown-timeout`` of ``argv``, or torchrun's environment) is exported
  to the ranks as ``$TIERCKPT_SHUTDOWN_TIMEOUT``: the engine's start-up check
  (:func:`tierckpt.preemption.warn_if_shutdown_too_short`) compares it with ``preemption_grace_s``;
- ``$TIERCKPT_PREEMPTED_DIR`` = a fresh directory where each rank that finished its preemption
  save leaves a mark (:func:`tierckpt.preemption.mark_preempted`).

Exit status: torchrun's (0; 1 when a rank failed, its failure summary printed), except
**75** (:data:`~tierckpt.preemption.PREEMPTED_EXIT`, "requeue me") when every rank of this
node saved on a preemption notice — whether the notice came to torchrun (forwarded) or to the
ranks directly — and 128 + N when signal N stopped torchrun without that.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

from tierckpt.preemption import (DEFAULT_SHUTDOWN_S, DEFAULT_SIGNALS, PREEMPTED_DIR_ENV, PREEMPTED_EXIT, SHUTDOWN_ENV,
                                 all_local_ranks_preempted, signal_numbers, torchrun_shutdown_timeout)

SIGNALS_ENV = "TIERCKPT_PREEMPTION_SIGNALS"
TORCHRUN_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")  # torchrun's own default


def _has_option(argv: list[str], *names: str) -> bool:
    return any(a == n or a.startswith(n + "=") for a in argv for n in names)


def torchrun_args(argv: list[str], env: dict[str, str] | None = None) -> list[str]:
    """torchrun's arguments for this wrapper's ``argv``: the signal list and shutdown timeout
    put first unless ``argv`` sets them.

    Raises:
        ValueError: ``$TIERCKPT_PREEMPTION_SIGNALS`` names a signal that cannot be caught, or
            ``$TIERCKPT_SHUTDOWN_TIMEOUT`` is not a whole number of seconds > 0.
    """
    env = dict(os.environ if env is None else env)
    names = [s.strip() for s in env.get(SIGNALS_ENV, ",".join(DEFAULT_SIGNALS)).split(",") if s.strip()]
    try:
        nums = signal_numbers(names, SIGNALS_ENV)
    except Exception as e:
        raise ValueError(str(e)) from None
    import signal as _signal

    watched = [_signal.Signals(n).name for n in nums]
    out = []
    if not _has_option(argv, "--signals-to-handle", "--signals_to_handle"):
        out += ["--signals-to-handle", ",".join(dict.fromkeys([*TORCHRUN_SIGNALS, *watched]))]
    if not _has_option(argv, "--shutdown-timeout", "--shutdown_timeout") and not env.get(
            "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"):
        raw = env.get(SHUTDOWN_ENV, str(DEFAULT_SHUTDOWN_S)).strip()
        if not raw.isdigit() or int(raw) <= 0:
            raise ValueError(f"{SHUTDOWN_ENV}={raw!r}: must be whole seconds > 0 (more than preemption_grace_s "
                             "plus one training step)")
        out += ["--shutdown-timeout", raw]
    return out + list(argv)


def main(argv: list[str] | None = None) -> int:
    """Run torchrun with ``argv`` (see the module doc); returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = torchrun_args(argv)
    except ValueError as e:
        print(f"tierckpt.launch: error: {e}", file=sys.stderr)
        return 2
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    marks = tempfile.mkdtemp(prefix="tierckpt-preempted-")
    os.environ[PREEMPTED_DIR_ENV] = marks  # the ranks inherit it
    # what torchrun will wait before SIGKILLing the ranks, for their start-up check
    os.environ[SHUTDOWN_ENV] = str(torchrun_shutdown_timeout(args)[0])
    rc = 0
    why = ""
    try:
        torchrun_main(args)
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except SignalException as e:
        rc, why = 128 + int(e.sigval), f"torchrun stopped by {e.sigval.name}"
    except ChildFailedError as e:
        rc, why = 1, e.format_msg()
    try:
        if rc != 0 and all_local_ranks_preempted(marks):
            print(f"tierckpt.launch: every rank of this node saved on a preemption notice "
                  f"({why.splitlines()[0] if why else f'status {rc}'}): exiting with status {PREEMPTED_EXIT} "
                  "to be requeued", file=sys.stderr, flush=True)
            return PREEMPTED_EXIT
        if why:
            print(f"tierckpt.launch: {why}", file=sys.stderr, flush=True)
        return rc
    finally:
        shutil.rmtree(marks, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
