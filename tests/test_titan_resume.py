"""torchtitan resume semantics: a final model-only export is never a resume point."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _train(tmp, steps, *extra, check=True):
    from tests.harness import free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
           str(free_port()), "-m", "titan_plugin.train", "--toml", os.path.join(ROOT, "configs", "titan_demo.toml"),
           "--dump_folder", os.path.join(tmp, "run"), "--checkpoint.local_root", os.path.join(tmp, "nvme", "node-{node}"),
           "--training.steps", str(steps), "--checkpoint.local_interval", "3", "--checkpoint.interval", "3", *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=400, env=env)
    if check:
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    return r


def test_last_step_is_durable_and_a_model_only_export_is_never_a_resume_point(tmp_path):
    tmp = str(tmp_path)
    ckpt = os.path.join(tmp, "run", "checkpoint")
    # a bf16 model-only export needs its own step-N: the persistent tier must live elsewhere
    r = _train(tmp, 4, "--checkpoint.last_save_model_only", "true", "--checkpoint.export_dtype", "bfloat16",
               check=False)
    assert r.returncode != 0 and "error: checkpoint.persistent_folder" in r.stderr, r.stderr[-3000:]
    pfs = os.path.join(tmp, "pfs")
    _train(tmp, 4, "--checkpoint.last_save_model_only", "true", "--checkpoint.export_dtype", "bfloat16",
           "--checkpoint.persistent_folder", pfs)
    # torchtitan's model-only export of the last step is there, without a commit marker ...
    assert os.path.exists(os.path.join(ckpt, "step-4", ".metadata"))
    assert not os.path.exists(os.path.join(ckpt, "step-4", "tierckpt.committed"))
    # ... and the planned exit committed the full state of step 4 to the persistent tier
    assert os.path.exists(os.path.join(pfs, "step-4", "tierckpt.committed"))
    _train(tmp, 6, "--checkpoint.persistent_folder", pfs)
    recs = [json.loads(x) for x in open(os.path.join(pfs, "tierckpt-ledger.jsonl"))]
    restores = [r for r in recs if r["kind"] == "restore"]
    assert len(restores) == 1 and restores[0]["step"] == 4, restores
    assert {v["source"] for v in restores[0]["sources"].values()} == {"own-local"}


def test_fp32_model_only_export_is_the_committed_full_last_step(tmp_path):
    tmp = str(tmp_path)
    ckpt = os.path.join(tmp, "run", "checkpoint")
    _train(tmp, 4, "--checkpoint.last_save_model_only", "true")
    assert os.path.exists(os.path.join(ckpt, "step-4", "tierckpt.committed"))
    # the requeue lands on fresh nodes: only the persistent tier is left
    shutil.rmtree(os.path.join(tmp, "nvme"))
    _train(tmp, 6)
    recs = [json.loads(x) for x in open(os.path.join(ckpt, "tierckpt-ledger.jsonl"))]
    restores = [r for r in recs if r["kind"] == "restore"]
    assert len(restores) == 1 and restores[0]["step"] == 4, restores
    assert {v["source"] for v in restores[0]["sources"].values()} == {"persistent"}
    ends = [r for r in recs if r["kind"] == "run_end"]
    assert [e["durable_step"] for e in ends] == [4, 6] and all(e["clean"] for e in ends), ends
