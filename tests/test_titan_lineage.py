"""torchtitan: a new experiment (another --dump_folder) on the same node-local roots starts fresh.

Issue #14 input 3: same TOML, same working directory, ``--dump_folder outputs/expA`` then
``--dump_folder outputs/expB``; expB must not restore expA's node-local steps.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess

from titan_plugin.metrics import read_losses
from tierckpt.history import lineage
from tierckpt.io.layout import LINEAGE
from tierckpt.io.manifest import read_committed
from tierckpt.io.storage import Store

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _train(tmp, exp, steps):
    from tests.harness import titan_train_cmd

    cmd = [*titan_train_cmd(),
           "--dump_folder", os.path.join(tmp, exp), "--checkpoint.local_root", os.path.join(tmp, "nvme", "node-{node}"),
           "--training.steps", str(steps), "--checkpoint.busy_tier_policy", "wait", "--checkpoint.local_interval", "3", "--checkpoint.interval", "6",
           # a learning rate that does not depend on training.steps: a run extended from 4 to 6
           # steps then follows the same schedule as one planned for 6
           "--lr_scheduler.decay_ratio", "0"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=400,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    return r


def _ledger(tmp, exp):
    with open(os.path.join(tmp, exp, "checkpoint", "tierckpt-ledger.jsonl")) as f:
        return [json.loads(line) for line in f]


def _local_lineages(tmp) -> dict[str, str | None]:
    """{step directory relative to tmp/nvme: lineage recorded} of every committed node-local
    step and replica."""
    out = {}
    for d in glob.glob(os.path.join(tmp, "nvme", "node-*", "local", "step-*")) + \
            glob.glob(os.path.join(tmp, "nvme", "node-*", "replicas", "node-*", "step-*")):
        doc = read_committed(Store(os.path.dirname(d)), os.path.basename(d))
        if doc is not None:
            out[os.path.relpath(d, os.path.join(tmp, "nvme"))] = lineage.of_manifest(doc)
    return out


def test_new_dump_folder_is_a_new_experiment_on_shared_local_roots(tmp_path):
    tmp = str(tmp_path)
    _train(tmp, "expA", 6)
    lin_a = lineage.read(Store(os.path.join(tmp, "expA", "checkpoint")))
    a_local = _local_lineages(tmp)
    assert lin_a and set(a_local.values()) == {lin_a}, a_local
    assert "node-0/local/step-6" in a_local and "node-0/replicas/node-1/step-6" in a_local, a_local
    loss_a = read_losses(os.path.join(tmp, "expA", "metrics", "losses.jsonl"))

    # expB: another dump folder, the same node-local roots: a fresh start, not expA's model
    r = _train(tmp, "expB", 4)
    lin_b = lineage.read(Store(os.path.join(tmp, "expB", "checkpoint")))
    assert lin_b and lin_b != lin_a
    assert not [x for x in _ledger(tmp, "expB") if x["kind"] == "restore"]
    loss_b = read_losses(os.path.join(tmp, "expB", "metrics", "losses.jsonl"))
    assert sorted(loss_b) == [1, 2, 3, 4]
    assert loss_b[1] == loss_a[1], (loss_b, loss_a)  # the first step of a fresh model
    b_local = _local_lineages(tmp)
    # expA's steps are ignored (logged with expA's id), not deleted by the start that created
    # expB's lineage
    assert set(b_local.values()) == {lin_a, lin_b}, b_local
    assert "another lineage" in r.stdout + r.stderr and lin_a in r.stdout + r.stderr

    # a requeue of expB (same dump folder) resumes expB's own newest step, and continues as
    # the uninterrupted expA did (same config, same seed)
    r = _train(tmp, "expB", 6)
    assert set(_local_lineages(tmp).values()) == {lin_b}  # expA's steps purged on this start
    assert "other lineage" in r.stdout + r.stderr
    restores = [x for x in _ledger(tmp, "expB") if x["kind"] == "restore"]
    assert len(restores) == 1 and restores[0]["step"] == 4, restores
    assert {v["source"] for v in restores[0]["sources"].values()} == {"own-local"}, restores
    loss_b = read_losses(os.path.join(tmp, "expB", "metrics", "losses.jsonl"))
    assert [loss_b[s] for s in (5, 6)] == [loss_a[s] for s in (5, 6)], (loss_b, loss_a)
    assert os.path.exists(os.path.join(tmp, "expB", "checkpoint", LINEAGE))
