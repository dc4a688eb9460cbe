"""Fault campaign (issues 15, 28): hundreds of seeded random faults against the tiered checkpoint engine.

Every trial runs the engine (:class:`tierckpt.engine.TieredCheckpointer`) on 2-4 simulated gloo
nodes (one rank per node, each rank its own process; two ranks per node in some
``per-rank-values`` trials) with the small FSDP2 model of
``tests/scenarios.py``, injects one or two faults at an instant drawn from the trial's seed,
restarts the job with fresh processes, restores, and checks invariants computed from the files
on disk, independently of the restore planner (see :mod:`bench.campaign_checks`).

Trial ``i`` of a campaign with base seed ``S`` uses seed ``S + i`` and fault point
``POINTS[i % len(POINTS)]`` (round robin, so 300 trials give each of the 28 points at least 10 trials);
everything else (node count, victim, step, byte offset, sub-instant, second fault) comes from
``random.Random(S + i)``. Faults are injected by monkeypatching engine functions inside the
rank processes (:class:`Injector`); the k-th call of a wrapped function, or a byte offset in
a step's data files, is the instant, so a trial replays exactly from its seed and index:
``bench/fault_campaign.py --seed S --one i``.

Usage::

    OMP_NUM_THREADS=1 .venv/bin/python bench/fault_campaign.py --trials 20 [--seed 0] [--record]
    make fault-campaign FAULT_TRIALS=20 FAULT_SEED=0 FAULT_ARGS="--record"

Exit status 1 when any invariant was violated (or a fault point was never reached in a run
that should reach it), 0 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import faulthandler
import json
import multiprocessing as mp
import os
import random
import re
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # the script runs from bench/: tests/ and bench/ import from the root
    sys.path.insert(0, str(REPO))

from bench import campaign_checks as checks  # noqa: E402
from bench import campaign_exit  # noqa: E402

# --------------------------------------------------------------------------------------------
# the fault points
# --------------------------------------------------------------------------------------------
POINTS: dict[str, str] = {
    "kill-staging": "SIGKILL of one/all ranks while save() stages the state (before/after the copy)",
    "kill-local-write": "SIGKILL of one/all ranks at a byte offset of the local DCP write",
    "kill-checksum": "SIGKILL of one/all ranks in the checksum phase (local or persistent)",
    "kill-commit": "SIGKILL of one/all ranks committing a local step (before/after manifest, after marker)",
    "kill-repl-send": "SIGKILL of one/all ranks sending a replica (start, mid-stream, end)",
    "kill-repl-recv": "SIGKILL of one/all ranks receiving a replica (start, mid-stream, end, commit)",
    "kill-retention": "SIGKILL of one/all ranks in retention's purge (before/after uncommit, mid-rmtree)",
    "kill-persistent-write": "SIGKILL of one/all ranks at a byte offset of the persistent DCP write",
    "kill-persistent-commit": "SIGKILL while the persistent step is committed (before/after manifest, after marker)",
    "kill-restore": "SIGKILL of one/all ranks inside restore(), then a second restart and restore",
    "second-loss-after-restore": "node v lost, restore, then another node lost before any save, restore",
    "second-loss-of-server": "node v lost, restore, then the node that served v's replica lost, restore",
    "remap-swapped-roots": "two nodes' local roots swapped across the restart (re-imaged/remapped hosts)",
    "enospc-local": "ENOSPC on one node's local root from a byte offset of a local save on",
    "enospc-persistent": "ENOSPC on the persistent root's step data from a byte offset of a persistent save on",
    "enospc-ledger": "ENOSPC on the ledger from its k-th append on",
    "readonly-persistent": "the persistent root turns read-only (EROFS) at the k-th save (and stays so at restart half the time)",
    "hung-local-disk": "one node's local write hangs for good at a byte offset (sometimes with a restore() in the run)",
    "torn-ledger-line": "rank 0 dies with half of its k-th ledger line written",
    "slow-persistent": "every persistent file open takes 0.2-0.8 s (sometimes plus a SIGKILL in a persistent write)",
    "dying-writer-thread": "the background writer thread of a tier dies before running its k-th job",
    "hung-read-restore": "a read of a restore's source hangs for good (a node's own copy, or the replica a peer sends it)",
    "exit-without-close": "the trainer returns / raises / sys.exit(0)s right after a save, without close() "
                          "(bench/campaign_exit.py)",
    "per-rank-values": "per-rank values under one key (probe, RNG state, counter, object) saved and restored "
                       "around a random kill fault, 1 or 2 ranks per node, restored as the fault leaves it, from "
                       "the persistent tier (every local root wiped) or in-cluster: every rank gets its own values "
                       "(restored state and files)",
    "signal-tree-loader-workers": "a preemption signal (SIGTERM/SIGUSR1, sometimes twice) to every process of the "
                                  "job, DataLoader workers (2 per rank, protected or not) included, mid-step",
    # issue 28: never resume the wrong state (new timelines over old step numbers)
    "corrupt-newest-then-save": "newest step corrupt (some/all copies, unservable for a node); the restart falls back, "
                                "saves a new timeline with retention; some/all node roots lost; restore",
    "failed-replication-after-fallback": "one node's newest step corrupt everywhere; the restart falls back and "
                                         "saves that step number local-only while replication fails; a node lost; restore",
    "rollback-skewed-clock": "one rank's wall clock off by 1 h while saving; an explicit rollback commits a new "
                             "step, the run dies; restore",
}
POINT_NAMES = list(POINTS)

STEPS = 5                   # training steps of the faulty run; a local save at every step
BYTE_RANGE = 12000          # a rank writes ~5-10 KiB per step: offsets cover the whole write and beyond
LOCAL_WAIT_S = 2.0          # local_wait_timeout_s of the campaign's engine
COLLECTIVE_S = 30.0         # collective_timeout_s of the campaign's engine
PHASE_BOUND_S = 90.0        # a phase running longer is a hang (faulthandler dumps every thread first)
RESTORE_BOUND_S = LOCAL_WAIT_S + 30.0  # a restore() during a hung local write must return within this
HUNG_READ_S = 3.0           # restore_read_timeout_s of the hung-read-restore point's engine
HUNG_SLACK_S = 30.0         # its restart and restore: the timed-out reads + this


# --------------------------------------------------------------------------------------------
# plans
# --------------------------------------------------------------------------------------------
@dataclass
class Plan:
    """Everything a trial does, drawn from its seed (JSON-serialisable, handed to the ranks).

    Attributes:
        seed, index: the trial's seed and index in the campaign; ``point`` its fault point.
        nodes, factor: simulated nodes (one rank each) and replication factor F (J = 1).
        persistent_steps: steps that also save the persistent tier.
        keep_local, keep_persistent: keep_latest_k of the tiers.
        fault: the primary fault (``point`` specific keys: victim, step, k, sub, byte, tier, ...).
        second: an optional second fault (``{"kind": "lose-node", "node": n}`` or a kill spec).
        script: the phases, in order: ``"train"``, ``"restore"`` (``"restore:in-cluster"``: the
            restore may read in-cluster only), and disk actions between them (``wipe:<n>``,
            ``wipe-all``, ``wipe-server-of:<n>``, ``wipe-other-than:<n>``, ``swap:<a>:<b>``).
        rpn: ranks per node (each its own process; 1 but in some ``per-rank-values`` trials).
        restore_from: what a ``per-rank-values`` trial's last restore reads: ``"any"`` (what the
            fault left), ``"persistent"`` (every local root wiped first) or ``"in-cluster"``.
    """

    seed: int
    index: int
    point: str
    nodes: int
    factor: int
    persistent_steps: list[int]
    keep_local: int
    keep_persistent: int
    fault: dict
    second: dict | None = None
    script: list[str] = field(default_factory=list)
    rpn: int = 1
    restore_from: str = "any"

    @property
    def world(self) -> int:
        """Ranks (processes) of the job."""
        return self.nodes * self.rpn

    def describe(self) -> str:
        """One line: the faults and their instant, for the report."""
        f = {k: v for k, v in self.fault.items() if k != "kind"}
        text = f"{self.fault['kind']}({', '.join(f'{k}={v}' for k, v in f.items())})"
        if self.second:
            s = {k: v for k, v in self.second.items() if k != "kind"}
            text += f" + {self.second['kind']}({', '.join(f'{k}={v}' for k, v in s.items())})"
        if self.point == "per-rank-values":
            text += f"; {self.rpn} rank(s)/node, restore from {self.restore_from}"
        return text


def _plan_hung_read(plan: Plan, rng: random.Random) -> None:
    """hung-read-restore: node v's own copies hang when read (``target = "own"``), or v's disk
    is lost and every replica of v hangs when its holder sends it (``"replica"``)."""
    v = rng.randrange(plan.nodes)
    target = rng.choice(["own", "replica"])
    plan.fault.update(node=v, target=target)
    plan.script = ["train"] + ([f"wipe:{v}"] if target == "replica" else []) + ["restore:hung"]


def _victim(rng: random.Random, nodes: int, p_all: float = 0.25) -> str:
    """``"all"`` (the whole job dies at once) or ``"r<k>"``."""
    return "all" if rng.random() < p_all else f"r{rng.randrange(nodes)}"


def make_plan(base_seed: int, index: int, point: str | None = None, nodes: int | None = None) -> Plan:
    """The plan of trial ``index``: point round robin (or ``point``), the rest from
    ``Random(base_seed + index)`` (``nodes``: this node count instead of the drawn one)."""
    seed = base_seed + index
    point = point or POINT_NAMES[index % len(POINT_NAMES)]
    if point == "per-rank-values":
        return _per_rank_plan(base_seed, index)
    rng = random.Random(seed)
    drawn = rng.choice([2, 2, 2, 3, 4])
    nodes = nodes or drawn
    factor = {2: 2, 3: 3, 4: 2}[nodes]
    pers = sorted(rng.sample(range(1, STEPS + 1), 2))
    plan = Plan(seed=seed, index=index, point=point, nodes=nodes, factor=factor, persistent_steps=pers,
                keep_local=rng.choice([1, 2, 2]), keep_persistent=2, fault={"kind": point},
                script=["train", "restore"])
    f = plan.fault
    kill_points = {"kill-staging", "kill-local-write", "kill-checksum", "kill-commit", "kill-repl-send",
                   "kill-repl-recv", "kill-retention", "kill-persistent-write", "kill-persistent-commit"}
    if point in kill_points:
        f["victim"] = _victim(rng, nodes)
    if point == "kill-staging":
        f.update(step=rng.randint(1, STEPS), sub=rng.choice(["before", "after"]))
    elif point == "kill-local-write":
        f.update(step=rng.randint(1, STEPS), byte=rng.randrange(BYTE_RANGE))
    elif point == "kill-checksum":
        tier = rng.choice(["local", "persistent"])
        f.update(tier=tier, step=rng.randint(1, STEPS) if tier == "local" else rng.choice(pers),
                 sub=rng.choice(["before", "after"]))
    elif point == "kill-commit":
        f.update(step=rng.randint(1, STEPS), sub=rng.choice(["before-manifest", "after-manifest", "after-marker"]))
    elif point == "kill-repl-send":
        f.update(step=rng.randint(1, STEPS), sub=rng.choice(["start", "mid", "end"]), j=rng.randint(1, 3))
    elif point == "kill-repl-recv":
        f.update(step=rng.randint(1, STEPS), sub=rng.choice(["start", "mid", "end", "commit"]), j=rng.randint(1, 3))
    elif point == "kill-retention":
        f.update(k=rng.randint(1, 3), sub=rng.choice(["before", "after-uncommit", "mid-rmtree"]))
    elif point == "kill-persistent-write":
        f.update(step=rng.choice(pers), byte=rng.randrange(BYTE_RANGE))
    elif point == "kill-persistent-commit":
        f.update(victim="all" if rng.random() < 0.25 else "any", step=rng.choice(pers),
                 sub=rng.choice(["before-manifest", "after-manifest", "after-marker"]))
    elif point == "kill-restore":
        sub = rng.choice(["inventory", "send", "recv", "pull-commit", "verify", "load"])
        lose = sub in ("send", "recv", "pull-commit") or rng.random() < 0.5
        f.update(victim="all" if rng.random() < 0.25 else "any", sub=sub, k=1)
        lost = rng.randrange(nodes) if lose else None
        if lose:
            plan.second = {"kind": "lose-node", "node": lost}
        plan.script = ["train"] + ([f"wipe:{lost}"] if lose else []) + ["restore:fault", "restore"]
    elif point in ("second-loss-after-restore", "second-loss-of-server"):
        if rng.random() < 0.5:
            plan.persistent_steps = []  # only the node-local tier holds the state (issue 15's case)
        v = rng.randrange(nodes)
        f.update(node=v)
        second = f"wipe-server-of:{v}" if point == "second-loss-of-server" else f"wipe-other-than:{v}"
        plan.script = ["train", f"wipe:{v}", "restore", second, "restore"]
    elif point == "remap-swapped-roots":
        if rng.random() < 0.5:
            plan.persistent_steps = []
        a, b = rng.sample(range(nodes), 2)
        f.update(a=a, b=b)
        plan.script = ["train", f"swap:{a}:{b}", "restore"]
    elif point == "enospc-local":
        f.update(node=rng.randrange(nodes), step=rng.randint(1, STEPS), byte=rng.randrange(BYTE_RANGE))
    elif point == "enospc-persistent":
        f.update(step=rng.choice(pers), byte=rng.randrange(BYTE_RANGE))
    elif point == "enospc-ledger":
        f.update(k=rng.randint(2, 9))
    elif point == "readonly-persistent":
        f.update(step=rng.randint(1, STEPS), at_restart=rng.random() < 0.5)
    elif point == "hung-local-disk":
        f.update(node=rng.randrange(nodes), step=rng.randint(1, STEPS - 1), byte=rng.randrange(BYTE_RANGE),
                 restore_in_run=rng.random() < 0.4)
    elif point == "torn-ledger-line":
        f.update(k=rng.randint(2, 10))
    elif point == "slow-persistent":
        f.update(delay=round(rng.uniform(0.2, 0.8), 2))
        if rng.random() < 0.4:
            plan.second = {"kind": "kill-persistent-write", "victim": f"r{rng.randrange(nodes)}",
                           "step": rng.choice(pers), "byte": rng.randrange(BYTE_RANGE)}
    elif point == "hung-read-restore":
        _plan_hung_read(plan, rng)
    elif point == "signal-tree-loader-workers":
        f.update(step=rng.randint(1, STEPS - 1), signal=rng.choice(["SIGTERM", "SIGUSR1"]),
                 protect=rng.random() < 0.75, repeat=rng.random() < 0.3)
    elif point == "dying-writer-thread":
        tier = rng.choice(["local", "persistent"])
        f.update(tier=tier, victim=f"r{rng.randrange(nodes)}", k=rng.randint(1, STEPS if tier == "local" else 2))
    elif point == "exit-without-close":
        campaign_exit.plan_exit(plan, rng, STEPS)
    elif point in TIMELINE_POINTS:
        _timeline_plan(plan, rng)
    # a killed node's disk is sometimes lost too: the restart pulls its state from a replica
    if point in kill_points and rng.random() < 0.3:
        v = f["victim"]
        n = int(v[1:]) if v.startswith("r") else rng.randrange(nodes)
        plan.second = {"kind": "lose-node", "node": n}
        plan.script = ["train", f"wipe:{n}", "restore"]
    return plan


PER_RANK_FAULTS = ("kill-local-write", "kill-commit", "kill-repl-send", "kill-persistent-write", "kill-restore")
"""The faults a ``per-rank-values`` trial draws from (each with its own instant and, for some,
a lost node), around a state that also holds per-rank values under shared keys."""

PER_RANK_SOURCES = ("any", "persistent", "in-cluster")
"""What a ``per-rank-values`` trial's last restore reads (:attr:`Plan.restore_from`)."""


def _per_rank_plan(base_seed: int, index: int) -> Plan:
    """A ``per-rank-values`` trial: the plan of a fault drawn from :data:`PER_RANK_FAULTS`, with
    1 or 2 ranks per node (2 nodes then) and a last restore from what the fault left, from the
    persistent tier only (every node-local root wiped before it) or in-cluster only; the rank
    functions add :func:`bench.campaign_checks.per_rank_values` to the state."""
    rng = random.Random((base_seed + index) * 31 + 7)
    inner = rng.choice(PER_RANK_FAULTS)
    rpn = rng.choice([1, 2])
    source = rng.choice(PER_RANK_SOURCES)
    plan = make_plan(base_seed, index, point=inner, nodes=2 if rpn == 2 else None)
    plan.point, plan.rpn, plan.restore_from = "per-rank-values", rpn, source
    if rpn == 2:  # a victim "r<k>" names a rank: one of node k's (its leader where only leaders act)
        leader = inner in ("kill-commit", "kill-repl-send")  # node leaders commit and send replicas
        for f in (plan.fault, plan.second):
            if f and str(f.get("victim", "")).startswith("r"):
                f["victim"] = f"r{int(f['victim'][1:]) * rpn + (0 if leader else rng.randrange(rpn))}"
    last = len(plan.script) - 1 - plan.script[::-1].index("restore")
    if source == "persistent":
        plan.script.insert(last, "wipe-all")
        plan.persistent_steps = sorted(set(plan.persistent_steps) | {1})  # a step there before most faults
    elif source == "in-cluster":
        plan.script[last] = "restore:in-cluster"
    return plan


def _app_state(plan: dict, model, opt, rank: int, step: int | None) -> dict:
    """The state a rank saves (``step``) or restores into (None): the scenario's, plus, in a
    ``per-rank-values`` trial, this rank's values of step ``step`` under the shared key
    ``per_rank`` (a template of other values when restoring)."""
    from tests import scenarios

    sd = scenarios.app_state(model, opt)
    if plan["point"] == "per-rank-values":
        sd["per_rank"] = checks.per_rank_values(rank, step) if step is not None else checks.per_rank_template()
    return sd


def _per_rank_mismatch(plan: dict, sd: dict, rank: int, step: int) -> str | None:
    """The first difference between the restored ``per_rank`` values and rank ``rank``'s own of
    ``step`` (None: equal, or not a ``per-rank-values`` trial)."""
    from tests import scenarios

    if plan["point"] != "per-rank-values":
        return None
    try:
        scenarios.assert_bitwise(sd["per_rank"], checks.per_rank_values(rank, step), "per_rank")
    except AssertionError as e:
        return f"not this rank's own values: {e}"
    return None


# --------------------------------------------------------------------------------------------
# fault injection inside a rank process
# --------------------------------------------------------------------------------------------
_STEP_RE = re.compile(r"(?:^|/)step-(\d+)(?:/|$)")


def _step_of(path: str) -> int | None:
    m = _STEP_RE.search(path)
    return int(m.group(1)) if m else None


class Injector:
    """Installs the monkeypatches of one phase of a plan in a rank process and fires the fault
    at its instant.

    A fault's state that outlives one call (a full or read-only file system) is a flag file
    under ``<base>/state``, so every rank process sees it at once and the driver can clear it
    between phases. Every firing is recorded under ``<base>/fired`` (JSON: what, where, when),
    which is how the driver knows the instant was reached.
    """

    def __init__(self, plan: dict, phase: str, rank: int, base: str):
        self.plan, self.phase, self.rank, self.base = plan, phase, rank, base
        self.node = rank // plan.get("rpn", 1)  # the simulated node of this rank
        self.counts: Counter = Counter()
        self.bytes: Counter = Counter()
        self.tls = threading.local()
        self.pfs = os.path.join(base, "pfs")
        self.faults = [f for f in (plan["fault"], plan.get("second")) if f and self._in_phase(f)]
        os.makedirs(os.path.join(base, "fired"), exist_ok=True)
        os.makedirs(os.path.join(base, "state"), exist_ok=True)

    def _in_phase(self, f: dict) -> bool:
        restore_fault = f["kind"] == "kill-restore"
        if self.phase == "restore:fault":
            return restore_fault
        if self.phase == "restore:hung":
            return f["kind"] == "hung-read-restore"
        if self.phase == "train":
            return not restore_fault and f["kind"] not in ("lose-node", "hung-read-restore")
        return False

    # -- helpers ---------------------------------------------------------------------------
    def root_of(self, node: int) -> str:
        return os.path.join(self.base, "nvme", f"node-{node}")

    def mine(self, f: dict) -> bool:
        """Whether this rank is a victim of ``f`` (``any``: every rank may fire, the first wins)."""
        v = f.get("victim", "any")
        return v in ("all", "any") or v == f"r{self.rank}"

    def record(self, f: dict, what: str, exclusive: bool = False) -> bool:
        """Write the firing record; with ``exclusive`` only the first rank of the job does
        (returns False on the others)."""
        name = f"{self.phase.replace(':', '-')}-{f['kind']}" + ("" if exclusive else f"-r{self.rank}")
        path = os.path.join(self.base, "fired", name + ".json")
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return not exclusive
        with os.fdopen(fd, "w") as fh:
            json.dump({"rank": self.rank, "phase": self.phase, "what": what, "time": time.time()}, fh)
        return True

    def kill(self, f: dict, what: str) -> None:
        """SIGKILL this rank (``victim: all``: every rank of the job), after recording the
        firing and the committed set just before it."""
        if not self.record(f, what, exclusive=f.get("victim") == "any"):
            return  # another rank already fired this "any" fault
        prefault = os.path.join(self.base, "fired", f"prefault-{self.phase.replace(':', '-')}.json")
        if not os.path.exists(prefault):
            try:
                disk = checks.scan_disk(self.base, verify=False)
                with open(prefault + f".{self.rank}", "w") as fh:
                    json.dump([asdict(c) for c in disk], fh)
                os.replace(prefault + f".{self.rank}", prefault)
            except OSError:
                pass
        if f.get("victim") == "all":
            try:
                with open(os.path.join(self.base, f"pids-{self.phase.replace(':', '-')}.json")) as fh:
                    pids = json.load(fh)
            except (OSError, ValueError):
                pids = []
            for pid in pids:
                if pid != os.getpid():
                    with contextlib.suppress(OSError):
                        os.kill(pid, signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)

    def flag(self, name: str) -> str:
        return os.path.join(self.base, "state", name)

    def set_flag(self, name: str) -> None:
        Path(self.flag(name)).touch()

    def storage_error(self, path: str, writing: bool = True) -> OSError | None:
        """The error a write to ``path`` hits now (a full or read-only file system), or None."""
        path = os.path.abspath(path)
        if not writing:
            return None
        if path.startswith(self.pfs + os.sep) or path == self.pfs:
            if os.path.exists(self.flag("pfs-ro")):
                return OSError(errno.EROFS, "Read-only file system (injected)", path)
            rel = path[len(self.pfs) + 1:]
            if rel.startswith("step-") and os.path.exists(self.flag("pfs-full")):
                return OSError(errno.ENOSPC, "No space left on device (injected)", path)
        for n in range(8):
            root = self.root_of(n)
            if (path.startswith(root + os.sep)) and os.path.exists(self.flag(f"node-{n}-full")):
                return OSError(errno.ENOSPC, "No space left on device (injected)", path)
        return None

    # -- installation ----------------------------------------------------------------------
    def install(self) -> None:
        """Patch every hook this phase's faults need (idempotent per process)."""
        kinds = {f["kind"] for f in self.faults}
        self._patch_storage()  # full / read-only flags may be set by any rank, any phase
        if kinds & {"kill-staging", "readonly-persistent"}:
            self._patch_stage()
        self._patch_streams()
        if kinds & {"kill-checksum"}:
            self._patch_checksum()
        self._patch_commit()
        if kinds & {"kill-repl-send", "kill-repl-recv", "kill-restore"}:
            self._patch_transfer()
        if kinds & {"kill-retention"}:
            self._patch_retention()
        if kinds & {"kill-restore"}:
            self._patch_restore()
        self._patch_ledger()  # a read-only persistent root refuses ledger appends too
        if kinds & {"dying-writer-thread"}:
            self._patch_worker()
        if kinds & {"hung-read-restore"}:
            self._patch_hung_read()
        if kinds & {"rollback-skewed-clock"}:
            _patch_clock(self)

    def faults_of(self, *kinds: str) -> list[dict]:
        return [f for f in self.faults if f["kind"] in kinds]

    def _patch_stage(self) -> None:
        """The k-th save's staging copy: the early one (a free slot, copied while the busy-tier
        agreement travels) or, when there was none, the blocking one — one count per save."""
        from tierckpt.staging.pool import StagingPool

        orig, orig_early = StagingPool.stage, StagingPool.stage_early
        inj = self

        def starting(k: int) -> list[dict]:
            for f in inj.faults_of("readonly-persistent"):
                if k == f["step"] and inj.record(f, f"save {k}: persistent root read-only", exclusive=True):
                    inj.set_flag("pfs-ro")
            fs = [f for f in inj.faults_of("kill-staging") if inj.mine(f) and f["step"] == k]
            for f in fs:
                if f["sub"] == "before":
                    inj.kill(f, f"staging of save {k}, before the copy")
            return fs

        def copied(k: int, fs: list[dict]) -> None:
            for f in fs:
                inj.kill(f, f"staging of save {k}, after the copy")

        def _early_stage(pool, state_dict):
            inj.counts["stage"] += 1
            k = inj.counts["stage"]
            fs = starting(k)
            out = orig_early(pool, state_dict)
            if out is None:  # no free slot: this save's blocking copy follows
                inj.tls.staging_k = k
                return out
            copied(k, fs)
            return out

        def _stage(pool, state_dict, users):
            k = getattr(inj.tls, "staging_k", None)
            inj.tls.staging_k = None
            if k is None:
                inj.counts["stage"] += 1
                k = inj.counts["stage"]
                fs = starting(k)
            else:
                fs = [f for f in inj.faults_of("kill-staging") if inj.mine(f) and f["step"] == k]
            out = orig(pool, state_dict, users)
            copied(k, fs)
            return out

        StagingPool.stage, StagingPool.stage_early = _stage, _early_stage

    def _patch_streams(self) -> None:
        """DCP data files: byte-offset kills, ENOSPC, a hung write, a slow open."""
        from tierckpt.io import dcp_io

        orig = dcp_io.HashingFileSystem.create_stream
        inj = self

        @contextlib.contextmanager
        def create_stream(fs, path, mode):
            writing = "w" in mode or "a" in mode
            path = str(path)
            if writing:
                inj.on_open(path)
            with orig(fs, path, mode) as s:
                yield _FaultStream(s, path, inj) if writing else s

        dcp_io.HashingFileSystem.create_stream = create_stream  # type: ignore[assignment]  # fs is self

    def on_open(self, path: str) -> None:
        """A DCP file opens for writing: a slow persistent tier waits here; a full or
        read-only file system refuses it."""
        ap = os.path.abspath(path)
        for f in self.faults_of("slow-persistent"):
            if ap.startswith(self.pfs + os.sep):
                self.counts["slow"] += 1
                if self.counts["slow"] == 1:
                    self.record(f, "first slow persistent open")
                time.sleep(f["delay"])
        err = self.storage_error(ap)
        if err is not None:
            raise err

    def byte_faults(self, path: str) -> list[tuple[dict, int]]:
        """(fault, byte offset) of the faults armed on the data files of ``path``'s step."""
        ap = os.path.abspath(path)
        step = _step_of(ap)
        out = []
        for f in self.faults:
            kind = f["kind"]
            if kind in ("kill-local-write", "enospc-local", "hung-local-disk"):
                node = f.get("node", self.node)
                if kind == "kill-local-write" and not self.mine(f):
                    continue
                if node != self.node or not ap.startswith(os.path.join(self.root_of(node), "local") + os.sep):
                    continue
            elif kind in ("kill-persistent-write", "enospc-persistent"):
                if kind == "kill-persistent-write" and not self.mine(f):
                    continue
                if not ap.startswith(self.pfs + os.sep):
                    continue
            else:
                continue
            if step == f["step"]:
                out.append((f, f["byte"]))
        return out

    def on_write(self, path: str, data_len: int) -> tuple[int, dict | None]:
        """Account ``data_len`` bytes about to be written to ``path``: returns (bytes to write
        before the fault, the fault) or (data_len, None)."""
        faults = self.byte_faults(path)
        key = (os.path.dirname(os.path.abspath(path)), _step_of(path))
        done = self.bytes[key]
        for f, offset in faults:
            if done + data_len > offset and not getattr(self.tls, f"done_{id(f)}", False):
                setattr(self.tls, f"done_{id(f)}", True)
                self.bytes[key] += max(0, offset - done)
                return max(0, offset - done), f
        self.bytes[key] += data_len
        return data_len, None

    def fire_byte(self, f: dict, path: str) -> None:
        """The byte-offset fault ``f`` is reached while writing ``path``."""
        kind, where = f["kind"], f"{os.path.relpath(path, self.base)} at byte {f['byte']} of step {f['step']}"
        if kind.startswith("kill"):
            self.kill(f, where)
        elif kind == "enospc-local":
            if self.record(f, where, exclusive=True):
                self.set_flag(f"node-{f['node']}-full")
            raise OSError(errno.ENOSPC, "No space left on device (injected)", path)
        elif kind == "enospc-persistent":
            if self.record(f, where, exclusive=True):
                self.set_flag("pfs-full")
            raise OSError(errno.ENOSPC, "No space left on device (injected)", path)
        elif kind == "hung-local-disk":
            self.record(f, where)
            while True:  # a disk that never answers again: this thread never returns
                time.sleep(3600)

    def arm_commit_fallback(self, rel_path: str) -> None:
        """A byte offset past the step's data bytes: the fault fires at the step's first
        commit-file write instead (the same save, so the instant stays within the plan)."""
        for f, _ in self.byte_faults(rel_path):
            if not getattr(self.tls, f"done_{id(f)}", False):
                setattr(self.tls, f"done_{id(f)}", True)
                self.fire_byte(f, rel_path)

    def _patch_storage(self) -> None:
        """Commit files, side files and the replica receiver's os.write obey the full /
        read-only flags."""
        from tierckpt.io.storage import Store
        from tierckpt.transport import receive

        inj = self
        orig_atomic, orig_open = Store.write_atomic, Store.open
        orig_makedirs, orig_remove, orig_rmtree, orig_rename = Store.makedirs, Store.remove, Store.rmtree, Store.rename

        def write_atomic(store: Store, rel: str, data: bytes, *, sync: bool = True, sync_dir: bool = True) -> None:
            p = store.path(rel)
            inj.arm_commit_fallback(p)
            err = inj.storage_error(p)
            if err is not None:
                raise err
            return orig_atomic(store, rel, data, sync=sync, sync_dir=sync_dir)

        def open_(store, rel, mode="rb"):
            if any(c in mode for c in "wa"):
                err = inj.storage_error(store.path(rel))
                if err is not None:
                    raise err
            return orig_open(store, rel, mode)

        def ro_guard(orig):
            def wrapped(store, rel="", *a):
                p = os.path.abspath(store.path(rel))
                if (p == inj.pfs or p.startswith(inj.pfs + os.sep)) and os.path.exists(inj.flag("pfs-ro")):
                    if orig is orig_makedirs and os.path.isdir(p):
                        return None  # mkdir -p of an existing directory succeeds on a read-only mount
                    raise OSError(errno.EROFS, "Read-only file system (injected)", p)
                return orig(store, rel, *a)
            return wrapped

        # an injector in place of the methods (mypy would bind the replacement as a method)
        Store.write_atomic, Store.open = write_atomic, open_  # type: ignore[assignment]
        Store.makedirs, Store.remove = ro_guard(orig_makedirs), ro_guard(orig_remove)
        Store.rmtree, Store.rename = ro_guard(orig_rmtree), ro_guard(orig_rename)

        class _OsShim:
            """``os`` for the replica receiver: ``write`` refuses a full file system."""

            def __getattr__(self, name):
                return getattr(os, name)

            @staticmethod
            def write(fd, data):
                try:
                    target = os.readlink(f"/proc/self/fd/{fd}")
                except OSError:
                    target = ""
                err = inj.storage_error(target) if target else None
                if err is not None:
                    raise err
                return os.write(fd, data)

        receive.os = _OsShim()  # type: ignore[assignment]  # the module whose sink writes received chunks

    def _patch_checksum(self) -> None:
        from tierckpt.tiers import commit

        orig = commit.written_entries
        inj = self

        def written_entries(store, rel, mine, index, count, group):
            tier = "persistent" if not rel.startswith("local/") else "local"
            fs = [f for f in inj.faults_of("kill-checksum") if inj.mine(f) and f["tier"] == tier
                  and _step_of(rel) == f["step"]]
            for f in fs:
                if f["sub"] == "before":
                    inj.kill(f, f"checksum of {tier} step {f['step']}, before hashing")
            out = orig(store, rel, mine, index, count, group)
            for f in fs:
                inj.kill(f, f"checksum of {tier} step {f['step']}, after hashing")
            return out

        commit.written_entries = written_entries

    def _patch_commit(self) -> None:
        """Kills around a step's manifest and marker (local, replica, persistent, pulled)."""
        from tierckpt.io import manifest

        orig = manifest.commit_bytes
        inj = self

        def which(rel: str) -> list[tuple[dict, str]]:
            out = []
            step = _step_of(rel)
            for f in inj.faults:
                kind = f["kind"]
                if kind == "kill-commit" and rel.startswith("local/") and inj.phase == "train":
                    ok = step == f["step"]
                elif kind == "kill-persistent-commit":
                    ok = rel.startswith("step-") and step == f["step"]
                elif kind == "kill-repl-recv" and f["sub"] == "commit":
                    ok = rel.startswith("replicas/") and step == f["step"]
                elif kind == "kill-restore" and f["sub"] == "pull-commit":
                    ok = rel.startswith("local/")
                else:
                    ok = False
                if ok and inj.mine(f):
                    out.append((f, f.get("sub", "before-manifest")))
            return out

        def commit_bytes(store, step_rel, mbytes):
            inj.arm_commit_fallback(store.path(step_rel))
            fs = which(step_rel)
            for f, sub in fs:
                if sub in ("before-manifest", "commit", "pull-commit"):
                    inj.kill(f, f"commit of {step_rel}, before the manifest")
                elif sub == "after-manifest":
                    store.write_atomic(f"{step_rel}/{manifest.MANIFEST}", mbytes)
                    inj.kill(f, f"commit of {step_rel}, manifest written, no marker")
            orig(store, step_rel, mbytes)
            for f, sub in fs:
                inj.kill(f, f"commit of {step_rel}, marker written, before the agreement")

        manifest.commit_bytes = commit_bytes

    def _patch_transfer(self) -> None:
        """Kills at the start, in the middle (the j-th chunk request) or at the end of a send
        or a receive (replication in the faulty run, pulls in a restore)."""
        from tierckpt.transport import transfer, wire

        inj = self
        orig_send, orig_recv, orig_work = transfer.send_step, transfer.recv_step, wire.work

        def matching(kind: str, t) -> list[dict]:
            out = []
            for f in inj.faults:
                if not inj.mine(f):
                    continue
                if f["kind"] == kind and t.tag.startswith("replica") and _step_of(t.dst_rel) == f["step"]:
                    out.append(f)
                elif f["kind"] == "kill-restore" and t.tag.startswith("pull") and \
                        f["sub"] == ("send" if kind == "kill-repl-send" else "recv"):
                    out.append(f)
            return out

        def run(kind, orig, t, args, kw):
            fs = matching(kind, t)
            for f in fs:
                if f.get("sub") in ("start", "send", "recv") and f["kind"] != "kill-restore":
                    inj.kill(f, f"{t.tag}: {kind[10:]} start")
            mids = [f for f in fs if f.get("sub") == "mid" or f["kind"] == "kill-restore"]
            inj.tls.mid = (mids, 0, t.tag) if mids else None
            try:
                out = orig(*args, **kw)
            finally:
                inj.tls.mid = None
            for f in fs:
                if f.get("sub") in ("end", "start"):
                    inj.kill(f, f"{t.tag}: {kind[10:]} end")
            return out

        # pass every argument through: a wrapper that drops one (a new parameter) fails every
        # receive before it drains its stream, and the sender then waits out the gloo timeout
        def send_step(store, t, *rest, **kw):
            return run("kill-repl-send", orig_send, t, (store, t, *rest), kw)

        def recv_step(store, t, *rest, **kw):
            return run("kill-repl-recv", orig_recv, t, (store, t, *rest), kw)

        def _work(w):
            mid = getattr(inj.tls, "mid", None)
            if mid:
                fs, n, tag = mid
                inj.tls.mid = (fs, n + 1, tag)
                for f in fs:
                    if n + 1 >= f.get("j", 1):
                        inj.kill(f, f"{tag}: chunk request {n + 1}")
            return orig_work(w)

        transfer.send_step, transfer.recv_step, wire.work = send_step, recv_step, _work

    def _patch_retention(self) -> None:
        from tierckpt.io import manifest
        from tierckpt.tiers import retention

        inj = self
        orig_purge, orig_uncommit = retention.purge_dir, manifest.uncommit

        def purge_dir(store, parent, *a, **kw):
            inj.tls.purging = store
            try:
                return orig_purge(store, parent, *a, **kw)
            finally:
                inj.tls.purging = None

        def uncommit(store, step_rel):
            if getattr(inj.tls, "purging", None) is store and store.exists(f"{step_rel}/tierckpt.committed"):
                inj.counts["purge"] += 1
                for f in inj.faults_of("kill-retention"):
                    if inj.mine(f) and inj.counts["purge"] == f["k"]:
                        what = f"retention deleting {store.path(step_rel)}"
                        if f["sub"] == "before":
                            inj.kill(f, what + ", before uncommit")
                        orig_uncommit(store, step_rel)
                        if f["sub"] == "mid-rmtree":
                            names = sorted(os.listdir(store.path(step_rel)))
                            for name in names[: max(1, len(names) // 2)]:
                                with contextlib.suppress(OSError):
                                    os.remove(os.path.join(store.path(step_rel), name))
                        inj.kill(f, what + f", {f['sub']}")
            return orig_uncommit(store, step_rel)

        retention.purge_dir, manifest.uncommit = purge_dir, uncommit

    def _patch_restore(self) -> None:
        from tierckpt.restore import restorer
        from tierckpt.tiers.local_tier import LocalTier
        from tierckpt.tiers.persistent import PersistentTier

        inj = self
        (f,) = self.faults_of("kill-restore")

        def wrap(name, orig, sub):
            def wrapped(*a, **kw):
                if f["sub"] == sub and inj.mine(f):
                    inj.kill(f, f"restore: {name}")
                return orig(*a, **kw)
            return wrapped

        LocalTier.survey = wrap("inventory (LocalTier.survey)", LocalTier.survey, "inventory")
        restorer.verify_split = wrap("verify_split", restorer.verify_split, "verify")
        restorer.load_dir = wrap("load_dir", restorer.load_dir, "load")
        PersistentTier.load = wrap("PersistentTier.load", PersistentTier.load, "load")

    def _patch_hung_read(self) -> None:
        """Every read-only ``os.open`` or ``open`` of a hung data file (see :func:`hung_dirs`; the
        files there when the phase starts, by inode: a pulled copy that replaces them reads
        normally) blocks for good, as on a hung NFS/NVMe disk; the first one records the firing."""
        import builtins
        import io
        (f,) = self.faults_of("hung-read-restore")
        hung = set()
        for d in hung_dirs(self.base, f["node"], f["target"]):
            for name in os.listdir(d):
                if name.endswith(".distcp"):
                    st = os.stat(os.path.join(d, name))
                    hung.add((st.st_dev, st.st_ino))
        inj, orig_open, orig_builtin = self, os.open, builtins.open

        def maybe_hang(path) -> None:
            if hung and isinstance(path, (str, bytes, os.PathLike)):
                with contextlib.suppress(OSError):
                    st = os.stat(path)
                    if (st.st_dev, st.st_ino) in hung:
                        inj.record(f, f"restore: read of {os.fsdecode(path)} hangs", exclusive=True)
                        threading.Event().wait()  # never returns: a read that hangs for good

        def hanging_open(path, flags, *a, **kw):
            if flags & os.O_ACCMODE == os.O_RDONLY:
                maybe_hang(path)
            return orig_open(path, flags, *a, **kw)

        def hanging_builtin(file, mode="r", *a, **kw):
            if "r" in mode and "+" not in mode:
                maybe_hang(file)
            return orig_builtin(file, mode, *a, **kw)

        os.open = hanging_open
        builtins.open = io.open = hanging_builtin  # DCP's reader opens through pathlib (io.open)

    def _patch_ledger(self) -> None:
        from tierckpt.history.ledger import Ledger

        orig = Ledger._append_line
        inj = self

        def _append_line(ledger, line):
            inj.counts["ledger"] += 1
            k = inj.counts["ledger"]
            if os.path.exists(inj.flag("pfs-ro")):
                raise OSError(errno.EROFS, "Read-only file system (injected)", ledger.store.path("tierckpt-ledger.jsonl"))
            for f in inj.faults_of("enospc-ledger"):
                if k == f["k"] and inj.record(f, f"ledger append {k}: file system full", exclusive=True):
                    inj.set_flag("ledger-full")
            if os.path.exists(inj.flag("ledger-full")):
                raise OSError(errno.ENOSPC, "No space left on device (injected)", "tierckpt-ledger.jsonl")
            for f in inj.faults_of("torn-ledger-line"):
                if k == f["k"]:
                    path = ledger.store.path("tierckpt-ledger.jsonl")
                    with open(path, "ab") as fh:
                        fh.write(line.encode()[: max(1, len(line) // 2)])
                        fh.flush()
                        os.fsync(fh.fileno())
                    inj.kill(dict(f, victim="all"), f"ledger append {k}: half a line written")
            return orig(ledger, line)

        Ledger._append_line = _append_line

    def _patch_worker(self) -> None:
        """The k-th job of the victim's tier worker kills its thread before it runs (the
        job's Future is never resolved)."""
        from tierckpt.tiers import workers

        orig = workers.DaemonWorker.submit
        inj = self
        (f,) = self.faults_of("dying-writer-thread")

        def submit(worker, fn, *args):
            if worker._thread.name == f"tierckpt-{f['tier']}" and inj.mine(f):
                inj.counts["jobs"] += 1
                if inj.counts["jobs"] == f["k"]:
                    inj.record(f, f"{worker._thread.name} job {f['k']}: thread dies")

                    def die():
                        raise RuntimeError("injected: the background writer thread died")

                    # armed before the item is queued: the idle worker takes it at once
                    fut: Future = Future()
                    fut.set_running_or_notify_cancel = die  # outside the worker's try
                    worker._q.put((fut, fn, args))
                    return fut
            return orig(worker, fn, *args)

        workers.DaemonWorker.submit = submit


class _FaultStream:
    """A DCP write stream that stops at the plan's byte offset (kill, ENOSPC, hang)."""

    def __init__(self, inner, path: str, inj: Injector):
        self._inner, self._path, self._inj = inner, path, inj

    def write(self, b) -> int:
        mv = memoryview(b).cast("B")
        err = self._inj.storage_error(self._path)
        if err is not None:
            raise err
        n, f = self._inj.on_write(self._path, len(mv))
        if f is None:
            return self._inner.write(b)
        if n:
            self._inner.write(bytes(mv[:n]))
        with contextlib.suppress(Exception):
            self._inner.flush()
            os.fsync(self._inner.fileno())
        self._inj.fire_byte(f, self._path)
        return self._inner.write(bytes(mv[n:])) + n  # fire_byte returned: nothing to stop

    def __getattr__(self, name):
        return getattr(self._inner, name)


# --------------------------------------------------------------------------------------------
# rank functions
# --------------------------------------------------------------------------------------------
def _config(base: str, plan: dict):
    from tierckpt.config import TierConfig

    extra: dict[str, Any] = {"restore_read_timeout_s": HUNG_READ_S} if plan["point"] == "hung-read-restore" else {}
    return TierConfig(
        local_root=os.path.join(base, "nvme", "node-{node}"), persistent_root=os.path.join(base, "pfs"),
        job_id="campaign", replication_factor=plan["factor"],
        keep_latest_k={"local": plan["keep_local"], "persistent": plan["keep_persistent"]},
        transfer_chunk_bytes=8192, collective_timeout_s=COLLECTIVE_S, local_wait_timeout_s=LOCAL_WAIT_S,
        **extra)


def hung_dirs(base: str, node: int, target: str) -> list[str]:
    """The step directories whose data files hang when read in a hung-read-restore trial: node
    ``node``'s own steps (``own``) or every holder's replicas of it (``replica``)."""
    nvme = os.path.join(base, "nvme")
    parents = [os.path.join(nvme, f"node-{node}", "local")] if target == "own" else \
        [os.path.join(nvme, h, "replicas", f"node-{node}") for h in sorted(os.listdir(nvme))] \
        if os.path.isdir(nvme) else []
    return [os.path.join(p, d) for p in parents if os.path.isdir(p) for d in sorted(os.listdir(p))
            if d.startswith("step-")]


def _snap_path(base: str, rank: int, step: int, run: str | None = None) -> str:
    """The trainer's snapshot of ``rank``'s state saved as ``step``; with ``run``, the one that
    run saved (runs of a new timeline save other states under the same step numbers)."""
    return os.path.join(base, "snaps", f"r{rank}-s{step}" + (f"-{run}" if run else "") + ".pt")


def _snap_for(base: str, rank: int, step: int, save_id: str | None) -> str:
    """The snapshot of the save a restore loaded (``save_id``: the restore's): the one its run
    wrote, else (a run that keyed none) the step's."""
    from tierckpt.history.timeline import run_of

    keyed = _snap_path(base, rank, step, run_of(save_id))
    return keyed if save_id is not None and os.path.exists(keyed) else _snap_path(base, rank, step)


def rank_train(rank: int, world: int, base: str, plan: dict, phase: str) -> dict:
    """The faulty run: train ``STEPS`` steps, save the local tier at every step (and the
    persistent tier at the plan's steps), waiting for each save; snapshot the state before
    each save. Failures the engine raises are recorded, not fatal (a trainer logs them)."""
    import torch

    from tests import scenarios
    from tierckpt.engine import TieredCheckpointer
    from tierckpt.errors import TierFailedError

    if plan["fault"]["kind"] == "signal-tree-loader-workers":
        return rank_train_signal_tree(rank, world, base, plan)
    inj = Injector(plan, phase, rank, base)
    inj.install()
    eng = TieredCheckpointer(_config(base, plan), node_id=_node_of(plan, rank))
    model, opt = scenarios.build(seed=0)
    out: dict = {"raised": [], "restore_in_run": None}
    os.makedirs(os.path.join(base, "snaps"), exist_ok=True)
    hung = plan["fault"]["kind"] == "hung-local-disk" and plan["fault"].get("restore_in_run")
    for s in range(1, STEPS + 1):
        scenarios.train_step(model, opt, s, rank)
        torch.save(scenarios.snapshot(model, opt), _snap_path(base, rank, s))
        shutil.copyfile(_snap_path(base, rank, s), _snap_path(base, rank, s, eng.timeline.run))
        tiers = ["local"] + (["persistent"] if s in plan["persistent_steps"] else [])
        try:
            eng.save(s, _app_state(plan, model, opt, rank, s), tiers=tiers)
        except TierFailedError as e:  # raised before staging: save again (it does not raise twice)
            out["raised"].append([e.tier, e.step])
            eng.save(s, _app_state(plan, model, opt, rank, s), tiers=tiers)
        eng.wait()
        if hung and s == plan["fault"]["step"]:
            out["restore_in_run"] = _restore_in_run(eng, rank, base, plan["fault"]["node"])
    try:
        eng.close()
    except TierFailedError as e:
        out["raised"].append([e.tier, e.step])
    out["history"] = [r.as_ledger() for r in eng.history]  # ledger lines: the JSON report
    return out


def _process_tree(pids: list[int]) -> list[int]:
    """``pids`` and all their live descendants (from /proc)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                with open(f"/proc/{d}/stat") as fh:
                    children.setdefault(int(fh.read().rsplit(")", 1)[1].split()[1]), []).append(int(d))
    out, todo = [], list(pids)
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def rank_train_signal_tree(rank: int, world: int, base: str, plan: dict) -> dict:
    """The faulty run of ``signal-tree-loader-workers``: the engine watches SIGTERM and
    SIGUSR1; each step reads a batch from a ``DataLoader(num_workers=2)`` (its workers
    protected with :func:`tierckpt.protect_loader_workers` when the plan says), trains, and
    saves as :func:`rank_train`. After training the fault's step, rank 0 sends the plan's
    signal (once or twice) from a separate process to every process of the job — the ranks and
    their loader workers — as Slurm's ``scancel --signal`` or torchrun's group signal do;
    every rank then finishes its step and, at the agreed step, takes the preemption save
    (``save_for_preemption``), or, when a fetch failed for the notice on every rank at the
    same step (agreed through the store: :func:`tierckpt.integration.agree_loader_death`),
    saves the last finished step; a fetch failure the ranks do not agree on is raised."""
    import subprocess

    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from tests import scenarios
    from tierckpt import protect_loader_workers
    from tierckpt.engine import TieredCheckpointer
    from tierckpt.integration import agree_loader_death

    f = plan["fault"]
    # the driver starts ranks as daemonic processes (killed with it), which multiprocessing
    # forbids to start children; a rank process here is a trainer, which may
    mp.current_process()._config["daemon"] = False  # type: ignore[attr-defined]
    cfg = dataclasses.replace(_config(base, plan), preemption_signals=("SIGTERM", "SIGUSR1"), preemption_grace_s=30.0)
    eng = TieredCheckpointer(cfg, node_id=rank)
    model, opt = scenarios.build(seed=0)
    out: dict = {"raised": [], "preempted": None, "workers_alive": None, "fetch_failed": None}
    os.makedirs(os.path.join(base, "snaps"), exist_ok=True)
    # fork, as a trainer started by torchrun gets by default (these ranks come from a
    # forkserver, whose children default to it; protect_loader_workers covers fork fully)
    loader = DataLoader(TensorDataset(torch.arange(64.0)), batch_size=2, num_workers=2, multiprocessing_context="fork")
    if f["protect"]:
        protect_loader_workers(loader, cfg.preemption_signals)
    batches = iter(loader)
    handle = None
    try:
        for s in range(1, STEPS + 1):
            try:
                next(batches)
            except RuntimeError as e:
                sig = agree_loader_death(eng, e, s - 1)  # collective save: only when every rank's fetch failed so
                if sig is None:
                    raise
                out["fetch_failed"] = str(e)[:200]
                out["preempted"] = eng.save_for_preemption(s - 1, scenarios.app_state(model, opt), sig,
                                                           handle=handle).step
                break
            scenarios.train_step(model, opt, s, rank)
            torch.save(scenarios.snapshot(model, opt), _snap_path(base, rank, s))
            if s == f["step"] and rank == 0:
                with open(os.path.join(base, "pids-train.json")) as fh:
                    tree = _process_tree(json.load(fh))
                for _ in range(2 if f["repeat"] else 1):
                    subprocess.run(["kill", "-s", f["signal"][3:], *map(str, tree)], check=False)
                    time.sleep(0.2)
                os.makedirs(os.path.join(base, "fired"), exist_ok=True)
                with open(os.path.join(base, "fired", "train-signal-tree-loader-workers.json"), "w") as fh:
                    json.dump({"rank": rank, "phase": "train", "time": time.time(),
                               "what": f"{f['signal']} x{2 if f['repeat'] else 1} to {len(tree)} processes after "
                                       f"step {s}"}, fh)
            time.sleep(0.3)  # the rest of the step: the notice lands here
            tiers = ["local"] + (["persistent"] if s in plan["persistent_steps"] else [])
            handle = eng.save(s, scenarios.app_state(model, opt), tiers=tiers)
            eng.wait()
            sig = eng.preemption_requested()
            if sig is not None:
                workers = getattr(batches, "_workers", [])
                out["workers_alive"] = [w.is_alive() for w in workers]
                out["preempted"] = eng.save_for_preemption(s, scenarios.app_state(model, opt), sig,
                                                           handle=handle).step
                break
    finally:
        del batches  # stops the loader's workers
    eng.close(raise_failures=False)
    return out


def check_signal_tree(plan: Plan, ph: PhaseResult, base: str, lines_before: int) -> list[str]:
    """``signal-tree-loader-workers``: no process of the job died of the notice, every rank
    took the preemption save at one step (the fault's step, or the next one when the notice
    landed after that step's check), the ledger's ``preemption`` record commits every tier at
    that step, and protected loader workers are still alive after the notice."""
    f = plan.fault
    if not any(x["name"].startswith("train-signal-tree") for x in _fired(base)):
        return []
    out = [f"rank {r} died by signal {-c} (a watched preemption signal must not kill a rank)"
           for r, c in sorted(ph.exitcodes.items()) if c is not None and c < 0]
    steps = {r: (v or {}).get("preempted") for r, v in sorted(ph.values.items())}
    if any(v is None for v in steps.values()) or len(set(steps.values())) != 1:
        out.append(f"the ranks did not all take one preemption save: {steps}")
        return out
    step = next(iter(steps.values()))
    if not f["step"] - 1 <= step <= f["step"] + 1:
        out.append(f"preemption save at step {step}, the notice came after step {f['step']}")
    pre = [r for r in checks.ledger_records(base, lines_before) if r.get("kind") == "preemption"]
    if len(pre) != 1 or pre[0].get("step") != step or not all((pre[0].get("committed") or {}).values()):
        out.append(f"ledger preemption records {pre}: want one at step {step} with every tier committed")
    if f["protect"]:
        for r, v in sorted(ph.values.items()):
            v = v or {}
            alive = v.get("workers_alive")
            if alive is not None and not all(alive):
                out.append(f"rank {r}: protected loader workers died of the notice: alive {alive}")
            if v.get("fetch_failed"):
                out.append(f"rank {r}: a protected loader's fetch failed: {v['fetch_failed']}")
    return out


def _restore_in_run(eng, rank: int, base: str, hung_node: int) -> dict:
    """A restore() while a local write hangs: it must return within the bound (fall back to
    another source), and what it loads must equal the snapshot of its step. A NoCheckpointError
    is right only when no step is servable without the hung node's local root (its copies are
    not trusted while a write into it is stuck); ``expected`` is computed from the files."""
    from tests import scenarios
    from tierckpt.errors import NoCheckpointError

    model, opt = scenarios.build(seed=77)
    sd = scenarios.app_state(model, opt)
    t0 = time.monotonic()
    try:
        res = eng.restore(sd)
    except NoCheckpointError as e:
        usable = [c for c in checks.scan_disk(base) if c.where != f"node-{hung_node}"]
        return {"seconds": time.monotonic() - t0, "step": None, "mismatch": None, "error": str(e)[:300],
                "expected": checks.expected_step(usable, eng.topo.nodes)}
    took = time.monotonic() - t0
    mismatch = None
    if res is not None:
        scenarios.apply_state(model, opt, sd)
        mismatch = _compare(scenarios.snapshot(model, opt), _snap_for(base, rank, res.step, res.save_id))
    return {"seconds": took, "step": None if res is None else res.step, "mismatch": mismatch}


def _compare(state, snap_file: str) -> str | None:
    """None when ``state`` equals the saved snapshot bitwise, else the first difference."""
    import torch

    from tests import scenarios

    try:
        ref = torch.load(snap_file, weights_only=False)
    except OSError as e:
        return f"no snapshot {snap_file}: {e}"
    try:
        scenarios.assert_bitwise(state, ref)
    except AssertionError as e:
        return str(e) or "differs"
    return None


def rank_restore(rank: int, world: int, base: str, plan: dict, phase: str) -> dict:
    """A restart: a fresh engine and model (another seed), restore, compare with the saved
    snapshot of the restored step, close."""
    from tests import scenarios
    from tierckpt.engine import TieredCheckpointer

    inj = Injector(plan, phase, rank, base)
    inj.install()
    out: dict = {"step": None, "sources": None, "error": None, "mismatch": None}
    t0 = time.monotonic()
    try:
        eng = TieredCheckpointer(_config(base, plan), node_id=_node_of(plan, rank))
    except Exception as e:  # a start that fails is a result too (e.g. a read-only root)
        out["error"] = f"start: {type(e).__name__}: {e}"
        return out
    model, opt = scenarios.build(seed=123)
    scenarios.train_step(model, opt, 999, rank)  # the fresh state differs everywhere
    sd = _app_state(plan, model, opt, rank, None)
    try:
        res = eng.restore(sd, sources=("in-cluster",) if phase == "restore:in-cluster" else None)
    except BaseException as e:  # noqa: BLE001 - the type is the result (NoCheckpointError or a raw error)
        out["error"] = f"{type(e).__name__}: {str(e)[:600]}"
        res = None
    out["seconds"] = time.monotonic() - t0
    if res is not None:
        out["step"], out["save_id"] = res.step, res.save_id
        out["sources"] = {str(n): [o.source.kind, o.source.holder] for n, o in res.sources.items()}
        scenarios.apply_state(model, opt, sd)
        out["mismatch"] = (_compare(scenarios.snapshot(model, opt), _snap_for(base, rank, res.step, res.save_id))
                           or _per_rank_mismatch(plan, sd, rank, res.step))
    try:
        eng.close(clean=out["error"] is None, raise_failures=False)
    except Exception as e:  # noqa: BLE001 - reported, the restore result stands
        out["close_error"] = f"{type(e).__name__}: {e}"
    return out


RANK_FUNCS = {"train": rank_train, "restore": rank_restore}


def _node_of(plan: dict, rank: int) -> int:
    """The simulated node of ``rank`` (``plan["rpn"]`` ranks per node)."""
    return rank // plan.get("rpn", 1)


# --------------------------------------------------------------------------------------------
# launcher: one process per rank (forkserver with torch preloaded: a start costs ~0.1 s)
# --------------------------------------------------------------------------------------------
@dataclass
class PhaseResult:
    """What one phase's processes did: ``values`` per rank (None when it returned nothing),
    ``errors`` (tracebacks), ``exitcodes``, ``hung`` (ran past the bound), ``seconds``."""

    values: dict[int, dict | None]
    errors: dict[int, str]
    exitcodes: dict[int, int | None]
    hung: bool
    seconds: float
    log: str = ""


def _entry(func: str, rank: int, world: int, port: int, base: str, plan: dict, phase: str, q, bound: float) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank % plan.get("rpn", 1)), OMP_NUM_THREADS="1")
    import logging

    logname = os.path.join(base, "logs", f"{phase.replace(':', '-')}-r{rank}.log")
    fh = open(logname, "a")
    os.dup2(fh.fileno(), 2)  # warnings and gloo's messages go to the rank's log, not the report
    logging.basicConfig(level=logging.WARNING, stream=fh,
                        format=f"[rank{rank}] %(levelname)s %(name)s: %(message)s", force=True)
    # a hang dumps every thread's stack into the log, then exits: the driver sees it as a hang
    faulthandler.dump_traceback_later(bound, exit=True, file=fh)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        q.put((rank, RANK_FUNCS[func](rank, world, base, plan, phase), None))
    except BaseException:  # noqa: BLE001 - every failure goes back to the driver
        q.put((rank, None, traceback.format_exc()))
    faulthandler.cancel_dump_traceback_later()
    fh.flush()
    q.close()
    q.join_thread()  # the result must reach the driver before the hard exit below
    # skip interpreter teardown: a peer blocked in gloo, or an abandoned daemon thread, must
    # not turn a finished rank into a SIGABRT (docs/design.md, "A hung node-local disk")
    os._exit(0)


_CTX = None


def _context():
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(["torch", "torch.distributed.checkpoint", "tierckpt.engine",
                                     "tests.scenarios", "bench.fault_campaign"])
    return _CTX


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_phase(func: str, world: int, base: str, plan: dict, phase: str, bound: float = PHASE_BOUND_S) -> PhaseResult:
    """Run ``func`` on ``world`` fresh rank processes. When a rank dies by a signal the others
    are stopped (what torchrun/srun do when a node fails); a phase running longer than
    ``bound`` (+ a margin) is a hang."""
    ctx = _context()
    os.makedirs(os.path.join(base, "logs"), exist_ok=True)
    q = ctx.Queue()
    port = _free_port()
    t0 = time.monotonic()
    procs = [ctx.Process(target=_entry, args=(func, r, world, port, base, plan, phase, q, bound), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    with open(os.path.join(base, f"pids-{phase.replace(':', '-')}.json"), "w") as fh:
        json.dump([p.pid for p in procs], fh)
    values: dict[int, dict | None] = {r: None for r in range(world)}
    errors: dict[int, str] = {}
    hung = False
    deadline = t0 + bound + 20
    died_at = None
    while True:
        with contextlib.suppress(Exception):
            while True:
                r, v, e = q.get(timeout=0.1)
                values[r] = v
                if e:
                    errors[r] = e
        alive = [p for p in procs if p.is_alive()]
        if not alive:
            break
        if died_at is None and any(p.exitcode is not None and p.exitcode < 0 for p in procs):
            died_at = time.monotonic()
        if died_at is not None and time.monotonic() - died_at > 0.5:
            for p in alive:
                p.kill()
        if time.monotonic() > deadline:
            hung = True
            for p in alive:
                p.kill()
        time.sleep(0.05)
    for p in procs:
        p.join()
    with contextlib.suppress(Exception):
        while True:
            r, v, e = q.get(timeout=0.05)
            values[r] = v
            if e:
                errors[r] = e
    codes = {r: p.exitcode for r, p in enumerate(procs)}
    # faulthandler's exit is status 1 without a result: the rank hung past its bound
    for r, p in enumerate(procs):
        if codes[r] == 1 and values[r] is None and r not in errors:
            hung = True
    log = ""
    for r in range(world):
        with contextlib.suppress(OSError):
            log += Path(base, "logs", f"{phase.replace(':', '-')}-r{r}.log").read_text()[-4000:]
    return PhaseResult(values, errors, codes, hung, time.monotonic() - t0, log)



# --------------------------------------------------------------------------------------------
# the invariants of one phase (bench/campaign_checks.py holds the definitions)
# --------------------------------------------------------------------------------------------
def _hang_text(ph: PhaseResult, phase: str) -> str:
    """A hang's violation text: the phase and the first stack lines faulthandler dumped."""
    # the engine's frames (not the injector's deliberately hung write) say where it waits
    stack = [ln.strip() for ln in ph.log.splitlines()
             if ln.strip().startswith("File") and "/tierckpt/" in ln and "/bench/" not in ln]
    return f"hang: the {phase} phase ran past its bound ({PHASE_BOUND_S:g} s); stacks: {' | '.join(stack[:12])}"


def _killed(ph: PhaseResult) -> bool:
    return any(c is not None and c < 0 for c in ph.exitcodes.values())


def _common_disk_checks(base: str, after: list) -> list[str]:
    ls_rows, verify_doc, problems = checks.run_cli(base)
    return problems + checks.check_visible(ls_rows, verify_doc, after, base)


def check_train_phase(plan: Plan, ph: PhaseResult, base: str, lines_before: int) -> list[str]:
    """The faulty run: no hang, no raw trainer crash, a bounded in-run restore, the failure
    records of injected storage faults, nothing committed lost but to retention, nothing
    uncommitted visible."""
    out = []
    if ph.hung:
        out.append(_hang_text(ph, "train"))
    if not _killed(ph):
        for r, e in sorted(ph.errors.items()):
            out.append(f"rank {r}: the training run raised: {e.strip().splitlines()[-1][:400]}")
    after = checks.scan_disk(base)
    out += _common_disk_checks(base, after)
    prefault = os.path.join(base, "fired", "prefault-train.json")
    if os.path.exists(prefault):
        with open(prefault) as fh:
            before = checks.copies_from_json(json.load(fh))
        out += checks.check_no_loss(before, after, keep_local=plan.keep_local, keep_persistent=plan.keep_persistent,
                                    allow_retention=True)
    records = checks.ledger_records(base, lines_before)
    out += checks.check_ok_records_on_disk(records, after, plan.keep_persistent)
    for rec in (r for r in records if r.get("kind") == "restore"):  # a restore() inside the run
        out += checks.check_one_save(rec, checks.served_by_record(rec, after), strict=False)
    fired = {f["name"] for f in _fired(base)}
    f = plan.fault
    if f["kind"] == "signal-tree-loader-workers":
        return out + check_signal_tree(plan, ph, base, lines_before)
    if _killed(ph) or ph.hung:
        return out
    if f["kind"] == "enospc-local" and any("enospc-local" in x for x in fired):
        out += checks.check_failure_records(records, "local", list(range(f["step"], STEPS + 1)))
    elif f["kind"] == "enospc-persistent" and any("enospc-persistent" in x for x in fired):
        steps = [s for s in plan.persistent_steps if s >= f["step"]]
        out += checks.check_failure_records(records, "persistent", steps)
        for r, v in sorted(ph.values.items()):
            raised = {tuple(x) for x in (v or {}).get("raised", [])}
            missing = [s for s in steps if ("persistent", s) not in raised]
            if missing:
                out.append(f"rank {r}: the failed persistent save(s) {missing} never reached the trainer "
                           "(TierFailedError at the next persistent save or at close)")
    elif f["kind"] == "hung-local-disk" and any("hung-local-disk" in x for x in fired):
        if f["step"] < STEPS:
            out += checks.check_failure_records(records, "local", [], skipped_node=f["node"])
        for r, v in sorted(ph.values.items()):
            rr = (v or {}).get("restore_in_run")
            if rr and rr["seconds"] > RESTORE_BOUND_S:
                out.append(f"rank {r}: restore() during a hung local write took {rr['seconds']:.0f} s "
                           f"(bound {RESTORE_BOUND_S:g} s)")
            if rr and rr.get("mismatch"):
                out.append(f"rank {r}: restore() during a hung local write loaded step {rr['step']} wrong: "
                           f"{rr['mismatch'][:300]}")
            if rr and rr.get("error") and rr.get("expected") is not None:
                out.append(f"rank {r}: restore() during a hung local write raised although step "
                           f"{rr['expected']} is servable without the hung node: {rr['error']}")
    return out


def _readable(plan: Plan, base: str, copies: list) -> list:
    """``copies`` less those a hung-read-restore trial's restore cannot read (:func:`hung_dirs`)."""
    hung = set(hung_dirs(base, plan.fault["node"], plan.fault["target"]))
    return [c for c in copies if c.holder is None or os.path.join(base, "nvme", c.where, c.rel) not in hung]


def hung_restore_bound(plan: Plan) -> float:
    """Seconds a hung-read-restore trial's restart and restore may take: one read bound per
    source that can time out (each kept step: a pull and an in-cluster read per holder of a
    hung copy) plus :data:`HUNG_SLACK_S`."""
    return (2 * max(1, plan.factor - 1) * plan.keep_local + 1) * HUNG_READ_S + HUNG_SLACK_S


def check_hung_read(plan: Plan, ph: PhaseResult, base: str, lines_before: int) -> list[str]:
    """hung-read-restore: every rank's restart and restore returned within
    :func:`hung_restore_bound` (the bound's fallbacks plus slack), and the ledger's restore
    record names the hung source of the node as failed, timed out (when the read fired). The
    step and the bitwise state are :func:`check_restore_phase`'s (from the readable copies)."""
    out = []
    bound = hung_restore_bound(plan)
    for r, v in sorted(ph.values.items()):
        if v is not None and v.get("seconds", 0) > bound:
            out.append(f"rank {r}: restart and restore with a hung read took {v['seconds']:.0f} s "
                       f"(bound {bound:g} s)")
    if ph.hung or not any(x["name"].startswith("restore-hung-hung-read-restore") for x in _fired(base)):
        return out
    recs = [r for r in checks.ledger_records(base, lines_before) if r.get("kind") == "restore"]
    v = plan.fault["node"]
    kind = "own-local" if plan.fault["target"] == "own" else "peer-replica"
    if recs and not any(f.get("node") == v and f.get("source") == kind and "timed out" in (f.get("error") or "")
                        for f in recs[0].get("failures") or []):
        out.append(f"ledger: the restore record does not name node {v}'s {kind} source as timed out: "
                   f"{recs[0].get('failures')}")
    return out


@dataclass
class RestoreCheck:
    """A restore phase's violations, the restored and expected outcome (report text), and the
    rank-0 result (for the next disk action of the script)."""

    violations: list[str]
    restored: str
    expected: str
    value: dict | None


def _describe_restore(v: dict | None) -> str:
    if v is None:
        return "killed"
    if v.get("error"):
        return v["error"].split(":", 1)[0]
    if v.get("step") is None:
        return "fresh"
    src = ", ".join(f"{k}" + (f"@{h}" if h is not None and k != "own-local" else "")
                    for k, h in (v.get("sources") or {}).values())
    return f"{v['step']} ({src})"


def check_restore_phase(plan: Plan, ph: PhaseResult, base: str, before: list, after: list, lines_before: int,
                        *, interrupted: bool, final: bool, usable: list | None = None,
                        ph_name: str = "restore") -> RestoreCheck:
    """A restart and restore: bounded, the expected step (or fresh start / NoCheckpointError),
    bitwise state, sources that were on disk, the ledger's restore record, nothing lost,
    nothing uncommitted visible, redundancy re-established. ``usable``: the copies the
    expected step is computed from, when not all of ``before`` can be read (hung)."""
    phase = "restore (interrupted)" if interrupted else ph_name
    out = []
    if ph.hung:
        out.append(_hang_text(ph, phase))
    killed = _killed(ph)
    for r, e in sorted(ph.errors.items()):
        if not killed:
            out.append(f"rank {r}: the restart raised: {e.strip().splitlines()[-1][:400]}")
    in_cluster = phase == "restore:in-cluster"
    exp_save = checks.expected_save(before if usable is None else usable, plan.nodes, world=plan.world,
                                    persistent=not in_cluster)
    exp = None if exp_save is None else exp_save[0]
    expected = "fresh" if exp is None and not checks.any_committed(before) else \
        "NoCheckpointError" if exp is None else str(exp)
    values = {r: v for r, v in ph.values.items() if v is not None}
    v0 = ph.values.get(0)
    restored = _describe_restore(v0) if not killed else "killed (as injected)"
    out += _common_disk_checks(base, after)
    out += checks.check_no_loss(before, after, keep_local=plan.keep_local, keep_persistent=plan.keep_persistent,
                                allow_retention=False)
    raw = checks.ledger_raw(base)
    torn = 1 if any(f["name"].startswith("train-torn-ledger-line") for f in _fired(base)) else 0
    out += checks.check_ledger_parse(raw, torn)
    for rec in (r for r in checks.ledger_records(base, lines_before) if r.get("kind") == "restore"):
        out += checks.check_one_save(rec, checks.served_by_record(rec, after), strict=not (killed or ph.hung))
    if killed or ph.hung or len(values) < plan.world:
        if not killed and not ph.hung:
            out.append(f"ranks {sorted(set(range(plan.world)) - set(values))} returned no restore result")
        return RestoreCheck(out, restored, expected, None)
    out += checks.check_restored(exp, checks.any_committed(before), values)
    if v0 and v0.get("step") is not None and not v0.get("error"):
        step, sources = v0["step"], v0["sources"] or {}
        for r, v in values.items():
            if v.get("sources") != sources or v.get("step") != step:
                out.append(f"rank {r} reports step {v.get('step')} from {v.get('sources')}, rank 0 {step} from {sources}")
        out += checks.check_sources(sources, step, before, v0.get("save_id"), by_save="save_id" in v0)
        if "save_id" in v0 and exp_save is not None and step == exp_save[0] and v0["save_id"] != exp_save[1]:
            out.append(f"rank 0: restored save {v0['save_id']} of step {step}, but the newest save of it complete "
                       f"on disk for every node is {exp_save[1]}")
        ro = os.path.exists(os.path.join(base, "state", "pfs-ro"))
        if not ro:  # a read-only persistent root cannot take the record
            out += checks.check_restore_record(checks.ledger_records(base, lines_before), step, sources)
        if plan.factor > 1 and all(k in ("own-local", "peer-replica") for k, _ in sources.values()):
            out += checks.check_redundancy(after, step, plan.nodes, plan.factor)
    return RestoreCheck(out, restored, expected, v0)

# --------------------------------------------------------------------------------------------
# issue 28: new timelines (a fallback, an explicit rollback) over the old timeline's step numbers
# --------------------------------------------------------------------------------------------
TIMELINE_POINTS = ("corrupt-newest-then-save", "failed-replication-after-fallback", "rollback-skewed-clock")
NEW_BATCHES = 500  # a new timeline trains on batches step + 500: its states differ at every step number


def _timeline_plan(plan: Plan, rng: random.Random) -> None:
    """The fault and script of a point of :data:`TIMELINE_POINTS` (the training run itself is
    clean but for a skewed clock; the faults are corrupt copies, a failed replication, a
    lost node root, and the new timeline's own saves and retention)."""
    f, nodes = plan.fault, plan.nodes
    if plan.point == "corrupt-newest-then-save":
        # keep_local 1 leaves only the newest step locally: the persistent tier must then keep
        # an older step to fall back to (keep 2 of the 2 persistent steps)
        plan.keep_local = rng.choice([1, 2, 2])
        plan.keep_persistent = 2 if plan.keep_local == 1 else rng.choice([1, 2])
        n_new = rng.randint(1, 3)
        wipes = [] if rng.random() < 0.5 else sorted(rng.sample(range(nodes), rng.randint(1, nodes)))
        f.update(node=rng.randrange(nodes), frac=round(rng.random(), 2), new=n_new,
                 new_persistent=sorted(rng.sample(range(1, n_new + 1), rng.randint(0, n_new))), wipe=wipes)
        plan.script = ["train", "corrupt-newest", "timeline", *[f"wipe:{n}" for n in wipes], "restore"]
    elif plan.point == "failed-replication-after-fallback":
        plan.keep_local = rng.choice([2, 3])  # the step before the newest stays local: the fallback's target
        w = rng.randrange(nodes)
        f.update(node=rng.randrange(nodes), frac=0.0, save_step=STEPS, wipe=[w])
        plan.script = ["train", "corrupt-newest", "timeline", f"wipe:{w}", "restore"]
    else:  # rollback-skewed-clock
        plan.keep_local = rng.choice([2, 3])
        plan.keep_persistent = 2
        kept = set(range(STEPS - plan.keep_local + 1, STEPS)) | {s for s in plan.persistent_steps if s < STEPS}
        f.update(victim=f"r{rng.randrange(nodes)}", skew=rng.choice([-3600.0, 3600.0]), to_step=rng.choice(sorted(kept)),
                 tiers=rng.choice([["local"], ["local", "persistent"]]))
        plan.script = ["train", "timeline", "restore"]


def _patch_clock(inj: Injector) -> None:
    """rollback-skewed-clock: the victim rank writes its manifests (``committed_at``) with a
    wall clock ``skew`` seconds off, as a host whose clock is wrong."""
    (f,) = inj.faults_of("rollback-skewed-clock")
    if not inj.mine(f):
        return
    import tierckpt.io.manifest as manifest_mod

    real, skew = time, float(f["skew"])

    class _Skewed:
        def __getattr__(self, name):
            return getattr(real, name)

        @staticmethod
        def time() -> float:
            return real.time() + skew

    manifest_mod.time = _Skewed()  # type: ignore[assignment]
    inj.record(f, f"rank {inj.rank}'s wall clock off by {skew:+.0f} s while saving")


def corrupt_newest(plan: Plan, base: str) -> list[str]:
    """Between the training run and the restart: flip a byte in every data file of the newest
    step's copies — every copy of the plan's node (its own, its replicas) and the persistent
    step, each other copy with probability ``frac`` — so that the step is unservable for that
    node. Returns violation texts when there was nothing to corrupt (a campaign error)."""
    from tests.scenarios_timeline import corrupt_step_dir

    f = plan.fault
    rng = random.Random(plan.seed * 7919 + 28)
    copies = [c for c in checks.scan_disk(base, verify=False) if c.committed]
    newest = max((c.step for c in copies), default=None)
    if newest is None:
        return ["campaign: the training run left no committed step to corrupt"]
    hit = []
    for c in sorted((c for c in copies if c.step == newest), key=lambda c: c.path):
        if c.holder is None or c.node == f["node"] or rng.random() < f["frac"]:
            if corrupt_step_dir(os.path.join(base, "nvme", c.path) if c.holder is not None else os.path.join(base, c.path)):
                hit.append(c.path)
    Path(base, "fired", "corrupt-newest.json").write_text(json.dumps(
        {"rank": None, "phase": "corrupt", "what": f"step {newest} corrupted in {', '.join(hit)}", "time": time.time()}))
    got = checks.expected_save(checks.scan_disk(base), plan.nodes)
    if got is not None and got[0] >= newest:
        return [f"campaign: corrupting {hit} left step {newest} servable for every node"]
    return []


def _served_now(base: str, res, node: int) -> dict[str, list[list]]:
    """The copies node ``node`` was served from (:func:`bench.campaign_checks.served_by_record`),
    read from the files right after ``res``'s restore (a pull may be committing meanwhile: a
    directory that vanishes between listing and reading is read again)."""
    rec = {"step": res.step, "sources": {str(n): {"source": o.source.kind, "holder": o.source.holder}
                                         for n, o in res.sources.items()}}
    for attempt in range(5):
        try:
            return checks.served_by_record(rec, checks.scan_disk(base, verify=False), nodes=[node])
        except OSError:
            if attempt == 4:
                raise
            time.sleep(0.2)
    return {}


def rank_timeline(rank: int, world: int, base: str, plan: dict, phase: str) -> dict:
    """A run that starts a new timeline: restore (no step: a fallback past the corrupt newest
    step; rollback-skewed-clock: ``restore(step=k, rollback=True)``), read the copies this node
    was served from (before any save can supersede or purge them; a barrier holds every rank
    until all have read), train on other batches and save new steps under the old timeline's
    numbers (failed-replication-after-fallback: local only, every replication failing), each
    waited for and snapshotted per run; close (uncleanly after a rollback: the run dies)."""
    import torch
    import torch.distributed as dist

    from tests import scenarios
    from tierckpt.engine import TieredCheckpointer
    from tierckpt.errors import TierFailedError

    f = plan["fault"]
    kind = f["kind"]
    inj = Injector(plan, phase, rank, base)
    if kind == "failed-replication-after-fallback":
        import tierckpt.tiers.jobs as jobs

        def no_replication(*a, **kw):
            inj.record(f, "replication of the new timeline's save: link down", exclusive=True)
            raise OSError(errno.ENETUNREACH, "injected: replication link down")

        jobs.replicate = no_replication
    out: dict = {"step": None, "save_id": None, "sources": None, "error": None, "mismatch": None, "served": {},
                 "saved": [], "raised": []}
    eng = TieredCheckpointer(_config(base, plan), node_id=rank)
    model, opt = scenarios.build(seed=123)
    scenarios.train_step(model, opt, 999, rank)  # the fresh state differs everywhere
    sd = scenarios.app_state(model, opt)
    rollback = kind == "rollback-skewed-clock"
    try:
        res = eng.restore(sd, step=f["to_step"], rollback=True) if rollback else eng.restore(sd)
    except BaseException as e:  # noqa: BLE001 - the type is the result
        out["error"] = f"{type(e).__name__}: {str(e)[:600]}"
        res = None
    if res is not None:
        out["step"], out["save_id"] = res.step, res.save_id
        out["sources"] = {str(n): [o.source.kind, o.source.holder] for n, o in res.sources.items()}
        scenarios.apply_state(model, opt, sd)
        out["mismatch"] = _compare(scenarios.snapshot(model, opt), _snap_for(base, rank, res.step, res.save_id))
        out["served"] = _served_now(base, res, rank)
    dist.barrier()
    if res is None:
        with contextlib.suppress(Exception):
            eng.close(clean=False, reason="campaign: nothing restored", raise_failures=False)
        return out
    if rollback:
        todo = [(f["to_step"] + 1, list(f["tiers"]))]
    elif kind == "failed-replication-after-fallback":
        todo = [(f["save_step"], ["local"])] if f["save_step"] > res.step else []
    else:
        todo = [(res.step + i, ["local"] + (["persistent"] if i in f["new_persistent"] else []))
                for i in range(1, f["new"] + 1)]
    t = res.step
    for s, tiers in todo:
        while t < s:
            t += 1
            scenarios.train_step(model, opt, t + NEW_BATCHES, rank)
        sid = f"{eng.timeline.run}.{eng.timeline.next_seq}"
        torch.save(scenarios.snapshot(model, opt), _snap_path(base, rank, s, eng.timeline.run))
        try:
            eng.save(s, scenarios.app_state(model, opt), tiers=tiers)
        except TierFailedError as e:
            out["raised"].append([e.tier, e.step])
            sid = f"{eng.timeline.run}.{eng.timeline.next_seq}"
            eng.save(s, scenarios.app_state(model, opt), tiers=tiers)
        eng.wait()
        out["saved"].append([s, sid, tiers])
    try:
        if rollback:
            eng.close(clean=False, reason="campaign: the new timeline's run dies", raise_failures=False)
        else:
            eng.close(raise_failures=False)
    except Exception as e:  # noqa: BLE001 - reported by the driver
        out["close_error"] = f"{type(e).__name__}: {e}"
    out["history"] = [r.as_ledger() for r in eng.history]  # ledger lines: the JSON report
    return out


RANK_FUNCS["timeline"] = rank_timeline


def run_timeline_phase(plan: Plan, base: str, pd: dict) -> RestoreCheck:
    """Run the new timeline's phase (:func:`rank_timeline`) and check it."""
    before = checks.scan_disk(base)
    lines = checks.ledger_lines(base)
    ph = run_phase("timeline", plan.nodes, base, pd, "timeline")
    return check_timeline_phase(plan, ph, base, before, checks.scan_disk(base), lines)


def check_timeline_phase(plan: Plan, ph: PhaseResult, base: str, before: list, after: list,
                         lines_before: int) -> RestoreCheck:
    """The new timeline's run: bounded; its restore loaded the expected save (the newest
    complete one; after a rollback, the newest of the step named) bitwise, from copies of that
    one save (ledger record and files); then the checks of the timeline it started
    (:func:`bench.campaign_checks.check_new_timeline`) and, for a failed replication, the
    local record saying so."""
    out = []
    f = plan.fault
    rollback = f["kind"] == "rollback-skewed-clock"
    if ph.hung:
        out.append(_hang_text(ph, "timeline"))
    for r, e in sorted(ph.errors.items()):
        out.append(f"rank {r}: the new timeline's run raised: {e.strip().splitlines()[-1][:400]}")
    exp = checks.expected_save(before, plan.nodes, step=f["to_step"] if rollback else None)
    expected = "NoCheckpointError" if exp is None else str(exp[0])
    values = {r: v for r, v in ph.values.items() if v is not None}
    v0 = values.get(0)
    restored = _describe_restore(v0)
    out += _common_disk_checks(base, after)
    if ph.hung or len(values) < plan.nodes:
        if not ph.hung:
            out.append(f"ranks {sorted(set(range(plan.nodes)) - set(values))} returned no result")
        return RestoreCheck(out, restored, expected, v0)
    out += checks.check_restored(None if exp is None else exp[0], checks.any_committed(before), values)
    if exp is None or v0 is None or v0.get("step") is None or v0.get("error"):
        return RestoreCheck(out, restored, expected, v0)
    step, sid, sources = v0["step"], v0["save_id"], v0["sources"] or {}
    for r, v in values.items():
        if (v.get("step"), v.get("save_id"), v.get("sources")) != (step, sid, sources):
            out.append(f"rank {r} reports step {v.get('step')} (save {v.get('save_id')}) from {v.get('sources')}, "
                       f"rank 0 {step} (save {sid}) from {sources}")
    if sid != exp[1]:
        out.append(f"rank 0: restored save {sid} of step {step}, but the newest save of it complete on disk for "
                   f"every node is {exp[1]}")
    out += checks.check_sources(sources, step, before, sid, by_save=True)
    records = checks.ledger_records(base, lines_before)
    out += checks.check_restore_record(records, step, sources)
    rrec = [r for r in records if r.get("kind") == "restore"]
    served = {n: cs for v in values.values() for n, cs in (v.get("served") or {}).items()}
    if len(rrec) == 1:
        out += checks.check_one_save(rrec[0], served, strict=True)
    saved = v0.get("saved") or []
    out += checks.check_new_timeline(before, after, records, nodes=plan.nodes, to_step=step, keep=sid,
                                     saved=[(s, i, tiers) for s, i, tiers in saved],
                                     cause=None if rollback else "fallback", keep_local=plan.keep_local,
                                     keep_persistent=plan.keep_persistent, base=base)
    if f["kind"] == "failed-replication-after-fallback":
        recs = [r for r in records if r.get("kind") == "checkpoint" and r.get("tier") == "local"
                and r.get("step") == f["save_step"]]
        if not saved:
            out.append(f"the new timeline restored step {step}, so it never saved step {f['save_step']} again")
        elif len(recs) != 1 or not recs[0].get("ok") or not recs[0].get("replicas_failed"):
            out.append(f"ledger: the new timeline's local step {f['save_step']} (replication failing) should have "
                       f"one ok record with replicas_failed, found {[(r.get('ok'), r.get('replicas_failed')) for r in recs]}")
    return RestoreCheck(out, restored, expected, v0)


# --------------------------------------------------------------------------------------------
# the trial driver
# --------------------------------------------------------------------------------------------
@dataclass
class TrialResult:
    """One row of the report."""

    seed: int
    index: int
    point: str
    nodes: int
    faults: str
    instant: str
    result: str            # "ok", "VIOLATION" or "not reached"
    restored: str          # e.g. "4 (own-local, peer-replica@0)", "fresh", "NoCheckpointError"
    expected: str
    violations: list[str]
    seconds: float
    workdir: str = ""


def _fired(base: str) -> list[dict]:
    d = os.path.join(base, "fired")
    out = []
    for name in sorted(os.listdir(d)) if os.path.isdir(d) else []:
        if name.startswith("prefault") or not name.endswith(".json"):
            continue
        with contextlib.suppress(OSError, ValueError):
            out.append({"name": name[:-5], **json.loads(Path(d, name).read_text())})
    return out


def _wipe(base: str, node: int) -> None:
    shutil.rmtree(os.path.join(base, "nvme", f"node-{node}"), ignore_errors=True)


def _swap(base: str, a: int, b: int) -> None:
    ra, rb = (os.path.join(base, "nvme", f"node-{n}") for n in (a, b))
    tmp = ra + ".swap"
    os.makedirs(ra, exist_ok=True)
    os.makedirs(rb, exist_ok=True)
    os.rename(ra, tmp)
    os.rename(rb, ra)
    os.rename(tmp, rb)


def _clear_transient_state(base: str, plan: Plan) -> None:
    """Between the faulty run and the restart: a full disk is freed (the job is rescheduled),
    a read-only persistent root stays so only when the plan says."""
    d = os.path.join(base, "state")
    for name in os.listdir(d) if os.path.isdir(d) else []:
        if name == "pfs-ro" and plan.fault.get("at_restart"):
            continue
        os.remove(os.path.join(d, name))


def run_trial(plan: Plan, workdir: str) -> TrialResult:
    """Run one trial's script and check the invariants after every restore."""
    t0 = time.monotonic()
    base = workdir
    violations: list[str] = []
    restored, expected = "-", "-"
    pd = asdict(plan)
    last_restore: dict | None = None
    for i, action in enumerate(plan.script):
        if action == "train" and plan.point == "exit-without-close":  # its own rank processes
            violations += campaign_exit.run_exit_phase(plan, base, PHASE_BOUND_S)
        elif action == "train":
            before = checks.ledger_lines(base)
            ph = run_phase("train", plan.world, base, pd, "train")
            violations += check_train_phase(plan, ph, base, before)
            if plan.point == "per-rank-values":
                violations += checks.check_per_rank_files(checks.scan_disk(base), base)
            _clear_transient_state(base, plan)
        elif action.startswith("wipe:"):
            _wipe(base, int(action.split(":")[1]))
        elif action == "wipe-all":  # every node-local root lost: only the persistent tier is left
            shutil.rmtree(os.path.join(base, "nvme"), ignore_errors=True)
        elif action.startswith("wipe-other-than:"):
            v = int(action.split(":")[1])
            rng = random.Random(plan.seed * 7919 + i)
            _wipe(base, rng.choice([n for n in range(plan.nodes) if n != v]))
        elif action.startswith("wipe-server-of:"):
            v = int(action.split(":")[1])
            src = (last_restore or {}).get("sources", {}).get(str(v)) if last_restore else None
            server = src[1] if src and src[0] == "peer-replica" and src[1] is not None else None
            if server is None:  # v was not served by a replica: lose another node instead
                rng = random.Random(plan.seed * 7919 + i)
                server = rng.choice([n for n in range(plan.nodes) if n != v])
            _wipe(base, server)
        elif action.startswith("swap:"):
            _, a, b = action.split(":")
            _swap(base, int(a), int(b))
        elif action == "corrupt-newest":
            violations += corrupt_newest(plan, base)
        elif action == "timeline":
            tres = run_timeline_phase(plan, base, pd)
            violations += tres.violations
            restored, expected = tres.restored, tres.expected
        elif action.startswith("restore"):
            phase = action
            disk_before = checks.scan_disk(base)
            lines_before = checks.ledger_lines(base)
            ph = run_phase("restore", plan.world, base, pd, phase)
            disk_after = checks.scan_disk(base)
            final = i == len(plan.script) - 1 or not plan.script[i + 1:] or \
                all(not a.startswith("restore") for a in plan.script[i + 1:])
            hung = phase == "restore:hung"
            res = check_restore_phase(plan, ph, base, disk_before, disk_after, lines_before,
                                      interrupted=phase == "restore:fault", final=final,
                                      usable=_readable(plan, base, disk_before) if hung else None, ph_name=phase)
            violations += res.violations + (check_hung_read(plan, ph, base, lines_before) if hung else [])
            if plan.point == "per-rank-values":
                violations += checks.check_per_rank_files(disk_after, base)
            if phase != "restore:fault":
                restored, expected = res.restored, res.expected
                last_restore = res.value
    fired = _fired(base)
    instant = "; ".join(f"{f['name']}: {f['what']}" for f in fired)[:400] or "-"
    must_fire = plan.point not in ("second-loss-after-restore", "second-loss-of-server", "remap-swapped-roots")
    result = "VIOLATION" if violations else ("not reached" if must_fire and not fired else "ok")
    return TrialResult(seed=plan.seed, index=plan.index, point=plan.point, nodes=plan.nodes,
                       faults=plan.describe(), instant=instant, result=result, restored=restored,
                       expected=expected, violations=violations, seconds=round(time.monotonic() - t0, 1),
                       workdir=workdir)


# --------------------------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------------------------
def counts_per_point(rows: list[TrialResult]) -> dict[str, Counter]:
    """{point: Counter(trials, ok, VIOLATION, not reached)} over every point (0 for unrun ones)."""
    out: dict[str, Counter] = {p: Counter() for p in POINT_NAMES}
    for r in rows:
        out[r.point]["trials"] += 1
        out[r.point][r.result] += 1
    return out


VIOLATION_KINDS = [
    ("hang", "hang:"), ("redundancy", "redundancy not re-established"), ("lost copy", "committed copy lost"),
    ("uncommitted visible", "tierckpt ls shows"), ("corrupt", "tierckpt verify"), ("ledger", "ledger"),
    ("wrong step / raw error", "rank "), ("other", ""),
]


def violation_kind(text: str) -> str:
    """The invariant a violation text belongs to (for the summary)."""
    for name, prefix in VIOLATION_KINDS:
        if text.startswith(prefix) or (prefix and prefix in text[:40]):
            return name
    return "other"


def violations_by_kind(rows: list[TrialResult]) -> dict[str, list[int]]:
    """{invariant: seeds of the trials that violated it}."""
    out: dict[str, list[int]] = {}
    for r in rows:
        for kind in sorted({violation_kind(v) for v in r.violations}):
            out.setdefault(kind, []).append(r.seed)
    return out


def source_revision(repo: Path = REPO) -> str:
    """``<commit> (clean)`` or ``<commit> (dirty: uncommitted changes to tracked files)`` of the
    repository the campaign ran from (``git rev-parse HEAD``), ``unknown`` outside a git checkout."""
    import subprocess

    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True,
                              check=True, timeout=30).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo,
                               capture_output=True, text=True, check=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown (not a git checkout)"
    return f"{head} ({'dirty: uncommitted changes to tracked files' if dirty else 'clean'})"


def render(rows: list[TrialResult], args: argparse.Namespace, seconds: float, revision: str | None = None) -> str:
    """The Markdown report: method, command, the commit it ran on, counts per point, every
    trial, every violation."""
    cmd = f"make fault-campaign FAULT_TRIALS={args.trials} FAULT_SEED={args.seed}"
    n_bad = sum(1 for r in rows if r.result == "VIOLATION")
    lines = [
        "# Fault campaign (issues 15 and 28: faults, timelines, per-rank values)", "",
        f"Run on commit `{revision or source_revision()}`.", "",
        "Generated by `bench/fault_campaign.py --record`. Method: every trial runs the engine on 2-4",
        "simulated gloo nodes (one rank per node, each a process; two ranks per node in some",
        "`per-rank-values` trials) with the small FSDP2 model of",
        "`tests/scenarios.py`: 5 training steps, a local save (+ replicas) at every step and a",
        "persistent save at 2 of them, each waited for. One or two faults are injected at an",
        "instant drawn from the trial's seed (the k-th call of a wrapped engine function, or a",
        "byte offset of a step's DCP data) by monkeypatches inside the rank processes; then the",
        "job restarts with fresh processes and restores. The invariants are computed from the",
        "files on disk (manifests and markers read and every file re-hashed by the campaign,",
        "not by the restore planner); see `bench/campaign_checks.py` for their exact definitions:",
        "", "- **restored step**: the newest save (by `save_order`, not by step number) for which every",
        "  node has a committed, verified copy of its state on a surviving disk (own or a replica) or",
        "  in the persistent tier (not for a restore limited to in-cluster reads); a fresh start only",
        "  when no committed step exists, NoCheckpointError when steps exist but none is complete;",
        "- **bitwise**: every tensor equals the snapshot the trainer took before saving that step;",
        "- **no uncommitted step visible**: every step `tierckpt ls --json` reports committed is",
        "  complete on disk (manifest = the data files, every checksum matches); `tierckpt verify`",
        "  finds nothing corrupt;",
        "- **nothing committed lost**: per (saved node, step), the number of committed copies on",
        "  surviving disks (and the persistent step) does not drop between the snapshot before the",
        "  fault (or before the restart) and after the restore, except what retention may purge:",
        "  a copy with at least keep_latest_k committed steps of newer saves of the same node (tier);",
        "- **ledger**: parseable (a torn line only where one was injected, never swallowing the",
        "  next record), one failure record per injected storage fault (ENOSPC on a local or",
        "  persistent root; a skipped local save for a hung disk), one restore record per restore",
        "  whose step and per-node sources are the restore's and were on disk before it;",
        "- **redundancy after restore**: once a restore from node-local copies returned and the",
        "  job closed, every node's restored step has F copies on the nodes' disks again;",
        "- **one save**: every restore (each ledger `restore` record) combines copies of one save: the",
        "  copy each node was served from records the record's `save_id`; the restored step is the",
        "  newest (step, save) complete for every node with copies of that one save (by `save_order`),",
        "  its state bitwise equal to the snapshot of the run that wrote that save;",
        "- **every rank gets its own values** (`per-rank-values` trials: 1 or 2 ranks per node, the last",
        "  restore from what the fault left, from the persistent tier with every node-local root wiped,",
        "  or in-cluster): every rank's restored `per_rank` values (a tensor, an RNG state, a counter,",
        "  an object) equal its own saved ones bitwise; and from the files, each intact copy holds each",
        "  saving rank's own values, read back with stock DCP: a persistent step under every rank's",
        "  qualified key `__tierckpt_rank__/<rank>/per_rank.<k>` for each value that differs across",
        "  ranks (the plain key: rank 0's), a node-local copy of a one-rank node under the plain key, of",
        "  a two-rank node under each of its ranks' qualified keys; values equal on every rank never",
        "  written per rank;",
        "- **new timeline** (after a fallback or a rollback): one `rollback` record; every copy of the",
        "  abandoned timeline superseded; the run's last save is the newest complete save on disk",
        "  (retention never keeps a corrupt or abandoned step over it); `run_end.durable_step` is the",
        "  run's newest persistent step and exists;",
        "- **bounded**: no phase runs longer than 90 s (faulthandler dumps the stacks), a restore()",
        "  during a hung local write returns within local_wait_timeout_s + 30 s.",
        "", f"Command: `{cmd}` (base seed {args.seed}; trial i uses seed {args.seed} + i and fault point",
        f"`POINTS[i % {len(POINTS)}]`; replay one with `bench/fault_campaign.py --seed BASE --one i --keep`).",
        f"{len(rows)} trials in {seconds:.0f} s, {n_bad} with invariant violations.", "",
        "## Trials per fault point", "",
        "| fault point | what | trials | ok | violations | not reached |", "|---|---|---|---|---|---|",
    ]
    for p, c in counts_per_point(rows).items():
        lines.append(f"| {p} | {POINTS[p]} | {c['trials']} | {c['ok']} | {c['VIOLATION']} | {c['not reached']} |")
    lines += ["", "## Violations by invariant", ""]
    for kind, seeds in violations_by_kind(rows).items():
        lines.append(f"- {kind}: {len(seeds)} trials (seeds {', '.join(map(str, seeds))})")
    lines += ["", "## Violations", ""]
    bad = [r for r in rows if r.result == "VIOLATION"]
    if not bad:
        lines.append("None.")
    for r in bad:
        lines.append(f"- seed {r.seed} (trial {r.index}, {r.point}, {r.nodes} nodes): {r.faults}; instant: "
                     f"{r.instant}; restored {r.restored}, expected {r.expected}")
        for v in r.violations:
            lines.append(f"  - {_md(v)}")
    lines += ["", "## Every trial", "", "| seed | point | nodes | faults | instant | result | restored | expected |",
              "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.seed} | {r.point} | {r.nodes} | {_md(r.faults)} | {_md(r.instant)} | {r.result} | "
                     f"{_md(r.restored)} | {_md(r.expected)} |")
    return "\n".join(lines) + "\n"


def _md(s: str) -> str:
    return str(s).replace("|", "\\|").replace("\n", " ")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=300, help="number of trials (default 300)")
    ap.add_argument("--seed", type=int, default=0, help="base seed; trial i uses seed + i")
    ap.add_argument("--one", type=int, default=None, metavar="I", help="run only trial I (replay)")
    ap.add_argument("--points", default="", help="comma-separated fault points to run (others skipped)")
    ap.add_argument("--record", action="store_true", help="write bench/FAULTS.md")
    ap.add_argument("--keep", action="store_true", help="keep every trial's directory (default: violations only)")
    ap.add_argument("--workdir", default=None, help="where trial directories go (default: a temp dir)")
    ap.add_argument("--json", default=None, help="also write the rows as JSON to this file")
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if __name__ == "__main__":  # run through the importable module: the forkserver pickles by name
        from bench import fault_campaign as me
    else:
        me = sys.modules[__name__]
    indices = [args.one] if args.one is not None else list(range(args.trials))
    only = {p for p in args.points.split(",") if p}
    unknown = only - set(POINT_NAMES)
    if unknown:
        ap.error(f"unknown fault point(s) {sorted(unknown)}; allowed: {', '.join(POINT_NAMES)}")
    revision = source_revision()  # the code the trials run (before they start: a later edit does not count)
    root = args.workdir or tempfile.mkdtemp(prefix="tierckpt-campaign-")
    os.makedirs(root, exist_ok=True)
    rows: list[TrialResult] = []
    t0 = time.monotonic()
    for i in indices:
        plan = me.make_plan(args.seed, i)
        if only and plan.point not in only:
            continue
        wd = os.path.join(root, f"trial-{i:04d}-seed-{plan.seed}")
        shutil.rmtree(wd, ignore_errors=True)
        os.makedirs(wd)
        try:
            row = me.run_trial(plan, wd)
        except Exception:  # noqa: BLE001 - a driver crash is reported as the trial's violation
            row = TrialResult(plan.seed, i, plan.point, plan.nodes, plan.describe(), "-", "VIOLATION", "-", "-",
                              [f"campaign driver error: {traceback.format_exc()[-1500:]}"], 0.0, wd)
        rows.append(row)
        print(f"[{len(rows):3d}] seed {row.seed:5d} {row.point:26s} n={row.nodes} {row.result:11s} "
              f"restored {row.restored} (expected {row.expected}) {row.seconds:5.1f}s", flush=True)
        for v in row.violations:
            print(f"        ! {v[:600]}", flush=True)
        if row.result == "ok" and not args.keep:
            shutil.rmtree(wd, ignore_errors=True)
    seconds = time.monotonic() - t0
    print("\ntrials per fault point (trials / ok / violations / not reached):")
    for p, c in counts_per_point(rows).items():
        if c["trials"]:
            print(f"  {p:26s} {c['trials']:4d} {c['ok']:4d} {c['VIOLATION']:4d} {c['not reached']:4d}")
    for kind, seeds in violations_by_kind(rows).items():
        print(f"  violated '{kind}': {len(seeds)} trials, seeds {seeds}")
    n_bad = sum(1 for r in rows if r.result == "VIOLATION")
    n_unreached = sum(1 for r in rows if r.result == "not reached")
    print(f"{len(rows)} trials in {seconds:.0f}s: {n_bad} with violations, {n_unreached} not reached; "
          f"kept directories under {root}; commit {revision}")
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in rows], indent=1))
    if args.record:
        (REPO / "bench" / "FAULTS.md").write_text(render(rows, args, seconds, revision))
        print("wrote bench/FAULTS.md")
    return 1 if n_bad else 0


if __name__ == "__main__":
    sys.exit(main())
