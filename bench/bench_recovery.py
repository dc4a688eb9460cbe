"""What a lost node costs, kill → next training step, with and without warm node agents.

``make bench-recovery`` runs the torchtitan demo's failure scenario (``launch/local_demo.py``:
llama3 debug model, 2 CPU ranks = 2 simulated nodes, local tier + replica every 5 steps,
persistent every 15; node 1 SIGKILLed and its disk deleted once local step 15 is committed)
once per mode, in the same session, each with its own reference run (every loss after the
resume must be bitwise equal to it):

- ``cold``: ``launch/local.py --cold`` — a torchrun per node and attempt, every rank a new
  interpreter importing torch and torchtitan (the baseline: what the launcher did before);
- ``warm``: the default — one node agent per node imports them once and forks each attempt's
  ranks;
- ``warm-stop`` (``--with-stop``): the node is frozen (SIGSTOP of its agent and rank) instead of
  killed; found by the launcher's hang detection (``--hang-timeout``, 10 s by default) and
  replaced by a spare node that restores from the replica.

For each it reports the recovery (the demo's kill → the first logged step after the resume),
the ``recovery`` ledger record's phases (failure noticed … first step done), the restore, the
first step after the restore against the attempt's steady step, and the warm ÷ cold ratios of
the whole recovery and of its start-up part (failure noticed → restore started). Targets (issue
31): warm kill → first step ≤ 4 s; a frozen node replaced ≤ 30 s after the freeze.

Usage::

    .venv/bin/python bench/bench_recovery.py [--repeats 1] [--with-stop] [--out DIR] [--record]

``--record`` appends the table to bench/history/<YYYY-MM>.md. Exit status 1 when a run failed
its demo checks or a target was missed.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for p in (REPO, os.path.join(REPO, "launch")):
    if p not in sys.path:
        sys.path.insert(0, p)

import local_demo as demo  # noqa: E402  (launch/local_demo.py)

HISTORY_MD = os.path.join(REPO, "bench", "history", time.strftime("%Y-%m", time.gmtime()) + ".md")
MODES: dict[str, dict[str, Any]] = {"cold": {"cold": True}, "warm": {}, "warm-stop": {"fault": "stop"}}
WARM_TARGET_S = 4.0   # issue 31: make demo, kill → first step completed
STOP_TARGET_S = 30.0  # issue 31: a SIGSTOPped node is replaced within 30 s by default
PHASES = ("survivors_stopped", "launched", "processes_started", "imports_done", "process_group_up", "model_built",
          "restore_done", "first_step_done")


def summarise_run(mode: str, report: dict) -> dict:
    """One demo report as a row: recovery, phases (s since failure noticed), the kill →
    noticed gap, restore, first and steady step, ok."""
    ph = report.get("recovery_phases") or {}
    phases_s = ph.get("phases_s") or {}
    gap = ph.get("kill_to_failure_noticed_s")
    restore_started = None
    if phases_s.get("restore_done") is not None and report.get("restore_seconds") is not None:
        restore_started = phases_s["restore_done"] - report["restore_seconds"]
    return {"mode": mode, "ok": bool(report.get("ok")), "recovery_s": report.get("recovery_seconds"),
            "kill_to_noticed_s": gap, "phases_s": {k: phases_s.get(k) for k in PHASES},
            "startup_s": restore_started, "restore_s": report.get("restore_seconds"),
            "first_step_s": report.get("first_step_after_restore_s"), "steady_step_s": report.get("steady_step_s"),
            "warm": report.get("warm"), "replaced": report.get("replaced") or {},
            "sources": report.get("restore_source"), "persistent_bytes": report.get("persistent_bytes_read_on_restore")}


def _median(rows: list[dict], key: str) -> float | None:
    vals = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def summarise(rows: list[dict]) -> dict:
    """Medians per mode, the warm ÷ cold ratios and the verdict.

    Returns ``{"modes": {mode: {recovery_s, startup_s, restore_s, first_step_s, steady_step_s,
    runs, ok}}, "ratios": {recovery, startup}, "targets": {...}, "ok": bool}``; a ratio is None
    when a mode is missing.
    """
    modes: dict[str, dict] = {}
    for mode in MODES:
        mine = [r for r in rows if r["mode"] == mode]
        if mine:
            modes[mode] = {k: _median(mine, k) for k in ("recovery_s", "startup_s", "restore_s", "first_step_s",
                                                        "steady_step_s")}
            modes[mode].update(runs=len(mine), ok=all(r["ok"] for r in mine))

    def ratio(key: str) -> float | None:
        w, c = modes.get("warm", {}).get(key), modes.get("cold", {}).get(key)
        return None if w is None or not c else w / c

    targets = {"warm_recovery_le_4s": None, "stop_replaced_le_30s": None}
    if modes.get("warm", {}).get("recovery_s") is not None:
        targets["warm_recovery_le_4s"] = modes["warm"]["recovery_s"] <= WARM_TARGET_S
    if modes.get("warm-stop", {}).get("recovery_s") is not None:
        targets["stop_replaced_le_30s"] = modes["warm-stop"]["recovery_s"] <= STOP_TARGET_S
    ok = all(m["ok"] for m in modes.values()) and all(v is not False for v in targets.values())
    return {"modes": modes, "ratios": {"recovery": ratio("recovery_s"), "startup": ratio("startup_s")},
            "targets": targets, "ok": ok}


def _f(x, fmt: str = "{:.2f}") -> str:
    return "—" if x is None else fmt.format(x)


def render(rows: list[dict], summary: dict) -> str:
    """The markdown tables: one row per run with its phases, then medians and ratios."""
    head = ("| mode | ok | kill → first step (s) | kill → noticed | " + " | ".join(p.replace("_", " ") for p in PHASES)
            + " | restore (s) | first step / steady (s) |")
    lines = [head, "|" + "---|" * (6 + len(PHASES))]
    for r in rows:
        lines.append(f"| {r['mode']} | {'yes' if r['ok'] else 'NO'} | {_f(r['recovery_s'])} | "
                     f"{_f(r['kill_to_noticed_s'])} | " + " | ".join(_f(r['phases_s'].get(p)) for p in PHASES)
                     + f" | {_f(r['restore_s'])} | {_f(r['first_step_s'])} / {_f(r['steady_step_s'])} |")
    lines += ["", "| mode | runs | recovery (s) | start-up: noticed → restore (s) | restore (s) | first / steady step (s) |",
              "|---|---|---|---|---|---|"]
    for mode, m in summary["modes"].items():
        lines.append(f"| {mode} | {m['runs']} | {_f(m['recovery_s'])} | {_f(m['startup_s'])} | {_f(m['restore_s'])} | "
                     f"{_f(m['first_step_s'])} / {_f(m['steady_step_s'])} |")
    ra, t = summary["ratios"], summary["targets"]
    lines += ["", f"warm ÷ cold: recovery {_f(ra['recovery'])}, start-up {_f(ra['startup'])}. "
              f"Targets: warm kill → first step ≤ {WARM_TARGET_S:.0f} s: {t['warm_recovery_le_4s']}; "
              f"frozen node replaced ≤ {STOP_TARGET_S:.0f} s: {t['stop_replaced_le_30s']}. "
              f"Verdict: {'PASS' if summary['ok'] else 'FAIL'}."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=1, help="runs per mode (alternating cold, warm, …)")
    ap.add_argument("--with-stop", action="store_true", help="also freeze a node (SIGSTOP) with a spare (warm-stop)")
    ap.add_argument("--out", default=os.path.join(REPO, "outputs", "bench-recovery"), help="output directory")
    ap.add_argument("--record", action="store_true", help="append the tables to bench/history/<YYYY-MM>.md")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    modes = ["cold", "warm"] + (["warm-stop"] if args.with_stop else [])
    os.makedirs(args.out, exist_ok=True)
    rows: list[dict] = []
    t0 = time.time()
    for k in range(args.repeats):
        for mode in (modes if k % 2 == 0 else modes[::-1]):  # ABBA: load drift does not favour one mode
            out = os.path.join(args.out, f"{mode}-{k}")
            demo.clear_out(out)
            print(f"[bench-recovery] {mode} run {k + 1}/{args.repeats} → {out}", flush=True)
            try:
                report = demo.run_demo(out, demo.DemoParams(**MODES[mode]))
            except demo.DemoError as e:
                print(f"[bench-recovery] {mode}: the demo could not run: {e}", file=sys.stderr)
                report = {"ok": False}
            rows.append(summarise_run(mode, report))
    summary = summarise(rows)
    text = render(rows, summary)
    print(text)
    with open(os.path.join(args.out, "report.json"), "w") as f:
        json.dump({"rows": rows, "summary": summary}, f, indent=1)
    if args.record:
        cmd = "python bench/bench_recovery.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
        with open(HISTORY_MD, "a") as f:
            f.write(f"\n### Recovery, kill → next step, warm vs cold (`make bench-recovery`), "
                    f"{time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC\n\n`{cmd.strip()}` "
                    f"({time.time() - t0:.0f} s)\n\n{text}\n")
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
