"""``make bench-gpu``'s script end to end on the CPU (``--cpu-dry-run``): the prepared GPU run
must not first fail on a lent GPU machine's short time budget. Checks the JSON summary's shape
and that every system's restore was bitwise; δ on CPU is a memcpy, not the GPU result."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_cpu_dry_run_two_ranks(tmp_path):
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "bench_gpu.py"), "--cpu-dry-run", "--ranks", "2",
                        "--dir", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    s = json.loads(r.stdout.strip().splitlines()[-1])
    assert s["bench"] == "gpu" and s["device"] == "cpu (dry run)" and s["ranks"] == 2 and s["cpu_dry_run"] is True
    assert s["target_delta_ms"] == 10.0
    (size,) = s["sizes"].values()
    t = size["tierckpt"]
    assert t["ok"] and t["bitwise"] and t["restored_step"] == s["saves"] and t["source"] == "own-local", t
    assert 0 < t["delta_ms_median"] <= t["delta_ms_max"]
    for peer in ("dcp-sync", "dcp-async-pinned"):
        assert size[peer]["bitwise"] is True, size[peer]
    # NVRx's local checkpointing needs CUDA tensors: skipped with the reason, not failed
    assert set(size["nvrx-local"]) == {"skipped"} and "CUDA" in size["nvrx-local"]["skipped"], size["nvrx-local"]
    assert os.listdir(tmp_path) == []  # everything written under --dir is removed
