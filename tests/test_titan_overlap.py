"""torchtitan with ``[checkpoint] cpu_staging = "overlapped"`` on 2 ranks = 2 simulated nodes:
every step saves the local tier while its large tensors are copied in the background, the
optimizer step (torchtitan's ``maybe_wait_for_staging`` and the engine's global step pre-hook)
waits for the copy; no save fails. A second run rolls back to step 4 (``load_step``), a copy
the optimizer step 5 ran after, and its losses of steps 5–8 are bitwise those of the first run."""

from __future__ import annotations

import json
import os
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _train(tmp, dump, steps, *extra):
    from tests.harness import titan_train_cmd

    cmd = [*titan_train_cmd(),
           "--dump_folder", os.path.join(tmp, dump), "--checkpoint.local_root", os.path.join(tmp, dump + "-nvme", "node-{node}"),
           "--training.steps", str(steps), "--checkpoint.busy_tier_policy", "wait", *extra]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=400, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    return r


def _losses(tmp, dump) -> dict[int, str]:
    out = {}
    for line in open(os.path.join(tmp, dump, "metrics", "losses.jsonl")):
        r = json.loads(line)
        out[r["step"]] = r["loss_hex"]
    return out


def test_overlapped_staging_saves_every_step_and_resumes_bitwise(tmp_path):
    tmp = str(tmp_path)
    overlapped = ("--checkpoint.cpu_staging", "overlapped", "--checkpoint.local_interval", "1",
                  "--checkpoint.interval", "3", "--checkpoint.local_keep_latest_k", "8")
    r = _train(tmp, "run", 8, *overlapped)
    assert "overlapped staging:" in r.stdout + r.stderr  # the background copy was taken (logged once)
    first = _losses(tmp, "run")
    _train(tmp, "run", 8, *overlapped, "--checkpoint.load_step", "4")
    ledger = [json.loads(x) for x in open(os.path.join(tmp, "run", "checkpoint", "tierckpt-ledger.jsonl"))]
    ckpts = [x for x in ledger if x["kind"] == "checkpoint"]
    assert ckpts and all(x["ok"] for x in ckpts), [x for x in ckpts if not x["ok"]]
    assert sorted({x["step"] for x in ckpts if x["tier"] == "local"}) == list(range(1, 9))
    restores = [x for x in ledger if x["kind"] == "restore"]
    assert [x["step"] for x in restores] == [4] and {v["source"] for v in restores[0]["sources"].values()} == {"own-local"}
    steps = [json.loads(x)["step"] for x in open(os.path.join(tmp, "run", "metrics", "losses.jsonl"))]
    assert steps == list(range(1, 9)) + [5, 6, 7, 8], steps  # the second run trained 5-8 again
    again = _losses(tmp, "run")  # its records come last
    assert sorted(first) == list(range(1, 9))
    assert all(again[s] == first[s] for s in range(5, 9)), {s: (first[s], again[s]) for s in range(5, 9)}
