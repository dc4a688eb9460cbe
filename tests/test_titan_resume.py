"""torchtitan resume semantics: a final model-only export is never a resume point."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _train(tmp, steps, *extra):
    from tests.harness import free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
           str(free_port()), "-m", "titan_plugin.train", "--toml", os.path.join(ROOT, "configs", "titan_demo.toml"),
           "--dump_folder", os.path.join(tmp, "run"), "--checkpoint.local_root", os.path.join(tmp, "nvme", "node-{node}"),
           "--training.steps", str(steps), "--checkpoint.local_interval", "3", "--checkpoint.interval", "3", *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=400, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    return r


def test_model_only_last_save_is_not_a_resume_point(tmp_path):
    tmp = str(tmp_path)
    _train(tmp, 4, "--checkpoint.last_save_model_only", "true")
    ckpt = os.path.join(tmp, "run", "checkpoint")
    # torchtitan's model-only export of the last step is there, without a commit marker
    assert os.path.exists(os.path.join(ckpt, "step-4", ".metadata"))
    assert not os.path.exists(os.path.join(ckpt, "step-4", "tierckpt.committed"))
    _train(tmp, 6)
    recs = [json.loads(x) for x in open(os.path.join(ckpt, "tierckpt-ledger.jsonl"))]
    restores = [r for r in recs if r["kind"] == "restore"]
    assert len(restores) == 1 and restores[0]["step"] == 3, restores  # the last full state
    assert {v["source"] for v in restores[0]["sources"].values()} == {"own-local"}
