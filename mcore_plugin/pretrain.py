"""Run an unmodified Megatron-LM training script with the tierckpt plugin installed.

Usage (one process per rank, like the script itself; e.g. under torchrun or srun)::

    python -m mcore_plugin.pretrain <Megatron-LM>/pretrain_gpt.py <megatron args> \\
        --ckpt-plugin-enable --ckpt-plugin-local-root /local_nvme/{job}/node-{node} ...
    python -m mcore_plugin.pretrain <Megatron-LM>/pretrain_gpt.py @configs/mcore_gpt_nvme.args

``@FILE`` arguments are replaced by the file's arguments (:func:`mcore_plugin.args.read_args_file`).

What it does, in order:

1. puts the script's directory first on ``sys.path`` and sets ``sys.argv`` to
   ``[script, *args]``, exactly as ``python pretrain_gpt.py ...`` would (so the checkout's
   ``megatron`` package, ``gpt_builders`` and ``model_provider`` are the ones imported);
2. without an accelerator, applies the CPU shims of the repository's development package
   (:func:`tierckpt_dev.mcore.cpu.apply` and :func:`tierckpt_dev.mcore.cpu_lm.apply` for
   Megatron-LM's training loop; not in the wheel); with one, it imports nothing of them;
3. installs the version-aware hooks (:func:`mcore_plugin.install.install`): the
   ``--ckpt-plugin-*`` flags join Megatron's parser, their validation runs after Megatron's,
   and with ``--ckpt-plugin-enable`` the checkpoint paths are served by the tiers;
4. runs the script with :func:`runpy.run_path` as ``__main__``.

Exit status: the script's; 2 for a bad command line or an invalid plugin flag (the message
names the flag), before any process group is created where possible, and without an
accelerator when ``tierckpt_dev`` cannot be imported.
"""

from __future__ import annotations

import os
import runpy
import sys
from typing import NoReturn

from tierckpt import ConfigError
from tierckpt.integration import accelerator_present, install_process_group_hook

USAGE = "usage: python -m mcore_plugin.pretrain <Megatron-LM script.py> [megatron args | @ARGS_FILE] [--ckpt-plugin-* ...]"


def _die(msg: str) -> NoReturn:
    print(f"mcore_plugin.pretrain: error: {msg}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def prepare(argv: list[str]) -> str:
    """Check the command line, set ``sys.argv``/``sys.path`` like ``python script.py`` would.

    Returns:
        the absolute path of the script.
    Raises:
        SystemExit(2): no script, not a ``.py`` file, or not found.
    """
    if not argv or argv[0] in ("-h", "--help") and len(argv) == 1:
        _die(USAGE)
    script = argv[0]
    if script.startswith("-"):
        _die(f"the first argument must be the Megatron-LM script (e.g. pretrain_gpt.py), got {script!r}\n{USAGE}")
    if not script.endswith(".py") or not os.path.isfile(script):
        _die(f"{script!r} is not a Python file\n{USAGE}")
    script = os.path.abspath(script)
    from mcore_plugin.args import expand_args_files

    try:
        rest = expand_args_files(argv[1:])
    except (ConfigError, ValueError) as e:
        _die(str(e))
    sys.argv = [script, *rest]
    # `python script.py` has the script's directory as sys.path[0]; `python -m` put the cwd
    # there instead (the checkout's `megatron` must win over the megatron-core wheel's).
    if sys.path and sys.path[0] in ("", os.getcwd()):
        sys.path[0] = os.path.dirname(script)
    else:
        sys.path.insert(0, os.path.dirname(script))
    return script


def apply_cpu_shims() -> list[str]:
    """Without an accelerator, apply the megatron-core and Megatron-LM CPU shims
    (:mod:`tierckpt_dev.mcore`, from a repository checkout); with one, import nothing.

    Returns:
        names of the shims applied in this process ([] with an accelerator).
    Raises:
        SystemExit(2): no accelerator and ``tierckpt_dev`` cannot be imported (the message says
            how to make it importable).
    """
    if accelerator_present():
        return []
    try:
        from tierckpt_dev.mcore import cpu, cpu_lm
    except ModuleNotFoundError as e:
        if not e.name or e.name.split(".")[0] != "tierckpt_dev":
            raise  # tierckpt_dev is there; one of its own imports is missing
        _die("no accelerator: Megatron runs on the CPU only with the shims of the development package "
             "tierckpt_dev (tierckpt_dev.mcore), which the tierckpt wheel does not ship; run from a "
             "repository checkout with its root on PYTHONPATH (launch/tierckpt_slurm.sh sets it)")
    return cpu.apply() + cpu_lm.apply()


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``python -m mcore_plugin.pretrain`` (see the module docstring)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    script = prepare(argv)

    apply_cpu_shims()
    install_process_group_hook()  # the recovery timeline's process_group_up (tierckpt.recovery.timeline)
    from mcore_plugin import install

    try:
        install.install()
    except install.UnsupportedMegatronVersion as e:
        _die(str(e))
    try:
        runpy.run_path(script, run_name="__main__")
    except ConfigError as e:
        # Raised by the plugin's validation inside Megatron's initialize (every rank).
        _die(str(e))


if __name__ == "__main__":
    main()
