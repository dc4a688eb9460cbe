"""titan_plugin/elastic.py: the overrides that fit a torchtitan run to fewer nodes (what the
launchers append when a node is lost for good and TIERCKPT_MIN_NODES lets the job go on)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tierckpt import ConfigError
from titan_plugin.elastic import clamp_replication, fit_parallelism, overrides

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("jump,factor,nodes,expected", [
    (1, 2, 4, (1, 2)),   # fits: unchanged
    (1, 3, 3, (1, 3)),
    (1, 3, 2, (1, 2)),   # F > nodes
    (1, 2, 3, (1, 1)),   # 3 is odd: no clique of 2 tiles it
    (2, 2, 6, (1, 2)),   # J*F = 4 does not divide 6: keep F = 2, lower J
    (4, 2, 4, (2, 2)),   # 8 nodes in racks of 4 lost half: J = 2 still leaves the pair
    (3, 3, 6, (2, 3)),   # copies first: F = 3 kept with J = 2 (J*F = 6)
])
def test_clamp_replication(jump, factor, nodes, expected):
    j, f, warn = clamp_replication(jump, factor, nodes)
    assert (j, f) == expected
    assert nodes % (j * f) == 0 and f <= nodes
    if (jump, factor) == expected:
        assert warn is None
    else:
        assert f"using J={j}, F={f}" in warn and f"do not fit {nodes} nodes" in warn
    with pytest.raises(ValueError, match="replication_factor must be >= 1"):
        clamp_replication(1, 0, 2)


def _par(shard=-1, rep=1, cp=1, tp=1, pp=1):
    return SimpleNamespace(data_parallel_shard_degree=shard, data_parallel_replicate_degree=rep,
                           context_parallel_degree=cp, tensor_parallel_degree=tp, pipeline_parallel_degree=pp)


def test_fit_parallelism():
    assert fit_parallelism(_par(), 6) is None          # -1: every rank left over
    assert fit_parallelism(_par(shard=8), 6) == 6      # explicit: follows the world
    assert fit_parallelism(_par(shard=4, tp=2), 4) == 2
    assert fit_parallelism(_par(shard=2, tp=2), 4) is None  # already right
    with pytest.raises(ConfigError) as e:
        fit_parallelism(_par(shard=4, tp=4), 6)
    assert e.value.option == "parallelism" and "tensor_parallel_degree=4" in str(e.value) and "6 ranks" in str(e.value)


def test_overrides_for_three_to_two_nodes():
    cfg = SimpleNamespace(parallelism=_par(shard=6), checkpoint=SimpleNamespace(
        enable=True, local_interval=5, replication_jump=1, replication_factor=3, simulated_ranks_per_node=0))
    args, warnings = overrides(cfg, nodes=2, nproc_per_node=2)
    assert args == ["--parallelism.data_parallel_shard_degree", "4",
                    "--checkpoint.replication_jump", "1", "--checkpoint.replication_factor", "2"]
    assert len(warnings) == 2
    # simulated nodes: the engine counts ranks / simulated_ranks_per_node nodes (here 4)
    cfg.checkpoint.simulated_ranks_per_node = 1
    assert overrides(cfg, nodes=2, nproc_per_node=2)[0][2:] == [
        "--checkpoint.replication_jump", "1", "--checkpoint.replication_factor", "2"]
    cfg.checkpoint.local_interval = 0  # no local tier: replication settings are not used
    assert overrides(cfg, nodes=2, nproc_per_node=2)[0] == ["--parallelism.data_parallel_shard_degree", "4"]


def test_cli_on_the_demo_config():
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "titan_plugin.elastic", "--nodes", "2", "--nproc-per-node", "1", "--",
           "--toml", str(REPO / "configs" / "titan_demo.toml"), "--checkpoint.replication_factor", "3"]
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout.strip().splitlines()[-1])
    # the demo config keeps data_parallel_shard_degree = -1: only the replication changes
    assert doc["args"] == ["--checkpoint.replication_jump", "1", "--checkpoint.replication_factor", "2"]
    r = subprocess.run(cmd[:-2] + ["--parallelism.tensor_parallel_degree", "3"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "parallelism: " in r.stderr and "does not divide the 2 ranks left" in r.stderr
