"""bench/bench_peers.py: the bitwise check must catch one flipped bit, and the bench runs end to end
at a tiny size (tierckpt, DCP, NVRx in .venv; lm-resiliency only where .venv-peers exists)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from bench import bench_peers as bp
from bench import peers_common as pc

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_state_layout():
    sd = pc.make_state(rank=1, mib=4)
    assert len(sd) == 324
    large = [v for k, v in sd.items() if ".large" in k]
    small = [v for k, v in sd.items() if ".small" in k]
    scalars = [v for k, v in sd.items() if ".scalar" in k]
    assert (len(large), len(small), len(scalars)) == (4, 280, 40)
    assert all(v.dtype == torch.float32 for v in large + small)
    assert all(v.dtype == torch.int64 and v.dim() == 0 for v in scalars)
    total = pc.state_bytes(sd)
    assert total <= 4 << 20
    assert sum(v.numel() * 4 for v in large) / total == pytest.approx(0.75, abs=0.01)
    assert all(k.startswith("r1.") for k in sd)  # rank-unique keys (DCP would dedupe otherwise)


def test_bitwise_check_fails_on_one_bit():
    sd = pc.make_state(rank=0, mib=1)
    got = pc.snapshot(sd)
    assert pc.bitwise_mismatches(sd, got) == []
    pc.assert_bitwise(sd, got, "identical")

    got["r0.large2"].view(torch.int32)[12345] ^= 1  # lowest mantissa bit of one float
    assert pc.bitwise_mismatches(sd, got) == ["r0.large2: 1 byte(s) differ"]
    with pytest.raises(AssertionError, match="r0.large2: 1 byte"):
        pc.assert_bitwise(sd, got, "one bit")

    got = pc.snapshot(sd)
    got["r0.scalar7"].view(1).view(torch.uint8)[7] ^= 0x80  # the sign bit of an int64 scalar
    assert pc.bitwise_mismatches(sd, got) == ["r0.scalar7: 1 byte(s) differ"]

    got = pc.snapshot(sd)
    got["r0.small3"] = got["r0.small3"].double()
    assert "r0.small3: torch.float64" in pc.bitwise_mismatches(sd, got)[0]
    del got["r0.small4"]
    assert pc.bitwise_mismatches(sd, got)[0] == "missing keys: ['r0.small4']"


def test_abba_order():
    assert pc.abba(["a", "b", "c"], 3) == [["a", "b", "c"], ["c", "b", "a"], ["a", "b", "c"]]


def test_bench_runs_end_to_end_main_venv(tmp_path, monkeypatch):
    out = tmp_path / "s.json"
    # 2 warm-up saves: each staging buffer builds its copy plan, the measured save overlaps
    rc = bp.main(["--mib-per-rank", "4", "--saves", "1", "--warmup", "2", "--restore-reps", "1",
                  "--rss-saves", "1", "--skip-lmr", "--dir", str(tmp_path), "--json", str(out), "--timeout", "300",
                  "--overlap-window-ms", "200", "--cpu-steps", "2", "--cpu-reps", "1"])
    assert rc == 0
    (s,) = json.loads(out.read_text())
    assert s["systems"] == ["tierckpt", bp.OVERLAP, bp.PRIO0, "DCP sync", "DCP async (thread)", "DCP process+async staging",
                            "NVRx local"]
    # the modelled forward/backward is not blocking time: δ is save() plus the wait after it
    assert all(d < 0.2 for d in s["raw"]["delta_s"][bp.OVERLAP] + s["raw"]["delta_s"]["DCP process+async staging"])
    assert 3.9 < s["mib"] <= 4.0
    for name in s["systems"]:
        assert 0 < s["delta"][name] < 60 and math.isfinite(s["delta_ratio"][name])
    # the restores ran and passed the bitwise check inside the ranks (they raise otherwise)
    # the disk floor is its own repetition, not a restore
    assert set(s["restore"]) == {"tierckpt", "NVRx local"} and 0 < s["floor"] < 60 and len(s["raw"]["floor_s"]) == 1
    assert all(0 < v < 60 for v in s["restore"].values())
    assert set(s["rss"]) == {"tierckpt", bp.OVERLAP, bp.PRIO0, "DCP sync", "DCP async (thread)",
                             "DCP process+async staging"}
    assert s["lmr"] is None and s["lmr_skipped"] == "--skip-lmr"
    # measurement 4 ran for tierckpt, its overlapped mode, tierckpt at the trainer's priority and DCP's
    # process executor
    sc = s["stepcost"]
    assert set(sc["cost"]) == {"tierckpt", bp.OVERLAP, bp.PRIO0, "DCP process+async staging"}
    assert all(n >= 2 for n in sc["steps"].values()) and 0 < sc["base_step"] < 60
    assert all(math.isfinite(v) for v in sc["cost"].values())
    head, meas, targ = bp.rows(s)
    assert head[1:] == s["systems"]
    assert all(len(r) == len(head) for r in meas)
    assert [r[0] for r in meas][-1] == "4. ÷ memcpy" and meas[-1][head.index("DCP sync")] == "—"
    row4 = [f"4. save cost {n} ÷ DCP process executor (replica + checksums on)" for n in ("tierckpt", bp.OVERLAP,
                                                                                          bp.PRIO0)]
    assert [t[0] for t in targ] == ["δ tierckpt ÷ memcpy", "δ tierckpt (overlapped, 200 ms idle host) ÷ memcpy",
                                    *row4, "restore tierckpt ÷ NVRx local"]
    assert targ[4][-1] == "—"  # the trainer-priority row is information, not a target
    assert all(t[-1] in ("PASS", "MISS") for i, t in enumerate(targ) if i != 4)
    assert [p for p in os.listdir(tmp_path) if p.startswith("tierckpt-peers-")] == []
    # --record's text: the memory state at the start and end, and this run's target table
    md = tmp_path / "RESULTS.md"
    monkeypatch.setattr(bp, "RESULTS_MD", str(md))
    args = bp.argparse.Namespace(saves=1, warmup=1, restore_reps=1, rss_saves=1, overlap_window_ms=200.0,
                                 cpu_steps=2, cpu_reps=1)
    bp.record([s], bp.machine(), args, "bench/bench_peers.py …", 1.0, "df", (0.0, 0.0, 0.0),
              "MemFree 1.0 GiB, Cached 2.0 GiB, MemAvailable 3.0 GiB")
    text = md.read_text()
    assert "Memory: MemFree 1.0 GiB, Cached 2.0 GiB, MemAvailable 3.0 GiB at the start; MemFree " in text
    assert "| restore tierckpt ÷ NVRx local |" in text and "| 4. ÷ memcpy |" in text
    assert "CPU-bound step cost: at least 2 steps of 200 ms of matmuls" in text
    assert (f"{bp.OVERLAP} and DCP process+async staging: δ = the call + the wait for staging after a modelled "
            "forward/backward of 200 ms") in text
    for bad in (["--overlap-window-ms", "-1"], ["--cpu-steps", "-1"], ["--cpu-reps", "0"],
                ["--overlap-window-ms", "0"]):  # measurement 4 needs a forward/backward to model
        with pytest.raises(SystemExit):
            bp.main(bad)
    assert "Incomplete" not in text
    bp.record([s], bp.machine(), args, "bench/bench_peers.py …", 1.0, "df", (0.0, 0.0, 0.0), "MemFree 1.0 GiB",
              failed="RuntimeError: ranks did not report")
    assert ("**Incomplete**: only 4 MiB measured; the next size failed (RuntimeError: ranks did not report)."
            in md.read_text().split("\n## bench-peers")[-1])


def test_a_failed_size_keeps_the_sizes_measured_before_it(tmp_path, monkeypatch):
    """A later size that fails (an OOM kill at 1 GiB) neither loses nor hides the earlier sizes:
    they are printed, written to --json and recorded, and the exit status is 1; a first size
    that fails raises as before."""
    done: list = []
    recorded: list = []

    def ranks(args, timeout, target):
        if args["mib"] > 100:
            raise RuntimeError("ranks did not report (exit codes [-9, -9])")
        return {"mib": args["mib"]}, None

    monkeypatch.setattr(bp, "run_lmr", lambda a, mib, base: {"skipped": "test"})
    monkeypatch.setattr(bp, "run_ranks", ranks)
    monkeypatch.setattr(bp, "run_restores", lambda a, mib, base, ram: {})
    monkeypatch.setattr(bp, "summarise", lambda r0, lmr: {"mib": r0["mib"]})
    monkeypatch.setattr(bp, "print_rich", lambda summaries, *a: done.append(list(summaries)))
    monkeypatch.setattr(bp, "record", lambda summaries, *a: recorded.append((list(summaries), a[-1])))
    out = tmp_path / "s.json"
    rc = bp.main(["--mib-per-rank", "4", "1024", "--skip-lmr", "--dir", str(tmp_path), "--json", str(out), "--record"])
    assert rc == 1
    assert done == [[{"mib": 4.0}]] and json.loads(out.read_text()) == [{"mib": 4.0}]
    assert recorded == [([{"mib": 4.0}], "RuntimeError: ranks did not report (exit codes [-9, -9])")]
    assert [p for p in os.listdir(tmp_path) if p.startswith("tierckpt-peers-")] == []
    with pytest.raises(RuntimeError, match="did not report"):
        bp.main(["--mib-per-rank", "1024", "4", "--skip-lmr", "--dir", str(tmp_path)])


class _Fake:
    """A system for step_cost: ``stall_s`` held at its first wait, background busy for
    ``busy_steps`` of the trainer's steps."""

    def __init__(self, stall_s=0.0, busy_steps=0):
        self.stall_s, self.busy_steps, self.waits = stall_s, busy_steps, 0

    def begin(self, sd, step):
        self.waits = 0

    def before_update(self):
        if self.waits == 0 and self.stall_s:
            import time

            time.sleep(self.stall_s)
        self.waits += 1

    def busy(self):
        return self.waits < self.busy_steps

    def complete(self):  # nothing runs after busy() turned False
        return None


def test_step_cost_counts_the_stall_and_runs_until_the_background_is_done(monkeypatch):
    from bench import peers_stepcost as ps

    monkeypatch.setattr(ps, "gmax", lambda x: x)  # one process: the slower rank is this one
    sd = pc.make_state(0, 1)
    systems = {"free": _Fake(), "stall": _Fake(stall_s=0.15), "long": _Fake(busy_steps=6)}
    out = ps.step_cost(systems, list(systems), sd, reps=3, steps=3, window_s=0.01, barrier=lambda: None,
                       first_step=1)
    cost = {n: pc.med(v) for n, v in out["cost_s"].items()}
    assert 0.1 < cost["stall"] < 0.4, cost
    # a background that stalls nothing costs ~0 (tolerance: step-time noise on a loaded 2-core machine)
    assert abs(cost["free"]) < 0.1 and abs(cost["long"]) < 0.1, cost
    assert out["steps"] == {"free": [3, 3, 3], "stall": [3, 3, 3], "long": [6, 6, 6]}
    assert out["matmuls_per_step"] >= 1 and out["next_step"] == 1 + 3 * 3


def test_memory_state_reads_meminfo():
    line = bp.memory_state()
    parts = dict(p.rsplit(" ", 2)[:2] for p in line.split(", "))
    assert set(parts) == {"MemFree", "Cached", "MemAvailable"}
    assert all(float(v) >= 0 for v in parts.values())


@pytest.mark.skipif(not os.path.exists(bp.PEERS_PY),
                    reason="side venv .venv-peers absent (scripts/setup_venv_peers.sh or `make bench-peers` creates it)")
def test_lmr_driver_side_venv(tmp_path):
    out = tmp_path / "lmr.json"
    subprocess.run([bp.PEERS_PY, os.path.join(REPO, "bench", "peers_lmr.py"), "--mib", "4", "--saves", "1",
                    "--warmup", "1", "--restore-reps", "1", "--rss-saves", "1", "--dir", str(tmp_path),
                    "--out", str(out), "--timeout", "300"], check=True, timeout=360)
    r = json.loads(out.read_text())
    assert r["versions"]["lm-resiliency"] == "0.2.0"
    assert r["n_tensors"] == 324
    assert len(r["capture_s"]) == len(r["memcpy_s"]) == 1
    for k in ("capture_s", "replication_s", "ram_restore_s", "disk_restore_s", "flush_s"):
        assert len(r[k]) >= 1 and all(0 < x < 60 for x in r[k]), k
    assert not (tmp_path / "lmr").exists()
    # the disk restart path alone, one repetition (one turn of the main run's restore ABBA order)
    subprocess.run([bp.PEERS_PY, os.path.join(REPO, "bench", "peers_lmr.py"), "--mib", "4", "--restore-reps", "1",
                    "--phases", "disk", "--dir", str(tmp_path), "--out", str(out), "--timeout", "300"],
                   check=True, timeout=360)
    r = json.loads(out.read_text())
    assert len(r["disk_restore_s"]) == len(r["flush_s"]) == 1 and 0 < r["disk_restore_s"][0] < 60
    assert r["capture_s"] == r["ram_restore_s"] == [] and "rss_growth_bytes" not in r
    bad = subprocess.run([bp.PEERS_PY, os.path.join(REPO, "bench", "peers_lmr.py"), "--mib", "4", "--phases", "disk,x",
                          "--dir", str(tmp_path), "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--phases" in bad.stderr


@pytest.mark.skipif(not os.path.exists(bp.PEERS_PY),
                    reason="side venv .venv-peers absent (scripts/setup_venv_peers.sh or `make bench-peers` creates it)")
def test_bench_interleaves_the_lmr_disk_path_with_the_restores(tmp_path):
    out = tmp_path / "s.json"
    rc = bp.main(["--mib-per-rank", "4", "--saves", "1", "--warmup", "1", "--restore-reps", "2", "--rss-saves", "1",
                  "--systems", "--dir", str(tmp_path), "--json", str(out), "--timeout", "300"])
    assert rc == 0
    (s,) = json.loads(out.read_text())
    # ABBA over tierckpt, the disk floor and the side-venv disk path: two samples each, in the same run
    raw = s["raw"]
    assert len(raw["restore_s"]["tierckpt"]) == len(raw["restore_s"][bp.LMR_DISK]) == len(raw["floor_s"]) == 2
    assert set(s["restore"]) == {"tierckpt"} and 0 < s["lmr"]["disk"] < 60 and 0 < s["lmr"]["flush"] < 60
    assert 0 < s["floor"] < 60
    targ = {t[0]: t for t in bp.rows(s)[2]}
    x = targ["restore tierckpt ÷ lm-resiliency disk path (same run, ABBA)"]
    assert float(x[1]) == pytest.approx(s["restore"]["tierckpt"] / s["lmr"]["disk"], abs=0.006)


def test_probe_memory_prints_every_method_and_refuses_bad_sizes():
    """bench/probe_memory.py (the fresh-memory cost behind the restore row of RESULTS.md): one
    row per method with a positive first-touch time; a zero size is refused with the option named."""
    cmd = [sys.executable, os.path.join(REPO, "bench", "probe_memory.py")]
    r = subprocess.run(cmd + ["--mib", "4", "--reps", "1"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    rows = {ln.split()[0]: ln.split()[1:] for ln in r.stdout.splitlines()[2:]}
    assert set(rows) == {"zero_", "MADV_POPULATE_WRITE", "MAP_POPULATE"}, r.stdout
    assert all(float(v[0]) > 0 and float(v[1]) > 0 for v in rows.values()), r.stdout
    bad = subprocess.run(cmd + ["--mib", "0"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--mib" in bad.stderr


def test_probe_save_cpu_counts_the_local_write_and_refuses_bad_variants(tmp_path):
    """bench/probe_save_cpu.py (CPU seconds of one save, by thread): the local tier's writer
    thread is charged CPU time and the raw samples hold one entry per measured save; an unknown
    variant is refused with the option and the allowed values named."""
    import json

    cmd = [sys.executable, os.path.join(REPO, "bench", "probe_save_cpu.py")]
    out = tmp_path / "probe.json"
    r = subprocess.run(cmd + ["--mib", "4", "--saves", "1", "--variants", "local", "--json", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "== local: 4 MiB per rank, 1 saves" in r.stdout and "machine CPU" in r.stdout, r.stdout
    ranks = json.loads(out.read_text())["local"]
    assert len(ranks) == 2 and all(len(x["samples"]) == 1 for x in ranks)
    assert all(x["samples"][0]["threads"].get("tierckpt-local", 0.0) > 0 for x in ranks), ranks
    bad = subprocess.run(cmd + ["--variants", "nvme"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--variants" in bad.stderr and "replica, local, shm" in bad.stderr, bad.stderr
