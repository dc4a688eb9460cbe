"""ETTR and its waste, from a run's own step log: no engine estimate enters.

Definitions (one run of one system, all times UNIX seconds from the trainer's per-step JSONL,
``{"step", "time", "pid"}`` per logged step, in log order):

- ``t_ref``: the failure-free step time without checkpoint work. The bench passes each run's
  own quiet step time (:func:`quiet_step_s`: steps at least 3 past a save, in the same run),
  the reference run's median only when a run has too few such steps: on a shared machine
  the load moves between runs minutes apart, and a reference measured under another load
  would put that drift into the ETTR (or push it above 1);
- the run starts at ``t0`` = first logged step − ``t_ref`` and ends at its last logged step:
  wall time ``W``; the useful work is ``final_step × t_ref`` (every step of the final lineage,
  1 … the last step logged, once, at the failure-free speed);
- **ETTR** = ``final_step × t_ref / W`` (the effective training time ratio of ByteRobust and
  MoEvement: the share of wall time that ends up as training progress).

``W`` is partitioned exactly, gap by gap of the time-ordered log (:func:`account`):

- a gap between consecutive logged steps with no failure inside it is one step of work
  (``t_ref``) plus its excess ``gap − t_ref``: **blocking** when the step before it saved
  (its save ran in this gap: the trainer waits for staging; the save's first background work
  too), **restart** when the step is one of the first ``WARMUP_STEPS`` of a process started
  after a failure (warm-up after a restart is restart cost), *other* for the first process's
  warm-up, else **background slowdown** (a save's write, checksums and replication competing
  with training; on a shared machine also the step time's noise and load drift, signed);
- a gap that holds one or more failures (kill times ``k1 … kn``): ``k1 − previous step`` is
  **lost work** (the step in flight); ``kn − k1`` is **restart** (failures during a restart);
  ``next step − t_ref − kn`` is the downtime, split into **restore** (the restarted attempt's
  measured restore seconds, capped at the downtime) and **restart** (the rest: noticing the
  failure, stopping the survivors, starting the processes, imports, process group, model
  build); the step itself is one step of work;
- the work of steps logged more than once (re-run after a resume) is **lost work** too:
  ``(logged steps − final_step) × t_ref``.

``other`` is what remains (the first process's warm-up), so the buckets sum to ``W``.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping

WARMUP_STEPS = 3  # the first steps of a process: slow (eager kernels, allocator); bench_schedule's too
BUCKETS = ("blocking", "background", "lost", "restart", "restore", "other")


def account(recs: Iterable[Mapping], kills: Iterable[Mapping], save_steps: Iterable[int], t_ref: float,
            restore_s: Mapping[int, float] | None = None) -> dict:
    """ETTR and waste of one run (see the module docstring).

    Args:
        recs: step records ``{"step", "time", "pid"}`` (any order; sorted by time here).
        kills: failures ``{"time", "attempt"}``: the kill instant and the launcher attempt it
            struck (its restart is attempt + 1).
        save_steps: steps after which a save started (its cost sits in the next gap).
        t_ref: failure-free step seconds, > 0.
        restore_s: ``{attempt: restore seconds}`` of restarted attempts (None: none measured).

    Returns:
        ``{"wall_s", "useful_s", "ettr", "final_step", "logged_steps", "t0", "waste_s": {bucket:
        s}, "waste_frac": {bucket: share of W}, "restarts": [{"attempt", "downtime_s",
        "restore_s"}]}``; ``ettr`` is NaN for an empty log.

    Raises:
        ValueError: ``t_ref`` ≤ 0.
    """
    if not t_ref > 0:
        raise ValueError(f"t_ref must be > 0 seconds, got {t_ref!r}")
    times = sorted(recs, key=lambda r: r["time"])
    ks = sorted(kills, key=lambda k: k["time"])
    saves, restore_s = set(save_steps), dict(restore_s or {})
    w = dict.fromkeys(BUCKETS, 0.0)
    if not times:
        return {"wall_s": 0.0, "useful_s": 0.0, "ettr": float("nan"), "final_step": 0, "logged_steps": 0,
                "t0": None, "waste_s": w, "waste_frac": dict.fromkeys(BUCKETS, float("nan")), "restarts": []}
    t0 = times[0]["time"] - t_ref
    prev_t, ki, restarted = t0, 0, False
    seen: dict = {}  # pid -> steps logged
    fresh: set = set()  # pids started after a failure
    restarts = []
    for r in times:
        inside = []
        while ki < len(ks) and ks[ki]["time"] <= r["time"]:
            if ks[ki]["time"] > prev_t:
                inside.append(ks[ki])
            ki += 1
        n = seen[r.get("pid")] = seen.get(r.get("pid"), 0) + 1
        if inside:
            k1, kn = inside[0]["time"], inside[-1]["time"]
            down = max(0.0, r["time"] - t_ref - kn)
            att = inside[-1].get("attempt")
            rs = min(down, max(0.0, restore_s.get(att + 1, 0.0))) if isinstance(att, int) else 0.0
            w["lost"] += k1 - prev_t
            w["restart"] += (kn - k1) + down - rs
            w["restore"] += rs
            restarts.append({"attempt": att, "downtime_s": down, "restore_s": rs})
            fresh.add(r.get("pid"))
            restarted = True
        else:
            excess = r["time"] - prev_t - t_ref
            if n <= WARMUP_STEPS and r.get("pid") in fresh:
                w["restart"] += excess
            elif n <= WARMUP_STEPS and not restarted:
                w["other"] += excess
            elif r["step"] - 1 in saves:
                w["blocking"] += excess
            else:
                w["background"] += excess
        prev_t = r["time"]
    final_step = times[-1]["step"]
    w["lost"] += (len(times) - final_step) * t_ref
    wall = times[-1]["time"] - t0
    useful = final_step * t_ref
    w["other"] = wall - useful - sum(v for k, v in w.items() if k != "other")
    return {"wall_s": wall, "useful_s": useful, "ettr": useful / wall if wall > 0 else float("nan"),
            "final_step": final_step, "logged_steps": len(times), "t0": t0, "waste_s": w,
            "waste_frac": {k: (v / wall if wall > 0 else float("nan")) for k, v in w.items()},
            "restarts": restarts}


def quiet_step_s(recs: Iterable[Mapping], save_steps: Iterable[int], after: int = 3) -> float | None:
    """Mean gap between consecutive steps of one process at least ``after`` steps past the last
    save and past its warm-up (gaps over 2× their median dropped as outliers): the system's own
    step time without checkpoint work, against ``t_ref`` a measure of load drift. None with
    fewer than 5 such gaps."""
    by_pid: dict = {}
    for r in sorted(recs, key=lambda r: r["time"]):
        by_pid.setdefault(r.get("pid"), []).append(r)
    saves = sorted(set(save_steps))
    gaps = []
    for rs in by_pid.values():
        rs = rs[WARMUP_STEPS:]
        for a, b in zip(rs, rs[1:]):
            last = max((s for s in saves if s <= a["step"]), default=None)
            if b["step"] == a["step"] + 1 and (last is None or a["step"] - last >= after):
                gaps.append(b["time"] - a["time"])
    if len(gaps) < 5:
        return None
    med = statistics.median(gaps)
    kept = [g for g in gaps if g <= 2 * med]
    return statistics.fmean(kept)


def useful_curve(recs: Iterable[Mapping], t0: float) -> tuple[list[float], list[int]]:
    """(seconds since ``t0``, useful steps) after every logged step: the newest step of the
    lineage so far, which falls back after a resume (re-run steps are not progress twice)."""
    xs, ys = [0.0], [0]
    for r in sorted(recs, key=lambda r: r["time"]):
        xs.append(r["time"] - t0)
        ys.append(int(r["step"]))
    return xs, ys


def summarise_seeds(ettrs: list[float]) -> dict:
    """``{"mean", "min", "max", "n"}`` of the ETTRs of a system over seeds (NaNs left out)."""
    xs = [x for x in ettrs if x == x]
    if not xs:
        return {"mean": float("nan"), "min": float("nan"), "max": float("nan"), "n": 0}
    return {"mean": statistics.fmean(xs), "min": min(xs), "max": max(xs), "n": len(xs)}
