#!/usr/bin/env python
"""The main demo, second act: a node is lost for good and the job goes on with fewer nodes.

Run ``python launch/local_demo_elastic.py`` (or ``make demo-elastic``). torchtitan's llama3
debug model on 3 simulated nodes × 1 rank (FSDP2 over gloo, CPU; configs/titan_demo.toml,
``data_parallel_shard_degree = -1``), through the local launcher ``launch/local.py`` with
``min_nodes = 2`` (``TIERCKPT_MIN_NODES``). Local tier + replicas every ``--local-interval``
steps with ``replication_factor = 3`` (3 nodes tile only with J·F = 3), persistent tier every
``--persistent-interval`` steps:

1. **elastic run, attempt 1** (3 nodes): once the ledger shows local and persistent step
   ``--kill-after`` committed (and replicated) and a later step has run, node 2 is lost for
   good (``LocalLauncher.lose_node``: its training process SIGKILLed, its local root deleted);
2. **elastic run, attempt 2** (2 nodes): the launcher goes on with the survivors, with the
   parallel degrees and replication refitted to 2 nodes (``titan_plugin.elastic``: data
   parallel 2, ``replication_factor`` 3 → 2). The restore reads the 3-node step in-cluster —
   every rank's new FSDP shards from its own disk or from the other survivor, node 2's shards
   from the replicas it left — with no persistent byte; the dataloader is repositioned from 3
   data-parallel ranks to 2 (titan_plugin/dataloader.py); training runs to the end;
3. **reference**: a separate 2-node run that loads the same step from the persistent tier
   only (a copy of the persistent step, local tier off) and trains one step.

Both 2-node runs dump the state right after their restore (``tierckpt_dev.titan.probe``: one
``dcp.save`` of model, optimizer, lr scheduler and train state, i.e. the global values after
DCP's gather); the dumps must be bitwise equal to each other and to the persistent step
(every entry but the dataloader positions, which depend on the data-parallel layout). The loss of the first step after the restore must match the
reference's: the two runs have the same world size, state and batches, hence the same gloo
reduction order, so they are expected bitwise equal; the check allows a relative difference
of 1e-5 (about a hundred fp32 ulps), the order of what a different all-reduce summation order
could change, and the report says whether the losses were bitwise equal.

**With a spare** (``--spares 1``, ``make demo-spare``; output ``outputs/demo-spare``): the job
runs on 3 nodes plus an idle spare node agent. When node 2 is lost, the spare takes over its
node id at once (warm: its processes are forked, nothing imported), restores node 2's shards
from the replicas the other nodes hold (``peer-replica``, no persistent byte) and the job
goes on at 3 nodes: no reshard, the same parallelism. The reference is then a 3-node run
loading the persistent step, and every entry of the restored state must be bitwise equal to
it (the dataloader positions too) and to the persistent step.

``<out>/report.json`` (default ``outputs/demo-elastic``): ``nodes_before``, ``nodes_after``,
``persistent_bytes_read_on_restore`` (must be 0), ``restore_seconds``, ``restore_sources``,
``resharded``, ``first_step_loss`` (elastic and reference, bitwise flag, relative difference,
tolerance), ``state_after_restore`` (dump comparisons), ``dataloader``, ``recovery_phases``
(the ledger's ``recovery`` record of attempt 2 — cause ``lost-node``, every phase from the
launcher noticing the loss to the first step — with the lose → failure-noticed gap; not a
check) and ``ok``. Exit 1
unless all checks hold (2: the scenario could not run).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import time
from dataclasses import dataclass, field

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)
LAUNCH = os.path.join(REPO, "launch")
if LAUNCH not in sys.path:
    sys.path.insert(0, LAUNCH)

import local_demo as demo  # noqa: E402  (launch/local_demo.py: processes, files, comparisons)

DEFAULT_OUT = os.path.join(REPO, "outputs", "demo-elastic")
JOB_ID = "titan-demo-elastic"
OURS = {"elastic", "reference", "logs", "report.json", "report.json.tmp"}
LOSS_RTOL = 1e-5
NOT_COMPARED = ("dataloader",)  # positions per data-parallel layout (checked by the dataloader policy)


@dataclass
class ElasticParams:
    steps: int = 16
    kill_after: int = 10          # S: local + persistent step S committed, then node 2 is lost
    local_interval: int = 5
    persistent_interval: int = 10
    nodes: int = 3
    victim: int = 2
    spares: int = 0
    toml: str = demo.DEFAULT_TOML
    timeout: float = 600.0
    extra: list[str] = field(default_factory=list)

    def check(self) -> None:
        if self.nodes != 3 or self.victim not in range(3):
            raise ValueError("the elastic demo runs 3 simulated nodes and loses one of them (--victim 0..2)")
        if self.kill_after % self.local_interval or self.kill_after % self.persistent_interval:
            raise ValueError("--kill-after must be a local and a persistent step (a multiple of both intervals)")
        if not 0 < self.kill_after < self.steps:
            raise ValueError("need 0 < --kill-after < --steps")
        if self.spares not in (0, 1):
            raise ValueError("--spares must be 0 (go on with 2 nodes) or 1 (a spare takes over the lost node)")

    @property
    def nodes_after(self) -> int:
        return self.nodes if self.spares else self.nodes - 1


@dataclass
class Paths:
    out: str

    def __getattr__(self, name: str) -> str:
        if name in ("elastic", "reference", "logs"):
            return os.path.join(self.out, name)
        raise AttributeError(name)

    @property
    def nvme_template(self) -> str:  # the launcher's local_root: only {node}
        return os.path.join(self.elastic, "nvme", JOB_ID, "node-{node}")

    def ledger(self, dump: str) -> str:
        return os.path.join(dump, "checkpoint", "tierckpt-ledger.jsonl")

    def losses(self, dump: str) -> str:
        return os.path.join(dump, "metrics", "losses.jsonl")

    def dumps(self, dump: str) -> str:
        return os.path.join(dump, "restored-state")


def _train_args(p: ElasticParams, paths: Paths, dump: str, reference: bool) -> list[str]:
    args = ["--toml", p.toml, "--dump_folder", dump, "--checkpoint.enable", "true",
            "--checkpoint.last_save_model_only", "false", "--checkpoint.simulated_ranks_per_node", "1"]
    if reference:
        return args + ["--training.steps", str(p.kill_after + 1), "--checkpoint.job_id", JOB_ID + "-reference",
                       "--checkpoint.busy_tier_policy", "wait", "--checkpoint.local_interval", "0", "--checkpoint.interval", str(p.steps),
                       "--checkpoint.replication_factor", "1", *p.extra]
    return args + ["--training.steps", str(p.steps), "--checkpoint.job_id", JOB_ID,
                   "--checkpoint.local_root", os.path.join(paths.elastic, "nvme", "{job}", "node-{node}"),
                   "--checkpoint.busy_tier_policy", "wait", "--checkpoint.local_interval", str(p.local_interval),
                   "--checkpoint.interval", str(p.persistent_interval),
                   "--checkpoint.replication_factor", "3", *p.extra]


class _LoseNode:
    """Monitor of attempt 1: once local and persistent step S are committed (local replicated)
    and rank 0 logged a later step, lose node ``victim`` for good."""

    def __init__(self, p: ElasticParams, paths: Paths, con):
        self.p, self.paths, self.con = p, paths, con
        self.t_lost: float | None = None
        self.lost_at: int | None = None

    def __call__(self, launcher, attempt) -> None:
        p = self.p
        if attempt.index > 0:
            if self.t_lost is None:
                raise demo.DemoError("attempt 1 ended before the failure point\n"
                                     + launcher.failure_text(launcher.attempts[0]))
            return
        if self.t_lost is not None:
            return
        if time.time() - attempt.t_start > p.timeout:
            raise demo.DemoError(f"timed out after {p.timeout:.0f}s waiting for step {p.kill_after}")
        recs = demo._jsonl(self.paths.ledger(self.paths.elastic))
        done = {(r.get("tier"), r.get("step")): r for r in recs if r.get("kind") == "checkpoint"}
        loc, per = done.get(("local", p.kill_after)), done.get(("persistent", p.kill_after))
        if loc is None or per is None:
            return
        if not (loc.get("ok") and per.get("ok")) or loc.get("replicas_failed"):
            raise demo.DemoError(f"step {p.kill_after} did not commit cleanly: local {loc}, persistent {per}")
        steps = [r["step"] for r in demo._jsonl(self.paths.losses(self.paths.elastic))]
        if not steps or max(steps) <= p.kill_after:
            return
        self.t_lost, self.lost_at = time.time(), max(steps)
        launcher.lose_node(p.victim)
        demo._say(self.con, f"    [red]node {p.victim} lost for good[/] at step {self.lost_at} (SIGKILL, local root "
                            f"deleted); {self.t_lost - attempt.t_start:.1f} s after start")


def run_demo(out: str, params: ElasticParams | None = None, console=None) -> dict:
    """Run the elastic run and the reference in ``out`` (existing, empty) and write
    ``<out>/report.json``; returns the report (``report["ok"]`` is the verdict).

    Raises:
        DemoError: a run failed or timed out (every started process is killed first).
    """
    p = params or ElasticParams()
    p.check()
    paths = Paths(os.path.abspath(out))
    try:
        return _run(p, paths, console)
    finally:
        demo.kill_live_jobs()


def _launch(lo, p: ElasticParams, paths: Paths, name: str, nodes: int, train_args: list[str], dump: str, **kw):
    cmd = ["-m", "tierckpt_dev.titan.probe", "--dump-restored", paths.dumps(dump), *train_args]
    # the probe wraps titan_plugin.train: the agents import what a torchtitan run imports
    preload = [*lo.default_preload(["-m", "titan_plugin.train"]), "tierckpt_dev.titan.probe"]
    job = lo.LocalLauncher(cmd, nodes=nodes, log_dir=paths.logs, name=name, env=demo.RUN_ENV, preload=preload,
                           reconfigure=lo.titan_reconfigure(["-m", "titan_plugin.train", *train_args]), **kw)
    demo._LIVE.append(job)
    return job


def _run(p: ElasticParams, paths: Paths, con) -> dict:
    from tierckpt_dev.titan.assets import ensure_assets

    ensure_assets()
    lo = demo.local_launcher()
    # 1.+2. elastic run ----------------------------------------------------------------------------
    demo._say(con, f"[cyan]1/2[/] elastic run on {p.nodes} nodes" + (" + 1 spare" if p.spares else "")
              + f"; node {p.victim} is lost for good after step {p.kill_after}, the job goes on with "
              + (f"the spare in its place ({p.nodes} nodes) …" if p.spares else f"{p.nodes - 1} …"))
    job = _launch(lo, p, paths, "elastic", p.nodes, _train_args(p, paths, paths.elastic, False), paths.elastic,
                  max_attempts=2, min_nodes=p.nodes - 1, local_root=paths.nvme_template, spares=p.spares)
    mon = _LoseNode(p, paths, con)
    try:
        rc = job.run(timeout=2 * p.timeout, monitor=mon, log=lambda line: demo._say(con, f"    [dim]launcher: {line}[/]"))
    except lo.LaunchError as e:
        raise demo.DemoError(str(e)) from None
    if rc != 0 or len(job.attempts) != 2 or job.attempts[1].nodes != p.nodes_after:
        raise demo.DemoError(f"the elastic run did not finish on {p.nodes_after} nodes in attempt 2 (exit {rc})\n"
                             f"{job.failure_text()}")
    ledger = demo._jsonl(paths.ledger(paths.elastic))
    restore = next((r for r in reversed(ledger) if r.get("kind") == "restore"), None)
    if restore is None:
        raise demo.DemoError(f"attempt 2 recorded no restore in {paths.ledger(paths.elastic)}")
    rstep = int(restore["step"])
    # 3. reference -------------------------------------------------------------------------------
    demo._say(con, f"[cyan]2/2[/] reference: {p.nodes_after} nodes load step {rstep} from the persistent tier only "
                   "and train one step …")
    src = os.path.join(paths.elastic, "checkpoint", f"step-{rstep}")
    if not os.path.isdir(src):
        raise demo.DemoError(f"the restored step {rstep} has no persistent copy to start the reference from")
    shutil.copytree(src, os.path.join(paths.reference, "checkpoint", f"step-{rstep}"))
    ref_args = _train_args(p, paths, paths.reference, True)
    ref_args[ref_args.index("--training.steps") + 1] = str(rstep + 1)
    ref = _launch(lo, p, paths, "reference", p.nodes_after, ref_args, paths.reference, max_attempts=1)
    try:
        rrc = ref.run(timeout=p.timeout)
    except lo.LaunchError as e:
        raise demo.DemoError(str(e)) from None
    if rrc != 0:
        raise demo.DemoError(ref.failure_text())
    report = _report(p, paths, job, mon, restore, src)
    report["recovery_phases"] = demo.recovery_phases(ledger, mon.t_lost)  # the restart's timeline
    demo._write_json(os.path.join(paths.out, "report.json"), report)
    if con is not None:
        print_report(con, report)
    return report


def _first_loss(paths: Paths, dump: str, step: int, since: float = 0.0) -> float | None:
    recs = [r for r in demo._jsonl(paths.losses(dump)) if r["step"] == step and r["time"] >= since]
    return float.fromhex(recs[-1]["loss_hex"]) if recs else None


def _dataloader_line(logs: list[str]) -> str | None:
    """What the dataloader policy did on the restore (node 0's log of the attempt)."""
    for path in logs[:1]:
        try:
            with open(path, errors="replace") as f:
                for line in f:
                    if "dataloader positions:" in line:
                        return line.split("dataloader positions:", 1)[1].strip()
        except OSError:
            pass
    return None


def _report(p: ElasticParams, paths: Paths, job, mon: _LoseNode, restore: dict, persistent_step: str) -> dict:
    a1, a2 = job.attempts
    rstep = int(restore["step"])
    sources = {str(n): v["source"] for n, v in sorted(restore["sources"].items())}
    pbytes = int(restore.get("persistent_bytes", -1))
    el = _first_loss(paths, paths.elastic, rstep + 1, since=a2.t_start)
    rf = _first_loss(paths, paths.reference, rstep + 1)
    rel = abs(el - rf) / max(abs(rf), 1e-30) if el is not None and rf is not None else None
    e_dump = os.path.join(paths.dumps(paths.elastic), f"restart-{a2.restart_count}")
    r_dump = os.path.join(paths.dumps(paths.reference), "restart-0")
    states = {}
    for name, (a, b) in {"elastic_vs_reference": (e_dump, r_dump),
                         "elastic_vs_persistent_step": (e_dump, persistent_step)}.items():
        # with a spare the layout stays: the restored dataloader positions equal the reference's
        # (the persistent step keeps the plugin's per-layout table, which a dump does not)
        same = p.spares and name == "elastic_vs_reference"
        try:
            states[name] = demo.compare_final_states(a, b, exclude=() if same else NOT_COMPARED)
        except Exception as e:  # a missing dump: the check fails, the report says why
            states[name] = {"equal": False, "error": f"{type(e).__name__}: {e}"}
    first_after = min((r["time"] for r in demo._jsonl(paths.losses(paths.elastic)) if r["time"] >= a2.t_start),
                      default=None)
    report = {
        "nodes_before": a1.nodes, "nodes_after": a2.nodes, "lost_node": p.victim, "lost_at_step": mon.lost_at,
        "spares": p.spares, "replaced": {str(n): s for n, s in a2.replaced.items()}, "warm": a2.warm,
        "restored_step": rstep, "restore_sources": sources, "persistent_bytes_read_on_restore": pbytes,
        "restore_seconds": restore.get("seconds"), "resharded": restore.get("resharded"),
        "recovery_seconds": (first_after - mon.t_lost) if first_after and mon.t_lost else None,
        "reconfigured_args": a2.extra_args,
        "first_step_loss": {"step": rstep + 1, "elastic": el, "reference": rf,
                            "bitwise_equal": el is not None and rf is not None and el.hex() == rf.hex(),
                            "rel_diff": rel, "rtol": LOSS_RTOL,
                            "why_tolerance": "same world size, state and batches: the same gloo reduction order, so "
                                             "bitwise equality is expected; 1e-5 relative (about 100 fp32 ulps) only "
                                             "admits a different all-reduce summation order"},
        "state_after_restore": states,
        "dataloader": _dataloader_line(a2.logs),
    }
    if p.spares:  # the spare restores the lost node's shards from its peers' replicas, no reshard
        want = {str(n): "peer-replica" if n == p.victim else "own-local" for n in range(p.nodes)}
        served = sources == want and a2.replaced == {p.victim: p.nodes}
    else:
        served = set(sources.values()) == {"in-cluster"}
    report["ok"] = bool(a2.nodes == p.nodes_after and pbytes == 0 and served
                        and rel is not None and rel <= LOSS_RTOL and all(s.get("equal") for s in states.values()))
    return report


def print_report(con, r: dict) -> None:
    from rich.table import Table

    yes = lambda ok: "[green]yes[/]" if ok else "[red]NO[/]"  # noqa: E731
    t = Table(title="tierckpt elastic demo", show_header=False)
    spare = f", spare slot {r['replaced'][str(r['lost_node'])]} took over" if r.get("replaced") else ""
    t.add_row("nodes", f"{r['nodes_before']} → {r['nodes_after']} (node {r['lost_node']} lost for good at step "
                       f"{r['lost_at_step']}{spare}; processes warm: {r.get('warm')})")
    t.add_row("restored step", f"{r['restored_step']} from {sorted(set(r['restore_sources'].values()))}, "
                               f"resharded {r['resharded']}")
    t.add_row("persistent bytes read", f"{r['persistent_bytes_read_on_restore']} "
              + yes(r["persistent_bytes_read_on_restore"] == 0))
    rec = r["recovery_seconds"]
    t.add_row("restore / recovery", f"{r['restore_seconds']:.2f} s / " + (f"{rec:.1f} s" if rec else "—"))
    fl = r["first_step_loss"]
    t.add_row(f"loss of step {fl['step']}", f"elastic {fl['elastic']!r}, reference {fl['reference']!r}; bitwise "
              f"{yes(fl['bitwise_equal'])}, rel diff {fl['rel_diff']} ≤ {fl['rtol']}")
    for name, cmp in r["state_after_restore"].items():
        t.add_row(f"state after restore, {name}", yes(cmp.get("equal"))
                  + f" ({cmp.get('entries', '?')} entries{'; ' + str(cmp.get('differing') or cmp.get('error')) if not cmp.get('equal') else ''})")
    t.add_row("dataloader", str(r["dataloader"]))
    t.add_row("verdict", "[green]PASS[/]" if r["ok"] else "[red]FAIL[/]")
    con.print(t)
    demo.print_recovery(con, r.get("recovery_phases"))


def clear_out(out: str) -> None:
    """Delete and recreate ``out`` (refusing a directory with files this demo did not write)."""
    demo.clear_out(out, OURS)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                                 epilog="Other --section.key VALUE arguments are passed to every run.")
    d = ElasticParams()
    ap.add_argument("--out", default=DEFAULT_OUT, help="output directory (cleared at start)")
    ap.add_argument("--toml", default=d.toml, help="training config")
    ap.add_argument("--steps", type=int, default=d.steps, help="training.steps of the elastic run")
    ap.add_argument("--kill-after", type=int, default=d.kill_after, help="lose the node once this step is committed")
    ap.add_argument("--local-interval", type=int, default=d.local_interval, help="checkpoint.local_interval")
    ap.add_argument("--persistent-interval", type=int, default=d.persistent_interval, help="checkpoint.interval")
    ap.add_argument("--victim", type=int, default=d.victim, help="node lost for good (0..2)")
    ap.add_argument("--spares", type=int, default=d.spares,
                    help="1: a spare node takes over the lost node's id and the job stays at 3 nodes")
    ap.add_argument("--timeout", type=float, default=d.timeout, help="per attempt, seconds")
    args, extra = ap.parse_known_args(argv)
    if any(not a.startswith("--") for a in extra[:1]):
        ap.error(f"unrecognized arguments: {extra}")
    params = ElasticParams(steps=args.steps, kill_after=args.kill_after, local_interval=args.local_interval,
                           persistent_interval=args.persistent_interval, victim=args.victim, spares=args.spares,
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
    con.print(f"[bold]tierckpt elastic demo[/]: torchtitan llama3 debugmodel, {params.nodes} simulated nodes → "
              f"{params.nodes - 1}, {params.steps} steps; node {params.victim} lost for good after step {params.kill_after}")
    def on_term(signum, frame):  # make `kill <demo>` clean up its ranks too
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    try:
        report = run_demo(out, params, console=con)
    except demo.DemoError as e:
        from rich.markup import escape

        con.print("[red]demo failed:[/]\n" + escape(str(e)))
        return 2
    except KeyboardInterrupt:
        con.print("[red]interrupted[/]")
        return 130
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
