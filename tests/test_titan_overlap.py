"""torchtitan with ``[checkpoint] cpu_staging = "overlapped"`` on 2 ranks = 2 simulated nodes:
every step saves the local tier while its large tensors are copied in the background, the
optimizer step (torchtitan's ``maybe_wait_for_staging`` and the engine's global step pre-hook)
waits for the copy; no save fails, a restart resumes at the last step, and every loss of the
saved and resumed runs is bitwise equal to the same workflow with blocking staging, resumed
from a mid-run step (``load_step``) whose copy overlapped the next step's forward/backward."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _train(tmp, dump, steps, *extra):
    from tests.harness import free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
           str(free_port()), "-m", "titan_plugin.train", "--toml", os.path.join(ROOT, "configs", "titan_demo.toml"),
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
    every = ("--checkpoint.local_interval", "1", "--checkpoint.interval", "3")
    # the reference: the same workflow (5 steps, then a restart to 8 from step 4, a copy the
    # optimizer step 5 ran after; torchtitan's LR schedule depends on training.steps) with
    # blocking staging, whose resume is bitwise (test_titan_contract, test_titan_explicit_step)
    _train(tmp, "ref", 5, *every)
    _train(tmp, "ref", 8, *every, "--checkpoint.load_step", "4")
    overlapped = ("--checkpoint.cpu_staging", "overlapped", *every)
    r = _train(tmp, "run", 5, *overlapped)
    assert "overlapped staging:" in r.stdout + r.stderr  # the background copy was taken (logged once)
    _train(tmp, "run", 8, *overlapped, "--checkpoint.load_step", "4")
    ledger = [json.loads(x) for x in open(os.path.join(tmp, "run", "checkpoint", "tierckpt-ledger.jsonl"))]
    ckpts = [x for x in ledger if x["kind"] == "checkpoint"]
    assert ckpts and all(x["ok"] for x in ckpts), [x for x in ckpts if not x["ok"]]
    assert sorted({x["step"] for x in ckpts if x["tier"] == "local"}) == list(range(1, 9))
    restores = [x for x in ledger if x["kind"] == "restore"]
    assert [x["step"] for x in restores] == [4] and {v["source"] for v in restores[0]["sources"].values()} == {"own-local"}
    want, got = _losses(tmp, "ref"), _losses(tmp, "run")
    assert sorted(got) == list(range(1, 9)) and got == want, {s: (want[s], got.get(s)) for s in want if want[s] != got.get(s)}
