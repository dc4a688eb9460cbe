"""A persistent root that stops answering at the engine's start (its lineage file blocks on
read: a FIFO stands in for a hung shared file system) fails the start on every rank within
restore_read_timeout_s with a ConfigError naming persistent_root, instead of holding global
rank 0's constructor forever while the other ranks wait for it until collective_timeout_s."""

from __future__ import annotations

import os
import time

import pytest

from tests import scenarios
from tests.harness import run_world
from tierckpt.errors import ConfigError
from tierckpt.engine import TieredCheckpointer


def phase_start(rank, world, base):
    t0 = time.monotonic()
    try:
        TieredCheckpointer(scenarios.make_config(base, restore_read_timeout_s=3.0, collective_timeout_s=300.0),
                           node_id=rank)
    except ConfigError as e:
        return {"option": e.option, "msg": str(e), "s": time.monotonic() - t0}
    return {"option": None, "msg": "started", "s": time.monotonic() - t0}


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs a FIFO to stand in for a hung read (POSIX)")
def test_hung_persistent_root_fails_the_start_on_every_rank_within_the_bound(tmp_path):
    os.makedirs(tmp_path / "pfs")
    os.mkfifo(tmp_path / "pfs" / "tierckpt-lineage.json")
    for r in run_world(phase_start, 2, str(tmp_path), timeout=240):
        v = r.value
        assert v["option"] == "persistent_root", v
        assert "does not answer" in v["msg"] or "failed on another rank" in v["msg"], v
        assert v["s"] < 120, v  # the bound (3 s) plus the start's agreement, not collective_timeout_s
