"""``python -m tierckpt.recovery.child (-m MODULE | SCRIPT) [args …]``: a cold rank started
by a node agent (:mod:`tierckpt.recovery.agent`) when it cannot fork warm ones: starts the
rank's beacon (:mod:`tierckpt.recovery.beacon`), then runs the training command as
``__main__``, as ``python <command>`` would."""

from __future__ import annotations

import sys

from tierckpt.recovery import beacon
from tierckpt.recovery.warm import run_argv


def main(argv: list[str] | None = None) -> int:
    """Run the rank; returns its exit status (2 without a command)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv == ["-m"]:
        print("usage: python -m tierckpt.recovery.child (-m MODULE | SCRIPT) [args ...]", file=sys.stderr)
        return 2
    beacon.start_from_env()
    return run_argv(argv)


if __name__ == "__main__":
    sys.exit(main())
