"""The systems a goodput campaign compares, as the commands the launcher runs.

Every system trains the same torchtitan demo (``configs/titan_demo.toml``'s job: llama3 debug
model, FSDP2 over gloo, 1 CPU rank per simulated node, the same seed and data) under
``launch/local.py``'s :class:`LocalLauncher` with warm node agents that preload the same modules
(torch, DCP, torchtitan, the plugin, the demo's config), so restarts cost every system alike.

Names (``--systems``, comma-separated):

- ``tierckpt-adaptive``: tierckpt with its default settings and both tiers adaptive
  (``--checkpoint.adaptive local,persistent``; the TOML's intervals, local 5 and persistent
  15 steps, are only the starting values; the MTBF and restart priors are the plugin's
  defaults: what a new user gets);
- ``tierckpt-adaptive-priorF``: the same with the MTBF prior an operator of the compressed
  cluster would give, F × the injected MTBF (``--checkpoint.gpu_mtbf_hours`` = F × MTBF × ranks,
  weight 1, learned from the failures; bench_schedule's ``--prior-factor``). The default prior
  is Llama 3's failure rate (a 2-rank job: M0 ≈ 1.4 years), which no 60 s MTBF outweighs within
  a run: at a compressed MTBF the default settings alone measure that prior, not the scheduler;
- ``tierckpt-fixed-K``: tierckpt, local tier + replica every K steps, persistent tier at the
  TOML's 15 steps (the sweep over K: the best of them is the bar adaptive must meet);
- ``titan-stock-K``: torchtitan's stock ``CheckpointManager`` (DCP ``async_mode="async"`` to
  the shared folder ``<dump>/checkpoint``) every K steps (``bench.goodput.titan_stock``);
- ``torchft``: torchtitan's ``experiments/torchft`` with 2 replica groups — not run by this
  harness (:func:`torchft_status` says why; the row is kept).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from bench import bench_schedule as bs

TOML = bs.TOML
KINDS = ("tierckpt-adaptive", "tierckpt-adaptive-priorF", "tierckpt-fixed-K", "titan-stock-K", "torchft")
DEFAULT_SYSTEMS = ("tierckpt-adaptive", "tierckpt-adaptive-prior4", "tierckpt-fixed-5", "tierckpt-fixed-10", "tierckpt-fixed-20",
                   "titan-stock-10", "titan-stock-20", "titan-stock-40", "torchft")
QUICK_SYSTEMS = ("tierckpt-adaptive", "tierckpt-adaptive-prior4", "tierckpt-fixed-10", "titan-stock-20", "torchft")
STOCK_PRELOAD = ["torch", "torch.distributed.checkpoint", "tierckpt.engine", "torchtitan.train",
                 "titan_plugin.manager", "titan_plugin.toml", "tierckpt_dev.titan", "tierckpt_dev.titan.cpu"]


@dataclass(frozen=True)
class System:
    """One system of the campaign: ``name`` as on the command line, ``kind`` (tierckpt,
    stock, torchft), ``interval`` (steps; None for adaptive and torchft), ``prior_factor``
    (adaptive with an MTBF prior of that many injected MTBFs; None: the plugin's default)."""

    name: str
    kind: str
    interval: int | None = None
    prior_factor: float | None = None

    @property
    def runnable(self) -> bool:
        return self.kind != "torchft"


def parse_system(name: str) -> System:
    """The :class:`System` of ``name``.

    Raises:
        ValueError: not one of ``KINDS`` (K a whole number of steps ≥ 1); the message lists them.
    """
    if name == "tierckpt-adaptive":
        return System(name, "tierckpt")
    if name == "torchft":
        return System(name, "torchft")
    m = re.fullmatch(r"tierckpt-adaptive-prior(\d+(?:\.\d+)?)", name)
    if m and float(m.group(1)) > 0:
        return System(name, "tierckpt", prior_factor=float(m.group(1)))
    m = re.fullmatch(r"(tierckpt-fixed|titan-stock)-(\d+)", name)
    if m and int(m.group(2)) >= 1:
        return System(name, "tierckpt" if m.group(1) == "tierckpt-fixed" else "stock", int(m.group(2)))
    raise ValueError(f"--systems: unknown system {name!r}; allowed: {', '.join(KINDS)} (K: steps >= 1, F > 0)")


def parse_systems(spec: str) -> list[System]:
    """``--systems`` (comma-separated names) as systems, in order, without duplicates.

    Raises:
        ValueError: an unknown name, or none at all.
    """
    out: list[System] = []
    for n in (s.strip() for s in spec.split(",")):
        if n and n not in [s.name for s in out]:
            out.append(parse_system(n))
    if not out:
        raise ValueError(f"--systems: name at least one system; allowed: {', '.join(KINDS)}")
    return out


def local_root(nvme: str, job: str) -> str:
    """The node disks of a tierckpt run (``{node}`` template; what a failure wipes)."""
    return os.path.join(nvme, job, "node-{node}")


def command(system: System, *, dump: str, nvme: str, job: str, steps: int, mtbf_s: float = 60.0,
            ranks: int = 2) -> list[str]:
    """What the launcher runs on every node for ``system`` (after torchrun's options);
    ``mtbf_s`` (injected) and ``ranks`` size an adaptive system's prior.

    Raises:
        ValueError: ``system`` cannot run here (torchft).
    """
    if system.kind == "tierckpt":
        ov = bs.common_overrides(dump, steps, job, nvme)
        if system.interval is None:
            ov += ["--checkpoint.adaptive", "local,persistent"]
            if system.prior_factor is not None:  # the prior is per GPU (rank): the job's is that / ranks
                ov += ["--checkpoint.gpu_mtbf_hours", repr(system.prior_factor * mtbf_s * ranks / 3600.0)]
        else:
            ov += ["--checkpoint.local_interval", str(system.interval)]
        return ["-m", "titan_plugin.train", "--toml", TOML, *ov]
    if system.kind == "stock":
        return ["-m", "torchtitan.train", "--module", "bench.goodput.titan_stock", "--config", "titan_demo_stock",
                "--dump_folder", dump, "--training.steps", str(steps),
                "--checkpoint.interval", str(system.interval), "--checkpoint.async_mode", "async"]
    raise ValueError(f"{system.name}: not run by this harness ({torchft_status()})")


def reference_command(dump: str, steps: int) -> list[str]:
    """The failure-free, checkpoint-free run of the demo that measures ``t_ref``."""
    return ["-m", "titan_plugin.train", "--toml", TOML, "--dump_folder", dump, "--training.steps", str(steps),
            "--checkpoint.enable", "false"]


TORCHFT_VENV = ".venv-torchft"


def torchft_status(repo: str = bs.REPO) -> str:
    """Why the torchft row has no numbers, for the report (one sentence; facts checked here:
    the side virtualenv of ``scripts/setup_venv_torchft.sh`` and its torchft version)."""
    py = os.path.join(repo, TORCHFT_VENV, "bin", "python")
    stamp = os.path.join(repo, TORCHFT_VENV, ".installed-stamp")
    have = ""
    if os.path.exists(stamp):
        with open(stamp) as f:
            have = f.read().strip()
    where = (f"torchft {have} installs from the package index into {TORCHFT_VENV} (a CPU wheel; process "
             "groups on gloo)" if have else
             f"torchft 0.2.0 is on the package index (scripts/setup_venv_torchft.sh installs it into "
             f"{TORCHFT_VENV}; not installed here{'' if os.path.exists(py) else ', no side venv'})")
    return (f"not run: {where}, but torchtitan's experiments/torchft trainer needs a torchft lighthouse "
            "and one launcher per replica group (2 groups × 1 node here), which this harness does not "
            "start yet; no torchft number is claimed")
