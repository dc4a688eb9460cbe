"""Where the CPU time of one tierckpt save goes, thread by thread and machine-wide.

Measurement 4 of ``make bench-peers`` shows that on a CPU-bound trainer a save costs far more
training time than its blocking δ: the background work (DCP serialisation, xxh3 checksums,
writes and fsyncs, the replica's send, receive and write) runs on the step's cores. This probe
counts that work in CPU seconds on an otherwise idle machine: 2 gloo ranks as 2 nodes, bench
peers' state (``--mib`` MiB per rank), ``--saves`` saves per variant after 2 warm-ups, each
waited for until its handle resolves (replica committed). Per save it reads

- each rank's process from ``/proc/self/stat`` and its threads from ``/proc/self/task/*/stat``
  (user + system, by Python thread name; threads Python does not know by their kernel
  ``comm``; threads that started and ended inside the save as one remainder line);
- the machine's ``/proc/stat`` (user, system, softirq, iowait), whose remainder over both
  ranks' processes is kernel work (page-cache writeback, loopback networking) and anything
  else that ran.

Variants (``--variants``): ``replica`` (local tier + replica on the other node, the bench-peers
configuration), ``local`` (replication_factor 1: no send or receive), ``shm`` (the replica
configuration with the local root on ``/dev/shm``: no disk writeback).

    .venv/bin/python bench/probe_save_cpu.py --mib 256 --saves 4
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_engine import run_ranks  # noqa: E402
from peers_common import make_state, med, mutate  # noqa: E402

VARIANTS = ("replica", "local", "shm")
TICK = os.sysconf("SC_CLK_TCK")


def _threads() -> dict[str, float]:
    """CPU seconds (user + system) of this process's threads, by name."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[str, float] = defaultdict(float)
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
            with open(f"/proc/self/task/{tid}/comm") as f:
                comm = f.read().strip()
        except FileNotFoundError:  # the thread ended between listdir and open
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        cpu = (int(fields[11]) + int(fields[12])) / TICK
        name = names.get(int(tid), f"[{comm}]")
        out[name.rstrip("0123456789_-")] += cpu  # pool workers together
    return out


def _process() -> float:
    """CPU seconds (user + system) of this process, threads that have ended included."""
    with open("/proc/self/stat") as f:
        stat = f.read()
    fields = stat[stat.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def _machine() -> dict[str, float]:
    """Machine-wide CPU seconds from /proc/stat's first line, by kind."""
    with open("/proc/stat") as f:
        v = [int(x) / TICK for x in f.readline().split()[1:]]
    return {"user": v[0] + v[1], "system": v[2], "irq+softirq": v[5] + v[6], "iowait": v[4], "steal": v[7]}


def rank_main(rank: int, world: int, args: dict) -> dict:
    """One rank of a variant: 2 warm-up saves, then ``args["saves"]`` measured ones, each waited
    for until its handle resolved. Returns ``{"samples": [{"wall": s, "threads": {name: CPU s},
    "machine": {kind: CPU s}}]}`` (seconds)."""
    import torch.distributed as dist

    from tierckpt.config import TierConfig
    from tierckpt.engine import TieredCheckpointer

    v = args["variant"]
    base = args["shm"] if v == "shm" else args["base"]
    cfg = TierConfig(local_root=os.path.join(base, v, "node-{node}"),
                     persistent_root=os.path.join(args["base"], v + "-ledger"),
                     tiers=("local",), replication_factor=1 if v == "local" else 2, job_id="probe-cpu")
    eng = TieredCheckpointer(cfg, node_id=rank)
    sd = make_state(rank, args["mib"])
    samples = []
    for i in range(args["saves"] + 2):
        mutate(sd, i)
        dist.barrier()
        m0, p0, t0, w0 = _machine(), _process(), _threads(), time.perf_counter()
        h = eng.save(i, sd, tiers=["local"])
        h.wait()
        dist.barrier()
        wall = time.perf_counter() - w0
        m1, p1, t1 = _machine(), _process(), _threads()
        if i >= 2:
            threads = {k: t1[k] - t0.get(k, 0.0) for k in t1}
            # threads started and ended within the save (replication's sender) are only in the
            # process total
            threads["(threads ended during the save)"] = max(0.0, (p1 - p0) - sum(threads.values()))
            samples.append({"wall": wall, "process": p1 - p0, "threads": threads,
                            "machine": {k: m1[k] - m0[k] for k in m1}})
    eng.close()
    return {"samples": samples}


def main(argv=None) -> int:
    """Parse the options (bad ``--variants``, ``--mib`` or ``--saves``: exit 2 naming the option),
    run each variant on 2 spawned gloo ranks, print medians per save; 0 on success."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=float, default=256, help="MiB of state per rank (default 256)")
    ap.add_argument("--saves", type=int, default=4, help="measured saves per variant (default 4)")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help=f"comma-separated, of {', '.join(VARIANTS)} (default all)")
    ap.add_argument("--json", help="write the raw samples here")
    a = ap.parse_args(argv)
    variants = [x for x in a.variants.split(",") if x]
    bad = [x for x in variants if x not in VARIANTS]
    if bad or not variants:
        ap.error(f"--variants: unknown {bad or 'empty'}; allowed: {', '.join(VARIANTS)}")
    if a.mib <= 0 or a.saves <= 0:
        ap.error("--mib and --saves must be positive")
    out = {}
    with tempfile.TemporaryDirectory(prefix="probe-cpu-") as base, \
            tempfile.TemporaryDirectory(prefix="probe-cpu-", dir="/dev/shm") as shm:
        for v in variants:
            res = run_ranks({"variant": v, "base": base, "shm": shm, "mib": a.mib, "saves": a.saves, "threads": 1},
                            target=rank_main)
            out[v] = res
            per = []
            for j in range(a.saves):
                r0, r1 = res[0]["samples"][j], res[1]["samples"][j]
                procs = [r["process"] for r in (r0, r1)]
                mach = r0["machine"]
                per.append({"wall": max(r0["wall"], r1["wall"]), "procs": procs, "machine": sum(mach.values()) -
                            mach["iowait"] - mach["steal"], "kinds": mach,
                            "threads": {k: [r0["threads"].get(k, 0.0), r1["threads"].get(k, 0.0)]
                                        for k in sorted(set(r0["threads"]) | set(r1["threads"]))}})
            print(f"\n== {v}: {a.mib:g} MiB per rank, {a.saves} saves (medians, CPU seconds per save)")
            print(f"wall until the handle resolved (slower rank): {med([p['wall'] for p in per]):.3f} s")
            busy = med([p["machine"] for p in per])
            procs = med([sum(p["procs"]) for p in per])
            print(f"machine CPU (user+system+irq, both ranks + kernel): {busy:.3f} s; ranks' processes "
                  f"{procs:.3f} s; rest (kernel threads, other) {busy - procs:.3f} s")
            kinds = {k: med([p["kinds"][k] for p in per]) for k in per[0]["kinds"]}
            print("  machine by kind: " + ", ".join(f"{k} {x:.3f}" for k, x in kinds.items()))
            names = sorted({k for p in per for k in p["threads"]})
            for k in names:
                r = [med([p["threads"].get(k, [0.0, 0.0])[i] for p in per]) for i in (0, 1)]
                if max(r) >= 0.005:
                    print(f"  {k:40s} rank 0 {r[0]:.3f}  rank 1 {r[1]:.3f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
