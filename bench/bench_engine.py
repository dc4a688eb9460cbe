"""Engine benchmark: tierckpt against plain baselines, all measured in one run.

Two gloo ranks act as two simulated nodes (node_id = rank, replication_factor=2); each holds a
state of ``--gib-per-rank`` GiB (a dict of ``--tensors`` fp32 tensors). Measured, as ratios
against baselines taken in the same run on the same machine (absolute numbers on this shared
machine are noisy; ratios are what we compare):

1. blocking time δ of ``TieredCheckpointer.save(step, sd, tiers=["local"])`` in steady state
   (after warm-up saves have allocated both staging buffer sets) vs one ``dst.copy_(src)`` of
   the same bytes into preallocated tensors.                           target δ/memcpy ≤ 1.5
2. local-tier write throughput: ``LocalTier.save`` (DCP write + fsync + checksum + commit) of
   the staged dict vs a plain sequential write+fsync of the same tensor bytes to a file on
   the same filesystem, order ABBA-alternated.                          target ours/plain ≥ 0.8
3. replication throughput: ``tierckpt.tiers.replication.replicate`` of a committed step, both ranks
   sending to each other at once (F=2), vs raw gloo isend/irecv of the same bytes in the same
   pattern and chunk size (``transfer_chunk_bytes``), ABBA-alternated. target ours/raw ≥ 0.7

Both ranks run every measurement at the same time (barrier before each), as two nodes would;
a measurement's time is the slower rank's (the step is done when the last node is), and the
reported value is the median over repetitions. Time spent inside the engine is split into
phases by wrapping functions at run time (this file only; tierckpt/ is untouched).

Usage::

    .venv/bin/python bench/bench_engine.py [--gib-per-rank 1.0] [--dir /tmp] [--local-root-base /dev/shm] [--record]

``--local-root-base /dev/shm`` puts the local roots (and the plain-write baseline, so the ratio
stays on one filesystem) in host memory (tmpfs); the persistent root stays under ``--dir``.

``--record`` appends the results (machine, exact command, tables) to bench/history/<YYYY-MM>.md.
Everything written under the temp dir is removed at the end (``--keep`` keeps it).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import multiprocessing as mp
import os
import platform
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import types
from collections import defaultdict

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)



def history_md(when: float | None = None) -> str:
    """The dated notebook a ``--record`` appends to: ``bench/history/<YYYY-MM>.md`` of the run's
    UTC month. ``bench/RESULTS.md`` holds the current standing, updated by hand from these
    entries (one table per benchmark and the command that produced it)."""
    return os.path.join(REPO, "bench", "history", time.strftime("%Y-%m", time.gmtime(when)) + ".md")


RESULTS_MD = history_md()  # the name the other bench scripts (and tests) import and patch
TARGETS = {"delta": 1.5, "local": 0.8, "repl": 0.7}
GiB = 1 << 30


# ---------------------------------------------------------------------------------------------
# phase profiler (wraps functions by name; thread-safe accumulation)
class Prof:
    def __init__(self):
        self._lock = threading.Lock()
        self.t: dict[str, float] = defaultdict(float)
        self.n: dict[str, int] = defaultdict(int)

    def wrap(self, name, fn):
        @functools.wraps(fn)
        def w(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                dt = time.perf_counter() - t0
                with self._lock:
                    self.t[name] += dt
                    self.n[name] += 1
        return w

    def reset(self):
        with self._lock:
            self.t.clear()
            self.n.clear()

    def snap(self) -> dict[str, float]:
        with self._lock:
            return dict(self.t)


PROF = Prof()


def install_probes():
    """Wrap the engine's and DCP's phase functions (in this process only) with timers."""
    import torch.distributed.checkpoint as dcp
    import torch.distributed.checkpoint.filesystem as dcp_fs

    from tierckpt.tiers import commit, local_tier, replication
    from tierckpt.transport import transfer
    from tierckpt.io import manifest
    from tierckpt.io.storage import Store

    # local tier: DCP save (whole), inside it the per-item serialisation (torch.save into the
    # file stream) and every fsync; then checksums, fsync_tree, manifest+marker commit.
    proxy = types.SimpleNamespace(**{k: getattr(dcp, k) for k in dir(dcp) if not k.startswith("__")})
    proxy.save = PROF.wrap("dcp.save (total)", dcp.save)
    local_tier.dcp = proxy
    dcp_fs._write_item = PROF.wrap("dcp: torch.save of items", dcp_fs._write_item)
    os.fsync = PROF.wrap("os.fsync (all callers)", os.fsync)
    commit.hash_split = PROF.wrap("checksum (read+xxh3)", commit.hash_split)
    Store.fsync_tree = PROF.wrap("Store.fsync_tree", Store.fsync_tree)
    manifest.commit = PROF.wrap("manifest.commit", manifest.commit)
    # replication: the transfer (send thread ∥ receive loop) and the commit of received files
    replication.run_transfers = PROF.wrap("run_transfers (total)", replication.run_transfers)
    transfer.send_step = PROF.wrap("send_step (sender thread)", transfer.send_step)
    transfer.recv_step = PROF.wrap("recv_step (receive loop)", transfer.recv_step)
    replication.commit_received = PROF.wrap("commit_received", replication.commit_received)


# ---------------------------------------------------------------------------------------------
# rank side
def _entry(rank, world, port, args, q, target=None):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    import logging

    logging.basicConfig(level=logging.WARNING, format=f"[rank{rank}] %(levelname)s %(name)s: %(message)s")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(args["threads"])
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        q.put((rank, (target or rank_main)(rank, world, args), None))
    except BaseException:
        q.put((rank, None, traceback.format_exc()))
        raise SystemExit(1)
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def log0(rank, msg):
    if rank == 0:
        print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def rank_main(rank: int, world: int, args: dict) -> dict:
    import warnings

    import torch
    import torch.distributed as dist

    from tierckpt.cluster.collectives import all_gather
    from tierckpt.config import TierConfig
    from tierckpt.engine import TieredCheckpointer
    from tierckpt.tiers.replication import replicate

    warnings.filterwarnings("ignore", message=".*Detected an existing checkpoint.*")
    install_probes()
    base = args["base"]
    out: dict = {"rank": rank}

    def gather_max(x: float) -> float:
        return max(all_gather(x, dist.group.WORLD))

    def gather_list(x):
        return all_gather(x, dist.group.WORLD)

    # -- state ----------------------------------------------------------------------------
    n_t = args["tensors"]
    total = int(args["gib_per_rank"] * GiB)
    per = (total // n_t) // 4  # fp32 elements per tensor
    gen = torch.Generator().manual_seed(1234 + rank)
    sd = {f"layer{i}.weight": torch.randn(per, generator=gen, dtype=torch.float32) for i in range(n_t)}
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    out["state_bytes"] = nbytes
    log0(rank, f"state: {n_t} fp32 tensors, {nbytes / GiB:.3f} GiB per rank")

    # -- 1. blocking time δ vs memcpy ------------------------------------------------------
    dst = {k: torch.empty_like(v) for k, v in sd.items()}

    def memcpy_once() -> float:
        dist.barrier()
        t0 = time.perf_counter()
        for k, v in sd.items():
            dst[k].copy_(v)
        return gather_max(time.perf_counter() - t0)

    memcpy_once()  # fault in dst
    cfg = TierConfig(
        local_root=os.path.join(args["local_base"], "nvme", "node-{node}"), persistent_root=os.path.join(base, "pfs"),
        tiers=("local",), replication_factor=2, job_id="bench",
        transfer_chunk_bytes=args["chunk_bytes"] or TierConfig.transfer_chunk_bytes,
    )
    eng = TieredCheckpointer(cfg, node_id=rank)
    local = eng.local
    assert local is not None, "the benchmark's config has the local tier"
    chunk = eng.cfg.transfer_chunk_bytes
    out["chunk_bytes"] = chunk
    out["staging_buffers"] = eng.cfg.staging_buffers
    step = 0
    warm = []
    for _ in range(eng.cfg.staging_buffers):  # allocate every staging buffer set
        dist.barrier()
        warm.append(gather_max(eng.save(step, sd, tiers=["local"]).blocking_s))
        eng.wait()
        step += 1
    out["warmup_delta_s"] = warm
    log0(rank, f"warm-up saves (first use of each staging buffer set): δ = {', '.join(f'{d:.3f}s' for d in warm)}")
    def settle():
        os.sync()  # let the kernel finish writeback/discard of the previous phase first
        dist.barrier()

    # memcpy and save alternate (M S M S … M), each started on a quiet machine (background
    # work finished, page cache written back); medians over all samples. The first operation
    # after a background job tends to run slow on this VM (kernel work left over from the
    # job's writes and deletions), so an unrecorded memcpy goes first: both recorded
    # operations then follow a memcpy.
    deltas, memcpys, save_walls, bg_s, bg_prof = [], [], [], [], []
    settle()
    for i in range(args["saves"]):
        memcpy_once()
        memcpys.append(memcpy_once())
        settle()
        t0 = time.perf_counter()
        d = eng.save(step, sd, tiers=["local"]).blocking_s
        wall = time.perf_counter() - t0
        deltas.append(gather_max(d))
        save_walls.append(gather_max(wall))
        PROF.reset()
        t1 = time.perf_counter()
        eng.wait()  # background: local-tier write + replication + ledger + retention
        bg_s.append(gather_max(time.perf_counter() - t1))
        bg_prof.append(PROF.snap())
        step += 1
        log0(rank, f"save {i + 1}/{args['saves']}: δ={deltas[-1]:.3f}s memcpy={memcpys[-1]:.3f}s "
                   f"background={bg_s[-1]:.1f}s")
        settle()
    memcpy_once()
    memcpys.append(memcpy_once())
    # diagnostic: the staging copy alone (both buffer sets in turn, no background job), paired
    # with memcpy, to separate the copy's cost from what else happens around save()
    stage_only, memcpy_pair = [], []
    for i in range(args["saves"]):
        memcpy_pair.append(memcpy_once())
        slot = eng.pool.acquire()
        dist.barrier()
        t0 = time.perf_counter()
        slot.stage(sd, users=1)
        stage_only.append(gather_max(time.perf_counter() - t0))
        slot.release()
    out.update(stage_only_s=stage_only, memcpy_pair_s=memcpy_pair)
    log0(rank, f"staging copy alone: median {med(stage_only):.3f}s vs memcpy {med(memcpy_pair):.3f}s")
    out.update(delta_s=deltas, memcpy_s=memcpys, save_wall_s=save_walls, background_s=bg_s,
               background_prof=bg_prof)
    committed_step = step - 1
    hist = [h for h in eng.history if h.tier == "local"]
    out["engine_history_ok"] = all(h.ok and not h.replicas_failed for h in hist)

    # -- 2. local-tier write vs plain write+fsync --------------------------------------------
    slot = eng.pool.acquire()
    staged = slot.stage(sd, users=1)
    plain_dir = os.path.join(args["local_base"], "plain")  # the same filesystem as the local tier
    os.makedirs(plain_dir, exist_ok=True)
    wchunk = args["write_chunk_bytes"]

    def plain_write(path) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for t in staged.values():
                mv = memoryview(t.view(-1).view(torch.uint8).numpy())
                for off in range(0, len(mv), wchunk):
                    piece = mv[off:off + wchunk]
                    done = 0
                    while done < len(piece):
                        done += os.write(fd, piece[done:])
            os.fsync(fd)
        finally:
            os.close(fd)
        return gather_max(time.perf_counter() - t0)

    plain_s, ours_s, ours_bytes, local_prof = [], [], [], []
    order = ("BOOB" * args["write_reps"])[: 2 * args["write_reps"]]
    for j, which in enumerate(order):
        if which == "B":
            p = os.path.join(plain_dir, f"rank{rank}-{j}.bin")
            plain_s.append(plain_write(p))
            os.remove(p)
        else:
            s = 100000 + j
            dist.barrier()
            PROF.reset()
            t0 = time.perf_counter()
            nb = local.save(staged, s)
            dt = time.perf_counter() - t0
            local_prof.append(PROF.snap())
            ours_s.append(gather_max(dt))
            ours_bytes.append(nb)
            local.store.rmtree(f"local/step-{s}")
        settle()
        log0(rank, f"local write {j + 1}/{len(order)} [{'plain' if which == 'B' else 'ours'}]: "
                   f"{(plain_s if which == 'B' else ours_s)[-1]:.2f}s")
    slot.release()
    out.update(plain_write_s=plain_s, local_save_s=ours_s, local_save_bytes=ours_bytes,
               local_prof=local_prof, write_order=order, plain_bytes=nbytes)

    # -- 3. replication vs raw gloo ------------------------------------------------------------
    group = eng.groups.local_world
    peer = 1 - rank
    peer_g = dist.get_group_rank(group, peer)
    src_chunks = []
    for t in sd.values():
        flat = t.view(-1).view(torch.uint8)
        for off in range(0, flat.numel(), chunk):
            src_chunks.append(flat[off:off + chunk])
    rbufs = [torch.empty(chunk, dtype=torch.uint8) for _ in range(2)]

    def raw_exchange() -> float:
        dist.barrier()
        t0 = time.perf_counter()
        works: list = [None, None]
        for k, c in enumerate(src_chunks):
            b = k % 2
            if works[b] is not None:
                for w in works[b]:
                    w.wait()
            works[b] = (dist.isend(c, peer_g, group=group), dist.irecv(rbufs[b][: c.numel()], peer_g, group=group))
        for ws in works:
            if ws is not None:
                for w in ws:
                    w.wait()
        return gather_max(time.perf_counter() - t0)

    raw_s, rep_s, rep_bytes, rep_prof, rep_fail = [], [], [], [], []
    raw_exchange()  # warm the connection
    rorder = ("BOOB" * args["repl_reps"])[: 2 * args["repl_reps"]]
    for j, which in enumerate(rorder):
        if which == "B":
            raw_s.append(raw_exchange())
        else:
            # a fresh destination, as for a new step in production (replicate() would otherwise
            # first delete the copy of the previous repetition inside the timed region)
            local.store.rmtree(f"replicas/node-{peer}")
            settle()
            PROF.reset()
            t0 = time.perf_counter()
            rep = replicate(local.store, eng.topo, group, eng.groups.node, committed_step, True, chunk)
            dt = time.perf_counter() - t0
            rep_prof.append(PROF.snap())
            rep_s.append(gather_max(dt))
            rep_bytes.append(rep.bytes_received)
            rep_fail.append(rep.failed)
        settle()
        log0(rank, f"replication {j + 1}/{len(rorder)} [{'raw gloo' if which == 'B' else 'ours'}]: "
                   f"{(raw_s if which == 'B' else rep_s)[-1]:.2f}s")
    out.update(raw_s=raw_s, repl_s=rep_s, repl_bytes=rep_bytes, repl_prof=rep_prof, repl_failed=rep_fail,
               raw_bytes=sum(c.numel() for c in src_chunks), repl_order=rorder)
    eng.close()
    # -- component costs (rank 0 alone, rank 1 waits): explain where the engine's time goes --
    if rank == 0:
        out["components"] = component_costs(sd)
    dist.barrier()
    out["all"] = gather_list({k: out[k] for k in ("local_save_bytes", "repl_bytes", "repl_failed")})
    return out


def component_costs(sd: dict, reps: int = 3) -> dict[str, float]:
    """Single-core GB/s of the per-byte operations on the engine's paths (best of ``reps``)."""
    import io

    import torch
    import xxhash

    t = next(iter(sd.values()))
    nb = t.numel() * t.element_size()
    mv = memoryview(t.view(-1).view(torch.uint8).numpy())
    dst = torch.empty_like(t)

    class Sink(io.RawIOBase):
        n = 0

        def writable(self):
            return True

        def write(self, b):
            n = memoryview(b).nbytes
            self.n += n
            return n

        def tell(self):
            return self.n

    def best(fn):
        r = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            r.append(time.perf_counter() - t0)
        return nb / min(r) / 1e9

    old = torch.serialization.get_crc32_options()
    out = {"memcpy (tensor.copy_)": best(lambda: dst.copy_(t)),
           "xxh3-64 (manifest checksum)": best(lambda: xxhash.xxh3_64(mv).hexdigest())}
    try:
        torch.serialization.set_crc32_options(True)
        out["torch.save to a null sink, zip CRC32 on (DCP default)"] = best(lambda: torch.save(t, Sink()))  # type: ignore[arg-type]  # a RawIOBase sink is enough
        torch.serialization.set_crc32_options(False)
        out["torch.save to a null sink, zip CRC32 off (no copy: the sink only takes a view)"] = best(
            lambda: torch.save(t, Sink()))  # type: ignore[arg-type]
    finally:
        torch.serialization.set_crc32_options(old)
    return out


# ---------------------------------------------------------------------------------------------
# driver side
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(args: dict, world: int = 2, timeout: float = 1500, target=None) -> list[dict]:
    """Run ``target(rank, world, args)`` (default :func:`rank_main`) on ``world`` gloo ranks."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world, port, args, q, target)) for r in range(world)]
    for p in procs:
        p.start()
    res: dict[int, tuple] = {}
    deadline = time.time() + timeout
    try:
        while len(res) < world and time.time() < deadline:
            try:
                rank, value, err = q.get(timeout=1.0)
                res[rank] = (value, err)
                if err:
                    break
            except Exception:
                if any(p.exitcode not in (None, 0) for p in procs):
                    break
    finally:
        for p in procs:
            p.join(timeout=30 if len(res) == world else 1)
            if p.is_alive():
                p.kill()
                p.join()
    errs = [f"rank {r}:\n{e}" for r, (v, e) in sorted(res.items()) if e]
    if errs or len(res) < world:
        raise SystemExit("benchmark failed:\n" + ("\n".join(errs) or f"ranks did not report (exit codes "
                                                 f"{[p.exitcode for p in procs]}, timeout {timeout}s)"))
    return [res[r][0] for r in range(world)]


def med(xs):
    return statistics.median(xs) if xs else float("nan")


def summarise(r0: dict, r1: dict) -> dict:
    nbytes = r0["state_bytes"]
    delta, memcpy = med(r0["delta_s"]), med(r0["memcpy_s"])
    plain, ours = med(r0["plain_write_s"]), med(r0["local_save_s"])
    local_bytes = max(r0["local_save_bytes"] + r1["local_save_bytes"])
    raw, rep = med(r0["raw_s"]), med(r0["repl_s"])
    rep_bytes = max(max(b) for b in [r0["repl_bytes"], r1["repl_bytes"]])
    s = {
        "nbytes": nbytes,
        "delta": delta, "memcpy": memcpy, "ratio_delta": delta / memcpy,
        "plain_gbs": nbytes / plain / 1e9, "local_gbs": local_bytes / ours / 1e9,
        "plain_s": plain, "local_s": ours, "local_bytes": local_bytes,
        "raw_gbs": r0["raw_bytes"] / raw / 1e9, "repl_gbs": rep_bytes / rep / 1e9,
        "raw_s": raw, "repl_s": rep, "repl_bytes": rep_bytes, "raw_bytes": r0["raw_bytes"],
    }
    s["ratio_local"] = s["local_gbs"] / s["plain_gbs"]
    s["ratio_repl"] = s["repl_gbs"] / s["raw_gbs"]
    s["pass_delta"] = s["ratio_delta"] <= TARGETS["delta"]
    s["pass_local"] = s["ratio_local"] >= TARGETS["local"]
    s["pass_repl"] = s["ratio_repl"] >= TARGETS["repl"]
    s["components"] = r0.get("components", {})
    s["stage_only"], s["memcpy_pair"] = med(r0["stage_only_s"]), med(r0["memcpy_pair_s"])
    s["repl_ok"] = not any(f for r in (r0, r1) for f in r["repl_failed"])
    s["engine_ok"] = r0["engine_history_ok"] and r1["engine_history_ok"]
    return s


def comp_rows(s: dict) -> list[list[str]]:
    return [[k, f"{v:.2f}"] for k, v in s["components"].items()]


def result_rows(s: dict, diag: bool = True) -> list[list[str]]:
    pf = lambda ok: "PASS" if ok else "FAIL"  # noqa: E731
    extra = [["(diagnostic) staging copy alone, no background job", f"{s['stage_only'] * 1e3:.0f} ms",
              f"memcpy {s['memcpy_pair'] * 1e3:.0f} ms", f"{s['stage_only'] / s['memcpy_pair']:.2f}", "—", "—"]]
    return [
        ["1. blocking δ of save(tiers=[local])", f"{s['delta'] * 1e3:.0f} ms",
         f"memcpy {s['memcpy'] * 1e3:.0f} ms", f"δ/memcpy = {s['ratio_delta']:.2f}", "≤ 1.5", pf(s["pass_delta"])],
        ["2. local-tier write (DCP+fsync+checksum+commit)", f"{s['local_gbs']:.3f} GB/s ({s['local_s']:.2f} s)",
         f"write+fsync {s['plain_gbs']:.3f} GB/s ({s['plain_s']:.2f} s)", f"ours/plain = {s['ratio_local']:.2f}",
         "≥ 0.8", pf(s["pass_local"])],
        ["3. replication, F=2 both directions", f"{s['repl_gbs']:.3f} GB/s ({s['repl_s']:.2f} s)",
         f"raw gloo {s['raw_gbs']:.3f} GB/s ({s['raw_s']:.2f} s)", f"ours/raw = {s['ratio_repl']:.2f}",
         "≥ 0.7", pf(s["pass_repl"])],
    ] + (extra if diag else [])


HEAD = ["measurement", "tierckpt (median)", "baseline (median)", "ratio", "target", "result"]


def breakdown_rows(r0: dict, r1: dict) -> dict[str, list[list[str]]]:
    """Median per-phase seconds (per rank) of the profiled engine runs."""
    out = {}
    for key, label, total_key in (("local_prof", "LocalTier.save", "local_save_s"),
                                  ("repl_prof", "replicate", "repl_s"),
                                  ("background_prof", "engine background job (local write + replication)", "background_s")):
        names = sorted({n for r in (r0, r1) for p in r[key] for n in p})
        rows = []
        for n in names:
            vals = [med([p.get(n, 0.0) for p in r[key]]) for r in (r0, r1)]
            rows.append([n] + [f"{v:.3f}" for v in vals])
        rows.append(["(total wall, slower rank)", f"{med(r0[total_key]):.3f}", ""])
        out[label] = rows
    return out


def meminfo_kb() -> dict[str, int]:
    """/proc/meminfo as {field: kB} (e.g. ``MemTotal``, ``MemFree``, ``Cached``); {} where it cannot
    be read (not Linux)."""
    try:
        with open("/proc/meminfo") as f:
            return {k: int(v.split()[0]) for k, v in (ln.split(":", 1) for ln in f if ":" in ln)}
    except (OSError, ValueError, IndexError):
        return {}


def machine() -> dict:
    def sh(cmd):
        try:
            return subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=20).stdout.strip()
        except Exception as e:
            return f"({e})"

    import torch

    kb = meminfo_kb().get("MemTotal")
    mem = f"RAM {kb / (1 << 20):.1f} GiB (MemTotal {kb} kB)" if kb else "RAM unknown"
    cpu = sh("grep -m1 'model name' /proc/cpuinfo").split(":", 1)[-1].strip()
    # not `nproc`: it reports OMP_NUM_THREADS (1 under the benches' OMP_NUM_THREADS=1)
    return {"nproc": len(os.sched_getaffinity(0)), "mem": mem, "cpu": cpu, "kernel": platform.release(),
            "python": platform.python_version(), "torch": torch.__version__, "host": socket.gethostname()}


def disk(path: str) -> str:
    try:
        return subprocess.run(["df", "-hT", path], capture_output=True, text=True, timeout=20).stdout.strip()
    except Exception as e:
        return f"({e})"


def print_rich(s, bd, m, dfout, args, elapsed):
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    c = Console(width=max(140, shutil.get_terminal_size((140, 40)).columns))
    t = Table(title=f"tierckpt engine benchmark — 2 gloo ranks = 2 nodes, F=2, "
                    f"{s['nbytes'] / GiB:.2f} GiB per rank", show_lines=True)
    for h in HEAD:
        t.add_column(h)
    for row in result_rows(s):
        color = {"PASS": "green", "FAIL": "red"}.get(row[-1], "default")
        t.add_row(*[escape(x) for x in row[:-1]], f"[{color}]{row[-1]}[/]")
    c.print(t)
    for label, rows in bd.items():
        bt = Table(title=f"phase breakdown: {label} (median s per rank; nested/overlapping phases)")
        for h in ("phase", "rank 0", "rank 1"):
            bt.add_column(h)
        for r in rows:
            bt.add_row(*r)
        c.print(bt)
    ct = Table(title="component costs, one core (rank 0 alone), GB/s")
    ct.add_column("operation")
    ct.add_column("GB/s")
    for k, v in comp_rows(s):
        ct.add_row(k, v)
    c.print(ct)
    c.print(f"machine: {m['nproc']} CPUs ({m['cpu']}), {m['mem']}, torch {m['torch']}; "
            f"bench dir on:\n{dfout}")
    if not (s["repl_ok"] and s["engine_ok"]):
        c.print("[red]WARNING: some replication/engine job reported a failure (see raw samples)[/]")
    c.print(f"elapsed {elapsed:.0f} s")


def md_table(head, rows) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def record(s, bd, m, dfout, args, r0, r1, cmd, elapsed):
    when = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    parts = [f"\n## Run {when}\n",
             f"Command (from the repo root): `{cmd}`  \n"
             f"State: {args['tensors']} fp32 tensors, {s['nbytes'] / GiB:.3f} GiB per rank; "
             f"transfer_chunk_bytes = {r0['chunk_bytes'] >> 20} MiB; staging_buffers = {r0['staging_buffers']}; "
             f"torch threads per rank = {args['threads']}; measured saves = {args['saves']}, "
             f"write reps = {args['write_reps']} (order {r0['write_order']}), "
             f"replication reps = {args['repl_reps']} (order {r0['repl_order']}); elapsed {elapsed:.0f} s.\n",
             f"Machine: {m['nproc']} CPUs; {m['mem']}; CPU: {m['cpu']}; kernel {m['kernel']}; "
             f"Python {m['python']}; torch {m['torch']}.  \nBench dir filesystem (`df -hT`):\n",
             "```\n" + dfout + "\n```\n",
             md_table(HEAD, result_rows(s)) + "\n"]
    if not (s["repl_ok"] and s["engine_ok"]):
        parts.append("\n**WARNING:** a replication or engine job reported a failure in this run.\n")
    for label, rows in bd.items():
        parts.append(f"\nPhase breakdown — {label} (median seconds per rank; phases nest/overlap):\n\n"
                     + md_table(["phase", "rank 0", "rank 1"], rows) + "\n")
    parts.append("\nComponent costs, one core (rank 0 alone):\n\n" + md_table(["operation", "GB/s"], comp_rows(s)) + "\n")
    samples = {k: [round(x, 4) for x in r0[k]] for k in
               ("warmup_delta_s", "delta_s", "memcpy_s", "save_wall_s", "background_s", "stage_only_s", "memcpy_pair_s",
                "plain_write_s", "local_save_s", "raw_s", "repl_s")}
    parts.append("\nRaw samples (seconds, slower rank per repetition):\n\n```json\n"
                 + json.dumps(samples, indent=None) + "\n```\n")
    if not os.path.exists(RESULTS_MD):
        with open(RESULTS_MD, "w") as f:
            f.write("# Benchmark notebook\n\nDated entries appended by the bench scripts' `--record`; "
                    "the current standing is in [../RESULTS.md](../RESULTS.md).\n")
    with open(RESULTS_MD, "a") as f:
        f.write("".join(parts))
    print(f"recorded to {RESULTS_MD}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib-per-rank", type=float, default=1.0, help="state size per rank (GiB), default 1.0")
    ap.add_argument("--tensors", type=int, default=4, help="number of fp32 tensors in the state (default 4)")
    ap.add_argument("--saves", type=int, default=6, help="measured steady-state saves (default 6)")
    ap.add_argument("--write-reps", type=int, default=5, help="repetitions of each of plain/ours local write (default 5)")
    ap.add_argument("--repl-reps", type=int, default=5, help="repetitions of each of raw/ours replication (default 5)")
    ap.add_argument("--chunk-bytes", type=int, default=0, help="transfer_chunk_bytes (default: the config default)")
    ap.add_argument("--write-chunk-bytes", type=int, default=64 << 20, help="plain-write chunk size (default 64 MiB)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1: 2 ranks on 2 cores)")
    ap.add_argument("--dir", default=None, help="parent of the temp dir (default: $TMPDIR or /tmp)")
    ap.add_argument("--local-root-base", default=None,
                    help="parent of the local roots and the plain-write baseline (e.g. /dev/shm for a RAM local "
                         "tier; default: the temp dir under --dir); a temp dir is made there and removed at the end")
    ap.add_argument("--keep", action="store_true", help="keep the temp dir")
    ap.add_argument("--record", action="store_true", help=f"append the results to {os.path.relpath(RESULTS_MD, REPO)}")
    ap.add_argument("--timeout", type=float, default=1500, help="abort after this many seconds (default 1500)")
    a = ap.parse_args(argv)
    base = tempfile.mkdtemp(prefix="tierckpt-bench-", dir=a.dir)
    local_base = tempfile.mkdtemp(prefix="tierckpt-bench-local-", dir=a.local_root_base) if a.local_root_base else base
    args = dict(gib_per_rank=a.gib_per_rank, tensors=a.tensors, saves=a.saves, write_reps=a.write_reps,
                repl_reps=a.repl_reps, chunk_bytes=a.chunk_bytes, write_chunk_bytes=a.write_chunk_bytes,
                threads=a.threads, base=base, local_base=local_base)
    cmd = " ".join(shlex.quote(x) for x in [os.path.relpath(sys.executable, REPO) if sys.executable.startswith(REPO)
                                            else sys.executable, os.path.relpath(os.path.abspath(__file__), REPO)]
                   + (sys.argv[1:] if argv is None else list(argv)))
    dfout = disk(local_base)  # the local-tier and plain-write measurements run there
    t0 = time.time()
    print(f"bench dir {base}", flush=True)
    try:
        r0, r1 = run_ranks(args, timeout=a.timeout)
    finally:
        if not a.keep:
            shutil.rmtree(base, ignore_errors=True)
            shutil.rmtree(local_base, ignore_errors=True)
    elapsed = time.time() - t0
    s = summarise(r0, r1)
    bd = breakdown_rows(r0, r1)
    m = machine()
    print_rich(s, bd, m, dfout, args, elapsed)
    if a.record:
        record(s, bd, m, dfout, args, r0, r1, cmd, elapsed)
    return 0 if (s["repl_ok"] and s["engine_ok"]) else 1


if __name__ == "__main__":
    sys.exit(main())
