"""The campaign's tables, verdict, record entry and plot.

Rows: one per (MTBF, seed, system) with ETTR and the waste buckets as shares of the wall time
(:mod:`bench.goodput.accounting`); then per MTBF and system the mean, min and max ETTR over
seeds; then the verdict against issue 32's targets at each MTBF:

- ETTR of ``tierckpt-adaptive`` ≥ 1.15 × the best ``titan-stock-K`` (the K with the highest
  mean ETTR over seeds: torchtitan's stock checkpointing at its best interval);
- ≥ ``torchft`` (no number while the torchft row is not run: reported as not checked);
- on every seed ≥ 0.97 × the best ``tierckpt-fixed-K`` (the K with the highest mean ETTR),
  the same seed's run.
"""

from __future__ import annotations

import math
import os

from bench.goodput.accounting import BUCKETS, summarise_seeds

STOCK_FACTOR = 1.15
FIXED_TOLERANCE = 0.03


def _pct(x) -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.1f} %"


def _row_cells(r: dict) -> list[str]:
    if r.get("skipped"):
        return [r["system"], f"{r['mtbf_s']:g}", str(r["seed"]), "not run", "–", "–", "–", "–"] + ["–"] * len(BUCKETS) \
            + [r["skipped"]]
    ck = r.get("checkpoints") or {}
    drift = (f"{r['quiet_step_s'] / r['t_ref']:.2f}" if r.get("quiet_step_s") else "– (t_ref used)")
    note = "; ".join(filter(None, [
        f"checkpoints {'/'.join(f'{k} {v}' for k, v in ck.items())}" if ck else "",
        f"last τ {r['last_intervals']}" if r.get("last_intervals") else "",
        f"quiet step / t_ref {drift}",
        f"load {r['load_before']:.1f}→{r['load_after']:.1f}" if isinstance(r.get("load_before"), (int, float))
        and isinstance(r.get("load_after"), (int, float)) else "",
        "INVALID: " + ", ".join(r["bookkeeping"]) if r.get("bookkeeping") else ""]))
    return [r["system"], f"{r['mtbf_s']:g}", str(r["seed"]), "yes" if r.get("finished") else "cap",
            str(r["failures"]), str(r["final_step"]), f"{r['wall_s']:.0f}", f"**{r['ettr']:.3f}**"] + \
        [_pct(r["waste_frac"][b]) for b in BUCKETS] + [note]


def rows_table(rows: list[dict]) -> str:
    """Markdown: one line per (MTBF, seed, system)."""
    head = ["system", "MTBF s", "seed", "finished", "failures", "steps", "wall s", "ETTR"] + \
        [f"{b}" for b in BUCKETS] + ["notes"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(_row_cells(r)) + " |" for r in rows]
    return "\n".join(lines)


def per_system(rows: list[dict]) -> dict:
    """``{mtbf: {system: {"mean", "min", "max", "n", "by_seed": {seed: ettr}}}}`` of the runs that ran."""
    out: dict = {}
    for r in rows:
        if r.get("skipped") or r.get("bookkeeping"):
            continue
        cell = out.setdefault(r["mtbf_s"], {}).setdefault(r["system"], {"by_seed": {}})
        cell["by_seed"][r["seed"]] = r["ettr"]
    for systems in out.values():
        for s in systems.values():
            s.update(summarise_seeds(list(s["by_seed"].values())))
    return out


def _best(systems: dict, prefix: str) -> str | None:
    cands = {k: v["mean"] for k, v in systems.items() if k.startswith(prefix) and v["n"]}
    return max(cands, key=lambda k: cands[k]) if cands else None


def verdict(rows: list[dict]) -> dict:
    """``{mtbf: {"vs_stock": ratio, "best_stock", "stock_ok", "best_fixed", "vs_fixed_min": the
    worst seed's adaptive / best-fixed ratio, "fixed_ok", "torchft": text}}``; None where a side
    is missing."""
    out = {}
    for mtbf, systems in per_system(rows).items():
        ad = systems.get("tierckpt-adaptive")
        bs_, bf = _best(systems, "titan-stock-"), _best(systems, "tierckpt-fixed-")
        v: dict = {"best_stock": bs_, "best_fixed": bf, "vs_stock": None, "stock_ok": None, "vs_fixed_min": None,
                   "fixed_ok": None, "torchft": "not checked: the torchft row did not run"}
        if ad and bs_:
            v["vs_stock"] = ad["mean"] / systems[bs_]["mean"]
            v["stock_ok"] = v["vs_stock"] >= STOCK_FACTOR
        if ad and bf:
            ratios = [ad["by_seed"][s] / e for s, e in systems[bf]["by_seed"].items() if s in ad["by_seed"]]
            if ratios:
                v["vs_fixed_min"] = min(ratios)
                v["fixed_ok"] = v["vs_fixed_min"] >= 1 - FIXED_TOLERANCE
        if "torchft" in systems and ad:
            v["torchft"] = ad["mean"] >= systems["torchft"]["mean"]
        out[mtbf] = v
    return out


def _ok(x) -> str:
    return "n/a" if x is None else "PASS" if x else "FAIL"


def summary_table(rows: list[dict]) -> str:
    """Markdown: mean (min – max) ETTR per MTBF and system, and the verdict lines."""
    ps, ver = per_system(rows), verdict(rows)
    lines = ["| MTBF s | system | seeds | ETTR mean | min – max |", "|---|---|---|---|---|"]
    for mtbf, systems in ps.items():
        for name, s in sorted(systems.items(), key=lambda kv: -kv[1]["mean"]):
            lines.append(f"| {mtbf:g} | {name} | {s['n']} | {s['mean']:.3f} | {s['min']:.3f} – {s['max']:.3f} |")
    lines.append("")
    for mtbf, v in ver.items():
        vs = "–" if v["vs_stock"] is None else f"{v['vs_stock']:.2f}×"
        vf = "–" if v["vs_fixed_min"] is None else f"{v['vs_fixed_min']:.3f}"
        lines.append(f"- MTBF {mtbf:g} s: adaptive ÷ best stock ({v['best_stock']}) = {vs} (target ≥ "
                     f"{STOCK_FACTOR}): {_ok(v['stock_ok'])}; adaptive ÷ best fixed ({v['best_fixed']}), worst "
                     f"seed = {vf} (target ≥ {1 - FIXED_TOLERANCE:.2f}): {_ok(v['fixed_ok'])}; "
                     f"adaptive ≥ torchft: {v['torchft'] if isinstance(v['torchft'], str) else _ok(v['torchft'])}")
    return "\n".join(lines)


def plot(rows: list[dict], path: str) -> str:
    """PNG of useful steps against wall time, one panel per (MTBF, seed), one line per system;
    failure instants as ticks. Returns ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ran = [r for r in rows if not r.get("skipped")]
    cells = sorted({(r["mtbf_s"], r["seed"]) for r in ran})
    if not cells:
        raise ValueError("nothing to plot: no system ran")
    mtbfs = sorted({c[0] for c in cells})
    seeds = sorted({c[1] for c in cells})
    fig, axes = plt.subplots(len(mtbfs), len(seeds), figsize=(4.5 * len(seeds), 3.4 * len(mtbfs)), squeeze=False)
    for r in ran:
        ax = axes[mtbfs.index(r["mtbf_s"])][seeds.index(r["seed"])]
        ax.step(r["curve"]["t"], r["curve"]["steps"], where="post", label=f"{r['system']} ({r['ettr']:.2f})",
                lw=1.2)
        ax.set_title(f"MTBF {r['mtbf_s']:g} s, seed {r['seed']}", fontsize=9)
        ax.set_xlabel("wall time, s")
        ax.set_ylabel("useful steps")
    for row in axes:
        for ax in row:
            if ax.lines:
                ax.legend(fontsize=6, title="system (ETTR)", title_fontsize=6)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def record_entry(title: str, cmd: str, setup: str, rows: list[dict], png_rel: str | None) -> str:
    """The markdown entry ``--record`` appends: heading, command, setup, summary, all rows, plot."""
    parts = [f"\n### {title}\n", f"Command: `{cmd}`\n", setup + "\n", summary_table(rows) + "\n",
             rows_table(rows) + "\n"]
    if png_rel:
        parts.append(f"![useful steps against wall time]({png_rel})\n")
    return "\n".join(parts)
